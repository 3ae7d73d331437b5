"""Parameters whose storage is not the module's shape: in-place init refuses them.

On simulated ranks ``DistributedDataParallel`` stores each parameter as one row per rank
(shape ``(N, *shape)``) and ``FullyShardedDataParallel`` as flat padded chunks (``(N,
chunk)``, or ``(chunk,)`` per process).  ``torch.nn.init`` after wrapping would read that
storage as the parameter: each rank's replica filled from its own draw (the replicas no
longer equal), a fan-in (``kaiming_*``, ``xavier_*``, ``nn.Linear.reset_parameters``)
read from the rows' or the chunk's shape.  One device's result would need one draw of
the full parameter, which the wrappers do at construction (DDP broadcasts rank 0's
values; FSDP cuts the module's values), so these parameters are a subclass of
``nn.Parameter`` whose ``__torch_function__`` raises on a random fill (the ``Tensor``
methods every ``torch.nn.init`` random init ends in: ``uniform_``, ``normal_``...; the
``nn.init`` functions torch lets a subclass override; ``torch.eye(out=...)``) and passes
every other function through unchanged (plain results, as ``nn.Parameter``'s).
``fill_`` / ``zero_`` / ``nn.init.constant_`` are elementwise and stay allowed; a whole
parameter's random fill is one device's draw (below).  ``p.data``
and ``p.detach()`` keep these guards (:class:`_LaidOutData`: torch's are plain tensors,
which drew each rank's row or chunk on its own), and so does every view of the storage
(``p.view(-1)``, ``p[0]``, ``p.flatten()``, ``p.T``, ``p.narrow``, ``p.unbind()``...:
:class:`_LaidOutView`, random fills raise, elementwise writes write what it views).  A
reshape that must copy (a non-contiguous storage: fully_shard over DistTensors keeps its
chunks dp-minor) gives a copy, as torch's, which reads as one and refuses writes (on one
device the parameter is contiguous and the reshape a view that writes it:
:mod:`.laid_out_copies`).

Read into a plain tensor of the module's shape by an in-place op (an EMA's
``ema.copy_(p)``, ``_foreach_lerp_``), ``p`` is its module value, and so is it in an
out-of-place pointwise op beside a tensor of the module's shape (a custom
``AveragedModel(avg_fn=...)``'s ``0.1 * ema + 0.9 * p``: :mod:`.laid_out_reads`).

``nn.init.normal_(p, mean, std)`` (GPT-2's init), and every other random ``nn.init``
(``uniform_``, ``kaiming_*``, ``xavier_*``, ``trunc_normal_``, ``Linear.reset_parameters``)
and random fill of ``p`` or ``p.data`` (``p.data.normal_(0, 0.02)``, Hugging Face's) is one
device's: one draw of the module's shape written into every row or chunk
(:func:`_one_draw`), the fans read from the module's shape (habits12; before, only
``normal_`` was, the rest raised).

``torch.autograd.grad`` over DDP's rows raises (:func:`_check_autograd_grad`: each row
would be its own rank's gradient, never averaged; torch DDP does not support it).

``nn.init.eye_`` / ``orthogonal_`` / ``dirac_`` / ``sparse_`` (the storage's shape read
inside ``nn.init``, a write by index or through a view) raise at their first touch, before
any draw (:func:`.laid_out_replica_init.refuse_laid_out_init`): initialize before wrapping.

Where the wrapper says how (``full`` / ``store``: the module's tensor from the storage
and back), a value of the module's own shape goes in and out as on one device:
``p.copy_(t)`` with ``t`` of the module's shape writes it into every rank's row or chunk
(FSDP's chunks would otherwise raise a broadcasting error, or DDP's rows take it
already), another in-place op given such a tensor raises (its elements would not meet
the storage's), and the module's own ``state_dict()`` / ``load_state_dict`` give and take
tensors of the module's shapes (:func:`module_shaped_state_dict`), as ``ddp.module.
state_dict()`` does in torch; so does any ``torch.optim`` optimizer's ``state_dict()`` over
them (hooked at its first step), and one device's optimizer states loaded into it are laid
out before the next step (:func:`_lay_out_loaded_states`): a checkpoint moves between one
device and any rank count.  An optimizer whose update reads a parameter whole would read
the storage instead (``torch.optim.LBFGS`` over DDP's rows, ``Adafactor`` over FSDP's
chunks): it raises before its first step (:func:`_check_whole_parameter_optimizer`).

The parts live beside this module, which keeps their import path: the parameter and its
aliases and views (:mod:`.laid_out_param`), module-shaped writes and draws
(:mod:`.laid_out_draws`), the layouts (:mod:`.laid_out_layouts`), an optimizer's states
(:mod:`.laid_out_states`, whose import registers the step pre-hook) and the module's
state dict (:mod:`.laid_out_state_dict`).
"""
from __future__ import annotations

from .laid_out_draws import _draw_store, _module_shaped_operands, _one_draw, _owner  # noqa: F401
from .laid_out_layouts import Chunks, ProcessChunks, Rows  # noqa: F401
from .laid_out_param import (_LAID_OUT, LaidOutParameter, _LaidOutData,  # noqa: F401
                             _LaidOutView, _check_autograd_grad, _guard_views, laid_out,
                             rank_row)
# (imported after the parameter's modules: the step pre-hook it registers comes after
# theirs, as when it was registered at the end of this module)
from .laid_out_states import (_check_whole_parameter_optimizer,  # noqa: F401
                              _lay_out_loaded_states, _module_shaped_states)
from .laid_out_state_dict import module_shaped, module_shaped_state_dict  # noqa: F401

__all__ = ["LaidOutParameter", "laid_out", "module_shaped", "module_shaped_state_dict", "Rows",
           "Chunks", "rank_row"]
