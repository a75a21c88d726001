"""The benchmark's side measurements: hook and store costs, int8 quality, cold start, llama-bench."""
from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from engine import CHAT_REPETITION_PENALTY, CHAT_TOP_P, Engine, NotEnoughMemory, SamplingParams

from .browser import ROOT, start_app

T = TypeVar("T")

QUALITY_TEXTS = [
    "The capital of France is Paris, and the capital of Germany is Berlin. The KV cache stores keys and values.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "北京是中国的首都，也是一座历史悠久的城市。",
    "Once upon a time, in a small village by the sea, there lived an old fisherman.",
]


def hook_costs(engine: Engine, prompt: list[int], num_gen: int, repetitions: int, folder: Path) -> dict:
    """Decode tok/s with no hooks, with the UI's hooks (trace + JSON), and with those plus the history
    store writing to a real SQLite file; runs interleaved so that drift hits all three alike."""
    from ..history.recorder import make_recorder
    from ..history.store import Store
    from ..ui.session import ChatSession
    from ..ui.trace import ReplyTrace

    store = Store.open(folder / "bench-history.db")
    recorder = make_recorder(store, lambda: engine.info)
    sampling = SamplingParams(max_new_tokens=num_gen, temperature=0, ignore_eos=True)

    def ui_hooks():
        trace = ReplyTrace(turn=1)
        return [trace.add, lambda event: json.dumps(event.to_dict())]

    def store_hooks():
        session = ChatSession()
        trace = ReplyTrace(turn=1)
        return ui_hooks() + [recorder(session, [{"role": "user", "content": "bench"}], sampling, trace)]

    def measure(make_hooks) -> Callable[[], tuple[float, float]]:
        def run() -> tuple[float, float]:  # (decode tok/s, µs spent in the hooks per token)
            timed = _TimedHooks(make_hooks())
            *_, finished = engine.run(engine.new_request_from_ids(prompt, sampling), hooks=[timed])
            return finished.metrics.decode_tokens_per_s, timed.ns / 1e3 / num_gen
        return run

    configs = {"none": lambda: [], "hooks": ui_hooks, "hooks+store": store_hooks}
    rounds = max(repetitions, 5)  # the effect is ~1%: fewer rounds cannot tell it from run-to-run noise
    samples = interleaved({name: measure(make_hooks) for name, make_hooks in configs.items()}, rounds)
    speed = {name: statistics.median(tps for tps, _ in values) for name, values in samples.items()}
    hook_us = {name: statistics.median(us for _, us in values) for name, values in samples.items()}
    step_us = 1e6 / speed["none"]
    return {name: {"decode_tokens_per_s": round(speed[name], 2), "vs_none": round(speed[name] / speed["none"], 4),
                   "rounds": rounds, "hook_us_per_token": round(hook_us[name], 1),
                   "hook_share_of_step": round(hook_us[name] / step_us, 4)}
            for name in configs}


class ReadProbe:
    """This machine's memory read rate right now, with one thread and with all of torch's: one vectorized
    sum over 256 MB of fp32 (far larger than the caches), the most a step that streams its weights or its
    KV cache from memory can read. Measured beside what it bounds: a shared machine's rate moves with its
    neighbours (the Lab's roofline probe, app/lab/profile.py, reads it the same way once per machine, all
    threads)."""

    def __init__(self, megabytes: int = 256) -> None:
        self.buffer = torch.ones(megabytes << 18)  # 4 bytes each
        self.threads = sorted({1, torch.get_num_threads()})

    def gb_s(self, threads: int) -> float:
        """One sum with `threads` threads."""
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            start = time.perf_counter()
            self.buffer.sum()
            elapsed = time.perf_counter() - start
        finally:
            torch.set_num_threads(previous)
        return self.buffer.numel() * self.buffer.element_size() / elapsed / 1e9

    @staticmethod
    def labels(rates: dict[int, float]) -> dict[str, float]:
        """{threads: GB/s} as the reports write it: {"1 thread": .., "2 threads": ..}."""
        return {f"{k} thread{'s' if k > 1 else ''}": round(v, 1) for k, v in rates.items()}


