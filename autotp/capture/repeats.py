"""Capture a deep model at the cost of a shallow one: export a few blocks, copy their graph for the rest.

``torch.export`` costs about the same per op, so a GPT's capture grows with its depth (4 s at 32 Llama-70B
layers, 10 s at 80 on 2 cores) although blocks 1 … L−1 compute what block 1 computes with their own
weights. Here:

1. A cheap eager run on the meta device (:mod:`autotp.capture.meta_run`) records, for every child of the
   model's longest module list, the ops it runs: each op with its arguments' shapes, dtypes and Python
   values, and the block's own parameter and buffer shapes. Blocks with the same record are one *kind*;
   the kinds come from what the blocks do, never from their names or classes (a dense first block, MoE
   every other block, alternating local and global attention are kinds of their own).
2. The model is exported with its list cut to the first blocks that hold, for every kind found after the
   first block, one instance that follows another block: ``keep`` blocks, 2 for identical blocks.
3. The graph is extended to all L blocks: block i is a copy of its kind's captured block, reading block i's
   own parameters and buffers, its one input from block i − 1 and everything else from the code before the
   blocks, exactly as the captured block does. A block may also return values of its own (a KV cache's key
   and value, a hidden state): the meta runs say which block made each returned tensor, and each copy
   returns its own in the whole model's output structure.

It is used only where it is safe, and the full export runs otherwise: the meta run must succeed (no data-
dependent Python on tensor values), every block must be called once, in order, with no code between two
blocks; the cut model must run the same ops before and after its blocks as the whole one; in the cut
graph each block must read one value of the block before it and hand one value on; and each returned
tensor of a copy must have its template's place, shape and dtype among its block's returned tensors.
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from autotp.capture import autocast, functions
from autotp.capture.recompute import renamed_region
from autotp.capture.meta_run import Outputs, Recorder, outputs, record, text
from autotp.capture.structure import Spec
from autotp.errors import own_bug

MIN_BLOCKS = 3  # a list shorter than this is captured whole


@dataclass(frozen=True)
class Repeats:
    container: str  # the module list's path in the model
    kinds: tuple[int, ...]  # each block's kind
    keep: int  # blocks 0 … keep − 1 are exported
    template: tuple[int, ...]  # per kind: the exported block copied for it (-1: none after the first)
    whole: Outputs | None = None  # the whole model's outputs, and the cut model's
    cut: Outputs | None = None


@dataclass(frozen=True, eq=False)
class Copies:
    """What a graph exported with ``rep.keep`` blocks lacks to be the whole model's: blocks keep … L−1, each
    a copy of its kind's template (:func:`expand`), reading its own tensors from ``state``."""

    rep: Repeats
    state: dict[str, torch.Tensor]
    spec: Spec  # the cut graph's output structure

    def apply(self, gm: fx.GraphModule) -> Spec | None:
        """Copy the blocks into ``gm`` (the cut graph, or the cut graph rewritten by passes that keep each
        node in its block): the whole model's output spec, or None with ``gm`` untouched."""
        return expand(gm, self.rep, self.state, self.spec)

    def names(self, name: str) -> list[str]:
        """``name`` (a tensor or module of an exported block, or the block) as each copy of that block names
        its own, in block order; none for a name outside the exported blocks."""
        prefix = f"{self.rep.container}."
        head, dot, rest = name[len(prefix):].partition(".") if name.startswith(prefix) else ("", "", "")
        if not head.isdigit():
            return []
        t = int(head)
        return [f"{prefix}{i}{dot}{rest}" for i in range(self.rep.keep, len(self.rep.kinds))
                if self.rep.template[self.rep.kinds[i]] == t]


