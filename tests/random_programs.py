"""Random SPMD programs held to one device, forward and backward.

:func:`run_program` draws a mesh (1-3 dims, up to 8 ranks, random rank order), a leaf
tensor (0-4 dims, sizes 0-9, float64) laid out by random placements (nested shards,
Partial of every reduce op, from unequal parts), then a chain of ops drawn from
:data:`OPS` (new leaves join binary ops), running each op on the DistTensors and on
plain tensors side by side (the kinds of tests/random_programs_more.py too: most of the
op table, float32 / int64 / 0-d operands, in-place writes and views written in place, and
tests/random_programs_habits.py's: in-place ops on views, out=, calls torch refuses, which
must raise torch's exception type here too with the program's tensors untouched);
every intermediate result is gathered and compared, and so is every rank's local shard
with its nested ``torch.chunk`` of the one-device value (DTensor's layout), then
``(out * g).sum()`` is backpropagated on both sides and the leaves' gradients compared.
The program is recorded as text, so every failure comes with its reproducer.

``wide=True`` draws from tests/random_programs_wide.py's wider space as well (other first
dtypes, redistribute / cross-mesh reshards / from_local mid-program, no_grad, autocast,
60 more op kinds, other backward forms); ``wide=False`` programs are those drawn before it.

``rng`` is a ``random.Random``: ``hypothesis.strategies.randoms()`` in the property test,
``random.Random(seed)`` in ``benchmarks/random_sweep.py``.  ``avoid`` names the known
bugs (issue 10) the generator keeps off; the sweep passes ``avoid=()``.
"""
from __future__ import annotations

import itertools
import math
import random
import traceback
from dataclasses import dataclass

import torch

import workbench as wb
from workbench.parallel.placement import PARTIAL_OPS, Partial, Replicate, Shard
from workbench.parallel.validate import distribute

from tests.random_programs_habits import HABITS
from tests.random_programs_habits import build as build_habit
from tests.random_programs_more import MORE, build
from tests import random_programs_wide as _wide

# known bugs the property test keeps off until they are fixed (issue 10):
# the known bugs the generator once kept off (P(sum) + 1 on every rank; zero-size uneven
# splits crashing) are fixed: nothing is kept off for correctness any more
KNOWN = ()
# not a wrong answer but a cost: choosing a binary op's strategy on a 3-d mesh plans each
# of its 125-343 candidates (10-15 s for one add on a (2, 2, 2) mesh): kept off by default
SLOW = ("slow_planning",)
BINARY = ("add", "sub", "mul", "div", "maximum", "matmul", "cat", "stack")

LOW = (torch.float32, torch.bfloat16, torch.float16, torch.complex64)
CLEAR = (ValueError, NotImplementedError)      # refusals with a message: not raw


@dataclass
class Outcome:
    status: str             # "ok" | "wrong" | "raised" | "refused"
    text: str               # the program, as Python
    detail: str = ""
    kind: str = ""          # the exception type (raised / refused), the op (wrong)
    where: str = ""         # file:line of the innermost workbench frame


class _Wrong(Exception):
    pass


def _mesh(rng):
    nd = rng.randint(1, 3)
    while True:
        shape = tuple(rng.randint(1, 4) for _ in range(nd))
        if math.prod(shape) <= 8:
            break
    ranks = list(range(math.prod(shape)))
    rng.shuffle(ranks)
    nested = torch.tensor(ranks).reshape(shape).tolist()
    return wb.Mesh(nested)


