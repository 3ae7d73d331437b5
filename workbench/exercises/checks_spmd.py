"""Checks for the exercises of notebook 04 (SPMD propagation), first part: Megatron's MLP
plan, and what the 04 checks share (the "Correct" line, placements shown short).

The MLP plan's output is compared with one device's; the student's plan is read with
the library's ``explain``, as the notebook does.  The cumsum rule's check is in
:mod:`.checks_spmd_rule`."""
from __future__ import annotations

import copy

import torch

from ..parallel.explain import explain
from ..parallel.module import STYLES, dist_parameters, parallelize
from ..parallel.placement import Replicate, fmt_placements
from ..parallel.dist_tensor import shard_tensor
from ..sim_mesh.mesh import Mesh
from ..text_width import wrap
from .feedback import CheckError, exercise

__all__ = ["check_mlp_plan"]


R = Replicate()


def _ok(msg: str, wrapped: bool = True) -> None:
    """Print the one "Correct: ..." line within text_width.WIDTH characters, continuations
    indented (JupyterLab breaks a longer line mid-word)."""
    print(wrap("Correct: " + msg))


def _fmt(ps) -> str:
    return fmt_placements(ps) if ps is not None else "-"


# ---- 04 SPMD propagation: Megatron's MLP plan --------------------------------------------------

def _mlp_hint(op: str, params: dict, hidden: int) -> str | None:
    """What the placements of the student's plan did wrong when ``op`` inserted a
    collective (nn.Linear stores its weight as (out_features, in_features))."""
    w0, w2 = params["0.weight"].placements[0], params["2.weight"].placements[0]
    if op == "relu":
        if w0.is_shard(1):
            return ("layer 0's weight [S(1)] splits its input features (nn.Linear's weight is "
                    "(out_features, in_features)), so each rank's output is a partial sum over "
                    "its share of the inputs. relu is not linear: it cannot act on partial "
                    "sums, so the planner reduces them first. Split layer 0's output features "
                    "instead: its output is then split by features, and relu acts on each "
                    "shard alone")
        return ("relu is not linear: it cannot act on partial sums, so the planner reduces "
                "them first. Split layer 0's output features (dim 0 of its (out_features, "
                "in_features) weight): relu then acts on each shard alone")
    if op == "linear" and w2.is_shard(0):
        return (f"layer 2's weight [S(0)] splits its output features, so each rank needs "
                f"all {hidden} input features of the rows it computes, and the hidden "
                "activations, split by features, must move. Split its input features instead (dim 1 of its (out_features, "
                "in_features) weight), exactly as layer 0 split its outputs: each rank's "
                "partial sum then needs nothing from the others")
    return None


@exercise
def check_mlp_plan(plan, d: int = 16, hidden: int = 64, tp: int = 4,
                   profile: str = "ascend-910b", styles: bool = False) -> None:
    """A ``parallelize`` plan for nn.Sequential(Linear(d, hidden), ReLU(), Linear(hidden, d))
    on ``tp`` ranks that shards both weights and needs no forward communication, given
    with placements per parameter (``styles``: style names such as 'colwise' allowed too;
    notebook 04's section 5 shows the plan with them, so its exercise asks placements)."""
    from torch import nn
    if not isinstance(plan, dict):
        raise CheckError(f"plan should be a dict from parameter names to placements, e.g. "
                         f"{{'0.weight': ['S(0)']}}; got {type(plan).__name__}")
    named = {k: v for k, v in plan.items() if isinstance(v, str) and v in STYLES}
    if named and not styles:
        raise CheckError(f"your plan names styles ({named}): section 5 already wrote the plan "
                         "that way. Give placements, one entry per parameter, e.g. "
                         "{'0.weight': ['S(?)'], ...}: which dim of each (out_features, "
                         "in_features) weight does each layer split?")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, d))
        X = torch.randn(8, d)
    ref = copy.deepcopy(model)
    mesh = Mesh.grid(tp, ["tp"])
    try:
        parallelize(model, mesh, plan)
    except (ValueError, TypeError) as e:
        raise CheckError(f"parallelize rejected your plan: {e}") from None
    params = dict(dist_parameters(model))
    for layer in ("0", "2"):
        w = params[f"{layer}.weight"]
        if all(p.is_replicate() for p in w.placements):
            raise CheckError(f"layer {layer}'s weight is replicated {_fmt(w.placements)}: every "
                             f"rank stores all {w.numel()} values and nothing is split. Give "
                             f"'{layer}.weight' a Shard placement")
    table = explain(model, shard_tensor(X, mesh, [R]), profile=profile)
    for i, row in enumerate(table.rows):
        if row.collectives:
            colls = ", ".join(f"{k} on {dim}" for k, dim in row.collectives)
            raise CheckError(f"with your plan {row.op} (layer {i}) inserts {colls} "
                             f"({row.bytes:,d} B per rank) in the forward: "
                             + (_mlp_hint(row.op, params, hidden) or row.reason))
    y = table.result
    if not torch.allclose(y.full(), ref(X), rtol=1e-5, atol=1e-5):
        raise CheckError("no communication, but the output differs from one device's: "
                         "a rule is wrong (please report it)")
    outs = " -> ".join(f"{r.op} {_fmt(r.outputs[0])}" for r in table.rows)
    b0 = params["0.bias"]
    note = (f" (0.bias stays {_fmt(b0.placements)}: every rank stores all {hidden} values and "
            f"cuts out its {hidden // tp}; Megatron splits it with the weight, ['S(0)'])"
            if all(p.is_replicate() for p in b0.placements) else "")
    _ok(f"{outs} with no forward communication; the output is {y.notation()}: one all-reduce "
        f"when it is needed whole (Megatron's g){note}", wrapped=True)
