"""Where the time goes inside one prefill and one decode step, and both steps on this machine's roofline."""
from __future__ import annotations

import json
import time

import torch

from engine import FORWARD_STAGES, Engine
from engine.loader import cache_root

from .lab import Lab, decode_steps, median, r
from .result import LabResult, Series, processor_name

PROBE_FILE = "roofline.json"


def stages(lab: Lab, prompt: str) -> LabResult:
    num_prompt, num_gen = lab.size((128, 8), (512, 24))
    lab.step(f"prefill of {num_prompt} tokens and {num_gen} decode steps, each stage timed")
    e = lab.engine.variant(prefix_caching=False)
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
    rows = [{"stage": stage, "prefill (ms)": r(prefill[stage], 2), "prefill %": r(100 * prefill[stage] / prefill_total),
             "decode step (ms)": r(decode[stage], 3), "decode %": r(100 * decode[stage] / decode_total)}
            for stage in (*FORWARD_STAGES, "sample")]
    rows.append({"stage": "step (measured)", "prefill (ms)": r(prefill_total, 2), "prefill %": 100.0,
                 "decode step (ms)": r(decode_total, 3), "decode %": 100.0})
    labels = [f"prefill ({num_prompt} tokens)", "one decode step"]
    series = [Series(row["stage"], labels, [row["prefill %"], row["decode %"]], kind="bar",
                     text=[f"{row['prefill (ms)']} ms", f"{row['decode step (ms)']} ms"]) for row in rows[:-1]]
    by_stage = {row["stage"]: row for row in rows}
    ffn, attention, head, sample = (by_stage[k] for k in ("ffn", "attention", "lm_head", "sample"))
    explanation = (f"Prefill of {num_prompt} tokens took {prefill_total:.0f} ms: the MLP {ffn['prefill %']:.0f} % "
                   f"and attention {attention['prefill %']:.0f} %, big matrix products over many tokens at once. "
                   f"A decode step took {decode_total:.2f} ms, of which the MLP took {ffn['decode %']:.0f} %, the "
                   f"LM head {head['decode %']:.0f} % (in prefill {head['prefill %']:.1f} %: it runs for the last "
                   f"token only, the layers for all {num_prompt}) and sampling {sample['decode %']:.0f} %. The "
                   f"stages add up to {prefill_sum:.0%} of the prefill's measured time and {decode_sum:.0%} of the "
                   f"decode step's.")
    effects = timed = {"the stages sum to within 10 % of the prefill's time": abs(prefill_sum - 1) <= 0.1,
                       "the stages sum to within 10 % of the decode step's time": abs(decode_sum - 1) <= 0.1}
    return LabResult("stages", "Where the time goes: one prefill and one decode step by stage", prompt,
                     {"prompt_tokens": num_prompt, "decode_steps": len(steps), "stages_over_prefill": r(prefill_sum, 3),
                      "stages_over_decode": r(decode_sum, 3)}, "", "% of the step", series, rows, explanation,
                     effects, timed=list(timed))


def probe(device: torch.device, refresh: bool = False) -> dict:
    """This machine's peak fp32 FLOP/s (a square matmul) and memory bandwidth (reading a tensor far larger
    than the caches), the best of a few tries each; cached per machine, device and thread count."""
    threads = torch.get_num_threads()
    key = f"{device}|{processor_name(device)}|{threads} threads|torch {torch.__version__}"
    path = cache_root() / PROBE_FILE
    known = json.loads(path.read_text()) if path.exists() else {}
    if key in known and not refresh:
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
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(known, indent=1))
    return result


