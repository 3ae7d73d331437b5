"""The op table, enumerated: every op with a rule runs on DistTensors and equals one
device (value, shape, dtype) under every input placement on 2 ranks (Partial inputs
from unequal parts); every op that runs has a rule, a cost and an op class; every op
that is not a view records a compute event on the trace."""
import zlib

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from tests.spmd_harness import check_op
from tests.test_distops_more import TABLE_SAMPLES
from tests.test_distops_datadep import DATADEP_SAMPLES
from tests.test_distops_conv import CONV_SAMPLES
from workbench.parallel.ops_table import OP_CLASSES, RULES, TABLE
from workbench.parallel.ops_table.ring_attention import ring_attention_step

torch.manual_seed(0)
X, Y = torch.randn(4, 6), torch.randn(4, 6)
POS = X.abs() + 0.5
IDX = torch.stack([torch.randperm(6)[:3] for _ in range(4)])            # (4, 3) distinct per row
Q, K, V = (torch.randn(2, 2, 4, 6) for _ in range(3))
COS, SIN = wb.ops.rope_cos_sin(4, 6)
MASK = torch.rand(4, 6) > 0.5
_, MOE_E, MOE_S, _ = wb.ops.router_topk(torch.randn(4, 6, 3), 2, capacity=3)   # (4, 6, 2)


def seeded_dropout(x):
    torch.manual_seed(3)
    return F.dropout(x, 0.5)


