"""Checks for the exercise of notebook 06 on PyTorch's tensor-parallel API
(``parallelize_module`` with ``ColwiseParallel``, ``RowwiseParallel``,
``PrepareModuleInput``, ``SequenceParallel``).

As in :mod:`.checks`: a right answer prints one "Correct: ..." line; a wrong one raises
:class:`~.checks.CheckError` saying what is wrong.  The student's plan is run, not read:
it is applied to the MLP half of the course's tiny Llama block, one forward and backward
run on a simulated mesh, and the result is held to one device (values and gradients), to
the parameter layouts of Megatron-LM's MLP (Shoeybi et al. 2019, sec. 3: the first linear
split by columns, the second by rows) and to Megatron's communication: one all-reduce of
the activation forward (g) and one backward (f), counted in the trace.
"""
from __future__ import annotations

import copy
import fnmatch

import torch
from torch import nn

from ..models.config import get_config
from ..models.llama import MLP, RMSNorm
from ..parallel.dist_tensor import DistTensor, shard_tensor
from ..parallel.placement import Partial, Replicate, Shard, fmt_placements
from ..parallel.tp_api import parallelize_module
from ..parallel.tp_from_torch import from_torch_style, is_torch_style
from ..parallel.tp_prepare import PrepareModuleInput
from ..parallel.tp_styles import ColwiseParallel, RowwiseParallel
from ..sim_mesh.mesh import Mesh
from ..sim_mesh.trace import trace
from .checks import _ok
from .feedback import CheckError, exercise

__all__ = ["check_tp_mlp_plan"]


class MLPHalf(nn.Module):
    """The MLP half of the course's Llama block (``workbench.models.llama.Block``), with
    its names: ``x + mlp(mlp_norm(x))``."""

    def __init__(self, cfg):
        super().__init__()
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x):                                                    # (B, S, h)
        return x + self.mlp(self.mlp_norm(x))


_COL = ("ColwiseParallel: its weight Shard(0) splits the output features, so each rank "
        "computes its own slice of the hidden activation with no communication")
_ROW = ("RowwiseParallel: its weight Shard(1) splits the input features, the hidden "
        "activation w1 and w3 leave split, and each rank's product is a partial sum")


def _layouts_wrong(model, plan) -> str | None:
    """What is wrong with the parameters' tp layouts, or None."""
    want = {"mlp.w1.weight": Shard(0), "mlp.w3.weight": Shard(0), "mlp.w2.weight": Shard(1)}
    for name, p in model.named_parameters():
        got = p.placements[0] if isinstance(p, DistTensor) else None
        if name == "mlp_norm.weight":
            if got is not None:
                return ("your plan gives mlp_norm a style (SequenceParallel?): that splits the "
                        "residual stream over the sequence, which is sequence parallelism; "
                        "here the stream is replicated and the norm runs whole on every rank: "
                        "leave mlp_norm out of the plan")
            continue
        lin = name.split(".")[1]
        if got is None:
            style = next((type(v).__name__ for k, v in plan.items()
                          if isinstance(k, str) and _matches(k, f"mlp.{lin}")), None)
            why = (f"mlp.{lin} is not in your plan" if style is None else
                   f"your plan gives mlp.{lin} {style}, which lays out no weight")
            return (f"{why}, so its weight stays whole on every rank; give it "
                    + (_COL if lin != "w2" else _ROW))
        if got != want[name]:
            if lin == "w2":
                return ("w2 got ColwiseParallel: it contracts over the hidden features, which "
                        "w1 and w3 already split; colwise would first gather the whole hidden "
                        "activation (b s d_ff) on every rank. Use " + _ROW)
            return (f"{lin} got RowwiseParallel: its input is the whole residual stream, so "
                    f"splitting its input features makes its output a partial sum, and SiLU "
                    f"of a partial sum is not the sum of SiLUs: it must be all-reduced before "
                    f"the gate. Use " + _COL)
    return None


