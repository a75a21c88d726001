"""`phasescope bench`: prefill and decode speed of each engine mode, and of transformers' `generate`,
in one run on one machine, modelled on llama-bench: pp{N} (prefill N tokens), tg{N} (generate N
tokens), pp{N}+tg{M}; each the mean ± std over repetitions after a warm-up, in tokens/s.

Also measured: the cost of hooks and of the history store while generating (ratios within the run),
decode's achieved memory bandwidth and prefill's achieved FLOP/s, each mode's quality against fp32, and
the cold start from the converted-weights cache. llama.cpp's `llama-bench` is run on the same GGUF
when it is found on PATH or given with --llama-bench.
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine import Engine, EngineConfig, SamplingParams, load_model
from engine.config import PRECISION_DTYPES
from engine.kernels.fused import start_early
from engine.models.hf_runner import in_dtype, make_runner
from engine.models.llama import LeanLlama
from engine.models.loader import cache_root
from engine.tensor_parallel import split_plan

from .extras import (app_ready_s, cold_start_s, fbgemm_quality, hook_costs, int8_prefill_report, llama_bench,
                     native_vs_ops, quality_vs, random_prompt, sampling_cost)
from .decode_side import (at_depth, flash_decoding, kv_quality, kv_variants, long_text_ids, no_cache, prefill_at_depth,
                          speculation, teacher_forced, weights_quality)
from . import figures
from .load import LoadMeter
from .prefill_side import attention_impls, int8_prefill_vs_fbgemm, tensor_parallel_vs_one_rank
from .scheduler import concurrency, scheduler_cost, second_turn

BENCH_KV_MB = 1024  # each mode's KV pool: far more than any test here needs
# pp and tg prefill the same prompt again and again, as llama-bench does: measured whole, not taken from
# the prefix cache (the second-turn test switches it on to measure what it saves)


@dataclass
class Result:
    engine: str  # "phasescope", "transformers", "llama.cpp"
    mode: str  # e.g. "lean-llama int8"
    test: str  # "pp512", "tg128", "pp512+tg128"
    samples: list[float] = field(default_factory=list)  # tokens/s, one per repetition
    note: str = ""

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples) if self.samples else float("nan")

    @property
    def std(self) -> float:
        return statistics.stdev(self.samples) if len(self.samples) > 1 else 0.0


def tests_for(pp: int, tg: int) -> list[tuple[str, int, int]]:
    return [(f"pp{pp}", pp, 0), (f"tg{tg}", 0, tg), (f"pp{pp}+tg{tg}", pp, tg)]


def bench_prompt(num_tokens: int, vocab: int, bos: int | None) -> list[int]:
    """Random token ids, as llama-bench uses; tg starts from one token (BOS) like it does."""
    if num_tokens == 0:
        return [bos if bos is not None else 1]
    return random_prompt(num_tokens, vocab)


def engine_run(engine: Engine, prompt: list[int], num_gen: int, hooks=()) -> object:
    sampling = SamplingParams(max_new_tokens=max(num_gen, 1), temperature=0, ignore_eos=True)
    *_, finished = engine.run(engine.new_request_from_ids(prompt, sampling), hooks=hooks)
    return finished


def engine_tokens_per_s(engine: Engine, prompt: list[int], num_prompt: int, num_gen: int) -> float:
    m = engine_run(engine, prompt, num_gen).metrics
    if num_gen == 0:
        return m.prefill_tokens_per_s
    if num_prompt == 0:
        return m.decode_tokens_per_s
    return (num_prompt + num_gen) * 1000 / m.e2e_ms  # llama-bench's pp+tg: all tokens / total time


def hf_tokens_per_s(model: torch.nn.Module, prompt: list[int], num_prompt: int, num_gen: int) -> float:
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        start = time.perf_counter()
        if num_gen == 0:
            model(input_ids=ids)
        else:
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_gen,
                           min_new_tokens=num_gen, do_sample=False)
        elapsed = time.perf_counter() - start
    return (num_prompt + num_gen) / elapsed if num_prompt else num_gen / elapsed


def mode_engines(loaded, modes: list[str]) -> dict[str, Engine]:
    engines = {}
    for precision in modes:
        model = loaded.model
        if precision in ("fp16", "bf16"):
            model = in_dtype(loaded.model, getattr(torch, PRECISION_DTYPES[precision]))
        runner = make_runner(model, precision)
        engines[f"{runner.name} {runner.precision}"] = Engine(
            loaded, EngineConfig(precision=precision, kv_cache_mb=BENCH_KV_MB, prefix_caching=False), runner=runner)
    return engines


def run(model: str | None = None, device: str = "auto", modes: tuple[str, ...] = ("fp32", "int8"), pp: int = 512,
        tg: int = 128, repetitions: int = 3, baseline: bool = True, llama_bench_path: str | None = None,
        log=print, concurrency_levels: tuple[int, ...] = (1, 2, 4, 8), depths: tuple[int, ...] = (),
        tensor_parallel: int = 2, quick: bool = False, more_pp: tuple[int, ...] = ()) -> dict:
    """pp: the prompt of every measurement; more_pp: more prompt lengths for prefill alone (llama-bench's
    -p 512,2048), also at each depth with the fp32 cache. quick: a smoke run's shortcuts where a
    measurement's cost grows with its text (every 4th prefix for int8 prefill's quality, 96 tokens of the
    long text)."""
    load = LoadMeter()
    start_early(cache_root(), device, "auto")  # the native step compiles (once) while the model loads
    loaded = load_model(model, device=device, dtype="float32")
    if not LeanLlama.supports(loaded.model):  # its modes, switches and scheduler are the lean forward's
        raise ValueError(f"bench measures the lean forward of the Llama family; {loaded.name} "
                         f"({loaded.model.config.model_type}) runs on transformers' forward: measure its TTFT and "
                         "TPOT with `phasescope generate --json` or the page")
    if tensor_parallel > 1:
        split_plan(loaded.model.config, tensor_parallel)  # too many ranks for the heads: said now, not at the end
    engines = mode_engines(loaded, list(modes))
    vocab, bos = loaded.model.config.vocab_size, loaded.tokenizer.bos_token_id
    contenders = [("phasescope", name, lambda p, n, g, e=e: engine_tokens_per_s(e, p, n, g))
                  for name, e in engines.items()]
    if baseline:
        contenders.append(("transformers", f"eager generate {str(loaded.dtype).removeprefix('torch.')}",
                           lambda p, n, g: hf_tokens_per_s(loaded.model, p, n, g)))
    results = []
    for test, num_prompt, num_gen in tests_for(pp, tg) + [(f"pp{p}", p, 0) for p in more_pp]:
        prompt = bench_prompt(num_prompt, vocab, bos)
        for engine_name, mode, measure in contenders:
            measure(prompt, num_prompt, num_gen)  # warm-up, left out of the figures
            result = Result(engine_name, mode, test, [measure(prompt, num_prompt, num_gen) for _ in range(repetitions)])
            results.append(result)
            _log_result(log, result)
    results += _depths(engines, depths, pp, tg, repetitions, vocab, bos, log, more_pp)
    best_name = max(engines, key=lambda name: _mean(results, name, f"tg{tg}"))
    best = engines[best_name]
    _annotate(results, engines, tg)
    summary = {"machine": _machine(loaded), "model": loaded.name, "best_mode": best_name}
    with tempfile.TemporaryDirectory(prefix="phasescope-bench-") as folder:  # its history file goes with it
        summary["hooks"] = hook_costs(best, bench_prompt(0, vocab, bos), tg, repetitions, Path(folder))
    log(f"  hooks: {summary['hooks']}")
    summary["decode_paths"] = {name: e.info.decode_path for name, e in engines.items()}
    summary["native_decode_vs_pytorch_ops"] = {
        name: native_vs_ops(e, bench_prompt(0, vocab, bos), tg, repetitions)
        for name, e in engines.items() if getattr(e.runner, "fused", None) is not None}
    log(f"  native decode step vs PyTorch ops: {summary['native_decode_vs_pytorch_ops']}")
    summary["sampling"] = sampling_cost(best, bench_prompt(0, vocab, bos), tg, repetitions)
    log(f"  TPOT by sampling rule, {best_name}: {summary['sampling']}")
    if "lean-llama fp32" in engines:
        reference = engines["lean-llama fp32"].runner
        summary["quality_vs_fp32"] = {engine.runner.precision: quality_vs(reference, engine.runner, loaded.tokenizer)
                                      for name, engine in engines.items() if engine.runner is not reference}
        if "lean-llama int8" in engines and engines["lean-llama int8"].runner.fused is not None:
            summary["quality_vs_fp32"]["int8 via FBGEMM"] = fbgemm_quality(
                reference, engines["lean-llama int8"].runner, loaded.tokenizer)
        log(f"  quality vs fp32: {summary['quality_vs_fp32']}")
        if "lean-llama int8" in engines and engines["lean-llama int8"].runner.fused is not None:
            summary["int8_prefill_quality"] = int8_prefill_report(reference, engines["lean-llama int8"].runner,
                                                                  loaded.tokenizer, stride=4 if quick else 1)
            log(f"  int8 prefill (each prefix in one pass) vs fp32: {summary['int8_prefill_quality']}")
            summary["int8_prefill_vs_fbgemm"] = int8_prefill_vs_fbgemm(engines["lean-llama int8"], pp, vocab,
                                                                       rounds=1 if quick else 5)
            log(f"  int8 prefill pp{pp}, native vs FBGEMM, tok/s: {summary['int8_prefill_vs_fbgemm']}")
    if "lean-llama fp32" in engines and baseline:
        summary["fp32_greedy_equals_transformers"] = _same_greedy(engines["lean-llama fp32"], loaded, min(tg, 32))
    _scheduler(summary, engines, pp, tg, repetitions, concurrency_levels, vocab, log)
    _decode_side(summary, engines, pp, tg, repetitions, log, long_text_tokens=48 if quick else 3000, quick=quick)
    lengths = (pp // 2, pp) if pp < 256 else (256, 1024, 2048, 4096)  # --quick: a taste
    summary["prefill_attention"] = {name: attention_impls(e, lengths, vocab) for name, e in _native(engines).items()}
    log(f"  prefill attention, native vs sdpa vs eager: {summary['prefill_attention']}")
    if tensor_parallel > 1 and (loaded.device.type == "cpu" or torch.cuda.device_count() >= tensor_parallel):
        summary["tensor_parallel"] = tensor_parallel_vs_one_rank(loaded, pp, min(tg, 32), repetitions, tensor_parallel)
        log(f"  tensor parallel, fp32: {summary['tensor_parallel']}")
    summary["cold_start_s"] = cold_start_s(model, best.runner.precision, runs=1 if quick else 3)
    log(f"  cold start: {summary['cold_start_s']}")
    summary["app_ready_s"] = app_ready_s(model, best.runner.precision)
    log(f"  phasescope ui: {summary['app_ready_s']}")
    results += [Result("llama.cpp", mode, test, samples)
                for mode, test, samples in llama_bench(llama_bench_path, loaded.source, pp, tg, repetitions, log,
                                                       depths, more_pp)]
    summary["machine_load"] = load.since()  # outside the run; llama-bench's time is the run's
    return {"results": results, "summary": summary}


def depth_test(test: str, depth: int) -> str:
    return f"{test} @ d{depth}"


def _log_result(log, result: Result) -> None:
    log(f"  {result.engine:<12} {result.mode:<24} {result.test:<14} {result.mean:8.1f} ± {result.std:.1f} tok/s")


def _native(engines: dict[str, Engine]) -> dict[str, Engine]:
    """The modes whose decode is the native step (the PyTorch-ops modes are too slow to be worth the
    bench's time in the longer measurements)."""
    return {name: e for name, e in engines.items() if getattr(e.runner, "fused", None) is not None}


def _depths(engines: dict[str, Engine], depths: tuple[int, ...], pp: int, tg: int, repetitions: int, vocab: int,
            bos: int | None, log, more_pp: tuple[int, ...] = ()) -> list[Result]:
    """Prefill and decode after `depth` tokens already in the cache (llama-bench's -d), for each mode
    whose decode is native, with its KV cache in each format: how both phases slow as the context grows.
    The prompt lengths of more_pp: prefill alone, with the fp32 cache (the default)."""
    results = []
    for name, engine in _native(engines).items():
        for kv, variant in kv_variants(engine).items():
            for depth in depths:
                context = bench_prompt(depth, vocab, bos) if depth else []

                def prefill(num_prompt: int) -> list[float]:
                    prompts = [random_prompt(num_prompt, vocab, 1000 + i) for i in range(repetitions + 1)]
                    return prefill_at_depth(variant, context, prompts)[1:]

                tests = [(f"pp{pp}", lambda: prefill(pp)),
                         (f"tg{tg}", lambda: at_depth(variant, context or [bos or 1], tg, repetitions))]
                if kv == "KV fp32":
                    tests += [(f"pp{p}", lambda p=p: prefill(p)) for p in more_pp]
                for test, measure in tests:
                    result = Result("phasescope", f"{name}, {kv}", depth_test(test, depth), measure())
                    results.append(result)
                    _log_result(log, result)
    return results


def _decode_side(summary: dict, engines: dict[str, Engine], pp: int, tg: int, repetitions: int, log,
                 long_text_tokens: int, quick: bool = False) -> None:
    """Speculative decoding, decode without a KV cache, Flash Decoding and the KV formats (over the first
    long_text_tokens of the long text), for the native modes."""
    native = _native(engines)
    summary["speculative_prompt_lookup"] = {name: speculation(e, repetitions, tg) for name, e in native.items()}
    log(f"  speculative decoding (prompt lookup) vs plain: {summary['speculative_prompt_lookup']}")
    summary["no_kv_cache"] = {name: no_cache(e, pp) for name, e in native.items()}
    log(f"  a decode step without the KV cache vs with it: {summary['no_kv_cache']}")
    summary["flash_decoding"] = {name: flash_decoding(e, (256, 512) if quick else (4096, 8000), rounds=1 if quick else 5)
                                 for name, e in native.items()}
    log(f"  Flash Decoding (split KV) vs one task per KV group, decode step and its attention: "
        f"{summary['flash_decoding']}")
    ids = long_text_ids(next(iter(native.values())), long_text_tokens)
    plain, summary["kv_formats_quality"] = {}, {}
    for name, e in native.items():  # one mode's variants at a time: each brings its own KV pool
        variants = kv_variants(e, window=pp)
        plain[name] = teacher_forced(variants["KV fp32"], ids)[:2]  # the mode's weights with an fp32 cache
        summary["kv_formats_quality"][name] = kv_quality(variants, ids, plain[name])
    log(f"  KV formats and a {pp}-token window against an fp32 cache over a long text: "
        f"{summary['kv_formats_quality']}")
    if "lean-llama fp32" in plain:
        reference = plain["lean-llama fp32"]
        summary["weights_quality_long_text"] = {native[name].info.precision: weights_quality(reference, run)
                                                for name, run in plain.items() if name != "lean-llama fp32"}
        log(f"  weights against fp32 over the long text: {summary['weights_quality_long_text']}")


def _scheduler(summary: dict, engines: dict[str, Engine], pp: int, tg: int, repetitions: int,
               levels: tuple[int, ...], vocab: int, log) -> None:
    """Batching, prefix caching and the scheduler's own cost, for the modes whose decode is native (the
    PyTorch-ops modes batch too, but too slowly to be worth the bench's time)."""
    native = _native(engines)
    summary["scheduler_cost"] = {name: scheduler_cost(e, bench_prompt(pp, vocab, None), tg, repetitions)
                                 for name, e in native.items()}
    log(f"  scheduler vs a bare forward loop: {summary['scheduler_cost']}")
    if levels:
        summary["concurrency"] = {name: concurrency(e, list(levels), tg, repetitions, vocab)
                                  for name, e in native.items()}
        log(f"  concurrency: {summary['concurrency']}")
    summary["second_turn"] = {name: second_turn(e, pp, repetitions) for name, e in native.items()}
    log(f"  second turn after a {pp}-token first turn: {summary['second_turn']}")


def _mean(results: list[Result], mode: str, test: str) -> float:
    return next((r.mean for r in results if r.mode == mode and r.test == test), 0.0)


def _annotate(results: list[Result], engines: dict[str, Engine], tg: int) -> None:
    """Achieved decode bandwidth (weight bytes read per step / step time) and prefill FLOP/s."""
    for result in results:
        engine = engines.get(result.mode)
        runner = engine.runner if engine else None
        if runner is None or not hasattr(runner, "weight_bytes"):
            continue
        if result.test == f"tg{tg}":
            result.note = f"{runner.weight_bytes * result.mean / 1e9:.1f} GB/s of weights"
        elif result.test.startswith("pp") and result.test[2:].isdigit():  # pp512, and -p's other lengths
            num_prompt = int(result.test[2:])
            result.note = f"{engine.forward_flops(num_prompt, 0) * result.mean / num_prompt / 1e9:.0f} GFLOP/s"


def _same_greedy(engine: Engine, loaded, num_tokens: int) -> bool:
    prompt = loaded.tokenizer("The two phases of inference are")["input_ids"]
    request = engine.new_request_from_ids(prompt, SamplingParams(max_new_tokens=num_tokens, temperature=0,
                                                                 ignore_eos=True))
    list(engine.run(request))
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        expected = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens,
                                         min_new_tokens=num_tokens, do_sample=False)[0, len(prompt):].tolist()
    return expected == request.generated_ids


