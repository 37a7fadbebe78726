"""The wheel holds every package of the source tree and every config group folder (pyproject lists them by
hand: a folder it does not list is left out of the wheel, with a setuptools warning at install)."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "trace_lightning").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    groups = {f"trace_lightning.conf.{d.name}" for d in (ROOT / "conf").iterdir() if d.is_dir()}
    found |= {"trace_lightning.conf"} | {g for g in groups if not g.endswith("__pycache__")}
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"
