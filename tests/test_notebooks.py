"""The notebooks run top to bottom, offline, in a fresh kernel (about 15-20 s each on 2 cores).

Each runs with an empty working directory and TMPDIR pointed into this test's temp folder, so the test
also checks that a notebook writes nothing outside the temporary folder it creates for itself.
"""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
TIMEOUT_S = 120  # per cell; the slowest cell trains two tiny runs in about 10 s


@pytest.mark.parametrize("name", ["quickstart.ipynb", "compare.ipynb"])
def test_notebook_runs(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))  # the kernel inherits it: the notebook's mkdtemp lands here
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = NotebookClient(
        nb, timeout=TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails
    errors = [
        o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs if o.output_type == "error"
    ]
    assert not errors
    assert list(cwd.iterdir()) == []
    # one workdir from tempfile.mkdtemp, kept for the user (torch may add its own cache folder beside it)
    assert len(list(tmp.glob("trace_*"))) == 1