def _machine(loaded) -> str:
    import platform

    return f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, {loaded.device}"


# --- output -----------------------------------------------------------------------------------------

def _ratios(results: list[Result], result: Result) -> tuple[str, str]:
    def versus(engine: str) -> str:
        other = next((r for r in results if r.engine == engine and r.test == result.test), None)
        return f"{result.mean / other.mean:.2f}×" if other and other.mean > 0 and other is not result else ""

    return versus("transformers"), versus("llama.cpp")


CONCURRENCY_HEADER = ("| mode | requests | decode tok/s, all | vs 1 | TPOT ms | vs 1 | output tok/s "
                      "| same tokens as alone |")


def to_markdown(report: dict) -> str:
    results, summary = report["results"], report["summary"]
    lines = ["| engine | mode | test | tokens/s | vs transformers | vs llama.cpp | achieved |",
             "|---|---|---|---:|---:|---:|---|"]
    for r in results:
        vs_hf, vs_llama = _ratios(results, r)
        lines.append(f"| {r.engine} | {r.mode} | {r.test} | {r.mean:.1f} ± {r.std:.1f} | {vs_hf} | {vs_llama} | "
                     f"{r.note} |")
    lines.append("")
    if summary.get("concurrency"):
        lines += [CONCURRENCY_HEADER, "|---|---:|---:|---:|---:|---:|---:|---|"]
        for mode, levels in summary["concurrency"].items():
            lines += [f"| {mode} | {b} | {v['decode_tokens_per_s']} | {v['decode_vs_1']}× | {v['tpot_ms']} | "
                      f"{v['tpot_vs_1']}× | {v['output_tokens_per_s']} | "
                      f"{'yes' if v['same_tokens_as_alone'] else 'NO'} |" for b, v in levels.items()]
        lines.append("")
    lines += figures.to_markdown(report)
    lines.append(f"machine: {summary['machine']}; model: {summary['model']}; best mode: {summary['best_mode']}")
    if load := summary.get("machine_load"):
        lines.append(f"while it ran, programs outside it used {load['others_cores']} cores on average, and the host "
                     f"took {load['steal_cores']} (steal)")
    for key, value in summary.items():
        if key not in ("machine", "model", "best_mode", "concurrency", "machine_load"):
            lines.append(f"- {key}: {json.dumps(value)}")
    return "\n".join(lines)


