"""The MLflow UI in a real browser: a tiny `debug=fast` training, `mlflow ui` on
127.0.0.1, and headless Chromium on the link the trainer prints. The page must open in the Model
training view and show a logged metric, a parameter and the tree PNGs.

About a minute on 2 shared cores (most of it `mlflow ui` starting), so it is marked `slow` and
`browser`; `make test-browser` runs it (CI installs Debian's `chromium` first).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.browser]
CHROMIUM = shutil.which("chromium")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(output root, the run-page link the trainer printed) for one tiny `debug=fast` run."""
    out = tmp_path_factory.mktemp("ui_run")
    proc = subprocess.run(
        [sys.executable, "-m", "trace_lightning.trainer", "debug=fast", f"output_root={out}"],
        capture_output=True,
        text=True,
        timeout=600,
        env=ENV,
        cwd=out,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    links = re.findall(r"http://127\.0\.0\.1:5000/(\S+)", proc.stdout)
    assert links, proc.stdout[-2000:]
    return out, links[-1]


@pytest.fixture(scope="module")
def ui(trained: tuple[Path, str]) -> Iterator[str]:
    """`mlflow ui --workers 1` over the run's store, on a free local port; yields its base URL."""
    out, _ = trained
    port = free_port()
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", f"sqlite:///{out}/mlflow.db"]
    proc = subprocess.Popen(
        [*cmd, "--workers", "1", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=ENV,
        start_new_session=True,  # its server workers share the group, so one signal ends them all
    )
    base = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.time() + 180
        while True:
            try:
                urllib.request.urlopen(base, timeout=5)
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, "mlflow ui did not start"
                time.sleep(1)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def browse(url: str, screenshot: Path | None = None) -> str:
    """The page's DOM after 15 s of virtual time in headless Chromium (flags from ENV_NOTES.md)."""
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1400,900"]
    cmd += ["--virtual-time-budget=15000", "--dump-dom"]
    if screenshot is not None:
        cmd.append(f"--screenshot={screenshot}")
    proc = subprocess.run([*cmd, url], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_the_printed_link_opens_the_run_in_the_model_training_view(ui, trained, tmp_path):
    _, link = trained
    shot = tmp_path / "run.png"
    dom = browse(ui + link, screenshot=shot)
    assert shot.read_bytes()[:8] == PNG_MAGIC
    assert "rollout/success_rate" in dom and "train/loss" in dom  # logged metrics
    assert "budget.leaves" in dom  # a logged parameter
    assert "Model training" in dom and "workflowType=machine_learning" in dom
    assert "Evaluation runs" not in dom and "workflowType=genai" not in dom  # not the GenAI view


def test_the_run_page_shows_the_tree_pngs(ui, trained):
    _, link = trained
    page, query = link.split("?")
    dom = browse(f"{ui}{page}/artifacts/trees/iteration_0001.png?{query}")
    assert re.search(r'<img alt="trees/iteration_0001\.png" src="blob:', dom)  # the PNG, loaded
    assert "iteration_0000.png" in dom  # the first iteration's drawing is listed beside it
