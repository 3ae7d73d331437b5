"""User-trial audit of the DTensor-style API (second pass): what a PyTorch DTensor user
writes (``init_device_mesh``, ``mesh.size()``, ``mesh["dp", "cp"]``,
``DistTensor.from_local(..., run_check=, shape=, stride=)``, ``to_local`` /
``full_tensor(grad_placements=)``) held to PyTorch's DeviceMesh and DTensor, which run
here under a fake process group and ``LocalTensorMode`` (``tests/dtensor_support.py``)."""
import pickle

import pytest
import torch

import workbench as wb
from workbench import Partial, Replicate, Shard

from tests.dtensor_support import LocalTensor, LocalTensorMode, oracle  # noqa: F401
from tests.dtensor_support import DReplicate, DShard, DTensor  # noqa: F401


# ---- DeviceMesh's names ------------------------------------------------------------------

def test_init_device_mesh_size_names_and_slices_as_device_mesh(oracle):
    ours = wb.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "pp", "cp"))
    oracle.mesh((2, 2, 2))                  # the fake process group of 8 ranks
    from torch.distributed.device_mesh import DeviceMesh
    theirs = DeviceMesh("cpu", torch.arange(8).reshape(2, 2, 2),
                        mesh_dim_names=("dp", "pp", "cp"))
    assert ours.mesh_dim_names == theirs.mesh_dim_names
    assert torch.equal(ours.mesh, theirs.mesh)
    assert ours.size() == theirs.size() == 8
    for d in range(3):
        assert ours.size(d) == theirs.size(d)
    assert ours.size("cp") == 2 and ours.size(-1) == 2
    assert ours.size == 8 and ours.size + 1 == 9 and isinstance(ours.size, int)   # still an int
    # this process is rank 0 of the fake group: DeviceMesh's slices through rank 0
    for names in (("dp",), ("cp",), ("dp", "cp"), ("pp", "cp"), ("dp", "pp", "cp")):
        key = names[0] if len(names) == 1 else names
        assert ours[key].ranks == tuple(theirs[key].mesh.flatten().tolist()), names
        assert ours[key].shape == tuple(theirs[key].mesh.shape)
        assert ours[key].mesh_dim_names == theirs[key].mesh_dim_names
    for bad, err in ((("cp", "dp"), KeyError), (("xx",), KeyError), ("xx", KeyError),
                     (("dp", "dp"), RuntimeError)):
        with pytest.raises(err):
            theirs[bad]
        with pytest.raises(err):
            ours[bad]
    with pytest.raises(ValueError, match="'xx' is not a dim"):      # and Mesh.dim's ValueError
        ours["xx"]
    assert pickle.loads(pickle.dumps(ours)).size(2) == 2


def test_mesh_size_and_current_rank_errors_name_the_fix():
    mesh = wb.Mesh.grid((2, 3), ["dp", "tp"])
    with pytest.raises(KeyError, match="no mesh dim of that name"):
        mesh.size("ep")
    with pytest.raises(IndexError, match=r"\[-2, 1\]"):
        mesh.size(2)
    with pytest.raises(RuntimeError, match="needs to be given"):
        mesh.get_local_rank()
    for call in (lambda: mesh.get_local_rank("tp"), mesh.get_coordinate, mesh.get_rank):
        with pytest.raises(RuntimeError, match=r"no current rank.*mesh.coordinate\(rank\)"):
            call()
    one = wb.init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    assert one.get_local_rank() == 0 and one.get_coordinate() == (0,) and one.get_rank() == 0
    with pytest.raises(ValueError, match="one name per mesh dim"):
        wb.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp",))
    with pytest.raises(TypeError, match="device_type"):
        wb.init_device_mesh(None, (2, 2))


# ---- DistTensor.from_local / to_local / full_tensor ---------------------------------------

