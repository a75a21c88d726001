"""The decode-side experiments: KV cache on/off, speculative decoding, KV compression, batching, Flash
Decoding, and weight precision against the bytes each token reads."""
from __future__ import annotations

import time

from ..bench.decode_side import teacher_forced
from ..bench.extras import ReadProbe
from ..bench.texts import SPECULATION_PROMPTS
from .lab import Lab, decode_steps, median, r
from .result import LabResult, Series

FREE_PROMPT = SPECULATION_PROMPTS["no repeats"]


def kv_cache(lab: Lab, prompt: str) -> LabResult:
    num_prompt, num_gen = lab.size((64, 48), (96, 128))
    ids = lab.tokens(prompt, num_prompt)
    settings = {"KV cache": lab.engine.variant(prefix_caching=False), "no KV cache": lab.engine.variant(kv_cache=False)}
    series, rows, steps, tokens = [], [], {}, {}
    for name, e in settings.items():
        lab.step(f"{name}: {num_gen} tokens after {num_prompt} prompt tokens")
        request, events = lab.run(e, ids, num_gen)
        steps[name], tokens[name] = decode_steps(events), request.generated_ids
        positions = [num_prompt + s.step for s in steps[name]]
        series.append(Series(f"{name} · ms per token", positions, [r(s.forward_ms, 2) for s in steps[name]]))
        series.append(Series(f"{name} · GFLOP per step", positions, [r(s.flops / 1e9, 3) for s in steps[name]],
                             kind="lines", axis="y2", dash="dot"))
    for name, found in steps.items():
        first, last = median(s.forward_ms for s in found[:4]), median(s.forward_ms for s in found[-4:])
        rows.append({"setting": name, "first steps (ms)": r(first, 2), "last steps (ms)": r(last, 2),
                     "last step GFLOP": r(found[-1].flops / 1e9, 3), "same tokens": tokens[name] == tokens["KV cache"]})
    cached, recomputed = rows
    end = num_prompt + steps["KV cache"][-1].step
    explanation = (f"With the cache, the step at position {end} took {cached['last steps (ms)']:.1f} ms; without, "
                   f"{recomputed['last steps (ms)']:.0f} ms: each step recomputed all {end} tokens "
                   f"({recomputed['last step GFLOP']:.1f} GFLOP against {cached['last step GFLOP']:.2f}). Without a "
                   f"cache the cost per token grows with the sequence; with one it stays nearly flat, since only "
                   f"the new token goes through the weights.")
    timed = {"without a cache, the last steps are slower than the first":
             recomputed["last steps (ms)"] > recomputed["first steps (ms)"],
             "without a cache, each step is slower than with one":
             recomputed["last steps (ms)"] > cached["last steps (ms)"]}
    effects = {**timed, "the same tokens either way": recomputed["same tokens"]}
    return LabResult("kv-cache", "KV cache on/off: time per token against position", prompt,
                     {"prompt_tokens": num_prompt, "new_tokens": num_gen}, "position (tokens)", "ms per token",
                     series, rows, explanation, effects, timed=list(timed), y2_label="GFLOP per step")


