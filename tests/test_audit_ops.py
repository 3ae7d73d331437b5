"""User-trial audit of workbench.ops against PyTorch's own ops (small, fast)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import workbench as wb


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(3, 2)) for _ in range(2)]


def _steps(opt, ps, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


@pytest.mark.parametrize("kw", [dict(amsgrad=True), dict(maximize=True)])
def test_adamw_refuses_unsupported_options(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        wb.ops.AdamW(_params(), **kw)
    ps = _params()                                  # a param group asking for it: not ignored
    opt = wb.ops.AdamW([dict(params=ps, **kw)], lr=0.1)
    for p in ps:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in ps]
    with pytest.raises(ValueError, match=next(iter(kw))):
        opt.step()
    for p, b in zip(ps, before):
        assert torch.equal(p.detach(), b)


def test_adamw_false_options_and_groups_match_torch():
    a, b = _params(), _params()
    groups = lambda ps: [dict(params=ps[:1], lr=0.5), dict(params=ps[1:], weight_decay=0.0)]
    oa = torch.optim.AdamW(groups(a), lr=0.1, amsgrad=False, maximize=False)
    ob = wb.ops.AdamW(groups(b), lr=0.1, amsgrad=False, maximize=False)
    _steps(oa, a, 3)
    _steps(ob, b, 3)
    for x, y in zip(a, b):
        assert_close(x, y)


def test_adamw_loads_torch_state_dict_and_continues():
    a, b = _params(), _params()
    oa = torch.optim.AdamW(a, lr=0.1)
    _steps(oa, a, 3)
    ob = wb.ops.AdamW(b, lr=0.1)
    with torch.no_grad():
        for x, y in zip(a, b):
            y.copy_(x)
    ob.load_state_dict(copy.deepcopy(oa.state_dict()))   # its step is a tensor
    _steps(oa, a, 2, seed=7)
    _steps(ob, b, 2, seed=7)
    for x, y in zip(a, b):
        assert_close(x, y)


@pytest.mark.parametrize("backend", ["reference", "unfused", "native"])
def test_attention_matches_sdpa(backend):
    torch.manual_seed(0)
    q = torch.randn(1, 4, 3, 5, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 7, 5, dtype=torch.float64) for _ in range(2))
    with wb.ops.use(backend):
        assert_close(wb.ops.flash_attention(q, k, v, causal=True, scale=0.3),
                     F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3,
                                                    enable_gqa=True))


def test_rms_norm_eps_none_is_finfo_eps_and_weight_none_is_refused():
    torch.manual_seed(0)
    x, w = torch.randn(2, 3, 4) * 1e-4, torch.randn(3, 4)
    assert_close(wb.ops.rms_norm(x, w, None), F.rms_norm(x, (3, 4), w, None))
    with pytest.raises(TypeError, match="weight=None"):
        wb.ops.rms_norm(x, None)