def _dtensor_local_grads(placements, shape, w, local_of):
    """Every rank's local gradient after (d.full_tensor() * w).sum().backward(), d made by
    DTensor.from_local on a 2x2 fake mesh."""
    from torch.distributed.device_mesh import DeviceMesh
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
    with LocalTensorMode(4):
        locs = LocalTensor({r: local_of(r).clone() for r in range(4)}).requires_grad_()
        d = DTensor.from_local(locs, mesh, placements, shape=shape,
                               stride=(shape[1], 1))
        (d.full_tensor() * w).sum().backward()
        return [locs.grad._local_tensors[r].clone() for r in range(4)]


@pytest.mark.parametrize("layout", ["RR", "SR", "PR"])
def test_from_local_gives_every_replicas_local_its_gradient_as_dtensor(oracle, layout):
    """Each rank's local of a Replicate mesh dim gets the gradient, as each rank's own
    DTensor.from_local gives it (was: only the first replica's, the others None)."""
    oracle.mesh((2, 2))
    torch.manual_seed(0)
    x, w = torch.randn(5, 6), torch.randn(5, 6)
    parts = [x * 0.25, x * 0.75]
    ours_ps, their_ps, local_of = {
        "RR": ([Replicate(), Replicate()], [DReplicate(), DReplicate()], lambda r: x),
        "SR": ([Shard(0), Replicate()], [DShard(0), DReplicate()],
               lambda r: x.chunk(2, 0)[r // 2]),
        "PR": ([Partial(), Replicate()], None, lambda r: parts[r // 2]),
    }[layout]
    locs = [local_of(r).clone().requires_grad_() for r in range(4)]
    d = wb.DistTensor.from_local(locs, wb.Mesh.grid((2, 2)), ours_ps, shape=(5, 6))
    (d.full_tensor() * w).sum().backward()
    if their_ps is None:
        from tests.dtensor_support import DPartial
        their_ps = [DPartial(), DReplicate()]
    theirs = _dtensor_local_grads(their_ps, (5, 6), w, local_of)
    for r in range(4):
        assert locs[r].grad is not None, r
        torch.testing.assert_close(locs[r].grad, theirs[r])


def test_from_local_of_one_tensor_for_every_rank_counts_its_gradient_once():
    """wb.from_local([t] * 4, ...): the one tensor every rank passes gets the gradient once,
    as each process's own would (not four times)."""
    mesh = wb.Mesh.grid((2, 2))
    t = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(3, 4)
    d = wb.from_local([t] * 4, mesh, [Replicate(), Replicate()])
    (d.full() * w).sum().backward()
    torch.testing.assert_close(t.grad, w)


def test_dist_tensor_from_local_takes_dtensors_arguments():
    mesh = wb.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.arange(20.).reshape(5, 4)
    locs = wb.distribute_tensor(x, mesh, [Shard(0), Shard(-1)]).locals()
    d = wb.DistTensor.from_local(locs, mesh, [Shard(0), Shard(-1)], run_check=True,
                                 shape=(5, 4), stride=(4, 1))
    assert d.placements == (Shard(0), Shard(1)) and torch.equal(d.full_tensor(), x)
    # one tensor that every rank passes: DTensor's global of equal blocks (Shard) or sum
    t = torch.arange(6.).reshape(2, 3)
    torch.testing.assert_close(
        wb.DistTensor.from_local(t, mesh, [Shard(0), Replicate()]).full_tensor(),
        torch.cat([t, t]))
    torch.testing.assert_close(
        wb.DistTensor.from_local(t, mesh, [Partial(), Partial()]).full_tensor(), 4 * t)
    assert wb.DistTensor.from_local(t, mesh).placements == (Replicate(), Replicate())
    with pytest.raises(RuntimeError, match="pass both shape and stride"):
        wb.DistTensor.from_local(t, mesh, stride=(3, 1))
    with pytest.raises(NotImplementedError, match=r"stride \(3, 1\)"):
        wb.DistTensor.from_local(t, mesh, shape=(2, 3), stride=(1, 2))
    with pytest.raises(RuntimeError, match="only accepts torch.Tensor"):
        wb.DistTensor.from_local(d, mesh)
    with pytest.raises(TypeError, match="device_mesh"):
        wb.DistTensor.from_local(t)
    with pytest.raises(ValueError, match="different tensor than its replica"):
        wb.DistTensor.from_local([t, t, t + 1, t], mesh, [Replicate(), Replicate()])


def test_to_local_and_full_tensor_take_grad_placements():
    one = wb.init_device_mesh("cpu", (1,))
    x = torch.randn(4, 3)
    d = wb.distribute_tensor(x, one, [Shard(0)]).requires_grad_()
    loc = d.to_local(grad_placements=[Partial()])        # one rank: every layout is one
    assert torch.equal(loc, x)
    (loc * 2).sum().backward()
    torch.testing.assert_close(d.grad.full_tensor(), torch.full_like(x, 2.0))
    mesh = wb.Mesh.grid((2, 2))
    d = wb.distribute_tensor(x, mesh, [Shard(0), Replicate()]).requires_grad_()
    y = d.full_tensor(grad_placements=[Replicate(), Replicate()])
    (y * 3).sum().backward()
    torch.testing.assert_close(d.grad.full_tensor(), torch.full_like(x, 3.0))
    with pytest.raises(NotImplementedError, match="grad_placements"):
        d.full_tensor(grad_placements=[Partial(), Replicate()])
    with pytest.raises(ValueError, match=r"to_local\(\) on simulated ranks.*d.local\(rank\)"):
        d.to_local()
    with pytest.raises(NotImplementedError, match="grad_placements"):
        d.to_local(grad_placements=[Replicate(), Replicate()])


# ---- distribute_module, nn.Parameter(d), grad_fn ------------------------------------------

def test_distribute_module_with_torchs_partition_fn_trains_as_one_device():
    """torch's partition_fn pattern (register_parameter(name, nn.Parameter(distribute_tensor
    (...)))) and input_fn / output_fn hooks give one device's outputs and gradients (was:
    no distribute_module; nn.Parameter(d) raised AttributeError '_is_param')."""
    import copy
    from torch import nn
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    model = copy.deepcopy(ref)
    mesh = wb.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))

    def shard_first(name, mod, mesh):
        if name == "0":
            for pname, p in mod.named_parameters(recurse=False):
                mod.register_parameter(
                    pname, nn.Parameter(wb.distribute_tensor(p, mesh, [Shard(0)])))

    calls = []

    def input_fn(mod, inputs, mesh):
        calls.append("in")
        return tuple(wb.distribute_tensor(i, mesh, [Replicate()]) for i in inputs)

    def output_fn(mod, outputs, mesh):
        calls.append("out")
        return outputs.full_tensor()

    assert wb.distribute_module(model, mesh, shard_first, input_fn, output_fn) is model
    got = {n: p.placements for n, p in model.named_parameters()}
    assert got == {"0.weight": (Shard(0),), "0.bias": (Shard(0),),
                   "2.weight": (Replicate(),), "2.bias": (Replicate(),)}
    assert all(p.requires_grad for p in model.parameters())
    x = torch.randn(4, 6)
    y, y_ref = model(x), ref(x)
    assert calls == ["in", "out"] and isinstance(y, torch.Tensor)
    torch.testing.assert_close(y, y_ref)
    y.sum().backward()
    y_ref.sum().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=n)
    with pytest.raises(RuntimeError, match="only be called once"):
        wb.distribute_module(model, mesh)
    lin = nn.Linear(3, 2)
    wb.distribute_module(lin, mesh)                      # default: every parameter replicated
    assert lin.weight.placements == (Replicate(),) and torch.equal(
        lin.weight.full_tensor(), lin.weight.full_tensor())
    with pytest.raises(ValueError, match="input_fn"):
        wb.distribute_module(nn.Linear(2, 2), mesh, input_fn=lambda a: a)
    with pytest.raises(TypeError, match="device_mesh"):
        wb.distribute_module(nn.Linear(2, 2), None)


def test_parameter_of_a_dist_tensor_and_grad_fn():
    mesh = wb.Mesh.grid((2,))
    from torch import nn
    d = wb.distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
    p = nn.Parameter(d)
    assert isinstance(p, wb.DistTensor) and p.requires_grad and p.is_leaf and p is not d
    assert p.placements == d.placements and torch.equal(p.full_tensor(), d.full_tensor())
    assert p.grad_fn is None and d.grad_fn is None
    y = p * 2
    assert y.grad_fn is not None and type(y.grad_fn).__name__ == type((torch.ones(1, requires_grad=True) * 2).grad_fn).__name__
    with torch.no_grad():
        assert (p * 2).grad_fn is None


@pytest.mark.parametrize("layout", [[Replicate(), Replicate()], [Shard(1), Replicate()],
                                    [Partial(), Replicate()]])
def test_from_local_of_every_ranks_local_keeps_the_gradient_once(layout):
    """from_local(d.locals()) and from_local of values each rank computed from one
    replicated tensor: d gets one device's gradient, not one per replica."""
    torch.manual_seed(0)
    mesh = wb.Mesh.grid((2, 2))
    x, w = torch.randn(4, 6), torch.randn(4, 6)
    d = wb.distribute_tensor(x, mesh, [p if not p.is_partial() else Replicate()
                                       for p in layout]).requires_grad_()
    back = wb.from_local(d.locals(), mesh, d.placements, shape=d.shape)
    (back.full_tensor() * w).sum().backward()
    torch.testing.assert_close(d.grad.full_tensor(), w)
    d.grad = None
    doubled = wb.from_local([t * 2 for t in d.locals()], mesh, d.placements, shape=d.shape)
    (doubled.full_tensor() * w).sum().backward()
    torch.testing.assert_close(d.grad.full_tensor(), 2 * w)


# ---- local_map --------------------------------------------------------------------------

def test_local_map_runs_on_local_shards_with_one_devices_values_and_gradients():
    torch.manual_seed(0)
    mesh = wb.Mesh.grid((3,), ["tp"])
    x, w, g = torch.randn(7, 4), torch.randn(4, 5), torch.randn(7, 5)   # 7 rows: 3, 3, 1
    mm = wb.parallel.local_map(lambda a, b: a @ b, out_placements=[Shard(0)],
                               in_placements=([Shard(0)], [Replicate()]))
    xd = wb.distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
    wd = wb.distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
    y = mm(xd, wd)
    assert y.placements == (Shard(0),)
    torch.testing.assert_close(y.full_tensor(), x @ w)
    (y.full_tensor() * g).sum().backward()
    torch.testing.assert_close(xd.grad.full_tensor(), g @ w.T)
    torch.testing.assert_close(wd.grad.full_tensor(), x.T @ g)       # summed over the ranks
    total = wb.parallel.local_map(lambda a: a.sum(0), out_placements=[Partial()])(xd)
    torch.testing.assert_close(total.full_tensor(), x.sum(0))
    top, rows = wb.parallel.local_map(lambda a: (a.amax(0), a.shape[0]),
                                      out_placements=([Partial("max")], None))(xd)
    torch.testing.assert_close(top.full_tensor(), x.amax(0))
    assert rows == 3                                   # rank 0's, a plain value as torch's

    @wb.parallel.local_map(out_placements=[Shard(0)])
    def relu(a):
        return a.relu()
    torch.testing.assert_close(relu(xd).full_tensor(), x.relu())
    assert torch.equal(mm(x, w), x @ w)                # no DistTensor: a plain call, as torch
    xr = wb.distribute_tensor(x, mesh, [Replicate()])
    with pytest.raises(ValueError, match="redistribute_inputs=True"):
        mm(xr, wd)
    again = wb.parallel.local_map(lambda a, b: a @ b, [Shard(0)], ([Shard(0)], [Replicate()]),
                                  redistribute_inputs=True)(xr, wd)
    torch.testing.assert_close(again.full_tensor(), x @ w)
    with pytest.raises(ValueError, match="1 placements for 2 outputs"):
        wb.parallel.local_map(lambda a: (a, a), out_placements=[Shard(0)])(xd)
    with pytest.raises(ValueError, match="different tensor than its replica"):
        wb.parallel.local_map(lambda a: a.sum(), out_placements=[Replicate()])(xd)


# ---- distribute_tensor of a tensor that requires grad; torch's placement objects ----------

def test_distribute_tensor_of_a_tensor_requiring_grad_is_a_new_leaf_as_dtensors(oracle):
    """DTensor's distribute_tensor detaches: the result is a leaf whose .grad fills, and no
    gradient reaches the source (was: a non-leaf, .grad None with torch's warning, the
    gradient silently on the source tensor)."""
    from tests.dtensor_support import distribute_tensor as torch_distribute
    dmesh = oracle.mesh((2,))
    x = torch.randn(4, 3, requires_grad=True)
    with LocalTensorMode(2):
        theirs = torch_distribute(x, dmesh, [DShard(0)])
        (theirs * 2).sum().backward()
        their_grad = theirs.grad.full_tensor()
    assert theirs.is_leaf and theirs.requires_grad and x.grad is None
    ours = wb.distribute_tensor(x, wb.Mesh.grid((2,)), [Shard(0)])
    assert ours.is_leaf and ours.requires_grad
    (ours * 2).sum().backward()
    assert x.grad is None
    torch.testing.assert_close(ours.grad.full_tensor(), their_grad)
    # shard_tensor, the library's own, stays differentiable back to its source
    y = wb.shard_tensor(x, wb.Mesh.grid((2,)), [Shard(0)])
    (y * 3).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))


