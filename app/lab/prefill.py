"""The prefill-side experiments: chunked prefill beside a running chat, prefix caching across the turns
of a chat, eager against fused attention, and tensor parallelism."""
from __future__ import annotations

import torch

from engine import Engine, EngineConfig, reply_message
from engine.models.llama import score_matrix_bytes
from engine.tensor_parallel import start

from ..bench.prefill_side import tp_speed
from .lab import Lab, median, r
from .result import LabResult, Series, said

RUNNING_CHAT = "Tell me a long story about a lighthouse keeper and the ships she guides home."
FOLLOW_UPS = ["Now say the same in two sentences.", "Give one example.", "What is the most important point?"]


def chunked_prefill(lab: Lab, prompt: str) -> LabResult:
    """A long prompt arrives while another chat decodes: each chunk size's TTFT for the long prompt against
    the pauses it puts into the running chat."""
    num_long = lab.size(384, 1536)
    long_ids, chat_ids = lab.tokens(prompt, num_long), lab.tokens(RUNNING_CHAT, 24)
    series, rows = [], []
    for chunk in (64, 256, 0):
        name = said("lab.set.chunks_of", n=chunk) if chunk else "lab.set.whole_prompt"
        lab.step(said("lab.step.beside_chat", setting=name, tokens=num_long))
        e = lab.variant(prefix_caching=False)
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
        series.append(Series(said("lab.series", setting=name, what="lab.w.running_chat"), [r(t, 1) for t, _ in gaps],
                             [r(g, 1) for _, g in gaps], shape="vh"))  # each gap drawn over the time it lasted
        during = [g for t, g in gaps if t > 0]
        rows.append({"lab.col.setting": name, "lab.col.long_ttft": r((long.token_ns[0] - arrived) / 1e6),
                     "lab.col.longest_pause": r(max(during)), "lab.col.median_gap": r(median(during)),
                     "lab.col.prefill_chunks": long.num_prefill_chunks})
    small, mid, whole = rows
    explanation = said("lab.chunked_prefill.explain", tokens=num_long, whole_ttft=whole["lab.col.long_ttft"],
                       whole_pause=whole["lab.col.longest_pause"], small_pause=small["lab.col.longest_pause"],
                       small_ttft=small["lab.col.long_ttft"])
    effects = timed = {"lab.chunked_prefill.shorter_pauses":
                       small["lab.col.longest_pause"] < whole["lab.col.longest_pause"],
                       "lab.chunked_prefill.later_first_token": small["lab.col.long_ttft"] > whole["lab.col.long_ttft"]}
    return LabResult("chunked-prefill", "lab.chunked_prefill.title",
                     prompt, {"long_prompt_tokens": num_long, "chunks": [64, 256, "whole"]},
                     "lab.w.since_long_prompt", "lab.w.chat_gap", series, rows, explanation, effects, timed=list(timed))


def prefix_cache(lab: Lab, prompt: str) -> LabResult:
    turns, num_gen = lab.size((2, 12), (3, 24))
    series, rows, ttft = [], [], {}
    for name, reuse in (("lab.set.no_reuse", False), ("lab.set.prefix_cache", True)):
        e = lab.variant(prefix_caching=reuse)
        messages, ttft[name], cached = [{"role": "user", "content": prompt}], [], []
        for turn in range(1, turns + 1):
            lab.step(said("lab.step.turn", setting=name, turn=turn))
            request, events = lab.run(e, messages, num_gen)
            finished = events[-1]
            ttft[name].append(finished.metrics.ttft_ms)
            cached.append(finished.metrics.num_cached_tokens)
            if reuse:
                rows.append({"lab.col.turn": turn, "lab.col.prompt_tokens": finished.metrics.num_prompt_tokens,
                             "lab.col.cached_tokens": cached[-1],
                             "lab.col.ttft_no_reuse": r(ttft["lab.set.no_reuse"][turn - 1]),
                             "lab.col.ttft_prefix_cache": r(ttft[name][-1])})
            messages += [reply_message(finished.text, request.generated_ids),  # as the chat sends it back
                         {"role": "user", "content": FOLLOW_UPS[(turn - 1) % len(FOLLOW_UPS)]}]
        series.append(Series(said("lab.series", setting=name, what="TTFT"), list(range(1, turns + 1)),
                             [r(t) for t in ttft[name]]))
        if reuse:
            series.append(Series(said("lab.series", setting=name, what="lab.col.cached_tokens"),
                                 list(range(1, turns + 1)), cached, kind="bar", axis="y2"))
    last = rows[-1]
    explanation = said("lab.prefix_cache.explain", turn=last["lab.col.turn"], tokens=last["lab.col.prompt_tokens"],
                       cached=last["lab.col.cached_tokens"], ttft=last["lab.col.ttft_prefix_cache"],
                       no_reuse=last["lab.col.ttft_no_reuse"])
    second = rows[1]
    timed = {"lab.prefix_cache.lower_ttft": second["lab.col.ttft_prefix_cache"] < second["lab.col.ttft_no_reuse"]}
    effects = {**timed, "lab.prefix_cache.from_cache": all(row["lab.col.cached_tokens"] > 0 for row in rows[1:])}
    return LabResult("prefix-cache", "lab.prefix_cache.title", prompt,
                     {"turns": turns, "new_tokens": num_gen}, "lab.col.turn", "TTFT (ms)", series, rows, explanation,
                     effects, timed=list(timed), y2_label="lab.w.from_cache")


