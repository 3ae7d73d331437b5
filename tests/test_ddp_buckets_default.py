"""wb.DistributedDataParallel buckets its gradients as torch's DistributedDataParallel
does by default (torch 2.13): the same buckets step by step, on simulated ranks and on
torch.distributed, held to torch's own function and to torch's own wrapper."""
import itertools
import json
import os
import random
import sys

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel.distributed import _BucketCapacityConfig

import workbench as wb
from workbench.parallel.strategies.ddp_buckets import (FIRST_BUCKET_BYTES, assign_by_size,
                                                       torch_policy)
from tests.torchrun_support import json_rows, two_proc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "dist_scripts"))
from ddp_buckets_models import (STEPS, batch, cases, dist_tensor_cases, loss,  # noqa: E402
                                make)


def test_assignment_is_torchs_function_over_dtype_orders_sizes_and_walks():
    """torch.distributed._compute_bucket_assignment_by_size: registration order (sorted
    buckets) and a given walk (the rebuild's), every order of four dtypes."""
    rng = random.Random(0)
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
    for perm in itertools.permutations(dtypes):
        for _ in range(6):
            ts = [torch.empty(rng.choice([1, 7, 300, 70000, 300000]),
                              dtype=perm[min(int(rng.expovariate(1.0)), 3)])
                  for _ in range(rng.randint(1, 10))]
            limits = rng.choice([[2**20, 25 * 2**20], [1000], [5000, 100000], [0]])
            keys = [(t.dtype, t.device) for t in ts]
            sizes = [t.numel() * t.element_size() for t in ts]
            walk = list(range(len(ts)))
            rng.shuffle(walk)
            n = len(ts)
            assert assign_by_size(keys, sizes, limits) == \
                dist._compute_bucket_assignment_by_size(ts, limits, [False] * n)[0]
            assert assign_by_size(keys, sizes, limits, walk) == \
                dist._compute_bucket_assignment_by_size([ts[i] for i in walk], limits,
                                                        [False] * n, walk)[0]


@pytest.mark.parametrize("cap", [None, 1, 25, 0.5])
@pytest.mark.parametrize("unused,static", [(False, False), (True, False), (False, True)])
def test_limits_are_torchs_config(cap, unused, static):
    cfg = _BucketCapacityConfig.create(bucket_cap_mb=cap, bucket_cap_mb_list=None,
                                       use_python_reducer=False)
    first, _ = cfg.compute_bucket_size_limits(static_graph=static,
                                              find_unused_parameters=unused)
    pol = torch_policy(cap, unused, static)
    assert list(pol.initial) == first
    if unused and not static:
        assert pol.rebuild is None                 # torch: never rebuilt
    else:                                          # Reducer's rebuild limits
        assert pol.rebuild == (cfg.first_bucket_bytes_cap, cfg.bucket_bytes_cap)
    assert cfg.first_bucket_bytes_cap == (FIRST_BUCKET_BYTES if cap is None else
                                          cfg.bucket_bytes_cap)


@pytest.fixture(scope="module")
def torch_rows(tmp_path_factory):
    """torch's DDP and wb's DDP(mesh=None) on 2 gloo processes, every case (one launch:
    the 2-process parts, torchrun_support.TWO_PROC)."""
    out, text = two_proc(tmp_path_factory, "ddp_buckets_check.py")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {json.dumps(r["case"]): r for r in json_rows(text)}
    assert len(rows) == len(list(cases())) + len(list(dist_tensor_cases()))
    return rows


@pytest.mark.slow
def test_torchrun_buckets_and_gradients_are_torch_ddps(torch_rows):
    for key, r in torch_rows.items():
        assert r["wb_buckets"] == r["torch"], key       # every step's buckets, in launch order
        if json.loads(key)[-1] == "disttensor":         # the global mean's gradient: rounding
            assert r["grad_diff"] < (1e-2 if "small_mixed" in key else 1e-6), key   # bf16
            continue
        assert r["grad_keys"][0] == r["grad_keys"][1], key   # unused: None in both
        assert r["grad_diff"] == 0.0, key                # 2 ranks: the same sums, bitwise
        assert r["shared"][0] == r["shared"][1], key     # gradient_as_bucket_view's views
        if json.loads(key)[1].get("gradient_as_bucket_view"):
            assert r["shared"][1] and all(r["shared"][1]), key


def sizes_of(name):
    m = make(name)
    return {k: p.numel() * p.element_size() for k, p in m.named_parameters()}


def simulated(name, kw, n=2):
    """wb DDP on n simulated ranks: each step's buckets and the ddp collectives traced."""
    mesh = wb.Mesh.grid(n, ["dp"])
    ddp = wb.DistributedDataParallel(make(name), mesh, **kw)
    buckets, events = [], []
    for step in range(STEPS):
        with wb.trace() as tr:
            out = ddp(wb.shard_tensor(batch(name, step), mesh, [wb.Shard(0)]))
            buckets.append(ddp.bucket_names)
            loss(out).backward()
        events.append([[e.name, e.label, e.args["buffer_bytes"]] for e in tr.collectives()
                       if e.label.startswith("ddp")])
    return buckets, events