def test_torchs_placement_objects_are_accepted():
    from tests.dtensor_support import DPartial
    mesh = wb.Mesh.grid((2, 2))
    x = torch.randn(4, 6)
    d = wb.distribute_tensor(x, mesh, [DShard(-1), DReplicate()])
    assert d.placements == (Shard(1), Replicate()) and torch.equal(d.full_tensor(), x)
    e = d.redistribute(mesh, [DReplicate(), DShard(0)])
    assert e.placements == (Replicate(), Shard(0)) and torch.equal(e.full_tensor(), x)
    p = wb.DistTensor.from_local([x] * 4, mesh, [DPartial("avg"), DReplicate()])
    assert p.placements == (Partial("avg"), Replicate())
    torch.testing.assert_close(p.full_tensor(), x)


# ---- a constant written in place over a value with history ---------------------------------

@pytest.mark.parametrize("write", ["zero_", "fill_", "copy_"])
@pytest.mark.parametrize("ps", [[Replicate(), Replicate()], [Shard(0), Shard(1)],
                                [Partial(), Shard(0)]])
def test_a_constant_written_over_a_non_leaf_keeps_its_history_as_torch(write, ps):
    """y = d * 2; y.zero_() (fill_, copy_(plain)): y still requires grad and backward
    gives d zeros there, as torch (was: y lost requires_grad, backward raised 'element 0
    of tensors does not require grad')."""
    torch.manual_seed(0)
    x, w = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    do = {"zero_": lambda t: t.zero_(), "fill_": lambda t: t.fill_(2.5),
          "copy_": lambda t: t.copy_(torch.ones(6, dtype=torch.float64))}[write]
    xr = x.clone().requires_grad_()
    yr = xr * 2
    do(yr)
    ((yr * w).sum() + (xr * w).sum()).backward()
    d = wb.distribute_tensor(x, wb.Mesh.grid((2, 2)),
                             [Replicate() if p.is_partial() else p for p in ps])
    if any(p.is_partial() for p in ps):
        d = d.redistribute(d.mesh, ps)
    d.requires_grad_()
    y = d * 2
    do(y)
    assert y.requires_grad and not y.is_leaf and y.grad_fn is not None
    torch.testing.assert_close(y.full_tensor(), yr.detach())
    ((y * w).sum() + (d * w).sum()).backward()
    torch.testing.assert_close(d.grad.full_tensor(), xr.grad)