def speculative(lab: Lab, prompt: str) -> LabResult:
    num_gen = lab.size(48, 128)
    # the prompt's text twice, as plain text (no chat template): the model goes on with a third copy, the
    # way an edit repeats most of a document; and a chat that asks for something new
    once = lab.encode(prompt)[:1000]
    prompts = {"repeat/edit": once * 2, "free": FREE_PROMPT}
    settings = {"plain": lab.engine.variant(speculative=None, prefix_caching=False),
                "prompt lookup": lab.engine.variant(speculative="prompt-lookup", prefix_caching=False)}
    series, rows, texts = [], [], {}
    for kind, text in prompts.items():
        for name, e in settings.items():
            lab.step(f"{kind} prompt, {name}")
            # the faster of two runs: one run's speed on a shared machine is noisy
            request, events = max((lab.run(e, text, num_gen) for _ in range(2)),
                                  key=lambda run: run[1][-1].metrics.decode_tokens_per_s or 0)
            finished = events[-1]
            texts[kind, name] = request.generated_ids
            spec = finished.speculation
            row = {"prompt": kind, "setting": name, "decode tok/s": r(finished.metrics.decode_tokens_per_s or 0),
                   "tokens per forward": r(spec.tokens_per_forward or 1, 2) if spec else 1.0,
                   "acceptance": r(spec.accepted / spec.drafted, 2) if spec and spec.drafted else None,
                   "same output": texts[kind, name] == texts[kind, "plain"]}
            rows.append(row)
            if kind == "repeat/edit":
                steps = decode_steps(events)
                series.append(Series(f"{name} · repeat/edit prompt", [s.step for s in steps],
                                     [r(s.latency_ms, 2) for s in steps], kind="markers" if spec else "lines"))
    plain, spec, free_plain, free_spec = rows
    explanation = (f"On the repeat/edit prompt prompt lookup made {spec['tokens per forward']:.2f} tokens per forward "
                   f"({spec['decode tok/s']:.0f} tok/s against {plain['decode tok/s']:.0f}); on the free prompt "
                   f"{free_spec['tokens per forward']:.2f} ({free_spec['decode tok/s']:.0f} against "
                   f"{free_plain['decode tok/s']:.0f}). Accepted drafts arrive together: the points near zero on the "
                   f"chart are tokens that came in the same forward as the one before them. Greedy output is the same "
                   f"token for token, since every draft is verified.")
    timed = {"repeat/edit prompt: faster than plain decoding": spec["decode tok/s"] > plain["decode tok/s"]}
    effects = {"repeat/edit prompt: more than one token per forward": spec["tokens per forward"] > 1.3, **timed,
               "outputs identical on both prompts": spec["same output"] and free_spec["same output"]}
    return LabResult("speculative", "Speculative decoding (prompt lookup): latency of each token", prompt,
                     {"new_tokens": num_gen, "draft_tokens": lab.engine.config.draft_tokens},
                     "token", "ms since the previous token", series, rows, explanation, effects, timed=list(timed))


