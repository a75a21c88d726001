"""The prefill-side experiments: chunked prefill beside a running chat, prefix caching across the turns
of a chat, eager against fused attention, and tensor parallelism."""
from __future__ import annotations

import torch

from engine import Engine, EngineConfig
from engine.llama import score_matrix_bytes
from engine.tensor_parallel import start

from ..bench.prefill_side import tp_speed
from .lab import Lab, median, r
from .result import LabResult, Series

RUNNING_CHAT = "Tell me a long story about a lighthouse keeper and the ships she guides home."
FOLLOW_UPS = ["Now say the same in two sentences.", "Give one example.", "What is the most important point?"]


def chunked_prefill(lab: Lab, prompt: str) -> LabResult:
    """A long prompt arrives while another chat decodes: each chunk size's TTFT for the long prompt against
    the pauses it puts into the running chat."""
    num_long = lab.size(384, 1536)
    long_ids, chat_ids = lab.tokens(prompt, num_long), lab.tokens(RUNNING_CHAT, 24)
    series, rows = [], []
    for chunk in (64, 256, 0):
        name = f"chunks of {chunk}" if chunk else "whole prompt"
        lab.step(f"{name}: {num_long} prompt tokens beside a decoding chat")
        e = lab.engine.variant(prefix_caching=False)
        longest = min(e.context_window - len(chat_ids), e.config.limits.max_new_tokens)  # ends when cancelled
        chat = e.submit(lab.request(e, chat_ids, longest))
        while chat.num_generated < 4:
            e.step()
        long = e.submit(lab.request(e, long_ids, 1, prefill_chunk=chunk))
        while not long.is_finished:
            e.step()
        for _ in range(3):  # the chat's pace after the prompt is in
            e.step()
        chat.cancel()
        while not chat.is_finished:
            e.step()
        arrived = long.submit_ns
        times = [(ns - arrived) / 1e6 for ns in chat.token_ns]
        gaps = [(b, b - a) for a, b in zip(times, times[1:]) if b > -50]  # from just before it arrived
        series.append(Series(f"{name} · running chat", [r(t, 1) for t, _ in gaps], [r(g, 1) for _, g in gaps],
                             shape="vh"))  # each gap drawn over the time it lasted
        during = [g for t, g in gaps if t > 0]
        rows.append({"setting": name, "long prompt TTFT (ms)": r((long.token_ns[0] - arrived) / 1e6),
                     "chat longest pause (ms)": r(max(during)), "chat median gap (ms)": r(median(during)),
                     "prefill chunks": long.num_prefill_chunks})
    small, mid, whole = rows
    explanation = (f"Prefilled whole, the {num_long}-token prompt got its first token after "
                   f"{whole['long prompt TTFT (ms)']:.0f} ms, and the running chat waited "
                   f"{whole['chat longest pause (ms)']:.0f} ms for its next token. In chunks of 64 the chat never "
                   f"waited more than {small['chat longest pause (ms)']:.0f} ms, since every step decodes it beside "
                   f"one chunk, while the prompt's TTFT grew to {small['long prompt TTFT (ms)']:.0f} ms. This is why "
                   f"vLLM chunks prefill: one long prompt no longer freezes everyone else's stream.")
    effects = timed = {"smaller chunks: shorter pauses in the running chat":
                       small["chat longest pause (ms)"] < whole["chat longest pause (ms)"],
                       "smaller chunks: a later first token for the long prompt":
                       small["long prompt TTFT (ms)"] > whole["long prompt TTFT (ms)"]}
    return LabResult("chunked-prefill", "Chunked prefill: the running chat's gaps while a long prompt is read",
                     prompt, {"long_prompt_tokens": num_long, "chunks": [64, 256, "whole"]},
                     "ms since the long prompt arrived", "running chat: ms between tokens", series, rows,
                     explanation, effects, timed=list(timed))