# ---- F.cross_entropy's class weights and probability targets -------------------------------

_CE_CASES = [(kind, red, eps) for kind in ("probs", "probs_weight", "index_weight")
             for red in ("mean", "sum", "none") for eps in (0.0, 0.1)]


@pytest.mark.parametrize("kind,reduction,eps", _CE_CASES)
def test_cross_entropy_weights_and_probability_targets_equal_torch(kind, reduction, eps):
    """Was NotImplementedError; now torch's values and gradients over uneven, vocabulary-
    sharded and 2-d layouts, targets plain or laid out as the logits' rows."""
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, dtype=torch.float64, generator=g)
    probs = torch.randn(5, 7, dtype=torch.float64, generator=g).softmax(-1)
    idx = torch.tensor([0, 6, -100, 3, 3])                      # one ignored target
    w = torch.rand(7, dtype=torch.float64, generator=g) + 0.5
    target = idx if kind == "index_weight" else probs
    weight = None if kind == "probs" else w
    xr = x.clone().requires_grad_()
    ref = F.cross_entropy(xr, target, weight=weight, reduction=reduction, label_smoothing=eps)
    seed = torch.randn(ref.shape, dtype=ref.dtype, generator=g)
    (ref * seed).sum().backward()
    for shape, ps in (((3,), [Shard(0)]), ((3,), [Shard(1)]), ((2, 2), [Shard(0), Shard(1)]),
                      ((2, 2), [Replicate(), Shard(1)])):
        mesh = wb.Mesh.grid(shape)
        d = wb.distribute_tensor(x, mesh, ps).requires_grad_()
        rows = [p if p.is_shard(0) else Replicate() for p in ps]
        for t in (target, wb.distribute_tensor(target, mesh, rows)):
            d.grad = None
            out = F.cross_entropy(d, t, weight=weight, reduction=reduction,
                                  label_smoothing=eps)
            (out * seed).sum().backward()
            torch.testing.assert_close(out.full_tensor(), ref.detach())
            torch.testing.assert_close(d.grad.full_tensor(), xr.grad)


