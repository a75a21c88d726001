"""The decode-side switches, measured: speculative decoding (prompt lookup) against plain decoding on a
prompt that repeats a paragraph and on one that repeats nothing, and decode without a KV cache against
decode with one at the same context."""
from __future__ import annotations

import math
import statistics
import time

import torch

from engine import DecodeStep, Engine, SamplingParams

from .extras import ReadProbe, interleaved
from .texts import LONG_TEXT, SPECULATION_PROMPTS


def speculation(engine: Engine, repetitions: int, max_new_tokens: int = 128) -> dict:
    """Decode tok/s plain and with prompt lookup on each prompt (greedy, the best of `repetitions`
    interleaved runs), whether the text is the same, and what the drafts did."""
    engines = {"plain": engine.variant(speculative=None, prefix_caching=False),
               "prompt-lookup": engine.variant(speculative="prompt-lookup", prefix_caching=False)}
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0)
    report = {}
    for kind, prompt in SPECULATION_PROMPTS.items():
        best: dict[str, tuple[float, object]] = {}
        for _ in range(repetitions):
            for name, e in engines.items():
                finished = list(e.stream([{"role": "user", "content": prompt}], sampling))[-1]
                speed = finished.metrics.decode_tokens_per_s or 0.0
                if name not in best or speed > best[name][0]:
                    best[name] = (speed, finished)
        (plain, plain_end), (spec, spec_end) = best["plain"], best["prompt-lookup"]
        drafts = spec_end.speculation
        report[kind] = {"plain_tokens_per_s": round(plain, 1), "speculative_tokens_per_s": round(spec, 1),
                        "speedup": round(spec / plain, 2) if plain else None,
                        "same_text": plain_end.text == spec_end.text,
                        "tokens": spec_end.metrics.num_generated_tokens, "drafted": drafts.drafted,
                        "accepted": drafts.accepted, "tokens_per_forward": round(drafts.tokens_per_forward or 0, 2)}
    return report


def at_depth(engine: Engine, prompt: list[int], num_gen: int, repetitions: int) -> list[float]:
    """Decode tok/s of num_gen tokens after `prompt` is in the cache (llama-bench's tg at depth -d), one
    sample per repetition; the prompt's own prefill is left out."""
    sampling = SamplingParams(max_new_tokens=num_gen, temperature=0, ignore_eos=True)
    samples = []
    for _ in range(repetitions + 1):  # the first run warms up
        *_, finished = engine.run(engine.new_request_from_ids(prompt, sampling))
        samples.append(finished.metrics.decode_tokens_per_s or 0.0)
    return samples[1:]


def prefill_at_depth(engine: Engine, context: list[int], prompts: list[list[int]]) -> list[float]:
    """Prefill tok/s of each prompt after `context` is in the cache (llama-bench's pp at depth -d): the
    context is cached first (prefix caching), then context + prompt is sent and only the prompt is
    prefilled. One sample per prompt; the prompts differ, so none is cached from an earlier sample."""
    sampling = SamplingParams(max_new_tokens=1, temperature=0)
    e = engine.variant(prefix_caching=True)
    samples = []
    for prompt in prompts:
        list(e.run(e.new_request_from_ids(context or prompt[:1], sampling)))  # the context into the cache
        *_, finished = e.run(e.new_request_from_ids(context + prompt, sampling))
        samples.append(finished.metrics.prefill_tokens_per_s or 0.0)
    return samples


def kv_variants(engine: Engine, window: int | None = None) -> dict[str, Engine]:
    """The engine with its KV cache in each format the native step reads, and, with window, an fp32
    cache that keeps only 4 sink tokens and the last `window`."""
    variants = {f"KV {kv}": engine.variant(kv_dtype=kv) for kv in ("fp32", "fp16", "int8")}
    if window:
        variants[f"KV window {window} + 4 sinks"] = engine.variant(kv_dtype="fp32", kv_window=window, kv_sinks=4,
                                                            prefix_caching=False)
    return variants


