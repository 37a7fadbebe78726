"""Tests that need an opt-in resource say so: `make test` must pass on a machine that
installed nothing opt-in, and a test that reaches for the Gemma chunks, vLLM or Chromium without its
marker would fail there while a developer's machine stays green."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import conftest
import pytest
import test_trainer
from helpers import optin
from helpers.optin import OPT_IN

TESTS = Path(__file__).parent


def _marks(decorators: list[ast.expr]) -> set[str]:
    """Marker names in decorators or a `pytestmark` value: `pytest.mark.vllm` -> {"vllm"}."""
    names = set()
    for node in decorators:
        for sub in ast.walk(node):
            mark = isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Attribute)
            if mark and sub.value.attr == "mark":
                names.add(sub.attr)
    return names


def _module_marks(tree: ast.Module) -> set[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            return _marks([node.value])
    return set()


def _inside_raises(func: ast.AST, source: str, trigger: str) -> bool:
    """Every occurrence of `trigger` in `func` sits in a `with pytest.raises(...)` block (a test of the
    error a user sees without the resource)."""
    blocks = [
        ast.get_source_segment(source, node) or ""
        for node in ast.walk(func)
        if isinstance(node, ast.With)
        and any("raises" in (ast.get_source_segment(source, i.context_expr) or "") for i in node.items)
    ]
    inside = sum(b.count(trigger) for b in blocks)
    return (ast.get_source_segment(source, func) or "").count(trigger) == inside


def unguarded(source: str) -> list[tuple[str, str]]:
    """(function, resource) pairs where a test or fixture reaches for an opt-in resource with no guard:
    no marker on it or its module, no fake fixture, no explicit `pytest.skip`, not inside pytest.raises."""
    tree = ast.parse(source)
    module_marks = _module_marks(tree)
    found = []
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef):
            continue
        text = ast.get_source_segment(source, func) or ""
        for name, opt_in in OPT_IN.items():
            hits = [t for t in opt_in.triggers if t in text]
            if not hits or name in module_marks | _marks(func.decorator_list):
                continue
            if any(fake in text for fake in opt_in.fakes):
                continue
            if "pytest.skip(" in text or all(_inside_raises(func, source, t) for t in hits):
                continue
            found.append((func.name, name))
    return found


@pytest.mark.parametrize("path", sorted(TESTS.rglob("test_*.py")), ids=lambda p: p.name)
def test_every_test_that_needs_an_opt_in_resource_is_guarded(path):
    if path.name == Path(__file__).name:  # this file names the triggers on purpose
        return
    assert unguarded(path.read_text()) == [], (
        f"{path.name}: mark these tests with the resource's marker (tests/helpers/optin.py), e.g. "
        "@pytest.mark.gemma, so they skip where it is not installed"
    )


def test_the_guard_check_flags_an_unguarded_test_and_passes_guarded_ones():
    bare = "def test_x():\n    prepare_gemma3(None)\n"
    marked = "import pytest\n@pytest.mark.gemma\ndef test_x():\n    prepare_gemma3(None)\n"
    faked = "def test_x(fake_gemma):\n    prepare_gemma3(None)\n"
    patched = "def test_x(mp):\n    mp.setattr(m, 'GEMMA3_PARTS', ())\n    prepare_gemma3(None)\n"
    raises = "def test_x():\n    with pytest.raises(ValueError):\n        prepare_gemma3(None)\n"
    module = "import pytest\npytestmark = pytest.mark.vllm\ndef test_x():\n    import vllm\n"
    assert unguarded(bare) == [("test_x", "gemma")]
    for guarded in (marked, faked, patched, raises, module):
        assert unguarded(guarded) == []
    half = raises + "    prepare_gemma3(None)\n"  # one call outside the raises block
    assert unguarded(half) == [("test_x", "gemma")]


def test_every_config_option_that_builds_an_opt_in_model_is_marked_in_the_composition_test():
    """test_trainer instantiates every group option; an option whose target prepares an opt-in
    resource must carry that resource's marker there."""
    conf = test_trainer.CONF
    for group, option in test_trainer.GROUP_OPTIONS:
        text = (conf / group / f"{option}.yaml").read_text()
        for name, opt_in in OPT_IN.items():
            if any(f"_target_: {t}" in text for t in opt_in.config_targets):
                mark = test_trainer.OPT_IN_OPTIONS.get((group, option))
                assert mark is not None and mark.name == name, f"{group}={option} needs @pytest.mark.{name}"


def _item(marker: str | None) -> SimpleNamespace:
    return SimpleNamespace(get_closest_marker=lambda name: object() if name == marker else None)


def test_a_marked_test_skips_without_its_resource_and_fails_where_the_run_requires_it(monkeypatch):
    absent = optin.OptIn(lambda: False, "no such thing: run `make it`", ())
    monkeypatch.setitem(OPT_IN, "vllm", absent)
    monkeypatch.delenv("TRACE_REQUIRE", raising=False)
    with pytest.raises(pytest.skip.Exception, match="make it"):
        conftest.pytest_runtest_setup(_item("vllm"))
    conftest.pytest_runtest_setup(_item(None))  # unmarked tests are not touched
    monkeypatch.setenv("TRACE_REQUIRE", "browser,vllm")
    with pytest.raises(pytest.fail.Exception, match="required in this run"):
        conftest.pytest_runtest_setup(_item("vllm"))
    monkeypatch.setitem(OPT_IN, "vllm", optin.OptIn(lambda: True, "", ()))
    conftest.pytest_runtest_setup(_item("vllm"))  # present: runs
