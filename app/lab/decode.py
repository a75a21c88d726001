"""The decode-side experiments: KV cache on/off, speculative decoding, KV compression, batching, Flash
Decoding, and weight precision against the bytes each token reads."""
from __future__ import annotations

import time

from ..bench.decode_side import teacher_forced
from ..bench.extras import ReadProbe
from ..bench.texts import SPECULATION_PROMPTS
from .lab import Lab, decode_steps, median, r
from .result import LabResult, Series, said

FREE_PROMPT = SPECULATION_PROMPTS["no repeats"]


def kv_cache(lab: Lab, prompt: str) -> LabResult:
    num_prompt, num_gen = lab.size((64, 48), (96, 128))
    ids = lab.tokens(prompt, num_prompt)
    settings = {"lab.set.kv_cache": lab.variant(prefix_caching=False),
                "lab.set.no_kv_cache": lab.variant(kv_cache=False)}
    series, rows, steps, tokens = [], [], {}, {}
    for name, e in settings.items():
        lab.step(said("lab.step.after_prompt", setting=name, new=num_gen, prompt=num_prompt))
        request, events = lab.run(e, ids, num_gen)
        steps[name], tokens[name] = decode_steps(events), request.generated_ids
        positions = [num_prompt + s.step for s in steps[name]]
        series.append(Series(said("lab.series", setting=name, what="lab.w.ms_per_token"), positions,
                             [r(s.forward_ms, 2) for s in steps[name]]))
        series.append(Series(said("lab.series", setting=name, what="lab.w.gflop_per_step"), positions,
                             [r(s.flops / 1e9, 3) for s in steps[name]], kind="lines", axis="y2", dash="dot"))
    for name, found in steps.items():
        first, last = median(s.forward_ms for s in found[:4]), median(s.forward_ms for s in found[-4:])
        rows.append({"lab.col.setting": name, "lab.col.first_steps_ms": r(first, 2),
                     "lab.col.last_steps_ms": r(last, 2),
                     "lab.col.last_step_gflop": r(found[-1].flops / 1e9, 3),
                     "lab.col.same_tokens": tokens[name] == tokens["lab.set.kv_cache"]})
    cached, recomputed = rows
    end = num_prompt + steps["lab.set.kv_cache"][-1].step
    explanation = said("lab.kv_cache.explain", end=end, cached_ms=cached["lab.col.last_steps_ms"],
                       recomputed_ms=recomputed["lab.col.last_steps_ms"],
                       gflop=recomputed["lab.col.last_step_gflop"], cached_gflop=cached["lab.col.last_step_gflop"])
    timed = {"lab.kv_cache.slower_at_end": recomputed["lab.col.last_steps_ms"] > recomputed["lab.col.first_steps_ms"],
             "lab.kv_cache.slower_than_cached": recomputed["lab.col.last_steps_ms"] > cached["lab.col.last_steps_ms"]}
    effects = {**timed, "lab.kv_cache.same_tokens": recomputed["lab.col.same_tokens"]}
    return LabResult("kv-cache", "lab.kv_cache.title", prompt, {"prompt_tokens": num_prompt, "new_tokens": num_gen},
                     "lab.w.position", "lab.w.ms_per_token", series, rows, explanation, effects, timed=list(timed),
                     y2_label="lab.w.gflop_per_step")


