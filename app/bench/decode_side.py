"""The decode-side switches, measured: speculative decoding (prompt lookup) against plain decoding on a
prompt that repeats a paragraph and on one that repeats nothing, and decode without a KV cache against
decode with one at the same context."""
from __future__ import annotations

import dataclasses
import statistics

from engine import DecodeStep, Engine, SamplingParams

# a paragraph the bundled 135M model repeats faithfully when asked (in fp32 and int8)
PARAGRAPH = ("The quick brown fox jumps over the lazy dog. Prefill reads the whole prompt in one pass and fills the "
             "KV cache; decode then makes one token per forward pass, reading every weight once for each token. ")
SPECULATION_PROMPTS = {
    "repeat": "Repeat the following paragraph exactly, word for word:\n\n" + PARAGRAPH * 2,
    "no repeats": "Write a short story about a lighthouse keeper who finds a strange map in a bottle.",
}


def _sibling(engine: Engine, **changes) -> Engine:
    """The same loaded model and forward under another engine setting (nothing converted again)."""
    return Engine(engine.loaded, dataclasses.replace(engine.config, **changes), runner=engine.runner)


def speculation(engine: Engine, repetitions: int, max_new_tokens: int = 128) -> dict:
    """Decode tok/s plain and with prompt lookup on each prompt (greedy, the best of `repetitions`
    interleaved runs), whether the text is the same, and what the drafts did."""
    engines = {"plain": _sibling(engine, speculative=None, prefix_caching=False),
               "prompt-lookup": _sibling(engine, speculative="prompt-lookup", prefix_caching=False)}
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


def no_cache(engine: Engine, context: int = 512, num_gen: int = 8, vocab_offset: int = 1000) -> dict:
    """One decode step at `context` tokens of context with the KV cache and without: the median forward
    time and FLOPs of each, and whether the tokens are the same."""
    prompt = [vocab_offset + (i * 7) % 5000 for i in range(context)]
    sampling = SamplingParams(max_new_tokens=num_gen, temperature=0, ignore_eos=True)
    steps, tokens = {}, {}
    for name, e in (("cached", _sibling(engine, prefix_caching=False)), ("no cache", _sibling(engine, kv_cache=False))):
        request = e.new_request_from_ids(prompt, sampling)
        steps[name] = [ev for ev in e.run(request) if isinstance(ev, DecodeStep) and ev.step > 0]
        tokens[name] = request.generated_ids
    ms = {name: statistics.median(s.forward_ms for s in found) for name, found in steps.items()}
    return {"context": context, "cached_step_ms": round(ms["cached"], 2), "no_cache_step_ms": round(ms["no cache"], 1),
            "slower": round(ms["no cache"] / ms["cached"], 1),
            "cached_step_gflop": round(steps["cached"][0].flops / 1e9, 2),
            "no_cache_step_gflop": round(steps["no cache"][0].flops / 1e9, 1),
            "same_tokens": tokens["cached"] == tokens["no cache"]}
