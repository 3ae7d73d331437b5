"""The planner's error messages in the words of the command line that raised them.

``wb.plan`` names its Python arguments (``global_batch=5``, ``Layout: tp=5 does not
divide ...``); a user of ``python -m workbench plan`` or ``python -m workbench train
--dry-run`` typed flags, so the commands print the same message with each argument
written as its flag (``--global-batch 5``, ``--tp 5``)::

    as_flags("search: ... global_batch=5; try a global_batch that ...", PLAN_FLAGS)
    # 'search: ... --global-batch 5; try a --global-batch that ...'

An argument the command has no flag for (``stages=``, ``n_head=``) is left as it is.
"""
from __future__ import annotations

import re

__all__ = ["PLAN_FLAGS", "dry_run_flags", "as_flags"]

# python -m workbench plan (workbench.cli): search's and Cluster's arguments
PLAN_FLAGS = {"global_batch": "--global-batch", "max_micro_batch": "--max-micro-batch",
              "top": "--top", "devices": "--devices", "profile": "--profile"}

# the Layout fields python -m workbench train --dry-run sets (plan.dryrun_cli)
_TRAIN = {"global_batch": "--batch-size", "micro_batch": "--micro-batch", "tp": "--tp",
          "pp": "--pp", "zero": "--zero", "recompute": "--recompute", "schedule": "--schedule",
          "sp": "--sp", "cp": "--cp", "ep": "--ep", "profile": "--profile",
          "cp_comm": "--cp-comm"}

# a Layout value the flag spells otherwise (plan.dryrun_cli._SCHEDULES)
_VALUES = {("--schedule", "interleaved_1f1b"): "interleaved"}


def dry_run_flags(ep: int = 1) -> dict:
    """The flags of ``train --dry-run``; ``dp`` only without ``--ep``, which the layout's
    dp includes (``--dp 2 --ep 2`` is ``Layout(dp=4)``: its dp is not the flag's)."""
    return dict(_TRAIN, **({"dp": "--dp"} if ep == 1 else {}))


def as_flags(message: str, flags: dict) -> str:
    """``message`` with each ``name=value`` of ``flags`` written ``--flag value`` (quotes
    dropped, but for an empty value: ``--flag ''``; ``sp=True`` as ``--sp``) and each bare argument name that has an underscore
    (``global_batch``: a Python name in prose) as its flag."""
    names = "|".join(sorted(map(re.escape, flags), key=len, reverse=True))

    def one(m):
        flag, value = flags[m.group(1)], m.group(2).strip("'\"")
        if not value:                     # an empty string given: shown as typed ('')
            return f"{flag} ''"
        if value in ("True", "False") and flag == "--sp":
            return "--sp" if value == "True" else "no --sp"
        return f"{flag} {_VALUES.get((flag, value), value)}"

    out = re.sub(rf"(?<![\w.-])({names})=('[^']*'|\"[^\"]*\"|[^\s,;:)]+)", one, message)
    prose = "|".join(re.escape(n) for n in flags if "_" in n)
    if prose:
        out = re.sub(rf"(?<![\w.-])({prose})(?![\w=])", lambda m: flags[m.group(1)], out)
    return out