def speculative(lab: Lab, prompt: str) -> LabResult:
    num_gen = lab.size(48, 128)
    # the prompt's text twice, as plain text (no chat template): the model goes on with a third copy, the
    # way an edit repeats most of a document; and a chat that asks for something new
    once = lab.encode(prompt)[:1000]
    prompts = {"lab.set.repeat_prompt": once * 2, "lab.set.free_prompt": FREE_PROMPT}
    settings = {"lab.set.plain": lab.variant(speculative=None, prefix_caching=False),
                "lab.set.prompt_lookup": lab.variant(speculative="prompt-lookup", prefix_caching=False)}
    series, rows, texts = [], [], {}
    for kind, text in prompts.items():
        for name, e in settings.items():
            lab.step(said("lab.step.prompt_setting", prompt=kind, setting=name))
            # the faster of two runs: one run's speed on a shared machine is noisy
            request, events = max((lab.run(e, text, num_gen) for _ in range(2)),
                                  key=lambda run: run[1][-1].metrics.decode_tokens_per_s or 0)
            finished = events[-1]
            texts[kind, name] = request.generated_ids
            spec = finished.speculation
            row = {"lab.col.prompt": kind, "lab.col.setting": name,
                   "lab.col.decode_tps": r(finished.metrics.decode_tokens_per_s or 0),
                   "lab.col.tokens_per_forward": r(spec.tokens_per_forward or 1, 2) if spec else 1.0,
                   "lab.col.acceptance": r(spec.accepted / spec.drafted, 2) if spec and spec.drafted else None,
                   "lab.col.same_output": texts[kind, name] == texts[kind, "lab.set.plain"]}
            rows.append(row)
            if kind == "lab.set.repeat_prompt":
                steps = decode_steps(events)
                series.append(Series(said("lab.series", setting=name, what=kind), [s.step for s in steps],
                                     [r(s.latency_ms, 2) for s in steps], kind="markers" if spec else "lines"))
    plain, spec, free_plain, free_spec = rows
    explanation = said("lab.speculative.explain", per_forward=spec["lab.col.tokens_per_forward"],
                       tps=spec["lab.col.decode_tps"], plain_tps=plain["lab.col.decode_tps"],
                       free_per_forward=free_spec["lab.col.tokens_per_forward"],
                       free_tps=free_spec["lab.col.decode_tps"], free_plain_tps=free_plain["lab.col.decode_tps"])
    timed = {"lab.speculative.faster": spec["lab.col.decode_tps"] > plain["lab.col.decode_tps"]}
    effects = {"lab.speculative.several_per_forward": spec["lab.col.tokens_per_forward"] > 1.3, **timed,
               "lab.speculative.identical": spec["lab.col.same_output"] and free_spec["lab.col.same_output"]}
    return LabResult("speculative", "lab.speculative.title", prompt,
                     {"new_tokens": num_gen, "draft_tokens": lab.engine.config.draft_tokens},
                     "lab.w.token", "lab.w.ms_since_previous", series, rows, explanation, effects, timed=list(timed))


