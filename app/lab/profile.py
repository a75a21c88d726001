"""Where the time goes inside one prefill and one decode step, and both steps on this machine's roofline."""
from __future__ import annotations

import json
import time

import torch

from engine import FORWARD_STAGES, Engine
from engine.models.loader import cache_root, write_atomically

from .lab import Lab, decode_steps, median, r
from .result import LabResult, Series, processor_name, said

PROBE_FILE = "roofline.json"


def stages(lab: Lab, prompt: str) -> LabResult:
    num_prompt, num_gen = lab.size((128, 8), (512, 24))
    lab.step(said("lab.step.stages", prompt=num_prompt, new=num_gen))
    e = lab.variant(prefix_caching=False)
    lab.run(e, lab.tokens(prompt, 16), 2, time_stages=True)  # warm-up: the timers' first call
    _, events = lab.run(e, lab.tokens(prompt, num_prompt), num_gen, time_stages=True)
    chunk = next(ev for ev in events if ev.type == "PrefillChunk")
    steps = [s for s in decode_steps(events) if s.stage_ms]
    decode = {stage: median(s.stage_ms.get(stage, 0.0) for s in steps) for stage in (*FORWARD_STAGES, "sample")}
    prefill = {stage: chunk.stage_ms.get(stage, 0.0) for stage in FORWARD_STAGES}
    prefill["sample"] = next(ev.stage_ms.get("sample", 0.0) for ev in events if ev.type == "DecodeStep")
    prefill_total = chunk.latency_ms + prefill["sample"]
    decode_total = median(s.forward_ms + s.stage_ms["sample"] for s in steps)
    prefill_sum = sum(prefill[s] for s in FORWARD_STAGES) / chunk.latency_ms
    decode_sum = median(sum(s.stage_ms.get(stage, 0.0) for stage in FORWARD_STAGES) / s.forward_ms for s in steps)
    rows = [{"lab.col.stage": stage, "lab.col.prefill_ms": r(prefill[stage], 2),
             "lab.col.prefill_pct": r(100 * prefill[stage] / prefill_total), "lab.col.decode_ms": r(decode[stage], 3),
             "lab.col.decode_pct": r(100 * decode[stage] / decode_total)} for stage in (*FORWARD_STAGES, "sample")]
    rows.append({"lab.col.stage": "lab.w.step_measured", "lab.col.prefill_ms": r(prefill_total, 2),
                 "lab.col.prefill_pct": 100.0, "lab.col.decode_ms": r(decode_total, 3), "lab.col.decode_pct": 100.0})
    labels = [said("lab.w.prefill_of", tokens=num_prompt), "lab.w.one_decode_step"]
    series = [Series(row["lab.col.stage"], labels, [row["lab.col.prefill_pct"], row["lab.col.decode_pct"]], kind="bar",
                     text=[f"{row['lab.col.prefill_ms']} ms", f"{row['lab.col.decode_ms']} ms"]) for row in rows[:-1]]
    by_stage = {row["lab.col.stage"]: row for row in rows}
    ffn, attention, head, sample = (by_stage[k] for k in ("ffn", "attention", "lm_head", "sample"))
    explanation = said("lab.stages.explain", tokens=num_prompt, prefill_ms=prefill_total,
                       ffn=ffn["lab.col.prefill_pct"], attention=attention["lab.col.prefill_pct"],
                       decode_ms=decode_total,
                       ffn_decode=ffn["lab.col.decode_pct"], head_decode=head["lab.col.decode_pct"],
                       head_prefill=head["lab.col.prefill_pct"], sample=sample["lab.col.decode_pct"],
                       prefill_sum=prefill_sum, decode_sum=decode_sum)
    effects = timed = {"lab.stages.sum_prefill": abs(prefill_sum - 1) <= 0.1,
                       "lab.stages.sum_decode": abs(decode_sum - 1) <= 0.1}
    return LabResult("stages", "lab.stages.title", prompt,
                     {"prompt_tokens": num_prompt, "decode_steps": len(steps), "stages_over_prefill": r(prefill_sum, 3),
                      "stages_over_decode": r(decode_sum, 3)}, "", "lab.w.pct_of_step", series, rows, explanation,
                     effects, timed=list(timed))


def probe(device: torch.device, refresh: bool = False) -> dict:
    """This machine's peak fp32 FLOP/s (a square matmul) and memory bandwidth (reading a tensor far larger
    than the caches), the best of a few tries each; cached per machine, device and thread count."""
    threads = torch.get_num_threads()
    key = f"{device}|{processor_name(device)}|{threads} threads|torch {torch.__version__}"
    path = cache_root() / PROBE_FILE
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, unreadable, or cut short by a full disk: measured again
        known = {}
    known = known if isinstance(known, dict) else {}
    if isinstance(known.get(key), dict) and {"peak_gflops", "bandwidth_gbs"} <= set(known[key]) and not refresh:
        return known[key]

    def best(run, tries: int = 5) -> float:
        run()  # warm-up
        times = []
        for _ in range(tries):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return min(times)

    n = 4096 if device.type == "cuda" else 1024
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    big = torch.ones(64 << 20, device=device)  # 256 MB of fp32
    result = {"peak_gflops": round(2 * n ** 3 / best(lambda: a @ b) / 1e9, 1),
              "bandwidth_gbs": round(big.numel() * 4 / best(lambda: big.sum()) / 1e9, 2), "key": key}
    known[key] = result
    # whole or not at all; a cache that cannot be written (a read-only home) only measures again next time
    write_atomically(path, lambda scratch: scratch.write_text(json.dumps(known, indent=1)))
    return result


