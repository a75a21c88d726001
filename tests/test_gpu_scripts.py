"""The GPU check scripts run here on the CPU (`--device cpu --layers 2`), as a session lent a GPU would
run them there: a GPU session is rare and its device time short, so a script that an engine change broke
must fail here first. Each section must run, and the tokens each path gives must be the eager ops'."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# whole scripts, 20-30 s each here: in `make sweep`, which .ci/run runs beside `make test`
pytestmark = pytest.mark.sweep
ROOT = Path(__file__).resolve().parents[1]


def run_script(name: str, out: Path, *args: str) -> dict:
    subprocess.run([sys.executable, f"scripts/{name}.py", "--device", "cpu", "--layers", "2", "--out", str(out),
                    *args], cwd=ROOT, check=True, capture_output=True, text=True, timeout=300)
    report = json.loads((out / f"{name}.json").read_text())
    assert "failed" not in report, report["failed"]
    return report


def test_gpu_check_runs_and_both_kinds_of_graph_give_the_eager_tokens(tmp_path):
    report = run_script("gpu_check", tmp_path, "--lean-only")
    greedy = {key: value for key, value in report.items() if key.startswith("fp32 greedy tokens")}
    assert len(greedy) == 2 and set(greedy.values()) == {"identical"}
    assert report["tg128 batch 1"]["lean, CUDA graphs"] > 0 and report["pp512"]["lean"] > 0


def test_gpu_variants_run_and_give_the_plain_loops_tokens(tmp_path):
    report = run_script("gpu_variants", tmp_path, "--only", "sdpa,gemv,gemv-fp32")
    assert report["fp32 greedy tokens, attention as sums + gemv vs PyTorch ops"] == "identical"
    for name in ("compiled, SDPA", "compiled, attention as sums + gemv"):
        figures = report[name]
        assert figures["token on the device, same tokens"] and figures["each read, same tokens"]
        assert figures["tg128 batch 1"] > 0 and figures["tg128 batch 1, token on the device, each read"] > 0
