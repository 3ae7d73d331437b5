"""What a call of a compiled module runs besides its tensors, recorded at capture and
checked on every call: its tree of submodules, their train/eval flags, and the module
hooks (the module's and the global ones)."""
from __future__ import annotations

from torch import nn


def module_tree(module: nn.Module) -> tuple:
    """(name, the submodule itself) for the module and every child: what the graph ran
    (the objects, held: an id alone could be a new module's at the same address)."""
    return tuple(module.named_modules(remove_duplicate=False))


def check_module_tree(module: nn.Module, captured: tuple) -> None:
    """Refuse a call after a submodule was added, removed or replaced (``m.act = Tanh()``:
    the graph still runs the ops of the one it captured)."""
    now = module_tree(module)
    if len(now) == len(captured) and all(a == b and m is n for (a, m), (b, n) in
                                         zip(now, captured)):
        return
    was, is_ = dict(captured), dict(now)
    changed = [f"{n or 'the module'} ({type(was[n]).__name__ if n in was else 'none'} -> "
               f"{type(is_[n]).__name__ if n in is_ else 'none'})"
               for n in list(was) + [n for n in is_ if n not in was]
               if was.get(n) is not is_.get(n)]
    raise ValueError("compiled program: submodules added, removed or replaced since capture: "
                     f"{', '.join(changed[:4])}{' ...' if len(changed) > 4 else ''}; the graph "
                     "runs the ops of the modules it captured: compile the module again")


def training_flags(module: nn.Module) -> tuple:
    """(submodule name, its ``training`` flag) for the module and every child."""
    return tuple((name, m.training) for name, m in module.named_modules())


def check_training_flags(module: nn.Module, captured: tuple) -> None:
    """Refuse a call in another train/eval mode than the capture's."""
    now = training_flags(module)
    if now == captured:
        return
    was = dict(captured)
    changed = [f"{name or 'the module'} ({'train' if was[name] else 'eval'} -> "
               f"{'train' if flag else 'eval'})" for name, flag in now
               if name in was and was[name] != flag]
    raise ValueError(
        "compiled program called with its module in another train/eval mode than at "
        f"capture: {', '.join(changed[:4])}{' ...' if len(changed) > 4 else ''}; the graph "
        "keeps what the capture's mode did (dropout, branches on self.training): compile "
        "the module again in this mode (wb.compile after model.train() / model.eval()), or "
        "set the mode back")


_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def hook_keys(module) -> tuple:
    """The hooks a call of ``module`` runs: per submodule and globally, their handles' ids."""
    from torch.nn.modules import module as M
    glob = tuple(tuple(getattr(M, f"_global{h}", {})) for h in _HOOKS)
    if not isinstance(module, nn.Module):
        return (glob,)
    return (glob,) + tuple((name, tuple(tuple(getattr(m, h, {})) for h in _HOOKS))
                           for name, m in module.named_modules())


def check_hooks(module, captured: tuple) -> None:
    """Refuse a call after a module hook was added or removed (the graph ran the old ones)."""
    now = hook_keys(module)
    if now == captured:
        return
    was = dict(captured[1:])
    where = ["global module hooks"] if now[0] != captured[0] else []
    where += [repr(name) if name else "the module" for name, keys in now[1:]
              if was.get(name) != keys]
    raise ValueError(f"compiled program: hooks added or removed since capture on "
                     f"{', '.join(where[:4])}; the graph holds what the hooks at capture "
                     "did: compile again with the hooks you want")
