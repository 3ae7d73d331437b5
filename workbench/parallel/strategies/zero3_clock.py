"""ZeRO-3 on the modeled clock: prefetched gathers, and the gathered copies one rank holds.

:class:`Zero3Clock` holds :class:`~.zero3.Zero3`'s hooks for the simulated clock (the
order and overlap they give are described in :mod:`.zero3`): each module's all-gather
issued ahead of use on the comm stream, the backward's from the end of the forward in
the forward's order reversed, each gradient's reduce-scatter launched as backward
produces it.

ZeRO-3 keeps only a shard of each parameter; a module's whole parameters exist from the
moment their all-gather is issued (the receive buffer is allocated then) until ZeRO frees
them: after the module's forward, and after its backward (DeepSpeed's
``PartitionedParameterCoordinator.release_sub_module``).  With prefetch, the modules
gathered ahead hold their copies too, up to ``stage3_prefetch_bucket_size`` elements
beyond the module computing; a backward prefetch issued at the end of the forward
(:mod:`.zero3`) holds them from then on.

:class:`GatheredLedger` counts those bytes per rank (every rank of the group holds the
same): ``hold(key, nbytes)`` when a gather is issued, ``free(key)`` when the copy is
released; it keeps the current bytes, the peak and the timeline ``[(seconds on the
modeled clock, bytes)]`` at each change, on the compute clock of one rank of the group.
"""
from __future__ import annotations

import math

import torch

from .. import storage
from ..dist_tensor import DistTensor
from ..seq_order import same_order
from ..load_back import flush
from ..ops_table import linear_regather
from .zero_optimizer_dist import defer_reduce_scatter

__all__ = ["GatheredLedger", "Zero3Clock"]


