"""Hardware profiles: what the modeled clock prices work on.

A profile holds a device's dense peak FLOP/s per dtype, its memory bandwidth and
size, how many devices share a node, and two links: the one between devices of
a node (NVLink, HCCS) and the one between nodes (InfiniBand, RoCE). The built-in
profiles are JSON data files in ``profiles/`` beside this module, each carrying
its sources and what is uncertain about it::

    >>> p = get_profile("a100")
    >>> p.peak("bfloat16") / 1e12, p.intra_node.bandwidth / 1e9
    (312.0, 300.0)

Conventions (used by ``cost.py``):

- ``peak_flops``: dense (no structured sparsity) FLOP/s, keyed by dtype name
  ("float32", "tf32" where the hardware has it, "bfloat16", "float16").
- ``Link.bandwidth``: bytes/s one device can send in one direction over that
  level (NVIDIA's "600 GB/s NVLink" is 300 GB/s each way). 1/bandwidth is the
  beta of the alpha-beta model; ``Link.latency`` is its alpha, in seconds.
- Node of a rank: ``rank // devices_per_node``.

Your own hardware: copy one of the JSON files, edit it, ``load_profile(path)``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

__all__ = ["Link", "Profile", "get_profile", "list_profiles", "load_profile",
           "dtype_name", "DEFAULT_PROFILE"]

DEFAULT_PROFILE = "a100"
REQUIRED_DTYPES = ("float32", "bfloat16", "float16")

# Spellings accepted for a dtype; torch dtypes arrive as "torch.float16" etc.
_DTYPE_ALIASES = {
    "float32": "float32", "float": "float32", "fp32": "float32", "f32": "float32",
    "tf32": "tf32", "tensorfloat32": "tf32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "half": "float16", "fp16": "float16", "f16": "float16",
}


def dtype_name(dtype) -> str:
    """Canonical dtype key ("float32", "tf32", "bfloat16", "float16") for a torch
    dtype or a string such as "bf16" / "torch.half"."""
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPE_ALIASES:
        raise ValueError(f"dtype={dtype!r} is not a known floating-point dtype; "
                         f"use one of {sorted(set(_DTYPE_ALIASES.values()))} "
                         f"(or a torch dtype such as torch.bfloat16)")
    return _DTYPE_ALIASES[key]


def _positive(owner: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{owner}: {name}={value!r} must be a finite number > 0")


@dataclass(frozen=True)
class Link:
    """One level of interconnect, as the alpha-beta model sees it."""
    name: str          # e.g. "NVLink 3 via NVSwitch"
    bandwidth: float   # bytes/s, one direction, per device (beta = 1 / bandwidth)
    latency: float     # seconds per message (alpha)

    def __post_init__(self):
        _positive(f"Link {self.name!r}", "bandwidth", self.bandwidth)
        if isinstance(self.latency, bool) or not isinstance(self.latency, (int, float)) \
                or not math.isfinite(self.latency) or self.latency < 0:
            raise ValueError(f"Link {self.name!r}: latency={self.latency!r} must be "
                             f"a finite number of seconds >= 0")

    def __str__(self):
        return f"{self.name}: {self.bandwidth / 1e9:g} GB/s, {self.latency * 1e6:g} us"


@dataclass(frozen=True)
class Profile:
    """A device type and how its devices are connected (see the module docstring)."""
    name: str
    description: str
    peak_flops: Mapping[str, float] = field(hash=False)  # dtype -> dense FLOP/s
    memory_bandwidth: float           # bytes/s, device memory (HBM)
    memory_bytes: int                 # device memory capacity
    devices_per_node: int             # ranks r and q share a node iff r // d == q // d
    intra_node: Link                  # between devices of one node
    inter_node: Link                  # between nodes, per device
    sources: tuple[str, ...] = ()     # datasheets / papers the numbers come from
    notes: str = ""                   # assumptions and uncertainties

    def __post_init__(self):
        owner = f"Profile {self.name!r}"
        flops = {dtype_name(k): float(v) for k, v in dict(self.peak_flops).items()}
        missing = [d for d in REQUIRED_DTYPES if d not in flops]
        if missing:
            raise ValueError(f"{owner}: peak_flops lacks {missing}; give dense FLOP/s "
                             f"for each of {list(REQUIRED_DTYPES)}")
        for k, v in flops.items():
            _positive(owner, f"peak_flops[{k!r}]", v)
        _positive(owner, "memory_bandwidth", self.memory_bandwidth)
        _positive(owner, "memory_bytes", self.memory_bytes)
        if isinstance(self.devices_per_node, bool) or not isinstance(self.devices_per_node, int) \
                or self.devices_per_node < 1:
            raise ValueError(f"{owner}: devices_per_node={self.devices_per_node!r} "
                             f"must be an int >= 1")
        for attr in ("intra_node", "inter_node"):
            if not isinstance(getattr(self, attr), Link):
                raise ValueError(f"{owner}: {attr} must be a Link, "
                                 f"got {type(getattr(self, attr)).__name__}")
        object.__setattr__(self, "peak_flops", MappingProxyType(flops))
        object.__setattr__(self, "sources", tuple(self.sources))

    def peak(self, dtype) -> float:
        """Dense peak FLOP/s for ``dtype`` (torch dtype or string)."""
        key = dtype_name(dtype)
        if key not in self.peak_flops:
            raise ValueError(f"profile {self.name!r} has no peak for dtype={key!r}; "
                             f"it knows {sorted(self.peak_flops)}")
        return self.peak_flops[key]

    def node_of(self, rank: int) -> int:
        """The node holding ``rank`` (ranks are packed node by node)."""
        return rank // self.devices_per_node

    def to_dict(self) -> dict:
        """Plain data, the layout of the JSON files (``from_dict`` reads it back)."""
        def link(l):
            return {"name": l.name, "bandwidth": l.bandwidth, "latency": l.latency}
        return {"name": self.name, "description": self.description,
                "peak_flops": dict(self.peak_flops),
                "memory_bandwidth": self.memory_bandwidth, "memory_bytes": self.memory_bytes,
                "devices_per_node": self.devices_per_node,
                "intra_node": link(self.intra_node), "inter_node": link(self.inter_node),
                "sources": list(self.sources), "notes": self.notes}

    @classmethod
    def from_dict(cls, data: Mapping) -> "Profile":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"profile data has unknown keys {unknown}; "
                             f"the keys are {sorted(known)}")
        kw = dict(data)
        for attr in ("intra_node", "inter_node"):
            if attr not in kw:
                raise ValueError(f"profile data lacks {attr!r}: give "
                                 f'{{"name": ..., "bandwidth": B/s, "latency": s}}')
            kw[attr] = Link(**kw[attr])
        missing = sorted(known - set(kw) - {"sources", "notes"})
        if missing:
            raise ValueError(f"profile data lacks keys {missing}")
        if isinstance(kw["memory_bytes"], float) and kw["memory_bytes"].is_integer():
            kw["memory_bytes"] = int(kw["memory_bytes"])
        kw["sources"] = tuple(kw.get("sources", ()))
        return cls(**kw)

    def __str__(self):
        return (f"{self.name}: {self.peak('bfloat16') / 1e12:g} TFLOP/s bf16, "
                f"{self.memory_bandwidth / 1e12:g} TB/s, {self.memory_bytes / 1e9:g} GB, "
                f"{self.devices_per_node}/node, intra {self.intra_node}, "
                f"inter {self.inter_node}")


def _data_dir():
    return resources.files(__package__).joinpath("profiles")


def list_profiles() -> list[str]:
    """Names of the built-in profiles, sorted."""
    return sorted(p.name[:-len(".json")] for p in _data_dir().iterdir()
                  if p.name.endswith(".json"))


def load_profile(path) -> Profile:
    """Read a profile from a JSON file laid out like the built-in ones."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"load_profile: path={str(path)!r} does not exist; give the "
                         f"path of a JSON file (see workbench/sim_mesh/profiles/)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"load_profile: {str(path)!r} is not valid JSON: {e}") from None
    return Profile.from_dict(data)


@lru_cache(maxsize=None)
def _builtin(name: str) -> Profile:
    return Profile.from_dict(json.loads(
        _data_dir().joinpath(f"{name}.json").read_text(encoding="utf-8")))


def get_profile(p: "str | Profile | None" = None) -> Profile:
    """A profile by name (case-insensitive), a Profile as is, or None for the
    default ("a100")."""
    if isinstance(p, Profile):
        return p
    if p is None:
        p = DEFAULT_PROFILE
    if not isinstance(p, str):
        raise TypeError(f"profile={p!r}: give a profile name, a Profile or None")
    name = p.strip().lower()
    hit = _BY_NAME.get(name)
    if hit is not None:
        return hit
    known = list_profiles()
    if name not in known:
        raise ValueError(f"profile={p!r} is not known; the built-in profiles are {known} "
                         f"(or load your own with load_profile(path))")
    _BY_NAME[name] = prof = _builtin(name)
    return prof


_BY_NAME: dict = {}
