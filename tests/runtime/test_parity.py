"""Multi-process parity: a parallelized model gives the unsharded model's numbers (gloo, CPU)."""
from __future__ import annotations

import pytest

from ranks import Launches
from parity_workers import (checkpoint_round_trip, dropout_streams, large_logits_cross_entropy, other_calls,
                            preloaded, replicated_block, training_parity)

# model -> (b, s, h, layers)
MODELS = {"nanogpt": (4, 32, 64, 2), "gpt2": (4, 16, 64, 2), "gpt2_50257": (4, 16, 64, 2), "llama": (4, 16, 64, 2),
          "llama_deep": (4, 16, 64, 5), "llama_deep_cache": (4, 16, 64, 5)}
# (model, world) pairs run; the KV-cache variant of llama_deep only at world 2
PARITY = [(m, w) for m in MODELS for w in (1, 2, 4) if m != "llama_deep_cache" or w == 2]
TOYS = ["interleaved", "fused_gqa", "fused_mqa", "handwritten"]
LOSSES = ["nll_sum", "smoothing_none", "ignore_mean"]
ROUND_TRIPS = {"nanogpt": 2, "gpt2_50257": 4, "llama": 4}
# in the extended run only (tests/conftest.py): models at tp 4 whose plan does not change from tp 2 but for
# sizes (Llama's kv heads and the 50257 vocab's padding do), those at tp 1 that stay untouched as nanoGPT
# does, and one of each pair of spellings below; the default run keeps one model per kind of plan (nanoGPT at
# tp 2, a padded 50257 vocabulary at tp 2, Llama's kv heads replicated at tp 4, a deep Llama with its cache)
EXTENDED = {("nanogpt", 4), ("gpt2", 4), ("llama_deep", 4), ("gpt2", 1), ("gpt2_50257", 1), ("llama_deep", 1),
            ("llama", 1), ("handwritten", 4), ("nll_sum", 4), ("smoothing_none", 4), ("nanogpt", 1), ("gpt2", 2),
            ("llama", 2), ("llama_deep", 2), ("gpt2_50257", 4), ("interleaved", 4), ("fused_mqa", 4)}


def _marked(model: str, world: int):
    return pytest.param(model, world, marks=pytest.mark.extended) if (model, world) in EXTENDED else (model, world)


def _at_tp4(name: str):
    return pytest.param(name, marks=pytest.mark.extended) if (name, 4) in EXTENDED else name


# every job of this file, by the world it runs at: one launch per world (a launch costs seconds of process
# start and imports per rank; each job builds, parallelizes and trains its own model in it)
JOBS: dict[int, dict[str, tuple]] = {world: {f"training {m}": (training_parity, m) for m, w in PARITY
                                             if w == world and (m, w) not in EXTENDED} for world in (1, 2, 4)}
JOBS[4].update({f"training {name}": (training_parity, name) for name in TOYS + LOSSES if (name, 4) not in EXTENDED})
REST: dict[int, dict[str, tuple]] = {}
for _name, _world in EXTENDED:
    REST.setdefault(_world, {})[f"training {_name}"] = (training_parity, _name)
JOBS[2].update({"preloaded": (preloaded,), "large logits": (large_logits_cross_entropy,),
                "other calls": (other_calls,),
                "dropout": (dropout_streams,), "replicated block": (replicated_block,)})
for _model, _world in ROUND_TRIPS.items():  # Llama's at tp 4 by default, the others in the extended run
    (JOBS if _model == "llama" else REST).setdefault(_world, {})[f"round trip {_model}"] = \
        (checkpoint_round_trip, _model)


@pytest.fixture(scope="module")
def runs() -> Launches:
    return Launches(JOBS, extended=REST, reuse_captures=True)


@pytest.mark.slow
def test_ranks_start_with_autotp_imported(runs):
    """The fork server the ranks come from imported autotp's analysis and passes (and the helpers), so a
    rank does not pay those imports again: Python 3.11's fork server ignores the sys.path it is given, and
    skips a preload it cannot find without a word."""
    for rank, r in runs(2, "preloaded").items():
        assert r == {"preload": True, "passes": True, "analysis": True}, (rank, r)


