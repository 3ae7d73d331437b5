"""A MoE layer's kernels around its expert GEMMs: the token permutation, the experts'
SwiGLU and the un-permutation, forward and backward, as (name, class, FLOPs, bytes,
launches) tuples, and their price on the modeled clock.

One place for both sides: the planner's MoE block (``plan.moe_cost.forward_ops`` /
``backward_ops``) lists these tuples among its kernels, and the expert-parallel layer's
clock (``expert_parallel_clock.record_layer``) records the same tuples, priced by the same
``cost.compute_time``, for the rows each rank actually holds (was: the clock priced the
expert GEMMs only, and the dry run of a MoE layout came out 0.89-0.97 of the estimate).

Sizes (``plan.moe_cost``'s module docstring): on one rank, ``Tn`` tokens enter the block,
``R`` (token, choice) rows leave it for the experts (c k Tn under balanced routing), ``M``
rows go through its experts, each a SwiGLU of width ``f``; ``h`` the model width, ``e``
bytes per element.  Counts: an element-wise kernel reads its inputs and writes its output
once; silu(x) = x / (1 + exp(-x)) is 4 FLOPs an element (``ops/swiglu.py``,
``ops_table.costs``), its gradient 8; the product's gradient 2 (dy b, dy a).
"""
from __future__ import annotations

from ...sim_mesh import cost as _cost

__all__ = ["permute", "swiglu", "unpermute", "unpermute_grad", "swiglu_grad", "dgrad_add",
           "permute_grad", "input_grad_add", "price"]


def permute(Tn, R, h, e) -> tuple:
    """The rows gathered in expert order: Tn tokens read, R rows written (no arithmetic)."""
    return ("permute", "data_movement", 0, e * (Tn * h + R * h), 1)


def swiglu(M, f, e, who: str = "expert") -> list:
    """silu(x w1) and its product with x w3 on M rows of width f."""
    return [(who + "_silu", "elementwise", 4 * M * f, 2 * e * M * f, 1),
            (who + "_swiglu_mul", "elementwise", M * f, 3 * e * M * f, 1)]


def unpermute(Tn, R, h, e) -> tuple:
    """Each token's k output rows times their (fp32) gates, summed: R rows and gates read,
    Tn tokens written."""
    return ("unpermute", "elementwise", 2 * R * h, e * (R * h + Tn * h) + 4 * R, 1)


def unpermute_grad(Tn, R, h, e) -> tuple:
    """The rows' gradient (the tokens' gradient times the gates) and the gates' (fp32)."""
    return ("unpermute_grad", "elementwise", 2 * R * h, e * (Tn * h + 2 * R * h) + 8 * R, 1)


def swiglu_grad(M, f, e, who: str = "expert") -> tuple:
    """(the product's gradient, silu's gradient): in autograd's order, w3's GEMMs between."""
    return ((who + "_swiglu_mul_grad", "elementwise", 2 * M * f, 5 * e * M * f, 1),
            (who + "_silu_grad", "elementwise", 8 * M * f, 3 * e * M * f, 1))


def dgrad_add(M, h, e) -> tuple:
    """The expert input's two gradients (through w1 and w3) summed."""
    return ("expert_dgrad_add", "elementwise", M * h, 3 * e * M * h, 1)


def permute_grad(Tn, R, h, e) -> tuple:
    """The rows' gradient scattered back to the tokens."""
    return ("permute_grad", "data_movement", 0, e * (R * h + Tn * h), 1)


def input_grad_add(Tn, h, e) -> tuple:
    """The block input's gradient through the permutation added to the router's (the
    router reads the same tokens)."""
    return ("moe_input_grad_add", "elementwise", Tn * h, 3 * e * Tn * h, 1)


def price(op: tuple, profile, dtype) -> float:
    """Seconds of one such tuple on ``profile`` (``cost.compute_time``, as the planner
    prices its compute tuples: ``plan.ep_cp._price_moe``)."""
    name, cls, flops, nbytes, launches = op
    return _cost.compute_time(flops, nbytes, profile, dtype, cls, launches)
