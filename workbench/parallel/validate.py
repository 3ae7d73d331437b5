"""Per-candidate validation of the SPMD rules, as PyTorch DTensor's
``torch/distributed/tensor/_ops/strategy_validation.py`` does for its own.

The dispatcher runs only the candidate the chooser picks, so a wrong but costlier
candidate stays hidden until another hardware profile makes it the cheapest.  Here,
for every op of the op table with a sample call (its registration's, :func:`ops_table.samples.samples`), every input
layout on 1-d and 2-d meshes (uneven sizes; Partial inputs made of deliberately
unequal parts, for every reduce op), EACH candidate the rule offers is forced in
turn, run, and its gathered result held to one device's:

* wrong: a candidate whose result, dtype, local shapes or announced placements
  differ from one device (or that raises);
* missing (1-d meshes): an output placement that is exact for inputs used as they
  are, but that no candidate offers (``R -> P(max)`` and the like, true of every
  replicated output, are not reported, nor are bool outputs: a comparison of
  unequal parts agrees with one device by construction more often than in general).  A layout counts as exact only if it holds
  for the sample and for its negation (signs decide ``P(max)`` identities).

    >>> report = validate(ops=["relu"])
    >>> report.wrong
    []

The coupling to the dispatcher is in :func:`_decide` and :func:`_run` only.
"""
from __future__ import annotations

import dataclasses
import itertools
import random
import time
from dataclasses import dataclass, field

import torch

from ..sim_mesh.mesh import Mesh
from . import layout
from .dist_tensor import DistTensor
from .placement import PARTIAL_OPS, Partial, Replicate, Shard, fmt_placements
from .ops_table.strategy import RULES, Candidate, Strategy
from .validate_inputs import _get, _leaves, _neg, _options, _substitute, distribute
from .ops_table.samples import Sample, samples, unchecked

__all__ = ["Finding", "Report", "Sample", "validate", "distribute", "MESHES"]

MESHES = ((2,), (3,), (2, 2))     # mesh shapes: 3 ranks makes 5 or 4 rows uneven


# ---- coupling to the dispatcher (adapt here when the op table changes) ------------------------

class _Op:
    """An op-table entry seen through one of its callables (that callable's parse)."""
    __slots__ = ("entry", "parse", "name")

    def __init__(self, entry, parse):
        self.entry, self.parse, self.name = entry, parse, entry.name


def _opdef(fn):
    from .ops_table.table import BY_FUNC
    hit = BY_FUNC.get(fn)
    return None if hit is None else _Op(*hit)


def _implemented() -> set:
    from .ops_table.table import TABLE
    return {name for name, e in TABLE.items() if e.runs and e.rule is not None}


def _decide(opdef, args, kwargs):
    """(inputs, attrs, specs, mesh, decision) for one call, as dispatch() computes them."""
    from .dispatch import _spec_of
    from .ops_table.strategy import infer
    inputs, attrs = opdef.parse(*args, **kwargs)
    mesh = next(x.mesh for x in inputs if isinstance(x, DistTensor))
    specs = tuple(_spec_of(x, mesh) for x in inputs)
    return inputs, attrs, specs, mesh, infer(opdef.name, *specs, **attrs)


def _run(opdef, dec, cand, inputs, specs, attrs, mesh) -> tuple:
    """Run ``cand`` (whether or not it is the cheapest) as dispatch() runs its choice."""
    from .dispatch import _prepare, run_prepared
    if opdef.entry.extra.get("data_dependent"):         # no shape before it runs
        from .dispatch_datadep import run_data_dependent
        out = run_data_dependent(opdef.entry, inputs, attrs, force=lambda d: cand)
        return out if isinstance(out, tuple) else (out,)
    prep = _prepare(opdef.entry, dec, inputs, specs, attrs, mesh, cand=cand)
    out = run_prepared(opdef.entry, prep, inputs, specs, attrs, mesh)
    return out if isinstance(out, tuple) else (out,)


# ---- the report ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Finding:
    kind: str               # "wrong" | "missing"
    op: str
    call: str               # the sample call
    mesh: tuple             # mesh shape
    inputs: str             # the input layouts given
    candidate: str          # (required inputs) -> (outputs)
    max_error: float        # max |result - one device| (nan: no comparable result)
    detail: str

    def __str__(self) -> str:
        err = "" if self.max_error != self.max_error else f", max error {self.max_error:.3g}"
        return (f"{self.kind}: {self.call} on mesh {self.mesh}, inputs {self.inputs}: "
                f"{self.candidate}{err} ({self.detail})")


