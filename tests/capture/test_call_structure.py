"""The structure of a call's inputs and outputs (:mod:`autotp.capture.structure`): any object graph of
tensors flattens and rebuilds, and an object reached by many paths is walked once."""
from __future__ import annotations

import torch

from autotp.capture.structure import flatten, unflatten


class _Node:
    def __init__(self, left: object, right: object, t: torch.Tensor):
        self.left, self.right, self.t = left, right, t


def test_an_object_shared_by_many_paths_is_walked_once():
    """A chain of 30 records, each referring twice to the next (as a cache's layers share a config): 2^30 paths
    to the last one, which the walk reads once; the rebuilt objects hold the same tensors."""
    leaf = _Node(None, None, torch.zeros(1))
    node, made = leaf, [leaf]
    for i in range(30):
        node = _Node(node, node, torch.full((1,), float(i)))
        made.append(node)
    tensors, spec = flatten(node)
    assert len(tensors) == 17  # one per record down to the depth limit (16), each walked once, not 2^17 - 1
    back = unflatten(tensors, spec)
    assert type(back) is _Node and back is not node
    assert torch.equal(back.t, node.t) and torch.equal(back.left.t, node.left.t)
    assert back.left.t is back.right.t  # both paths read the one tensor


def test_a_cycle_ends_at_the_object_itself():
    a = _Node(None, None, torch.ones(2))
    a.left = a  # a parent pointer
    tensors, spec = flatten(a)
    back = unflatten(tensors, spec)
    assert len(tensors) == 1 and torch.equal(back.t, a.t) and back.left is a
