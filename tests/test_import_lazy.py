"""`import workbench` loads the simulated mesh and the parallel layer; the layers above
(plan, recipes, serve, compile, models, exercises, checkpoint) load on first use, and
every public name still resolves (attribute access, dir(), `from workbench import *`)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAZY = ["workbench.plan", "workbench.recipes", "workbench.serve", "workbench.compile",
        "workbench.models", "workbench.exercises", "workbench.checkpoint"]

_PROBE = """
import json, sys
import workbench as wb
loaded = sorted(m for m in %r if m in sys.modules)
names = dir(wb)
ns = {}
exec("from workbench import *", ns)
print(json.dumps({"loaded": loaded, "all": wb.__all__,
                  "missing_dir": [n for n in wb.__all__ if n not in names],
                  "missing_star": [n for n in wb.__all__ if n not in ns],
                  "after": sorted(m for m in %r if m in sys.modules)}))
""" % (LAZY, LAZY)


def test_import_loads_the_upper_layers_on_first_use_only():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["loaded"] == [], f"`import workbench` imported {got['loaded']} eagerly"
    assert got["missing_dir"] == [] and got["missing_star"] == []
    assert got["after"] == sorted(LAZY)          # `import *` resolved every lazy name


def test_lazy_names_are_the_subpackages():
    import importlib

    import workbench as wb
    for name in LAZY:
        short = name.split(".")[1]
        assert getattr(wb, short) is importlib.import_module(name)
    assert callable(wb.compile)                  # the callable package, not builtins.compile
    assert set(wb.__all__) <= set(dir(wb))
    with pytest.raises(AttributeError, match="no_such_name"):
        wb.no_such_name