def kv_compression(lab: Lab, prompt: str) -> LabResult:
    context, window = lab.size((320, 128), (1024, 256))
    ids = lab.tokens(prompt, context)
    settings = {"KV fp32": lab.engine.variant(kv_dtype="fp32", prefix_caching=False),
                "KV int8": lab.engine.variant(kv_dtype="int8", prefix_caching=False),
                f"window {window} + 4 sinks": lab.engine.variant(kv_dtype="fp32", kv_window=window, kv_sinks=4,
                                                                 prefix_caching=False)}
    series, rows, reference = [], [], None
    for name, e in settings.items():
        lab.step(f"{name}: {context} tokens through decode steps")
        perplexity, best, step_ms, kv_bytes = teacher_forced(e, ids)
        reference = reference or best
        positions = list(range(1, len(kv_bytes) + 1))
        series.append(Series(f"{name} · KV MB", positions[::4], [r(b / 1e6, 3) for b in kv_bytes[::4]], kind="lines"))
        rows.append({"setting": name, "KV MB at the end": r(kv_bytes[-1] / 1e6, 2),
                     "decode ms (last quarter)": r(median(step_ms[-len(step_ms) // 4:]), 2),
                     "perplexity": r(perplexity, 2),
                     "top-1 agreement with fp32": r(sum(a == b for a, b in zip(best, reference)) / len(best), 3)})
    full, int8, windowed = rows
    explanation = (f"At {context} tokens the fp32 cache holds {full['KV MB at the end']:.1f} MB, int8 "
                   f"{int8['KV MB at the end']:.1f} MB (top-1 agreement {int8['top-1 agreement with fp32']:.1%}), "
                   f"and the window {windowed['KV MB at the end']:.1f} MB, flat once full, at an agreement of "
                   f"{windowed['top-1 agreement with fp32']:.1%}: "
                   + ("what it forgot seldom changed the next token on this text. "
                      if windowed["top-1 agreement with fp32"] >= 0.98 else "what it forgot mattered. ") +
                   f"Fewer bytes also mean "
                   f"less to read per decode step ({full['decode ms (last quarter)']:.2f} ms fp32, "
                   f"{int8['decode ms (last quarter)']:.2f} int8, {windowed['decode ms (last quarter)']:.2f} window).")
    effects = {"int8 KV holds fewer bytes than fp32": int8["KV MB at the end"] < full["KV MB at the end"] / 2,
               "int8 KV agrees with fp32 on at least 90 % of next tokens": int8["top-1 agreement with fp32"] >= 0.9,
               "the window stops the cache growing": windowed["KV MB at the end"] < full["KV MB at the end"] / 2}
    return LabResult("kv-compression", "KV compression at long context: cache bytes against position", prompt,
                     {"context_tokens": context, "window": window, "sinks": 4}, "position (tokens)", "KV cache (MB)",
                     series, rows, explanation, effects)


def batching(lab: Lab, prompt: str) -> LabResult:
    levels, num_gen = lab.size(((1, 2, 4), 24), ((1, 2, 4, 8), 64))
    e = lab.engine.variant(prefix_caching=False)
    ids = lab.tokens(prompt, 32)
    rows = []
    for batch in levels:
        lab.step(f"{batch} request(s) at once")
        requests = [lab.request(e, ids, num_gen) for _ in range(batch)]
        finished = e.run_all(requests)
        # decode throughput over the span every request was decoding (after the step that admitted them all)
        span_ns = max(q.token_ns[-1] for q in requests) - max(q.token_ns[0] for q in requests)
        tokens = sum(len(q.token_ns) - 1 for q in requests)
        rows.append({"requests": batch, "aggregate tok/s": r(tokens * 1e9 / span_ns),
                     "TPOT per request (ms)": r(median(f.metrics.tpot_ms for f in finished), 2)})
    series = [Series("batching · aggregate decode", [row["TPOT per request (ms)"] for row in rows],
                     [row["aggregate tok/s"] for row in rows], text=[f"B={row['requests']}" for row in rows])]
    one, most = rows[0], rows[-1]
    explanation = (f"One request decoded at {one['aggregate tok/s']:.0f} tok/s; {most['requests']} together at "
                   f"{most['aggregate tok/s']:.0f} tok/s in all "
                   f"({most['aggregate tok/s'] / one['aggregate tok/s']:.1f}x), "
                   f"each waiting {most['TPOT per request (ms)']:.1f} ms per token instead of "
                   f"{one['TPOT per request (ms)']:.1f}. Decode reads every weight once per step whatever the batch, "
                   f"so more sequences per step buy throughput at a small cost in each one's latency.")
    effects = timed = {
        "batching raises aggregate throughput": most["aggregate tok/s"] > 1.5 * one["aggregate tok/s"],
        "each request's TPOT rises with the batch": most["TPOT per request (ms)"] > one["TPOT per request (ms)"]}
    return LabResult("batching", "Batching: aggregate throughput against each request's TPOT", prompt,
                     {"levels": list(levels), "new_tokens": num_gen, "prompt_tokens": 32},
                     "TPOT per request (ms)", "aggregate decode tok/s", series, rows, explanation, effects,
                     timed=list(timed))


def _bound(split: dict, unsplit: dict, machine: dict[int, float]) -> str:
    """What bounds the split at the longest context, from its read rate and the machine's."""
    split_rate, unsplit_rate = split["KV read GB/s"] or 0.0, unsplit["KV read GB/s"] or 0.0
    said = (f"At long context the attention streams the cache from memory: split, it read it at "
            f"{split_rate:.1f} GB/s, unsplit {unsplit_rate:.1f}")
    if not machine:
        return said + "."
    one, most = machine[min(machine)], machine[max(machine)]
    said += f", where this machine reads {most:.1f} GB/s with {max(machine)} threads and {one:.1f} with one. "
    if split_rate >= 0.85 * most:
        return said + ("The split reads near all the machine gives, so memory bandwidth, which it cannot add, "
                       "bounds it; and the closer one thread alone comes to that, the less the waiting core left "
                       "unread.")
    return said + ("The split reads well below what the machine gives, so here the kernel's own pace (its "
                   "arithmetic, and each thread's wait on memory), not the bandwidth, bounds it.")


def flash_decoding(lab: Lab, prompt: str) -> LabResult:
    contexts, num_gen = lab.size(((256, 1024), 8), ((512, 1024, 2048, 4096), 16))
    contexts = [c for c in contexts if c < lab.engine.context_window - num_gen]
    settings = {"unsplit": lab.engine.variant(split_kv=False, prefix_caching=True),
                "split (Flash Decoding)": lab.engine.variant(split_kv=True, prefix_caching=True)}
    available = getattr(lab.engine.runner, "fused", None) is not None
    series, rows = [], []
    for name, e in settings.items():
        attention = []
        for context in contexts:
            lab.step(f"{name}: decode at {context} tokens of context")
            _, events = lab.run(e, lab.tokens(prompt, context), num_gen, time_stages=True)
            attention.append(median(s.stage_ms["attention"] for s in decode_steps(events) if s.stage_ms))
            cache_mb = e.info.kv_bytes_per_token * context / 1e6  # what a step's attention reads
            rows.append({"setting": name, "context": context, "attention ms per step": r(attention[-1], 2),
                         "step ms": r(median(s.forward_ms for s in decode_steps(events)), 2),
                         "KV read GB/s": r(cache_mb / attention[-1], 1) if attention[-1] > 0 else None})
        series.append(Series(f"{name} · attention", contexts, [r(a, 2) for a in attention]))
    on_cpu = lab.engine.info.device.startswith("cpu")  # the probe reads the host's memory
    if on_cpu:
        lab.step("this machine's memory read rate, one thread and all")
    probe = ReadProbe() if on_cpu else None  # the median of three sums with one thread and with all
    machine = {k: r(median(probe.gb_s(k) for _ in range(3)), 1) for k in probe.threads} if probe else {}
    half = len(rows) // 2
    unsplit, split = rows[half - 1], rows[-1]
    explanation = (f"At {unsplit['context']} tokens of context attention took "
                   f"{unsplit['attention ms per step']:.2f} ms per step unsplit and "
                   f"{split['attention ms per step']:.2f} ms split across the threads; at {rows[0]['context']}, "
                   f"{rows[0]['attention ms per step']:.2f} ms. Unsplit, each KV group of a sequence is one task: "
                   f"with fewer groups than cores to spread evenly (3 on 2 threads here), one core attends for two "
                   f"while the other waits. Split, each group's positions are cut into chunks of 512 that every "
                   f"core shares, merged exactly by their maxima and sums (log-sum-exp). Below 512 positions there "
                   f"is nothing to cut. " + _bound(split, unsplit, machine))
    if not available:
        explanation = "The native decode step is not built here, so there is no split to switch on. " + explanation
    effects = timed = {"attention time grows with the context (unsplit)":
                       rows[half - 1]["attention ms per step"] > rows[0]["attention ms per step"],
                       "attention time grows with the context (split)":
                       rows[-1]["attention ms per step"] > rows[half]["attention ms per step"]}
    return LabResult("flash-decoding", "Flash Decoding: attention time per decode step against context", prompt,
                     {"contexts": contexts, "new_tokens": num_gen, "native_step": available,
                      "machine_read_gb_s": ReadProbe.labels(machine)},
                     "context (tokens)", "attention ms per decode step", series, rows, explanation, effects,
                     timed=list(timed))


def precision(lab: Lab, prompt: str) -> LabResult:
    num_gen = lab.size(24, 64)
    ids = lab.tokens(prompt, 32)
    rows = []
    for name in ("fp32", "fp16", "int8"):
        lab.step(f"weights in {name}")
        start = time.perf_counter()
        e = lab.engine.variant(precision=name, prefix_caching=False)
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
        rows.append({"weights": name, "MB read per token": r(weight_mb), "decode tok/s": r(1000 / ms),
                     "GB/s achieved": r(weight_mb / ms, 2), "forward ready (s)": r(ready_s, 2)})
    bandwidth = max(row["GB/s achieved"] for row in rows)
    top = max(row["MB read per token"] for row in rows)
    series = [Series(row["weights"] + " · decode", [row["MB read per token"]], [r(1000 / row["decode tok/s"], 2)],
                     kind="markers+text", text=[row["weights"]]) for row in rows]
    series.append(Series(f"{bandwidth:.1f} GB/s · all time spent reading weights", [0, top],
                         [0, r(top / bandwidth, 2)],
                         kind="lines", dash="dash"))
    fp32, fp16, int8 = rows
    explanation = (f"fp32 reads {fp32['MB read per token']:.0f} MB of weights per token and decodes at "
                   f"{fp32['decode tok/s']:.0f} tok/s; int8 reads {int8['MB read per token']:.0f} MB and decodes at "
                   f"{int8['decode tok/s']:.0f} tok/s; fp16 {fp16['MB read per token']:.0f} MB at "
                   f"{fp16['decode tok/s']:.0f} tok/s. A memory-bound step takes bytes / bandwidth: the points lie on "
                   f"a line through the origin (dashed: {bandwidth:.1f} GB/s, the best achieved), and fewer bytes per "
                   f"token buy speed in proportion. A point above the line spends time on something besides reading "
                   f"weights (converting a format the CPU cannot multiply natively, or per-step overhead).")
    timed = {"int8 decodes faster than fp32": int8["decode tok/s"] > fp32["decode tok/s"]}
    effects = {"int8 reads fewer bytes per token than fp32": int8["MB read per token"] < fp32["MB read per token"] / 2,
               **timed}
    return LabResult("precision", "Weight precision: time per token against bytes read per token", prompt,
                     {"new_tokens": num_gen, "prompt_tokens": 32}, "MB of weights read per token", "ms per token",
                     series, rows, explanation, effects, timed=list(timed))
