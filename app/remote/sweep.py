"""A load sweep against an OpenAI-compatible server, in the manner of vLLM's serving benchmark: at each
concurrency level, N requests (all at once up to the level, or arriving as a Poisson process at a given
rate), each streamed and measured from here; per level the request and token throughput, p50/p90/p99
of TTFT, TPOT, ITL and E2E, and the goodput under a latency SLO."""
from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from engine import Finished, SamplingParams
from engine.metrics import percentiles

from .client import SERVER_GAUGES, Endpoint, gauges_text, server_gauges

WATCH_S = 0.2  # how often a level reads the server's gauges
WORDS = ("the model reads the prompt in one pass and then writes one token at a time while the cache of keys and "
         "values grows with every step of the reply").split()


def prompts(count: int, input_words: int, random_lengths: bool, seed: int = 0) -> list[str]:
    """Distinct prompts of about input_words words (random: 0.5x to 1.5x), numbered so that no two share
    more than a short prefix (a prefix cache would otherwise serve them)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        n = max(1, round(input_words * rng.uniform(0.5, 1.5))) if random_lengths else input_words
        words = [rng.choice(WORDS) for _ in range(n)]
        out.append(f"Request {i} ({rng.random():.6f}): continue this text. " + " ".join(words))
    return out


def parse_slo(text: str | None) -> dict[str, float]:
    """"ttft:500,tpot:50" -> {"ttft_ms": 500.0, "tpot_ms": 50.0}."""
    slo = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, _, value = part.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if name.strip() not in ("ttft", "tpot", "e2e") or not ms > 0:
            raise ValueError(f"--slo takes ttft:MS,tpot:MS,e2e:MS with milliseconds above 0, got {part!r}")
        slo[f"{name.strip()}_ms"] = ms
    return slo


def _meets(finished: Finished, slo: dict[str, float]) -> bool:
    m = finished.metrics
    values = {"ttft_ms": m.ttft_ms, "tpot_ms": m.tpot_ms, "e2e_ms": m.e2e_ms}
    return finished.reason != "error" and all(values[k] is not None and values[k] <= limit for k, limit in slo.items()
                                              if not (k == "tpot_ms" and values[k] is None))


def level(endpoint: Endpoint, texts: list[str], concurrency: int, output_tokens: int, rate: float | None,
          slo: dict[str, float], seed: int = 0) -> dict:
    """One level: the requests through `concurrency` workers (arriving at `rate` per second, if given)."""
    sampling = SamplingParams(max_new_tokens=output_tokens, temperature=0, ignore_eos=True)
    results: list[Finished] = []
    lock = threading.Lock()
    arrivals = random.Random(seed)
    # the requests read no /metrics of their own (two more round trips each, on the server measured): the
    # level's watcher below reads it
    quiet = dataclasses.replace(endpoint, scrape_metrics=False)

    def one(text: str) -> None:
        *_, finished = quiet.stream([{"role": "user", "content": text}], sampling)
        with lock:
            results.append(finished)

    seen: list[dict[str, float]] = []  # the server's own gauges (its /metrics) while the level runs
    done = threading.Event()

    def watch() -> None:
        while not done.wait(WATCH_S):
            if gauges := server_gauges(endpoint.scrape()):
                seen.append(gauges)

    watcher = threading.Thread(target=watch, name="sweep-metrics", daemon=True)
    watcher.start()
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for text in texts:
            pool.submit(one, text)
            if rate:
                time.sleep(arrivals.expovariate(rate))
    elapsed = time.perf_counter() - start
    done.set()
    watcher.join()
    ok = [f for f in results if f.reason != "error"]
    metrics = [f.metrics for f in ok]
    tokens = sum((f.server or {}).get("usage", {}).get("completion_tokens") or f.metrics.num_generated_tokens
                 for f in ok)

    def pct(values) -> dict:
        return {k: round(v, 2) if v is not None else None for k, v in percentiles(list(values)).items()}

    errors = [f.error for f in results if f.reason == "error"]
    peak = {what: max(s[what] for s in seen if what in s) for what in SERVER_GAUGES if any(what in s for s in seen)}
    return {"concurrency": concurrency, "request_rate": rate, "requests": len(texts), "completed": len(ok),
            "errors": len(errors), "first_error": errors[0] if errors else None, "duration_s": round(elapsed, 3),
            "request_throughput": round(len(ok) / elapsed, 3), "output_tokens_per_s": round(tokens / elapsed, 1),
            "ttft_ms": pct(m.ttft_ms for m in metrics if m.ttft_ms is not None),
            "tpot_ms": pct(m.tpot_ms for m in metrics if m.tpot_ms is not None),
            "itl_ms": pct(v for m in metrics for v in m.itl_ms), "e2e_ms": pct(m.e2e_ms for m in metrics),
            "goodput": round(sum(_meets(f, slo) for f in results) / elapsed, 3) if slo else None,
            "server_peak": peak or None}


def sweep(endpoint: Endpoint, levels: tuple[int, ...], num_requests: int, input_words: int, output_tokens: int,
          random_lengths: bool = False, rate: float | None = None, slo: dict[str, float] | None = None,
          log: Callable[[str], None] = lambda line: None, seed: int | None = None) -> dict:
    """seed: the prompts'; by default a new one each run, so that a server's prefix cache does not serve the
    prompts of an earlier run (llama.cpp's server keeps each slot's last prompt, vLLM and PhaseScope whole
    blocks): their TTFT would be a cache hit's, not a prefill's."""
    seed = random.randrange(1 << 31) if seed is None else seed
    texts = prompts(num_requests * len(levels), input_words, random_lengths, seed)
    report = {"endpoint": endpoint.url, "model": endpoint.model, "seed": seed, "requests_per_level": num_requests,
              "input_words": input_words, "output_tokens": output_tokens, "random_lengths": random_lengths,
              "request_rate": rate, "slo": slo or {}, "server_info": endpoint.server_info(), "levels": []}
    for i, concurrency in enumerate(levels):
        log(f"  concurrency {concurrency}: {num_requests} requests" + (f" at {rate:g}/s" if rate else ""))
        result = level(endpoint, texts[i * num_requests:(i + 1) * num_requests], concurrency, output_tokens, rate,
                       slo or {})
        log(f"    {result['output_tokens_per_s']:,.1f} tok/s, TTFT p50 {result['ttft_ms']['p50']} ms, "
            f"TPOT p50 {result['tpot_ms']['p50']} ms, {result['errors']} errors")
        if result["errors"]:
            log(f"    first error: {result['first_error']}")
        if not report["levels"] and not result["completed"]:  # a wrong model or key: nothing to measure
            raise ValueError(f"every request failed; the first: {result['first_error']}")
        report["levels"].append(result)
    return report


def figure_result(report: dict):
    """The sweep as a lab result: latency against throughput, one point per level (drawn by app.lab)."""
    from ..lab import LabResult, Series

    levels = report["levels"]
    x = [row["output_tokens_per_s"] for row in levels]
    text = [f"C={row['concurrency']}" for row in levels]
    series = [Series("TPOT p50 · per request", x, [row["tpot_ms"]["p50"] for row in levels], text=text,
                     kind="lines+markers+text"),
              Series("TTFT p50 · per request", x, [row["ttft_ms"]["p50"] for row in levels], text=text,
                     kind="lines+markers", axis="y2", dash="dot")]
    return LabResult("load-sweep", f"Latency against throughput: {report['model']} at {report['endpoint']}", "",
                     {k: v for k, v in report.items() if k != "levels"}, "output tokens per second (all requests)",
                     "TPOT p50 (ms)", series, [], "", {}, y2_label="TTFT p50 (ms)")


def markdown(report: dict) -> str:
    head = ("| concurrency | req/s | output tok/s | TTFT p50/p90/p99 (ms) | TPOT p50/p90/p99 (ms) | ITL p50/p99 (ms) "
            "| E2E p50 (ms) | goodput (req/s) | errors |")
    lines = [f"Load sweep of {report['model']} at {report['endpoint']} (client-side; {report['requests_per_level']} "
             f"requests per level, ~{report['input_words']} words in, {report['output_tokens']} tokens out"
             + (f", Poisson arrivals at {report['request_rate']:g}/s" if report["request_rate"] else "") + ")", "",
             head, "|" + "---|" * 9]
    if report.get("server_info"):  # how the server says it runs, from its /metrics
        lines[1:1] = ["", "The server says how it runs: " + "; ".join(
            f"{name} " + ", ".join(f"{k}={v or '(none)'}" for k, v in labels.items())
            for name, labels in report["server_info"].items()) + "."]

    def three(p: dict) -> str:
        return "/".join("-" if p.get(k) is None else f"{p[k]:,.1f}" for k in ("p50", "p90", "p99"))

    for row in report["levels"]:
        goodput = "-" if row["goodput"] is None else f"{row['goodput']:.2f}"
        itl = row["itl_ms"]
        lines.append(f"| {row['concurrency']} | {row['request_throughput']:.2f} | {row['output_tokens_per_s']:,.1f} | "
                     f"{three(row['ttft_ms'])} | {three(row['tpot_ms'])} | "
                     f"{itl['p50'] or 0:,.1f}/{itl['p99'] or 0:,.1f} | {row['e2e_ms']['p50'] or 0:,.0f} | {goodput} | "
                     f"{row['errors']} |")
    peaks = [f"{row['concurrency']}: {gauges_text(row['server_peak'])}" for row in report["levels"]
             if row.get("server_peak")]
    if peaks:
        lines += ["", f"The server's own gauges (its /metrics, read every {WATCH_S:g} s), the most seen at each "
                  "concurrency: " + "; ".join(peaks) + "."]
    if report["slo"]:
        lines += ["", "Goodput: requests per second that met " +
                  ", ".join(f"{k.removesuffix('_ms').upper()} ≤ {v:g} ms" for k, v in report["slo"].items()) + "."]
    return "\n".join(lines)


def csv_rows(report: dict) -> list[dict]:
    rows = []
    for row in report["levels"]:
        flat = {k: v for k, v in row.items() if not isinstance(v, dict)}
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            for q, value in row[key].items():
                flat[f"{key.removesuffix('_ms')}_{q}_ms"] = value
        for what, value in (row.get("server_peak") or {}).items():
            flat[f"server_{what}_peak"] = value
        rows.append(flat)
    return rows
