"""The layout ``autotp plan --auto`` chose, as the ``autotp shard`` command line that runs it, and what that
command leaves to the training script (recomputation, gradient accumulation without a pipeline).

Over several nodes a layout is spelled with ``--nnodes``: where its replicas divide evenly into the nodes with
``--dp`` counting one node's (world = tp × cp × dp × pp × nnodes), else with ``--world-size`` and ``--dp``
counting every node's (world = tp × cp × dp × pp, world / nnodes ranks per node: a pipeline's stages on
different nodes). Both put the ranks in Megatron's order, so both run the layout priced. A layout whose tp
groups would straddle two nodes has no command line, and the reason is said instead.
"""
from __future__ import annotations

from typing import NamedTuple

from autotp.distributed.rank_grid import RankGrid
from autotp.search.auto import Space
from autotp.search.cost import Candidate


class Command(NamedTuple):
    line: str | None  # None: autotp shard cannot spell this layout (``notes`` says why)
    notes: tuple[str, ...]  # what the training script does for the layout to run as priced


def command(model: str, lay: Candidate, space: Space, example_rows: int | None = None) -> Command:
    """The ``autotp shard`` command line of ``lay`` for ``model`` over ``space.world`` devices. ``example_rows``:
    the sequences the model file's example batch holds (what autotp shard trains each replica on per step),
    where known: a note says when the layout needs another number."""
    per_node = min(space.gpus_per_node, space.world)
    nnodes = space.world // per_node if space.world % per_node == 0 else 1
    notes = []
    try:  # the ranks autotp shard would start: tp groups inside a node, sizes that multiply to the world
        RankGrid.build(space.world, lay.tp, pp=lay.pp, dp=lay.dp, gpus_per_node=space.world // nnodes, cp=lay.cp)
    except ValueError as exc:
        return Command(None, (f"autotp shard cannot lay it out on {nnodes} nodes of {space.world // nnodes}: {exc}",))
    per_node_dp = lay.dp % nnodes == 0  # the per-node spelling, where the nodes take equal shares of the replicas
    flags = [f"--tp {lay.tp}"]
    if lay.cp > 1:
        flags.append(f"--cp {lay.cp}")
    flags.append(f"--dp {lay.dp // nnodes if per_node_dp else lay.dp}")
    if lay.pp > 1:
        flags += [f"--pp {lay.pp}", f"--microbatches {lay.microbatches}"]
        if lay.v > 1:
            flags += [f"--virtual-stages {lay.v}", f"--schedule {lay.schedule}"]
    if lay.fsdp:
        flags.append("--fsdp")
        if lay.fsdp_dtype:
            flags.append(f"--fsdp-param-dtype {lay.fsdp_dtype}")
    if lay.sp:
        flags.append("--sequence-parallel")
    if not per_node_dp:  # --dp is every node's replicas
        flags.append(f"--world-size {space.world}")
    if nnodes > 1:
        flags.append(f"--nnodes {nnodes} --node-rank R --master-addr HOST --master-port PORT")
        notes.append(f"run it on each of the {nnodes} nodes, R its index (0 on HOST), PORT a free port on HOST")
        if not per_node_dp:
            order = "tp fastest, then " + ("cp, " if lay.cp > 1 else "") + "dp, pp"
            stages = f", so the {lay.pp} pipeline stages sit on different nodes" if lay.pp > 1 else ""
            notes.append(f"--dp {lay.dp} counts every node's replicas (--world-size given): {space.world // nnodes} "
                         f"ranks per node in Megatron's order ({order}){stages}")
    per_replica = lay.micro_batch * lay.microbatches
    said = ("returns them" if example_rows == per_replica else "sets it" if example_rows is None else
            f"sets it, and holds {example_rows} now: make it return {per_replica}")
    notes.append(f"each data-parallel replica trains on {per_replica} sequences per step"
                 + (f" ({lay.microbatches} micro-batches of {lay.micro_batch})" if lay.microbatches > 1 else "")
                 + f": the model file's example_batch() {said}")
    if lay.pp == 1 and lay.microbatches > 1:
        notes.append(f"the {lay.microbatches} micro-batches are the training script's gradient accumulation"
                     + (" (FSDP2: set_requires_gradient_sync(False) and set_reshard_after_backward(False) on the "
                        "model for all but the last micro-batch)" if lay.keep else ""))
    if lay.recompute:
        notes.append("rc: the model's own activation checkpointing of its blocks "
                     "(torch.utils.checkpoint), which autotp keeps")
    return Command(f"autotp shard {model} " + " ".join(flags), tuple(notes))