SAMPLES = {      # op name -> (function, inputs): floating inputs are laid out every way
    "abs": (torch.abs, [X]), "neg": (lambda x: -x, [X]), "relu": (F.relu, [X]),
    "gelu": (F.gelu, [X]), "silu": (F.silu, [X]), "sigmoid": (torch.sigmoid, [X]),
    "tanh": (torch.tanh, [X]), "exp": (torch.exp, [X]), "log": (torch.log, [POS]),
    "sqrt": (torch.sqrt, [POS]), "rsqrt": (torch.rsqrt, [POS]), "square": (torch.square, [X]),
    "sin": (torch.sin, [X]), "cos": (torch.cos, [X]), "erf": (torch.erf, [X]),
    "expm1": (torch.expm1, [X]), "log1p": (torch.log1p, [POS]),
    "reciprocal": (torch.reciprocal, [POS]), "softplus": (F.softplus, [X]),
    "leaky_relu": (F.leaky_relu, [X]), "elu": (F.elu, [X]), "mish": (F.mish, [X]),
    "hardtanh": (F.hardtanh, [X]), "floor": (torch.floor, [X]), "ceil": (torch.ceil, [X]),
    "round": (torch.round, [X]), "sign": (torch.sign, [X]), "isnan": (torch.isnan, [X]),
    "isfinite": (torch.isfinite, [X]), "logical_not": (lambda x: torch.logical_not(x > 0), [X]),
    "clone": (torch.clone, [X]), "contiguous": (lambda x: x.contiguous(), [X]),
    "positive": (torch.positive, [X]),
    "add": (torch.add, [X, Y]), "sub": (lambda a, b: a - b, [X, Y]), "mul": (torch.mul, [X, Y]),
    "div": (lambda a, b: a / b, [X, POS]), "pow": (torch.pow, [POS, Y]),
    "maximum": (torch.maximum, [X, Y]), "minimum": (torch.minimum, [X, Y]),
    "atan2": (torch.atan2, [X, Y]), "remainder": (torch.remainder, [X, POS]),
    "fmod": (torch.fmod, [X, POS]),
    "logical_and": (lambda a, b: torch.logical_and(a > 0, b > 0), [X, Y]),
    "logical_or": (lambda a, b: torch.logical_or(a > 0, b > 0), [X, Y]),
    "floor_divide": (lambda a, b: a // b, [X, POS]),
    "bitwise_and": (lambda a, b: (a * 4).long() & (b * 4).long(), [X, Y]),
    "bitwise_or": (lambda a, b: (a * 4).long() | (b * 4).long(), [X, Y]),
    "bitwise_xor": (lambda a, b: (a * 4).long() ^ (b * 4).long(), [X, Y]),
    "bitwise_not": (lambda x: ~(x * 4).long(), [X]),
    "bitwise_left_shift": (lambda a, b: (a * 4).long() << (b.abs() * 2).long(), [X, Y]),
    "bitwise_right_shift": (lambda a, b: (a * 16).long() >> (b.abs() * 2).long(), [X, Y]),
    "lerp": (lambda a, b: torch.lerp(a, b, 0.25), [X, Y]),
    "any": (lambda x: (x > 0.5).any(1), [X]), "all": (lambda x: (x > -1).all(), [X]),
    "isclose": (lambda a, b: torch.isclose(a, b, rtol=0.3, atol=0.3), [X, Y]),
    "eq": (torch.eq, [X, X.round()]), "ne": (torch.ne, [X, X.round()]), "lt": (torch.lt, [X, Y]),
    "le": (torch.le, [X, Y]), "gt": (torch.gt, [X, Y]), "ge": (torch.ge, [X, Y]),
    "to": (lambda x: x.to(torch.float64), [X]), "type_as": (lambda x: x.type_as(POS.double()), [X]),
    "float": (lambda x: x.float(), [X.double()]), "double": (lambda x: x.double(), [X]),
    "half": (lambda x: x.half(), [X]), "bfloat16": (lambda x: x.bfloat16(), [X]),
    "int": (lambda x: x.int(), [X * 3]), "long": (lambda x: x.long(), [X * 3]),
    "bool": (lambda x: x.bool(), [X.round()]),
    "clamp": (lambda x: torch.clamp(x, -0.5, 0.5), [X]),
    "where": (lambda a, b: torch.where(a > 0, a, b), [X, Y]),
    "masked_fill": (lambda x: x.masked_fill(MASK, 0.5), [X]),
    "triu": (lambda x: torch.triu(x, 1), [torch.randn(2, 4, 5)]),
    "tril": (lambda x: x.tril(), [torch.randn(2, 4, 5)]),
    "matmul": (torch.matmul, [X, torch.randn(6, 3)]), "mm": (torch.mm, [X, torch.randn(6, 3)]),
    "bmm": (torch.bmm, [torch.randn(2, 3, 4), torch.randn(2, 4, 5)]),
    "linear": (F.linear, [X, torch.randn(3, 6), torch.randn(3)]),
    "einsum": (lambda a, b: torch.einsum("ij,jk->ik", a, b), [X, torch.randn(6, 3)]),
    "sum": (lambda x: x.sum(1), [X]), "mean": (lambda x: x.mean(0), [X]),
    "amax": (lambda x: x.amax(1), [X]), "amin": (lambda x: x.amin(0), [X]),
    "softmax": (lambda x: torch.softmax(x, 1), [X]), "log_softmax": (lambda x: F.log_softmax(x, 0), [X]),
    "cumsum": (lambda x: torch.cumsum(x, 1), [X]),
    "argmax": (lambda x: torch.argmax(x, 1), [X]), "argmin": (lambda x: x.argmin(0), [X]),
    "topk": (lambda x: tuple(torch.topk(x, 2, dim=1)), [X]),
    "multinomial": (lambda p: torch.multinomial(p, 2, generator=torch.Generator().manual_seed(0)),
                    [POS]),
    "gather": (lambda x: torch.gather(x, 1, IDX), [X]),
    "scatter": (lambda x, s: torch.scatter(x, 1, IDX, s), [X, torch.randn(4, 3)]),
    "index_select": (lambda x: torch.index_select(x, 1, torch.tensor([0, 2, 5])), [X]),
    "expand": (lambda x: x.expand(3, 4, 6), [X]),
    "expand_as": (lambda x: x.expand_as(torch.empty(4, 6)), [torch.randn(4, 1)]),
    "repeat": (lambda x: x.repeat(2, 1, 2), [X]),
    "reshape": (lambda x: x.reshape(24), [X]), "view": (lambda x: x.view(2, 12), [X]),
    "flatten": (lambda x: torch.flatten(x, 1), [torch.randn(2, 3, 4)]),
    "unflatten": (lambda x: x.unflatten(1, (2, 3)), [X]),
    "unsqueeze": (lambda x: x.unsqueeze(0), [X]), "squeeze": (lambda x: x.squeeze(1), [torch.randn(4, 1, 6)]),
    "permute": (lambda x: x.permute(1, 0), [X]), "transpose": (lambda x: x.transpose(0, 1), [X]),
    "cat": (lambda a, b: torch.cat([a, b], 1), [X, Y]), "stack": (lambda a, b: torch.stack([a, b], 1), [X, Y]),
    "split": (lambda x: x.split([2, 4], 1), [X]), "chunk": (lambda x: x.chunk(2, 1), [X]),
    "unbind": (lambda x: x.unbind(0), [torch.randn(2, 6)]), "getitem": (lambda x: x[1:3], [X]),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (6,), w, b), [X, torch.randn(6), torch.randn(6)]),
    "rms_norm": (lambda x, w: F.rms_norm(x, (6,), w), [X, torch.randn(6)]),
    "embedding": (lambda w: F.embedding(torch.tensor([[1, 9], [0, 3]]), w), [torch.randn(10, 4)]),
    "cross_entropy": (lambda z: F.cross_entropy(z, torch.tensor([1, 0, 4, 2])), [torch.randn(4, 5)]),
    "dropout": (seeded_dropout, [X]),
    "scaled_dot_product_attention": (lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, is_causal=True), [Q, K, V]),
    "flash_attention": (lambda q, k, v: wb.ops.flash_attention(q, k, v, causal=True), [Q, K, V]),
    "swiglu": (lambda x: wb.ops.swiglu(x), [X]),
    "rotary_embedding": (lambda x: wb.ops.rotary_embedding(x, COS, SIN), [Q]),
    "ring_attention_step": (lambda q, k, v: ring_attention_step(q, k, v, ring=2, step=1),
                            [Q, K, V]),
    "router_topk": (lambda z: wb.ops.router_topk(z, 2, capacity=3), [torch.randn(4, 6, 3)]),
    "moe_dispatch": (lambda x: wb.ops.moe_dispatch(x, MOE_E, MOE_S, 3, 3), [torch.randn(4, 6, 4)]),
    "moe_combine": (lambda y, w: wb.ops.moe_combine(y, w, MOE_E, MOE_S),
                    [torch.randn(4, 3, 3, 4), torch.randn(4, 6, 2)]),
    "attach_aux_loss": (lambda y, a: wb.ops.attach_aux_loss(y, a, 0.5), [X, torch.randn(4)]),
}
from workbench.parallel.ops_table.pointwise import reduced_copy  # noqa: E402