def _apply(plan, tp: int):
    if not isinstance(plan, dict):
        raise CheckError(f"plan should be a dict of module names to styles, e.g. "
                         f"{{'mlp.w1': ColwiseParallel(), ...}}; got a {type(plan).__name__}")
    bad = [k for k in plan if not isinstance(k, str) or not (k == "mlp_norm" or k == "mlp"
                                                              or k.startswith("mlp."))]
    if bad:
        raise CheckError(f"plan key {bad[0]!r} names no module of the MLP half of a block; its "
                         "modules are 'mlp_norm', 'mlp', 'mlp.w1', 'mlp.w3', 'mlp.w2' (names "
                         "relative to the block, as torchtitan applies its plan block by block)")
    enter = plan.get("mlp")
    if is_torch_style(enter):
        enter = from_torch_style(enter)
    if isinstance(enter, PrepareModuleInput) and enter.input_layouts \
            and enter.input_layouts[0] not in (None, Replicate()):
        raise CheckError(f"your PrepareModuleInput says the MLP's input arrives "
                         f"{fmt_placements(enter.input_layouts[:1])}, but without sequence "
                         "parallelism the residual stream is whole on every rank: "
                         "input_layouts=(Replicate(),). (torch would take each rank's whole "
                         "tensor for a shard and gather a sequence t times too long)")
    if isinstance(enter, PrepareModuleInput) and enter.desired_input_layouts \
            and enter.desired_input_layouts[0] not in (None, Replicate()):
        raise CheckError(f"your PrepareModuleInput hands the MLP its input as "
                         f"{fmt_placements(enter.desired_input_layouts[:1])}: w1 and w3 would "
                         "each gather it back, since a column-parallel linear multiplies every "
                         "token by its weight columns. f hands the block the input as the "
                         "column-parallel linears need it: check desired_input_layouts")
    for key, style in plan.items():
        if is_torch_style(style):
            style = from_torch_style(style)
        lin = next((n for n in ("w1", "w3") if _matches(key, f"mlp.{n}")), None)
        if (isinstance(style, ColwiseParallel) and lin
                and style.output_layouts[0] not in (Shard(-1), Shard(2))):
            raise CheckError(f"your ColwiseParallel for {lin} makes its output "
                             f"{fmt_placements(style.output_layouts)}: that gathers the hidden "
                             "activation (b s d_ff) on every rank, which w2 splits again. Keep "
                             "ColwiseParallel's default output_layouts, the hidden features "
                             "split, as RowwiseParallel takes them")
        if (isinstance(style, RowwiseParallel) and _matches(key, "mlp.w2")
                and style.input_layouts[0] not in (Shard(-1), Shard(2))):
            raise CheckError(f"your RowwiseParallel for w2 says its input arrives "
                             f"{fmt_placements(style.input_layouts)}, but w1 and w3 hand it "
                             "the hidden activation split over its features, Shard(-1). (In "
                             "torch ColwiseParallel hands on each rank's local slice, and w2 "
                             "would take that slice for the whole tensor: wrong shapes.) Keep "
                             "RowwiseParallel's default input_layouts")
    cfg = get_config("tiny")
    torch.manual_seed(0)
    ref = MLPHalf(cfg)
    with torch.no_grad():                 # a norm weight not all ones: its gradient matters
        ref.mlp_norm.weight.add_(torch.randn(cfg.d_model) * 0.1)
    model = copy.deepcopy(ref)
    mesh = Mesh.grid(tp, ["tp"])
    try:
        parallelize_module(model, mesh, plan)
    except Exception as e:                # the student's plan: any error is an answer
        raise CheckError(f"parallelize_module refused your plan: {type(e).__name__}: {e}") \
            from None
    return cfg, ref, model, mesh


def _matches(key: str, name: str) -> bool:
    """Whether plan ``key`` names module ``name`` (fnmatch per dotted token, as torch and
    ``parallelize_module`` resolve it)."""
    a, b = key.split("."), name.split(".")
    return len(a) == len(b) and all(fnmatch.fnmatchcase(n, k) for k, n in zip(a, b))


def _messages(tr):
    """(kind, buffer bytes) of each collective rank 0 took part in."""
    return [(e.name, e.args.get("buffer_bytes")) for e in tr.collectives() if 0 in e.ranks]