@pytest.mark.slow
@pytest.mark.parametrize("model,world", [_marked(m, w) for m, w in PARITY])
def test_training_parity(runs, model: str, world: int):
    results = runs(world, f"training {model}")
    b, s, h, layers = MODELS[model]
    bsh = b * s * h
    for rank, r in results.items():
        assert r["tp"] == world
        assert r["names_match"], "parameters keep their original names and order"
        assert r["loss_diff"] <= 1e-5, (rank, r["loss_diff"])
        assert r["logits_diff"] <= 1e-5, (rank, r["logits_diff"])
        assert r["grad_diff"] <= 1e-5, (rank, r["grad_diff"])
        assert r["param_diff"] <= 1e-4, (rank, r["param_diff"])
        fwd, bwd = r["forward_collectives"], r["backward_collectives"]
        if world == 1:
            assert fwd == [] and bwd == []
            assert r["plan"]["params"] == {}
            continue
        # Megatron: forward, the vocab-parallel embedding's all-reduce, per layer one after attention and one
        # after the MLP (b·s·h each), then the cross-entropy's max, target-logit and exp-sum reductions (b·s).
        # Backward: per layer one entering attention and one entering the MLP, and one entering the LM head.
        assert fwd == [("all_reduce", "sum", bsh)] * (2 * layers + 1) + \
            [("all_reduce", "max", b * s), ("all_reduce", "sum", b * s), ("all_reduce", "sum", b * s)]
        activations = [c for c in bwd if c[2] == bsh]
        assert activations == [("all_reduce", "sum", bsh)] * (2 * layers + 1)
        assert all(c[2] < bsh for c in bwd if c[2] != bsh)  # nothing of b·s·V
        params = r["plan"]["params"]
        assert len(r["plan"]["pairs"]) == 2 * layers
        vocab = r["plan"]["vocab"]
        assert len(vocab["embeddings"]) == 1 and len(vocab["heads"]) == 1 and len(vocab["losses"]) == 1
        assert not r["plan"]["replicated"], r["plan"]["replicated"]
        # the completeness check: every 2-D weight is cut, or listed with its reason (GPT-2's position
        # embedding, whole as in Megatron)
        assert r["unexplained"] == [], r["unexplained"]
        assert all("position embedding" in why for why in r["whole"].values()), r["whole"]
        replicated_kv = {n for n, p in params.items() if any(s["parts"] < world for s in p["segments"])}
        # kv heads fewer than tp are replicated on tp / n_kv ranks; only their weight gradients are summed
        assert sorted(c[2] for c in bwd if c[2] != bsh) == sorted(r["local_numel"][n] for n in replicated_kv)
        for name, p in params.items():
            expected = sum(s["size"] // s["parts"] for s in p["segments"])
            assert r["local_numel"][name] * p["full_shape"][p["dim"]] == r["full_numel"][name] * expected
            if p["role"] == "vocab":  # padded V / tp rows
                v = p["vocab"]
                assert p["local_shape"][p["dim"]] == v["local"] == -(-v["size"] // world)
            elif name not in replicated_kv:
                assert r["local_numel"][name] * world == r["full_numel"][name], name
        if model.startswith("llama") and world == 4:
            assert len(replicated_kv) == 2 * layers  # k_proj and v_proj: 2 kv heads over 4 ranks
        else:
            assert not replicated_kv


@pytest.mark.slow
@pytest.mark.parametrize("toy", [_at_tp4(t) for t in TOYS])
def test_unseen_layouts_parity(runs, toy: str):
    results = runs(4, f"training {toy}")
    for r in results.values():
        assert r["plan"]["pairs"], "the block was sharded"
        assert r["loss_diff"] <= 1e-5 and r["logits_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5
        assert r["param_diff"] <= 1e-4
        assert len(r["forward_collectives"]) == 1 + 1 + 3  # embedding, block, cross-entropy


@pytest.mark.slow
@pytest.mark.parametrize("loss", [_at_tp4(t) for t in LOSSES])
def test_cross_entropy_forms_parity(runs, loss: str):
    # vocab 97 at tp 4: 25 rows per rank, the last rank owns 22 and holds 3 padding rows
    results = runs(4, f"training {loss}")
    for r in results.values():
        assert len(r["plan"]["vocab"]["losses"]) == 1
        assert r["loss_diff"] <= 1e-5 and r["logits_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5
        assert r["param_diff"] <= 1e-4
        ce = [c for c in r["forward_collectives"] if c[2] == 2 * 12]
        assert [c[1] for c in ce] == ["max", "sum", "sum"]


@pytest.mark.slow
def test_cross_entropy_of_large_logits(runs):
    # the loss is taken from logits shifted by the row max, as log_softmax takes it: logits near 1e4 lose
    # nothing (unshifted, 1e4's rounding, ~5e-4, would show)
    for r in runs(2, "large logits").values():
        for smoothing, (loss_diff, grad_diff) in r.items():
            assert loss_diff <= 1e-5 and grad_diff <= 1e-5, (smoothing, loss_diff, grad_diff)


@pytest.mark.slow
def test_other_signatures_share_parameters(runs):
    results = runs(2, "other calls")
    for r in results.values():
        assert r["no_targets"] <= 1e-5
        assert r["other_shape"] <= 1e-5
        assert r["batch_one"] <= 1e-5
        assert r["eval_mode"][0] is False and r["eval_mode"][1] <= 1e-5
        assert r["graphs"] >= 4  # (idx, targets) train, (idx,) train, batch one, eval
        assert r["shared_params"]
        assert r["retained_graph"] <= 1e-5


@pytest.mark.slow
def test_dropout_streams(runs):
    results = runs(2, "dropout")
    for r in results.values():
        assert r["random_region_ops"] == 2  # attention dropout of the 2 layers
        assert r["replicated_checked"] == 2 * 2 + 1 and r["replicated_identical"]
        assert r["default_stream_identical"]
        assert r["region_masks_differ"]
        assert 0.05 < r["dropped_fraction"] < 0.15


@pytest.mark.slow
@pytest.mark.parametrize("model,world", [(m, w) if m == "llama" else pytest.param(m, w, marks=pytest.mark.extended)
                                         for m, w in ROUND_TRIPS.items()])
def test_full_state_dict_round_trip(runs, model: str, world: int):
    for r in runs(world, f"round trip {model}").values():
        assert r["keys_match"] and r["shapes_match"], "original names, un-padded shapes"
        assert r["missing"] == [] and r["unexpected"] == []
        assert r["unsharded_loss_diff"] <= 1e-5 and r["unsharded_logits_diff"] <= 1e-5
        assert r["fresh_differed_before"] > 1e-3
        assert r["reloaded_loss_diff"] == 0.0 and r["reloaded_logits_diff"] == 0.0


@pytest.mark.slow
def test_unshardable_block_is_replicated_with_a_warning(runs):
    for r in runs(2, "replicated block").values():
        assert not r["block_sharded"]
        assert any("block left replicated" in w and "not sharded on its contracted dim" in w for w in r["warnings"]), r["warnings"]
        assert r["loss_diff"] <= 1e-5
