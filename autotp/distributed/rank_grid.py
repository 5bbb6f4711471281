"""The rank grid: which global rank holds which (tp, cp, dp, pp) coordinate.

Megatron's order: TP innermost (adjacent ranks), then CP (context parallelism), then DP, then PP. A rank ``r``
sits at ``tp = r % tp``, ``cp = (r // tp) % cp``, ``dp = (r // (tp * cp)) % dp``, ``pp = r // (tp * cp * dp)``.
Without context parallelism (cp 1) the cp coordinate is left out everywhere (groups, mesh, coordinates).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["GROUP_KINDS", "MESH_CP", "MESH_DP", "MESH_PP", "MESH_TP", "RankGrid"]

# the DeviceMesh's dim names, outermost first (Megatron's order: tp innermost); cp only with context parallelism
MESH_PP, MESH_DP, MESH_CP, MESH_TP = "pp", "dp", "cp", "tp"

GROUP_KINDS: tuple[str, ...] = ("tp", "cp", "dp", "pp", "mp", "embedding")


def _check_int(name: str, value: object) -> None:
    # bool is an int subclass; --tp True is a caller bug, not a size of 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")


@dataclass(frozen=True)
class RankGrid:
    """A tp × cp × dp × pp decomposition of ``world_size`` ranks, validated on construction."""

    world_size: int
    tp: int
    pp: int
    dp: int
    gpus_per_node: int | None = None
    cp: int = 1

    @classmethod
    def build(
        cls,
        world_size: int,
        tp: int,
        pp: int = 1,
        dp: int | None = None,
        gpus_per_node: int | None = None,
        cp: int = 1,
    ) -> RankGrid:
        """Build a grid, deriving ``dp = world_size / (tp * cp * pp)`` when not given."""
        if dp is None:
            for name, value in (("world_size", world_size), ("tp", tp), ("cp", cp), ("pp", pp)):
                _check_int(name, value)
            _check_positive(world_size=world_size, tp=tp, cp=cp, pp=pp)
            if world_size % (tp * cp * pp):
                shown = f"tp ({tp}) × cp ({cp}) × pp ({pp})" if cp > 1 else f"tp ({tp}) × pp ({pp})"
                raise ValueError(f"{shown} = {tp * cp * pp} does not divide world size {world_size}")
            dp = world_size // (tp * cp * pp)
        return cls(world_size=world_size, tp=tp, pp=pp, dp=dp, gpus_per_node=gpus_per_node, cp=cp)

    @property
    def _sizes(self) -> dict[str, int]:
        """The dims, outermost first (cp only where there is context parallelism)."""
        return {MESH_PP: self.pp, MESH_DP: self.dp, **({MESH_CP: self.cp} if self.cp > 1 else {}), MESH_TP: self.tp}

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "dp", "cp"):
            _check_int(name, getattr(self, name))
        if self.gpus_per_node is not None:
            _check_int("gpus_per_node", self.gpus_per_node)
        _check_positive(world_size=self.world_size, tp=self.tp, cp=self.cp, pp=self.pp, dp=self.dp)
        product = self.tp * self.cp * self.dp * self.pp
        if product != self.world_size:
            cp = f" × cp ({self.cp})" if self.cp > 1 else ""
            raise ValueError(
                f"tp ({self.tp}){cp} × dp ({self.dp}) × pp ({self.pp}) = {product} "
                f"≠ world size {self.world_size}"
            )
        g = self.gpus_per_node
        if g is not None:
            if g < 1:
                raise ValueError(f"gpus per node must be >= 1, got {g}")
            # A TP group all-reduces twice per layer; crossing a node boundary
            # would put that traffic on the inter-node network.
            if self.tp > g:
                raise ValueError(
                    f"tp ({self.tp}) exceeds gpus per node ({g}): "
                    "TP groups must stay inside a node"
                )
            if g % self.tp:
                raise ValueError(
                    f"gpus per node ({g}) is not divisible by tp ({self.tp}): "
                    "some TP group would straddle two nodes"
                )

    def rank(self, tp: int, dp: int, pp: int, cp: int = 0) -> int:
        """Global rank at coordinates (tp, dp, pp, cp)."""
        for name, value, size in (("tp", tp, self.tp), ("cp", cp, self.cp), ("dp", dp, self.dp),
                                  ("pp", pp, self.pp)):
            if not 0 <= value < size:
                raise ValueError(f"{name} coordinate {value} out of range [0, {size})")
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank``: tp, (cp,) dp, pp, and node when gpus_per_node is known."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range [0, {self.world_size})")
        out = {"tp": rank % self.tp}
        if self.cp > 1:
            out["cp"] = (rank // self.tp) % self.cp
        out["dp"] = (rank // (self.tp * self.cp)) % self.dp
        out["pp"] = rank // (self.tp * self.cp * self.dp)
        if self.gpus_per_node is not None:
            out["node"] = rank // self.gpus_per_node
        return out

    @property
    def num_nodes(self) -> int | None:
        """Nodes spanned, when gpus_per_node is known."""
        if self.gpus_per_node is None:
            return None
        return -(-self.world_size // self.gpus_per_node)

    def _groups(self, along: str) -> list[list[int]]:
        """The ranks that differ only in their ``along`` coordinate ("tp", "cp", "dp" or "pp"), one list for
        each value of the others, the outer of those (pp, dp, cp, tp) varying slowest."""
        sizes = self._sizes
        others = [k for k in sizes if k != along]
        groups: list[list[int]] = []
        for fixed in itertools.product(*(range(sizes[k]) for k in others)):
            at = dict(zip(others, fixed))
            groups.append([self.rank(**{**at, along: k}) for k in range(sizes[along])])
        return groups

    @property
    def tp_groups(self) -> list[list[int]]:
        """Ranks sharing (dp, pp): adjacent blocks of ``tp`` ranks."""
        return self._groups("tp")

    @property
    def cp_groups(self) -> list[list[int]]:
        """Ranks sharing (tp, dp, pp): each runs a chunk of the same sequences (context parallelism)."""
        return self._groups("cp")

    @property
    def dp_groups(self) -> list[list[int]]:
        """Ranks sharing (tp, pp): the gradient all-reduce groups."""
        return self._groups("dp")

    @property
    def pp_groups(self) -> list[list[int]]:
        """Ranks sharing (tp, dp), ordered by stage."""
        return self._groups("pp")

    @property
    def mp_groups(self) -> list[list[int]]:
        """Model-parallel groups (tp × pp): ranks sharing a dp (and cp) index."""
        return [
            [self.rank(t, d, p, c) for p in range(self.pp) for t in range(self.tp)]
            for d in range(self.dp) for c in range(self.cp)
        ]

    @property
    def embedding_groups(self) -> list[list[int]]:
        """First and last stage of each pipeline group (tied embedding / LM head)."""
        return [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in self.pp_groups]

    def groups(self) -> dict[str, list[list[int]]]:
        """All group kinds, keyed "tp", ("cp",) "dp", "pp", "mp", "embedding"."""
        return {
            "tp": self.tp_groups,
            **({"cp": self.cp_groups} if self.cp > 1 else {}),
            "dp": self.dp_groups,
            "pp": self.pp_groups,
            "mp": self.mp_groups,
            "embedding": self.embedding_groups,
        }

    def to_dict(self) -> dict[str, Any]:
        """Sizes and groups as plain JSON-able data."""
        return {
            "world_size": self.world_size,
            "tp": self.tp,
            **({"cp": self.cp} if self.cp > 1 else {}),
            "dp": self.dp,
            "pp": self.pp,
            "gpus_per_node": self.gpus_per_node,
            "groups": self.groups(),
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def device_mesh(self, device_type: str) -> DeviceMesh:
        """Build the ("pp", "dp", "tp") DeviceMesh for this grid (("pp", "dp", "cp", "tp") with context
        parallelism).

        Needs an initialised default process group of exactly ``world_size``
        ranks (``torch.distributed.init_process_group``); every rank must call it.
        Mesh shape (pp, dp, tp) puts tp last, i.e. innermost, matching ``coords``.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "RankGrid.device_mesh needs an initialised process group; "
                "call torch.distributed.init_process_group first"
            )
        actual = dist.get_world_size()
        if actual != self.world_size:
            raise RuntimeError(
                f"process group has {actual} ranks but the rank grid expects {self.world_size}"
            )
        sizes = self._sizes
        mesh = init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))
        # Cheap local check (no communication) that torch's mesh agrees with
        # the table the rest of autotp plans against.
        rank = dist.get_rank()
        for kind in sizes:
            expected = next(g for g in self._groups(kind) if rank in g)
            got = dist.get_process_group_ranks(mesh.get_group(kind))
            if sorted(got) != expected:
                raise RuntimeError(
                    f"DeviceMesh {kind} group for rank {rank} is {got}, the rank grid expects {expected}"
                )
        return mesh


def _check_positive(**sizes: int) -> None:
    bad = {name: value for name, value in sizes.items() if value < 1}
    if bad:
        shown = ", ".join(f"{name} ({value})" for name, value in bad.items())
        every = ", ".join(f"{name}={value}" for name, value in sizes.items())
        raise ValueError(f"{shown} must be >= 1 (got {every})")
