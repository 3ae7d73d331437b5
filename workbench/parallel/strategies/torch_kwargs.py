"""torch's own keyword arguments to ``DistributedDataParallel`` and
``ZeroRedundancyOptimizer``, taken where they mean something here and refused by name
where they do not.

A program written for ``torch.nn.parallel.DistributedDataParallel`` passes
``find_unused_parameters=True``, ``bucket_cap_mb=25`` or ``gradient_as_bucket_view=True``;
one written for ``torch.distributed.optim.ZeroRedundancyOptimizer`` passes
``parameters_as_bucket_view=True`` (signatures of torch 2.13).  Without this the first was
Python's bare "unexpected keyword argument", and the last reached the inner optimizer's
constructor (``AdamW(..., parameters_as_bucket_view=True)``), an error naming neither.

* taken, with the values torch gives: ``find_unused_parameters`` (here a parameter no
  rank used keeps ``grad=None``, torch's behaviour with True; with False torch raises at
  the next forward instead), ``bucket_cap_mb``, ``static_graph`` and
  ``find_unused_parameters`` choose torch's buckets (:mod:`.ddp_buckets`; bucket sizes
  ``int(bucket_cap_mb * 2**20)``, torch's conversion), ``gradient_as_bucket_view`` (on
  torch.distributed each gradient a view of its bucket), ``check_reduction`` (no
  effect), ``device_ids`` / ``output_device`` left None (torch's value for a CPU module);
  ZeRO's ``parameters_as_bucket_view`` (memory only);
* refused with a message: anything else that changes what is computed (another process
  group, mixed precision, ``init_sync=False``, ``overlap_with_ddp=True``...).
"""
from __future__ import annotations

__all__ = ["ddp_torch_kwargs", "zero_torch_kwargs"]

# torch DDP's bool arguments (buckets, views, memory or speed; never the values): any bool
_DDP_BOOL = ("find_unused_parameters", "gradient_as_bucket_view", "static_graph",
             "check_reduction")
# torch DDP's arguments built here only at torch's default
_DDP_DEFAULT = {"device_ids": None, "output_device": None, "process_group": None,
                "device_mesh": None, "init_sync": True, "mixed_precision": None,
                "delay_all_reduce_named_params": None, "param_to_hook_all_reduce": None,
                "skip_all_reduce_unused_params": False, "bucket_cap_mb_list": None,
                "batched_grad_copy": False, "forward_sync_buffers": None}
_WHY = {"process_group": "pass the mesh instead (mesh=wb.distributed.mesh(...), or None "
                         "for the default group)",
        "device_mesh": "pass the mesh instead (mesh=wb.distributed.mesh(...))",
        "device_ids": "the module's own device is used; move the module before wrapping",
        "output_device": "the output stays on the module's device",
        "init_sync": "the replicas always start from one rank's values (a broadcast)",
        "forward_sync_buffers": "the buffers are broadcast before each forward, as torch's "
                                "default"}


def ddp_torch_kwargs(kwargs: dict, bucket_bytes):
    """``bucket_bytes`` after torch DDP's keyword arguments ``kwargs`` (module docstring);
    raises for one not built or not torch's."""
    for name, v in kwargs.items():
        if name in _DDP_BOOL:
            if not isinstance(v, bool):
                raise TypeError(f"DistributedDataParallel({name}={v!r}): give True or False")
        elif name == "bucket_cap_mb":
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"DistributedDataParallel(bucket_cap_mb={v!r}): give a "
                                 "size in MiB > 0 (torch's default: 25)")
            if bucket_bytes is not None:
                raise ValueError("DistributedDataParallel: bucket_cap_mb and bucket_bytes "
                                 "both given; give one")
            bucket_bytes = int(v * 1024 * 1024)       # torch DDP's conversion
        elif name in _DDP_DEFAULT:
            if name == "forward_sync_buffers" and v is True:
                continue                # torch 2.13: None means True, the built one
            if v is not _DDP_DEFAULT[name] and v != _DDP_DEFAULT[name]:
                why = _WHY.get(name, "not built here")
                raise NotImplementedError(f"DistributedDataParallel({name}={v!r}): {why}; "
                                          f"leave it {_DDP_DEFAULT[name]!r}")
        else:
            raise TypeError(f"DistributedDataParallel got an unexpected keyword argument "
                            f"{name!r} (neither workbench's nor torch's)")
    return bucket_bytes


def zero_torch_kwargs(kwargs: dict) -> dict:
    """``kwargs`` less torch ZeroRedundancyOptimizer's own arguments (the rest are the
    inner optimizer's); raises for one not built."""
    out = dict(kwargs)
    v = out.pop("parameters_as_bucket_view", False)
    if not isinstance(v, bool):
        raise TypeError(f"ZeroRedundancyOptimizer(parameters_as_bucket_view={v!r}): give "
                        "True or False")
    v = out.pop("overlap_with_ddp", False)
    if v is not False:
        raise NotImplementedError(f"ZeroRedundancyOptimizer(overlap_with_ddp={v!r}): the step "
                                  "runs after DDP's all-reduce here; leave it False")
    v = out.pop("process_group", None)
    if v is not None:
        raise NotImplementedError(f"ZeroRedundancyOptimizer(process_group={v!r}): pass the "
                                  "mesh instead (mesh=wb.distributed.mesh(...), or None for "
                                  "the default group)")
    return out