def random_prompt(num_tokens: int, vocab: int, seed: int = 0) -> list[int]:
    """Random token ids (as llama-bench uses), the same for the same seed."""
    return torch.randint(100, vocab, (num_tokens,), generator=torch.Generator().manual_seed(seed)).tolist()


def interleaved(runs: dict[object, Callable[[], T]], rounds: int) -> dict[object, list[T]]:
    """Each run once per round, in turn, after a warm-up round left out, so that drift on a shared
    machine hits all of them alike; the results per run."""
    samples: dict[object, list[T]] = {name: [] for name in runs}
    for repetition in range(rounds + 1):
        for name, run in runs.items():
            result = run()
            if repetition > 0:
                samples[name].append(result)
    return samples


class _TimedHooks:
    """Calls hooks in order and adds up the time spent in them: their cost measured directly, which
    is steadier than a ratio of two noisy speeds."""

    def __init__(self, hooks: list) -> None:
        self.hooks, self.ns = hooks, 0

    def __call__(self, event) -> None:
        start = time.perf_counter_ns()
        for hook in self.hooks:
            hook(event)
        self.ns += time.perf_counter_ns() - start


def native_vs_ops(engine: Engine, prompt: list[int], num_gen: int, repetitions: int) -> dict:
    """Decode tok/s with the native decode step and with the PyTorch ops it replaces, same engine,
    interleaved (the step's gain, measured rather than claimed)."""
    sampling = SamplingParams(max_new_tokens=num_gen, temperature=0, ignore_eos=True)

    def native() -> float:
        *_, finished = engine.run(engine.new_request_from_ids(prompt, sampling))
        return finished.metrics.decode_tokens_per_s

    def ops() -> float:
        with engine.runner.pytorch_decode():
            return native()

    samples = interleaved({"native": native, "ops": ops}, repetitions)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    return {"native_tokens_per_s": round(medians["native"], 1), "ops_tokens_per_s": round(medians["ops"], 1),
            "speedup": round(medians["native"] / medians["ops"], 2)}


# name: (temperature, top-p, repetition penalty)
SAMPLING_RULES = {"greedy": (0.0, 1.0, 1.0), "temperature 0.7": (0.7, 1.0, 1.0),
                  "temperature 0.7, top-p 0.9": (0.7, 0.9, 1.0),
                  f"the chat's: temperature 0.7, top-p {CHAT_TOP_P:g}, repetition penalty {CHAT_REPETITION_PENALTY:g}":
                  (0.7, CHAT_TOP_P, CHAT_REPETITION_PENALTY)}


def sampling_cost(engine: Engine, prompt: list[int], num_gen: int, repetitions: int) -> dict:
    """TPOT under the chat's sampling rules (the page's default is temperature 0.7, top-p 0.9, repetition
    penalty 1.1) and its parts, and under greedy, same engine and prompt, interleaved: what choosing the
    token costs beside the forward, as each rule's ms per token over greedy's."""
    def tpot_ms(temperature: float, top_p: float, penalty: float) -> float:
        sampling = SamplingParams(max_new_tokens=num_gen, temperature=temperature, top_p=top_p, seed=1,
                                  repetition_penalty=penalty, ignore_eos=True)
        *_, finished = engine.run(engine.new_request_from_ids(prompt, sampling))
        return finished.metrics.tpot_ms

    samples = interleaved({name: (lambda rule=rule: tpot_ms(*rule)) for name, rule in SAMPLING_RULES.items()},
                          repetitions)
    tpot = {name: statistics.median(values) for name, values in samples.items()}
    return {name: {"tpot_ms": round(ms, 2), "over_greedy_ms": round(ms - tpot["greedy"], 2)}
            for name, ms in tpot.items()}