class _Prog:
    def __init__(self, rng, avoid):
        self.rng, self.avoid = rng, set(avoid)
        self.lines, self.leaves, self.n, self.kind = [], [], 0, ""
        self.low = False        # a step ran below float64 (the gradients' tolerance)
        self.wide = False       # run_program(wide=True): tests/random_programs_wide.py's space
        self.half = False       # a step ran in bfloat16 / float16
        # (half only) what rounding a bfloat16 / float16 P(sum) / P(avg) leaf's parts
        # carry into any value computed from them: see :meth:`leaf`
        self.part_atol = 0.0

    def name(self):
        self.n += 1
        return f"t{self.n}"

    def shape(self, ndim=None):
        lo = 1 if "zero_size" in self.avoid else 0
        ndim = self.rng.randint(0, 4) if ndim is None else ndim
        return tuple(1 if self.rng.random() < 0.15 else self.rng.randint(lo, 9 if ndim <= 2 else 5)
                     for _ in range(ndim))

    def placements(self, shape, dtype=torch.float64):
        rng = self.rng
        op = rng.choice(PARTIAL_OPS)      # one reduce op per tensor: a mix is ill-defined
        if op == "avg" and not dtype.is_floating_point:
            op = "sum"                    # an integer average rounds: refused
        if op in ("max", "min") and dtype.is_complex:
            op = "sum"                    # complex numbers have no order
        ps = []
        for _ in range(self.mesh.ndim):
            k = rng.random()
            if k < 0.35 or not shape and k < 0.7:
                ps.append(Replicate())
            elif k < 0.7:
                ps.append(Shard(rng.randrange(len(shape))))
            elif dtype == torch.bool:     # (wide only) a bool is not a sum of parts
                ps.append(Replicate())
            else:
                ps.append(Partial(op))
        return ps

    def leaf(self, shape, positive=False, dtype=torch.float64):
        g = torch.Generator().manual_seed(self.rng.getrandbits(31))
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        if positive:                   # a divisor: |x| >= 0.5
            x = torch.sign(x) * (x.abs() + 0.5) + (x == 0)
        if dtype.is_complex:           # (wide only) an imaginary part from the same generator
            x = torch.complex(x, torch.randn(shape, generator=g, dtype=torch.float64))
        x = (x * 2).round().to(dtype) if not (dtype.is_floating_point or dtype.is_complex) \
            else x.to(dtype)
        if positive and not dtype.is_floating_point:
            x = x + (x == 0).to(dtype)
        ps = self.placements(shape, dtype)
        seed = self.rng.randrange(1000)
        grad = dtype.is_floating_point or dtype.is_complex    # torch's complex autograd
        d = distribute(x, self.mesh, ps, seed=seed).requires_grad_(grad)
        # a Partial leaf holds its parts' reduction, rounded in its dtype (float32 P(avg)
        # of 8 parts: a few ulps from x): held to x at its dtype's tolerance, and one
        # device starts from the value the DistTensor holds (seed 900309: a float32
        # P(avg) leaf into a float64 remainder differed by 4.8e-7 at float64's tolerance)
        held = d.full().detach()
        if not (self.wide and dtype in (torch.bfloat16, torch.float16)):
            # (a bfloat16 P(sum) of 8 parts rounds each: 0.04 off x, seed 2000148 wide)
            _close(held, x, "the leaf's held value", loose=True)
        r = held.clone().requires_grad_(grad)
        self.low |= dtype in LOW
        self.half |= dtype in (torch.bfloat16, torch.float16)
        if dtype in (torch.bfloat16, torch.float16) and \
                any(q.is_partial() and q.reduce_op in ("sum", "avg") for q in ps):
            # an op on the parts rounds each at its own magnitude, and the parts are
            # deliberately unequal (tens for a value near 1): the reduction then holds the
            # value to about the parts' summed magnitude (P(avg): their mean) times the
            # unit roundoff, not the value's own (wide seed 2015043: a bfloat16 P(avg)
            # leaf of 8 parts up to 183, mean |part| up to 51; mean(1) of its parts, kept
            # P(avg) as DTensor keeps it, was 0.033 off one device's mean of the value:
            # a 2e-2 tolerance; each part's own rounding bound there 51 * 2^-8 = 0.2)
            locs = [d.local(r).detach().double().abs() for r in self.mesh.ranks]
            avg = any(q.is_partial() and q.reduce_op == "avg" for q in ps)
            if all(t.shape == locs[0].shape for t in locs):
                # every rank's local elementwise (shards of other mesh dims mixed in: an
                # upper bound, as is counting a part once per copy)
                parts = torch.stack(locs)
                mag = parts.mean(0) if avg else parts.sum(0)
            else:                   # uneven shards: the largest part, times their number
                n = math.prod(s for s, q in zip(self.mesh.shape, ps) if q.is_partial())
                mag = torch.tensor([max((float(t.max()) for t in locs if t.numel()),
                                        default=0.0) * (1 if avg else n)])
            if mag.numel():
                self.part_atol = max(self.part_atol,
                                     float(mag.max()) * torch.finfo(dtype).eps / 2)
        nm = self.name()
        self.lines.append(f"{nm} = distribute(torch.tensor({x.tolist()}, dtype={dtype}), "
                          f"mesh, {[str(p) for p in ps]}, seed={seed}).requires_grad_({grad})")
        self.leaves.append((nm, d, r, ps))
        return nm, d, r


