import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_allocation_benchmark_quick_mode(tmp_path):
    out = tmp_path / "allocation.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/allocation.py", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "trace" in proc.stdout and "x uniform" in proc.stdout
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {r["predictor"] for r in rows} == {"oracle", "noisy", "learned"}
    assert len({r["allocator"] for r in rows}) == 7
    for r in rows:  # every allocator spent exactly the same leaves every iteration
        assert r["leaves_per_iter"] == result["config"]["leaves"]
        assert 0.0 <= r["effective_ratio"] <= 1.0
        assert 0.0 <= r["mixed_prompts_per_iter"] <= r["prompts_per_iter"]