@torch.inference_mode()
def decode_logits(runner, tokenizer, keep: bool = False) -> list[torch.Tensor]:
    """The runner's logits at every position of QUALITY_TEXTS, one decode step each. keep: remember them
    while the runner lives (the bench compares fp16, int8 and FBGEMM's int8 with the same fp32)."""
    if keep and runner in _KEPT_LOGITS:
        return _KEPT_LOGITS[runner]
    logits = []
    for text in QUALITY_TEXTS:
        ids = torch.tensor(tokenizer(text)["input_ids"])
        cache = runner.new_cache(len(ids) + 1)
        logits += [runner.forward(ids[pos:pos + 1], pos, cache) for pos in range(len(ids))]
    if keep:
        _KEPT_LOGITS[runner] = logits
    return logits


_KEPT_LOGITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # runner -> its decode_logits


def quality_vs(reference, other, tokenizer) -> dict:
    """Top-1 agreement of a mode (int8, fp16...) with the reference (fp32) on every position of a fixed
    text set (one decode step each), the mean KL divergence of its next-token distribution from
    fp32's (nats; steadier than agreement on a small set), and the largest difference of any logit."""
    return _agreement(zip(decode_logits(reference, tokenizer, keep=True), decode_logits(other, tokenizer)))


def _agreement(pairs) -> dict:
    """Top-1 agreement, mean KL divergence (nats) of b's next-token distribution from a's, and the
    largest logit difference, over (a, b) pairs of logits."""
    agree = total = 0
    max_diff = kl_sum = 0.0
    for a, b in pairs:
        agree += int(a.argmax() == b.argmax())
        total += 1
        max_diff = max(max_diff, float((a - b).abs().max()))
        kl_sum += float(torch.nn.functional.kl_div(b.float().log_softmax(-1), a.float().log_softmax(-1),
                                                   log_target=True, reduction="sum"))
    return {"top1_agreement": round(agree / total, 4), "positions": total,
            "mean_kl_nats": round(kl_sum / total, 4), "max_logit_diff": round(max_diff, 3)}


