"""The scheduler's part of `phasescope bench`: several requests decoding together, a second chat turn
with and without prefix caching, and what the scheduler itself costs a request alone.

Every figure is a ratio within one run, with the settings measured in interleaved rounds so that the
machine's drift hits them alike.
"""
from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from engine import Engine, SamplingParams, reply_message

from .extras import bare_loop, interleaved

FIRST_TURN = ("Prefill reads the whole prompt in one forward pass and fills the KV cache; decode then adds one "
              "token per step, reading every weight and the cache once per token. ")


def _prompts(num: int, num_tokens: int, vocab: int) -> list[list[int]]:
    """Distinct random prompts (one per request), as llama-bench uses random tokens."""
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(100, vocab, (num_tokens,), generator=generator).tolist() for _ in range(num)]


def concurrency(engine: Engine, levels: list[int], num_gen: int, repetitions: int, vocab: int) -> dict:
    """B requests at once for each B in levels: aggregate decode tok/s (and output tok/s, prefill
    included) and per-request TPOT, against one request alone; and whether every request produced the
    same tokens as when it ran alone."""
    sampling = SamplingParams(max_new_tokens=num_gen, temperature=0, ignore_eos=True)
    # 16 tokens: a prompt of one block is never taken from the prefix cache (its last token is always
    # computed), so each level prefills the same work
    prompts = _prompts(max(levels), 16, vocab)
    alone = [engine.run_all([engine.new_request_from_ids(p, sampling)])[0].text for p in prompts]

    def measure(batch: int) -> Callable[[], tuple[float, float, float, bool]]:
        def run() -> tuple[float, float, float, bool]:
            requests = [engine.new_request_from_ids(p, sampling) for p in prompts[:batch]]
            start = time.perf_counter()
            finished = engine.run_all(requests)
            elapsed = time.perf_counter() - start
            metrics = [f.metrics for f in finished]
            # decode throughput: decode tokens over the span the batch spent decoding, from the step after
            # the last prefill (every first token comes from the step that admits them all) to the last token;
            # one request's own decode span would count the prefills of those admitted after it
            decoding_ns = max(r.token_ns[-1] for r in requests) - max(r.token_ns[0] for r in requests)
            decode = sum(len(r.token_ns) - 1 for r in requests) * 1e9 / decoding_ns
            return (decode, batch * num_gen / elapsed, statistics.fmean(m.tpot_ms for m in metrics),
                    [f.text for f in finished] == alone[:batch])
        return run

    samples = interleaved({b: measure(b) for b in levels}, max(repetitions, 5))  # cheap: steadier medians
    out = {}
    for batch, values in samples.items():
        out[batch] = {"decode_tokens_per_s": round(statistics.median(v[0] for v in values), 1),
                      "output_tokens_per_s": round(statistics.median(v[1] for v in values), 1),
                      "tpot_ms": round(statistics.median(v[2] for v in values), 2),
                      "same_tokens_as_alone": all(v[3] for v in values)}
    base = out[levels[0]]
    for values in out.values():
        values["decode_vs_1"] = round(values["decode_tokens_per_s"] / base["decode_tokens_per_s"], 2)
        values["tpot_vs_1"] = round(values["tpot_ms"] / base["tpot_ms"], 2)
    return out


@contextmanager
def _prefix_caching(engine: Engine, enabled: bool) -> Iterator[None]:
    previous, engine.pool.prefix_caching = engine.pool.prefix_caching, enabled
    try:
        yield
    finally:
        engine.pool.prefix_caching = previous


def _first_turn_text(engine: Engine, num_tokens: int) -> str:
    text = FIRST_TURN
    while len(engine.tokenizer(text)["input_ids"]) < num_tokens:
        text += FIRST_TURN
    return text


def second_turn(engine: Engine, first_tokens: int, repetitions: int, reply_tokens: int = 32) -> dict:
    """TTFT of a chat's second turn after a first turn of first_tokens, with and without prefix caching,
    against the TTFT of the same second message sent alone in a fresh chat. Each sample is a chat of its
    own (its first turn numbered), so that what is cached is that chat's first turn and reply, as in the
    app, and never an earlier sample's second turn."""
    greedy = SamplingParams(max_new_tokens=reply_tokens, temperature=0)
    text = _first_turn_text(engine, first_tokens)
    chats = itertools.count(1)
    question = {"role": "user", "content": "Which of the two phases sets the TTFT?"}

    def ttft(messages: list[dict]) -> tuple[float, int, int]:
        m = engine.generate(messages, SamplingParams(max_new_tokens=1, temperature=0)).metrics
        return m.ttft_ms, m.num_prompt_tokens, m.num_cached_tokens

    def turn(caching: bool) -> Callable[[], tuple[float, int, int]]:
        def run() -> tuple[float, int, int]:
            with _prefix_caching(engine, caching):
                first = [{"role": "user", "content": f"Chat {next(chats)}. {text}"}]
                request = engine.new_request(first, greedy)  # the first turn; its blocks stay in the pool
                reply = engine.run_all([request])[0].text
                return ttft(first + [reply_message(reply, request.generated_ids), question])  # as the chat does
        return run

    def fresh() -> tuple[float, int, int]:
        with _prefix_caching(engine, False):
            return ttft([question])

    samples = interleaved({"with prefix cache": turn(True), "without": turn(False), "alone": fresh}, repetitions)
    out = {name: {"ttft_ms": round(statistics.median(v[0] for v in values), 2),
                  "prompt_tokens": round(statistics.median(v[1] for v in values)),
                  "cached_tokens": round(statistics.median(v[2] for v in values))} for name, values in samples.items()}
    for name in ("with prefix cache", "without"):
        out[name]["vs_alone"] = round(out[name]["ttft_ms"] / out["alone"]["ttft_ms"], 2)
    return out


def scheduler_cost(engine: Engine, prompt: list[int], num_gen: int, repetitions: int) -> dict:
    """One request through the scheduler (submit, step, events) against the same forwards called
    directly in a loop with greedy picks: what the scheduler costs a request alone."""
    runner = engine.runner
    sampling = SamplingParams(max_new_tokens=num_gen, temperature=0, ignore_eos=True)

    def through_engine() -> tuple[float, float]:
        m = engine.run_all([engine.new_request_from_ids(prompt, sampling)])[0].metrics
        return m.prefill_tokens_per_s, m.decode_tokens_per_s

    samples = interleaved({"scheduler": through_engine, "bare": lambda: bare_loop(runner, prompt, num_gen)},
                          repetitions)
    pp = {name: statistics.median(v[0] for v in values) for name, values in samples.items()}
    tg = {name: statistics.median(v[1] for v in values) for name, values in samples.items()}
    return {"prefill_vs_bare_loop": round(pp["scheduler"] / pp["bare"], 3),
            "decode_vs_bare_loop": round(tg["scheduler"] / tg["bare"], 3),
            "decode_tokens_per_s": round(tg["scheduler"], 1), "prefill_tokens_per_s": round(pp["scheduler"], 1)}
