"""The compiled program runs what its schedule prices: at O1 the run's collectives are the
schedule's (no backward collective priced that the run does not make), at O2 the
gradients are all-reduced in the bucket pass's buckets, one collective per bucket
(``workbench/compile/buckets.py``), with eager's losses and gradients."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import workbench as wb

R, S = wb.Replicate, wb.Shard
# the collective the run makes outside the program's reshards and gradient reductions:
# cross_entropy's own all-reduce of the target count (inside the op); DistTensor.backward()
# seeds the P(sum) loss on every rank without reducing it
OUTSIDE = ("cross_entropy: global count of targets",)


def _llama(mesh):
    from workbench.models import build_model, get_config
    m = build_model(get_config("tiny"), seed=0)
    wb.parallelize(m, mesh, m.tp_plan(2), mesh_dim="tp")
    return m


def _run(level):
    mesh = wb.Mesh.grid((2, 2), ("dp", "tp"))
    g = torch.Generator().manual_seed(0)
    ids, tg = (torch.randint(0, 75, (4, 32), generator=g) for _ in range(2))
    x = wb.shard_tensor(ids, mesh, [S(0), R()])
    y = wb.shard_tensor(tg, mesh, [S(0), R()])
    eager_m, comp_m = _llama(mesh), _llama(mesh)
    _, loss = eager_m(x, y)
    loss.backward()
    prog = wb.compile(comp_m, x, y, level=level, profile="a100", method="trace")
    with wb.trace(profile="a100") as tr:
        _, closs = prog(x, y)
        closs.backward()
    torch.testing.assert_close(closs.full(), loss.full())
    grads = dict(eager_m.named_parameters())
    for name, p in comp_m.named_parameters():
        torch.testing.assert_close(p.grad.full(), grads[name].grad.full(), rtol=1e-5,
                                   atol=1e-6, msg=lambda m: f"{name}: {m}")
    return prog, tr


def _ran(tr):
    evs = [e for e in tr.events if e.stream == "comm" and 0 in e.ranks]
    outside = [e for e in evs if e.label in OUTSIDE]
    assert sorted(e.label for e in outside) == sorted(OUTSIDE), [e.label for e in evs]
    return Counter((e.name, e.args["mesh_dim"], e.args["buffer_bytes"])
                   for e in evs if e.label not in OUTSIDE)


def _priced(prog, sched):
    return Counter((it.coll, prog.mesh.dim_names[it.mesh_dim], it.nbytes)
                   for it in sched.items if it.kind == "comm")


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_the_run_makes_the_collectives_its_schedule_prices(level):
    prog, tr = _run(level)
    sched = prog.schedule
    assert _ran(tr) == _priced(prog, sched), f"{prog.passes()}\n{sched}"
    # and the time: the run's step, less the collective outside the program, is the
    # schedule's (the run's kernels in autograd's order, not the schedule's: not to the bit)
    outside = sum(e.duration for e in tr.events
                  if e.stream == "comm" and 0 in e.ranks and e.label in OUTSIDE)
    assert tr.time() - outside == pytest.approx(prog.step().time, rel=5e-3)
    if level == "O2":
        buckets = [it for it in sched.items if it.kind == "comm" and it.grad]
        grads = [it for it in prog.stages[0][1].items if it.kind == "comm" and it.grad]
        assert len(buckets) < len(grads)         # the pass merged some: the run did too
        assert sum(len(b.members) for b in buckets) == len(grads)
        labels = [e.label for e in tr.events if e.label.startswith("grad bucket")]
        assert len(labels) == len(buckets) * (prog.mesh.shape[1])   # one per dp group
        assert "one collective per bucket" in str(prog)


def test_async_buckets_run_beside_the_backward_and_are_waited_for_at_its_end():
    """Data parallelism kept by a memory limit (time alone gathers the batch instead):
    three 16 MiB gradients, too big to share a 25 MiB bucket; the overlap pass makes each
    reduction async and the run issues it beside the rest of the backward."""
    from torch import nn
    mesh = wb.Mesh.grid((2,), ("dp",))
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(2048, 2048, bias=False), nn.ReLU(),
                      nn.Linear(2048, 2048, bias=False), nn.ReLU(),
                      nn.Linear(2048, 2048, bias=False))
    ref = nn.Sequential(*[type(c)(2048, 2048, bias=False) if isinstance(c, nn.Linear)
                          else c for c in m])
    ref.load_state_dict(m.state_dict())
    xp = torch.randn(64, 2048, generator=torch.Generator().manual_seed(1))
    x = wb.shard_tensor(xp, mesh, [S(0)])
    o1 = wb.compile(m, x, profile="a100", method="trace", mesh=mesh)
    prog = wb.compile(m, x, level="O2", profile="a100", method="trace", mesh=mesh,
                      memory_limit=o1.greedy.memory)
    assert "3 gradient reduction(s) made async" in prog.passes()
    with wb.trace(profile="a100") as tr:
        prog(x).sum().backward()
    ref(xp).sum().backward()
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5,
                                   msg=lambda s: f"{name}: {s}")
    buckets = [e for e in tr.events if e.label.startswith("grad bucket") and 0 in e.ranks]
    assert len(buckets) == 3
    backward = [e for e in tr.events if e.stream == "compute" and 0 in e.ranks
                and e.start >= buckets[0].start]
    assert any(c.start < buckets[0].end for c in backward)     # beside the backward
    assert tr.time() >= max(b.end for b in buckets)            # and waited for
    priced = Counter(it.coll for it in prog.schedule.items if it.kind == "comm")
    ran = Counter(e.name for e in tr.events if e.stream == "comm" and 0 in e.ranks
                  and e.label != "P(sum)->R on dp")             # out.sum()'s, outside
    assert ran == priced


def test_a_second_backward_through_the_graph_reduces_its_buckets_again():
    """retain_graph=True: each backward reduces the buckets once (eager reduces each
    gradient once per backward), and the gradients accumulate as torch's do."""
    from torch import nn
    mesh = wb.Mesh.grid((2,), ("dp",))
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    ref = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    ref.load_state_dict(m.state_dict())
    xp = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    x = wb.shard_tensor(xp, mesh, [S(0)])
    o1 = wb.compile(m, x, profile="a100", method="trace", mesh=mesh)
    prog = wb.compile(m, x, level="O2", profile="a100", method="trace", mesh=mesh,
                      memory_limit=o1.greedy.memory)       # data parallel: 4 gradients
    buckets = [it for it in prog.schedule.items if it.kind == "comm" and it.grad]
    assert len(buckets) == 1 and len(buckets[0].members) == 4
    with wb.trace(profile="a100") as tr:
        loss = prog(x).sum().full()      # (DistTensor.backward takes no retain_graph)
        loss.backward(retain_graph=True)
        loss.backward()
    out = ref(xp).sum()
    out.backward(retain_graph=True)
    out.backward()
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda s: f"{name}: {s}")
    assert sum(1 for e in tr.events if e.label.startswith("grad bucket")) == 2


@pytest.mark.parametrize("src,dst", [([R()], [S(0)]), ([S(0)], [S(1)]), ([S(0)], [R()])])
def test_a_pinned_outputs_reshard_has_its_backward_on_the_clock(src, dst):
    """The gradient of a pinned output comes back through the pin's reshard (a local
    slice's all_gather, an all_to_all): the schedule holds it and the search prices it,
    as the run records it."""
    mesh = wb.Mesh.grid((2,))
    x = wb.shard_tensor(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)),
                        mesh, src).requires_grad_()
    prog = wb.compile(lambda a: torch.exp(a) * 2, x, level="O2", profile="a100",
                      method="trace", pin={"output": dst})
    with wb.trace(profile="a100") as tr:
        prog(x).sum().backward()
    ran = Counter((e.name, e.args["buffer_bytes"]) for e in tr.events
                  if e.stream == "comm" and 0 in e.ranks and e.label != "P(sum)->R on d0")
    priced = Counter((it.coll, it.nbytes) for it in prog.schedule.items if it.kind == "comm")
    assert ran == priced, f"{prog}\n{prog.schedule}"
    step = prog.stages[0][2]             # the O1 schedule replayed: the search's objective
    assert step.collectives == sum(priced.values())
