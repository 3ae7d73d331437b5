"""Review of the ddpbucket and auditserve2 merges (revI): each defect found, held to torch's
own DistributedDataParallel (gloo processes) or to one device."""
import collections
import copy
import dataclasses

import pytest
import torch
from torch import nn
from torch.nn.parallel.distributed import _find_tensors

import workbench as wb
from workbench.parallel.strategies.laid_out_whole import storage  # the rows (habits13)
from workbench.parallel.strategies.ddp_buckets import output_tensors
from tests.torchrun_support import ddp_unused_rows


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (nn.Linear(4, 4).double(), nn.Linear(4, 4).double(),
                                  nn.Linear(4, 2).double())

    def forward(self, x, skip_b=False):
        y = torch.tanh(self.a(x))
        return self.c(y if skip_b else torch.tanh(self.b(y)))


def batch(step):
    return torch.randn(12, 4, generator=torch.Generator().manual_seed(100 + step),
                       dtype=torch.float64)


# ---- DDP on simulated ranks: a gradient averaged by an earlier backward -------------------
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("kw", [{}, {"find_unused_parameters": True}, {"bucket_bytes": 1},
                                {"static_graph": True}])
def test_simulated_unused_parameter_keeps_its_averaged_gradient(n, kw):
    """b is used in step 1 and skipped in step 2 (no zero_grad: gradients accumulate).
    One device (and torch DDP, find_unused_parameters=True): b's gradient stays step 1's.
    Was: its rows, each already the average, were summed again: n times the gradient."""
    ref = Net()
    for step, skip in enumerate([False, True]):
        ref(batch(step), skip_b=skip).mean().backward()
    mesh = wb.Mesh.grid(n, ["dp"])
    ddp = wb.DistributedDataParallel(Net(), mesh, **kw)
    for step, skip in enumerate([False, True]):
        ddp(wb.shard_tensor(batch(step), mesh, [wb.Shard(0)]), skip_b=skip).mean().backward()
    for name, p in ddp.module.named_parameters():
        want = dict(ref.named_parameters())[name].grad
        for k in range(n):                                  # every rank's row
            torch.testing.assert_close(storage(p.grad)[k], want, rtol=1e-12, atol=1e-14, msg=name)


def test_simulated_frozen_then_unused_keeps_its_gradient():
    """requires_grad toggled off between steps without zero_grad: the frozen parameter's
    gradient is the one it had (one device's), not twice it."""
    ref, m = Net(), Net()
    mesh = wb.Mesh.grid(2, ["dp"])
    ddp = wb.DistributedDataParallel(m, mesh)
    ref(batch(0)).mean().backward()
    ddp(wb.shard_tensor(batch(0), mesh, [wb.Shard(0)])).mean().backward()
    ref.b.requires_grad_(False)
    m.b.requires_grad_(False)
    ref(batch(1)).mean().backward()
    ddp(wb.shard_tensor(batch(1), mesh, [wb.Shard(0)])).mean().backward()
    for name, p in m.named_parameters():
        torch.testing.assert_close(storage(p.grad)[1], dict(ref.named_parameters())[name].grad,
                                   rtol=1e-12, atol=1e-14, msg=name)


def test_simulated_static_graph_parameter_unused_at_first_then_used_raises():
    """static_graph=True takes the first backward's unused parameters as unused for good
    (ready, as zeros, at the first hook of every later backward).  b skipped at first,
    then used: torch raises ("Your training graph has changed", held in
    test_torchrun_a_graph_that_changes_under_static_graph_raises_as_torchs); wb went on,
    its result hanging on whether b's gradient came before the first hook.  Now it
    raises, naming b and the fix."""
    mesh = wb.Mesh.grid(2, ["dp"])
    ddp = wb.DistributedDataParallel(Net(), mesh, static_graph=True)
    ddp(wb.shard_tensor(batch(0), mesh, [wb.Shard(0)]), skip_b=True).mean().backward()
    with pytest.raises(RuntimeError, match=r"static_graph=True\): parameter 'b\.(weight|bias)'"
                       r".*static_graph=False"):
        ddp(wb.shard_tensor(batch(1), mesh, [wb.Shard(0)])).mean().backward()


