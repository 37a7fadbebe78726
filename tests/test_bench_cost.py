"""Quick mode of the cost-profile benchmark, so that the script cannot rot.

Each runs the real script in a subprocess (as the documented commands do) and checks invariants of what it
measured, never the measured numbers themselves.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("generation", "env", "predictor", "allocation", "old_logprobs", "training", "sync")


def run_script(script: str, *args: str, timeout: int = 300) -> str:
    proc = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return proc.stdout


def test_cost_profile_quick_mode(tmp_path):
    out, png = tmp_path / "cost.json", tmp_path / "cost.png"
    stdout = run_script("cost_profile.py", "--quick", "--out", str(out), "--plot", str(png))
    assert "alloc+pred" in stdout and ("PASS" in stdout or "MISS" in stdout)
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {r["sweep"] for r in rows} == {"budget", "expansion", "turns"}
    assert png.stat().st_size > 0
    for r in rows:
        # every named phase was measured, none is negative, and with `other` they are the whole iteration
        assert set(r["seconds"]) == {*PHASES, "other"}
        assert all(r["seconds"][p] >= 0 for p in PHASES)
        assert r["seconds"]["other"] >= -1e-6  # named phases never add up to more than the wall time
        assert math.isclose(sum(r["shares"].values()), 1.0, rel_tol=1e-6)
        assert r["phase_overlaps"] == 0  # no phase was timed inside another
        assert r["seconds"]["generation"] > 0 and r["seconds"]["training"] > 0
        assert r["seconds"]["predictor"] > 0 and r["seconds"]["allocation"] > 0
        assert all(n == 1 for n in r["sync_calls"])  # one weight sync per iteration, after training
        assert r["leaves_per_iteration"] == [r["leaves"]] * r["iterations"]
        assert r["prefill_tokens"] > 0 and r["tool_calls"] == 0  # budget units; chain has no tool
        assert r["bare_rollouts"] * (1 + r["expansion"]) == r["leaves"]
        assert r["target_met"] == (r["alloc_plus_predictor_share"] < 0.05)
