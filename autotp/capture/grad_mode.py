"""The model's own no-grad regions, seen by the capture, and kept by the graph that runs.

A forward may compute part of its value without gradients: ``with torch.no_grad():`` around recurrent steps
whose backward it truncates (Hugging Face's HRM-Text runs all but the last inner cycles so), around a teacher
or an EMA model, ``@torch.no_grad()`` on a helper, ``torch.inference_mode()``. Export traces under no_grad,
so nothing in the graph says which ops ran without gradients: the rewritten graph would send gradients
through them into weights the model never trains that way. While capturing, :func:`marking_grad_mode` tags
each node made inside such a region of the model's own code (``meta["custom"]["autotp_grad"]``: False, or
True inside an ``enable_grad`` nested in one); torch's own no-grad blocks inside the trace are not the
model's and are not tagged. :func:`detach_no_grad_regions` then ends each region where its value leaves it:
a tagged node that gradients could reach (it depends on a parameter) feeds every untagged reader through a
``detach``. The forward values are the same; the backward, as in the model, stops there.
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback

__all__ = ["KEY", "detach_no_grad_regions", "marking_grad_mode"]

KEY = "autotp_grad"
aten = torch.ops.aten
# context managers that set the grad mode on entry and restore it on exit: (class, the mode inside)
_MODES = ((torch.autograd.grad_mode.no_grad, False), (torch.autograd.grad_mode.enable_grad, True),
          (torch.autograd.grad_mode.inference_mode, None), (torch.autograd.grad_mode.set_grad_enabled, None))
# torch's decorator wrapper: ``@torch.no_grad()`` enters the context from here, for the function it wraps
_DECORATOR = "torch/utils/_contextlib.py"


@contextlib.contextmanager
def marking_grad_mode(user_code: object) -> Iterator[None]:
    """Inside: each grad-mode context the model's code enters (``user_code(filename)`` says whose a frame
    is) tags the nodes made until it exits with the mode it sets."""
    saved = [(cls, cls.__dict__.get("__enter__"), cls.__dict__.get("__exit__")) for cls, _ in _MODES]
    stacks: dict[int, list] = {}

    def entering(cls, inside, enter, exit_):
        def __enter__(self):
            out = enter(self) if enter is not None else super(cls, self).__enter__()
            mode = inside
            if mode is None:  # inference_mode(mode) and set_grad_enabled(mode) carry it
                mode = not bool(getattr(self, "mode", True)) if cls is torch.autograd.grad_mode.inference_mode \
                    else bool(getattr(self, "mode", False))
            tag = fx_traceback.annotate({KEY: mode}) if _called_by_model(user_code) else contextlib.nullcontext()
            tag.__enter__()
            stacks.setdefault(id(self), []).append(tag)
            return out

        def __exit__(self, *exc):
            tags = stacks.get(id(self))
            if tags:
                tags.pop().__exit__(*exc)
                if not tags:
                    del stacks[id(self)]
            return exit_(self, *exc) if exit_ is not None else super(cls, self).__exit__(*exc)

        return __enter__, __exit__

    for cls, inside in _MODES:
        enter, exit_ = cls.__dict__.get("__enter__"), cls.__dict__.get("__exit__")
        cls.__enter__, cls.__exit__ = entering(cls, inside, enter, exit_)
    try:
        with fx_traceback.preserve_node_meta():
            yield
    finally:
        for cls, enter, exit_ in saved:
            for name, was in (("__enter__", enter), ("__exit__", exit_)):
                if was is None:
                    delattr(cls, name)
                else:
                    setattr(cls, name, was)


def _called_by_model(user_code: object) -> bool:
    """Whether the grad-mode context being entered is the model's: entered by the model's code, or by torch's
    decorator wrapper around a function of the model's (``@torch.no_grad()`` on a rotary embedding)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    if frame is None:
        return False
    filename = frame.f_code.co_filename
    if filename.replace("\\", "/").endswith(_DECORATOR):
        wrapped = frame.f_locals.get("func")
        code = getattr(wrapped, "__code__", None)
        if code is None:
            return False
        filename = code.co_filename
    return not user_code(filename)


# casts that return their input itself when it already has the dtype (``x.to(x.dtype)``, ``x.type_as(x)``)
_NO_OP_CASTS = (aten.to.dtype, aten.to.dtype_layout, aten.to.other, aten.type_as.default)


def _made_in_region(node: fx.Node) -> bool:
    """Whether the region made ``node``'s value. A cast to the dtype its input already has returns the input
    itself, and export then hands the node to every later reader of that tensor: Dots3-Note's indexer, under
    ``@torch.no_grad()``, reads ``hidden_states.to(float32)`` of a float32 input, and the gate projection after it
    reads the same tensor, with its gradient, as ``g_proj(hidden_states)``; the region made nothing there."""
    while node.target in _NO_OP_CASTS and not _with_grad(node) and isinstance(node.args[0], fx.Node):
        src, val = node.args[0], node.meta.get("val")
        was = src.meta.get("val")
        copies = node.kwargs.get("copy", False) or node.kwargs.get("memory_format") not in (None, torch.preserve_format) \
            or (node.target in (aten.to.dtype, aten.to.other) and len(node.args) > 3 and node.args[3])
        if copies or not isinstance(val, torch.Tensor) or not isinstance(was, torch.Tensor) or val.dtype != was.dtype \
                or val.device != was.device:
            return True
        node = src
    return not _with_grad(node)


def _with_grad(node: fx.Node) -> bool:
    """Whether the node ran outside every no-grad region of the model's own."""
    custom = node.meta.get("custom")
    return not (isinstance(custom, dict) and custom.get(KEY) is False)


def detach_no_grad_regions(gm: fx.GraphModule) -> bool:
    """Every value a no-grad region of the model's own gives to code outside it passes through a ``detach``,
    where gradients could reach it (it depends on a parameter). Returns whether the graph changed."""
    params = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    reached: set[fx.Node] = set()  # nodes whose value depends on a parameter
    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and node.target in params or \
                node.op != "get_attr" and any(i in reached for i in node.all_input_nodes):
            reached.add(node)
        if _with_grad(node) or node not in reached or node.op not in ("call_function", "call_module"):
            continue
        outside = [u for u in node.users if _with_grad(u)]
        val = node.meta.get("val")
        if not outside or not isinstance(val, torch.Tensor) or not (val.dtype.is_floating_point or val.is_complex()):
            continue
        if not _made_in_region(node):
            continue  # the value from before the region, returned as it is: code outside reads it with its gradient
        with gm.graph.inserting_after(node):
            cut = gm.graph.call_function(aten.detach.default, (node,))
        cut.meta = {k: v for k, v in node.meta.items() if k != "custom"}  # the same value, outside the region
        for u in outside:
            u.replace_input_with(node, cut)
        changed = True
    return changed