def bare_loop(runner, prompt: list[int], num_gen: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of the runner's forwards called directly, greedy, without the
    engine: the prompt, then num_gen - 1 decode steps."""
    cache = runner.new_cache(len(prompt) + num_gen)
    start = time.perf_counter()
    logits = runner.forward(torch.tensor(prompt), 0, cache)
    prefilled = time.perf_counter()
    token = int(logits.argmax())
    for step in range(num_gen - 1):
        token = int(runner.decode([token], [len(prompt) + step], [cache])[0].argmax())
    end = time.perf_counter()
    return len(prompt) / (prefilled - start), (num_gen - 1) / (end - prefilled)


def decode_speed(runner, num_tokens: int = 32) -> float:
    """tok/s of num_tokens greedy decode steps after a one-token prompt, on a bare forward loop."""
    return bare_loop(runner, [1], num_tokens + 1)[1]


def precision_report(loaded, runner) -> dict:
    """What a precision costs and buys, measured here and now: its agreement with fp32 (quality_vs)
    and its decode speed against fp32's. For the app's precision switch; ~3 s for the bundled model."""
    from engine.models.hf_runner import make_runner

    speed = decode_speed(runner)
    if runner.precision == "fp32":
        return {"precision": "fp32", "decode_tokens_per_s": round(speed, 1)}
    try:
        reference = make_runner(loaded.model, "fp32")
    except NotEnoughMemory as exc:  # beside this precision's weights: its speed alone, and why
        return {"precision": runner.precision, "decode_tokens_per_s": round(speed, 1),
                "no_reference_gb": round(exc.needed_gb, 1)}
    report = quality_vs(reference, runner, loaded.tokenizer)
    reference_speed = decode_speed(reference)
    return {"precision": runner.precision, **report, "decode_tokens_per_s": round(speed, 1),
            "fp32_decode_tokens_per_s": round(reference_speed, 1), "decode_vs_fp32": round(speed / reference_speed, 2)}


@torch.inference_mode()
def prefill_quality(reference, other, tokenizer, stride: int = 1) -> dict:
    """quality_vs through prefill: every prefix of each text (every stride-th: each costs a prefill)
    prefilled in one pass (T > 1, prefill's kernels), its last logits against the reference's."""
    def pairs():
        for text in QUALITY_TEXTS:
            ids = torch.tensor(tokenizer(text)["input_ids"])
            for end in range(2, len(ids) + 1, stride):
                yield (reference.forward(ids[:end], 0, reference.new_cache(end)),
                       other.forward(ids[:end], 0, other.new_cache(end)))

    return _agreement(pairs())


def int8_prefill_report(reference, int8_runner, tokenizer, stride: int = 1) -> dict:
    """int8 prefill's quality through the native kernels and through FBGEMM (whose one activation scale
    per tensor spans every token of the prompt), and the weights int8 keeps: one copy, since FBGEMM's
    packed copy is only made where the native library is not built."""
    native = prefill_quality(reference, int8_runner, tokenizer, stride)
    with int8_runner.pytorch_decode():
        fbgemm = prefill_quality(reference, int8_runner, tokenizer, stride)
    return {"native": native, "FBGEMM": fbgemm, "weights_mb": round(int8_runner.weight_bytes / 1e6, 1),
            "fbgemm_copies_held": sum(linear._packed is not None for linear in int8_runner._linears())}


def fbgemm_quality(reference, int8_runner, tokenizer) -> dict:
    """int8 through FBGEMM, which quantizes activations per tensor rather than in blocks of 64 as the
    native kernels do (prefill and decode alike): what int8 gives where the native library is not built,
    and what prefill gave before it had a native kernel. Measured through the same positions."""
    with int8_runner.pytorch_decode():  # FBGEMM's linears, T = 1
        return quality_vs(reference, int8_runner, tokenizer)


COLD_START = textwrap.dedent("""
    import sys, time
    start = time.perf_counter()
    from engine import Engine, EngineConfig, SamplingParams
    imported = time.perf_counter()
    engine = Engine.from_config(EngineConfig(model=sys.argv[1] or None, precision=sys.argv[2]))
    loaded = time.perf_counter()
    request = engine.new_request_from_ids([1, 2, 3], SamplingParams(max_new_tokens=1))
    list(engine.run(request))
    done = time.perf_counter()
    print(f"{imported - start:.2f} {loaded - imported:.2f} {done - start:.2f}")
""")


def _last_line(stderr: str) -> str:
    """What a failed subprocess said last (its error), for the bench's report."""
    return stderr.strip().splitlines()[-1] if stderr.strip() else "failed"


def _generate_first_token_s(model: str | None, precision: str) -> float:
    """`phasescope generate` started as a user starts it: seconds until the first token is printed."""
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "app.cli", "generate", "--prompt", "Hi", "--max-new-tokens", "1",
                                "--precision", precision, *(["--model", model] if model else [])],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    first = process.stdout.read(1)
    seconds = time.perf_counter() - start
    _, err = process.communicate(timeout=300)
    if process.returncode != 0 or not first:
        raise RuntimeError(_last_line(err))
    return seconds


def cold_start_s(model: str | None, precision: str, runs: int = 3) -> dict:
    """From the converted cache, each a fresh process: `phasescope generate` until its first token is
    printed (the median of runs: one start varies by a few tenths of a second with the machine's load),
    and one start through the engine's API split into imports and model load."""
    try:
        starts = [_generate_first_token_s(model, precision) for _ in range(runs)]
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return {"error": str(exc)}
    out = subprocess.run([sys.executable, "-c", COLD_START, model or "", precision], capture_output=True,
                         text=True, timeout=300)
    if out.returncode != 0:
        return {"error": _last_line(out.stderr)}
    imports, load, total = (float(v) for v in out.stdout.split())
    return {"to_first_token_s": round(statistics.median(starts), 2), "runs_s": [round(s, 2) for s in starts],
            "imports_s": imports, "load_s": load, "engine_first_token_s": total, "precision": precision}


