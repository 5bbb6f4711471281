"""Graph rewrites that execute a Plan. Each pass is a plain function ``(gm, plan) -> gm``.

The runner owns ``lint()`` and ``recompile()`` and, when a pass fails, says which passes ran before it.
Passes never read the rank or call torch.distributed.

Three more rewrites put the model's own tagged regions back, as runtime modules, into the graph once it is bound to
the model (its pieces bound, its random ops to their streams): ``outline_functions``, ``outline_autocast``,
``outline_recompute`` (``gm -> count``, each lints and recompiles the graphs it changes). Where they run
among the steps after planning is :data:`autotp.parallel.apply.APPLY_ORDER`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.fx as fx

from autotp.errors import own_bug
from autotp.passes.context_parallel import context_parallel
from autotp.passes.expert_parallel import expert_parallel
from autotp.passes.gather_outputs import gather_outputs
from autotp.passes.graph_cuts import graph_cuts
from autotp.passes.insert_collectives import insert_collectives
from autotp.passes.local_inputs import local_inputs
from autotp.passes.outline_autocast import outline_autocast
from autotp.passes.outline_functions import outline_functions
from autotp.passes.outline_recompute import outline_recompute
from autotp.passes.region_rng import region_rng
from autotp.passes.rewrite_constants import rewrite_constants
from autotp.passes.sequence_grads import sequence_grads
from autotp.passes.sequence_split import sequence_split
from autotp.passes.sharded_stats import sharded_stats
from autotp.passes.slice_replicated import slice_replicated
from autotp.passes.split_stages import split_stages
from autotp.passes.split_units import split_units
from autotp.passes.row_bias import row_bias_after_reduce
from autotp.passes.vocab_embedding import vocab_embedding
from autotp.passes.vocab_loss import vocab_loss
from autotp.passes.vocab_output import vocab_output
from autotp.plan.plan import Plan

Pass = Callable[[fx.GraphModule, Plan], fx.GraphModule]

# The rewrite step of autotp.parallel.apply.APPLY_ORDER. Where the order matters: sequence_split and
# sequence_grads read edges the plan names in the captured graph, so they run before insert_collectives puts
# f and g on them; row_bias_after_reduce adds a row's bias after the collective insert_collectives put after
# that row, so it runs after; context_parallel runs the finished tensor-parallel graph on this rank's chunk of
# the sequence, so it runs last.
DEFAULT_PASSES: tuple[Pass, ...] = (rewrite_constants, sequence_split, sequence_grads, insert_collectives, expert_parallel,
                                    sharded_stats, row_bias_after_reduce,
                                    vocab_embedding, vocab_loss, vocab_output, gather_outputs, local_inputs,
                                    slice_replicated, graph_cuts, region_rng, context_parallel)


class PassError(RuntimeError):
    pass


def run_passes(gm: fx.GraphModule, plan: Plan, passes: Sequence[Pass] = DEFAULT_PASSES) -> fx.GraphModule:
    done: list[str] = []
    for p in passes:
        try:
            gm = p(gm, plan)
            gm.graph.lint()
        except Exception as e:
            if own_bug(e):  # autotp's own bug: shown, never a verdict
                raise
            raise PassError(f"pass {p.__name__} failed (after: {', '.join(done) or 'none'}): {e}") from e
        done.append(p.__name__)
    gm.recompile()
    return gm


__all__ = ["DEFAULT_PASSES", "PassError", "context_parallel", "expert_parallel", "gather_outputs", "graph_cuts",
           "insert_collectives", "local_inputs", "outline_autocast", "outline_functions", "outline_recompute",
           "region_rng",
           "rewrite_constants", "row_bias_after_reduce", "run_passes", "sequence_grads", "sequence_split",
           "sharded_stats", "slice_replicated", "split_stages", "split_units",
           "vocab_embedding", "vocab_loss", "vocab_output"]
