"""The prefill-side switches, measured: prefill's attention as the native kernel, PyTorch's fused SDPA
and the textbook's eager form (the score matrix materialized), at growing prompt lengths."""
from __future__ import annotations

from engine import Engine, SamplingParams
from engine.llama import score_matrix_bytes

from .extras import random_prompt, sibling

IMPLEMENTATIONS = ("auto", "sdpa", "eager")


def attention_impls(engine: Engine, lengths: tuple[int, ...], vocab: int, repetitions: int = 1) -> dict:
    """Prefill time of a random prompt of each length with each attention implementation (the best of
    `repetitions`), the score matrix eager attention holds for one layer, and whether the greedy token
    after the prompt is the same."""
    report = {}
    for length in lengths:
        prompt = random_prompt(length, vocab, seed=length)
        row, tokens = {}, {}
        for attention in IMPLEMENTATIONS:
            e = sibling(engine, attention=attention, prefix_caching=False)
            best = None
            for _ in range(repetitions):
                request = e.new_request_from_ids(prompt, SamplingParams(max_new_tokens=1, temperature=0))
                *_, finished = e.run(request)
                prefill_ms = finished.metrics.ttft_ms
                best = prefill_ms if best is None else min(best, prefill_ms)
                tokens[attention] = request.generated_ids
            row[attention] = {"prefill_ms": round(best, 1), "tokens_per_s": round(length / best * 1000, 1)}
        engine.runner.attention = engine.config.attention  # the siblings share the engine's forward
        heads = engine.runner.num_heads
        row["eager_score_matrix_mb"] = round(score_matrix_bytes(heads, length, length) / 1e6, 1)
        row["sdpa_vs_eager"] = round(row["eager"]["prefill_ms"] / row["sdpa"]["prefill_ms"], 2)
        row["same_first_token"] = len({tuple(t) for t in tokens.values()}) == 1
        report[length] = row
    return report
