"""Expert parallelism: a MoE layer's experts sharded over a mesh dim, tokens exchanged by
uneven all-to-all (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021; DeepSpeed-MoE,
Rajbhandari et al. 2022; Megatron-LM's ``MoEAlltoAllTokenDispatcher``).

The mesh (Megatron-LM's convention: the EP group is carved out of the data-parallel
ranks).  The dense layers see ``dp_total = edp x ep`` data-parallel ranks, each with its
own slice of the batch; the experts see the same ranks as an ``(edp, ep, tp)`` mesh
(:func:`expert_mesh`): expert e lives on ep rank ``e // (E / ep)``, replicated over edp
(the "expert data parallel" group: their gradients are reduced over edp only) and over
tp (Megatron's expert tensor parallel size 1).  Rank i of the dense mesh's dp dim is
(edp, ep) = (i // ep, i % ep).

One layer's forward on each ep group (per rank j, its tokens x_j and routes):

    1. permute    the (token, choice) pairs that kept a slot, sorted by expert; the
                  rows for ep rank r are the experts r owns (contiguous)
    2. counts     all-to-all of the row counts, then
    3. dispatch   all-to-all of the rows, uneven (``collectives.all_to_all_v``)
    4. experts    rank r runs each of its experts on the rows it received
    5. combine    the reverse all-to-all, then un-permute and weight by the gates

Backward is autograd's: the gradients go back through the same exchanges (recorded on
the trace as the reverse all-to-alls).

**Overlap** (the CANN article's fused all-to-all with expert compute; DeepSpeed-TED,
Singh et al. 2023; Tutel, Hwang et al. 2023): with ``chunks=n`` the clock runs the
exchange in n pieces as a pipeline, dispatch of piece c+1 and combine of piece c-1
on the comm stream while the experts compute piece c (recorded per rank, so a rank with
more tokens is the straggler everyone waits for).  The numbers are exact either way; only
the modeled time changes: for each exchange of time M and expert compute X, about
(1 - 1/n) min(M, X) hides, less n times the link latency.

Interface (this layer knows no model): the MoE module calls the dispatcher as
``dispatcher(x, weights, experts, slots, experts_module)`` with x (B, S, h) and the
router's (B, S, k) outputs; ``experts_module`` holds parameters with the experts on dim 0
and ``expert_forward(tokens, params_of_one_expert)``.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ...sim_mesh import backends as _B
from ...sim_mesh import collectives as C
from ...sim_mesh import cost as _cost
from ...sim_mesh.mesh import Mesh
from ...sim_mesh.trace import current_trace
from ..dist_tensor import DistTensor
from ..module import parallelize
from ..placement import Replicate, Shard

__all__ = ["ExpertParallel", "expert_parallel", "expert_mesh", "check_expert_parallel",
           "record_layer", "exchange_report"]


def expert_mesh(mesh: Mesh, ep: int, dp: str = "dp") -> Mesh:
    """The ``(edp, ep, rest...)`` view of ``mesh``'s ranks whose dim ``dp`` holds
    edp x ep ranks: rank i along dp is (i // ep, i % ep)."""
    d = mesh.dim(dp)
    n = mesh.shape[d]
    if n % ep:
        raise ValueError(f"ep={ep} does not divide the {n} data-parallel ranks of the mesh")
    ranks = torch.tensor(mesh.ranks).reshape(mesh.shape).movedim(d, 0)
    ranks = ranks.reshape(n // ep, ep, *ranks.shape[1:])
    names = [x for i, x in enumerate(mesh.dim_names) if i != d]
    return Mesh(ranks.tolist(), ["edp", "ep", *names])


def check_expert_parallel(num_experts: int, ep: int) -> None:
    """EP shards whole experts: a clear error when ``ep`` does not divide them."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep={ep!r}: give an int >= 1, the ranks the experts are split over")
    if num_experts % ep:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(f"ep={ep} does not divide moe_experts={num_experts}: expert "
                         f"parallelism gives each rank whole experts; use ep in {divisors} "
                         f"or moe_experts a multiple of {ep}")


def expert_parallel(experts: nn.Module, emesh: Mesh, chunks: int = 1) -> "ExpertParallel":
    """Shard ``experts``' parameters (experts on dim 0) over ``emesh``'s "ep" dim
    (replicated elsewhere) in place; return the token dispatcher for its MoE layer."""
    ax = emesh.dim("ep")
    E = {p.shape[0] for p in experts.parameters()}
    if len(E) != 1:
        raise ValueError(f"expert_parallel: the parameters of {type(experts).__name__} hold "
                         f"{sorted(E)} experts on dim 0; every one must hold all E experts")
    check_expert_parallel(E.pop(), emesh.shape[ax])
    ps = [Replicate()] * emesh.ndim
    ps[ax] = Shard(0)
    parallelize(experts, emesh, {"*": ps})
    return ExpertParallel(emesh, chunks)


class ExpertParallel:
    """The token dispatcher of one MoE layer under expert parallelism (module docstring).
    ``last_send_rows``: per ep group, the rows each rank sent each (the last forward)."""

    def __init__(self, emesh: Mesh, chunks: int = 1):
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks={chunks!r}: give an int >= 1 (1: no overlap)")
        self.mesh, self.chunks = emesh, chunks
        self.ax = emesh.dim("ep")
        self.ep = emesh.shape[self.ax]
        self.last_send_rows = {}

    # ---- one source rank's permutation ---------------------------------------------------
    def _permute(self, x, e, s, E):
        """x (N, h), e, s (N, k) -> rows sorted by expert, their (token, choice) index,
        rows per destination ep rank, rows per expert."""
        k = e.shape[-1]
        flat_e, keep = e.reshape(-1), s.reshape(-1) >= 0
        assign = torch.nonzero(keep).squeeze(1)
        order = torch.argsort(flat_e[assign], stable=True)
        assign = assign[order]
        per_expert = torch.bincount(flat_e[assign], minlength=E)
        per_dest = per_expert.view(self.ep, E // self.ep).sum(1).tolist()
        return x[assign // k], assign, per_dest, per_expert.tolist()

    @staticmethod
    def _unpermute(back, assign, w):
        """Rows back from the experts -> (N, h): each token's k outputs times its gates."""
        N, k = w.shape
        out = back.new_zeros(N * k, back.shape[-1]).index_copy(0, assign, back)
        return (out.view(N, k, -1) * w.unsqueeze(-1).to(back.dtype)).sum(1)

    def _experts_on(self, module, params, rows_from, counts_from, r, E):
        """Rank r: its experts on the rows each source sent; the outputs in the same order."""
        El = E // self.ep
        segs = [list(rows.split(c[r * El:(r + 1) * El])) for rows, c in zip(rows_from, counts_from)]
        outs = []
        for l in range(El):
            inp = torch.cat([s[l] for s in segs])
            outs.append(module.expert_forward(inp, {n: p[l] for n, p in params.items()})
                        if inp.shape[0] else inp)
        pieces = [o.split([s[l].shape[0] for s in segs]) for l, o in enumerate(outs)]
        return [torch.cat([pieces[l][j] for l in range(El)]) for j in range(len(segs))]

    # ---- the layer ---------------------------------------------------------------------------
    def __call__(self, x, weights, experts, slots, module):
        if not isinstance(x, DistTensor):
            raise TypeError("ExpertParallel: the MoE layer's input is a plain tensor; expert "
                            "parallelism runs on DistTensors laid out by the recipe")
        params = {n: p for n, p in module.named_parameters()}
        E = module.num_experts
        if _B.is_distributed(self.mesh):
            return self._distributed(x, weights, experts, slots, module, params, E)
        return self._simulated(x, weights, experts, slots, module, params, E)

    def _simulated(self, x, w, e, s, module, params, E):
        em, ep = self.mesh, self.ep
        loc = [t._local for t in (x, w, e, s)]
        if any(type(t) is not torch.Tensor for t in loc):
            raise NotImplementedError("ExpertParallel: uneven batch shards; give a batch "
                                      "that the data-parallel ranks divide")
        D = loc[0].shape[0]
        edp = em.shape[0]
        if D != edp * ep:
            raise ValueError(f"ExpertParallel: the input has {D} data-parallel shards, the "
                             f"expert mesh {edp} x {ep}; build both from one mesh")
        B, S, h = loc[0].shape[-3:]
        # tp copies are the same tokens: compute once (tp index 0), record for every group
        per_rank = [[t[i, 0].reshape(B * S, -1) for t in loc] for i in range(D)]
        group = tuple(range(ep))                # the exchange's order within a group
        ys, send_rows = [], {}
        for a in range(edp):
            src = per_rank[a * ep:(a + 1) * ep]                 # (x, w, e, s) of each rank
            perm = [self._permute(xj, ej, sj, E) for xj, _, ej, sj in src]
            send = {group: [list(pm[0].split(pm[2])) for pm in perm]}
            recv = C.all_to_all_v(send, em, self.ax, record=False)[group]
            counts = [pm[3] for pm in perm]
            outs = []                           # outs[r][j]: rank r's rows back to rank j
            for r in range(ep):
                pr = {n: _rank_slice(p._local, em, (a, r)) for n, p in params.items()}
                outs.append(self._experts_on(module, pr, recv[r], counts, r, E))
            back = C.all_to_all_v({group: outs}, em, self.ax, record=False)[group]
            for j in range(ep):
                ys.append(self._unpermute(torch.cat(back[j]), perm[j][1], src[j][1])
                          .reshape(B, S, h))
            send_rows[a] = [pm[2] for pm in perm]
        self.last_send_rows = send_rows
        y = torch.stack(ys).reshape(D, 1, B, S, h)
        y = self._record(y, send_rows, module, x)
        return DistTensor(y, x.mesh, x.placements, x.shape, x.dtype)

    def _distributed(self, x, w, e, s, module, params, E):
        lx, lw, le, ls = (t._local for t in (x, w, e, s))
        B, S, h = lx.shape[-3:]
        nd = lx.dim() - 3
        xs, ws = lx.reshape(B * S, h), lw.reshape(B * S, -1)
        rows, assign, per_dest, per_expert = self._permute(
            xs, le.reshape(B * S, -1), ls.reshape(B * S, -1), E)
        pg, g = _B.group(self.mesh, self.ax)
        me = g.index(_B.rank())
        counts = torch.tensor(per_expert, dtype=torch.int64)
        import torch.distributed as dist
        allc = [torch.empty_like(counts) for _ in g]
        dist.all_gather(allc, counts, group=pg)        # every source's counts per expert
        recv = C.all_to_all_v(list(rows.split(per_dest)), self.mesh, self.ax,
                              label="EP dispatch")
        pr = {n: p._local.reshape(p._local.shape[self.mesh.ndim:]) for n, p in params.items()}
        outs = self._experts_on(module, pr, recv, [c.tolist() for c in allc], me, E)
        back = C.all_to_all_v(outs, self.mesh, self.ax, label="EP combine")
        y = self._unpermute(torch.cat(back), assign, ws).reshape((1,) * nd + (B, S, h))
        return DistTensor(y, x.mesh, x.placements, x.shape, x.dtype)

    # ---- the clock -------------------------------------------------------------------------
    def _record(self, y, send_rows, module, x):
        """Put the layer's exchanges and expert GEMMs on the trace, forward now and
        backward when the gradient comes (chunked and overlapped, module docstring)."""
        tr = current_trace()
        if tr is None:
            return y
        per_expert = sum(math.prod(p.shape[1:]) for n, p in module.named_parameters()
                         if not n.endswith("bias"))        # weights one token multiplies
        item = x.dtype.itemsize
        h = x.shape[-1]
        plan = []                   # (group ranks, send bytes matrix, rows per rank)
        for g in self.mesh.groups(self.ax):
            a = self.mesh.coordinate(g[0])[0]
            rows = send_rows[a]
            matrix = [[n * h * item for n in row] for row in rows]
            got = [sum(rows[i][r] for i in range(self.ep)) for r in range(self.ep)]
            plan.append((g, matrix, got))
        w_bytes = per_expert * (module.num_experts // self.ep) * item
        record_layer(tr, plan, per_expert, w_bytes, h * item, x.dtype, self.chunks, "forward")
        if y.requires_grad and torch.is_grad_enabled():
            y = _RecordBackward.apply(
                lambda: record_layer(current_trace(), plan, per_expert, w_bytes, h * item,
                                     x.dtype, self.chunks, "backward"), y)
        return y


def _rank_slice(local, mesh, coord2):
    """The stacked parameter's tensor of (edp, ep) = coord2, tp index 0 (a replicated
    axis of size 1 stands for every rank)."""
    idx = tuple(c if local.shape[i] > 1 else 0 for i, c in enumerate(coord2))
    idx += (0,) * (mesh.ndim - len(coord2))
    return local[idx]


class _RecordBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, y):
        ctx.fn = fn
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        if current_trace() is not None:
            ctx.fn()
        return None, g


def record_layer(tr, plan, per_expert: int, w_bytes: int, row_bytes: int, dtype,
                 chunks: int, phase: str) -> None:
    """One MoE layer's exchange on the clock, per ep group: the counts, then dispatch,
    each rank's expert GEMMs, combine, in ``chunks`` pieces pipelined (dispatch of the
    next piece and combine of the last beside the experts' compute).  Backward: the
    same exchanges (the gradients' way back) and twice the GEMM FLOPs (dgrad, wgrad)."""
    mult = 2 if phase == "backward" else 1
    for g, matrix, got in plan:
        p = len(g)
        C.record_collective("all_to_all", None, None, 8 * p, f"EP counts ({phase})",
                            groups=[g])
        piece = [[b // chunks for b in row] for row in matrix]
        back = [list(r) for r in zip(*piece)]
        comp = []
        for r, n in enumerate(got):
            flops = mult * 2 * n * per_expert // chunks
            nbytes = w_bytes + 2 * n * row_bytes // chunks
            comp.append((flops, nbytes, _cost.compute_time(flops, nbytes, tr.profile, dtype,
                                                           op_class="matmul", launches=3)))
        ov = chunks > 1
        nxt = C.record_all_to_all_v(piece, g, f"EP dispatch ({phase})", overlap=ov)
        combines = []
        for c in range(chunks):
            h_now = nxt
            if c + 1 < chunks:                  # next piece's dispatch beside this compute
                nxt = C.record_all_to_all_v(piece, g, f"EP dispatch ({phase})", overlap=True)
            if h_now is not None and ov:
                tr.wait(h_now)
            for r, (flops, nbytes, dur) in zip(g, comp):
                tr.record_compute([r], f"experts {phase}", dur, flops=flops, bytes=nbytes,
                                  label=f"chunk {c + 1}/{chunks}",
                                  args={"op_class": "matmul", "phase": phase})
            combines.append(C.record_all_to_all_v(back, g, f"EP combine ({phase})",
                                                  overlap=ov))
        for hc in combines:
            if hc is not None and ov:
                tr.wait(hc)


def exchange_report(rows, row_bytes: int, per_expert: int, experts_per_rank: int,
                    chunks: int = 1, profile=None, dtype=torch.bfloat16, phase="forward"):
    """One MoE layer's exchange and expert GEMMs on the modeled clock of ``profile``, as an
    :class:`~workbench.parallel.strategies.overlap.OverlapReport` (``wb.viz`` draws it:
    ``draw_timeline(report)``, ``render_text(report)``).

    ``rows[i][j]``: tokens rank i sends rank j (an ep x ep matrix, uneven as a router
    makes it); ``row_bytes``: bytes of one token (h x element size); ``per_expert``: weights
    one token multiplies in its expert (3 h d_ff for SwiGLU); ``experts_per_rank``: E / ep.
    The ranks are 0 .. ep-1 of one node of the profile."""
    from ...sim_mesh.trace import trace
    from .overlap import OverlapReport
    ep = len(rows)
    if ep < 1 or any(len(r) != ep for r in rows):
        raise ValueError(f"exchange_report: rows must be an ep x ep matrix of token counts; "
                         f"got {rows!r:.80}")
    item = torch.empty((), dtype=dtype).element_size()
    matrix = [[int(n) * row_bytes for n in r] for r in rows]
    got = [sum(int(rows[i][r]) for i in range(ep)) for r in range(ep)]
    with trace(profile) as tr:
        record_layer(tr, [(tuple(range(ep)), matrix, got)], per_expert,
                     per_expert * experts_per_rank * item, row_bytes, dtype, chunks, phase)
    return OverlapReport.from_events(tr.events, f"EP {phase}", chunks, tr.profile.name)