def roofline(lab: Lab, prompt: str) -> LabResult:
    num_prompt, batches, num_gen = lab.size((128, (1, 2, 4), 8), (512, (1, 2, 4, 8), 16))
    lab.step("probing this machine's peak FLOP/s and bandwidth (cached after the first time)")
    peaks = probe(lab.engine.loaded.device)
    lab.step("the model in fp32 (the probe's format)")
    e = lab.engine.variant(precision="fp32", prefix_caching=False)
    try:
        points = _points(lab, e, prompt, num_prompt, batches, num_gen)
    finally:
        if e.runner is not lab.engine.runner:
            e.close()
    peak, bandwidth = peaks["peak_gflops"], peaks["bandwidth_gbs"]
    ridge = peak / bandwidth
    xs = [0.1 * 2 ** (i / 2) for i in range(25)]  # 0.1 to 410 FLOP per byte
    series = [Series(f"roof · {peak:.0f} GFLOP/s, {bandwidth:.1f} GB/s", [r(x, 3) for x in xs],
                      [r(min(peak, bandwidth * x), 2) for x in xs], kind="lines", dash="dash")]
    for point in points:
        series.append(Series(f"{point['step']} · achieved", [point["FLOP per byte"]], [point["GFLOP/s"]],
                             kind="markers+text", text=[point["step"]]))
    pre, d1, dn = points[0], points[1], points[-1]
    explanation = (f"This machine peaks at {peak:.0f} GFLOP/s (fp32) and reads memory at {bandwidth:.1f} GB/s: "
                   f"a step needs about {ridge:.0f} FLOPs per byte it reads to be compute-bound. Prefill of "
                   f"{num_prompt} tokens does {pre['FLOP per byte']:.0f} FLOPs per byte and reached "
                   f"{pre['GFLOP/s']:.0f} GFLOP/s, {pre['GFLOP/s'] / peak:.0%} of the compute roof; a decode step of "
                   f"one sequence does {d1['FLOP per byte']:.1f} and reached {d1['GFLOP/s']:.1f} GFLOP/s, on the "
                   f"bandwidth slope. Batching {dn['batch']} sequences reads the weights once for all of them: "
                   f"{dn['FLOP per byte']:.1f} FLOPs per byte, {dn['GFLOP/s']:.1f} GFLOP/s.")
    timed = {"batching walks decode up the slope": dn["GFLOP/s"] > d1["GFLOP/s"]}
    effects = {"the probe measured positive peaks": peak > 0 and bandwidth > 0,
               "prefill's arithmetic intensity is above decode's": pre["FLOP per byte"] > 10 * d1["FLOP per byte"],
               **timed}
    return LabResult("roofline", "Roofline: prefill and decode on this machine's limits", prompt,
                     {"prompt_tokens": num_prompt, "batches": list(batches), "precision": "fp32", **peaks},
                     "arithmetic intensity (FLOP per byte read)", "achieved GFLOP/s", series, points, explanation,
                     effects, timed=list(timed), log_x=True, log_y=True)


def _points(lab: Lab, e: Engine, prompt: str, num_prompt: int, batches: tuple[int, ...], num_gen: int) -> list[dict]:
    weights, per_token = getattr(e.runner, "weight_bytes", 0), e.info.kv_bytes_per_token
    lab.step(f"prefill of {num_prompt} tokens")
    lab.run(e, lab.tokens(prompt, 16), 2)  # warm-up
    _, events = lab.run(e, lab.tokens(prompt, num_prompt), 1)
    ms = next(ev.latency_ms for ev in events if ev.type == "PrefillChunk")
    flops, moved = e.forward_flops(num_prompt, 0), weights + num_prompt * per_token
    points = [{"step": f"prefill {num_prompt}", "batch": 1, "ms": r(ms, 2), "GFLOP": r(flops / 1e9, 2),
               "FLOP per byte": r(flops / moved, 2), "GFLOP/s": r(flops / ms / 1e6, 1)}]
    context = 32
    for batch in batches:
        lab.step(f"decode, {batch} sequence(s) per step")
        requests = [lab.request(e, lab.tokens(prompt, context), num_gen) for _ in range(batch)]
        events = []
        for request in requests:
            e.submit(request, [events.append])
        while not all(q.is_finished for q in requests):
            e.step()
        ms = median(s.forward_ms for s in decode_steps(events) if s.batch_size == batch)
        past = context + num_gen // 2
        flops, moved = batch * e.forward_flops(1, past), weights + batch * past * per_token
        points.append({"step": f"decode B={batch}", "batch": batch, "ms": r(ms, 2), "GFLOP": r(flops / 1e9, 3),
                       "FLOP per byte": r(flops / moved, 2), "GFLOP/s": r(flops / ms / 1e6, 1)})
    return points