def _container(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The longest ModuleList / Sequential of the model (the transformer blocks), if it is long enough."""
    best = None
    for name, m in model.named_modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= MIN_BLOCKS:
            if best is None or len(m) > len(best[1]):
                best = (name, m)
    return best


def _signature(block: nn.Module, prefix: str, params: dict[str, torch.Tensor]) -> tuple:
    """Each parameter's and buffer's name, shape (the stand-in's, where ``params`` names it), dtype."""
    return tuple((n, tuple(params.get(prefix + n, t).shape), t.dtype, t.requires_grad)
                 for n, t in [*block.named_parameters(remove_duplicate=False), *block.named_buffers()])


def _split(rec: Recorder, n: int) -> tuple[list, list[list], list, bool] | None:
    """(ops before the blocks, each block's ops, ops after them, whether nothing runs between two blocks)."""
    if rec.calls != list(range(n)):
        return None
    segs = [s for s in rec.segments if s[1] or s[0] is not None]
    if not segs:
        return None
    before = segs[0][1] if segs[0][0] is None else []
    rest = segs[1:] if segs[0][0] is None else segs
    blocks = [ops for b, ops in rest if b is not None]
    between = [ops for b, ops in rest if b is None]
    after = between[-1] if between and rest[-1][0] is None else []
    gaps = between[:-1] if between and rest[-1][0] is None else between
    return before, blocks, after, not any(gaps)


@contextlib.contextmanager
def cut(blocks: nn.Module, keep: int) -> Iterator[None]:
    """The module list holds its first ``keep`` blocks for the duration (the same object, so code that holds
    it or slices it sees the cut)."""
    saved = dict(blocks._modules)
    try:
        blocks._modules = type(saved)((k, v) for i, (k, v) in enumerate(saved.items()) if i < keep)
        yield
    finally:
        blocks._modules = saved


def find_repeats(model: nn.Module, run: Callable[[], object], params: dict[str, torch.Tensor] | None = None,
                 recorded: Recorder | None = None) -> Repeats | None:
    """The blocks to export and copy, or None: capture the whole model (see the module doc for when).
    ``params``: tensors the export will see in place of named parameters or buffers (full-size stand-ins
    for a sharded model's shards), whose shapes the meta runs take too. ``recorded``: the whole model's meta
    run of this call, made already (:func:`record_whole`, on tensors of these shapes)."""
    found = _container(model)
    if found is None:
        return None
    path, blocks = found
    n = len(blocks)
    rec = recorded if recorded is not None else record(model, blocks, run, path, params)
    whole = _split(rec, n) if rec is not None else None
    if whole is None or not whole[3]:
        return None
    before, ops, after, _ = whole
    keys: dict[tuple, int] = {}
    kinds = []
    for i, (name, block) in enumerate(blocks._modules.items()):
        key = (_signature(block, f"{path}.{name}." if path else f"{name}.", params or {}), tuple(ops[i]))
        kinds.append(keys.setdefault(key, len(keys)))
    template = [-1] * len(keys)
    for i in range(1, n):
        if template[kinds[i]] < 0:
            template[kinds[i]] = i
    keep = max(template) + 1
    if keep >= n:
        return None
    with cut(blocks, keep):
        rec_cut = record(model, blocks, run, path, params)
    short = _split(rec_cut, keep) if rec_cut is not None else None
    if short is None or short[0] != before or short[2] != after or short[1] != ops[:keep]:
        return None  # the code around the blocks depends on how many there are
    return Repeats(path, tuple(kinds), keep, tuple(template), outputs(rec), outputs(rec_cut))


def record_whole(model: nn.Module, run: Callable[[], object]) -> Recorder | None:
    """The model's meta run of ``run``, each op filed under its block of the model's longest module list:
    what :func:`program` writes out and :func:`find_repeats` starts from (one run serves both)."""
    path, blocks = _container(model) or ("", None)
    return record(model, blocks, run, path)


def program(model: nn.Module, run: Callable[[], object], rec: Recorder | None = None) -> str | None:
    """What the forward computes, as text (:func:`autotp.capture.meta_run.text`), its blocks being the model's
    longest module list; from ``rec``, :func:`record_whole`'s run, when given. None where the forward cannot
    run on meta."""
    rec = rec if rec is not None else record_whole(model, run)
    return text(rec) if rec is not None else None


# -- the graph ---------------------------------------------------------------------------------------------
def _block_of(node: fx.Node, path: str, n: int) -> int | None:
    prefix = path + "."
    if node.op == "get_attr":
        rest = node.target[len(prefix):] if node.target.startswith(prefix) else None
    else:
        rest = None
        for fqn, _ in (node.meta.get("nn_module_stack") or {}).values():
            if fqn.startswith(prefix):
                rest = fqn[len(prefix):]
                break
    if rest is None:
        return None
    head = rest.split(".", 1)[0]
    return int(head) if head.isdigit() and int(head) < n else None


def _members(graph: fx.Graph, path: str, n: int) -> dict[fx.Node, int | None]:
    """Each node's block (None: none). A node a rewrite inserted without a module stack (a size read, a
    group of parameters) belongs to the last block among its inputs': copied with it, or refused where
    that puts it in a block it does not follow (one node over several blocks' parameters)."""
    member: dict[fx.Node, int | None] = {}
    for node in graph.nodes:
        if node.op in ("call_function", "call_module") and "nn_module_stack" not in node.meta:
            blocks = [member[a] for a in node.all_input_nodes if member[a] is not None]
            member[node] = max(blocks) if blocks else None
        else:
            member[node] = _block_of(node, path, n)
    return member


def _after_blocks(graph: fx.Graph, member: dict[fx.Node, int | None]) -> set[fx.Node]:
    """Nodes of no block that read a block's value, directly or not: code after (or between) the blocks,
    which no copy may read as code before them."""
    after: set[fx.Node] = set()
    for node in graph.nodes:
        if member[node] is None and node.op != "get_attr" and any(
                member[a] is not None or a in after for a in node.all_input_nodes):
            after.add(node)
    return after


def _renamed(meta: dict, old: str, new: str) -> dict:
    """A copied node's meta: block ``old``'s module paths as block ``new``'s."""
    out = dict(meta)
    stack = meta.get("nn_module_stack")
    if stack:
        def swap(fqn: str) -> str:
            return new + fqn[len(old):] if fqn == old or fqn.startswith(old + ".") else fqn

        out["nn_module_stack"] = {(k.replace(fqn, swap(fqn)) if fqn in k else k): (swap(fqn), cls)
                                  for k, (fqn, cls) in stack.items()}
    return out


def _attr(gm: fx.GraphModule, target: str) -> torch.Tensor:
    obj: object = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _set_attr(gm: fx.GraphModule, target: str, value: torch.Tensor, as_param: bool | None) -> None:
    """Register ``value`` at ``target``: a parameter, a buffer, or (``as_param`` None) a plain attribute."""
    *parents, leaf = target.split(".")
    mod: nn.Module = gm
    for p in parents:
        child = getattr(mod, p, None)
        if child is None:
            child = nn.Module()
            mod.add_module(p, child)
        mod = child
    if as_param is None:
        setattr(mod, leaf, value)
    elif as_param:
        mod.register_parameter(leaf, value if isinstance(value, nn.Parameter) else nn.Parameter(value, value.requires_grad))
    else:
        mod.register_buffer(leaf, value)


def expand(gm: fx.GraphModule, rep: Repeats, state: dict[str, torch.Tensor], spec: Spec) -> Spec | None:
    """Extend ``gm`` (exported with ``rep.keep`` blocks, returning ``spec``) to all of them, in place; the
    whole model's output spec, or None (and ``gm`` untouched) where its blocks are not wired one after another
    or its outputs cannot be told apart by block (see the module doc)."""
    path, keep, n = rep.container, rep.keep, len(rep.kinds)
    graph = gm.graph
    member = _members(graph, path, keep)
    body: list[list[fx.Node]] = [[] for _ in range(keep)]
    for node in graph.nodes:
        b = member[node]
        if b is not None and node.op != "get_attr":
            body[b].append(node)
    if any(not nodes for nodes in body):
        return None
    order = {node: i for i, node in enumerate(graph.nodes)}
    first, last = order[body[0][0]], order[body[-1][-1]]
    after = _after_blocks(graph, member)
    if any(nd in after and first < order[nd] < last for nd in graph.nodes):
        return None  # code between blocks
    output = next(nd for nd in reversed(graph.nodes) if nd.op == "output")
    outs, carry = [], []
    for b in range(keep):
        inside = set(body[b])
        # a block hands one value on; others it makes may only be returned (a KV cache's key and value)
        o = [nd for nd in body[b] if any(u not in inside and u is not output for u in nd.users)]
        ins = {a for nd in body[b] for a in nd.all_input_nodes if a not in inside and a.op != "get_attr"}
        from_prev = [a for a in ins if member[a] is not None]
        if len(o) != 1 or any(member[a] != b - 1 for a in from_prev) or len(from_prev) != (b > 0) \
                or any(a in after for a in ins):
            return None
        outs.append(o[0])
        carry.append(from_prev[0] if from_prev else None)
    if any(carry[b] is not outs[b - 1] for b in range(1, keep)):
        return None
    returned = _returned(output, member, rep, spec)
    info = getattr(graph._codegen, "pytree_info", None)  # the exported module's flat outputs, as a tuple
    out_type = info.out_spec.type if info is not None and info.out_spec is not None else None
    if returned is None or out_type not in (None, tuple, list):
        return None
    whole_spec, picks = returned
    tail_users = [u for u in outs[-1].users if member[u] is None and u is not output]

    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    top = next(iter(graph.nodes))
    cursor, prev = body[-1][-1], outs[-1]
    envs: dict[int, dict[fx.Node, fx.Node]] = {}
    for i in range(keep, n):
        t = rep.template[rep.kinds[i]]
        old, new = f"{path}.{t}", f"{path}.{i}"
        env: dict[fx.Node, fx.Node] = {carry[t]: prev}
        for nd in body[t]:
            for a in nd.all_input_nodes:
                if a.op == "get_attr" and a not in env and member[a] == t:
                    target = new + a.target[len(old):]
                    if target in state:
                        _set_attr(gm, target, state[target], a.target in params)
                    else:  # a constant the export lifted out of the block (a cache's empty start): its own copy
                        owner, _, leaf = a.target.rpartition(".")
                        buffer = leaf in gm.get_submodule(owner)._buffers
                        _set_attr(gm, target, _attr(gm, a.target).clone(), False if buffer else None)
                    with graph.inserting_before(top), warnings.catch_warnings():
                        # a lifted constant is a plain attribute, as in the exported module: fx warns of those
                        warnings.filterwarnings("ignore", "Attempted to insert a get_attr Node")
                        env[a] = graph.get_attr(target)
                    env[a].meta = dict(a.meta)
            with graph.inserting_after(cursor):
                copy = graph.node_copy(nd, lambda a: env.get(a, a))
            copy.meta = functions.renamed_region(
                autocast.renamed_region(renamed_region(_renamed(nd.meta, old, new), new), new), new)
            env[nd] = cursor = copy
        envs[i] = env
        prev = env[outs[t]]
    for u in tail_users:
        u.replace_input_with(outs[-1], prev)
    flat = [node if block is None else envs[block][node] for node, block in picks]
    output.args = (type(output.args[0])(flat),)
    if out_type is not None:  # the module's own output unflattening: as many as the graph now returns
        graph._codegen.pytree_info = info._replace(out_spec=pytree.tree_structure(out_type(range(len(flat)))))
    graph.lint()
    gm.recompile()
    return whole_spec


def _returned(output: fx.Node, member: dict[fx.Node, int | None], rep: Repeats,
              spec: Spec) -> tuple[Spec, list[tuple[fx.Node, int | None]]] | None:
    """The whole model's output spec and, for each of its flat outputs, the cut graph's node to return and the
    block whose copy of it to take (None: that node itself); None where the meta runs do not say.

    The meta runs of the whole and the cut model tell which block made each returned tensor. The cut graph
    returns its tensors in the cut run's order, each made by the block the run says; the whole model
    returns, per block, as many as the block it copies returns, in the same order. The whole run's spec is
    the export's once its meta device is the export's (checked on the cut run's spec against the export's)."""
    if rep.whole is None or rep.cut is None:
        return None
    flat = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else None
    # after the forward's own outputs, what the forward writes on the model (autotp.capture.writes): made
    # outside the blocks, returned as they are, where the whole model returns as many outputs as the cut one
    extra = flat[len(rep.cut.made_in):] if flat is not None else []
    if extra and (len(rep.whole.made_in) != len(rep.cut.made_in) or
                  any(not isinstance(nd, fx.Node) or member[nd] is not None for nd in extra)):
        return None
    flat = flat[:len(rep.cut.made_in)] if flat is not None else None
    if flat is None or len(flat) != len(rep.cut.made_in) or any(
            not isinstance(nd, fx.Node) or member[nd] != b for nd, b in zip(flat, rep.cut.made_in)):
        return None
    devices: dict[torch.device, object] = {}
    if not _same_but_device(rep.cut.spec, spec, devices):
        return None
    by_block: dict[int | None, list[tuple[fx.Node, tuple]]] = {}
    for nd, b, kind in zip(flat, rep.cut.made_in, rep.cut.shapes):
        by_block.setdefault(b, []).append((nd, kind))
    picks, seen = [], {}
    for b, kind in zip(rep.whole.made_in, rep.whole.shapes):
        at = seen[b] = seen.get(b, -1) + 1
        src = b if b is None or b < rep.keep else rep.template[rep.kinds[b]]
        nodes = by_block.get(src, [])
        # the same place among its block's outputs, and the same shape and dtype (a last block that returns
        # less than the others, as Hugging Face's hidden states do, is no template for the middle ones)
        if at >= len(nodes) or nodes[at][1] != kind:
            return None
        picks.append((nodes[at][0], None if b is None or b < rep.keep else b))
    counts = {b: k + 1 for b, k in seen.items()}
    by_block = {b: [nd for nd, _ in nodes] for b, nodes in by_block.items()}
    if any(counts.get(b, 0) != len(nodes) for b, nodes in by_block.items() if b is None or b < rep.keep) or any(
            k != len(by_block.get(rep.template[rep.kinds[b]], [])) for b, k in counts.items()
            if b is not None and b >= rep.keep):
        return None
    return _with_devices(rep.whole.spec, devices), picks + [(nd, None) for nd in extra]


def _same_but_device(a: Spec, b: Spec, devices: dict) -> bool:
    """``a`` (a meta run's) is ``b`` (the export's) but for devices, each meta-run device always one export
    device; ``devices`` gets that map."""
    if a.kind != b.kind or a.keys != b.keys or len(a.children) != len(b.children):
        return False
    if a.kind == "const" and isinstance(a.value, torch.device) and isinstance(b.value, torch.device):
        return devices.setdefault(a.value, b.value) == b.value
    if a.kind in ("const", "tree", "tensor"):
        try:
            if type(a.value) is not type(b.value) or not bool(a.value == b.value):
                return False
        except Exception as exc:  # noqa: BLE001 - a value that cannot be compared is no proof of sameness
            if own_bug(exc):  # autotp's own bug: shown, never a verdict
                raise
            return False
    elif a.value is not b.value:  # "object": the same class
        return False
    return all(_same_but_device(x, y, devices) for x, y in zip(a.children, b.children))


def _with_devices(spec: Spec, devices: dict) -> Spec:
    if spec.kind == "const" and isinstance(spec.value, torch.device):
        return Spec("const", devices.get(spec.value, spec.value))
    if not spec.children:
        return spec
    return Spec(spec.kind, spec.value, spec.keys, tuple(_with_devices(c, devices) for c in spec.children))