def attention(lab: Lab, prompt: str) -> LabResult:
    lengths = lab.size((128, 256, 512), (256, 512, 1024, 2048))
    # setting: (its attention switch, its column in the table)
    impls = {"lab.set.eager": ("eager", "lab.col.eager_ms"), "lab.set.sdpa": ("sdpa", "lab.col.sdpa_ms"),
             "lab.set.native": ("auto", "lab.col.native_ms")}
    times: dict[str, list[float]] = {name: [] for name in impls}
    rows = []
    num_heads = lab.engine.loaded.model.config.num_attention_heads
    for length in lengths:
        ids, first = lab.tokens(prompt, length), set()
        for name, (impl, _) in impls.items():
            lab.step(said("lab.step.at_tokens", setting=name, tokens=length))
            e = lab.variant(attention=impl, prefix_caching=False)
            request, events = lab.run(e, ids, 1)
            times[name].append(next(ev.latency_ms for ev in events if ev.type == "PrefillChunk"))
            first.add(request.generated_ids[0])
        rows.append({"lab.col.prompt_tokens": length,
                     **{column: r(times[name][-1]) for name, (_, column) in impls.items()},
                     "lab.col.score_matrix_mb": r(score_matrix_bytes(num_heads, length, length) / 1e6, 1),
                     "lab.col.same_first_token": len(first) == 1})
    series = [Series(said("lab.series", setting=name, what="lab.w.prefill"), list(lengths), [r(t) for t in times[name]])
              for name in impls]
    series.append(Series(said("lab.series", setting="lab.set.eager", what="lab.w.score_matrix_mb"), list(lengths),
                         [row["lab.col.score_matrix_mb"] for row in rows], kind="lines", axis="y2", dash="dot"))
    last, first_row = rows[-1], rows[0]
    eager, sdpa = last["lab.col.eager_ms"], last["lab.col.sdpa_ms"]
    explanation = said("lab.attention.explain", tokens=last["lab.col.prompt_tokens"], eager=eager, sdpa=sdpa,
                       ratio=eager / sdpa, mb=last["lab.col.score_matrix_mb"],
                       first_mb=first_row["lab.col.score_matrix_mb"], first_tokens=first_row["lab.col.prompt_tokens"])
    timed = {"lab.attention.eager_slower": eager > sdpa}
    effects = {**timed,
               "lab.attention.square": last["lab.col.score_matrix_mb"] > 3.5 * rows[-2]["lab.col.score_matrix_mb"],
               "lab.attention.same_first_token": all(row["lab.col.same_first_token"] for row in rows)}
    return LabResult("attention", "lab.attention.title", prompt,
                     {"lengths": list(lengths)}, "lab.col.prompt_tokens", "lab.w.prefill_ms", series, rows, explanation,
                     effects, timed=list(timed), y2_label="lab.col.score_matrix_mb")


def tensor_parallel(lab: Lab, prompt: str) -> LabResult:
    num_prompt, num_gen = lab.size((256, 8), (512, 32))
    ids = lab.tokens(prompt, num_prompt)
    setups = {"lab.set.tp_one": (1, 1), "lab.set.tp_two_ranks": (2, 1), "lab.set.tp_two_threads": (1, 2)}
    threads_before = torch.get_num_threads()
    rows = []
    try:
        for name, (ranks, threads) in setups.items():
            lab.step(said("lab.step.starting", setting=name))
            runner = start(lab.engine.loaded.model, "fp32", ranks, threads)
            try:
                lab.step(said("lab.step.prefill_decode", setting=name, prompt=num_prompt, new=num_gen))
                e = Engine(lab.engine.loaded, EngineConfig(precision="fp32", prefix_caching=False, kv_cache_mb=64),
                           runner=runner)
                rows.append({"lab.col.setup": name, **tp_speed(e, ids, num_gen, repetitions=1)})
            finally:
                runner.close()
    finally:
        torch.set_num_threads(threads_before)
    phases = (("lab.w.prefill", "prefill_ms", "prefill_all_reduce_share", 1),
              ("lab.w.decode_x10", "decode_step_ms", "decode_all_reduce_share", 10))
    bars = [(said("lab.w.bar", phase=phase, setup=row["lab.col.setup"]), ms, share)
            for phase, ms_key, share_key, scale in phases for row in rows
            for ms, share in [(row[ms_key] * scale, row[share_key])]]
    x = [bar for bar, _, _ in bars]
    series = [Series("lab.w.compute", x, [r(ms * (1 - share), 1) for _, ms, share in bars], kind="bar"),
              Series("all-reduce", x, [r(ms * share, 1) for _, ms, share in bars], kind="bar")]
    one, split, threads = rows
    explanation = said("lab.tensor_parallel.explain", tokens=num_prompt, one_ms=one["prefill_ms"],
                       split_ms=split["prefill_ms"], speedup=one["prefill_ms"] / split["prefill_ms"],
                       share=split["prefill_all_reduce_share"], decode_share=split["decode_all_reduce_share"],
                       decode_ms=split["decode_step_ms"], threads_ms=threads["prefill_ms"])
    timed = {"lab.tensor_parallel.faster": split["prefill_ms"] < one["prefill_ms"]}
    effects = {"lab.tensor_parallel.all_reduce": split["prefill_all_reduce_share"] > 0, **timed}
    return LabResult("tensor-parallel", "lab.tensor_parallel.title", prompt,
                     {"prompt_tokens": num_prompt, "new_tokens": num_gen, "precision": "fp32"}, "",
                     "lab.w.ms_decode_x10", series, rows, explanation, effects, timed=list(timed))
