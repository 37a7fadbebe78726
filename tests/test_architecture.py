"""The package's import rules (docs/architecture.md "The pure core" and "Rooms").

The pure core (the allocation, tree, advantage, loss and gauge modules) imports only the standard
library, numpy, torch and each other, never Lightning, Hydra, torch.distributed or a generation engine.
The list of pure-core files is the Makefile's PURE_CORE (mypy --strict runs on exactly these).

The import graph, read with `ast` from every module (absolute and relative imports, at any depth, so
an import inside a function counts): each subpackage folder (`envs/`, `engines/`, `checkpoints/`,
`predictor/`) is one room and each top-level module its own. Rooms import each other without a circle,
and so do modules; `envs/`, `engines/` and `checkpoints/` import nothing of the package outside
themselves (a user's environment, an engine or the checkpoint code can be read, tested and reused
alone); `predictor/` imports only the rooms named in PREDICTOR_MAY_IMPORT. Imports by string
(`importlib.import_module`, Hydra's `_target_`) are not in the graph.
"""

from __future__ import annotations

import ast
import itertools
import re
import subprocess
import sys
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
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


# ---------------------------------------------------------------------------------------- the rooms

PACKAGE = "trace_lightning"
STANDALONE = ("envs", "engines", "checkpoints")  # rooms that import nothing of the package but themselves
# What predictor/ imports today, and may: the tree and its backup, BetaPrior (allocation), the head's MSE
# (losses), right_pad (packing, which owns the rows) and the shared-prefix KV fan-out (engines/kv.py). All
# framework-free; packing and engines are not in the Makefile's PURE_CORE, but neither imports Lightning or
# Hydra (packing imports only torch and the tree), and the graph holds none of the orchestration
# (collector, data, module, trainer) under them.
PREDICTOR_MAY_IMPORT = {"tree", "allocation", "losses", "packing", "engines"}


@dataclass(frozen=True)
class Edge:
    """`source` imports `target` (both module names) at `source`'s line `line`."""

    source: str
    target: str
    line: int

    def __str__(self) -> str:
        return f"{self.source}:{self.line} imports {self.target}"


def package_modules(root: Path, package: str) -> dict[str, Path]:
    """Module name -> file, for every module of `package` under `root` (a package is its __init__)."""
    out = {}
    for path in (root / package).rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(
    module: str, path: Path, node: ast.Import | ast.ImportFrom, known: dict[str, Path]
) -> list[str]:
    """The names one import statement brings in: `import a.b` names a.b; `from a import b` names the
    submodule a.b when there is one (else a); a relative import is resolved against `module`."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    source = node.module or ""
    if node.level:  # `from . import x` in pkg/envs/check.py is pkg.envs.x; `from .. import x`, pkg.x
        here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = here[: len(here) - node.level + 1]
        source = ".".join([*base, source] if source else base)
    subs = [f"{source}.{a.name}" for a in node.names]
    return [s for s in subs if s in known] or [source]


def import_edges(root: Path, package: str = PACKAGE) -> list[Edge]:
    """Every import of a package module by another, at any depth of the importing file."""
    known = package_modules(root, package)
    edges = []
    for module, path in sorted(known.items()):
        statements = ast.walk(ast.parse(path.read_text(), str(path)))  # every depth: functions too
        for node in (n for n in statements if isinstance(n, ast.Import | ast.ImportFrom)):
            for name in _imported(module, path, node, known):
                while name and name not in known:  # `a.b.SomeClass` -> module a.b
                    name = name.rpartition(".")[0]
                if name and name != module:
                    edges.append(Edge(module, name, node.lineno))
    return edges


def room(module: str) -> str:
    """`pkg.envs.tools` -> "envs" (a folder is one room), `pkg.runner` -> "runner", `pkg` -> "pkg"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def room_edges(edges: list[Edge]) -> dict[str, dict[str, list[Edge]]]:
    """Room -> the rooms it imports -> the module imports that make each such edge."""
    out: dict[str, dict[str, list[Edge]]] = {}
    for e in edges:
        if room(e.source) != room(e.target):
            out.setdefault(room(e.source), {}).setdefault(room(e.target), []).append(e)
    return out


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """One cycle of `graph` as its path, first node repeated at the end (["a", "b", "a"]), or []."""
    state: dict[str, str] = {}  # "open" while on the depth-first path, "done" once fully explored
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def circle_report(cycle: list[str], edges: dict[str, dict[str, list[Edge]]]) -> str:
    """The cycle, and for each of its steps the imports that make it."""
    steps = [f"  {a} -> {b}: " + "; ".join(map(str, edges[a][b])) for a, b in itertools.pairwise(cycle)]
    return "import circle " + " -> ".join(cycle) + "\n" + "\n".join(steps)


def outside_imports(edges: list[Edge], inside: str, allowed: Collection[str] = ()) -> list[str]:
    """The imports by room `inside` of any other room not in `allowed`."""
    return [str(e) for e in edges if room(e.source) == inside and room(e.target) not in {inside, *allowed}]


EDGES = import_edges(ROOT)


def test_the_walk_sees_the_package():
    """The graph is not empty by accident: imports at the top, inside a function and by `from pkg import
    module` are all edges."""
    rooms = room_edges(EDGES)
    folders = {room(m) for m in package_modules(ROOT, PACKAGE)}
    assert {*STANDALONE, "predictor"} <= folders
    assert "model_folder" in rooms["trainer"]
    assert "config" in rooms["trainer"]  # `from trace_lightning import config`
    assert "envs" in rooms["runner"] and "tree" in rooms["predictor"]


def test_the_rooms_import_each_other_without_a_circle():
    rooms = room_edges(EDGES)
    cycle = find_cycle(rooms)
    assert not cycle, circle_report(cycle, rooms)


def test_the_modules_import_each_other_without_a_circle():
    """Inside a room too (a circle checkpoints.py <-> checkpoint_shards.py once hid behind a function-level
    import; so did trainer.py <-> warmstart.py)."""
    modules: dict[str, dict[str, list[Edge]]] = {}
    for e in EDGES:
        modules.setdefault(e.source, {}).setdefault(e.target, []).append(e)
    cycle = find_cycle(modules)
    assert not cycle, circle_report(cycle, modules)


@pytest.mark.parametrize("inside", STANDALONE)
def test_a_standalone_room_imports_nothing_of_the_package_outside_itself(inside):
    assert outside_imports(EDGES, inside) == []


def test_the_predictor_imports_only_the_core_it_names():
    assert outside_imports(EDGES, "predictor", PREDICTOR_MAY_IMPORT) == []


def test_the_rules_catch_a_circle_and_an_outside_import_hidden_in_a_function(tmp_path):
    """The checker can fail: a standalone room that imports the config inside a function, relatively,
    closes a circle through a top-level module that imports the room."""
    (tmp_path / "pkg/envs").mkdir(parents=True)
    (tmp_path / "pkg/__init__.py").write_text("")
    (tmp_path / "pkg/envs/__init__.py").write_text("from pkg.envs.base import Task\n")
    (tmp_path / "pkg/envs/base.py").write_text("Task = int\n")
    (tmp_path / "pkg/envs/check.py").write_text("def main():\n    from .. import config\n")
    (tmp_path / "pkg/config.py").write_text("import pkg.envs.base\n")
    edges = import_edges(tmp_path, "pkg")
    assert outside_imports(edges, "envs") == ["pkg.envs.check:2 imports pkg.config"]
    rooms = room_edges(edges)
    assert find_cycle(rooms) == ["config", "envs", "config"]
    assert "pkg.envs.check:2 imports pkg.config" in circle_report(find_cycle(rooms), rooms)
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