def _dim(rng, t, extra=0):
    return rng.randrange(t.dim() + extra)


def _reshape_target(rng, shape):
    if not shape or rng.random() < 0.3:
        return (-1,)
    i = rng.randrange(len(shape))
    if i + 1 < len(shape) and rng.random() < 0.5:                 # merge two dims
        return shape[:i] + (shape[i] * shape[i + 1],) + shape[i + 2:]
    n = shape[i]                                                   # split one dim
    f = [k for k in range(1, n + 1) if n % k == 0]
    a = rng.choice(f) if f else 1
    return shape[:i] + (a, n // a if a else 0) + shape[i + 1:]


def _op(p: _Prog, cur):
    """Draw one op for ``cur`` = (name, dist, ref): (text, f(dist) , f(ref)) or None."""
    rng = p.rng
    nm, d, r = cur
    if p.wide and rng.random() < 0.5:
        k = p.kind = rng.choice(getattr(p, "wide_kinds", _wide.WIDE))
        return _wide.build(p, cur, k)
    k = p.kind = rng.choice(OPS[:len(OLD_OPS)] if rng.random() < 0.4 else OPS)
    if k in MORE:
        return build(p, cur, k)
    if k in HABITS:
        return build_habit(p, cur, k)
    if k in BINARY and p.mesh.ndim >= 3 and "slow_planning" in p.avoid:
        return None
    shape, nd = tuple(r.shape), r.dim()
    partial = any(q.is_partial() for q in d.placements)
    if k in ("neg", "relu", "exp", "tanh", "sigmoid", "abs"):
        f = {"neg": torch.neg, "relu": torch.relu, "exp": torch.exp, "tanh": torch.tanh,
             "sigmoid": torch.sigmoid, "abs": torch.abs}[k]
        return f"torch.{k}({nm})", f
    if k in ("mul_s", "div_s", "add_s", "rsub_s"):
        if k in ("add_s", "rsub_s") and partial and "partial_scalar" in p.avoid:
            return None
        c = round(rng.choice([-1, 1]) * rng.uniform(0.5, 2.0), 3)
        txt = {"mul_s": f"{nm} * {c}", "div_s": f"{nm} / {c}", "add_s": f"{nm} + {c}",
               "rsub_s": f"{c} - {nm}"}[k]
        return txt, {"mul_s": lambda t: t * c, "div_s": lambda t: t / c,
                     "add_s": lambda t: t + c, "rsub_s": lambda t: c - t}[k]
    if k in ("add", "sub", "mul", "div", "maximum"):
        ys = list(shape)
        if ys and rng.random() < 0.5:
            ys = ys[rng.randrange(len(ys) + 1):]                   # a suffix
        ys = [1 if rng.random() < 0.2 else s for s in ys]         # broadcast dims
        yn, yd, yr = p.leaf(tuple(ys), positive=k == "div")
        f = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
             "maximum": torch.maximum}[k]
        return f"torch.{k}({nm}, {yn})", lambda t: f(t, yd if isinstance(t, wb.DistTensor) else yr)
    if k in ("sum", "mean", "amax") and nd:
        dim, keep = _dim(rng, r), rng.random() < 0.3
        return f"{nm}.{k}({dim}, keepdim={keep})", lambda t: getattr(t, k)(dim, keepdim=keep)
    if k == "sum_all":
        return f"{nm}.sum()", lambda t: t.sum()
    if k in ("softmax", "log_softmax") and nd:
        dim = _dim(rng, r)
        return f"torch.{k}({nm}, {dim})", lambda t: getattr(torch, k)(t, dim)
    if k == "transpose" and nd >= 2:
        a, b = _dim(rng, r), _dim(rng, r)
        return f"{nm}.transpose({a}, {b})", lambda t: t.transpose(a, b)
    if k == "permute" and nd:
        perm = list(range(nd))
        rng.shuffle(perm)
        return f"{nm}.permute({perm})", lambda t: t.permute(perm)
    if k in ("reshape", "view"):
        tgt = _reshape_target(rng, shape)
        return f"{nm}.{k}({tgt})", lambda t: getattr(t, k)(tgt)
    if k == "unsqueeze":
        dim = _dim(rng, r, 1)
        return f"{nm}.unsqueeze({dim})", lambda t: t.unsqueeze(dim)
    if k == "squeeze":
        ones = [i for i, s in enumerate(shape) if s == 1]
        if ones:
            dim = rng.choice(ones)
            return f"{nm}.squeeze({dim})", lambda t: t.squeeze(dim)
    if k == "flatten" and nd >= 2:
        a = rng.randrange(nd - 1)
        return f"{nm}.flatten({a}, {a + 1})", lambda t: t.flatten(a, a + 1)
    if k == "matmul" and nd >= 1:
        wn, wd, wr = p.leaf((shape[-1], rng.randint(1, 5)))
        return f"torch.matmul({nm}, {wn})", \
            lambda t: torch.matmul(t, wd if isinstance(t, wb.DistTensor) else wr)
    if k in ("cat", "stack") and nd:
        dim = _dim(rng, r, 1 if k == "stack" else 0)
        ys = list(shape)
        if k == "cat":
            ys[dim] = rng.randint(1, 4)
        yn, yd, yr = p.leaf(tuple(ys))
        f = getattr(torch, k)
        return f"torch.{k}([{nm}, {yn}], {dim})", \
            lambda t: f([t, yd if isinstance(t, wb.DistTensor) else yr], dim)
    if k == "split" and nd and shape[0] > 0:
        dim = _dim(rng, r)
        if shape[dim] > 0:
            size = rng.randint(1, shape[dim])
            i = rng.randrange(-(-shape[dim] // size))
            return f"{nm}.split({size}, {dim})[{i}]", lambda t: t.split(size, dim)[i]
    if k == "slice" and nd:
        dim = _dim(rng, r)
        lo = 1 if "zero_size" in p.avoid else 0
        if shape[dim] < lo:
            return None
        a = rng.randint(0, shape[dim] - lo)
        b = rng.randint(a + lo, shape[dim])
        idx = (slice(None),) * dim + (slice(a, b),)
        return f"{nm}[{', '.join([':'] * dim + [f'{a}:{b}'])}]", lambda t: t[idx]
    return None


OLD_OPS = ("neg", "relu", "exp", "tanh", "sigmoid", "abs", "mul_s", "div_s", "add_s", "rsub_s",
           "add", "sub", "mul", "div", "maximum", "sum", "mean", "amax", "sum_all", "softmax",
           "log_softmax", "transpose", "permute", "reshape", "view", "unsqueeze", "squeeze",
           "flatten", "matmul", "cat", "stack", "split", "slice")
OPS = OLD_OPS + MORE + HABITS   # the first 33 kinds, tests/random_programs_more.py's, then
#                                  tests/random_programs_habits.py's


def _close(got, want, what, loose=False, half=False, part_atol=0.0):
    if got.shape != want.shape:
        raise _Wrong(f"{what}: shape {tuple(got.shape)}, one device {tuple(want.shape)}")
    if got.dtype != want.dtype:
        raise _Wrong(f"{what}: dtype {got.dtype}, one device {want.dtype}")
    rtol, atol = 1e-6, 1e-8
    loose = loose and (want.dtype.is_floating_point or want.dtype.is_complex)
    if loose or want.dtype in (torch.float32, torch.complex64):   # a float32 sum's order
        rtol, atol = 1e-4, 1e-5 * max(1.0, float(want.abs().nan_to_num(0, 0, 0).max())
                                      if want.numel() else 1.0)
    if half and (want.dtype.is_floating_point or want.dtype.is_complex):
        # after a bfloat16 / float16 step: its sums in parts round apart
        rtol, atol = 2e-2, 2e-2 * max(1.0, float(want.abs().nan_to_num(0, 0, 0).max())
                                      if want.numel() else 1.0) + part_atol
    if not torch.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True):
        if want.dtype == torch.bool:     # (bool - bool raises: seed 1042679 was "raised")
            raise _Wrong(f"{what}: values differ ({int((got != want).sum())} of "
                         f"{want.numel()} elements)")
        err = (got - want).abs().nan_to_num(float("inf")).max()
        raise _Wrong(f"{what}: values differ (max error {float(err):.3g})")


def _chunk_local(x, mesh_shape, placements, coord):
    """The shard of ``x`` at mesh coordinate ``coord``: nested ``torch.chunk`` left to
    right over the mesh dims, padded with empty chunks (DTensor's layout; the DTensor
    oracle, tests/test_dtensor_oracle.py, holds this definition to DTensor itself)."""
    t = x
    for i, q in enumerate(placements):
        if q.is_shard():
            n, dim = mesh_shape[i], q.dim
            pieces = list(torch.chunk(t, n, dim)) if t.shape[dim] else []
            pieces += [t.narrow(dim, t.shape[dim], 0)] * (n - len(pieces))
            t = pieces[coord[i]]
    return t


def _close_locals(d, want, what, loose=False, half=False, part_atol=0.0):
    """Every rank's local shard of ``d`` (no Partial) is its chunk of the one-device value."""
    if any(q.is_partial() for q in d.placements):
        return
    ranks = torch.tensor(d.mesh.tolist())
    for coord in itertools.product(*[range(n) for n in ranks.shape]):
        _close(d.local(int(ranks[coord])).detach(),
               _chunk_local(want, tuple(ranks.shape), d.placements, coord),
               f"{what} local shard at mesh {coord} ({[str(q) for q in d.placements]})",
               loose, half, part_atol)


def _refuses_as_torch(p, cur, txt, f, err):
    """Torch raised ``err`` for ``txt``: the DistTensor call raises too (torch's exception
    type, or a clear refusal), and leaves the program's tensors as they were."""
    tensors = [(cur[0], cur[1])] + [(ln, ld) for ln, ld, _, _ in p.leaves]
    before = [t.full().detach().clone() for _, t in tensors]
    try:
        f(cur[1])
    except type(err):
        pass
    except CLEAR as e:
        p.lines.append(f"{txt}  # torch raises {type(err).__name__}")
        raise _Refused(f"{txt}: torch raised {type(err).__name__}, here "
                       f"{type(e).__name__}") from e
    except Exception:
        p.lines.append(f"{txt}  # torch raises {type(err).__name__}: {str(err)[:100]}")
        raise
    else:
        p.lines.append(f"{txt}  # torch raises {type(err).__name__}")
        raise _Wrong(f"{txt}: torch raised {type(err).__name__} ({str(err)[:120]}), "
                     f"here a result")
    for (nm, t), b in zip(tensors, before):
        _close(t.full().detach(), b, f"{nm} after the refused {txt}")


class _Refused(Exception):
    pass


def _where(e) -> str:
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/workbench/" in f.filename]
    if not frames:
        return "outside workbench"
    f = frames[-1]
    return f"{f.filename.split('/workbench/')[-1]}:{f.lineno}"


def run_program(rng: random.Random, n_ops: int | None = None, avoid=KNOWN + SLOW,
                wide: bool = False) -> Outcome:
    """Draw and run one program (see the module doc); ``wide``: in the wider space of
    tests/random_programs_wide.py (other dtypes, reshards, no_grad / autocast, more ops and
    backward forms); the programs of ``wide=False`` are those drawn before it existed."""
    p = _Prog(rng, avoid)
    p.wide = wide
    p.mesh = _mesh(rng)
    p.lines.append(f"mesh = wb.Mesh({p.mesh.tolist()})")
    try:
        shape = p.shape()
        if wide:
            first = _wide.dtype(rng)
        else:
            first = torch.float32 if rng.random() < 0.1 else torch.float64
        cur = p.leaf(shape, dtype=first)
        for _ in range(rng.randint(1, 6) if n_ops is None else n_ops):
            for _try in range(20):
                drawn = _op(p, cur)
                if drawn is None:
                    continue
                txt, f = drawn
                try:
                    ref = f(cur[2])
                except Exception as e:  # noqa: BLE001 - torch refuses it: so must we
                    _refuses_as_torch(p, cur, txt, f, e)
                    continue
                nm = p.name()
                p.lines.append(f"{nm} = {txt}")
                p.low |= ref.dtype in LOW
                # (a bfloat16 step in an old program too: seed 1072063's t2.to(bfloat16) +
                # t3 summed t3's gradient over 10 bfloat16 elements in two shards, 0.2300
                # against one device's 0.2295, one bfloat16 ulp at 0.23)
                p.half |= ref.dtype in (torch.bfloat16, torch.float16)
                cur = (nm, f(cur[1]), ref)
                # after a float32 step, its rounding shows in a float64 value too (seed
                # 970803: a float32 P(sum) sum stacked with a float64 tensor, 1.2e-7)
                _close(cur[1].full().detach(), ref.detach(), nm, loose=p.low, half=p.half,
                       part_atol=p.part_atol)
                _close_locals(cur[1], ref.detach(), nm, loose=p.low, half=p.half,
                              part_atol=p.part_atol)
                break
        nm, d, r = cur
        if r.requires_grad and r.is_floating_point():
            g = torch.randn(r.shape, generator=torch.Generator().manual_seed(7), dtype=r.dtype)
            # (a complex result is not backpropagated: (out * g).sum() is no real scalar;
            # a complex leaf's gradient is held to torch's through a real result)
            form = rng.choice(_wide.BACKWARDS) if wide else "sum"
            p.lines.append(_wide.BACKWARD_TEXT[form].format(nm=nm))
            p.kind = "backward"
            try:
                wants = _wide.backward(form, r, g, [lr for _, _, lr, _ in p.leaves])
            except (RuntimeError, IndexError):  # torch has no derivative for it (heaviside),
                # or its own backward fails (torch 2.13: _foreach_addcdiv of a 0-d input
                # without grad, a 0-d tensor1 with: IndexError, sweep15 seed 5000090): done
                return Outcome("ok", "\n".join(p.lines))
            gots = _wide.backward(form, d, g, [ld for _, ld, _, _ in p.leaves])
            for (ln, ld, lr, ps), gd, gr in zip(p.leaves, gots, wants):
                if not lr.requires_grad:
                    continue
                # the gradient of a P(avg/max/min) leaf's parts is not the value's gradient
                if any(q.is_partial() and q.reduce_op != "sum" for q in ps):
                    continue
                want = gr if gr is not None else torch.zeros_like(lr)
                got = gd.full() if gd is not None else torch.zeros_like(lr)
                # a gradient that went through a float32 step: a float32 sum's order
                # shows in it (seed 941820: 6e-8 in a float64 0-d leaf's gradient)
                _close(got, want, f"{ln}.grad", loose=p.low, half=p.half,
                       part_atol=p.part_atol)
    except _Wrong as e:
        return Outcome("wrong", "\n".join(p.lines), str(e), kind=p.kind)
    except _Refused as e:       # torch's error, here a clear refusal of another type
        c = e.__cause__
        return Outcome("refused", "\n".join(p.lines), f"{e} ({c})"[:300], type(c).__name__,
                       _where(c))
    except Exception as e:  # noqa: BLE001 - classified for the report
        status = "refused" if isinstance(e, CLEAR) else "raised"
        return Outcome(status, "\n".join(p.lines), f"{type(e).__name__}: {e}"[:300],
                       type(e).__name__, _where(e))
    return Outcome("ok", "\n".join(p.lines))
