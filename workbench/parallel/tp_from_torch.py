"""PyTorch's own ParallelStyle objects read as ours, so a plan written with
``torch.distributed.tensor.parallel`` (torchtitan's, say) runs through
:func:`workbench.parallelize_module` unchanged.  Only torch's own style classes are read
(their attributes, torch 2.13 ``style.py``); a subclass with its own hooks (torchao's
Float8ColwiseParallel, torchtitan's NoParallel) is refused, never run as its parent."""
from __future__ import annotations

__all__ = ["is_torch_style", "from_torch_style"]


def is_torch_style(style) -> bool:
    """A torch ParallelStyle (its class or a subclass); torch's module imported only for
    an object that is not ours already."""
    try:
        from torch.distributed.tensor.parallel.style import ParallelStyle
    except ImportError:          # a torch built without distributed
        return False
    return isinstance(style, ParallelStyle)


def from_torch_style(style):
    """Our style equal to torch's ``style``."""
    from torch.distributed.tensor.parallel import style as ts

    from .tp_prepare import PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput
    from .tp_styles import ColwiseParallel, RowwiseParallel, SequenceParallel
    t = type(style)
    if t in (ts.ColwiseParallel, ts.RowwiseParallel):
        ours = ColwiseParallel if t is ts.ColwiseParallel else RowwiseParallel
        return ours(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                    use_local_output=style.use_local_output)
    if t is ts.SequenceParallel:
        return SequenceParallel(sequence_dim=style.sequence_sharding[0].dim,
                                use_local_output=style.use_local_output)
    if t is ts.PrepareModuleInput:
        kw = style.with_kwargs
        return PrepareModuleInput(
            input_layouts=style.input_layouts, desired_input_layouts=style.desired_input_layouts,
            input_kwarg_layouts=style.input_kwarg_layouts if kw else None,
            desired_input_kwarg_layouts=style.desired_input_kwarg_layouts if kw else None,
            use_local_output=style.use_local_output)
    if t is ts.PrepareModuleOutput:
        return PrepareModuleOutput(output_layouts=style.output_layouts,
                                   desired_output_layouts=style.desired_output_layouts,
                                   use_local_output=style.use_local_output)
    if t is ts.PrepareModuleInputOutput:
        i, o = from_torch_style(style.prepare_module_input), \
            from_torch_style(style.prepare_module_output)
        return PrepareModuleInputOutput(
            input_layouts=i.input_layouts, desired_input_layouts=i.desired_input_layouts,
            input_kwarg_layouts=i.input_kwarg_layouts or None,
            desired_input_kwarg_layouts=i.desired_input_kwarg_layouts or None,
            use_local_input=i.use_local_output, output_layouts=o.output_layouts,
            desired_output_layouts=o.desired_output_layouts, use_local_output=o.use_local_output)
    raise TypeError(f"{t.__module__}.{t.__name__}: a torch ParallelStyle workbench cannot read "
                    "(its own hooks); use workbench's ColwiseParallel, RowwiseParallel, "
                    "SequenceParallel, PrepareModuleInput / Output, or write its layouts with them")