def test_cross_entropy_other_forms_keep_torchs_errors_and_shapes():
    import torch.nn.functional as F
    mesh = wb.Mesh.grid((2,))
    x = torch.randn(4, 7, 3)
    d = wb.distribute_tensor(x, mesh, [Shard(2)])
    probs, w = torch.rand(4, 7, 3).softmax(1), torch.rand(7)
    torch.testing.assert_close(F.cross_entropy(d, probs, weight=w, reduction="none").full(),
                               F.cross_entropy(x, probs, weight=w, reduction="none"))
    one = wb.distribute_tensor(x[:, :, 0][0], mesh, [Shard(0)])      # (C,) logits
    torch.testing.assert_close(F.cross_entropy(one, torch.tensor(2), weight=w).full(),
                               F.cross_entropy(x[0, :, 0], torch.tensor(2), weight=w))
    with pytest.raises(RuntimeError, match="weight tensor should be defined"):
        F.cross_entropy(d, torch.zeros(4, 3, dtype=torch.long), weight=torch.ones(3))


# ---- empty dims and shapes torch refuses ------------------------------------------------------

@pytest.mark.parametrize("ps", [[Replicate(), Replicate()], [Shard(0), Shard(1)],
                                [Shard(1), Replicate()]])
def test_empty_dims_as_torch(ps):
    """logsumexp over a size-0 dim is -inf (was: amax's 'zero-size' error); unbind of a
    size-0 dim is an empty tuple (was: IndexError inside the view bookkeeping)."""
    mesh = wb.Mesh.grid((2, 2))
    x = torch.randn(5, 0)
    d = wb.distribute_tensor(x, mesh, ps)
    for dim, keepdim in ((1, False), (1, True), ((0, 1), False)):
        torch.testing.assert_close(d.logsumexp(dim, keepdim=keepdim).full_tensor(),
                                   x.logsumexp(dim, keepdim=keepdim))
    y = torch.randn(0, 7)
    e = wb.distribute_tensor(y, mesh, ps)
    assert e.unbind(0) == y.unbind(0) == ()
    assert [t.full_tensor().shape for t in e.unbind(1)] == [t.shape for t in y.unbind(1)]


