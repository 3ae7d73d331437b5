"""PyTorch's own answers that a test holds the library to, computed by torch alone in a
fresh Python (no workbench imported: the library teaches torch.optim, clip_grad_norm_,
Function.apply... DistTensors, and the references must be torch's own), all of them in
ONE process a test session.

Each reference was a ``subprocess.run([sys.executable, "-c", SCRIPT])`` of its own test:
3.3-3.6 s of CPU each, nearly all of it the start-up (``import torch``,
``torch.distributed``, and ``torch._dynamo``, which DTensor's and FSDP2's constructors
import); 13.7 s for the four (measured with benchmarks/suite_cputime.py on the four
tests, task speed18).  Here :data:`SCRIPTS` run one after another in one ``python -c``
(:data:`_RUNNER`), each in its own namespace with its own one-rank gloo group (each
script makes and destroys it) and its stdout captured apart; the job runs once a session
whichever test asks first, on whichever pytest-xdist worker
(:func:`tests.torchrun_support.run_once`), and :func:`reference` hands each test its
script's stdout, or fails with the script's own traceback.

Order: a script that changes torch for the rest of the process runs after the others:
``fsdp2_order`` wraps ``FSDPParamGroup.unshard`` / ``post_backward`` (to log them) and
leaves them wrapped, so it runs last, after ``fsdp2_reduce_scatter``'s FSDP2.
"""
import json
import sys

# ---- tests/test_plan_memory_peak.py: DTensor's loss_parallel, bytes per logit at the peak
LOSS_PARALLEL = r'''
import tempfile, torch, torch.nn.functional as F, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.distributed._tools.mem_tracker import MemTracker
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0,
                        world_size=1)
mesh = init_device_mesh("cpu", (1,))
N, V, H = 2048, 1024, 16
g = torch.Generator().manual_seed(0)
x = torch.randn(N, H, generator=g, dtype=torch.bfloat16).requires_grad_(True)
w = torch.randn(V, H, generator=g, dtype=torch.bfloat16).requires_grad_(True)
t = torch.randint(0, V, (N,), generator=g)
mt = MemTracker()
mt.track_external(x, w)
with mt:
    pred = x @ w.t()
    dpred = DTensor.from_local(pred, mesh, [Shard(1)], run_check=False)
    with loss_parallel():
        loss = F.cross_entropy(dpred.float(), distribute_tensor(t, mesh, [Replicate()]))
        del pred, dpred
        loss.backward()
peak = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
print((peak - 4 * (x.numel() + w.numel())) / (N * V))
dist.destroy_process_group()
'''

# ---- tests/test_fixlist3.py: set_model_state_dict with an empty state dict
EMPTY_CASES = [("strict", {}), ("not strict", dict(strict=False)),
               ("strict, frozen ignored", dict(ignore_frozen_params=True))]

TORCH_EMPTY = r"""
import json, torch, torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
out = {}
for name, kw in %s:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    before = [v.clone() for v in m.state_dict().values()]
    try:
        r = set_model_state_dict(m, {}, options=StateDictOptions(**kw))
        res = [list(r.missing_keys), list(r.unexpected_keys)]
    except Exception as e:
        res = type(e).__name__
    same = all(torch.equal(a, b) for a, b in zip(before, m.state_dict().values()))
    out[name] = [res, same]
dist.destroy_process_group()
print(json.dumps(out))
""" % repr(EMPTY_CASES)

# ---- tests/test_i21mem3.py: FSDP2 holds the previous unit's reduce-scatter input
FSDP2_REDUCE_SCATTER = r'''
import tempfile, torch, torch.nn as nn, torch.nn.functional as F, torch.distributed as dist
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state
from torch.utils.checkpoint import checkpoint
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0,
                        world_size=1)
torch.manual_seed(0)
h, f, V, n = 32, 128, 256, 16
class Block(nn.Module):
    def __init__(s):
        super().__init__(); s.fc1 = nn.Linear(h, f); s.fc2 = nn.Linear(f, h)
    def forward(s, x):
        return x + checkpoint(lambda y: s.fc2(F.gelu(s.fc1(y))), x, use_reentrant=False)
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.emb = nn.Embedding(V, h)
        s.blocks = nn.ModuleList([Block() for _ in range(3)])
        s.ln = nn.LayerNorm(h); s.head = nn.Linear(h, V, bias=False)
    def forward(s, idx):
        x = s.emb(idx)
        for b in s.blocks: x = b(x)
        return s.head(s.ln(x))
m = M()
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for b in m.blocks: fully_shard(b, mp_policy=mp)
fully_shard([m.ln, m.head], mp_policy=mp)
fully_shard(m, mp_policy=mp)
seen = []
def hook(mod, gout):
    c = _get_module_fsdp_state(m.blocks[0])._fsdp_param_group.comm_ctx
    held = getattr(c, "reduce_scatter_states", None)
    if held is None:
        held = [c.reduce_scatter_state] if c.reduce_scatter_state is not None else []
    seen.append([(s.reduce_scatter_input.numel(), str(s.reduce_scatter_input.dtype))
                 for s in held])
for b in m.blocks: b.fc2.register_full_backward_pre_hook(hook)
idx = torch.randint(0, V, (2, n)); tgt = torch.randint(0, V, (2 * n,))
F.cross_entropy(m(idx).float().flatten(0, 1), tgt).backward()
print(seen)
dist.destroy_process_group()
'''

