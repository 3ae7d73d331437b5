"""A backward run before the data-parallel wrapper / optimizer is built (its gradients
carried onto the replicas: ``grad_replicas.GradReplicas._carried_grad``), on the hybrid
recipe with sequence parallelism, whose norm weights' gradients are partial sums over tp:
the gradient read, the clip norm and the step are those of the usual order (optimizer
first).  The suspicion (zero1tp's note): ZeRO, which sums every gradient at step, would
sum a carried partial norm gradient twice.  Measured: it does not (dp rank 0 keeps the
carried gradient, the other replicas zeros; the tp sum then the dp reduce-scatter give it
back once): these tests guard it."""
import pytest
import torch

from workbench.models.config import get_config
from workbench.recipes.hybrid import Hybrid

from .test_habits11 import close


def _run(zero, backward_first, lr=1e-1):
    cfg = get_config("tiny")
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.vocab_size, (4, 16), generator=g) for _ in range(2))
    st = Hybrid(dp=2, tp=2, sp=True, zero=zero)
    model = st.build_model(cfg, 0)
    assert st._sp_norms
    if backward_first:
        st.forward_backward(model, x, y)
        (opt,) = st.build_optimizer(model, lr, 0.0)
    else:
        (opt,) = st.build_optimizer(model, lr, 0.0)
        st.forward_backward(model, x, y)
    grads = {n: p.grad.full().clone() for n, p in model.named_parameters()} if zero < 2 \
        else None                                   # (ZeRO-2's p.grad: in the shards)
    norm = opt.clip_grad_norm_(1e9)
    opt.step()
    return grads, norm, {n: p.full().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_a_backward_before_the_optimizer_is_summed_once(zero):
    g0, n0, w0 = _run(zero, False)
    g1, n1, w1 = _run(zero, True)
    close(n1, n0)
    if g0 is not None:
        for k in g0:
            torch.testing.assert_close(g1[k], g0[k], rtol=1e-6, atol=1e-7)
    for k in w0:        # AdamW's first step divides by |g|: a rounding of a tiny element
        torch.testing.assert_close(w1[k], w0[k], rtol=1e-4, atol=2e-5)
