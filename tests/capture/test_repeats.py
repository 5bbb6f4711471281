"""Capturing a few blocks and copying them (autotp.capture.repeats): the copied graph computes what the whole
export computes, blocks that differ get their own kind, and anything it cannot prove safe is exported whole."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autotp.capture.meta_run as meta_run
import autotp.capture.repeats as repeats
from autotp.capture.tracer import capture
from autotp.plan.planner import make_plan

H, V = 32, 64


class Block(nn.Module):
    """Pre-norm attention + MLP; ``window`` restricts attention to the last positions (local attention),
    ``experts`` > 0 replaces the MLP with a small mixture."""

    def __init__(self, window: int | None = None, idx: int = 0, last: bool = False, wide: bool = False):
        super().__init__()
        self.window, self.idx, self.last = window, idx, last
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.qkv, self.proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
        inner = 8 * H if wide else 4 * H
        self.fc, self.out = nn.Linear(H, inner), nn.Linear(inner, H)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, 4, H // 4).permute(2, 0, 3, 1, 4)  # (3, b, heads, s, d)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(H // 4)
        if self.window is not None:  # local attention: only the last `window` positions
            mask = mask & ~torch.ones(s, s, dtype=torch.bool, device=x.device).tril(-self.window)
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, H))
        y = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return y * 0.5 if self.last else y


class GPT(nn.Module):
    def __init__(self, blocks: list[nn.Module], style: str = "loop"):
        super().__init__()
        self.style = style
        self.wte, self.wpe = nn.Embedding(V, H), nn.Embedding(16, H)
        self.h = nn.ModuleList(blocks)
        self.ln_f, self.head = nn.LayerNorm(H), nn.Linear(H, V, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        s = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(s, device=idx.device))
        mask = torch.ones(s, s, dtype=torch.bool, device=idx.device).tril()
        if self.style == "loop":
            for block in self.h:
                x = block(x, mask)
        elif self.style == "slice":  # Hugging Face's `self.layers[: config.num_hidden_layers]`
            for block in self.h[: len(self.h)]:
                x = block(x, mask)
        elif self.style == "index":  # a fixed count: cutting the list breaks it
            for i in range(6):
                x = self.h[i](x, mask)
        elif self.style == "between":  # code between the blocks
            for block in self.h:
                x = block(x, mask) * 1.0001
        elif self.style == "depth":  # code after the blocks that reads how many there are
            for block in self.h:
                x = block(x, mask)
            x = x / len(self.h)
        return self.head(self.ln_f(x))


def _capture(model: nn.Module, idx: torch.Tensor, copy: bool):
    saved = repeats.MIN_BLOCKS
    repeats.MIN_BLOCKS = saved if copy else 10**9
    try:
        return capture(model, (idx,), {})[0]
    finally:
        repeats.MIN_BLOCKS = saved


def _found(model: nn.Module, idx: torch.Tensor):
    return repeats.find_repeats(model, lambda: model(idx.to("meta")))


def _same(model: nn.Module, idx: torch.Tensor) -> None:
    """The copied graph against the whole export: same ops in the same module order, same parameters, same
    numbers on real weights, same plan."""
    gm, whole = _capture(model, idx, True), _capture(model, idx, False)
    ref = model(idx)
    torch.testing.assert_close(gm(idx)[0], ref, rtol=0, atol=0)

    def walk(g):
        return [(str(n.target), list((n.meta.get("nn_module_stack") or {"": ("", "")}).values())[-1][0])
                for n in g.graph.nodes if n.op == "call_function"]

    assert walk(gm) == walk(whole)
    assert sorted(n for n, _ in gm.named_parameters()) == sorted(n for n, _ in whole.named_parameters())
    a, b = make_plan(gm, 2), make_plan(whole, 2)
    assert a.params == b.params and len(a.pairs) == len(b.pairs) and len(a.collectives) == len(b.collectives)
    assert [u.module for u in a.units] == [u.module for u in b.units]


IDX = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("style", ["loop", "slice"])
def test_identical_blocks_export_two_and_copy_the_rest(style):
    torch.manual_seed(0)
    model = GPT([Block() for _ in range(6)], style)
    rep = _found(model, IDX)
    assert rep is not None and rep.container == "h" and rep.keep == 2 and set(rep.kinds) == {0}
    _same(model, IDX)


def test_sequential_blocks():
    torch.manual_seed(0)

    class Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, H)
            self.blocks = nn.Sequential(*[nn.Sequential(nn.LayerNorm(H), nn.Linear(H, 4 * H), nn.GELU(),
                                                        nn.Linear(4 * H, H)) for _ in range(5)])
            self.head = nn.Linear(H, V)

        def forward(self, idx):
            return self.head(self.blocks(self.emb(idx)))

    model = Seq()
    assert _found(model, IDX).keep == 2
    _same(model, IDX)


def test_a_different_first_block_is_a_kind_of_its_own():
    torch.manual_seed(0)
    model = GPT([Block(wide=True)] + [Block() for _ in range(5)])  # a dense first block, then the rest
    rep = _found(model, IDX)
    assert rep.kinds == (0, 1, 1, 1, 1, 1) and rep.keep == 2
    _same(model, IDX)


def test_alternating_blocks_with_the_same_weights_are_told_apart_by_what_they_run():
    torch.manual_seed(0)
    model = GPT([Block(window=4 if i % 2 == 0 else None, idx=i) for i in range(7)])  # local, global, ...
    rep = _found(model, IDX)
    assert rep.kinds == (0, 1, 0, 1, 0, 1, 0) and rep.keep == 3 and rep.template == (2, 1)
    _same(model, IDX)


def test_a_different_last_block_is_exported_whole():
    torch.manual_seed(0)
    model = GPT([Block(idx=i, last=i == 5) for i in range(6)])
    assert _found(model, IDX) is None  # its kind is first seen last: nothing to copy it from
    _same(model, IDX)


@pytest.mark.parametrize("style", ["index", "between", "depth"])
def test_what_it_cannot_prove_is_exported_whole(style):
    torch.manual_seed(0)
    model = GPT([Block() for _ in range(6)], style)
    assert _found(model, IDX) is None
    gm = _capture(model, IDX, True)
    torch.testing.assert_close(gm(IDX)[0], model(IDX), rtol=0, atol=0)


def test_capture_exports_the_same_blocks_whatever_the_depth(monkeypatch):
    """The export runs on a fixed number of blocks whatever the depth: a 24-block model is exported once, with
    as many blocks as a 6-block one, and the graph still holds every block's parameters (counted, not timed:
    speed is the benchmarks' to measure)."""
    import autotp.capture.tracer as tracer

    exported: list[int] = []
    export_on = tracer._export_on

    def counting(model, *a, **k):
        exported.append(len(model.h))  # blocks present while torch.export traces
        return export_on(model, *a, **k)

    monkeypatch.setattr(tracer, "_export_on", counting)

    def blocks_exported(n: int) -> list[int]:
        exported.clear()
        torch.manual_seed(0)
        with torch.device("meta"):
            model = GPT([Block() for _ in range(n)])
        gm = capture(model, (IDX,), {})[0]
        assert sum(1 for p in gm.named_parameters() if p[0].startswith("h.")) == 12 * n
        assert len(model.h) == n  # the cut is undone
        return list(exported)

    six, deep = blocks_exported(6), blocks_exported(24)
    assert len(deep) == 1 and deep == six and deep[0] < 6, (six, deep)


