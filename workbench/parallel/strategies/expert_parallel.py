"""Expert parallelism: a MoE layer's experts sharded over a mesh dim, tokens exchanged by
uneven all-to-all (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021; DeepSpeed-MoE,
Rajbhandari et al. 2022; Megatron-LM's ``MoEAlltoAllTokenDispatcher``).

The mesh (Megatron-LM's convention: the EP group is carved out of the data-parallel
ranks).  The dense layers see ``dp_total = edp x ep`` data-parallel ranks, each with its
own slice of the batch; the experts see the same ranks as an ``(edp, ep, tp)`` mesh
(:func:`expert_mesh`): expert e lives on ep rank ``e // (E / ep)``, replicated over edp
(the "expert data parallel" group: their gradients are reduced over edp only) and over
tp (each tp rank the whole experts and the same tokens; Megatron-Core's default splits
each expert over tp instead).  Rank i of the dense mesh's dp dim is
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
(1 - 1/n) min(M, X) hides (``overlap.expected_hidden_share``), less n times the link
latency and n reads of the expert weights (:mod:`.expert_parallel_clock` records it).

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
from ...sim_mesh.mesh import Mesh
from ...sim_mesh.trace import current_trace
from .. import storage
from ..dist_tensor import DistTensor
from ..seq_order import same_order
from ..module import parallelize
from ..placement import Replicate, Shard
from ..reshard import reshard
from .expert_parallel_clock import _RecordBackward, exchange_report, record_layer

__all__ = ["ExpertParallel", "expert_parallel", "expert_mesh", "check_expert_parallel",
           "record_layer", "exchange_report"]


def expert_mesh(mesh: Mesh, ep: int, dp: str = "dp") -> Mesh:
    """The ``(edp, ep, rest...)`` view of ``mesh``'s ranks whose dim ``dp`` holds
    edp x ep ranks: rank i along dp is (i // ep, i % ep)."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"expert_mesh: ep={ep!r}; give an int >= 1, the ranks the experts "
                         "are split over (1: none)")
    d = mesh.dim(dp)
    n = mesh.shape[d]
    if n % ep:
        divisors = [i for i in range(1, n + 1) if n % i == 0]
        raise ValueError(f"expert_mesh: ep={ep} does not divide the {n} data-parallel ranks "
                         f"of the mesh (dim {dp!r}); the ep group is carved out of them: use "
                         f"ep in {divisors}, or a mesh whose {dp!r} dim is a multiple of {ep}")
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
    if not isinstance(emesh, Mesh) or "ep" not in emesh.dim_names:
        raise ValueError(f"expert_parallel: emesh={emesh!r} has no 'ep' dim; give the expert "
                         "mesh of the layer's data-parallel mesh, expert_mesh(mesh, ep) (its "
                         "dims are ('edp', 'ep', ...))")
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

    # what each forward writes (a compiled program's guards do not hold it as a value the
    # program read: ``compile.guards.snapshot``)
    STATS_WRITES = ("last_send_rows",)

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
        """Rows back from the experts -> (N, h): each token's k outputs times its gates.
        The rows go to their (token, choice) places by ``index_put``, whose backward
        saves the index only (``index_copy``'s saved its source too: one R x h buffer more
        per MoE layer than the planner counts, ``plan.moe_cost.activation_bytes``; the dry
        run's activations were 1.03-1.06x the estimate's)."""
        N, k = w.shape
        out = back.new_zeros(N * k, back.shape[-1]).index_put((assign,), back)
        return (out.view(N, k, back.shape[-1]) * w.unsqueeze(-1).to(back.dtype)).sum(1)

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
        if type(x) is torch.Tensor and x.is_meta:
            # wb.compile's capture (meta tensors of the global shapes): one op of the table,
            # which runs this dispatcher on the program's DistTensors (run_locals)
            from ..ops_table.moe import expert_parallel as op
            return op(x, weights, experts, slots, self, module)
        if not isinstance(x, DistTensor):
            raise TypeError("ExpertParallel: the MoE layer's input is a plain tensor; expert "
                            "parallelism runs on DistTensors laid out by the recipe")
        params = {n: p for n, p in module.named_parameters()}
        E = module.num_experts
        # the batch sharded over dp, whole elsewhere: the rules may have laid the layer's
        # input out otherwise (a batch of one sequence on two ranks comes replicated from
        # the embedding's rule); the output goes back to the input's layout
        laid = list(x.placements)
        want = [Shard(0)] + [Replicate()] * (x.mesh.ndim - 1)
        if x.mesh.dim_names[0] == "dp" and laid != want:
            x = reshard(x, x.mesh, want)
        # the routes laid out as the tokens (the router's rule may choose otherwise: a
        # batch of one sequence over two ranks is replicated there)
        weights, experts, slots = (
            t if isinstance(t, DistTensor) and t.mesh == x.mesh and
            tuple(t.placements) == tuple(x.placements)
            else reshard(t, x.mesh, list(x.placements)) for t in (weights, experts, slots))
        if _B.is_distributed(self.mesh):
            y = self._distributed(x, weights, experts, slots, module, params, E)
        else:
            y = self._simulated(x, weights, experts, slots, module, params, E)
        return y if list(y.placements) == laid else reshard(y, y.mesh, laid)

    def run_locals(self, ctx, locs, module):
        """The op table's ``expert_parallel`` (a captured program's node): the layer on
        the local tensors of x, weights, experts, slots laid out as ``ctx.in_specs`` say;
        the output's local tensor, laid out as x."""
        x, w, e, s = (DistTensor(t, ctx.mesh, sp.placements, sp.shape, t.dtype)
                      for t, sp in zip(locs, ctx.in_specs))
        return self(x, w, e, s, module)._local

    def _check_input(self, x):
        """x laid out as the recipe gives it: the batch sharded over "dp" (dim 0 of its
        mesh, edp x ep ranks), whole elsewhere."""
        ps = tuple(x.placements)
        if x.mesh.dim_names[0] != "dp" or ps[0] != Shard(0) or \
                any(not p.is_replicate() for p in ps[1:]):
            raise ValueError(f"ExpertParallel: the MoE layer's input is laid out "
                             f"{list(map(str, ps))} on mesh dims {x.mesh.dim_names}; it takes "
                             "the batch sharded over a first mesh dim 'dp' (edp x ep ranks) "
                             "and replicated on the others (no sequence parallelism)")

    def _simulated(self, x, w, e, s, module, params, E):
        em, ep = self.mesh, self.ep
        self._check_input(x)
        nd = x.mesh.ndim
        # uneven batch shards (torch.chunk sizes: a rank may hold fewer sequences, or
        # none) are one tensor per rank; even ones one stacked tensor
        loc = [storage.to_cells(t._local, nd) if storage.is_cells(x._local) else t._local
               for t in (x, w, e, s)]
        D, edp = x.mesh.shape[0], em.shape[0]
        if D != edp * ep or x.mesh.ranks != em.ranks:
            raise ValueError(f"ExpertParallel: the input's mesh {x.mesh} is not the expert "
                             f"mesh {em} seen as (edp x ep, ...); build both from one mesh")
        S, h = x.shape[-2:]
        # copies along the other dims (tp) are the same tokens: computed once (index 0),
        # the exchange recorded for every group
        rest = (0,) * (nd - 1)
        per_rank = [[_rows(t[(i, *rest)]) for t in loc] for i in range(D)]
        group = tuple(range(ep))                # the exchange's order within a group
        ys, send_rows, combined = [], {}, []
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
            combined.append((back, perm, src))
            send_rows[a] = [pm[2] for pm in perm]
        self.last_send_rows = send_rows
        # the exchange and the experts on the clock before the un-permutation, whose
        # product with the gates saves the combined rows: a full recompute (PyTorch's
        # non-reentrant checkpoint stops after the last saved tensor) re-runs all of this
        # layer and must price it again (was recorded after: the recompute stopped first,
        # and Mixtral's dry run with recompute="full" priced none of its experts twice)
        on_backward = self._record_forward(send_rows, module, x)
        for back, perm, src in combined:
            for j in range(ep):
                ys.append(self._unpermute(torch.cat(back[j]), perm[j][1], src[j][1])
                          .reshape(src[j][1].shape[0] // S, S, h))
        if isinstance(loc[0], storage.Cells):    # each rank its own; tp copies share it
            ys[0] = self._record_backward(ys[0], on_backward)
            y = storage.Cells(loc[0].lead, [ys[c[0]] for c in loc[0].coords()])
        else:
            y = torch.stack(ys).reshape(D, *(1,) * (nd - 1), *ys[0].shape)
            y = self._record_backward(y, on_backward)
        # the dtype the experts computed in: x's, or under torch.autocast the GEMMs'
        # (bfloat16), as one device's combine gives (was x's float32 over bfloat16 rows)
        return same_order(DistTensor(y, x.mesh, x.placements, x.shape, ys[0].dtype), x)

    def _distributed(self, x, w, e, s, module, params, E):
        """One process: its tokens out and back by torch.distributed's all_to_all_single
        with split sizes, after its per-expert counts are gathered (Megatron-LM gathers
        ``num_local_tokens_per_expert`` over the ep group before its all-to-all: NVIDIA/
        Megatron-LM d98e8a64dd megatron/core/transformer/moe/token_dispatcher.py:570-575);
        the collectives block, so nothing overlaps.  The counts are gathered over every
        dim of the expert mesh, not the ep group alone, so that each process's modeled
        clock records every group's exchange and expert GEMMs as the simulator does
        (``_record_forward``); the gathers themselves are the clock's bookkeeping, not on it (the
        trace has the count exchange of each ep group, 8 E bytes, as the simulator's)."""
        self._check_input(x)
        lx, lw, le, ls = (t._local for t in (x, w, e, s))
        B, S, h = lx.shape[-3:]
        nd = lx.dim() - 3
        xs, ws = lx.reshape(B * S, h), lw.reshape(B * S, -1)
        rows, assign, per_dest, per_expert = self._permute(
            xs, le.reshape(B * S, -1), ls.reshape(B * S, -1), E)
        every = self._all_counts(per_expert)          # (*expert mesh shape, E)
        coord = _B.coordinate(self.mesh)
        _, g = _B.group(self.mesh, self.ax)
        me, El = g.index(_B.rank()), E // self.ep

        def counts_of(j):                             # ep rank j of my group's E counts
            c = list(coord)
            c[self.ax] = j
            return every[tuple(c)].tolist()
        counts = [[0] * E for _ in g]                # source j's counts, at my experts' slots
        for j in range(len(g)):
            counts[j][me * El:(me + 1) * El] = counts_of(j)[me * El:(me + 1) * El]
        recv = C.all_to_all_v(list(rows.split(per_dest)), self.mesh, self.ax, record=False,
                              recv_rows=[sum(c) for c in counts])
        pr = {n: p._local.reshape(p._local.shape[self.mesh.ndim:]) for n, p in params.items()}
        outs = self._experts_on(module, pr, recv, counts, me, E)
        back = C.all_to_all_v(outs, self.mesh, self.ax, record=False, recv_rows=per_dest)
        # every group's send rows, as the simulator's ``last_send_rows`` (tp copies: index 0)
        send_rows = {}
        for a in range(self.mesh.shape[0]):
            per_rank = every[a].reshape(self.ep, -1, E)[:, 0]          # (ep, E), tp index 0
            send_rows[a] = per_rank.view(self.ep, self.ep, El).sum(-1).tolist()
        self.last_send_rows = send_rows
        on_backward = self._record_forward(send_rows, module, x)   # before: _simulated
        y = self._unpermute(torch.cat(back), assign, ws).reshape((1,) * nd + (B, S, h))
        y = self._record_backward(y, on_backward)
        return DistTensor(y, x.mesh, x.placements, x.shape, y.dtype)   # (as _simulated)

    def _all_counts(self, per_expert):
        """Every rank's per-expert row counts, gathered dim by dim over the expert mesh:
        an int64 tensor of shape (*mesh.shape, E)."""
        t = torch.tensor(per_expert, dtype=torch.int64)
        for ax in reversed(range(self.mesh.ndim)):
            pg, g = _B.group(self.mesh, ax)
            t = _B._all_gather(t.unsqueeze(0), pg, len(g), 0) if len(g) > 1 else \
                t.unsqueeze(0)
        return t

    # ---- the clock -------------------------------------------------------------------------
    @staticmethod
    def _record_backward(y, on_backward):
        """``y``, which records the layer's backward (``on_backward``) when its gradient
        comes (None: nothing to record)."""
        if on_backward is not None and y.requires_grad and torch.is_grad_enabled():
            y = _RecordBackward.apply(on_backward, y)
        return y

    def _record_forward(self, send_rows, module, x):
        """Put the layer's forward exchanges, expert GEMMs and the kernels around them
        (the permutations, the experts' SwiGLU: ``record_layer``) on the trace; returns
        what records its backward (None without a trace)."""
        tr = current_trace()
        if tr is None:
            return None
        mats = [p for n, p in module.named_parameters() if p.ndim == 3]   # (E, in, out)
        per_expert = sum(math.prod(p.shape[1:]) for p in mats)   # weights a token multiplies
        item = x.dtype.itemsize
        h = x.shape[-1]
        # the tokens of each rank along dp (torch.chunk's sizes of the batch, as the
        # input is laid out: ``_check_input``), for the permutations' kernels
        B, S, D = x.shape[0], x.shape[-2], x.mesh.shape[0]
        seqs = [len(c) for c in torch.arange(B).chunk(D)]
        tokens = [n * S for n in seqs + [0] * (D - len(seqs))]
        plan = []          # (group ranks, send bytes matrix, rows per rank, tokens per rank)
        for g in self.mesh.groups(self.ax):
            a = self.mesh.coordinate(g[0])[0]
            rows = send_rows[a]
            matrix = [[n * h * item for n in row] for row in rows]
            got = [sum(rows[i][r] for i in range(self.ep)) for r in range(self.ep)]
            plan.append((g, matrix, got, tokens[a * self.ep:(a + 1) * self.ep]))
        w_bytes = per_expert * (module.num_experts // self.ep) * item
        record_layer(tr, plan, per_expert, w_bytes, h * item, x.dtype, self.chunks, "forward",
                     len(mats))
        return lambda: record_layer(current_trace(), plan, per_expert, w_bytes, h * item,
                                    x.dtype, self.chunks, "backward", len(mats))


def _rows(t):
    """(B, S, n) -> (B S, n), spelled out: a rank may hold no sequence."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _rank_slice(local, mesh, coord2):
    """The stacked parameter's tensor of (edp, ep) = coord2, tp index 0 (a replicated
    axis of size 1 stands for every rank)."""
    idx = tuple(c if local.shape[i] > 1 else 0 for i, c in enumerate(coord2))
    idx += (0,) * (mesh.ndim - len(coord2))
    return local[idx]