@dataclass
class Report:
    findings: list = field(default_factory=list)
    runs: int = 0               # candidate runs
    layouts: int = 0            # input layouts checked
    layouts_total: int = 0      # input layouts there are (before a max_layouts cap)
    ops: list = field(default_factory=list)
    skipped: dict = field(default_factory=dict)     # op -> why not checked
    seconds: float = 0.0

    def merge(self, other: "Report") -> "Report":
        """Both reports in one (e.g. one op at a time)."""
        return Report(self.findings + other.findings, self.runs + other.runs,
                      self.layouts + other.layouts, self.layouts_total + other.layouts_total,
                      self.ops + other.ops, {**self.skipped, **other.skipped},
                      self.seconds + other.seconds)

    @property
    def wrong(self) -> list:
        return [f for f in self.findings if f.kind == "wrong"]

    @property
    def missing(self) -> list:
        return [f for f in self.findings if f.kind == "missing"]

    def __str__(self) -> str:
        return self.format()

    def format(self, per_op: int = 3) -> str:
        """The summary, every wrong candidate, and up to ``per_op`` missing layouts per op."""
        why = {}
        for op, reason in sorted(self.skipped.items()):
            why.setdefault(reason, []).append(op)
        lines = [f"validated {len(self.ops)} ops: {self.layouts} of {self.layouts_total} input "
                 f"layouts, {self.runs} candidate runs in {self.seconds:.1f} s; "
                 f"{len(self.wrong)} wrong candidates, {len(self.missing)} missing layouts"]
        lines += [f"  skipped {len(ops)} ({reason}): {', '.join(ops)}" for reason, ops in why.items()]
        lines += [f"  {f}" for f in self.wrong]
        groups: dict = {}
        for f in self.missing:
            groups.setdefault(f.op, []).append(f)
        for op, fs in sorted(groups.items()):
            lines.append(f"  missing for {op} ({len(fs)}): " + "; ".join(
                f"{f.call} mesh {f.mesh}: {f.candidate}" for f in fs[:per_op]) +
                ("; ..." if len(fs) > per_op else ""))
        return "\n".join(lines)


# ---- checking one run ---------------------------------------------------------------------

def _tol(dtype):
    return {torch.float64: (1e-7, 1e-9), torch.float16: (1e-2, 2e-2),
            torch.bfloat16: (4e-2, 6e-2)}.get(dtype, (1e-4, 1e-5))


def _compare(outs, refs, cand_outs, mesh) -> tuple[bool, float, str]:
    """(exact, max error, what differs) of a run's outputs against one device's."""
    if len(outs) != len(refs):
        return False, float("nan"), f"{len(outs)} outputs, one device gives {len(refs)}"
    worst = 0.0
    for j, (o, r, ps) in enumerate(zip(outs, refs, cand_outs)):
        if not isinstance(o, DistTensor):
            return False, float("nan"), f"output {j} is a {type(o).__name__}"
        if tuple(o.placements) != tuple(ps):
            return False, float("nan"), f"output {j} placed {fmt_placements(o.placements)}"
        if o.dtype != r.dtype:
            return False, float("nan"), f"output {j} dtype {o.dtype}, one device {r.dtype}"
        for rank in mesh.ranks:
            loc = o.local(rank)
            want = layout.local_shape(r.shape, mesh, ps, rank)
            if loc.dtype != o.dtype or tuple(loc.shape) != tuple(want):
                return False, float("nan"), (f"output {j} rank {rank} holds {loc.dtype} "
                                             f"{tuple(loc.shape)}, expected {o.dtype} {want}")
        got = o.full().detach()
        if got.shape != r.shape:
            return False, float("nan"), f"output {j} shape {tuple(got.shape)} != {tuple(r.shape)}"
        if r.is_complex():            # (re, im) with the tolerance of their real dtype
            got, r = torch.view_as_real(got.resolve_conj()), torch.view_as_real(r.resolve_conj())
        if not r.is_floating_point():
            if not torch.equal(got, r):
                return False, float((got.double() - r.double()).abs().max()), f"output {j} values"
            continue
        g, e = got.double(), r.double()
        rtol, atol = _tol(r.dtype)
        bad = ~torch.isclose(g, e, rtol=rtol, atol=atol, equal_nan=True)
        if bad.any():
            diff = (g - e).abs()
            worst = max(worst, float(diff[bad].nan_to_num(float("inf")).max()))
            return False, worst, f"output {j}: {int(bad.sum())} of {r.numel()} values differ"
    return True, worst, ""


