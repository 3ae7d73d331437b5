"""Nested containers of tensors as capture walks them: their leaves, their tensors, and a
copy with each tensor swapped."""
from __future__ import annotations

import torch

from ..parallel.dist_tensor import DistTensor
from .graph import same_tuple


def _leaves(tree, out):
    if isinstance(tree, (torch.Tensor, DistTensor)):
        out.append(tree)
    elif isinstance(tree, (tuple, list)):
        for x in tree:
            _leaves(x, out)
    elif isinstance(tree, dict):
        for x in tree.values():
            _leaves(x, out)
    elif isinstance(tree, slice):
        _leaves([tree.start, tree.stop, tree.step], out)
    return out


def nested_tensors(tree) -> list:
    """The tensors and DistTensors in a (nested) list, tuple or dict."""
    if isinstance(tree, (torch.Tensor, DistTensor)):
        return [tree]
    items = tree.values() if isinstance(tree, dict) else \
        tree if isinstance(tree, (list, tuple)) else ()
    return [t for x in items for t in nested_tensors(x)]


def _swap(tree, fn):
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, tuple):
        return same_tuple(tree, [_swap(x, fn) for x in tree])
    if isinstance(tree, list):
        return [_swap(x, fn) for x in tree]
    if isinstance(tree, dict):
        return {k: _swap(x, fn) for k, x in tree.items()}
    if isinstance(tree, slice):
        return slice(_swap(tree.start, fn), _swap(tree.stop, fn), _swap(tree.step, fn))
    return tree
