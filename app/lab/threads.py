"""The forward's threads on a busy machine: free to run anywhere, or bound a CPU each (--bind-threads)."""
from __future__ import annotations

import subprocess
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from .lab import Lab, decode_steps, median, r
from .result import LabResult, Series, said

RUNS = 3  # per setting: the median run is drawn and tabled (one run's speed on a shared machine is noisy)


@contextmanager
def busy_core():
    """Another program busy on one core while the block runs: a process that spins, ended after it."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # until it spins
        yield
    finally:
        spinner.kill()
        spinner.wait()


def bound_threads() -> int | None:
    """How many of this process's threads may run on one CPU only (None where /proc cannot say): the
    forward's team after --bind-threads, else none."""
    try:
        return sum(status.read_text().split("Cpus_allowed_list:")[1].split()[0].isdigit()
                   for status in Path("/proc/self/task").glob("*/status"))
    except (OSError, IndexError):
        return None


def threads(lab: Lab, prompt: str) -> LabResult:
    num_prompt, num_gen = lab.size((96, 24), (256, 64))
    ids = lab.tokens(prompt, num_prompt)
    free, bound = (lab.variant(prefix_caching=False, bind_threads=on) for on in (False, True))
    settings = [("lab.set.idle_free", free, False), ("lab.set.busy_free", free, True),
                ("lab.set.busy_bound", bound, True), ("lab.set.idle_bound", bound, False)]
    series, rows, tokens = [], [], {}
    try:
        for name, e, busy in settings:
            lab.step(said("lab.step.prefill_decode", setting=name, prompt=num_prompt, new=num_gen))
            lab.run(e, ids[:16], 2)  # its threads bound or freed, and awake
            with busy_core() if busy else nullcontext():
                runs = [lab.run(e, ids, num_gen) for _ in range(RUNS)]
                pinned = bound_threads()
            runs.sort(key=lambda run: run[1][-1].metrics.ttft_ms)
            request, events = runs[len(runs) // 2]
            tokens[name] = request.generated_ids
            steps = decode_steps(events)
            series.append(Series(said("lab.series", setting=name, what="lab.w.decode"), [s.step for s in steps],
                                 [r(s.forward_ms, 2) for s in steps]))
            rows.append({"lab.col.setting": name, "lab.col.ttft_ms": r(events[-1].metrics.ttft_ms),
                         "lab.col.decode_tps": r(median(run[1][-1].metrics.decode_tokens_per_s or 0 for run in runs)),
                         "lab.col.slowest_step_ms": r(max(s.forward_ms for s in steps), 1),
                         "lab.col.threads_bound": pinned,
                         "lab.col.same_tokens": tokens[name] == tokens["lab.set.idle_free"]})
    finally:  # the threads as the engine's own switch has them, not as the last run left them
        lab.engine.runner.fused.bind_threads(lab.engine.config.bind_threads)
    idle, busy_free, busy_bound, idle_bound = rows
    explanation = said("lab.threads.explain", threads=torch.get_num_threads(), idle_ttft=idle["lab.col.ttft_ms"],
                       idle_tps=idle["lab.col.decode_tps"], free_ttft=busy_free["lab.col.ttft_ms"],
                       free_tps=busy_free["lab.col.decode_tps"], bound_ttft=busy_bound["lab.col.ttft_ms"],
                       bound_tps=busy_bound["lab.col.decode_tps"], idle_bound_ttft=idle_bound["lab.col.ttft_ms"],
                       idle_bound_tps=idle_bound["lab.col.decode_tps"])
    timed = {"lab.threads.busy_slows_free": busy_free["lab.col.ttft_ms"] > idle["lab.col.ttft_ms"],
             "lab.threads.bound_faster_busy": busy_bound["lab.col.ttft_ms"] < busy_free["lab.col.ttft_ms"]
             and busy_bound["lab.col.decode_tps"] > busy_free["lab.col.decode_tps"]}
    effects = {**timed, "lab.threads.same_tokens": all(row["lab.col.same_tokens"] for row in rows),
               "lab.threads.bound": (busy_bound["lab.col.threads_bound"] or 0) >= torch.get_num_threads()
               > (busy_free["lab.col.threads_bound"] or 0)}
    return LabResult("threads", "lab.threads.title", prompt,
                     {"prompt_tokens": num_prompt, "new_tokens": num_gen, "runs": RUNS,
                      "forward_threads": torch.get_num_threads()},
                     "lab.w.token", "lab.w.ms_per_token", series, rows, explanation, effects, timed=list(timed))