def prefix_cache(lab: Lab, prompt: str) -> LabResult:
    turns, num_gen = lab.size((2, 12), (3, 24))
    series, rows, ttft = [], [], {}
    for name, reuse in (("no reuse", False), ("prefix cache", True)):
        e = lab.engine.variant(prefix_caching=reuse)
        messages, ttft[name], cached = [{"role": "user", "content": prompt}], [], []
        for turn in range(1, turns + 1):
            lab.step(f"{name}: turn {turn}")
            _, events = lab.run(e, messages, num_gen)
            finished = events[-1]
            ttft[name].append(finished.metrics.ttft_ms)
            cached.append(finished.metrics.num_cached_tokens)
            if reuse:
                rows.append({"turn": turn, "prompt tokens": finished.metrics.num_prompt_tokens,
                             "cached tokens": cached[-1], "TTFT no reuse (ms)": r(ttft["no reuse"][turn - 1]),
                             "TTFT prefix cache (ms)": r(ttft[name][-1])})
            messages += [{"role": "assistant", "content": finished.text},
                         {"role": "user", "content": FOLLOW_UPS[(turn - 1) % len(FOLLOW_UPS)]}]
        series.append(Series(f"{name} · TTFT", list(range(1, turns + 1)), [r(t) for t in ttft[name]]))
        if reuse:
            series.append(Series(f"{name} · cached tokens", list(range(1, turns + 1)), cached, kind="bar", axis="y2"))
    last = rows[-1]
    explanation = (f"On turn {last['turn']} the prompt held {last['prompt tokens']} tokens; with the prefix cache "
                   f"{last['cached tokens']} of them came from the KV of earlier turns and TTFT was "
                   f"{last['TTFT prefix cache (ms)']:.0f} ms, against {last['TTFT no reuse (ms)']:.0f} ms reading the "
                   f"whole conversation again. Each turn then costs only its new tokens.")
    second = rows[1]
    timed = {"the prefix cache lowers the second turn's TTFT":
             second["TTFT prefix cache (ms)"] < second["TTFT no reuse (ms)"]}
    effects = {**timed, "later turns take tokens from the cache": all(row["cached tokens"] > 0 for row in rows[1:])}
    return LabResult("prefix-cache", "Prefix cache: TTFT of each turn of one chat", prompt,
                     {"turns": turns, "new_tokens": num_gen}, "turn", "TTFT (ms)", series, rows, explanation,
                     effects, timed=list(timed), y2_label="prompt tokens from the cache")


def attention(lab: Lab, prompt: str) -> LabResult:
    lengths = lab.size((128, 256, 512), (256, 512, 1024, 2048))
    impls = {"eager (score matrix)": "eager", "sdpa (fused)": "sdpa", "native (paged, fused)": "auto"}
    times: dict[str, list[float]] = {name: [] for name in impls}
    rows = []
    num_heads = lab.engine.loaded.model.config.num_attention_heads
    for length in lengths:
        ids, first = lab.tokens(prompt, length), set()
        for name, impl in impls.items():
            lab.step(f"{name} at {length} tokens")
            e = lab.engine.variant(attention=impl, prefix_caching=False)
            request, events = lab.run(e, ids, 1)
            times[name].append(next(ev.latency_ms for ev in events if ev.type == "PrefillChunk"))
            first.add(request.generated_ids[0])
        rows.append({"prompt tokens": length, **{f"{name} (ms)": r(times[name][-1]) for name in impls},
                     "score matrix per layer (MB)": r(score_matrix_bytes(num_heads, length, length) / 1e6, 1),
                     "same first token": len(first) == 1})
    series = [Series(f"{name} · prefill", list(lengths), [r(t) for t in times[name]]) for name in impls]
    series.append(Series("eager (score matrix) · score matrix MB", list(lengths),
                         [row["score matrix per layer (MB)"] for row in rows], kind="lines", axis="y2", dash="dot"))
    last, first_row = rows[-1], rows[0]
    eager, sdpa = last["eager (score matrix) (ms)"], last["sdpa (fused) (ms)"]
    explanation = (f"At {last['prompt tokens']} tokens eager attention took {eager:.0f} ms and the fused kernel "
                   f"{sdpa:.0f} ms ({eager / sdpa:.1f}x); the score matrix eager attention writes and reads back holds "
                   f"{last['score matrix per layer (MB)']:.0f} MB per layer, against "
                   f"{first_row['score matrix per layer (MB)']:.1f} MB at {first_row['prompt tokens']}: it grows with "
                   f"the square of the prompt. A fused kernel (FlashAttention's idea) computes it in tiles that stay "
                   f"in cache, never the whole matrix.")
    timed = {"eager is slower than fused at the longest prompt": eager > sdpa}
    effects = {**timed,
               "the score matrix grows with the square of the prompt":
               last["score matrix per layer (MB)"] > 3.5 * rows[-2]["score matrix per layer (MB)"],
               "the same first token from every implementation": all(row["same first token"] for row in rows)}
    return LabResult("attention", "Attention: eager against fused, prefill time against prompt length", prompt,
                     {"lengths": list(lengths)}, "prompt tokens", "prefill ms", series, rows, explanation, effects,
                     timed=list(timed), y2_label="score matrix per layer (MB)")