def _attempt(opdef, dist_args, dist_kwargs, refs, cand_fn):
    """Decide, then run the candidates ``cand_fn(decision)`` picks; yields
    (candidate, exact, max error, detail)."""
    from .dispatch_local import VALIDATE
    inputs, attrs, specs, mesh, dec = _decide(opdef, dist_args, dist_kwargs)
    for cand in cand_fn(dec, specs):
        VALIDATE.append(True)        # "replicated" outputs must be equal on every rank
        try:
            outs = _run(opdef, dec, cand, inputs, specs, attrs, mesh)
            ok, err, why = _compare(outs, refs, cand.strategy.outputs, mesh)
        except Exception as e:  # noqa: BLE001 - a raising candidate is a finding
            ok, err, why = False, float("nan"), f"raised {type(e).__name__}: {e}"[:300]
        finally:
            VALIDATE.pop()
        yield cand, ok, err, why


def _cand_str(st: Strategy) -> str:
    ins = ", ".join(fmt_placements(p) if p is not None else "-" for p in st.inputs)
    return f"({ins}) -> ({', '.join(fmt_placements(o) for o in st.outputs)})"


def _reference(sample: Sample, negate: bool = False, opdef=None):
    """One device's outputs of the sample, or of its negation: every tensor negated, and
    every number that the op takes as an operand (not a dim or a size)."""
    if negate:
        paths = _leaves(sample)
        args, kwargs = _substitute(sample, paths, [_neg(_get(sample, p)) for p in paths])
        operands = opdef.parse(*sample.args, **sample.kwargs)[0]
        args = [_neg(a) if isinstance(a, (int, float)) and any(a is o for o in operands)
                else a for a in args]
        sample = Sample(sample.fn, tuple(args), kwargs)
    out = sample.fn(*sample.args, **sample.kwargs)
    return sample, (tuple(out) if isinstance(out, (tuple, list)) else (out,))


# ---- the validator ------------------------------------------------------------------------

def validate(ops=None, meshes=MESHES, *, missing: bool = True, max_layouts: int | None = None,
             table: dict | None = None, seed: int = 0) -> Report:
    """Force every candidate of every rule on every input layout; see the module doc.

    ops: op names to check (default: every op with a rule); meshes: mesh shapes;
    missing: also search 1-d meshes for layouts the rules miss; max_layouts: check at
    most this many input layouts per sample and mesh (a fixed-seed choice);
    table: {op name: [Sample]} instead of the registered ones (:func:`ops_table.samples.samples`)."""
    t0 = time.perf_counter()
    table = samples() if table is None else table
    names = sorted(RULES) if ops is None else list(ops)
    implemented = _implemented()
    rep = Report()
    for name in names:
        if name not in implemented:
            rep.skipped[name] = "no local implementation"
        elif unchecked(name):
            rep.skipped[name] = unchecked(name)
        elif not table.get(name):
            rep.skipped[name] = "no sample call"
        else:
            rep.ops.append(name)
            for sample in table[name]:
                for shape in meshes:
                    _check_sample(rep, name, sample, Mesh.grid(shape), missing, max_layouts, seed)
    rep.seconds = time.perf_counter() - t0
    return rep


