"""The optimizer step on the modeled clock (workbench/parallel/step_clock.py): each rank's
update recorded as the memory-bound kernels torch runs, bytes by hand from torch 2.13's
torch/optim/adam.py and sgd.py (sim_mesh/optimizer_cost.py), time = bytes / (memory
bandwidth x efficiency) + launches x launch overhead of the profile."""
import math

import pytest
import torch
from torch import nn

import workbench as wb
from workbench.parallel import step_clock
from workbench.parallel.strategies.data_parallel import DataParallel
from workbench.parallel.strategies.zero3 import Zero3
from workbench.sim_mesh import optimizer_cost as OC
from workbench.sim_mesh.profiles import get_profile

A100 = get_profile("a100")
BW = A100.memory_bandwidth * A100.memory_efficiency        # 2039 GB/s x 0.88
LAUNCH = A100.launch_overhead
D_IN, D_OUT = 20, 6
NUMEL = D_IN * D_OUT + D_OUT                                 # weight and bias


def _model(mesh, dtype=torch.float32):
    torch.manual_seed(0)
    m = nn.Linear(D_IN, D_OUT).to(dtype)
    wb.parallelize(m, mesh, {})
    return m


def _steps(tr):
    return [e for e in tr.events if e.name == "optimizer_step"]


def _train(mesh, m, step, dtype=torch.float32, n=1):
    x = DataParallel([], mesh, "dp").shard_batch(torch.randn(8, D_IN, dtype=dtype))
    with wb.trace("a100") as tr:
        for _ in range(n):
            m(x).float().square().mean().backward()
            step()
    return tr


def _seconds(nbytes, launches):
    return nbytes / BW + launches * LAUNCH


def test_data_parallel_adamw_is_the_fused_kernel_on_every_rank():
    mesh = wb.Mesh.grid((4,), ["dp"])
    m = _model(mesh)
    dp = DataParallel([p for _, p in wb.dist_parameters(m)], mesh, "dp")
    tr = _train(mesh, m, dp.step)
    (ev,) = _steps(tr)
    assert ev.ranks == tuple(mesh.ranks)
    assert ev.bytes == 7 * 4 * NUMEL             # read p, g, m, v; write p, m, v; fp32
    assert ev.bytes == OC.MIXED_ADAMW_BYTES * NUMEL     # the planner's 28 B per parameter
    assert ev.duration == pytest.approx(_seconds(28 * NUMEL, 1))
    assert ev.args["phase"] == "optimizer" and ev.label == "AdamW (fused) step"
    # after the gradients' all-reduce on every rank (the last event of the step)
    last_comm = max(e.end for e in tr.collectives())
    assert ev.start >= last_comm - 1e-12 and tr.time() == pytest.approx(ev.end)


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_steps_each_ranks_chunk_once(zero):
    mesh = wb.Mesh.grid((4,), ["dp"])
    m = _model(mesh)
    dp = DataParallel([p for _, p in wb.dist_parameters(m)], mesh, "dp", zero=zero)
    tr = _train(mesh, m, dp.step)
    (ev,) = _steps(tr)                # the inner optimizer's, not the wrapper's again
    chunk = math.ceil(D_IN * D_OUT / 4) + math.ceil(D_OUT / 4)    # padded to N_d
    assert ev.bytes == 28 * chunk
    assert ev.duration == pytest.approx(_seconds(28 * chunk, 1))
    # between the reduce-scatter and the all-gather of the updated chunks
    rs = [e for e in tr.collectives() if e.name == "reduce_scatter"]
    ag = [e for e in tr.collectives() if e.name == "all_gather"]
    assert max(e.end for e in rs) <= ev.start + 1e-12 and ag[-1].start >= ev.end - 1e-12


def test_zero3_steps_the_shards():
    mesh = wb.Mesh.grid((2,), ["dp"])
    m = _model(mesh)
    z = Zero3(m, mesh, "dp")
    tr = _train(mesh, m, z.step)
    (ev,) = _steps(tr)
    shard = sum(math.prod(wb.simulated_storage(e[3]).shape[1:]) for e in z.entries)
    assert shard == math.ceil(D_IN * D_OUT / 2) + math.ceil(D_OUT / 2)
    assert ev.bytes == 28 * shard


def test_a_bf16_model_moves_two_bytes_an_access():
    mesh = wb.Mesh.grid((2,), ["dp"])
    m = _model(mesh, torch.bfloat16)
    dp = DataParallel([p for _, p in wb.dist_parameters(m)], mesh, "dp")
    tr = _train(mesh, m, dp.step, dtype=torch.bfloat16)
    (ev,) = _steps(tr)
    assert ev.bytes == 7 * 2 * NUMEL


@pytest.mark.parametrize("opt, accesses, launches", [
    # foreach (torch's accelerator default): lerp 3, mul 2, addcmul 3, sqrt 2, div 2, add 2,
    # addcdiv 4 = 18 in 7 kernels; AdamW's default weight_decay=0.01: mul_(p) +2, +1 kernel
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3), 20, 8),
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True), 7, 1),
    (lambda ps: torch.optim.Adam(ps, lr=1e-3), 18, 7),
    (lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.1), 21, 8),    # L2: add(g, p)
    (lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=False), 18, 7 * 2),   # per parameter
    (lambda ps: torch.optim.SGD(ps, lr=0.1), 3, 1),                         # add_(p, g)
    (lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True), 3, 1),
])
def test_a_torch_optimizer_over_the_replicas(opt, accesses, launches):
    mesh = wb.Mesh.grid((2,), ["dp"])
    m = _model(mesh)
    dp = DataParallel([p for _, p in wb.dist_parameters(m)], mesh, "dp")
    o = opt(list(dp.parameters()))

    def step():
        dp.finish_gradient_synchronization()
        o.step()
        o.zero_grad()
    (ev,) = _steps(_train(mesh, m, step))
    assert ev.bytes == accesses * 4 * NUMEL
    assert ev.duration == pytest.approx(_seconds(accesses * 4 * NUMEL, launches))