# ---- tests/test_fsdp2_root.py: torchtitan's wrapping (fully_shard per block, then the
# model) on a toy Llama-like model; the order in which FSDP2 unshards and runs
# post-backward for each group, and which parameters the root's group holds
FSDP2_ORDER = r'''
import tempfile, torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as PG
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0,
                        world_size=1)
mesh = init_device_mesh("cpu", (1,))
torch.manual_seed(0)
class Block(nn.Module):
    def __init__(s):
        super().__init__(); s.l = nn.Linear(8, 8, bias=False)
    def forward(s, x):
        return x + s.l(x)
class Model(nn.Module):
    def __init__(s):
        super().__init__()
        s.tok_embeddings = nn.Embedding(16, 8)
        s.layers = nn.ModuleList([Block(), Block()])
        s.norm = nn.LayerNorm(8)
        s.output = nn.Linear(8, 16, bias=False)
    def forward(s, t):
        h = s.tok_embeddings(t)
        for b in s.layers:
            h = b(h)
        return s.output(s.norm(h)).float()
m = Model()
for b in m.layers:
    fully_shard(b, mesh=mesh)
fully_shard(m, mesh=mesh)
log = []
def wrap(name):
    orig = getattr(PG.FSDPParamGroup, name)
    def f(self, *a, **k):
        log.append((name, self._module_fqn or "root"))
        return orig(self, *a, **k)
    setattr(PG.FSDPParamGroup, name, f)
wrap("unshard"); wrap("post_backward")
t = torch.randint(0, 16, (2, 4))
m(t).sum().backward()
names = sorted(p._param_fqn for p in m._get_fsdp_state()._fsdp_param_group.fsdp_params)
print(repr((log, names)))
dist.destroy_process_group()
'''

# run in this order (see the module's docstring: FSDP2_ORDER last)
SCRIPTS = {"loss_parallel": LOSS_PARALLEL, "torch_empty": TORCH_EMPTY,
           "fsdp2_reduce_scatter": FSDP2_REDUCE_SCATTER, "fsdp2_order": FSDP2_ORDER}

# each script as its own ``python -c`` ran it: ``__main__``'s namespace (a fresh dict
# here), its prints captured; a failing script's traceback kept and the next one run
_RUNNER = r'''
import contextlib, io, json, sys, traceback
out = {}
for name, script in json.loads(sys.argv[1]).items():
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            exec(compile(script, "<" + name + ">", "exec"), {"__name__": "__main__"})
        out[name] = {"ok": True, "stdout": buf.getvalue()}
    except BaseException:
        out[name] = {"ok": False, "stdout": buf.getvalue(), "error": traceback.format_exc()}
print(json.dumps(out))
'''


def reference(name: str, tmp_path_factory) -> str:
    """The stdout of :data:`SCRIPTS` ``[name]``, from the session's one run of them all;
    an AssertionError with the script's traceback when it failed."""
    from tests.torchrun_support import run_once
    if name not in SCRIPTS:
        raise ValueError(f"reference: {name!r} is not in tests/torch_references.py's "
                         f"SCRIPTS ({sorted(SCRIPTS)}); add its script there")
    cmd = [sys.executable, "-c", _RUNNER, json.dumps(SCRIPTS)]
    out = run_once(cmd, tmp_path_factory, "torch-references", SCRIPTS, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])[name]
    assert got["ok"], got["error"][-3000:]
    return got["stdout"]