def kv_compression(lab: Lab, prompt: str) -> LabResult:
    context, window = lab.size((320, 128), (1024, 256))
    ids = lab.tokens(prompt, context)
    settings = {"lab.set.kv_fp32": lab.variant(kv_dtype="fp32", prefix_caching=False),
                "lab.set.kv_int8": lab.variant(kv_dtype="int8", prefix_caching=False),
                "lab.set.window": lab.variant(kv_dtype="fp32", kv_window=window, kv_sinks=4,
                                                     prefix_caching=False)}
    series, rows, reference = [], [], None
    for name, e in settings.items():
        setting = said(name, window=window)  # the window's name says its length
        lab.step(said("lab.step.through_decode", setting=setting, tokens=context))
        perplexity, best, step_ms, kv_bytes = teacher_forced(e, ids)
        reference = reference or best
        positions = list(range(1, len(kv_bytes) + 1))
        series.append(Series(said("lab.series", setting=setting, what="lab.w.kv_mb"), positions[::4],
                             [r(b / 1e6, 3) for b in kv_bytes[::4]], kind="lines"))
        rows.append({"lab.col.setting": setting, "lab.col.kv_mb_end": r(kv_bytes[-1] / 1e6, 2),
                     "lab.col.decode_ms_last_quarter": r(median(step_ms[-len(step_ms) // 4:]), 2),
                     "lab.col.perplexity": r(perplexity, 2),
                     "lab.col.agreement": r(sum(a == b for a, b in zip(best, reference)) / len(best), 3)})
    full, int8, windowed = rows
    forgot = ("lab.kv_compression.forgot_little" if windowed["lab.col.agreement"] >= 0.98
              else "lab.kv_compression.forgot_much")
    explanation = said("lab.kv_compression.explain", tokens=context, fp32_mb=full["lab.col.kv_mb_end"],
                       int8_mb=int8["lab.col.kv_mb_end"], int8_agreement=int8["lab.col.agreement"],
                       window_mb=windowed["lab.col.kv_mb_end"], window_agreement=windowed["lab.col.agreement"],
                       forgot=forgot, fp32_ms=full["lab.col.decode_ms_last_quarter"],
                       int8_ms=int8["lab.col.decode_ms_last_quarter"],
                       window_ms=windowed["lab.col.decode_ms_last_quarter"])
    effects = {"lab.kv_compression.int8_smaller": int8["lab.col.kv_mb_end"] < full["lab.col.kv_mb_end"] / 2,
               "lab.kv_compression.int8_agrees": int8["lab.col.agreement"] >= 0.9,
               "lab.kv_compression.window_flat": windowed["lab.col.kv_mb_end"] < full["lab.col.kv_mb_end"] / 2}
    return LabResult("kv-compression", "lab.kv_compression.title", prompt,
                     {"context_tokens": context, "window": window, "sinks": 4}, "lab.w.position", "lab.w.kv_cache_mb",
                     series, rows, explanation, effects)


def batching(lab: Lab, prompt: str) -> LabResult:
    levels, num_gen = lab.size(((1, 2, 4), 24), ((1, 2, 4, 8), 64))
    e = lab.variant(prefix_caching=False)
    ids = lab.tokens(prompt, 32)
    rows = []
    for batch in levels:
        lab.step(said("lab.step.requests_at_once", n=batch))
        requests = [lab.request(e, ids, num_gen) for _ in range(batch)]
        finished = e.run_all(requests)
        # decode throughput over the span every request was decoding (after the step that admitted them all)
        span_ns = max(q.token_ns[-1] for q in requests) - max(q.token_ns[0] for q in requests)
        tokens = sum(len(q.token_ns) - 1 for q in requests)
        rows.append({"lab.col.requests": batch, "lab.col.aggregate_tps": r(tokens * 1e9 / span_ns),
                     "lab.col.tpot_per_request": r(median(f.metrics.tpot_ms for f in finished), 2)})
    series = [Series(said("lab.series", setting="lab.set.batching", what="lab.w.aggregate_decode"),
                     [row["lab.col.tpot_per_request"] for row in rows], [row["lab.col.aggregate_tps"] for row in rows],
                     kind="lines+markers+text", text=[f"B={row['lab.col.requests']}" for row in rows])]
    one, most = rows[0], rows[-1]
    explanation = said("lab.batching.explain", one_tps=one["lab.col.aggregate_tps"], n=most["lab.col.requests"],
                       most_tps=most["lab.col.aggregate_tps"],
                       gain=most["lab.col.aggregate_tps"] / one["lab.col.aggregate_tps"],
                       most_tpot=most["lab.col.tpot_per_request"], one_tpot=one["lab.col.tpot_per_request"])
    effects = timed = {
        "lab.batching.throughput": most["lab.col.aggregate_tps"] > 1.5 * one["lab.col.aggregate_tps"],
        "lab.batching.tpot": most["lab.col.tpot_per_request"] > one["lab.col.tpot_per_request"]}
    return LabResult("batching", "lab.batching.title", prompt,
                     {"levels": list(levels), "new_tokens": num_gen, "prompt_tokens": 32},
                     "lab.col.tpot_per_request", "lab.w.aggregate_tps", series, rows, explanation, effects,
                     timed=list(timed))


def _bound(split: dict, unsplit: dict, machine: dict[int, float]) -> list:
    """What bounds the split at the longest context, from its read rate and the machine's."""
    split_rate, unsplit_rate = split["lab.col.kv_read_gbs"] or 0.0, unsplit["lab.col.kv_read_gbs"] or 0.0
    if not machine:
        return said("lab.flash_decoding.rates", split=split_rate, unsplit=unsplit_rate)
    one, most = machine[min(machine)], machine[max(machine)]
    verdict = ("lab.flash_decoding.memory_bound" if split_rate >= 0.85 * most
               else "lab.flash_decoding.kernel_bound")
    return said("lab.flash_decoding.rates_machine", split=split_rate, unsplit=unsplit_rate, most=most,
                threads=max(machine), one=one, verdict=verdict)


def flash_decoding(lab: Lab, prompt: str) -> LabResult:
    contexts, num_gen = lab.size(((256, 1024), 8), ((512, 1024, 2048, 4096), 16))
    contexts = [c for c in contexts if c < lab.engine.context_window - num_gen]
    settings = {"lab.set.unsplit": lab.variant(split_kv=False, prefix_caching=True),
                "lab.set.split": lab.variant(split_kv=True, prefix_caching=True)}
    available = getattr(lab.engine.runner, "fused", None) is not None
    series, rows = [], []
    for name, e in settings.items():
        attention = []
        for context in contexts:
            lab.step(said("lab.step.decode_at_context", setting=name, tokens=context))
            _, events = lab.run(e, lab.tokens(prompt, context), num_gen, time_stages=True)
            attention.append(median(s.stage_ms["attention"] for s in decode_steps(events) if s.stage_ms))
            cache_mb = e.info.kv_bytes_per_token * context / 1e6  # what a step's attention reads
            rows.append({"lab.col.setting": name, "lab.col.context": context,
                         "lab.col.attention_ms": r(attention[-1], 2),
                         "lab.col.step_ms": r(median(s.forward_ms for s in decode_steps(events)), 2),
                         "lab.col.kv_read_gbs": r(cache_mb / attention[-1], 1) if attention[-1] > 0 else None})
        series.append(Series(said("lab.series", setting=name, what="lab.w.attention"), contexts,
                             [r(a, 2) for a in attention]))
    on_cpu = lab.engine.info.device.startswith("cpu")  # the probe reads the host's memory
    if on_cpu:
        lab.step("lab.step.read_rate")
    probe = ReadProbe() if on_cpu else None  # the median of three sums with one thread and with all
    machine = {k: r(median(probe.gb_s(k) for _ in range(3)), 1) for k in probe.threads} if probe else {}
    half = len(rows) // 2
    unsplit, split = rows[half - 1], rows[-1]
    explanation = said("lab.flash_decoding.explain", context=unsplit["lab.col.context"],
                       unsplit_ms=unsplit["lab.col.attention_ms"], split_ms=split["lab.col.attention_ms"],
                       short=rows[0]["lab.col.context"], short_ms=rows[0]["lab.col.attention_ms"],
                       bound=_bound(split, unsplit, machine))
    if not available:
        explanation = said("lab.flash_decoding.not_built", rest=explanation)
    effects = timed = {"lab.flash_decoding.grows_unsplit":
                       rows[half - 1]["lab.col.attention_ms"] > rows[0]["lab.col.attention_ms"],
                       "lab.flash_decoding.grows_split":
                       rows[-1]["lab.col.attention_ms"] > rows[half]["lab.col.attention_ms"]}
    return LabResult("flash-decoding", "lab.flash_decoding.title", prompt,
                     {"contexts": contexts, "new_tokens": num_gen, "native_step": available,
                      "machine_read_gb_s": ReadProbe.labels(machine)},
                     "lab.w.context", "lab.w.attention_ms_per_step", series, rows, explanation, effects,
                     timed=list(timed))


def precision(lab: Lab, prompt: str) -> LabResult:
    num_gen = lab.size(24, 64)
    ids = lab.tokens(prompt, 32)
    rows = []
    for name in ("fp32", "fp16", "int8"):
        lab.step(said("lab.step.weights_in", precision=name))
        start = time.perf_counter()
        e = lab.variant(precision=name, prefix_caching=False)
        ready_s = time.perf_counter() - start
        try:
            lab.run(e, ids[:8], 4)  # warm-up: the first steps of a fresh forward are slower
            _, events = lab.run(e, ids, num_gen)
        finally:
            if e.runner is not lab.engine.runner:
                e.close()
        steps = decode_steps(events)
        ms = median(s.forward_ms for s in steps)
        weight_mb = getattr(e.runner, "weight_bytes", 0) / 1e6
        rows.append({"lab.col.weights": name, "lab.col.mb_per_token": r(weight_mb), "lab.col.decode_tps": r(1000 / ms),
                     "lab.col.gbs_achieved": r(weight_mb / ms, 2), "lab.col.ready_s": r(ready_s, 2)})
    bandwidth = max(row["lab.col.gbs_achieved"] for row in rows)
    top = max(row["lab.col.mb_per_token"] for row in rows)
    series = [Series(said("lab.series", setting=row["lab.col.weights"], what="lab.w.decode"),
                     [row["lab.col.mb_per_token"]], [r(1000 / row["lab.col.decode_tps"], 2)], kind="markers+text",
                     text=[row["lab.col.weights"]]) for row in rows]
    series.append(Series(said("lab.series", setting=f"{bandwidth:.1f} GB/s", what="lab.w.all_reading"), [0, top],
                         [0, r(top / bandwidth, 2)], kind="lines", dash="dash"))
    fp32, fp16, int8 = rows
    explanation = said("lab.precision.explain", bandwidth=bandwidth,
                       fp32_mb=fp32["lab.col.mb_per_token"], fp32_tps=fp32["lab.col.decode_tps"],
                       int8_mb=int8["lab.col.mb_per_token"], int8_tps=int8["lab.col.decode_tps"],
                       fp16_mb=fp16["lab.col.mb_per_token"], fp16_tps=fp16["lab.col.decode_tps"])
    timed = {"lab.precision.int8_faster": int8["lab.col.decode_tps"] > fp32["lab.col.decode_tps"]}
    effects = {"lab.precision.int8_fewer_bytes": int8["lab.col.mb_per_token"] < fp32["lab.col.mb_per_token"] / 2,
               **timed}
    return LabResult("precision", "lab.precision.title", prompt, {"new_tokens": num_gen, "prompt_tokens": 32},
                     "lab.w.mb_per_token", "lab.w.ms_per_token", series, rows, explanation, effects, timed=list(timed))
