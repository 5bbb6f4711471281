"""The Plan: an immutable, JSON-serializable description of how one captured graph is sharded.

Keyed by parameter and module names for what a user reads (which weight is cut on which dim, which
collective goes where and how big it is), and by graph node names for what the passes execute (which
constants change, where the conjugate operators go). The CLI renders it; the passes execute it.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from autotp.propagate import Rewrite
from autotp.shard_spec import Segment

PLAN_VERSION = 1


@dataclass(frozen=True)
class ParamShard:
    """How one parameter is cut. ``role``: "column" (output features) or "row" (input features)."""

    role: str
    module: str
    dim: int
    segments: tuple[Segment, ...]
    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...]

    def replicated_blocks(self, tp: int) -> bool:
        """Some blocks live on several ranks (kv heads fewer than tp): their gradients are summed."""
        return any(s.parts < tp for s in self.segments)


@dataclass(frozen=True)
class Collective:
    """One collective of a forward/backward pass. ``elements`` is symbolic in batch and sequence."""

    kind: str  # "all_reduce"
    op: str  # "sum" | "max"
    direction: str  # "forward" | "backward"
    module: str
    node: str  # graph node the operator wraps
    shape: tuple[str, ...]


@dataclass(frozen=True)
class PairPlan:
    """A column→row pair: what the passes insert around it."""

    module: str
    columns: tuple[str, ...]  # column matmul node names
    column_weights: tuple[str, ...]
    enter: tuple[str, ...]  # input nodes that get the identity-forward / all-reduce-backward operator
    row: str  # row matmul node name
    row_weight: str
    row_bias: str | None  # parameter added once, after the all-reduce


@dataclass(frozen=True)
class Plan:
    tp: int
    params: tuple[tuple[str, ParamShard], ...] = ()
    pairs: tuple[PairPlan, ...] = ()
    rewrites: tuple[Rewrite, ...] = ()
    collectives: tuple[Collective, ...] = ()
    random_nodes: tuple[str, ...] = ()  # random ops inside sharded regions: per-rank RNG stream
    replicated: tuple[tuple[str, str], ...] = ()  # (module, reason) left unsharded
    version: int = field(default=PLAN_VERSION)

    def param(self, name: str) -> ParamShard | None:
        return dict(self.params).get(name)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["params"] = {name: asdict(p) for name, p in self.params}
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        if d.get("version") != PLAN_VERSION:
            raise ValueError(f"plan version {d.get('version')} is not supported (expected {PLAN_VERSION})")

        def seg(xs):
            return tuple(Segment(**s) for s in xs)

        params = tuple(
            (name, ParamShard(p["role"], p["module"], p["dim"], seg(p["segments"]), tuple(p["full_shape"]),
                              tuple(p["local_shape"])))
            for name, p in d["params"].items()
        )
        pairs = tuple(PairPlan(**{k: tuple(v) if isinstance(v, list) else v for k, v in p.items()}) for p in d["pairs"])
        rewrites = tuple(Rewrite(**r) for r in d["rewrites"])
        collectives = tuple(Collective(**{k: tuple(v) if isinstance(v, list) else v for k, v in c.items()})
                            for c in d["collectives"])
        return cls(d["tp"], params, pairs, rewrites, collectives, tuple(d["random_nodes"]),
                   tuple(tuple(r) for r in d["replicated"]), d["version"])

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))