class GatheredLedger:
    """Bytes of gathered parameters live on one rank (module docstring)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.live: dict = {}                 # key -> bytes
        self.bytes = 0
        self.peak = 0
        self.timeline: list[tuple[float, int]] = []

    def _now(self) -> float:
        from ...sim_mesh.trace import current_trace
        tr = current_trace()
        return tr.now(self.rank) if tr is not None else 0.0

    def hold(self, key, nbytes: int) -> None:
        if key in self.live:
            return
        self.live[key] = nbytes
        self.bytes += nbytes
        self.peak = max(self.peak, self.bytes)
        self.timeline.append((self._now(), self.bytes))

    def free(self, key) -> None:
        nbytes = self.live.pop(key, None)
        if nbytes is None:
            return
        self.bytes -= nbytes
        self.timeline.append((self._now(), self.bytes))

    def free_all(self) -> None:
        for key in list(self.live):
            self.free(key)


class Zero3Clock:
    """:class:`~.zero3.Zero3`'s hooks on the modeled clock: async gathers issued ahead of
    use, the backward's from the end of the forward, reduce-scatters as gradients come,
    and the gathered copies counted in ``live`` (module docstring)."""

    def _init_clock(self, mods) -> None:
        self._inflight: dict = {}           # (phase, id(module)) -> [(trace, handles)]
        self._pending: list = []            # (trace, handle) of gradient reduce-scatters
        self._reduced: set = set()          # entries whose reduce-scatter was recorded
        # entry -> weakref of the gradient the last finish_gradient_synchronization
        # waited for (a second finish before a new gradient, a clip's then the step's,
        # records no second reduce-scatter of it)
        self._synced: dict = {}
        self._have_b: set = set()           # modules gathered for a recompute in backward
        # the gathered copies a rank holds: freed after a module's forward, and after its
        # backward (its trainable parameters' gradients produced; a module with none
        # when the next module's backward starts)
        self.live = GatheredLedger(self.group.ranks[0])
        self._owners: dict = {}             # entry index -> ids of the modules holding it
        for m in mods:
            for _, i in self._by_mod[id(m)]:
                self._owners.setdefault(i, []).append(id(m))
        self._grads_left: dict = {}         # id(module) -> entries whose gradient is due
        self._frozen_b: list = []           # backward copies of modules with no gradient

    # ---- the clock: async gathers ahead of use, reduce-scatters as gradients come -----------
    def _issue(self, phase: str, mod) -> None:
        from ...sim_mesh.trace import current_trace
        key = (phase, id(mod))
        if key in self._inflight:
            return
        from .fully_shard_tp_units import keeps_gathered
        if phase == "B" and keeps_gathered(self, mod):
            self._inflight[key] = []         # its forward's copy, kept: nothing to gather
            return
        label = "zero-3 params" if phase == "F" else "zero-3 re-gather"
        pd = getattr(self, "param_dtype", None)       # fully_shard's mixed precision
        nb = self._numel[id(mod)] * (pd.itemsize if pd is not None else
                                     self.entries[self._by_mod[id(mod)][0][1]][3].element_size())
        self._inflight[key] = [(current_trace(), self.group.record(
            "all_gather", nb, label, overlap=True))]
        self.live.hold(key, nb)             # the receive buffer exists from the issue on

    def _gather_ahead(self, phase: str, mods) -> None:
        """Issue the gathers of ``mods`` in turn while fewer than ``prefetch_numel``
        elements are issued (so at least one when it is > 0, as DeepSpeed's coordinator)."""
        ahead = 0
        for mod in mods:
            if ahead >= self.prefetch_numel:
                break
            self._issue(phase, mod)
            ahead += self._numel[id(mod)]

    def _prefetch_backward(self) -> None:
        """The forward's last module has run: gather for the backward, in the forward's
        order reversed (the module that ran last first), up to ``prefetch_numel``."""
        self._gather_ahead("B", self.order[::-1])

    def _begin_backward(self, mod) -> None:
        """``mod``'s backward starts: its gather waited for (unless a recompute gathered
        it), the copies of modules with no gradient whose backward came before freed."""
        for key in self._frozen_b:
            self.live.free(key)
            self.live.free(("F", key[1]))
        self._frozen_b = []
        if id(mod) in self._have_b:          # gathered for its recompute already
            self._have_b.discard(id(mod))
        else:
            self._wait("B", mod)             # its re-gather, before its backward computes
        due = {i for _, i in self._by_mod[id(mod)] if self.entries[i][3].requires_grad}
        if due:                              # (frozen now or not: read at each backward)
            self._grads_left[id(mod)] = due
        else:
            self._frozen_b.append(("B", id(mod)))

    def _holds_backward_copy(self, mod) -> bool:
        """Whether ``mod``'s backward began and its gathered copy is still held (waited
        for, its gradients not all produced): a recompute that reaches it then (a Llama
        block's w2 under PyTorch's non-reentrant checkpoint: its backward starts, its
        saved input's unpack re-runs the block, whose early stop comes inside w2's
        forward) reuses that copy, as FSDP2 skips the unshard of a unit already
        unsharded (``FSDPState._pre_forward`` returns at once in PRE_BACKWARD).  Was: a
        second gather, queued behind the reduce-scatters in flight, in the first backward
        only (measured, Llama ZeRO-3 dp 2 cp 2, "op": 1412 us the first micro-batch's
        backward, 1251 us each later one), and a stale ``_have_b`` entry after it that
        let the next backward start w2 without waiting for its gather."""
        key = ("B", id(mod))
        return key not in self._inflight and key in self.live.live

    def _wait(self, phase: str, mod, ahead: bool = True) -> None:
        """``mod`` is about to compute: wait for its gather, then gather ahead."""
        from ...sim_mesh.trace import current_trace
        self._issue(phase, mod)
        for tr, hs in self._inflight.pop((phase, id(mod))):
            if tr is current_trace() and tr is not None:
                for h in hs:
                    tr.wait(h)
        if not ahead:
            return
        order = self.order if phase == "F" else self.order[::-1]
        if mod in order:
            self._gather_ahead(phase, order[order.index(mod) + 1:])

    def _backward_hook(self, mod):
        zero3 = self

        class _BeforeBackward(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.gathered = False
                return x.view_as(x)

            @staticmethod
            def backward(ctx, g):
                if ctx.gathered:              # a second pass (a split backward's W)
                    return g
                ctx.gathered = True
                zero3._begin_backward(mod)
                return g

        def hook(module, args, out):
            from .fully_shard_tp_units import keeps_gathered
            if torch._C._current_graph_task_id() == -1:     # a forward (not a recompute)
                if not keeps_gathered(zero3, mod):
                    zero3.live.free(("F", id(mod)))         # ZeRO frees it after forward
                if torch.is_grad_enabled() and len(zero3._seen) == len(zero3.order) \
                        and mod is zero3._seen[-1]:
                    zero3._prefetch_backward()              # the forward's last module
            if torch.is_grad_enabled() and isinstance(out, DistTensor) \
                    and isinstance(out._local, torch.Tensor) and out._local.requires_grad:
                # the view keeps a sequence-parallel gathered input's mark (megatron_f's
                # hook ran first: the final norm's output the head reads) and a ring order
                loc = linear_regather.carry(out._local, _BeforeBackward.apply(out._local))
                return same_order(DistTensor(loc, out.mesh, out.placements, out.shape,
                                             out.dtype), out)
            return out
        return hook

    def _reduce_scatter_hook(self, i):
        def hook(grad):
            from ...sim_mesh.trace import current_trace
            rd = getattr(self, "reduce_dtype", None) or getattr(self, "param_dtype", None)
            nb = math.prod(grad.shape[self.mesh.ndim:]) * self.n * \
                (rd.itemsize if rd is not None else grad.element_size())
            self._reduced.add(i)
            for m in self._owners.get(i, ()):              # a module's backward is done
                left = self._grads_left.get(m)             # when its last gradient is
                if left is not None:
                    left.discard(i)
                    if not left:
                        del self._grads_left[m]
                        self.live.free(("B", m))
                        self.live.free(("F", m))   # kept for it (reshard_after_forward=False)
            tr = current_trace()
            from .fully_shard_tp_units import skips_reduce
            if skips_reduce(self, i):            # set_requires_gradient_sync(False): held
                tr = None
            if tr is not None:        # after the input gradient's collective (zero_optimizer_dist)
                defer_reduce_scatter(tr, self.group_mesh, self.group_axis, nb,
                                     "zero-3 params", self._pending)
        return hook

    def _gather_hook(self, mod):
        def hook(module, args):
            flush()             # a write into a state_dict() copy: into the shards first
            # on both executors (torch.distributed: the real gathers unrecorded, _gather)
            if torch._C._current_graph_task_id() != -1:     # a recompute in backward:
                if not self._holds_backward_copy(mod):
                    self._wait("B", mod, ahead=False)       # gathered as it runs
                    self._have_b.add(id(mod))
            else:
                if mod in self._seen:
                    self._seen = []                         # a new forward
                self._seen.append(mod)
                if len(self._seen) == len(self.order):
                    self.order = list(self._seen)           # the order forward ran
                self._wait("F", mod)
            for attr, i in self._by_mod[id(module)]:
                _, _, tmpl, shard = self.entries[i]
                copy = self._gather(tmpl, shard, cast=True)
                if not torch.is_grad_enabled():
                    _refuse_grad_of_no_grad_copy(copy, self.names[i])
                # every place of a tied weight holds this one copy (FSDP2's
                # _setattr_on_modules sets a parameter on its shared modules too): each
                # module kept its own gather, so model.head.weight is model.emb.weight
                # went False after a forward (torch's stays True)
                for mod2, attr2 in self._places[i]:
                    object.__setattr__(mod2, attr2, copy)
        return hook


def _refuse_grad_of_no_grad_copy(copy: DistTensor, name: str) -> None:
    """A forward under ``torch.no_grad()`` (an evaluation; ``checkpoint(...,
    use_reentrant=True)`` of inputs that require no grad) leaves on the module a copy
    gathered with no autograd link to the shards, a view made in no_grad mode: a loss
    term on it afterwards (a regularizer on ``model[2].bias``) lost its gradient, silently
    (torch drops a gradient into such a view; torch's own parameter gets it).  The copy's
    local tensors become leaves of the same memory whose gradient raises, as the
    template's does (``fsdp_dist_views._refuse_grad``)."""
    def hook(t):
        t.grad = None
        raise RuntimeError(
            f"a gradient reached {name} as a forward under torch.no_grad() left it on the "
            "module (the copy that forward gathered from the wrapper's flat shards, with no "
            "autograd link to them): it would not reach the shards the optimizer steps.  Run "
            "a forward with grad enabled before building this loss term, or build it in the "
            "forward")

    def leaf(t):
        if not t.requires_grad or t.grad_fn is not None:
            return t
        c = t.detach()
        c.__dict__.update(t.__dict__)       # the wrapper's marks (its .data, .grad...)
        c.requires_grad_()
        c.register_post_accumulate_grad_hook(hook)
        return c
    copy._local = storage.map_tensors(copy._local, leaf)
