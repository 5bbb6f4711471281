"""Look into the autocast regions export wraps: ``with torch.autocast(...):`` blocks and functions decorated
with ``@torch.autocast``/``torch.amp.custom_fwd`` become a ``wrap_with_autocast`` higher-order op whose body is
a submodule, which no rule of analysis reads. :func:`inline_autocast` copies each body into the graph in the
op's place, its nodes tagged with the region's arguments (:class:`~autotp.operators.autocast.AutocastRegion`),
so analysis and the passes see plain ops (a q/k norm computed in fp32 is a norm like any other); after the
rewrite the tagged nodes are outlined again under the same ``torch.autocast``
(:func:`~autotp.passes.outline_autocast.outline_autocast`).

Before::

    submod = get_attr[submod_1]
    wrapped = higher_order.wrap_with_autocast("cpu", bf16, False, None, submod, q, weight)
    normed = getitem(wrapped, 0)

After::

    to = aten.to.dtype(q, float32)         # custom[autotp_autocast] = AutocastRegion("cpu", bf16, False, None, 0)
    ...
    normed = aten.mul.Tensor(mul, weight)  # the same tag
"""
from __future__ import annotations

import itertools
import operator

import torch
import torch.fx as fx

from autotp.operators.autocast import KEY, AutocastRegion

_WRAP = getattr(torch.ops.higher_order, "wrap_with_autocast", None)


def inline_autocast(gm: fx.GraphModule, _ids: itertools.count | None = None) -> bool:
    """Inline every ``wrap_with_autocast`` of ``gm`` (nested ones too), tagging the copied nodes; whether
    any was found."""
    ids = _ids if _ids is not None else itertools.count()
    changed = False
    for node in list(gm.graph.nodes):
        if _WRAP is None or node.op != "call_function" or node.target is not _WRAP:
            continue
        device_type, dtype, enabled, cache, sub, *operands = node.args
        body = getattr(gm, sub.target)
        inline_autocast(body, ids)  # an inner region keeps its own tag
        region = AutocastRegion(device_type, dtype, bool(enabled), cache, next(ids))
        env: dict[fx.Node, object] = {}
        inputs = iter(operands)
        outs: tuple = ()
        with gm.graph.inserting_before(node):
            for b in body.graph.nodes:
                if b.op == "placeholder":
                    env[b] = next(inputs)
                elif b.op == "output":
                    outs = tuple(b.args[0])
                elif b.op == "get_attr":  # a nested region's own body, or a constant of the body
                    name = _free_name(gm, b.target)
                    setattr(gm, name, getattr(body, b.target))
                    env[b] = gm.graph.get_attr(name)
                    env[b].meta = dict(b.meta)
                else:
                    env[b] = copy = gm.graph.node_copy(b, lambda a: env[a])
                    custom = dict(copy.meta.get("custom") or {})
                    custom.setdefault(KEY, region)
                    copy.meta["custom"] = custom
        for user in list(node.users):
            if user.target is operator.getitem:
                user.replace_all_uses_with(env[outs[user.args[1]]])
                gm.graph.erase_node(user)
        if node.users:  # the op's result used whole (never in export's output): leave nothing half done
            raise AssertionError(f"wrap_with_autocast {node.name} is used other than item by item")
        gm.graph.erase_node(node)
        if not sub.users:
            gm.graph.erase_node(sub)
            delattr(gm, sub.target)
        changed = True
    if changed:
        gm.graph.lint()
    return changed


def _free_name(gm: fx.GraphModule, base: str) -> str:
    for k in itertools.count():
        name = f"{base}_inlined_{k}"
        if not hasattr(gm, name):
            return name
    raise AssertionError  # unreachable


def renamed_region(meta: dict, block: str) -> dict:
    """A copied block's node meta: its autocast region numbered apart from the block it was copied from."""
    custom = meta.get("custom")
    if isinstance(custom, dict) and isinstance(custom.get(KEY), AutocastRegion):
        return {**meta, "custom": {**custom, KEY: custom[KEY].renamed(block)}}
    return meta
