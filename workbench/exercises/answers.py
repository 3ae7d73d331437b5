"""How the checks of notebooks 05, 06 and 08 read a student's integer answers (a rank, a
group of ranks, bucket sizes: Python, NumPy or torch integers, never bools or floats), and
the slip they share of taking the notebook's group size for the exercise's."""
from __future__ import annotations

import numbers
import operator

import torch

from .feedback import CheckError


def _index(value) -> int | None:
    """``value`` as an int: a Python, NumPy or torch integer (``operator.index``: a 0-d
    integer tensor read off ``Mesh.mesh``, as off torch's ``DeviceMesh.mesh``, is a rank);
    None for a bool (or a bool tensor: a mask, not a number), a float or anything else."""
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _int(name, value, what="an int") -> int:
    """``value`` as an int (Python, NumPy or torch integers; not bools, not floats)."""
    got = _index(value)
    if got is None:
        raise CheckError(f"{name} should be {what}, got {value!r}")
    return got


def _ints(name, value, what="ints") -> list[int]:
    if isinstance(value, torch.Tensor):
        # a 1-d integer tensor (a column of Mesh.mesh, as of torch's DeviceMesh.mesh) is
        # read as its ints; a mask, a float or a 2-d tensor is not a list of ints
        if value.dim() != 1 or value.dtype == torch.bool or value.is_floating_point() \
                or value.is_complex():
            raise CheckError(f"{name} should be a list of {what}, got a tensor of "
                             f"{value.dtype} and shape {tuple(value.shape)}: pass a list "
                             "of ints (its .tolist() if it holds them)")
        return [int(v) for v in value.tolist()]
    if isinstance(value, dict):
        raise CheckError(f"{name} should be a list of {what}, got a dict (a list of it would "
                         f"be its keys): pass a list, e.g. list(d.values())")
    try:
        items = list(value)
    except TypeError:
        raise CheckError(f"{name} should be a list of {what}, got {value!r}") from None
    if not all(_index(v) is not None for v in items):
        whole = all(isinstance(v, numbers.Real) and not isinstance(v, bool)
                    and float(v).is_integer() for v in items)
        text = any(isinstance(v, str) for v in items)
        shown = value if isinstance(value, (list, tuple)) else items   # (not a spent iterator)
        raise CheckError(f"{name} should be a list of {what}, got {shown!r}"
                         + (": give each as an int (int(x)), not a float" if whole else
                            ": give each as an int, not a str (no quotes)" if text else ""))
    return [_index(v) for v in items]


def _other_n(total, n, nb_n, letter, where) -> list:
    """The (value, message) of the slip that takes the notebook's group size ``nb_n`` (a
    variable already defined above the exercise) for the exercise's ``n``: ``total`` (the
    bytes before the (n-1)/n factor) times (nb_n-1)/nb_n."""
    if n == nb_n:
        return []
    return [((nb_n - 1) * total / nb_n, f"that takes {letter} = {nb_n} ({where}); the "
             f"exercise has {letter} = {n}")]
