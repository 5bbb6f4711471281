"""Capture a user's forward call with non-strict ``torch.export`` of the user's own model object.

Non-strict export runs the model's real Python code (closures over submodules, plain tensor attributes,
module-level tensors, hooks on submodules, buffers written in forward) on fake tensors that it makes from
the parameters and buffers itself: no copy of the model, no memory, no real compute, and the model is left
as it was. Every dim of every tensor input is ``Dim.AUTO``: export keeps batch, sequence and cache lengths
symbolic unless the model pins them. Sizes 0 and 1 are specialized by export, so they are part of the
cache key (:func:`autotp.capture.structure.call_key`); any other size a graph is guarded on (a sequence
length compared with a mask buffer's) is asked of the graph itself (:func:`input_guard`).

The exported graph takes and returns flat tuples of tensors (:mod:`autotp.capture.structure`), so any Python object
a forward takes or returns (a model-output dataclass, a cache object holding tensors) is captured without
registering its type anywhere, and a forward with ``**kwargs`` needs no names matched.

A model whose parameters were already cut to local shards is captured with full-size stand-ins swapped in
for the duration of the export (``params=``): uninitialised CPU tensors (address space, never touched) or
meta tensors on other devices.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import site
import sysconfig
import traceback
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.export import Dim
from torch.nn.utils.stateless import _reparametrize_module

from autotp.errors import CaptureError, own_bug
from autotp.operators.gathered import GatheredOnUse
from autotp.capture.cached import helpers_uncached, keyed_by_size
from autotp.capture.functions import marking_functions
from autotp.capture.grad_mode import marking_grad_mode
from autotp.capture.recompute import marking_checkpoints
from autotp.capture.canonical import canonicalize
from autotp.capture.meta_run import Recorder
from autotp.capture.preserve import preserved, unique_names
from autotp.capture.repeats import Copies, Repeats, cut, find_repeats
from autotp.capture.source_lines import source_lines_released
from autotp.capture.structure import Spec, flatten, unflatten
from autotp.capture.islands import ISLANDS_KEY, island_for, islanded
from autotp.capture.values import CHECKS_KEY, ValueWatch, real_state
from autotp.capture.writes import WRITES_KEY, StateWatch, drop_buffer_copies

_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs")


# -- capture -------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _as_flat_forward(model: nn.Module, forward: Callable, in_spec: Spec, box: list,
                     written: list | None = None, checks: tuple[dict, list] | None = None) -> Iterator[None]:
    """Export ``model`` as if ``forward`` took and returned flat tensors: root hooks off (they run around
    the rewritten graph at call time, as before), the output's structure stored in ``box``. ``written``: the
    state the forward writes on the model is returned after its outputs, and what replays it
    (:mod:`autotp.capture.writes`) stored there. ``checks``: (the model's real state, a list): checks on
    that state's values are answered from it and stored in the list (:mod:`autotp.capture.values`)."""

    def flat_forward(*tensors):
        args, kwargs = unflatten(tensors, in_spec)
        watch = StateWatch(model) if written is not None else None
        values = ValueWatch(model, checks[0]) if checks is not None else contextlib.nullcontext()
        with values:
            result = forward(*args, **kwargs)
        if checks is not None:
            checks[1].append(tuple(values.checks))
        out, spec = flatten(result)
        box.append(spec)
        if watch is None:
            return tuple(out)
        extra, writes, rebound = watch.writes(len(out))
        written.append((writes, rebound))
        return tuple(out) + tuple(extra)

    saved = {name: getattr(model, name) for name in _HOOK_DICTS if hasattr(model, name)}
    had_forward = "forward" in model.__dict__
    old_forward = model.__dict__.get("forward")
    try:
        for name in saved:
            setattr(model, name, OrderedDict())
        model.__dict__["forward"] = flat_forward
        yield
    finally:
        for name, value in saved.items():
            setattr(model, name, value)
        if had_forward:
            model.__dict__["forward"] = old_forward
        else:
            model.__dict__.pop("forward", None)


def stand_ins(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Uninitialised tensors shaped like ``tensors`` on ``device``, one object per tied group.

    On the CPU they are address space until written (and capture never writes them); meta costs nothing.
    """
    made: dict[int, torch.Tensor] = {}
    for t in tensors.values():
        if id(t) not in made:
            e = torch.empty(t.shape, dtype=t.dtype, device=device)
            made[id(t)] = nn.Parameter(e, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else e
    return {name: made[id(t)] for name, t in tensors.items()}


class CutGraph(NamedTuple):
    """A capture whose blocks may not all be in the graph yet: ``copies`` adds them (None: they are)."""

    gm: fx.GraphModule
    spec: Spec
    copies: Copies | None
    export_whole: Callable[[], tuple[fx.GraphModule, Spec]]  # the whole model exported, where copying fails

    def whole(self) -> tuple[fx.GraphModule, Spec]:
        """The whole model's graph and output structure: the blocks copied in, else the whole export."""
        spec = self.copies.apply(self.gm) if self.copies is not None else self.spec
        return (self.gm, spec) if spec is not None else self.export_whole()


def capture(model: nn.Module, args: tuple, kwargs: dict, *, forward: Callable | None = None,
            params: dict[str, torch.Tensor] | None = None,
            device: torch.device | None = None, static: bool = False,
            recorded: Recorder | None = None) -> tuple[fx.GraphModule, Spec]:
    """Export ``model``'s call on ``(args, kwargs)``; returns the graph (flat tensor outputs) and the
    output structure. ``forward`` replaces the model's own forward for the export (default: the class's);
    ``params`` swaps in tensors for named parameters or buffers while exporting (full-size stand-ins for
    shards); ``device``: where the graph will run (factory calls are moved there), default the capture's;
    ``static``: every size as given (a pipeline stage sends and receives tensors of fixed shapes), not
    ``Dim.AUTO``. ``recorded``: the meta run of this call the caller made already
    (:func:`~autotp.capture.repeats.record_whole`, for the plan cache's key), on tensors of ``params``' shapes.

    The model's device decides the capture: meta models are captured on meta inputs; a graph that then
    holds a constant whose value a meta capture loses (``x[:, [-1]]`` builds one from Python data) is
    captured again with uninitialised CPU stand-ins (address space only, never read).
    """
    return capture_blocks(model, args, kwargs, forward=forward, params=params, device=device, static=static,
                          recorded=recorded).whole()


def capture_blocks(model: nn.Module, args: tuple, kwargs: dict, *, forward: Callable | None = None,
                   params: dict[str, torch.Tensor] | None = None, device: torch.device | None = None,
                   static: bool = False, recorded: Recorder | None = None, writes: bool = False) -> CutGraph:
    """:func:`capture`, the repeated blocks not yet copied in: a caller may rewrite the exported blocks
    first and copy the rewritten ones (:meth:`CutGraph.whole` copies them as exported). ``writes``: the
    state the forward writes on the model is returned after its outputs, and ``gm.meta[WRITES_KEY]`` says
    how to replay it (:mod:`autotp.capture.writes`); a graph whose blocks' copies would have to write state
    too (a write on a block's module) is exported whole."""
    forward = forward or type(model).forward.__get__(model)
    source = _model_device(model, params)
    rep = find_repeats(model, meta_call(forward, args, kwargs), params, recorded)
    gm, spec, copies = _export_blocks(model, forward, args, kwargs, params, source, static, rep, writes)
    if source.type == "meta" and _meta_constants(gm):
        cpu = torch.device("cpu")
        state = {**dict(model.named_parameters(remove_duplicate=False)),
                 **{n: b for n, b in model.named_buffers(remove_duplicate=False) if b.is_meta}, **(params or {})}
        try:
            on_cpu = stand_ins(state, cpu)
            gm, spec, copies = _export_blocks(model, forward, args, kwargs, on_cpu, cpu, static, rep, writes)
            source, params = cpu, on_cpu
        except CaptureError:
            pass  # the meta constants are the model's own meta tensor attributes: the meta graph is all there is

    def export_whole() -> tuple[fx.GraphModule, Spec]:
        whole, whole_spec = _export_on(model, forward, args, kwargs, params, source, static, writes)
        retarget_device(whole, device or source, source)
        canonicalize(whole)
        return whole, whole_spec

    retarget_device(gm, device or source, source)
    canonicalize(gm)
    return CutGraph(gm, spec, copies, export_whole)


def meta_call(forward: Callable, args: tuple, kwargs: dict) -> Callable[[], object]:
    """``forward`` on meta copies of the inputs, rebuilt from their structure on every call as the export's
    flat forward rebuilds them, so the caller's objects (a cache it passes) are never touched."""
    tensors, spec = flatten((tuple(args), dict(kwargs)))

    def call() -> object:
        a, k = unflatten([torch.empty(t.shape, dtype=t.dtype, device="meta") for t in tensors], spec)
        return forward(*a, **k)

    return call


def _export_blocks(model: nn.Module, forward: Callable, args: tuple, kwargs: dict,
                   params: dict[str, torch.Tensor] | None, device: torch.device, static: bool,
                   rep: Repeats | None, writes: bool = False) -> tuple[fx.GraphModule, Spec, Copies | None]:
    """Export with the blocks cut to ``rep.keep``, with what copies the rest (:mod:`autotp.capture.repeats`);
    the whole model where ``rep`` is None, or where the forward writes state the copies would have to write
    too (:func:`_writes_outside`)."""
    if rep is None:
        return (*_export_on(model, forward, args, kwargs, params, device, static, writes), None)
    blocks = model.get_submodule(rep.container)
    gone = tuple(f"{rep.container}.{name}." for name in list(blocks._modules)[rep.keep:])
    kept = {n: t for n, t in params.items() if not n.startswith(gone)} if params else params
    with cut(blocks, rep.keep):
        gm, spec = _export_on(model, forward, args, kwargs, kept, device, static, writes)
    if not _writes_outside(gm.meta.get(WRITES_KEY), rep.container) or gm.meta.get(CHECKS_KEY) \
            or gm.meta.get(ISLANDS_KEY):
        # the copies would neither write nor check their state, and an island's node names its own block
        return (*_export_on(model, forward, args, kwargs, params, device, static, writes), None)
    state = {**dict(model.named_parameters(remove_duplicate=False)),
             **dict(model.named_buffers(remove_duplicate=False)), **(params or {})}
    return gm, spec, Copies(rep, state, spec)


def _writes_outside(writes, container: str) -> bool:
    """Whether the copies of the blocks need not write anything: no state written, or all of it on modules
    outside the blocks (the loss kept on the root, a cache the model builds before its blocks), each write
    replayable (its extra outputs stay after the copied graph's own)."""
    if not writes:
        return True
    return not writes.named and all(w.path != container and not w.path.startswith(f"{container}.")
                                    and _no_count(w.value) for w in writes.items)


def _no_count(spec) -> bool:
    """Whether a written value holds no Python number: the cut export ran ``keep`` blocks, so a number the
    forward counted over its blocks (``self.n_run = len(self.blocks)``) would be the cut model's."""
    if spec is None or spec.kind in ("tensor", "size", "ref"):
        return True
    if spec.kind == "const":
        return isinstance(spec.value, (bool, str, type(None), torch.dtype, torch.device))
    return all(_no_count(c) for c in spec.children)


def _model_device(model: nn.Module, params: dict[str, torch.Tensor] | None) -> torch.device:
    for t in [*(params or {}).values(), *model.parameters(), *model.buffers()]:
        return t.device
    return torch.device("cpu")


def _export_on(model: nn.Module, forward: Callable, args: tuple, kwargs: dict,
               params: dict[str, torch.Tensor] | None, device: torch.device,
               static: bool = False, writes: bool = False) -> tuple[fx.GraphModule, Spec]:
    def place(x: torch.Tensor) -> torch.Tensor:
        # export reads shapes, not values: a tensor elsewhere, or a gathered-on-use output fed back (a KV
        # cache, which reading would gather), is replaced by an uninitialised plain tensor of its shape; so is
        # a view (``idx[:, -block_size:]``), on whose base's sizes export would guard the graph, and which a
        # later call of the same signature need not be
        if x.device == device and not isinstance(x, GatheredOnUse) and x._base is None:
            return x
        return torch.empty(x.shape, dtype=x.dtype, device=device)

    tensors, in_spec = flatten((tuple(args), dict(kwargs)))
    tensors = [place(t) for t in tensors]
    box: list[Spec] = []
    written: list | None = [] if writes else None
    # checks on the state's values are answered from its real tensors, read before export swaps in fake ones
    checks: tuple[dict, list] = (real_state(model, params or ()), [])
    islands: list[str] = []  # blocks whose own code branches on the data: each one opaque call
    island_specs: dict = {}  # path -> the structure of the block's inputs
    while True:
        swap = _reparametrize_module(model, unique_names(model, params)) if params else contextlib.nullcontext()
        try:
            # the model as it was, always; its cached helpers run uncached (autotp.capture.cached)
            with preserved(model), helpers_uncached(model), swap, islanded(model, islands, island_specs), \
                    _as_flat_forward(model, forward, in_spec, box, written, checks):
                gm = _export(model, tensors, forward, static)
            break
        except CaptureError as err:
            path = island_for(err, model, _not_user_code(), islands)
            if path is None:
                raise
            islands.append(path)
    if islands:
        gm.meta[ISLANDS_KEY] = {p: island_specs[p] for p in islands}
    found, rebound = written[-1] if written else (None, set())
    drop_buffer_copies(gm, rebound)  # a buffer re-assigned to itself never writes in the graph
    if found:
        gm.meta[WRITES_KEY] = found
    if checks[1] and checks[1][-1]:
        gm.meta[CHECKS_KEY] = checks[1][-1]
    return gm, box[-1]


def _meta_constants(gm: fx.GraphModule) -> list[str]:
    owned = {n for n, _ in gm.named_parameters(remove_duplicate=False)} | \
        {n for n, _ in gm.named_buffers(remove_duplicate=False)}
    found = []
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target not in owned:
            attr = gm
            for part in node.target.split("."):
                attr = getattr(attr, part)
            if isinstance(attr, torch.Tensor) and attr.is_meta:
                found.append(node.target)
    return found


def _export(model: nn.Module, tensors: list[torch.Tensor], forward: Callable, static: bool = False) -> fx.GraphModule:
    quiet = logging.getLogger("torch")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # a failed export logs its whole graph; the CaptureError says what matters
    name = getattr(forward, "__qualname__", f"{type(model).__name__}.forward")
    # forward(*tensors): one bundle
    dynamic = tuple({i: Dim.STATIC if static else Dim.AUTO for i in range(t.dim())} for t in tensors)
    try:
        # export prints the partial graph of a failed trace; the CaptureError below says what matters
        with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                warnings.catch_warnings():
            # a cache the forward writes (``self.cos_cached = ...``) is the model's own business: capture puts
            # the model back as it was (autotp.capture.preserve), so export's advice to register it is moot
            warnings.filterwarnings("ignore", message=r"The tensor attributes? .* (were|was) assigned during export")
            # the model's activation checkpointing (regions the runtime recomputes) and its own autograd
            # Functions (regions the runtime calls the Function for, so its backward is kept)
            # fake tensors' dispatch cache: pays for itself only over many repeated layers, and capture
            # exports a few blocks (autotp.capture.repeats): without it a small model exports ~30% faster
            # and the model's own no-grad regions (autotp.capture.grad_mode)
            with marking_checkpoints(), marking_functions(), marking_grad_mode(_not_user_code()), \
                    source_lines_released(), torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
                try:
                    with preserved(model, on_failure_only=True):  # a failed try leaves nothing to the next
                        ep = torch.export.export(model, tuple(tensors), dynamic_shapes=(dynamic,), strict=False)
                except Exception as e:  # noqa: BLE001 - told apart below, else raised as it was
                    if static or not keyed_by_size(e):
                        raise
                    # a memo keyed by a symbolic size: every size as given, the graph guarded on them
                    dynamic = tuple({i: Dim.STATIC for i in range(t.dim())} for t in tensors)
                    ep = torch.export.export(model, tuple(tensors), dynamic_shapes=(dynamic,), strict=False)
    except Exception as e:  # noqa: BLE001 - every export failure becomes one readable error
        if own_bug(e):  # autotp's own bug: shown, never a verdict
            raise
        raise CaptureError(
            f"torch.export could not capture {name}: {_reason(e)}{_user_line(e)}",
            hint="make the forward traceable (no data-dependent Python control flow on tensor values), "
                 "or pass example_inputs shaped like a real batch",
        ) from e
    finally:
        quiet.setLevel(level)
    return ep.module()


def input_guard(gm: fx.GraphModule) -> Callable[[Sequence[torch.Tensor]], bool]:
    """Whether the graph :func:`capture` returned (taken before any rewrite) accepts these flat inputs.

    Export keeps a size symbolic only as far as the model's code lets it. A causal mask buffer sliced to the
    sequence (``bias[:, :, :T, :T]`` of a (1, 1, 8, 8) buffer) makes it tell ``T == 8`` (the whole buffer)
    from ``T < 8``: captured at T = 5 the graph is guarded with ``T != 8``, captured at T = 8 it is pinned to
    8. Those guards refine :func:`~autotp.capture.structure.call_key`, which keeps sizes other than 0 and 1
    out of the key: a sampling loop whose context grows to block_size reaches a size its signature's graph
    rejects. The exported module's guard function (sizes specialized or bounded, relations between them,
    the tracer's own guards) answers; a module without one (older torch) gets the shape and range check its
    input pre-hook runs, on the shapes recorded at capture.
    """
    guards = getattr(gm, "_guards_fn", None)
    if guards is not None:
        def accepts(flat: Sequence[torch.Tensor]) -> bool:
            try:
                guards(*flat)  # torch._assert per guard: reads sizes only, never values
            except Exception as exc:  # noqa: BLE001 - a failed assert, or a guard this call cannot answer: not mine
                if own_bug(exc):  # autotp's own bug: shown, never a verdict
                    raise
                return False
            return True

        return accepts
    from torch._export.utils import _check_input_constraints_for_graph

    # the check reads node.meta["val"]; passes later give sharded inputs their local shapes, so keep the
    # captured ones
    placeholders = [SimpleNamespace(meta={"val": n.meta.get("val")}) for n in gm.graph.find_nodes(op="placeholder")]
    ranges = dict(getattr(gm, "range_constraints", None) or {})

    def accepts(flat: Sequence[torch.Tensor]) -> bool:
        try:
            _check_input_constraints_for_graph(
                placeholders, [((pytree.SequenceKey(i),), t) for i, t in enumerate(flat)], ranges)
        except RuntimeError:
            return False
        return True

    return accepts


def _reason(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _not_user_code() -> Callable[[str], bool]:
    """Whether a file is not the user's code: in torch's packages, autotp's own (``autotp``, ``autotp.passes``
    and ``autotp.cli`` each have their own folder), sympy (torch's symbolic shapes), or Python's standard
    library outside its site-packages (a model installed as a package is the user's code)."""
    packages = []
    for name in ("torch", "functorch", "torchgen", "sympy", "autotp", "autotp.passes", "autotp.cli"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            packages.append(os.path.dirname(os.path.realpath(spec.origin)) + os.sep)
    paths = sysconfig.get_paths()
    stdlib = [os.path.realpath(paths[k]) + os.sep for k in ("stdlib", "platstdlib") if k in paths]
    sites = [os.path.realpath(p) + os.sep for p in [*site.getsitepackages(), site.getusersitepackages(),
                                                    *(paths.get(k, "") for k in ("purelib", "platlib"))] if p]

    def framework(path: str) -> bool:
        path = os.path.realpath(path)
        if path.startswith(tuple(packages)):
            return True
        return path.startswith(tuple(stdlib)) and not path.startswith(tuple(sites))

    return framework


def _user_line(e: BaseException) -> str:
    """The deepest frame of the user's own code in the failure, as `` at file:line: source``. Frames are told
    apart by where their file really is (:func:`_not_user_code`), never by words in its path: a model file
    under a folder named ``autotp`` or a model library installed in site-packages is named."""
    frames = []
    while e is not None:
        frames += traceback.extract_tb(e.__traceback__)
        e = e.__cause__ or e.__context__
    framework = _not_user_code()
    for fr in reversed(frames):
        if fr.filename.startswith("<") or not os.path.isfile(fr.filename) or framework(fr.filename):
            continue  # generated code (<string>, <eval_with_key>), torch, autotp, the standard library
        return f"\n  at {fr.filename}:{fr.lineno}: {(fr.line or '').strip()}"
    return ""


def retarget_device(gm: fx.GraphModule, device: torch.device, source: torch.device) -> None:
    """Replace the capture device recorded in factory calls (``arange(..., device=meta)``) by ``device``, and
    move the constants the capture made there (a Hugging Face cache's ``torch.tensor([])``, captured on CPU
    stand-ins for a model on a GPU) to ``device``."""
    if source == device:
        return
    owned = {n for n, _ in gm.named_parameters(remove_duplicate=False)} | \
        {n for n, _ in gm.named_buffers(remove_duplicate=False)}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target not in owned:
            owner, _, name = node.target.rpartition(".")
            holder = gm.get_submodule(owner) if owner else gm
            value = getattr(holder, name, None)
            if isinstance(value, torch.Tensor) and value.device == source and source.type != "meta":
                setattr(holder, name, value.to(device))
        if node.op != "call_function":
            continue
        if node.kwargs.get("device") == source:
            node.kwargs = {**node.kwargs, "device": device}
        if any(a == source for a in node.args if isinstance(a, torch.device)):
            node.args = tuple(device if isinstance(a, torch.device) and a == source else a for a in node.args)
    gm.recompile()