SAMPLES.update(TABLE_SAMPLES)      # flip, sort, prod, exp2... (tests/test_distops_more.py)
SAMPLES.update(DATADEP_SAMPLES)    # masked_select, unique... (tests/test_distops_datadep.py)
SAMPLES.update(CONV_SAMPLES)       # conv, pooling, batch/group norm (tests/test_distops_conv.py)
SAMPLES["take"] = (lambda x: torch.take(x, torch.tensor([[-1, 9], [0, 23]])), [X])   # fixlist2
SAMPLES["quantile"] = (lambda x: torch.quantile(x, 0.3, dim=1), [X])        # fixlist3
SAMPLES["nanquantile"] = (lambda x: torch.nanquantile(x, torch.tensor([0.2, 0.9]), dim=0),
                          [X])
SAMPLES["searchsorted"] = (lambda s, v: torch.searchsorted(s, v),
                           [torch.sort(torch.randn(8, generator=torch.Generator()
                                                   .manual_seed(5))).values, X])
SAMPLES["detach"] = (torch.detach, [X])                                     # fixlist4
SAMPLES["reduced_copy"] = (reduced_copy, [X])    # a composite's reduction, captured (compile18)
# complex ops (sweep18, ops_table/complex.py): a complex value made of two laid-out real
# inputs (as test_distops_more's view_as_real / complex samples), a real result compared
_Y2 = Y.flip(1)
for _name, _fn in (
        ("conj", lambda a, b: torch.view_as_real(torch.complex(a, b).conj().resolve_conj())),
        ("conj_physical",
         lambda a, b: torch.view_as_real(torch.conj_physical(torch.complex(a, b)))),
        ("resolve_conj",
         lambda a, b: torch.view_as_real(torch.complex(a, b).conj().resolve_conj())),
        ("resolve_neg", lambda a, b: torch.complex(a, b).conj().imag.resolve_neg()),
        ("real", lambda a, b: torch.complex(a, b).real * 1),
        ("imag", lambda a, b: torch.complex(a, b).imag * 1),
        ("angle", lambda a, b: torch.angle(torch.complex(a, b)))):
    SAMPLES[_name] = (_fn, [X, _Y2])
SAMPLES["nanmedian"] = (lambda x: tuple(torch.nanmedian(x, 1)), [X])        # fixlist6
SAMPLES["nanmedian_all"] = (torch.nanmedian, [X])
SAMPLES["kthvalue_rows"] = (lambda x: tuple(torch.kthvalue(x, 2, 1)), [X])     # sweep11b
SAMPLES["median_rows"] = (lambda x: tuple(torch.median(x, 0)), [X])
SAMPLES["median_all"] = (torch.median, [X])                                  # sw12
M2 = wb.Mesh.grid(2, ["a"])


def runnable():
    return sorted(n for n, e in TABLE.items() if e.runs)


