"""How busy the machine was while something was measured: the CPU time programs outside the measurement took,
and the time the host took from this virtual machine (steal), each in cores on average. A figure measured
beside a busy program is the machine's as much as the engine's (`phasescope lab threads` shows by how much).
Linux's /proc; elsewhere nothing is said."""
from __future__ import annotations

import os
import time
from pathlib import Path

TICK_S = 1 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def _machine_ticks() -> tuple[int, int] | None:
    """All CPUs' busy time and steal time since boot, in ticks (the first line of /proc/stat)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return user + nice + system + irq + softirq, steal


def process_stat(stat: Path) -> tuple[str, list[str]] | None:
    """A process's name and the fields after it in its /proc/<pid>/stat (state first: user time is [11],
    system time [12], ended children's [13] and [14], in ticks); None once it has ended."""
    try:
        text = stat.read_text()
    except OSError:
        return None
    return text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()


def _process_ticks(pid: int) -> int:
    """The CPU time of a process and of all it started, in ticks: its own, its children's that ended and were
    waited for (llama-bench, a cold start's app, the Lab's busy program), and its live ones' (tensor-parallel
    ranks)."""
    if (found := process_stat(Path(f"/proc/{pid}/stat"))) is None:  # it ended meanwhile
        return 0
    children = []  # each thread's (a kernel without these files: the live children's time is not counted)
    for listed in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            children += listed.read_text().split()
        except OSError:  # the thread ended meanwhile
            pass
    return sum(int(v) for v in found[1][11:15]) + sum(_process_ticks(int(child)) for child in children)


class LoadMeter:
    """Started now; since() says how busy the rest of the machine was meanwhile."""

    def __init__(self) -> None:
        self._start = time.monotonic(), _machine_ticks(), _process_ticks(os.getpid())

    def since(self) -> dict[str, float]:
        """{"others_cores", "steal_cores"} over the time since the meter started; {} where /proc cannot say.
        Others are every process but this one and those it started (see _process_ticks)."""
        began, machine, ours = self._start
        now = _machine_ticks()
        seconds = time.monotonic() - began
        if machine is None or now is None or seconds <= 0:
            return {}
        busy, steal = (b - a for a, b in zip(machine, now))
        others = max(0, busy - (_process_ticks(os.getpid()) - ours))
        return {"others_cores": round(others * TICK_S / seconds, 2), "steal_cores": round(steal * TICK_S / seconds, 2)}