def test_addmm_addmv_refuse_an_input_that_does_not_fit_the_product_as_torch():
    """torch's CPU kernels raise where the input does not expand to the product's shape;
    its meta kernels do not, and the composition broadcast it (a (5, 5) result for a (1, 1)
    product, silently)."""
    mesh = wb.Mesh.grid((2,))
    a = torch.randn(1, 7)
    d = wb.distribute_tensor(a, mesh, [Replicate()])
    with pytest.raises(RuntimeError, match="expanded size"):
        torch.addmm(torch.ones(5, 5), a, a.t())
    with pytest.raises(RuntimeError, match="expanded size"):
        torch.addmm(torch.ones(5, 5), d, d.t())
    with pytest.raises(RuntimeError, match="size mismatch"):
        torch.addmv(torch.ones(3), a, torch.randn(7))
    with pytest.raises(RuntimeError, match="size mismatch"):
        torch.addmv(torch.ones(3), d, torch.randn(7))
    v = torch.randn(7)
    for bias in (torch.ones(1), torch.ones(())):        # these broadcast, as torch's
        torch.testing.assert_close(torch.addmm(bias, d, d.t()).full_tensor(),
                                   torch.addmm(bias, a, a.t()))
        torch.testing.assert_close(torch.addmv(bias, d, v).full_tensor(), torch.addmv(bias, a, v))


