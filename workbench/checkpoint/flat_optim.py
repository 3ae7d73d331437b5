"""torch's ``flatten_optimizer_state_dict`` form of an optimizer state dict keyed by FQN
(torch 2.13, ``torch/distributed/checkpoint/state_dict.py``, ``_flatten_optim_state_dict``):
``{"state.<fqn>.<name>": value, "param_groups.<fqn>.<key>": value}``, nested states
(Shampoo's) flattened with dots; :mod:`.state_dict` reads and writes it."""
from __future__ import annotations

__all__ = ["flatten", "unflatten"]


def flatten(osd: dict) -> dict:
    """``{"state": {fqn: {...}}, "param_groups": [...]}`` in the flattened form."""
    out = {}

    def put(prefix, v):
        if isinstance(v, dict):
            for n, x in v.items():
                put(f"{prefix}.{n}", x)
        else:
            out[prefix] = v
    for f, st in osd["state"].items():
        put(f"state.{f}", st)
    for g in osd["param_groups"]:
        for f in g["params"]:
            for n, v in g.items():
                if n != "params":
                    out[f"param_groups.{f}.{n}"] = v
    return out


def unflatten(flat: dict, fqns: list[str]) -> dict:
    """The flattened form back, for the parameters ``fqns`` (FQNs hold dots, so the
    optimizers' own FQNs tell the keys apart); parameters with equal settings share a
    group."""
    state, groups = {}, []
    for f in fqns:
        p = f"state.{f}."
        st = {}
        for k, v in flat.items():
            if k.startswith(p):
                *path, last = k[len(p):].split(".")
                d = st
                for n in path:
                    d = d.setdefault(n, {})
                d[last] = v
        if st:
            state[f] = st
        p = f"param_groups.{f}."
        hyper = {k[len(p):]: v for k, v in flat.items() if k.startswith(p)}
        if hyper:
            for g in groups:
                if {n: v for n, v in g.items() if n != "params"} == hyper:
                    g["params"].append(f)
                    break
            else:
                groups.append({**hyper, "params": [f]})
    return {"state": state, "param_groups": groups}
