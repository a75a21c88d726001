"""The metric definitions, in one place. They follow vLLM's benchmark definitions:

- TTFT: submit -> first generated token available (templating, queueing, prefill, first sample).
- ITL: the gap between two successive generated tokens; one value per token after the first.
- TPOT: (E2E - TTFT) / (output tokens - 1); defined only with two or more output tokens.
- E2E: submit -> last token. Throughput: output tokens / E2E.
- Prefill tokens/s: prompt tokens prefilled (not taken from the cache) / prefill forward time
  (llama.cpp's `prompt_per_second`).
- Decode tokens/s: (output tokens - 1) / (E2E - TTFT), i.e. 1000 / TPOT.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

NS_PER_MS = 1_000_000


def ttft_ms(submit_ns: int, token_ns: Sequence[int]) -> float | None:
    return (token_ns[0] - submit_ns) / NS_PER_MS if token_ns else None


def itl_ms(token_ns: Sequence[int]) -> list[float]:
    return [(b - a) / NS_PER_MS for a, b in zip(token_ns, token_ns[1:])]


def e2e_ms(submit_ns: int, token_ns: Sequence[int], end_ns: int | None = None) -> float:
    last = token_ns[-1] if token_ns else end_ns
    return (last - submit_ns) / NS_PER_MS if last is not None else 0.0


def tpot_ms(submit_ns: int, token_ns: Sequence[int]) -> float | None:
    if len(token_ns) < 2:
        return None
    return (e2e_ms(submit_ns, token_ns) - ttft_ms(submit_ns, token_ns)) / (len(token_ns) - 1)


def per_second(count: int, duration_ms: float | None) -> float | None:
    if not duration_ms or duration_ms <= 0 or count <= 0:
        return None
    return count * 1000.0 / duration_ms


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    return {f"p{q}": percentile(values, q) for q in (50, 90, 99)}


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """The summary of one request, with the names of shared/REFERENCE.md."""

    num_prompt_tokens: int
    num_cached_tokens: int
    num_generated_tokens: int
    ttft_ms: float | None
    tpot_ms: float | None
    e2e_ms: float
    prefill_ms: float
    decode_ms: float
    prefill_tokens_per_s: float | None
    decode_tokens_per_s: float | None
    throughput_tokens_per_s: float | None
    kv_tokens: int
    kv_bytes: int
    itl_ms: list[float] = field(default_factory=list)

    @property
    def itl_percentiles_ms(self) -> dict[str, float | None]:
        return percentiles(self.itl_ms)


def request_metrics(
    *,
    submit_ns: int,
    token_ns: Sequence[int],
    end_ns: int,
    prefill_ms: float,
    num_prompt_tokens: int,
    num_cached_tokens: int,
    kv_tokens: int,
    kv_bytes: int,
) -> RequestMetrics:
    first = ttft_ms(submit_ns, token_ns)
    total = e2e_ms(submit_ns, token_ns, end_ns)
    decode = total - first if first is not None else 0.0
    computed = num_prompt_tokens - num_cached_tokens
    return RequestMetrics(
        num_prompt_tokens=num_prompt_tokens,
        num_cached_tokens=num_cached_tokens,
        num_generated_tokens=len(token_ns),
        ttft_ms=first,
        tpot_ms=tpot_ms(submit_ns, token_ns),
        e2e_ms=total,
        prefill_ms=prefill_ms,
        decode_ms=decode,
        prefill_tokens_per_s=per_second(computed, prefill_ms),
        decode_tokens_per_s=per_second(len(token_ns) - 1, decode),
        throughput_tokens_per_s=per_second(len(token_ns), total),
        kv_tokens=kv_tokens,
        kv_bytes=kv_bytes,
        itl_ms=itl_ms(token_ns),
    )


def session_summary(metrics: Sequence[RequestMetrics]) -> dict[str, dict[str, float | None]]:
    """p50/p90/p99 of TTFT, TPOT, ITL and E2E over several requests."""
    ttfts = [m.ttft_ms for m in metrics if m.ttft_ms is not None]
    tpots = [m.tpot_ms for m in metrics if m.tpot_ms is not None]
    itls = [v for m in metrics for v in m.itl_ms]
    return {
        "ttft_ms": percentiles(ttfts),
        "tpot_ms": percentiles(tpots),
        "itl_ms": percentiles(itls),
        "e2e_ms": percentiles([m.e2e_ms for m in metrics]),
    }