@exercise
def check_tp_mlp_plan(plan, tp: int = 2, batch: int = 2) -> None:
    """``plan`` (a dict for ``parallelize_module``, names relative to one Llama block) lays
    out the block's MLP as Megatron does, without sequence parallelism: w1 and w3
    colwise, w2 rowwise, and the MLP's input entering the tensor-parallel region once
    (``PrepareModuleInput``), so that one step sends one all-reduce of the activation
    forward and one backward."""
    cfg, ref, model, mesh = _apply(plan, tp)
    wrong = _layouts_wrong(model, plan)
    if wrong:
        raise CheckError(wrong)
    g = torch.Generator().manual_seed(1)
    X = torch.randn(batch, cfg.seq_len, cfg.d_model, generator=g)           # (B, S, h)
    W = torch.randn(batch, cfg.seq_len, cfg.d_model, generator=g)           # loss weights
    Xr = X.clone().requires_grad_()
    (ref(Xr) * W).sum().backward()
    x = shard_tensor(X, mesh, [Replicate()]).requires_grad_()   # the replicated stream
    with trace("a100") as tr:
        try:
            y = model(x)
            fwd = _messages(tr)
            if not isinstance(y, DistTensor):
                raise CheckError(f"the block returned a {type(y).__name__}, not a DistTensor")
            (y * W).sum().backward()
        except CheckError:
            raise
        except Exception as e:            # the student's plan: any error is an answer
            raise CheckError(f"running the block under your plan raised "
                             f"{type(e).__name__}: {e}") from None
    bwd = _messages(tr)[len(fwd):]
    if y.placements != (Replicate(),):
        p = y.placements[0]
        hint = ("w2's output is reduce-scattered onto the sequence: that is sequence "
                "parallelism's g; here the residual stream is replicated, so g is an "
                "all-reduce: RowwiseParallel's default output_layouts=Replicate()"
                if p == Shard(1) else
                "the partial sums of w2 are never reduced: RowwiseParallel's "
                "output_layouts=Replicate() (the default) all-reduces them"
                if isinstance(p, Partial) else
                "the residual stream must leave the MLP as it came, Replicate()")
        raise CheckError(f"the block's output is {fmt_placements(y.placements)}: {hint}")
    torch.testing.assert_close(y.full(), ref(X), msg="the block's output differs from one "
                               "device's")        # held to one device: a bug here, not an answer
    torch.testing.assert_close(x.grad.full(), Xr.grad)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad.full() if isinstance(p, DistTensor) else p.grad,
                                   q.grad, msg=name)
    n = batch * cfg.seq_len * cfg.d_model * 4                     # one activation, fp32
    big_f = [k for k, b in fwd if b == n]
    big_b = [k for k, b in bwd if b == n]
    if big_f != ["all_reduce"]:
        seq = ("; w2's output is reduce-scattered onto the sequence: that is sequence "
               "parallelism's g, and the replicated residual stream then gathers it back; "
               "here g is an all-reduce: RowwiseParallel's default output_layouts=Replicate()"
               if big_f[:1] == ["reduce_scatter"] else "")
        raise CheckError(f"forward sent {', '.join(big_f) or 'nothing'} of the activation; "
                         "Megatron's g sends one all-reduce of the partial sums after w2" + seq)
    if big_b.count("all_reduce") == 2:
        raise CheckError("right layouts and right values, but backward sends 2 all-reduces of "
                         "the input gradient where Megatron's f sends 1: w1 and w3 each "
                         "entered the tensor-parallel region on their own, and each one's "
                         "input gradient is a partial sum reduced by itself. Let the input "
                         "enter once, for both: which of section 6's styles is f, and on "
                         "which module must it sit?",
                         expected="'mlp': PrepareModuleInput(input_layouts=(Replicate(),), "
                                  "desired_input_layouts=(Replicate(),)) beside w1, w3 "
                                  "colwise and w2 rowwise")
    if big_b != ["all_reduce"]:
        raise CheckError(f"backward sent {', '.join(big_b) or 'nothing'} of the activation; "
                         "Megatron's f sends one all-reduce of the input gradient")
    others = [k for k, b in fwd + bwd if b != n]
    if others:
        raise CheckError(f"besides Megatron's two all-reduces your plan sends "
                         f"{', '.join(others)}: let w1, w3 and w2 keep their styles' default "
                         "layouts" + (", and leave the norm out of the plan"
                                      if "mlp_norm" in plan else ""))
    share = 2 * (tp - 1) * n // tp
    _ok(f"w1, w3 colwise, w2 rowwise, the input entering once: one all-reduce forward (g) "
        f"and one backward (f), {share:,d} B per rank each, the output and every gradient "
        "equal to one device's")