def teacher_forced(e: Engine, ids: list[int]) -> tuple[float, list[int], list[float], list[int]]:
    """Feed ids token by token through decode steps, which read the cache as the engine keeps it (a sliding
    window slides): the perplexity of ids, the most likely next token at each position, and each step's
    time (ms) and the cache's bytes after it."""
    cache = e.pool.allocate([], e.kv_limit or len(ids))
    nll, best, step_ms, kv_bytes = 0.0, [], [], []
    try:
        for position, token in enumerate(ids[:-1]):
            if e.kv_limit is not None and cache.num_tokens == cache.capacity_tokens:
                cache.slide(e.sink_blocks)
            start = time.perf_counter()
            logits = e.runner.decode([token], [cache.num_tokens], [cache])[0].float()
            best.append(int(logits.argmax()))  # on a GPU: waits for the step, so the time below is its own
            step_ms.append((time.perf_counter() - start) * 1000)
            kv_bytes.append(cache.bytes_used)
            nll -= float(torch.log_softmax(logits, -1)[ids[position + 1]])
    finally:
        e.pool.free(cache)
    return math.exp(nll / (len(ids) - 1)), best, step_ms, kv_bytes


def long_text_ids(engine: Engine, max_tokens: int = 3000) -> list[int]:
    """The first max_tokens tokens of the fixed long text."""
    return engine.tokenizer(LONG_TEXT.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"][:max_tokens]


def _against(reference: tuple[float, list[int]], run: tuple[float, list[int]]) -> dict:
    """A teacher-forced run (perplexity, most likely next tokens) against the reference's."""
    (reference_ppl, expected), (ppl, best) = reference, run
    return {"perplexity": round(ppl, 3), "vs_fp32": round(ppl / reference_ppl, 4),
            "top1_agreement": round(sum(a == b for a, b in zip(best, expected)) / len(best), 4)}


def kv_quality(variants: dict[str, Engine], ids: list[int], reference: tuple[float, list[int]]) -> dict:
    """Each KV format against fp32's over ids (the long text) fed token by token (teacher forcing through
    decode steps, which read the cache): perplexity, and how often its most likely next token is the one
    fp32's is. reference: teacher_forced's perplexity and next tokens for variants["KV fp32"]."""
    report = {"tokens": len(ids), "KV fp32": {"perplexity": round(reference[0], 3)}}
    for name, e in variants.items():
        if name != "KV fp32":
            report[name] = {**_against(reference, teacher_forced(e, ids)[:2]),
                            "bytes_per_token": e.info.kv_bytes_per_token}
    return report


def weights_quality(reference: tuple[float, list[int]], run: tuple[float, list[int]]) -> dict:
    """A precision (int8, fp16...) against fp32, both teacher-forced over the long text with an fp32 cache:
    the ratio of the perplexities, and how often its most likely next token is fp32's. Thousands of
    positions, where quality_vs's 116 move by points with any change of float summation order (a last-bit
    difference can flip an int8 rounding in the next layer)."""
    return {"tokens": len(run[1]) + 1, **_against(reference, run), "fp32_perplexity": round(reference[0], 3)}


def no_cache(engine: Engine, context: int = 512, num_gen: int = 8, vocab_offset: int = 1000) -> dict:
    """One decode step at `context` tokens of context with the KV cache and without: the median forward
    time and FLOPs of each, and whether the tokens are the same."""
    prompt = [vocab_offset + (i * 7) % 5000 for i in range(context)]
    sampling = SamplingParams(max_new_tokens=num_gen, temperature=0, ignore_eos=True)
    steps, tokens = {}, {}
    for name, e in (("cached", engine.variant(prefix_caching=False)), ("no cache", engine.variant(kv_cache=False))):
        request = e.new_request_from_ids(prompt, sampling)
        steps[name] = [ev for ev in e.run(request) if isinstance(ev, DecodeStep) and ev.step > 0]
        tokens[name] = request.generated_ids
    ms = {name: statistics.median(s.forward_ms for s in found) for name, found in steps.items()}
    return {"context": context, "cached_step_ms": round(ms["cached"], 2), "no_cache_step_ms": round(ms["no cache"], 1),
            "slower": round(ms["no cache"] / ms["cached"], 1),
            "cached_step_gflop": round(steps["cached"][0].flops / 1e9, 2),
            "no_cache_step_gflop": round(steps["no cache"][0].flops / 1e9, 1),
            "same_tokens": tokens["cached"] == tokens["no cache"]}


def flash_decoding(engine: Engine, contexts: tuple[int, ...] = (4096, 8000), num_gen: int = 16, rounds: int = 5,
                   short: int = 16) -> dict:
    """Flash Decoding (split_kv) against one task per KV group, at each context length: the median decode
    step (forward) in each, and the attention over the cache: the step's attention stage (the native
    step's own clock) less that stage at `short` tokens of context, which leaves out the projections
    and everything else that does not grow with the context, in interleaved rounds. (Taken from whole
    steps, a few milliseconds of drift in the rest of a 25-35 ms step moved the ratio by tenths.) Each
    context is in each setting's cache from the first round on (prefix caching), so a round is its
    decode steps.

    The attention streams the cache from memory: each setting's rate of reading it (the cache's bytes over
    the attention's time) is reported beside the machine's own read rate with one thread and with all of
    them, measured in the same rounds. Unsplit, the last KV group's task reads alone while the other
    threads wait; where one thread alone draws most of what all of them can, that wait leaves little of
    the memory's bandwidth unused, and the split little to gain (see the README's *Measured*)."""
    contexts = tuple(c for c in contexts if c + num_gen <= engine.context_window)
    sampling = SamplingParams(max_new_tokens=num_gen, temperature=0, ignore_eos=True)
    settings = {"unsplit": engine.variant(split_kv=False, prefix_caching=True),
                "split": engine.variant(split_kv=True, prefix_caching=True)}

    def run(e: Engine, context: int):
        prompt = [1000 + (i * 7) % 5000 for i in range(context)]

        def sample() -> tuple[float, float]:  # the median step and its median attention stage (ms)
            request = e.new_request_from_ids(prompt, sampling)
            request.time_stages = True
            steps = [ev for ev in e.run(request) if isinstance(ev, DecodeStep)][1:]  # step 0: the prefill's token
            return (statistics.median(s.forward_ms for s in steps),
                    statistics.median(s.stage_ms["attention"] for s in steps))
        return sample

    probe = ReadProbe()
    runs = {(name, c): run(e, c) for name, e in settings.items() for c in (short, *contexts)}
    runs |= {("read", k): (lambda k=k: probe.gb_s(k)) for k in probe.threads}
    samples = interleaved(runs, rounds)
    machine = ReadProbe.labels({k: statistics.median(samples[("read", k)]) for k in probe.threads})
    ms = {key: statistics.median(v[0] for v in values) for key, values in samples.items() if key[0] != "read"}
    stage = {key: statistics.median(v[1] for v in values) for key, values in samples.items() if key[0] != "read"}
    report = {}
    bytes_per_token = settings["split"].pool.bytes_per_token
    for c in contexts:
        attention = {name: stage[(name, c)] - stage[(name, short)] for name in settings}
        read_gb_s = {name: round(bytes_per_token * (c - short) / (attention[name] * 1e6), 1) if attention[name] > 0
                     else None for name in settings}
        report[c] = {"unsplit_step_ms": round(ms[("unsplit", c)], 2), "split_step_ms": round(ms[("split", c)], 2),
                     "unsplit_attention_ms": round(attention["unsplit"], 2),
                     "split_attention_ms": round(attention["split"], 2),
                     "attention_speedup": round(attention["unsplit"] / attention["split"], 2)
                     if attention["split"] > 0 else None,
                     "kv_read_gb_s": read_gb_s, "machine_read_gb_s": machine}
    return report
