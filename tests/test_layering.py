"""Layers point down (DESIGN.md): nothing under ``workbench/parallel`` or
``workbench/sim_mesh`` imports the models, the planner, the recipes or anything above
them; ``sim_mesh`` knows nothing of placements (no ``workbench.parallel``).

Every import statement of every module is read from its syntax tree (imports inside
functions included, relative ones resolved against the module's package), and so are
``importlib.import_module("...")`` calls with a literal name."""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

ABOVE_PARALLEL = ("workbench.models", "workbench.plan", "workbench.recipes",
                  "workbench.train", "workbench.cli", "workbench.exercises", "workbench.viz",
                  "workbench.__main__", "workbench.serve")
FORBIDDEN = {
    "parallel": ABOVE_PARALLEL,
    "sim_mesh": ABOVE_PARALLEL + ("workbench.parallel",),
}


def _module_name(path: pathlib.Path, root: pathlib.Path) -> tuple[str, str]:
    """(module name, its package) of a source file under ``root``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
        return ".".join(parts), ".".join(parts)
    return ".".join(parts), ".".join(parts[:-1])


def imported_names(source: str, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of everything ``source`` (a module of ``package``)
    imports: ``from a import b`` yields both ``a`` and ``a.b`` (b may be a submodule)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = package.split(".")
                base = pkg[:len(pkg) - node.level + 1]
                if node.level - 1 > len(pkg):
                    raise ValueError(f"line {node.lineno}: import above the top package")
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Call) and node.args and \
                isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in ("import_module", "__import__"):
                out.append((node.lineno, node.args[0].value))
    return out


def violations(layer: str) -> list[str]:
    bad = []
    for path in sorted((ROOT / "workbench" / layer).rglob("*.py")):
        _, package = _module_name(path, ROOT)
        for line, name in imported_names(path.read_text(), package):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[layer]):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return bad


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_lower_layers_import_nothing_above(layer):
    assert violations(layer) == []


def test_the_checker_sees_relative_lazy_and_dynamic_imports():
    # what tensor_parallel.py once did (a norm class from the Llama, inside a function),
    # and the other spellings: each must be found, resolved to its absolute name
    src = ("import torch\n"
           "def f():\n"
           "    from ...models.llama import RMSNorm\n"
           "    from ... import plan\n"
           "    import workbench.recipes.hybrid\n"
           "    importlib.import_module('workbench.train')\n"
           "from ..dist_tensor import DistTensor\n")
    names = {n for _, n in imported_names(src, "workbench.parallel.strategies")}
    assert {"workbench.models.llama", "workbench.plan", "workbench.recipes.hybrid",
            "workbench.train", "workbench.parallel.dist_tensor"} <= names
    assert "workbench.parallel.strategies.models" not in names
    hits = [n for n in names if any(n == f or n.startswith(f + ".")
                                    for f in FORBIDDEN["parallel"])]
    assert len(hits) >= 4


def test_the_models_say_their_norm_classes():
    """Tensor parallelism takes the norm classes from the model (models/split.py)."""
    from torch import nn

    from workbench.models import get_config
    from workbench.models.config import build_model
    from workbench.models.llama import RMSNorm
    llama = build_model(get_config("tiny"), seed=0)
    gpt = build_model(get_config("tiny").replace(arch="gpt"), seed=0)
    assert llama.norm_classes() == (RMSNorm,)
    assert gpt.norm_classes() == (nn.LayerNorm,)
    for model in (llama, gpt):     # every norm of the model is one of them
        kinds = {type(m) for m in model.modules() if "norm" in type(m).__name__.lower()}
        assert kinds and kinds <= set(model.norm_classes())
    from workbench.parallel.strategies.tensor_parallel import sequence_parallel_norms
    from workbench.sim_mesh.mesh import Mesh
    with pytest.raises(TypeError, match="norm_classes='RMSNorm'"):
        sequence_parallel_norms(llama, Mesh.grid(2, ["tp"]), "RMSNorm")
