"""Import floors: trainer.py and warmstart.py are in no import circle, counting the
imports hidden inside functions, which Python resolves only when the function runs."""

import ast
from pathlib import Path

import trace_lightning

PACKAGE = Path(trace_lightning.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its body (top level or inside functions)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            found |= {t for t in targets if t in modules and t != name}
        graph[name] = found
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_walk_finds_a_circle_hidden_in_a_function():
    """The oracle can fail: a circle made of one top-level and one function-level import is found."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert circles(graph) == [{"a", "b"}]


def test_trainer_and_warmstart_are_in_no_import_circle():
    graph = import_graph()
    assert "trace_lightning.warmstart" in graph["trace_lightning.trainer"]  # the trainer builds on it
    assert "trace_lightning.trainer" not in graph["trace_lightning.warmstart"]
    mine = {"trace_lightning.trainer", "trace_lightning.warmstart", "trace_lightning.evaluate"}
    assert not [c for c in circles(graph) if c & mine]