def roofline(lab: Lab, prompt: str) -> LabResult:
    num_prompt, batches, num_gen = lab.size((128, (1, 2, 4), 8), (512, (1, 2, 4, 8), 16))
    lab.step("lab.step.probe")
    peaks = probe(lab.engine.loaded.device)
    lab.step("lab.step.fp32_model")
    e = lab.variant(precision="fp32", prefix_caching=False)
    try:
        points = _points(lab, e, prompt, num_prompt, batches, num_gen)
    finally:
        if e.runner is not lab.engine.runner:
            e.close()
    peak, bandwidth = peaks["peak_gflops"], peaks["bandwidth_gbs"]
    ridge = peak / bandwidth
    xs = [0.1 * 2 ** (i / 2) for i in range(25)]  # 0.1 to 410 FLOP per byte
    series = [Series(said("lab.w.roof", peak=peak, bandwidth=bandwidth), [r(x, 3) for x in xs],
                     [r(min(peak, bandwidth * x), 2) for x in xs], kind="lines", dash="dash")]
    for point in points:
        series.append(Series(said("lab.series", setting=point["lab.col.step"], what="lab.w.achieved"),
                             [point["lab.col.flop_per_byte"]], [point["GFLOP/s"]], kind="markers+text",
                             text=[point["lab.col.step"]]))
    pre, d1, dn = points[0], points[1], points[-1]
    explanation = said("lab.roofline.explain", peak=peak, bandwidth=bandwidth, ridge=ridge, tokens=num_prompt,
                       pre_intensity=pre["lab.col.flop_per_byte"], pre_gflops=pre["GFLOP/s"],
                       pre_share=pre["GFLOP/s"] / peak, d1_intensity=d1["lab.col.flop_per_byte"],
                       d1_gflops=d1["GFLOP/s"], batch=dn["lab.col.batch"], dn_intensity=dn["lab.col.flop_per_byte"],
                       dn_gflops=dn["GFLOP/s"])
    timed = {"lab.roofline.batching_climbs": dn["GFLOP/s"] > d1["GFLOP/s"]}
    effects = {"lab.roofline.positive_peaks": peak > 0 and bandwidth > 0,
               "lab.roofline.prefill_intensity": pre["lab.col.flop_per_byte"] > 10 * d1["lab.col.flop_per_byte"],
               **timed}
    return LabResult("roofline", "lab.roofline.title", prompt,
                     {"prompt_tokens": num_prompt, "batches": list(batches), "precision": "fp32",
                      "peak_gflops": peak, "bandwidth_gbs": bandwidth},
                     "lab.w.intensity", "lab.w.achieved_gflops", series, points, explanation,
                     effects, timed=list(timed), log_x=True, log_y=True)


def _points(lab: Lab, e: Engine, prompt: str, num_prompt: int, batches: tuple[int, ...], num_gen: int) -> list[dict]:
    weights, per_token = getattr(e.runner, "weight_bytes", 0), e.info.kv_bytes_per_token
    lab.step(said("lab.w.prefill_of", tokens=num_prompt))
    lab.run(e, lab.tokens(prompt, 16), 2)  # warm-up
    _, events = lab.run(e, lab.tokens(prompt, num_prompt), 1)
    ms = next(ev.latency_ms for ev in events if ev.type == "PrefillChunk")
    flops, moved = e.forward_flops(num_prompt, 0), weights + num_prompt * per_token
    points = [{"lab.col.step": said("lab.w.prefill_n", tokens=num_prompt), "lab.col.batch": 1, "ms": r(ms, 2),
               "GFLOP": r(flops / 1e9, 2), "lab.col.flop_per_byte": r(flops / moved, 2),
               "GFLOP/s": r(flops / ms / 1e6, 1)}]
    context = 32
    for batch in batches:
        lab.step(said("lab.step.decode_batch", n=batch))
        requests = [lab.request(e, lab.tokens(prompt, context), num_gen) for _ in range(batch)]
        events = []
        for request in requests:
            e.submit(request, [events.append])
        while not all(q.is_finished for q in requests):
            e.step()
        ms = median(s.forward_ms for s in decode_steps(events) if s.batch_size == batch)
        past = context + num_gen // 2
        flops, moved = batch * e.forward_flops(1, past), weights + batch * past * per_token
        points.append({"lab.col.step": said("lab.w.decode_b", n=batch), "lab.col.batch": batch, "ms": r(ms, 2),
                       "GFLOP": r(flops / 1e9, 3), "lab.col.flop_per_byte": r(flops / moved, 2),
                       "GFLOP/s": r(flops / ms / 1e6, 1)})
    return points