# ---- DTensor's factories -------------------------------------------------------------------

def test_factories_as_torch_distributed_tensors():
    """wb.parallel.zeros / ones / empty / full / rand / randn with DTensor's signature
    (was: missing): the global tensor torch makes (one device's draw), laid out."""
    mesh = wb.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ps = [Shard(0), Shard(-1)]
    z = wb.parallel.zeros(5, 6, device_mesh=mesh, placements=ps)
    assert z.placements == (Shard(0), Shard(1)) and torch.equal(z.full_tensor(), torch.zeros(5, 6))
    o = wb.parallel.ones((3, 4), dtype=torch.float64, device_mesh=mesh)
    assert o.placements == (Replicate(), Replicate()) and o.dtype == torch.float64
    assert torch.equal(o.full_tensor(), torch.ones(3, 4, dtype=torch.float64))
    f = wb.parallel.full([2, 3], 7, device_mesh=mesh, placements=[Shard(1), Replicate()])
    ref = torch.full([2, 3], 7)
    assert f.dtype == ref.dtype and torch.equal(f.full_tensor(), ref)
    assert wb.parallel.empty(2, 3, device_mesh=mesh).shape == (2, 3)
    for name in ("rand", "randn"):
        torch.manual_seed(0)
        r = getattr(wb.parallel, name)(5, 3, device_mesh=mesh, placements=[Shard(0), Replicate()],
                                       requires_grad=True)
        torch.manual_seed(0)
        assert torch.equal(r.full_tensor(), getattr(torch, name)(5, 3))
        assert r.is_leaf and r.requires_grad
    with pytest.raises(TypeError, match="device_mesh"):
        wb.parallel.zeros(2, 3)
    with pytest.raises(ValueError, match="Partial"):
        wb.parallel.ones(2, 3, device_mesh=mesh, placements=[Partial(), Replicate()])


# ---- torch.diff and torch.cdist -------------------------------------------------------------