def test_sgd_momentum_first_step_clones_then_two_kernels():
    mesh = wb.Mesh.grid((2,), ["dp"])
    m = _model(mesh)
    dp = DataParallel([p for _, p in wb.dist_parameters(m)], mesh, "dp")
    o = torch.optim.SGD(list(dp.parameters()), lr=0.1, momentum=0.9)

    def step():
        dp.finish_gradient_synchronization()
        o.step()
        o.zero_grad()
    first, second = _steps(_train(mesh, m, step, n=2))
    assert first.bytes == (3 + 2) * 4 * NUMEL          # g.clone() into the buffer
    assert second.bytes == (3 + 5) * 4 * NUMEL         # mul_(buf) 2, add_(buf, g) 3


def test_an_unknown_optimizer_records_nothing_and_says_so():
    mesh = wb.Mesh.grid((2,), ["dp"])
    m = _model(mesh)
    dp = DataParallel([p for _, p in wb.dist_parameters(m)], mesh, "dp")
    o = torch.optim.RMSprop(list(dp.parameters()), lr=1e-3)

    def step():
        dp.finish_gradient_synchronization()
        o.step()
    tr = _train(mesh, m, step)
    assert _steps(tr) == []
    assert len(tr.notes) == 1 and "RMSprop.step() not on the modeled clock" in tr.notes[0]


def test_plain_tensors_unpriced_and_outside_a_trace_nothing():
    p = nn.Parameter(torch.randn(5))
    o = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.ones(5)
    with wb.trace("a100") as tr:       # not a simulated rank's tensor: not on the clock
        o.step()
    assert _steps(tr) == [] and tr.notes == []
    mesh = wb.Mesh.grid((2,), ["dp"])
    m = _model(mesh)
    dp = DataParallel([p for _, p in wb.dist_parameters(m)], mesh, "dp")
    x = dp.shard_batch(torch.randn(8, D_IN))
    with wb.trace("a100") as tr:
        m(x).square().mean().backward()
        with step_clock.unpriced():
            dp.step()
    assert _steps(tr) == []
    m(x).square().mean().backward()
    dp.step()                          # no trace: runs, records nowhere


def test_the_planner_prices_the_same_bytes():
    # plan.estimate's and plan.dryrun's optimizer term: 28 B per parameter on the roofline
    n = 1e9
    assert OC.mixed_adamw_seconds(n, A100) == pytest.approx(28 * n / BW + LAUNCH)


def test_module_ddp_with_torch_adamw_and_zero_redundancy_optimizer():
    """The module wrappers: DDP's rows (one per rank) stepped by torch.optim.AdamW on
    every rank; ZeroRedundancyOptimizer: each rank steps the parameters it owns, on its
    own clock (here the weight on one rank, the bias on the other)."""
    mesh = wb.Mesh.grid((2,), ["dp"])
    x = wb.shard_tensor(torch.randn(8, D_IN), mesh, [wb.Shard(0)])
    for zero in (False, True):
        torch.manual_seed(0)
        ddp = wb.DistributedDataParallel(nn.Linear(D_IN, D_OUT), mesh)
        o = wb.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, mesh, lr=1e-3,
                                       fused=True) if zero else \
            torch.optim.AdamW(ddp.parameters(), lr=1e-3, fused=True)
        with wb.trace("a100") as tr:
            ddp(x).square().mean().backward()
            ddp.finish_gradient_synchronization()
            o.step()
        evs = _steps(tr)
        if not zero:
            (ev,) = evs
            assert ev.ranks == (0, 1) and ev.bytes == 28 * NUMEL
        else:
            assert sorted((e.ranks, e.bytes) for e in evs) == \
                [((0,), 28 * D_IN * D_OUT), ((1,), 28 * D_OUT)]
        assert tr.notes == []


def test_module_fsdp_steps_each_ranks_chunk():
    mesh = wb.Mesh.grid((2,), ["dp"])
    x = wb.shard_tensor(torch.randn(8, D_IN), mesh, [wb.Shard(0)])
    torch.manual_seed(0)
    fsdp = wb.FullyShardedDataParallel(nn.Linear(D_IN, D_OUT), mesh)
    o = torch.optim.AdamW(fsdp.parameters(), lr=1e-3, fused=True)
    with wb.trace("a100") as tr:
        fsdp(x).square().mean().backward()
        o.step()
    (ev,) = _steps(tr)
    assert ev.ranks == (0, 1)
    assert ev.bytes == 28 * (math.ceil(D_IN * D_OUT / 2) + math.ceil(D_OUT / 2))


def test_fully_shard_steps_each_ranks_chunk():
    mesh = wb.Mesh.grid((2,), ["dp"])
    x = wb.shard_tensor(torch.randn(8, D_IN), mesh, [wb.Shard(0)])
    torch.manual_seed(0)
    model = wb.fully_shard(nn.Linear(D_IN, D_OUT), mesh=mesh)
    o = torch.optim.AdamW(model.parameters(), lr=1e-3)       # foreach: 20 accesses, 8 kernels
    with wb.trace("a100") as tr:
        model(x).square().mean().backward()
        o.step()
    (ev,) = _steps(tr)
    chunk = math.ceil(D_IN * D_OUT / 2) + math.ceil(D_OUT / 2)
    assert ev.ranks == (0, 1) and ev.bytes == 20 * 4 * chunk
    assert ev.duration == pytest.approx(_seconds(20 * 4 * chunk, 8))
