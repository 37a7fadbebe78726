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
