"""addmm / addmv / baddbmm / addbmm with beta=0 on DistTensors: torch's input gradient is
grad * beta (derivatives.yaml: maybe_multiply(grad, beta)), zeros of the input's shape,
where ours was None (the input not read at all); the input's values stay unread (a NaN
there does not reach the result), and the result's bits are those of the no-grad call."""
import pytest
import torch

import workbench as wb

CASES = [(torch.addmm, ((4, 6), (4, 5), (5, 6))), (torch.addmm, ((6,), (4, 5), (5, 6))),
         (torch.addmv, ((4,), (4, 5), (5,))),
         (torch.baddbmm, ((2, 4, 6), (2, 4, 5), (2, 5, 6))),
         (torch.addbmm, ((4, 6), (2, 4, 5), (2, 5, 6)))]
R, S0 = wb.Replicate(), wb.Shard(0)


@pytest.mark.parametrize("fn,shapes", CASES, ids=[f"{f.__name__}{s[0]}" for f, s in CASES])
@pytest.mark.parametrize("ps", [[R, R], [S0, R], [R, S0]], ids=["RR", "S0R", "RS0"])
def test_beta_zero_input_gradient_is_zeros_as_torch(fn, shapes, ps):
    mesh = wb.Mesh.grid((2, 2))
    g = torch.Generator().manual_seed(0)
    inp = torch.randn(*shapes[0], generator=g)
    inp.view(-1)[0] = float("nan")
    a, b = (torch.randn(*s, generator=g) for s in shapes[1:])
    i = inp.clone().requires_grad_()
    ref = fn(i, a, b, beta=0)
    ref.sum().backward()
    di = wb.distribute_tensor(inp, mesh, ps).requires_grad_()
    da, db = (wb.distribute_tensor(t, mesh, [R, R]) for t in (a, b))
    out = fn(di, da, db, beta=0)
    out.sum().backward()
    torch.testing.assert_close(out.full_tensor(), ref, rtol=1e-5, atol=1e-6)   # no NaN
    assert di.grad is not None, "input's gradient None where torch gives zeros"
    assert torch.equal(di.grad.full_tensor(), i.grad) and not i.grad.any()
    plain = fn(wb.distribute_tensor(inp, mesh, ps), da, db, beta=0)
    assert torch.equal(plain.full_tensor(), out.full_tensor())        # the same bits