def test_register_comm_hook_is_refused_by_name():
    ddp = wb.DistributedDataParallel(Net(), wb.Mesh.grid(2, ["dp"]))

    def fp16_compress(state, bucket):
        return None
    with pytest.raises(NotImplementedError, match=r"register_comm_hook\(hook='fp16_compress'\)"
                       r".*communication hooks are not built"):
        ddp.register_comm_hook(None, fp16_compress)


# ---- the forward's output, searched as torch DDP searches it ------------------------------
@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    extra: tuple


class Dictish(collections.OrderedDict):     # Transformers' ModelOutput is one
    pass


def test_output_tensors_are_torchs_find_tensors():
    """find_unused_parameters=True reads the tensors of forward's output; a dataclass or a
    dict subclass (Transformers' outputs) holds tensors, as torch's _find_tensors finds.
    Was: pytree leaves, which take both as opaque leaves: no tensor, every parameter
    'unused', and their buckets averaged zeros (wrong gradients on torchrun)."""
    t = [torch.randn(2, requires_grad=True) for _ in range(4)]
    for out in [t[0], [t[0], (t[1], 3)], {"x": t[0], "y": [t[1]]},
                Out(t[0], (t[1], {"z": t[2]})), Dictish(a=t[3], b=Out(t[0], ())),
                "text", None, object()]:
        got = [id(x) for x in output_tensors(out)]
        assert got == [id(x) for x in _find_tensors(out)], out


def test_output_tensors_of_a_disttensor_are_its_local_tensors():
    """Inside a dataclass too: the stacked local tensor (even shards), or each rank's
    tensor (uneven shards, 5 rows on 2 ranks: 3 and 2)."""
    mesh = wb.Mesh.grid(2, ["dp"])
    even = wb.shard_tensor(torch.randn(4, 2), mesh, [wb.Shard(0)])
    assert [x is even._local for x in output_tensors(Out(even, ()))] == [True]
    uneven = wb.shard_tensor(torch.randn(5, 2), mesh, [wb.Shard(0)])
    got = output_tensors({"y": [uneven]})
    assert [tuple(x.shape) for x in got] == [(3, 2), (2, 2)]


