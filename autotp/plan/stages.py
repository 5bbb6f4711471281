"""Pipeline stages: the repeated blocks cut into ``pp × v`` contiguous runs, balanced by their work.

A stage boundary falls between two blocks, never inside one; the code before the first block (embeddings,
masks, rotary tables) runs in the first stage and the code after the last (final norm, LM head, loss) in the
last, so those stages start with a load of their own. The split minimises the largest stage's forward FLOPs
(:mod:`autotp.analysis.flops`), then the largest stage's parameter bytes; ``split_points`` (the blocks that
start stages 1, 2, ...) overrides it. Every stage holds at least one block.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch.fx as fx

from autotp.analysis.flops import node_flops
from autotp.plan.pieces import piece_keys
from autotp.errors import PipelineError
from autotp.plan.plan import Stage, Unit


@dataclass(frozen=True)
class StageRequest:
    """What the pipeline asks the planner for: ``count`` stages (pp × v), optionally where they start."""

    count: int
    split_points: tuple[str, ...] = ()


def _per_key(gm: fx.GraphModule, keys: dict[fx.Node, int]) -> tuple[dict[int, int], dict[int, set[str]]]:
    """Forward FLOPs of each piece key, and the parameters each key's nodes read."""
    flops: dict[int, int] = defaultdict(int)
    reads: dict[int, set[str]] = defaultdict(set)
    params = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    for node, key in keys.items():
        flops[key] += node_flops(node)
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in params:
            for user in node.users:
                if user in keys:
                    reads[keys[user]].add(node.target)
    return flops, reads


def _split(costs: list[tuple[int, int]], last: tuple[int, int], count: int) -> list[int]:
    """Where each of ``count`` contiguous runs of ``costs`` starts, minimising the largest run's cost
    (FLOPs, then bytes); the last run also carries ``last``."""
    n = len(costs)
    prefix = [(0, 0)]
    for f, b in costs:
        prefix.append((prefix[-1][0] + f, prefix[-1][1] + b))

    def run(a: int, z: int) -> tuple[int, int]:
        extra = last if z == n else (0, 0)
        return prefix[z][0] - prefix[a][0] + extra[0], prefix[z][1] - prefix[a][1] + extra[1]

    inf = (float("inf"), float("inf"))
    # best[s][j]: the smallest largest cost of j blocks in s runs, and where the last run starts
    best = [[(inf, 0)] * (n + 1) for _ in range(count + 1)]
    best[0][0] = ((0, 0), 0)
    for s in range(1, count + 1):
        for j in range(s, n - (count - s) + 1):
            for a in range(s - 1, j):
                worst = max(best[s - 1][a][0], run(a, j))
                if worst < best[s][j][0]:
                    best[s][j] = (worst, a)
    starts, j = [], n
    for s in range(count, 0, -1):
        a = best[s][j][1]
        starts.append(a)
        j = a
    return starts[::-1]


def _starts_from_points(blocks: list[str], points: tuple[str, ...], count: int) -> list[int]:
    where = {b: i for i, b in enumerate(blocks)}
    if len(points) != count - 1:
        raise PipelineError(f"split_points names {len(points)} blocks, but {count} stages start at {count - 1} "
                            f"(the first stage starts at the first block)",
                            hint=f"give {count - 1} of the blocks {blocks[0]} ... {blocks[-1]}")
    starts = [0]
    for p in points:
        if p not in where:
            raise PipelineError(f"split point {p!r} is not one of the model's blocks ({blocks[0]} ... {blocks[-1]})",
                                hint="name the block each stage after the first starts with")
        if where[p] <= starts[-1]:
            raise PipelineError(f"split point {p!r} does not come after the previous stage's first block "
                                f"{blocks[starts[-1]]}: the stages would be empty or out of order")
        starts.append(where[p])
    return starts


def plan_stages(gm: fx.GraphModule, units: tuple[Unit, ...], request: StageRequest,
                tp_bytes: dict[str, int] | None = None) -> tuple[Stage, ...]:
    """The stages of ``gm`` for ``request``; ``tp_bytes``: each parameter's bytes per rank (default: whole)."""
    blocks = [u.module for u in units if u.kind == "block"]
    count = request.count
    if count > len(blocks) or not blocks:
        found = f"{len(blocks)} repeated blocks ({blocks[0]} ... {blocks[-1]})" if blocks else "no repeated blocks"
        raise PipelineError(f"{count} pipeline stages (pp × virtual stages) need a block each, and the graph has "
                            f"{found}", hint=f"use at most {len(blocks)} stages" if blocks else
                            "a pipeline cuts between repeated transformer blocks; this model has none to cut at")
    keys = piece_keys(gm, blocks)
    flops, reads = _per_key(gm, keys)
    sizes = {n: p.numel() * p.element_size() for n, p in gm.named_parameters(remove_duplicate=False)}
    sizes.update(tp_bytes or {})
    nb = len(blocks)

    def cost(k: int) -> tuple[int, int]:
        return flops.get(k, 0), sum(sizes[n] for n in reads.get(k, ()))

    # block i carries the root code before it (key 2i); the code after the last block goes to the last stage
    costs = [tuple(a + b for a, b in zip(cost(2 * i), cost(2 * i + 1))) for i in range(nb)]
    starts = _starts_from_points(blocks, request.split_points, count) if request.split_points else \
        _split(costs, cost(2 * nb), count)
    stages = []
    for s, a in enumerate(starts):
        z = starts[s + 1] if s + 1 < count else nb
        ks = list(range(2 * a, 2 * z)) + ([2 * nb] if z == nb else [])
        names = sorted(set().union(*(reads.get(k, set()) for k in ks)))
        stages.append(Stage(tuple(blocks[a:z]), tuple(names), sum(flops.get(k, 0) for k in ks),
                            sum(sizes[n] for n in names)))
    return tuple(stages)


def stage_of_key(stages: tuple[Stage, ...]) -> tuple[list[str], list[int]]:
    """The blocks in order and each one's stage: a piece key k (:func:`~autotp.plan.pieces.piece_keys`)
    runs in the stage of block ``min(k // 2, blocks - 1)``."""
    blocks = [b for st in stages for b in st.blocks]
    return blocks, [s for s, st in enumerate(stages) for _ in st.blocks]