def to_rows(report: dict) -> list[dict]:
    rows = []
    for r in report["results"]:
        vs_hf, vs_llama = _ratios(report["results"], r)
        rows.append({"engine": r.engine, "mode": r.mode, "test": r.test, "tokens_per_s": round(r.mean, 2),
                     "std": round(r.std, 2), "samples": [round(s, 2) for s in r.samples], "vs_transformers": vs_hf,
                     "vs_llama_cpp": vs_llama, "achieved": r.note})
    return rows


def load(path: Path) -> dict:
    """A run saved with `--output json`, as run() returns it, to render again as Markdown or CSV (its
    samples rounded to two decimals, as saved)."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        results = [Result(row["engine"], row["mode"], row["test"], list(row["samples"]), row["achieved"])
                   for row in saved["results"]]
        summary = dict(saved["summary"])
        if not results:
            raise ValueError("no results")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path} is not a run saved by `phasescope bench --output json`") from exc
    return {"results": results, "summary": summary}


def render(report: dict, output: str) -> str:
    if output == "json":
        return json.dumps({"results": to_rows(report), "summary": report["summary"]}, indent=1)
    if output == "csv":
        import csv
        import io

        out = io.StringIO()
        rows = to_rows(report)
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({**row, "samples": " ".join(map(str, row["samples"]))} for row in rows)
        return out.getvalue()
    return to_markdown(report)
