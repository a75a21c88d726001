"""How busy the rest of the machine was while a bench or Lab run measured (app/bench/load.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.bench.load import LoadMeter

SPIN = [sys.executable, "-c", "while True: pass"]
pytestmark = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="no /proc: nothing is said")


def test_a_program_outside_the_run_counts_and_one_it_started_does_not():
    """A spinning program this process did not start shows as about a core of others' time; one it started
    (the Lab's busy program, llama-bench) is the run's own, alive or ended."""
    meter = LoadMeter()
    child = subprocess.Popen(SPIN)
    time.sleep(1.0)
    child.kill()
    child.wait()
    own = meter.since()["others_cores"]
    # started through a shell that exits at once: the spinner is no descendant of this process
    pid = int(subprocess.run(["sh", "-c", f"{' '.join(SPIN[:2])} 'while True: pass' >/dev/null 2>&1 & echo $!"],
                             capture_output=True, text=True, check=True).stdout)
    try:
        meter = LoadMeter()
        time.sleep(1.0)
        outside = meter.since()
    finally:
        os.kill(pid, signal.SIGKILL)
    assert outside["others_cores"] - own >= 0.5, (outside, own)  # whatever else this machine runs, in both
    assert outside["steal_cores"] >= 0