# ---- torch.distributed: held to torch's own DistributedDataParallel -----------------------
@pytest.fixture(scope="module")
def gloo_rows(tmp_path_factory):
    """tests/dist_scripts/review_revI_check.py's rows, from the session's one launch shared
    with test_fixlist2 (torchrun_support.ddp_unused_rows: its cases run after fixlist2's)."""
    return ddp_unused_rows(tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dataclass_output", "unused_keeps_stale_grad"])
def test_torchrun_gradients_are_torch_ddps(gloo_rows, case):
    """A forward returning a dataclass (was: every gradient wrong, the buckets sent zeros
    at the first hook) and a parameter skipped after a step: torch DDP's gradients."""
    for rank in (0, 1):
        r = gloo_rows[(case, rank)]
        assert isinstance(r["torch"], dict), r["torch"]
        assert r["wb"].keys() == r["torch"].keys()
        for k, want in r["torch"].items():
            got = r["wb"][k]
            assert (got is None) == (want is None), k
            if want is not None:
                assert max(abs(a - b) for a, b in zip(got, want)) < 1e-12, (case, k)


@pytest.mark.slow
def test_torchrun_gradient_reaching_an_unused_parameter_raises_as_torchs(gloo_rows):
    """The loss uses a parameter through a tensor forward stores instead of returning:
    torch raises ("Expected to mark a variable ready only once"); wb averaged zeros in its
    place (its bucket went at the first hook).  Now it raises, naming the parameter."""
    for rank in (0, 1):
        r = gloo_rows[("loss_outside_output", rank)]
        assert r["torch"].startswith("RuntimeError: Expected to mark a variable ready")
        assert r["wb"].startswith("RuntimeError: DistributedDataParallel("
                                  "find_unused_parameters=True): parameter 'b."), r["wb"]
        assert "return every tensor the loss uses" in r["wb"]


@pytest.mark.slow
def test_torchrun_a_graph_that_changes_under_static_graph_raises_as_torchs(gloo_rows):
    for rank in (0, 1):
        r = gloo_rows[("graph_changes_under_static_graph", rank)]
        assert r["torch"].startswith("RuntimeError: Your training graph has changed")
        assert r["wb"].startswith("RuntimeError: DistributedDataParallel(static_graph=True): "
                                  "parameter 'b."), r["wb"]


@pytest.mark.slow
def test_torchrun_parameter_used_on_one_rank_only_raises(gloo_rows):
    """find_unused_parameters=False, b used on rank 0 only: torch's reducer waits forever.
    wb gave rank 0 b's average and left rank 1's grad None (the replicas drift apart at the
    optimizer's step); now the rank without it raises, naming b and the fix."""
    r0, r1 = gloo_rows[("used_on_one_rank", 0)], gloo_rows[("used_on_one_rank", 1)]
    assert isinstance(r0["wb"], dict) and r0["wb"]["b.weight"] is not None
    assert isinstance(r1["wb"], str) and "['b.weight', 'b.bias']" in r1["wb"]
    assert "find_unused_parameters=True" in r1["wb"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["plain", "disttensor"])
def test_buckets_rebuilt_after_a_no_sync_step_are_torch_ddps(gloo_rows, mode):
    """A no_sync step (b skipped), then synchronized steps: torch's reducer records the
    order of the first backward that all-reduces.  DDP's DistTensor mode recorded the
    no_sync backward's (its hooks marked there too): b's gradients after a's in the
    rebuilt bucket, torch's before."""
    want = gloo_rows[("buckets_after_no_sync", 0)]["torch"]
    mesh = wb.Mesh.grid(2, ["dp"])
    m = Net() if mode == "plain" else wb.parallelize(Net(), mesh, {})
    ddp = wb.DistributedDataParallel(m, mesh, "dp")

    def step(k, skip_b=False):
        ddp(wb.shard_tensor(batch(k)[:8], mesh, [wb.Shard(0)]), skip_b=skip_b).mean().backward()
        ddp.finish_gradient_synchronization()
    with ddp.no_sync():
        step(0, skip_b=True)
    step(1)
    step(2)
    assert ddp.bucket_names == want


# ---- serving: step_cost's dtype defaults -------------------------------------------------
def test_step_cost_prices_no_quantization_it_was_not_asked_for():
    """weight_bits=None took the width of dtype: float8 priced int8 weight-only
    quantization (its bf16 scales and dequantize FLOPs) unasked, float64 raised about a
    weight_bits=64 nobody gave, and a bad kv_dtype was torch's AttributeError."""
    from workbench.serve.roofline import step_cost
    kw = dict(batch=1, new_tokens=1, context=4)
    for dt in ("float8_e4m3fn", "float64"):
        with pytest.raises(ValueError, match=rf"step_cost\(dtype='{dt}'\).*give weight_bits"):
            step_cost("tiny", dtype=dt, **kw)
    with pytest.raises(ValueError, match=r"step_cost\(kv_dtype='fp9'\): give a torch dtype"):
        step_cost("tiny", kv_dtype="fp9", **kw)
    f8 = step_cost("tiny", dtype="float8_e4m3fn", weight_bits=8, **kw)      # asked for
    assert f8.weight_bits == 8
    f32 = step_cost("tiny", dtype="float32", **kw)
    assert f32.weight_bytes == 2 * step_cost("tiny", **kw).weight_bytes    # 4 vs 2 bytes


@pytest.mark.slow
@pytest.mark.parametrize("case", ["disttensor_used_on_one_rank",
                                  "disttensor_used_on_one_rank_bucket_bytes"])
def test_torchrun_disttensor_mode_parameter_used_on_one_rank_only_raises(gloo_rows, case):
    """DDP's DistTensor mode left a parameter without a gradient out of its buffers, so the
    processes' buffers did not line up: with bucket_bytes=1 rank 1's a.weight was summed
    with rank 0's b.weight (0.053 off torch's, silently) while rank 0 waited on a gloo
    timeout.  Now every process sends every parameter (zeros where it has no gradient, as
    torch's buckets), and the rank without b's raises naming it."""
    r0, r1 = gloo_rows[(case, 0)], gloo_rows[(case, 1)]
    assert isinstance(r0["wb"], dict) and r0["wb"]["b.weight"] is not None, r0["wb"]
    assert isinstance(r1["wb"], str) and "['b.weight', 'b.bias']" in r1["wb"], r1["wb"]