_DIFF_CDIST = {
    "diff": lambda t: torch.diff(t, dim=0),
    "diff_n2_method": lambda t: t.diff(n=2),
    "diff_prepend_append": lambda t: torch.diff(
        t, dim=0, prepend=torch.zeros(1, 7, dtype=t.dtype), append=torch.ones(2, 7, dtype=t.dtype)),
    "diff_bool": lambda t: torch.diff(t > 0, dim=1),
    "cdist": lambda t: torch.cdist(t, t.flip(0) * 2),
    "cdist_p1": lambda t: torch.cdist(t, t[:3], p=1),
    "cdist_self": lambda t: torch.cdist(t, t),            # distance 0: gradient 0, as torch
}


@pytest.mark.parametrize("name", sorted(_DIFF_CDIST))
@pytest.mark.parametrize("shape,ps", [((3,), [Shard(0)]), ((3,), [Shard(1)]),
                                      ((2, 2), [Shard(0), Shard(1)]),
                                      ((2, 2), [Partial(), Shard(0)])])
def test_diff_and_cdist_equal_torch(name, shape, ps):
    """Was NoRuleError: torch.diff and torch.cdist composed of table ops."""
    f = _DIFF_CDIST[name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, dtype=torch.float64, generator=g)
    xr = x.clone().requires_grad_()
    ref = f(xr)
    mesh = wb.Mesh.grid(shape)
    d = wb.distribute_tensor(x, mesh, [Replicate() if p.is_partial() else p for p in ps])
    d = d.redistribute(mesh, ps).detach().requires_grad_()
    out = f(d)
    torch.testing.assert_close(out.full_tensor(), ref.detach())
    if ref.dtype.is_floating_point:
        w = torch.randn(ref.shape, dtype=ref.dtype, generator=g)
        (ref * w).sum().backward()
        (out * w).sum().backward()
        torch.testing.assert_close(d.grad.full_tensor(), xr.grad)


def test_mesh_size_saves_and_loads_as_a_plain_int():
    """mesh.size is an int that can be called (DeviceMesh's size()); saved, it loads as a
    plain int under torch.load's default weights_only=True."""
    import io
    mesh = wb.Mesh.grid((2, 3))
    buf = io.BytesIO()
    torch.save({"world": mesh.size, "mesh": mesh}, buf)
    buf.seek(0)
    got = torch.load(buf)
    assert type(got["world"]) is int and got["world"] == 6 and got["mesh"].size(1) == 3
    assert type(pickle.loads(pickle.dumps(mesh.size))) is int
    assert f"{mesh.size}" == "6" and mesh.size * 2 == 12 and type(mesh.size * 2) is int


def test_to_local_of_a_replicated_value_on_simulated_ranks_as_dtensor(oracle):
    """Every rank holds the same local under Replicate: to_local() gives it, and its
    gradient is the DistTensor's, as each rank's DTensor.to_local."""
    dmesh = oracle.mesh((2, 2))
    x, w = torch.randn(4, 3), torch.randn(4, 3)
    from tests.dtensor_support import distribute_tensor as torch_distribute
    with LocalTensorMode(4):
        theirs = torch_distribute(x.clone().requires_grad_(), dmesh, [DShard(0), DShard(1)])
        theirs_r = theirs.redistribute(dmesh, [DReplicate(), DReplicate()])
        (theirs_r.to_local() * w).sum().backward()
        their_val = theirs_r.to_local()._local_tensors[0].clone()
        their_grad = theirs.grad.full_tensor()._local_tensors[0].clone()
    mesh = wb.Mesh.grid((2, 2))
    d = wb.distribute_tensor(x, mesh, [Shard(0), Shard(1)]).requires_grad_()
    r = d.redistribute(mesh, [Replicate(), Replicate()])
    loc = r.to_local()
    torch.testing.assert_close(loc, their_val)
    (loc * w).sum().backward()
    torch.testing.assert_close(d.grad.full_tensor(), their_grad)
    with pytest.raises(ValueError, match="hold different shards"):
        d.to_local()
