"""The pure core's import rule (docs/architecture.md "The pure core"): the allocation, tree, advantage,
loss and gauge modules import only the standard library, numpy, torch and each other, never Lightning,
Hydra, torch.distributed or a generation engine. The list of pure-core files is the Makefile's
PURE_CORE (mypy --strict runs on exactly these)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
FORBIDDEN = ("lightning", "hydra", "omegaconf", "transformers", "peft", "vllm", "mlflow", "torchmetrics")


def pure_core() -> list[str]:
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    files = re.search(r"^PURE_CORE := (.+)$", text, re.M).group(1).split()
    return [f.removesuffix(".py").replace("/", ".") for f in files]


def imported_names(path: Path) -> set[str]:
    """Every module an `import` or `from ... import` names, at any depth (function-level included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def violations(modules: list[str]) -> list[tuple[str, str]]:
    allowed = set(modules)
    bad = []
    for module in modules:
        for name in imported_names(ROOT / (module.replace(".", "/") + ".py")):
            top = name.split(".")[0]
            inside = name.startswith("trace_lightning.") and name not in allowed
            if top in FORBIDDEN or name.startswith("torch.distributed") or inside:
                bad.append((module, name))
    return bad


def test_the_pure_core_imports_only_numpy_torch_and_itself():
    modules = pure_core()
    assert "trace_lightning.allocation" in modules and "trace_lightning.tree" in modules
    assert violations(modules) == []


def test_the_rule_catches_a_pure_module_that_pulls_in_lightning(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg/a.py").write_text("import numpy\nfrom pkg import b\n")
    (tmp_path / "pkg/b.py").write_text("def f():\n    import lightning.pytorch as L\n")
    (tmp_path / "pkg/c.py").write_text(
        "from torch.distributed import all_reduce\nfrom trace_lightning.data import X\n"
    )
    assert violations(["pkg.a", "pkg.b"]) == [("pkg.b", "lightning.pytorch")]
    assert sorted(violations(["pkg.c"])) == [
        ("pkg.c", "torch.distributed"),
        ("pkg.c", "trace_lightning.data"),
    ]


@pytest.mark.parametrize("module", pure_core())
def test_importing_a_pure_module_loads_none_of_the_heavy_stack(module):
    code = f"import sys, {module}; print(sorted({{m.split('.')[0] for m in sys.modules}}))"
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert not set(FORBIDDEN) & set(ast.literal_eval(loaded.stdout))


def test_every_package_folder_is_installed():
    """A wheel holds only the packages pyproject names; a new subpackage left out imports from the
    checkout but not from an install (Docker, `pip install .`)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    inits = (ROOT / "trace_lightning").rglob("__init__.py")
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in inits}
    # conf/ ships as trace_lightning.conf: a group folder it does not list is left out of the wheel
    found |= {"trace_lightning.conf"} | {
        f"trace_lightning.conf.{d.name}" for d in (ROOT / "conf").iterdir() if d.is_dir()
    }
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages in pyproject.toml"


def _package_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at any depth (function-level imports included, the
    kind that hides a circle). `from pkg import sub` names the submodule, not the package."""
    paths = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
        for p in (ROOT / "trace_lightning").rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                names = [s for s in subs if s in paths] or [node.module]
            for name in names:
                while name and name not in paths:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    found.add(name)
        graph[module] = found
    return graph


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Modules that reach themselves, grouped by the set they reach each other through."""
    reach = {m: set(deps) for m, deps in graph.items()}
    changed = True
    while changed:  # transitive closure; ~80 modules
        changed = False
        for m, seen in reach.items():
            grown = seen.union(*(reach.get(d, set()) for d in seen))
            if grown != seen:
                reach[m], changed = grown, True
    both_ways = {m: {d for d in reach[m] if m in reach.get(d, set())} for m in reach if m in reach[m]}
    loops = {frozenset({m} | others) for m, others in both_ways.items()}
    return [set(loop) for loop in loops]


def test_the_package_has_no_import_circle():
    """A package move once opened two (checkpoints <-> checkpoint_shards, trainer <-> warmstart) that
    function-level imports hid; a new one, hidden or not, fails here naming its modules."""
    assert _circles(_package_graph()) == []


def test_the_circle_check_finds_a_hidden_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}  # d only reaches the circle
    assert _circles(graph) == [{"a", "b", "c"}]