def tensor_parallel(lab: Lab, prompt: str) -> LabResult:
    num_prompt, num_gen = lab.size((256, 8), (512, 32))
    ids = lab.tokens(prompt, num_prompt)
    setups = {"1 rank x 1 thread": (1, 1), "2 ranks x 1 thread": (2, 1), "1 rank x 2 threads": (1, 2)}
    threads_before = torch.get_num_threads()
    rows = []
    try:
        for name, (ranks, threads) in setups.items():
            lab.step(f"{name}: starting")
            runner = start(lab.engine.loaded.model, "fp32", ranks, threads)
            try:
                lab.step(f"{name}: prefill {num_prompt} tokens, decode {num_gen}")
                e = Engine(lab.engine.loaded, EngineConfig(precision="fp32", prefix_caching=False, kv_cache_mb=64),
                           runner=runner)
                rows.append({"setup": name, **tp_speed(e, ids, num_gen, repetitions=1)})
            finally:
                runner.close()
    finally:
        torch.set_num_threads(threads_before)
    bars = [(f"{phase}<br>{row['setup']}", ms, share) for phase, ms_key, share_key, scale in
            (("prefill", "prefill_ms", "prefill_all_reduce_share", 1),
             ("decode step x10", "decode_step_ms", "decode_all_reduce_share", 10))
            for row in rows for ms, share in [(row[ms_key] * scale, row[share_key])]]
    x = [bar for bar, _, _ in bars]
    series = [Series("compute", x, [r(ms * (1 - share), 1) for _, ms, share in bars], kind="bar"),
              Series("all-reduce", x, [r(ms * share, 1) for _, ms, share in bars], kind="bar")]
    one, split, threads = rows
    explanation = (f"Prefill of {num_prompt} tokens took {one['prefill_ms']:.0f} ms on one rank with one thread and "
                   f"{split['prefill_ms']:.0f} ms on two ranks ({one['prefill_ms'] / split['prefill_ms']:.2f}x), "
                   f"{split['prefill_all_reduce_share']:.0%} of it in all-reduce; a decode step spent "
                   f"{split['decode_all_reduce_share']:.0%} of its {split['decode_step_ms']:.1f} ms there. Two threads "
                   f"in one rank on the same cores: {threads['prefill_ms']:.0f} ms. Splitting a layer across devices "
                   f"pays when each slice's compute outweighs the synchronization, as in prefill; a decode step has "
                   f"too little compute per all-reduce.")
    timed = {"two ranks prefill faster than one rank with one thread": split["prefill_ms"] < one["prefill_ms"]}
    effects = {"two ranks spend time in all-reduce": split["prefill_all_reduce_share"] > 0, **timed}
    return LabResult("tensor-parallel", "Tensor parallelism: compute and all-reduce per step", prompt,
                     {"prompt_tokens": num_prompt, "new_tokens": num_gen, "precision": "fp32"}, "",
                     "ms (decode step x10)", series, rows, explanation, effects, timed=list(timed))
