"""The prefill-side switches, measured: prefill's attention as the native kernel, PyTorch's fused SDPA
and the textbook's eager form (the score matrix materialized), at growing prompt lengths; and tensor
parallelism against one rank."""
from __future__ import annotations

import statistics

import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.models.llama import score_matrix_bytes
from engine.tensor_parallel import start

from .extras import interleaved, random_prompt

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
            e = engine.variant(attention=attention, prefix_caching=False)
            best = None
            for _ in range(repetitions):
                request = e.new_request_from_ids(prompt, SamplingParams(max_new_tokens=1, temperature=0))
                *_, finished = e.run(request)
                prefill_ms = finished.metrics.ttft_ms
                best = prefill_ms if best is None else min(best, prefill_ms)
                tokens[attention] = request.generated_ids
            row[attention] = {"prefill_ms": round(best, 1), "tokens_per_s": round(length / best * 1000, 1)}
        heads = engine.runner.num_heads
        row["eager_score_matrix_mb"] = round(score_matrix_bytes(heads, length, length) / 1e6, 1)
        row["sdpa_vs_eager"] = round(row["eager"]["prefill_ms"] / row["sdpa"]["prefill_ms"], 2)
        row["same_first_token"] = len({tuple(t) for t in tokens.values()}) == 1
        report[length] = row
    return report


def int8_prefill_vs_fbgemm(engine: Engine, pp: int, vocab: int, rounds: int = 3) -> dict:
    """int8 prefill of a pp-token prompt through the native int8 matmul and through FBGEMM, rounds
    alternating (the same native attention in both), medians: the first target of the prefill-side issue
    (native ≥ 0.9× FBGEMM). FBGEMM's packed copy is made by a first, unmeasured prefill, and dropped after."""
    e = engine.variant(prefix_caching=False)
    runner = e.runner

    def tokens_per_s(seed: int) -> float:
        request = e.new_request_from_ids(random_prompt(pp, vocab, seed), SamplingParams(max_new_tokens=1),
                                         prefill_chunk=0)
        *_, finished = e.run(request)
        return finished.metrics.prefill_tokens_per_s

    speeds = {"native": [], "FBGEMM": []}
    with runner.fbgemm_linears(keep_copy=True):
        tokens_per_s(seed=1)
    tokens_per_s(seed=1)
    for r in range(rounds):
        speeds["native"].append(tokens_per_s(seed=100 + r))
        with runner.fbgemm_linears(keep_copy=r < rounds - 1):  # packed once, let go after the last round
            speeds["FBGEMM"].append(tokens_per_s(seed=100 + r))
    report = {name: round(statistics.median(values), 1) for name, values in speeds.items()}
    report["native_vs_fbgemm"] = round(statistics.median(a / b for a, b in zip(*speeds.values())), 2)
    return report


def tensor_parallel_vs_one_rank(loaded, pp: int, tg: int, repetitions: int, world: int = 2) -> dict:
    """The honest experiment on one machine, in fp32, all through the same tensor-parallel code: one rank
    with one thread; `world` ranks with one thread each (adding cores as devices); one rank with `world`
    threads (the same cores, shared by threads instead). Prefill pp tokens and decode tg tokens, each with
    its time in all-reduce, the setups in turns (interleaved: a noisy minute hits the three alike; the
    split's workers wait without spinning meanwhile), the best prefill of each; and whether the split model
    gives one rank's logits and greedy tokens."""
    vocab = loaded.model.config.vocab_size
    prompt = random_prompt(pp, vocab, seed=pp)
    one, split = "1 rank x 1 thread", f"{world} ranks x 1 thread"
    setups = {one: (1, 1), split: (world, 1), f"1 rank x {world} threads": (1, world)}
    threads_before = torch.get_num_threads()
    runners: dict[str, object] = {}
    try:
        # the one-rank runners first: start() refuses a second process group, which the split has made
        for name, (ranks, threads) in sorted(setups.items(), key=lambda item: item[1][0]):
            runners[name] = start(loaded.model, "fp32", ranks, threads)
        engines = {name: Engine(loaded, EngineConfig(precision="fp32", prefix_caching=False, kv_cache_mb=256),
                                runner=runner) for name, runner in runners.items()}

        def run(name: str):
            def measure() -> dict:
                torch.set_num_threads(setups[name][1])  # this process runs rank 0 of each setup
                return tp_speed(engines[name], prompt, tg, repetitions=0)
            return measure

        samples = interleaved({name: run(name) for name in setups}, repetitions)
        report, logits, tokens = {}, {}, {}
        for name in setups:
            report[name] = min(samples[name], key=lambda sample: sample["prefill_ms"])
            torch.set_num_threads(setups[name][1])
            cache = runners[name].new_cache(pp + 1)
            logits[name] = runners[name].forward(torch.tensor(prompt), 0, cache)
            request = engines[name].new_request_from_ids(prompt[:64], SamplingParams(max_new_tokens=16, temperature=0))
            *_, finished = engines[name].run(request)
            tokens[name] = request.generated_ids
    finally:
        for runner in runners.values():
            runner.close()
        torch.set_num_threads(threads_before)
    report["prefill_speedup"] = round(report[split]["prefill_tokens_per_s"] / report[one]["prefill_tokens_per_s"], 2)
    report["decode_speedup"] = round(report[split]["decode_tokens_per_s"] / report[one]["decode_tokens_per_s"], 2)
    report["max_logit_difference"] = float((logits[split] - logits[one]).abs().max())
    report["same_greedy_tokens"] = tokens[split] == tokens[one]
    return report


def tp_speed(engine: Engine, prompt: list[int], tg: int, repetitions: int) -> dict:
    """Prefill of the prompt and decode of tg tokens after it: the best of repetitions (after a warm-up),
    with the share of each in collectives."""
    best = None
    for _ in range(repetitions + 1):
        events = list(engine.run(engine.new_request_from_ids(
            prompt, SamplingParams(max_new_tokens=tg, temperature=0, ignore_eos=True))))
        chunk = next(e for e in events if e.type == "PrefillChunk")
        steps = [e for e in events if e.type == "DecodeStep" and e.step > 0]
        prefill = (chunk.latency_ms, chunk.comm_ms)
        decode = (statistics.median(s.forward_ms for s in steps), statistics.median(s.comm_ms for s in steps))
        if best is None or prefill[0] < best[0][0]:
            best = (prefill, decode)
    (prefill_ms, prefill_comm), (step_ms, step_comm) = best
    return {"prefill_ms": round(prefill_ms, 1), "prefill_tokens_per_s": round(len(prompt) / prefill_ms * 1000, 1),
            "prefill_all_reduce_share": round(prefill_comm / prefill_ms, 3),
            "decode_step_ms": round(step_ms, 2), "decode_tokens_per_s": round(1000 / step_ms, 1),
            "decode_all_reduce_share": round(step_comm / step_ms, 3)}
