"""The repeated blocks of a model, read from the graph: the units data parallelism shards one at a time.

FSDP gathers a unit's parameters just before the unit runs and frees them after; a GPT's natural units are
its transformer blocks. They are found from what the graph records, never from module or class names:

- every module the forward called is on some node's ``nn_module_stack`` (``transformer.h.3``, ``layers.0``);
- a module's *signature* is its parameters' names relative to it and their shapes; a block holds the
  parameters of several modules (a lone ``Linear`` or norm repeated is none);
- the blocks are the called children of one parent that share a signature (two at least); of all such
  parents, the one whose repeated children hold the most parameters (ties: the shallower one), and at
  least a tenth of the model's. Experts repeat too, inside each block, and hold less; a block stack
  written as attributes of the root (``self.block1``, ``self.block2``) is the root's children;
- the units are those children, in the order the graph runs them; when they are the items of one container
  (a ``ModuleList`` or ``Sequential``: their names are indices), every item of it that owns parameters is a
  unit, so a dense first block before mixture-of-experts blocks is one too;
- a block holding a parameter also used outside it (tied) is no unit: FSDP shards a parameter in one unit.

Around the blocks, as torchtitan groups them: the modules whose parameters only code before the first
block reads (the embeddings) are one unit, those only code after the last block reads (the final norm and
the LM head) another; a parameter read on both sides (an LM head tied to the token embedding) or between
the blocks stays with the root, which FSDP gathers for the whole step.
"""
from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

import torch.fx as fx


MIN_SHARE = 0.1  # the repeated blocks must hold at least this share of the parameters to be FSDP's units


class UnitFacts(NamedTuple):
    module: str  # the block's module path, e.g. "transformer.h.0"; an edge unit's first module
    params: tuple[str, ...]  # the parameters it owns (names as the graph reads them), in name order
    kind: str = "block"  # "block", or "first" / "last": the modules read only before / after the blocks
    modules: tuple[str, ...] = ()  # an edge unit's modules (a block is its one module)


def called_modules(gm: fx.GraphModule) -> list[str]:
    """Every module path on some node's ``nn_module_stack``, in order of first appearance."""
    seen: dict[str, None] = {}
    for node in gm.graph.nodes:
        for value in (node.meta.get("nn_module_stack") or {}).values():
            if isinstance(value, tuple) and value and isinstance(value[0], str):
                seen.setdefault(value[0], None)
    return [p for p in seen if p]


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _owners(names: list[str]) -> dict[str, list[str]]:
    """Every module path -> the parameter names under it, in ``names``' order (one pass, not one per path)."""
    out: dict[str, list[str]] = defaultdict(list)
    for n in names:
        parts = n.split(".")
        for i in range(1, len(parts)):
            out[".".join(parts[:i])].append(n)
    return out


def find_units(gm: fx.GraphModule) -> tuple[UnitFacts, ...]:
    """The repeated blocks of ``gm`` in graph order; () when nothing repeats."""
    shapes = {n: tuple(p.shape) for n, p in gm.named_parameters(remove_duplicate=False)}
    names = sorted(shapes)
    owners = _owners(names)
    called = called_modules(gm)
    children: dict[str, list[str]] = defaultdict(list)
    for path in called:
        children[_parent(path)].append(path)
    best: tuple | None = None  # (parameters in the repeated children, -depth, parent, those children)
    for parent, kids in children.items():
        by_signature: dict[tuple, list[str]] = defaultdict(list)
        for kid in kids:
            owned = owners.get(kid, [])
            # a block holds several layers (attention, MLP, norms): a lone Linear or norm repeated is no block
            if len({n.rpartition(".")[0] for n in owned}) > 1:
                by_signature[tuple((n[len(kid):], shapes[n]) for n in owned)].append(kid)
        for signature, same in by_signature.items():
            if len(same) < 2:
                continue
            size = len(same) * sum(_numel(s) for _, s in signature)
            key = (size, -parent.count(".") - bool(parent), parent, same)
            if best is None or key[:2] > best[:2]:
                best = key
    # blocks hold most of a GPT; two repeated norms inside a single block hold next to nothing
    if best is None or best[0] < MIN_SHARE * sum(_numel(s) for s in shapes.values()):
        return ()
    parent, repeated = best[2], best[3]
    indexed = all(k.rsplit(".", 1)[-1].isdigit() for k in repeated)
    kids = [k for k in children[parent] if owners.get(k, []) and (k in repeated or indexed and k.rsplit(".", 1)[-1].isdigit())]
    tied = _tied_outside(gm, kids)
    blocks = tuple(UnitFacts(kid, tuple(owners.get(kid, []))) for kid in kids if kid not in tied)
    return _with_edges(gm, blocks) if blocks else blocks


def _with_edges(gm: fx.GraphModule, blocks: tuple[UnitFacts, ...]) -> tuple[UnitFacts, ...]:
    """``blocks`` with the unit of the modules read only before them first and the one of those read only
    after them last (where there are such modules)."""
    paths = {b.module for b in blocks}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    in_blocks = [order[n] for n in gm.graph.nodes
                 if any(isinstance(v, tuple) and v and v[0] in paths for v in (n.meta.get("nn_module_stack") or {}).values())]
    start, end = min(in_blocks), max(in_blocks)
    names: dict[int, list[str]] = defaultdict(list)
    for name, p in gm.named_parameters(remove_duplicate=False):
        names[id(p)].append(name)
    owned = {n for b in blocks for n in b.params}
    readers = defaultdict(list)  # parameter name -> graph positions of what reads it
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            readers[node.target] += [order[u] for u in node.users]
    side: dict[str, str] = {}  # every name of a root parameter -> "first", "last" or "root"
    for group in names.values():
        if any(n in owned for n in group):
            continue
        at = [i for n in group for i in readers.get(n, ())]
        where = "first" if at and max(at) < start else "last" if at and min(at) > end else "root"
        side.update({n: where for n in group})
    modules: dict[str, list[str]] = defaultdict(list)
    for name in side:
        modules[name.rpartition(".")[0]].append(name)
    out = []
    for kind in ("first", "last"):
        # a module joins when every parameter it holds is read on that side only (the root itself never)
        mods = [m for m, ns in modules.items() if m and all(side[n] == kind for n in ns)]
        if mods:
            params = tuple(sorted(n for m in mods for n in modules[m]))
            out.append(UnitFacts(mods[0], params, kind, tuple(mods)))
    first = [u for u in out if u.kind == "first"]
    last = [u for u in out if u.kind == "last"]
    return (*first, *blocks, *last)


def _tied_outside(gm: fx.GraphModule, kids: list[str]) -> set[str]:
    """The blocks among ``kids`` that hold a parameter some name outside the block also holds."""
    by_id: dict[int, list[str]] = defaultdict(list)
    for name, p in gm.named_parameters(remove_duplicate=False):
        by_id[id(p)].append(name)
    out = set()
    for group in by_id.values():
        owners = {next((k for k in kids if n.startswith(k + ".")), None) for n in group}
        if len(owners) > 1:
            out |= {k for k in owners if k is not None}
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