def test_stand_ins_for_every_block_are_read_for_the_copies():
    """parallelize captures a sharded or meta-built model with full-size stand-ins (``params=``): the export
    sees the kept blocks' stand-ins, and the copies read their own blocks' stand-ins."""
    from autotp.capture.tracer import stand_ins

    torch.manual_seed(0)
    model = GPT([Block() for _ in range(5)])
    swap = stand_ins(dict(model.named_parameters(remove_duplicate=False)), torch.device("meta"))
    gm = capture(model, (IDX,), {}, params=swap, device=torch.device("cpu"))[0]
    got = dict(gm.named_parameters(remove_duplicate=False))
    assert set(got) == set(swap)
    assert all(got[n] is swap[n] for n in swap if n.startswith("h.") and int(n.split(".")[1]) >= 2)


def test_a_sharded_model_is_recognised_through_its_stand_ins():
    """A later call signature of a parallelized model: its blocks hold shards (here half of q|k|v's rows), which
    the forward cannot run with; the meta runs, like the export, take the full-size stand-ins, and of the cut
    model only those of the blocks kept."""
    from autotp.capture.tracer import stand_ins

    torch.manual_seed(0)
    model = GPT([Block() for _ in range(6)])
    full = {}
    for i, block in enumerate(model.h):
        for name, dim in (("qkv.weight", 0), ("qkv.bias", 0), ("proj.weight", 1)):
            mod, leaf = name.split(".")
            p = getattr(block, mod)._parameters[leaf]
            full[f"h.{i}.{name}"] = p
            getattr(block, mod)._parameters[leaf] = nn.Parameter(p.detach().narrow(dim, 0, p.shape[dim] // 2).clone())
    assert _found(model, IDX) is None  # on its shards the forward fails: the whole model would be exported
    swap = stand_ins(full, torch.device("cpu"))  # as parallelize makes them for a model on the CPU
    rep = repeats.find_repeats(model, lambda: model(IDX.to("meta")), swap)
    assert rep is not None and rep.keep == 2 and rep.kinds == (0,) * 6
    gm = capture(model, (IDX,), {}, params=swap, device=torch.device("cpu"))[0]
    assert sum(n.op == "placeholder" for n in gm.graph.nodes) == 1
    assert {n for n, _ in gm.named_parameters()} >= set(full)


def _copied_and_whole(model: nn.Module, args: tuple, kwargs: dict):
    """(copied capture, whole capture), each (graph, output spec), and whether the copy was taken."""
    taken = []
    expand = repeats.expand

    def spy(*a, **k):
        taken.append(expand(*a, **k))
        return taken[-1]

    repeats_saved = repeats.MIN_BLOCKS
    repeats.expand = spy
    try:
        copied = capture(model, args, kwargs)
        repeats.MIN_BLOCKS = 10**9
        whole = capture(model, args, kwargs)
    finally:
        repeats.expand = expand
        repeats.MIN_BLOCKS = repeats_saved
    return copied, whole, bool(taken) and taken[0] is not None


def test_blocks_that_also_return_a_kv_cache_are_copied_with_their_outputs():
    """Hugging Face's default forward (use_cache on) returns each layer's key and value besides the logits:
    the copies return theirs, in the whole model's output structure."""
    from autotp.capture.structure import flatten, unflatten
    from small_models import llama

    model, _, kwargs = llama(layers=5)
    ids = kwargs["input_ids"]
    (gm, spec), (_, whole_spec), taken = _copied_and_whole(model, (), {"input_ids": ids})
    assert taken and spec == whole_spec
    ref = model(input_ids=ids)
    got = unflatten(list(gm(*flatten(((), {"input_ids": ids}))[0])), spec)
    torch.testing.assert_close(got.logits, ref.logits, rtol=0, atol=0)
    assert len(got.past_key_values.layers) == len(ref.past_key_values.layers) == 5
    for a, b in zip(got.past_key_values.layers, ref.past_key_values.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=0)
        torch.testing.assert_close(a.values, b.values, rtol=0, atol=0)


def test_every_block_output_returned_keeps_its_place():
    """A model that returns every block's hidden state (``output_hidden_states``) returns all of them."""

    class AllStates(GPT):
        def forward(self, idx):
            s = idx.shape[1]
            x = self.wte(idx) + self.wpe(torch.arange(s, device=idx.device))
            mask = torch.ones(s, s, dtype=torch.bool, device=idx.device).tril()
            states = [x]
            for block in self.h:
                x = block(x, mask)
                states.append(x)
            return self.head(self.ln_f(x)), tuple(states)

    torch.manual_seed(0)
    model = AllStates([Block() for _ in range(5)])
    (gm, spec), (_, whole_spec), taken = _copied_and_whole(model, (IDX,), {})
    assert taken and spec == whole_spec
    from autotp.capture.structure import unflatten

    logits, states = unflatten(list(gm(IDX)), spec)
    ref_logits, ref_states = model(IDX)
    assert len(states) == len(ref_states) == 6
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    for a, b in zip(states, ref_states):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_check_on_values_skipped_while_tracing_runs_on_fake_tensors():
    """Hugging Face's mask code reads position ids into Python unless it sees a fake tensor (export's view):
    the meta run fails there, the fake-tensor run does not, and the blocks are copied."""
    from autotp.capture.structure import flatten, unflatten
    from small_models import llama_deep

    model, args, kwargs = llama_deep()  # labels, use_cache off: no cache, so the mask code checks the ids
    on_meta = {k: v.to("meta") if torch.is_tensor(v) else v for k, v in kwargs.items()}
    assert meta_run.run_once(model, model.model.layers, lambda: model(**on_meta), "model.layers", fake=False) is None
    (gm, spec), (_, whole_spec), taken = _copied_and_whole(model, args, kwargs)
    assert taken and spec == whole_spec
    got, ref = unflatten(list(gm(*flatten((args, kwargs))[0])), spec), model(*args, **kwargs)
    torch.testing.assert_close(got.logits, ref.logits, rtol=0, atol=0)
    torch.testing.assert_close(got.loss, ref.loss, rtol=0, atol=0)


def _hf(family: str):
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=4,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=64, n_embd=H, n_layer=5, n_head=4,
                                      attn_implementation="eager", bos_token_id=0, eos_token_id=0))


@pytest.mark.parametrize("family,extra,copied", [
    ("gpt2", {}, True),  # a KV cache: two tensors per block
    pytest.param("qwen2", {}, True, marks=pytest.mark.extended),
    # the hidden states are each block's input (the last block's output is returned only after the final
    # norm) and the attention weights its own: the last kept block returns less than the middle ones, so no
    # copy is proven to return what the whole model returns
    pytest.param("gpt2", {"output_hidden_states": True, "output_attentions": True, "use_cache": False}, False,
                 marks=pytest.mark.extended),
])
def test_hugging_face_outputs_per_block(family, extra, copied):
    from autotp.capture.structure import flatten, unflatten

    model = _hf(family).eval()
    ids = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(1))
    kwargs = {"input_ids": ids, "labels": ids, **extra}
    (gm, spec), (_, whole_spec), taken = _copied_and_whole(model, (), kwargs)
    assert taken == copied and spec == whole_spec
    got = flatten(unflatten(list(gm(*flatten(((), kwargs))[0])), spec))[0]
    ref = flatten(model(**kwargs))[0]
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))
