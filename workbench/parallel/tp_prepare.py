"""PrepareModuleInput / PrepareModuleOutput: lay out a module's inputs and outputs, as
PyTorch's styles of those names (``torch/distributed/tensor/parallel/style.py``, torch
2.13); the layouts, plain-tensor inputs and ``use_local_output`` mean what
:mod:`.tp_styles` says."""
from __future__ import annotations

from .dist_tensor import DistTensor
from .tp_styles import ParallelStyle, _check_bool, _layouts, _placement, _put

__all__ = ["PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput"]


def _prepare(values, layouts, desired, mesh, md, what, enter):
    """Each value annotated with its layout (None: left alone) and moved to its desired one
    (``enter``: inputs, which enter a tp region through Megatron's f, :func:`.tp_styles._put`)."""
    out = []
    for i, (v, lay, want) in enumerate(zip(values, layouts, desired)):
        if lay is None:
            out.append(v)
            continue
        if not isinstance(v, DistTensor):
            v = _put(v, mesh, md, lay, f"{what}[{i}]")
        out.append(v if want is None else _put(v, mesh, md, want, f"{what}[{i}]", enter))
    return out


def _same_length(a, b, arg_a: str, arg_b: str) -> None:
    if a is not None and (b is None or len(a) != len(b)):
        raise ValueError(f"{arg_a} has {len(a)} entries but {arg_b} "
                         f"{'is None' if b is None else f'has {len(b)}'}: give one desired "
                         "layout (or None) per layout")


class PrepareModuleInput(ParallelStyle):
    """Inputs (and keyword inputs) annotated with ``input_layouts`` and moved to
    ``desired_input_layouts``; None leaves an input as it is."""

    def __init__(self, *, input_layouts=None, desired_input_layouts=None,
                 input_kwarg_layouts=None, desired_input_kwarg_layouts=None,
                 use_local_output: bool = False):
        self.input_layouts = _layouts(input_layouts, "input_layouts")
        self.desired_input_layouts = _layouts(desired_input_layouts, "desired_input_layouts")
        _same_length(self.input_layouts, self.desired_input_layouts,
                     "input_layouts", "desired_input_layouts")
        kw = {}
        for arg, d in (("input_kwarg_layouts", input_kwarg_layouts),
                       ("desired_input_kwarg_layouts", desired_input_kwarg_layouts)):
            if d is not None and not isinstance(d, dict):
                raise TypeError(f"{arg}={d!r}: expected a dict of keyword name -> placement")
            kw[arg] = {k: _placement(v, f"{arg}[{k!r}]") for k, v in (d or {}).items()}
        self.input_kwarg_layouts = kw["input_kwarg_layouts"]
        self.desired_input_kwarg_layouts = kw["desired_input_kwarg_layouts"]
        if set(self.input_kwarg_layouts) != set(self.desired_input_kwarg_layouts):
            raise ValueError(f"input_kwarg_layouts names {sorted(self.input_kwarg_layouts)} "
                             f"but desired_input_kwarg_layouts {sorted(self.desired_input_kwarg_layouts)}"
                             ": give both for the same keyword inputs")
        self.use_local_output = _check_bool(use_local_output, "use_local_output")

    def _run(self, mod, args, kwargs, mesh, md):
        if self.input_layouts is not None:
            if len(args) != len(self.input_layouts):
                raise ValueError(f"PrepareModuleInput: {type(mod).__name__} got {len(args)} "
                                 f"positional inputs but input_layouts has "
                                 f"{len(self.input_layouts)}: give one layout (or None) per input")
            args = tuple(_prepare(args, self.input_layouts, self.desired_input_layouts,
                                  mesh, md, "input", True))
        if self.input_kwarg_layouts:
            keys = [k for k in kwargs if k in self.input_kwarg_layouts]
            vals = _prepare([kwargs[k] for k in keys], [self.input_kwarg_layouts[k] for k in keys],
                            [self.desired_input_kwarg_layouts[k] for k in keys], mesh, md,
                            "kwarg input", True)
            kwargs = {**kwargs, **dict(zip(keys, vals))}
        return args, kwargs

    def _apply(self, module, mesh, md):
        module.register_forward_pre_hook(
            lambda mod, args, kwargs: self._run(mod, args, kwargs, mesh, md), with_kwargs=True)
        return module


class PrepareModuleOutput(ParallelStyle):
    """Outputs annotated with ``output_layouts`` and moved to ``desired_output_layouts``."""

    def __init__(self, *, output_layouts, desired_output_layouts, use_local_output: bool = True):
        self.output_layouts = _layouts(output_layouts, "output_layouts")
        self.desired_output_layouts = _layouts(desired_output_layouts, "desired_output_layouts")
        if self.output_layouts is None:
            raise ValueError("output_layouts=None: give a placement per output (None for one "
                             "left as it is)")
        _same_length(self.output_layouts, self.desired_output_layouts,
                     "output_layouts", "desired_output_layouts")
        self.use_local_output = _check_bool(use_local_output, "use_local_output")

    def _run(self, mod, out, mesh, md):
        one = not isinstance(out, tuple)
        outs = (out,) if one else out
        if len(outs) != len(self.output_layouts):
            raise ValueError(f"PrepareModuleOutput: {type(mod).__name__} returned {len(outs)} "
                             f"outputs but output_layouts has {len(self.output_layouts)}")
        res = _prepare(outs, self.output_layouts, self.desired_output_layouts, mesh, md, "output",
                       False)
        return res[0] if len(res) == 1 else tuple(res)

    def _apply(self, module, mesh, md):
        module.register_forward_hook(lambda mod, args, out: self._run(mod, out, mesh, md))
        return module


class PrepareModuleInputOutput(ParallelStyle):
    """PrepareModuleInput and PrepareModuleOutput on one module."""

    def __init__(self, *, input_layouts=None, desired_input_layouts=None,
                 input_kwarg_layouts=None, desired_input_kwarg_layouts=None,
                 use_local_input: bool = False, output_layouts, desired_output_layouts,
                 use_local_output: bool = True):
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input)
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts, desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output)

    def _apply(self, module, mesh, md):
        self.prepare_module_input._apply(module, mesh, md)
        return self.prepare_module_output._apply(module, mesh, md)