# ops a sample of plain inputs cannot run: held to eager by their own tests
ELSEWHERE = {"expert_parallel": "tests/test_fixlist16.py (an ExpertParallel dispatcher over "
                                "an expert mesh, compiled against eager)",
            "wrap_indices": "tests/test_compile10.py (an integer index: the harness lays out "
                            "floating inputs only)"}
# the recipes' layout hooks (Megatron's f and g over a tp mesh dim; a MoE layer's output laid
# out as its input): compiled Hybrid models against eager
ELSEWHERE.update(dict.fromkeys(("megatron_f", "megatron_g", "keep_layout"),
                               "tests/test_compile11.py"))
# a value written over one with history (wb.compile's captured in-place writes)
ELSEWHERE["overwrite"] = "tests/test_compile13.py"
# a compiled program's t.redistribute, pinned (wb.compile's tracer)
ELSEWHERE["kept_copy"] = "tests/test_compile14.py"


def test_every_op_in_the_table_has_a_sample_and_everything():
    assert set(SAMPLES) == set(runnable()) - set(ELSEWHERE), \
        "add a sample for every op in the table"
    for name in runnable():
        e = TABLE[name]
        assert e.rule is not None and RULES[name] is e.rule, name
        assert e.cost is not None and e.op_class in OP_CLASSES, name
    builtin = {n for n in RULES if not TABLE[n].extra.get("user")}   # not wb.register_rule's
    assert builtin <= set(runnable()), f"rules that cannot run: {builtin - set(runnable())}"


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_op_runs_on_every_placement_like_one_device(name):
    fn, inputs = SAMPLES[name]
    ref = fn(*inputs)
    refs = ref if isinstance(ref, tuple) else (ref,)
    skip = None
    if len([x for x in inputs if x.is_floating_point()]) >= 3:         # attention: a sample
        # a seventh of the combinations, chosen by crc32 (str's hash() is salted per
        # process), and every input sharded on dim 1 (attention's heads)
        skip = lambda mesh, combo: (zlib.crc32(str(combo).encode()) % 7 != 0 and  # noqa: E731
                                    any(ps != (wb.Shard(1),) * mesh.ndim for ps in combo))
    checked = check_op(fn, inputs, meshes=[M2], skip=skip or (lambda m, c: False),
                       rtol=1e-3 if name in ("half", "bfloat16") else 1e-4)
    assert checked >= 3, (name, checked)     # 5 of 36 for layer_norm, 29 of 216 for attention
    dist = [wb.shard_tensor(x, M2, [wb.Shard(0)]) for x in inputs]
    outs = fn(*dist)
    outs = outs if isinstance(outs, tuple) else (outs,)
    for o, r in zip(outs, refs):
        assert o.dtype == r.dtype and o.full().dtype == r.dtype, (name, o.dtype, r.dtype)
        assert o.shape == r.shape


def profile_prices_float64() -> bool:
    """The clock's profiles gain float64 peaks (issue 11); until then float64 waits."""
    try:
        wb.get_profile(None).peak(torch.float64)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_op_records_its_compute(name):
    fn, inputs = SAMPLES[name]
    if any(x.dtype == torch.float64 for x in inputs) and not profile_prices_float64():
        pytest.skip("the default profile has no float64 peak yet (the clock's part)")
    dist = [wb.shard_tensor(x, M2, [wb.Replicate()]) for x in inputs]
    with wb.trace() as tr:
        fn(*dist)
    evs = [e for e in tr.events if e.stream == "compute" and e.name == name]
    if TABLE[name].op_class == "view":
        assert not evs, f"{name} is a view: no kernel runs"
    else:
        assert evs and all(e.bytes > 0 and e.duration > 0 for e in evs), name
        assert evs[0].args["op_class"] == TABLE[name].op_class


def test_every_candidate_can_be_forced_and_is_right():
    """The validator's hook: each candidate the rule offers runs, and equals one device."""
    from workbench.parallel.dispatch import force_candidate
    A, B = torch.randn(5, 6), torch.randn(6, 3)
    a, b = wb.shard_tensor(A, M2, [wb.Shard(0)]), wb.shard_tensor(B, M2, [wb.Shard(0)])
    dec = wb.spmd.infer("matmul", a.spec, b.spec)
    assert len(dec.candidates) > 2
    for c in dec.candidates:
        with force_candidate(lambda d, c=c: next(x for x in d.candidates
                                                 if x.strategy == c.strategy)):
            out = a @ b
        assert out.placements == c.strategy.outputs[0]
        torch.testing.assert_close(out.full(), A @ B)