def _check_sample(rep, name, sample, mesh, missing, max_layouts, seed):
    opdef = _opdef(sample.fn)
    if opdef is None or opdef.name != name:
        raise ValueError(f"sample {sample} of {name!r} runs op "
                         f"{getattr(opdef, 'name', None)!r}: fix the sample table")
    _, refs = _reference(sample)
    neg_sample, neg_refs = _reference(sample, negate=True, opdef=opdef)
    paths = _leaves(sample)
    per = [_options(_get(sample, p), mesh.ndim) for p in paths]
    combos = list(itertools.product(*per))
    rep.layouts_total += len(combos)
    if max_layouts and len(combos) > max_layouts:
        combos = random.Random(seed).sample(combos, max_layouts)
    for combo in combos:
        rep.layouts += 1
        dist = [distribute(_get(sample, p), mesh, ps, seed=k) for k, (p, ps) in
                enumerate(zip(paths, combo))]
        args, kwargs = _substitute(sample, paths, dist)
        where = dict(op=name, call=str(sample), mesh=tuple(mesh.shape),
                     inputs=", ".join(fmt_placements(ps) for ps in combo))
        try:
            results = list(_attempt(opdef, args, kwargs, refs, lambda d, s: d.candidates))
        except Exception as e:  # noqa: BLE001 - the rule itself failed on this layout
            rep.findings.append(Finding("wrong", candidate="(rule)", max_error=float("nan"),
                                        detail=f"deciding raised {type(e).__name__}: {e}"[:300],
                                        **where))
            continue
        for cand, ok, err, why in results:
            rep.runs += 1
            if not ok:
                rep.findings.append(Finding("wrong", candidate=_cand_str(cand.strategy),
                                            max_error=err, detail=why, **where))
        if missing and mesh.ndim == 1:
            _search_missing(rep, opdef, sample, neg_sample, paths, combo, dist, refs, neg_refs,
                            mesh, where, seed)


def _search_missing(rep, opdef, sample, neg_sample, paths, combo, dist, refs, neg_refs,
                    mesh, where, seed):
    """Layouts (these inputs as they are -> an output) that are exact but not offered.

    Replicate is tested as P(max) and P(min) together (every rank holds the truth iff
    both their max and their min are the truth): the dispatcher computes a replicated
    output of uneven shards on the first rank only, so it cannot be tested directly."""
    if any(_get(sample, path).shape[p.dim] < mesh.shape[i]
           for path, ps in zip(paths, combo) for i, p in enumerate(ps) if p.is_shard()):
        return       # empty shards: not worth a rule (and torch's SDPA dies of SIGFPE on them)
    if all(not bool((r != 0).any()) for r in refs if r.numel()):
        return                                   # all-zero truth tells layouts apart poorly
    if any(r.dtype == torch.bool for r in refs):
        return          # comparisons of unequal parts agree by construction, not in general
    args, kwargs = _substitute(sample, paths, dist)
    inputs, attrs, specs, _, dec = _decide(opdef, args, kwargs)
    given = tuple(s.placements if s is not None else None for s in specs)
    offered = {c.strategy.outputs for c in dec.candidates if tuple(c.strategy.inputs) == given}
    ndist = [distribute(_neg(_get(sample, p)), mesh, ps, seed=k) for k, (p, ps) in
             enumerate(zip(paths, combo))]
    nargs, nkwargs = _substitute(neg_sample, paths, ndist)
    check_neg = all(bool(torch.isfinite(r).all()) for r in neg_refs if r.is_floating_point())
    r0 = refs[0]
    tries = [Shard(d) for d in range(r0.dim()) if r0.shape[d] > 1] + \
        [Partial(op) for op in PARTIAL_OPS]
    exact = {}
    for o in tries:
        outs = (tuple(o for _ in range(mesh.ndim)),) * len(refs)
        st = Strategy(given, outs)
        cand = Candidate(st, tuple(None for _ in specs), 0.0, 0)

        def one(args_, kwargs_, refs_):
            return next(_attempt(opdef, args_, kwargs_, refs_, lambda d, s: [cand]))[1]
        exact[o] = one(args, kwargs, refs) and (not check_neg or one(nargs, nkwargs, neg_refs))
        rep.runs += 1
    exact[Replicate()] = exact[Partial("max")] and exact[Partial("min")]
    for o, ok in exact.items():
        outs = (tuple(o for _ in range(mesh.ndim)),) * len(refs)
        trivial = o.is_partial() and o.reduce_op != "sum" and exact[Replicate()]
        if ok and not trivial and outs not in offered:
            rep.findings.append(Finding(
                "missing", candidate=_cand_str(Strategy(given, outs)), max_error=0.0,
                detail="exact here and for the negated inputs, but the rule does not offer it",
                **where))