@pytest.mark.slow
@pytest.mark.parametrize("name,kw", list(cases()), ids=lambda v: str(v))
def test_simulated_ranks_bucket_and_communicate_as_torch_ddp(torch_rows, name, kw):
    r = torch_rows[json.dumps([name, kw])]
    buckets, events = simulated(name, kw)
    assert buckets == r["torch"]                     # torch's own buckets, step by step
    assert events == r["wb_events"]                  # what torchrun's processes sent
    size = sizes_of(name)
    for step, sent in enumerate(events):
        grads = [e for e in sent if e[1] in ("ddp grad", "ddp bucket")]
        # one all-reduce per torch bucket, of its whole buffer (unused parameters too)
        assert [e[2] for e in grads] == [sum(size[k] for k in b) for b in r["torch"][step]]
        rebuild = [e for e in sent if e[1] == "ddp rebuild buckets"]
        used = [e for e in sent if e[1] == "ddp used params"]
        # counted with torch's profiler: the rebuild's two broadcasts (sync_bucket_indices)
        # before the step after the recorded backward, and the used-parameter map
        # all-reduce each step with find_unused_parameters (a static graph's first only)
        static, unused = kw.get("static_graph"), kw.get("find_unused_parameters")
        assert len(rebuild) == (2 if not unused and step == (2 if static else 1) else 0)
        assert len(used) == (1 if (unused and not static) or (static and step == 0) else 0)
        assert len(sent) == len(grads) + len(rebuild) + len(used)


@pytest.mark.slow
@pytest.mark.parametrize("name,kw", list(dist_tensor_cases()), ids=lambda v: str(v))
def test_dist_tensor_mode_buckets_as_torch_ddp(torch_rows, name, kw):
    """DDP of DistTensor parameters (wb.parallelize over dp) on simulated ranks: torch's
    buckets step by step; the sums run after backward (finish_gradient_synchronization)."""
    r = torch_rows[json.dumps([name, kw, "disttensor"])]
    mesh = wb.Mesh.grid(2, ["dp"])
    ddp = wb.DistributedDataParallel(wb.parallelize(make(name), mesh, {}), mesh, "dp", **kw)
    size = sizes_of(name)
    for step in range(STEPS):
        ddp.zero_grad(set_to_none=True)
        with wb.trace() as tr:
            out = ddp(wb.shard_tensor(batch(name, step), mesh, [wb.Shard(0)]))
            assert ddp.bucket_names == r["torch"][step]
            loss(out).backward()
            ddp.finish_gradient_synchronization()
        sent = [(e.label, e.args["buffer_bytes"]) for e in tr.collectives()
                if e.label.startswith(("dp", "ddp"))]
        rebuild = [("ddp rebuild buckets", 4 * (len(size) + 1)),     # indices + count
                   ("ddp rebuild buckets", 4 * len(r["torch"][step]))] if step == 1 else []
        assert sent == rebuild + [("dp bucket", sum(size[k] for k in b))
                                  for b in r["torch"][step]]


def test_each_bucket_launches_when_its_last_gradient_is_ready_and_in_order():
    """Reducer::mark_bucket_ready: a bucket launches once all its gradients are ready and
    every bucket before it has launched.  Counted at each gradient's readiness."""
    mesh = wb.Mesh.grid(2, ["dp"])
    for kw in ({}, {"find_unused_parameters": True}):
        ddp = wb.DistributedDataParallel(make("reordered"), mesh, **kw)
        for step in range(3):
            seen = []
            with wb.trace() as tr:
                hooks = [p.register_post_accumulate_grad_hook(
                    lambda p, k=k: seen.append((k, sum(e.label.startswith("ddp b")
                                                       for e in tr.collectives()))))
                    for k, p in ddp.module.named_parameters()]
                out = ddp(wb.shard_tensor(batch("reordered", step), mesh, [wb.Shard(0)]))
                names = ddp.bucket_names
                loss(out).backward()
            for h in hooks:
                h.remove()
            order = [k for k, _ in seen]
            launched = dict(seen)                    # all-reduces sent once k was ready
            want, done = {}, 0
            for k in order:                          # the rule, from the buckets alone
                while done < len(names) and all(order.index(q) <= order.index(k)
                                                for q in names[done]):
                    done += 1
                want[k] = done
            assert launched == want, (kw, step)
        if not kw:
            # rebuilt in torch's order (out, mid, inp); simulated ranks' hooks fire inp's
            # first, so bucket 1 fills first and waits until bucket 0 has launched
            assert names == [["out.bias", "out.weight", "mid.bias", "mid.weight"],
                             ["inp.bias", "inp.weight"]]
            full = max(order.index(k) for k in names[1])
            assert full < max(order.index(k) for k in names[0])
            assert launched[order[full]] == 0


