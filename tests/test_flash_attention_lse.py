"""flash_attention(..., return_lse=True): the log-sum-exp of each query row's scores."""
import pytest
import torch

import workbench as wb


@pytest.mark.parametrize("backend", ["reference", "unfused", "native"])
def test_return_lse_is_the_rows_logsumexp_and_differentiable(backend):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 5, 8, requires_grad=True)
    k, v = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)        # GQA: 2 kv heads
    with wb.ops.use(backend):
        out, lse = wb.ops.flash_attention(q, k, v, causal=True, return_lse=True)
        alone = wb.ops.flash_attention(q, k, v, causal=True)
    assert torch.equal(out, alone)
    kk = k.repeat_interleave(2, 1)
    s = (q @ kk.transpose(-2, -1)) / 8 ** 0.5
    s = s.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 5)
    lse.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_return_lse_of_a_row_with_no_key_is_minus_inf():
    q, k, v = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    mask = torch.tensor([[True, True, False], [False, False, False]])
    _, lse = wb.ops.flash_attention(q, k, v, mask=mask, return_lse=True)
    assert lse[0, 0, 1] == float("-inf") and torch.isfinite(lse[0, 0, 0])


def test_return_lse_on_dist_tensors_is_refused_clearly():
    mesh = wb.Mesh.grid(2, ["dp"])
    q = wb.shard_tensor(torch.randn(2, 1, 3, 4), mesh, ["S(0)"])
    with pytest.raises(NotImplementedError, match="return_lse"):
        wb.ops.flash_attention(q, q, q, return_lse=True)
