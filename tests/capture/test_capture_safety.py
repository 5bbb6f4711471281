"""Capture never changes the user's model (tests/support/stateful_models.py: buffers registered or grown on first use,
shared rotary and ALiBi modules, a tied head holding the embedding module, plain tensor attributes beside a
Python-side cache), a failed parallelize puts the model back exactly, and a capture error names the user's
own line wherever the model's file lives."""
from __future__ import annotations

import importlib.util
import sys
import sysconfig
import textwrap
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import autotp
from autotp.capture.repeats import find_repeats, record_whole
from autotp.capture.tracer import capture, input_guard, meta_call
from autotp.errors import CaptureError
from autotp.plan.cache import plan_key
from autotp.state import find_tp_state
from ranks import Launches
from stateful_models import STYLES, build, diff, snapshot
from stateful_workers import DOCUMENTED, stateful_parity
from tiers import core_first


@pytest.fixture
def fake_tp2():
    """A process group of two ranks in this process (torch's fake backend: collectives do nothing), so
    parallelize plans and shards as rank 0 of tp 2 would, with no process started."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("style", STYLES)
def test_capture_and_meta_runs_leave_the_model_untouched(style: str):
    model, (x, y) = build(style)
    want = model(x, y)[1]
    model, (x, y) = build(style)
    before = snapshot(model)
    forward = type(model).forward.__get__(model)
    run = meta_call(forward, (x, y), {})
    rec = record_whole(model, run)
    assert rec is not None, "the meta run of the forward failed"
    assert diff(before, snapshot(model)) == []
    # the meta runs find the repeated blocks: capture exports 2 of the 3 and copies the third
    rep = find_repeats(model, run, recorded=rec)
    assert rep is not None and rep.keep == 2, rep
    assert plan_key(model, run, {"tp": 2}, rec) is not None
    gm, _ = capture(model, (x, y), {})
    assert diff(before, snapshot(model)) == []
    assert torch.equal(gm(x, y)[1], want)  # the captured graph computes what the model computes


@pytest.mark.parametrize("style", STYLES)
def test_parallelize_changes_only_what_it_documents(style: str, fake_tp2):
    model, (x, _) = build(style)
    before = snapshot(model)
    cls = type(model)
    autotp.parallelize(model, example_inputs=(x,))
    assert diff(before, snapshot(model), skip=DOCUMENTED) == []
    assert isinstance(model, cls) and type(model) is not cls
    full = dict(build(style)[0].named_parameters(remove_duplicate=False))
    local = dict(model.named_parameters(remove_duplicate=False))
    assert list(local) == list(full)
    assert local["layers.0.attn.wq.weight"].shape == (32, 64)  # the attention is sharded, by whole heads
    if style.startswith("tied"):
        head = "output.tied_module.weight" if style == "tied_module" else "output.emb.weight"
        assert local[head] is local["tok_embeddings.weight"]


def _fail_after(monkeypatch, target: str, name: str) -> None:
    """Make ``target.name`` raise after it has run (its changes made)."""
    module = importlib.import_module(target)
    real = getattr(module, name)

    def failing(*args, **kwargs):
        real(*args, **kwargs)
        raise CaptureError(f"injected failure after {name}")

    monkeypatch.setattr(module, name, failing)


# each style fails after its export and after the whole apply; mid-apply (its shards held: a part of what a
# failed apply puts back) the tied head by default, the other styles in the extended run
_FAILS = [(style, where) for where in [("autotp.capture.tracer", "_export"), ("autotp.parallel.apply", "hold"),
                                       ("autotp.parallel.parallelize", "apply")]
          for style in ["lazy_mask", "plain_cache", "shared_rotary", "tied_module"]]


@pytest.mark.parametrize("style,where", core_first(_FAILS, [c for c in _FAILS if c[1][1] != "hold"
                                                           or c[0] == "tied_module"],
                                                   ids=lambda c: f"{c[0]}-{c[1][1]}"))
def test_failed_parallelize_leaves_the_model_exactly_as_it_was(style: str, where: tuple[str, str], fake_tp2,
                                                               monkeypatch):
    model, (x, y) = build(style)
    before = snapshot(model)
    cls = type(model)
    _fail_after(monkeypatch, *where)
    with pytest.raises(CaptureError, match="injected"):
        autotp.parallelize(model, example_inputs=(x, y))
    assert diff(before, snapshot(model)) == []  # parameters included: the originals, unsharded
    assert type(model) is cls and find_tp_state(model) is None
    monkeypatch.undo()
    ref = build(style)[0]
    assert torch.equal(model(x, y)[1], ref(x, y)[1])  # and it still runs, as on one device


def test_models_with_caches_keep_them(fake_tp2):
    """The test models that keep a cache on the model (a KV cache buffer written in forward, running
    statistics, Hugging Face's rotary and mask code): parallelize changes their parameters only, and the KV
    cache buffers it shards (kept under their names)."""
    import cache_models
    import capture_models
    from parity_workers import _hf

    kv = cache_models.build("index_copy")
    models = [(kv, (torch.randint(0, 64, (2, 5)), torch.arange(5)), {}, ("_buffers",)),
              (capture_models.build("buffer_write")[0], capture_models.build("buffer_write")[1], {}, ()),
              (_hf("llama")[0], (), {"input_ids": torch.randint(1, 128, (2, 6)), "use_cache": True}, ())]
    for model, args, kwargs, sharded in models:
        before = snapshot(model)
        buffers = [n for n, _ in model.named_buffers()]
        autotp.parallelize(model, example_inputs=(args, kwargs))
        assert diff(before, snapshot(model), skip=DOCUMENTED + sharded) == [], type(model).__name__
        assert [n for n, _ in model.named_buffers()] == buffers


def test_a_view_input_leaves_no_guard_on_its_base():
    """nanoGPT's ``generate`` calls ``self(idx_cond)`` with a view first (``idx[:, -block_size:]``), then with
    ``torch.cat``'s result: the graph of the first call must take the second, and a guard that cannot
    answer a call (it reads something the call lacks) means "not mine", never an error."""
    from nanogpt import GPT, GPTConfig

    model = GPT(GPTConfig(block_size=64, vocab_size=97, n_layer=2, n_head=4, n_embd=64, dropout=0.0, bias=True))
    idx = torch.randint(0, 97, (2, 16))
    gm, _ = capture(model, (idx[:, :4],), {})
    accepts = input_guard(gm)
    assert accepts([torch.randint(0, 97, (2, 5))]) and accepts([idx[:, 2:9]])
    assert not accepts([torch.randint(0, 97, (2, 65))])  # past block_size: the model's own assert
    assert not accepts([])  # a call of another structure reaches no graph's guards, and raises nothing here


# -- the user's line in a capture error -----------------------------------------------------------------
_FAILING = textwrap.dedent("""
    import torch

    class DataDependent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            if self.lin(x).sum() > 0:  # the user's line
                return x
            return -x
""")


def _import_file(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_error_names_a_model_file_in_a_folder_named_autotp(tmp_path: Path):
    path = tmp_path / "autotp" / "models" / "user_model.py"
    path.parent.mkdir(parents=True)
    path.write_text(_FAILING)
    model = _import_file(path, "user_model_in_autotp_folder").DataDependent()
    with pytest.raises(CaptureError) as e:
        capture(model, (torch.randn(2, 8),), {})
    assert f"at {path}:" in str(e.value) and "if self.lin(x).sum() > 0" in str(e.value)


def test_error_names_a_model_from_an_installed_package():
    site = Path(sysconfig.get_paths()["purelib"])
    name = f"autotp_test_models_{uuid.uuid4().hex[:8]}"
    pkg = site / name
    pkg.mkdir()
    try:
        (pkg / "__init__.py").write_text(_FAILING)
        importlib.invalidate_caches()  # site-packages' directory listing may be cached from this same second
        model = importlib.import_module(name).DataDependent()
        with pytest.raises(CaptureError) as e:
            capture(model, (torch.randn(2, 8),), {})
        assert f"{name}/__init__.py" in str(e.value) and "if self.lin(x).sum() > 0" in str(e.value)
    finally:
        sys.modules.pop(name, None)
        for f in sorted(pkg.rglob("*"), reverse=True):
            f.unlink() if f.is_file() else f.rmdir()
        pkg.rmdir()


# at tp 2 one style of each kind of state (a mask made on first use, a table grown in forward, a cache, a module
# shared by the blocks, a tied head); at tp 4 a sharded cache and state shared across modules; in the extended run
# the other styles, at tp 2 and at tp 4 (every style trains in one run or the other; the fast tier captures each)
STYLES_AT = {2: ["lazy_mask", "grown_rotary", "plain_cache", "shared_rotary", "tied_module"],
             4: ["plain_cache", "shared_alibi"]}
REST = ["lazy_mask_grow", "dict_cache", "tied_forward"]
REST_AT_2 = [s for s in STYLES if s not in STYLES_AT[2]]


# -- multi-process: exact, fully sharded, untouched ---------------------------------------------------------
@pytest.fixture(scope="module")
def runs() -> Launches:
    # tp 4 in the extended run (four ranks on CI's two cores cost the most of any launch)
    return Launches({2: {"stateful": (stateful_parity, STYLES_AT[2])}},
                    extended={2: {"rest": (stateful_parity, REST_AT_2)},
                              4: {"stateful": (stateful_parity, STYLES_AT[4]), "rest": (stateful_parity, REST)}})


@pytest.mark.slow
@pytest.mark.parametrize("world,part", [(2, "stateful"), pytest.param(2, "rest", marks=pytest.mark.extended),
                                        pytest.param(4, "stateful", marks=pytest.mark.extended),
                                        pytest.param(4, "rest", marks=pytest.mark.extended)])
def test_stateful_spellings_train_and_sample_exactly(runs, world: int, part: str):
    for rank, by_style in runs(world, part).items():
        want = {(2, "rest"): REST_AT_2, (4, "rest"): REST}.get((world, part), STYLES_AT[world])
        assert list(by_style) == want
        for style, r in by_style.items():
            assert r["changed"] == [] and r["same_names"], (style, r["changed"])
            assert r["loss_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, (rank, style, r)
            assert r["same_tokens"], (rank, style)
            assert r["replicated"] == [], (style, r["replicated"])
            assert r["fraction"] <= 1 / world + 0.12, (style, r["fraction"])