def app_ready_s(model: str | None, precision: str) -> dict:
    """`phasescope ui` started as a user starts it: seconds until its page answers, and until the model
    behind the page serves (the page comes first, see app.main.launch). Its history is a new file of its
    own, not the user's (which a newer PhaseScope may have written, and which a bench has no business
    opening); a start that fails is said in the report, as cold_start_s says its own."""
    with tempfile.TemporaryDirectory(prefix="phasescope-bench-") as folder:
        start = time.perf_counter()
        try:
            process, _ = start_app("--precision", precision, "--db", str(Path(folder) / "history.db"),
                                   *(["--model", model] if model else []))
        except RuntimeError as exc:
            return {"error": _last_line(str(exc))}
        page = time.perf_counter() - start
        try:
            while not any("decode: " in line for line in list(process.output)):  # the engine's line once it
                if process.poll() is not None:  # serves: "<model> on <device> (...)"
                    return {"error": f"the app ended: {_last_line(''.join(process.output))}"}
                time.sleep(0.005)
            served = time.perf_counter() - start
        finally:
            process.terminate()
            process.wait()
    return {"page_s": round(page, 2), "model_s": round(served, 2), "precision": precision}


LLAMA_BENCH_KEYS = {"n_prompt", "n_gen", "avg_ts", "stddev_ts"}  # what a row of `llama-bench -o json` gives


def llama_bench(path: str | None, gguf: str, pp: int, tg: int, repetitions: int, log,
                depths: tuple[int, ...] = (), more_pp: tuple[int, ...] = ()) -> list[tuple[str, str, list[float]]]:
    """llama.cpp's own benchmark on the same GGUF and thread count, when a llama-bench binary is at
    hand: (mode, test, tokens/s samples) for each of its tests (pp for pp and each of more_pp, tg, and
    pp+tg); with depths, also pp and tg after that many tokens in the cache (its -d)."""
    binary = path or shutil.which("llama-bench")
    if not binary or not str(gguf).endswith(".gguf"):
        log("  llama.cpp: llama-bench not found (give it with --llama-bench PATH); not compared")
        return []
    threads = str(torch.get_num_threads())

    def run(tests: list[str], name: str, timeout: int) -> list[dict] | None:
        """llama-bench's JSON rows for these tests on the GGUF, or None (said in the log) if it fails"""
        try:
            prompts = ",".join(map(str, (pp, *more_pp)))
            out = subprocess.run([binary, "-m", str(gguf), "-p", prompts, "-n", str(tg), *tests,
                                  "-r", str(repetitions), "-t", threads, "-o", "json"],
                                 capture_output=True, text=True, timeout=timeout)
        except OSError as exc:  # gone or unrunnable since the start: the rows measured so far still count
            log(f"  llama.cpp: {name} did not run: {exc}")
            return None
        if out.returncode != 0:
            log(f"  llama.cpp: {name} failed: {out.stderr.strip()[-300:]}")
            return None
        try:  # a list of rows, each with these keys; else not llama-bench, or one too old for -o json
            rows = json.loads(out.stdout)
            if all(isinstance(row, dict) and LLAMA_BENCH_KEYS <= row.keys() for row in rows):
                return rows
        except (ValueError, TypeError):
            pass
        log(f"  llama.cpp: {name} did not answer with llama-bench's JSON rows (is {binary} llama-bench?): "
            f"{out.stdout.strip()[:120]!r}")
        return None

    rows = run(["-pg", f"{pp},{tg}"], "llama-bench", 1800)
    if rows is None:
        return []
    if depths:
        deep = run(["-d", ",".join(map(str, depths))], "llama-bench -d", 3600)
        rows += [dict(row, depth=row.get("n_depth", 0)) for row in deep or []]
    results = []
    for row in rows:
        test = (f"pp{row['n_prompt']}+tg{row['n_gen']}" if row["n_prompt"] and row["n_gen"]
                else f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}")
        if "depth" in row:
            test += f" @ d{row['depth']}"  # as tables.depth_test names ours
        mode = f"{row.get('model_type', 'gguf')}, {threads} threads"
        results.append((mode, test, list(row.get("samples_ts") or [row["avg_ts"]])))
        log(f"  llama.cpp    {mode:<24} {test:<14} {row['avg_ts']:8.1f} ± {row['stddev_ts']:.1f} tok/s")
    return results