def test_bucket_bytes_keeps_fixed_buckets_and_one_gives_one_per_parameter():
    mesh = wb.Mesh.grid(2, ["dp"])
    size = sizes_of("mixed")
    for bucket_bytes in (1, 2**20):
        ddp = wb.DistributedDataParallel(make("mixed"), mesh, bucket_bytes=bucket_bytes)
        first = ddp.bucket_names
        for step in range(3):
            with wb.trace() as tr:
                loss(ddp(wb.shard_tensor(batch("mixed", step), mesh, [wb.Shard(0)]))) \
                    .backward()
            assert ddp.bucket_names == first                      # never rebuilt
            sent = [e.args["buffer_bytes"] for e in tr.collectives()]
            assert sent == [sum(size[k] for k in b) for b in first]
        if bucket_bytes == 1:
            assert first == [[k] for k in reversed(list(size))]   # naive: backward order
        else:                                                     # per dtype, >= 1 MiB
            assert first == [["d.bias", "d.weight", "c.bias", "c.weight"],
                             ["b.bias", "b.weight"], ["a.bias", "a.weight"]]


def test_default_buckets_train_as_one_device():
    """The rebuilt buckets change nothing in the values: five steps of SGD on 4 simulated
    ranks give one device's parameters."""
    mesh = wb.Mesh.grid(4, ["dp"])
    ddp = wb.DistributedDataParallel(make("mixed"), mesh)
    ref = make("mixed")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(5):
        opt.zero_grad()
        ref_opt.zero_grad()
        x = batch("mixed", step, 8)
        loss(ddp(wb.shard_tensor(x, mesh, [wb.Shard(0)]))).backward()
        loss(ref(x)).backward()
        opt.step()
        ref_opt.step()
    for k, v in ddp.full_state_dict().items():
        torch.testing.assert_close(v, ref.state_dict()[k], rtol=1e-5, atol=1e-6, msg=k)


def test_ddp_over_tensor_parallel_takes_torchs_buckets_over_the_local_shards():
    """DDP of a module with DistTensor parameters (wb.parallelize, tp on a 2-d mesh): the
    first step one bucket per dtype, then the buckets rebuilt in the order the gradients
    were ready (torch's function over the local shards' bytes), after the rebuild's two
    broadcasts on each dp group; one device's values throughout."""
    from torch import nn
    mesh = wb.Mesh.grid((2, 2), ["dp", "tp"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 1024), nn.ReLU(), nn.Linear(1024, 16))
    ref = nn.Sequential(nn.Linear(16, 1024), nn.ReLU(), nn.Linear(1024, 16))
    ref.load_state_dict(model.state_dict())
    wb.parallelize(model, mesh, {"0": "colwise", "2": "rowwise"}, mesh_dim="tp")
    ddp = wb.DistributedDataParallel(model, mesh, "dp")
    assert ddp.bucket_names == [["0.weight", "0.bias", "2.weight", "2.bias"]]
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        ref_opt.zero_grad()
        with wb.trace() as tr:
            out = ddp(wb.shard_tensor(x, mesh, [wb.Shard(0), wb.Replicate()]))
            names = ddp.bucket_names
            out.pow(2).mean().backward()
            ddp.finish_gradient_synchronization()
        ref(x).pow(2).mean().backward()
        opt.step()
        ref_opt.step()
        labels = [e.label for e in tr.collectives() if e.label.startswith(("dp", "ddp"))]
        if step == 0:
            assert labels == ["dp bucket"] * 2                     # one per dp group
        if step == 1:
            # the order the first backward made the gradients ready (the hooks'), the
            # local shards' bytes (0.weight 512 x 16 fp32: 32 KiB): all under the first
            # bucket's 1 MiB, so one bucket, last layer first
            local = {"0.weight": 1024 * 16 // 2, "0.bias": 512, "2.weight": 16 * 512,
                     "2.bias": 16}
            book = ddp.replicas.book
            name = {id(p): n for n, p in zip(ddp._names, ddp.replicas.params)}
            order = [name[id(book.params[i])] for i in book.order]
            assert sorted(order[:2]) == ["2.bias", "2.weight"]
            assert sorted(order[2:]) == ["0.bias", "0.weight"]
            ts = [torch.empty(local[k]) for k in order]
            want = dist._compute_bucket_assignment_by_size(
                ts, [FIRST_BUCKET_BYTES, 25 * 2**20], [False] * 4, [0, 1, 2, 3])[0]
            assert names == [[order[i] for i in b] for b in want]
            assert labels == ["ddp rebuild buckets"] * 4 + ["dp bucket"] * 2
        if step == 2:
            assert labels == ["dp bucket"] * 2
    got = ddp.full_state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)
