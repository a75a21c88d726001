"""The engine as a scheduler: continuous batching, the paged KV pool, prefix caching."""
from __future__ import annotations

import queue
import threading
from contextlib import nullcontext

import pytest
import torch

from conftest import shape, tiny_model, user
from engine import (FORWARD_STAGES, DecodeStep, Engine, EngineConfig, Finished, KVPool, KVPoolTooSmall,
                    PrefillChunk, SamplingParams, Started, WAKE)

PROMPTS = ["The cat sat on the mat.", "Tell me about the sea, please.", "One two three four five six",
           "Why is the sky blue?", "Prefill then decode.", "A longer prompt that takes a few more tokens to say.",
           "Hello", "What is a KV cache, and why does decode need one?"]

FP32 = EngineConfig(precision="fp32")  # exact comparisons need the reference precision


BLOCK_MB = 2 * 2 * 2 * 16 * 4 * 16 / 1e6  # the tiny model's 16-token block: K and V, 2 layers, 2 heads, 16 dims


def greedy(max_new: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True)


def run_staggered(engine: Engine, prompts: list[str], max_new: list[int], join_at: list[int]):
    """Submit request i once step join_at[i] has run; step until all are done. Returns each
    request's events and the requests."""
    requests = [engine.new_request(user(p), greedy(n)) for p, n in zip(prompts, max_new)]
    events = {r.request_id: [] for r in requests}
    step = 0
    while step == 0 or not all(r.is_finished for r in requests):
        for request, at in zip(requests, join_at):
            if at == step:
                engine.submit(request, [events[request.request_id].append])
        engine.step()
        step += 1
    return [events[r.request_id] for r in requests], requests


def alone(engine: Engine, prompt: str, max_new: int) -> list[int]:
    request = engine.new_request(user(prompt), greedy(max_new))
    list(engine.run(request))
    return request.generated_ids


@pytest.mark.parametrize("precision, path", [("fp32", "fused C++"), ("int8", "fused C++"), ("fp32", "PyTorch ops"),
                                             ("int8", "PyTorch ops")])
@pytest.mark.parametrize("batch, hidden", [(1, 64), (2, 64), (3, 256), (5, 64), (8, 256)])  # head dim 16 or 64
def test_batched_tokens_equal_alone_with_requests_joining_and_leaving(tokenizer, precision, path, batch, hidden):
    # no prefix reuse here: this test isolates batching (reuse has its own tests below)
    loaded = tiny_model(tokenizer, hidden=hidden)
    engine = Engine(loaded, EngineConfig(precision=precision, prefix_caching=False))
    switch = engine.runner.pytorch_decode() if path == "PyTorch ops" else nullcontext()
    prompts, max_new = PROMPTS[:batch], [6 + 3 * (i % 3) for i in range(batch)]
    join_at = [2 * i for i in range(batch)]  # each joins two steps after the one before
    with switch:
        assert path == engine.runner.decode_path
        expected = [alone(engine, p, n) for p, n in zip(prompts, max_new)]
        events, requests = run_staggered(engine, prompts, max_new, join_at)
    assert expected == [r.generated_ids for r in requests]
    for request, stream, n in zip(requests, events, max_new):
        prompt = request.num_prompt_tokens
        assert [("Started",), ("prefill", 0, prompt), ("FirstToken",), *[("decode", i) for i in range(n)],
                ("Finished",)] == shape(stream)
        finished = stream[-1]
        assert ("length", n, prompt) == (finished.reason, finished.metrics.num_generated_tokens,
                                         finished.metrics.num_prompt_tokens)
        assert finished.metrics.tpot_ms > 0 and finished.metrics.ttft_ms > 0
    sizes = [e.batch_size for stream in events for e in stream if isinstance(e, DecodeStep) and e.step > 0]
    assert (max(sizes) > 1) == (batch > 1)  # requests whose lifetimes overlap decode together
    assert 1 == min(sizes)  # the last one ends alone


def test_a_request_cancelled_mid_batch_leaves_the_others_untouched(tokenizer):
    engine = Engine(tiny_model(tokenizer), FP32)
    expected = [alone(engine, p, 12) for p in PROMPTS[:3]]
    requests = [engine.new_request(user(p), greedy(12)) for p in PROMPTS[:3]]
    cancel_at_3 = lambda e: requests[1].cancel() if isinstance(e, DecodeStep) and e.step == 3 else None  # noqa: E731
    seen = []
    finished = engine.run_all(requests, hooks=[seen.append])
    assert ["length", "length", "length"] == [f.reason for f in finished]
    requests = [engine.new_request(user(p), greedy(12)) for p in PROMPTS[:3]]
    for request in requests:
        engine.submit(request, [cancel_at_3] if request is requests[1] else [])
    while not all(r.is_finished for r in requests):
        engine.step()
    assert ["finished", "stopped", "finished"] == [r.status for r in requests]
    assert 4 == requests[1].num_generated
    assert [expected[0], expected[2]] == [requests[0].generated_ids, requests[2].generated_ids]
    assert 0 == engine.kv_usage().num_used  # every block went back


def test_prefix_reuse_across_turns_is_exact(tokenizer):
    loaded = tiny_model(tokenizer, max_positions=1024)
    # fp32: in int8 the reply's rows, written by decode steps, differ in the last bits from a prefill of
    # the same text, which int8's rounding of activations can turn into other tokens
    cached, fresh = Engine(loaded, FP32), Engine(loaded, EngineConfig(precision="fp32", prefix_caching=False))
    conversation = user("Explain prefill and decode in detail. " * 4)
    previous = 0  # the previous turn's prompt tokens
    for turn in range(3):
        first = cached.generate(conversation, greedy(20))
        second = fresh.generate(conversation, greedy(20))
        assert first.text == second.text  # identical greedy tokens with and without reuse
        assert 0 == second.metrics.num_cached_tokens
        if turn == 0:
            assert 0 == first.metrics.num_cached_tokens
        else:  # the earlier turns (prompt and reply) came from the pool, to the token (a part-filled last
            # block too); only the rest was prefilled
            assert first.metrics.num_cached_tokens >= previous
        previous = first.metrics.num_prompt_tokens
        conversation = conversation + [{"role": "assistant", "content": first.text},
                                       {"role": "user", "content": f"And turn {turn + 2}?"}]


def test_a_part_filled_last_block_is_reused_by_a_copy():
    pool = KVPool(num_layers=2, num_kv_heads=1, head_dim=4, num_blocks=6, block_size=4, dtype=torch.float32)
    tokens = list(range(1, 11))  # 10 tokens: two full blocks and 2 rows of a third
    first = pool.allocate(tokens, 12)
    rows = torch.arange(2 * 1 * 10 * 4, dtype=torch.float32).view(2, 1, 10, 4)
    for layer in range(2):
        first.write_kv(layer, 0, rows + 1000 * layer)
    pool.name_full_blocks(first, tokens)
    pool.free(first, tokens)
    # a continuation: the two full blocks held, the third's 2 rows copied into a block of its own
    second = pool.allocate(tokens + [11, 12], 14)
    assert 10 == second.num_tokens and first.block_ids != second.block_ids
    for layer in range(2):
        keys, values = second.layer_kv(layer, 10)
        assert torch.equal(torch.stack([keys, values]), rows + 1000 * layer)
    pool.free(second)
    assert 9 == pool.allocate(tokens[:9] + [99], 12).num_tokens  # diverges after one row: one row copied
    assert 9 == pool.allocate(tokens, 12).num_tokens  # the prompt's last token is always computed
    assert 6 == pool.allocate(tokens[:6] + [99, 98, 97], 12).num_tokens  # part of a full block, too


@pytest.mark.parametrize("pool_dtype, rows_dtype", [(torch.float32, torch.float16),
                                                     (torch.float16, torch.bfloat16)])
def test_half_precision_rows_go_into_a_cache_of_another_format_on_scattered_blocks(pool_dtype, rows_dtype):
    """fp16 or bf16 activations with an fp32 or fp16 cache (--kv-dtype): a slice of the pool converts what
    it is given, indices (a sequence's blocks not in a row) refused it, which failed the Lab's kv-compression
    run under --precision fp16."""
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=6, block_size=2, dtype=pool_dtype)
    first, second = pool.allocate([], 4), pool.allocate([], 2)
    pool.free(first)
    scattered = pool.allocate([], 6)
    assert [0, 1, 3] == scattered.block_ids  # the first's two blocks, then one past the second's
    rows = torch.randn(2, 1, 6, 4).to(rows_dtype)
    keys, values = scattered.update_kv(0, 0, rows)
    assert torch.equal(torch.stack([keys, values]), rows.to(pool_dtype))
    pool.free(second)


def pool_after_six_tokens() -> tuple[KVPool, list[int]]:
    """A pool of three 4-token blocks after a finished sequence of 6 tokens: one full block cached and
    one part-filled (2 rows), one block free."""
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=3, block_size=4, dtype=torch.float32)
    tokens = list(range(1, 7))
    sequence = pool.allocate(tokens, 8)
    sequence.write_kv(0, 0, torch.ones(2, 1, 6, 4))
    pool.name_full_blocks(sequence, tokens)
    pool.free(sequence, tokens)
    return pool, tokens


def test_part_filled_blocks_are_evicted_like_the_others():
    pool, tokens = pool_after_six_tokens()
    assert 2 == pool.usage().num_cached  # the full block and the part-filled one
    pool.free(pool.allocate([50 + i for i in range(12)], 12))  # takes every block: both evicted
    assert 0 == pool.allocate(tokens + [7], 8).num_tokens


def test_dropping_the_cached_prefixes_frees_their_blocks():
    pool, tokens = pool_after_six_tokens()
    held = pool.allocate([50, 51], 4)  # a running sequence keeps its block
    pool.drop_cached()
    assert (1, 0, 2) == (pool.usage().num_used, pool.usage().num_cached, pool.usage().num_free)
    assert 0 == pool.allocate(tokens + [7], 8).num_tokens  # nothing of the old prefix is found
    assert 1 == len(held.block_ids)


def test_a_part_filled_block_gives_way_when_the_pool_needs_it():
    pool, tokens = pool_after_six_tokens()
    # 12 positions need all three blocks: the part-filled one is taken for a fresh block, not copied from
    longer = pool.allocate(tokens + [7, 8, 9, 10, 11], 12)
    assert longer is not None and 4 == longer.num_tokens


def test_a_shared_system_prompt_is_prefilled_once(tokenizer):
    engine = Engine(tiny_model(tokenizer, max_positions=1024), FP32)
    system = [{"role": "system", "content": "You are a careful teacher of inference engines. " * 6}]
    first = list(engine.stream(system + user("What is TTFT?"), greedy(4)))
    second = list(engine.stream(system + user("What is TPOT?"), greedy(4)))
    started = second[0]
    assert isinstance(started, Started) and 0 == first[0].num_cached_tokens
    system_tokens = len(tokenizer.apply_chat_template(system, tokenize=False)) // 8  # well below its length
    assert started.num_cached_tokens >= system_tokens
    chunk = second[1]
    assert (started.num_cached_tokens, started.num_prompt_tokens) == (chunk.start, chunk.end)
    assert second[-1].metrics.num_cached_tokens == started.num_cached_tokens
    fresh = Engine(engine.loaded, EngineConfig(precision="fp32", prefix_caching=False)).generate(
        system + user("What is TPOT?"), greedy(4))
    assert fresh.text == second[-1].text


def test_unused_blocks_are_evicted_least_recently_used(tokenizer):
    engine = Engine(tiny_model(tokenizer), EngineConfig(kv_cache_mb=12 * BLOCK_MB))  # 12 blocks of 16 tokens
    a, b = "Tell me about whales. " * 6, "Something else entirely, about trees. " * 19
    first = engine.generate(user(a), greedy(8))
    usage = engine.kv_usage()
    assert (0, usage.num_blocks - usage.num_free) == (usage.num_used, usage.num_cached)
    second = engine.generate(user(a), greedy(8))
    assert second.metrics.num_cached_tokens >= first.metrics.num_prompt_tokens - 16  # still cached
    engine.generate(user(b), greedy(8))  # needs nearly the whole pool: a's own blocks are evicted
    again = engine.generate(user(a), greedy(8))
    # what is left is the chat template's opening, which b shares with a
    assert again.metrics.num_cached_tokens < second.metrics.num_cached_tokens
    assert first.text == second.text == again.text


def test_a_request_larger_than_the_pool_is_refused_clearly(tokenizer):
    engine = Engine(tiny_model(tokenizer, max_positions=4096), EngineConfig(kv_cache_mb=4 * BLOCK_MB))  # 64 tokens
    with pytest.raises(KVPoolTooSmall, match=r"needs KV cache for [\d,]+ tokens, but the pool holds 64 tokens"):
        engine.new_request(user("word " * 80), greedy(4))
    assert "length" == engine.generate(user("Hi"), greedy(4)).reason  # the engine goes on


def test_a_pool_larger_than_the_memory_is_refused_in_one_line(tokenizer):
    """It was torch's allocator's traceback ('can't allocate memory: you tried to allocate ...')."""
    from engine.engine import memory_bytes

    too_much = memory_bytes(torch.device("cpu")) // 1_000_000 * 2
    with pytest.raises(ValueError, match=r"^--kv-cache-mb [\d,]+ is more than the [\d,]+ MB of memory on this "
                                         "machine: lower it$"):
        Engine(tiny_model(tokenizer), EngineConfig(kv_cache_mb=too_much))


def test_a_request_waits_while_the_pool_is_full(tokenizer):
    engine = Engine(tiny_model(tokenizer), EngineConfig(prefix_caching=False, kv_cache_mb=6 * BLOCK_MB))  # 96 tokens
    requests = [engine.new_request(user(p), greedy(40)) for p in ("First prompt here", "Second prompt here")]
    order = []
    finished = engine.run_all(requests, hooks=[lambda e: order.append((e.request_id, e.type))
                                               if isinstance(e, (Started, Finished)) else None])
    first, second = (r.request_id for r in requests)
    assert [(first, "Started"), (first, "Finished"), (second, "Started"), (second, "Finished")] == order
    assert ["length", "length"] == [f.reason for f in finished]


def test_the_serving_thread_runs_requests_from_several_threads_together(tokenizer):
    engine = Engine(tiny_model(tokenizer), FP32)
    expected = [alone(engine, p, 30) for p in PROMPTS[:3]]
    loop = threading.Thread(target=engine.serve_forever, daemon=True)
    loop.start()
    results, sizes = {}, []

    def chat(index: int) -> None:
        request = engine.new_request(user(PROMPTS[index]), greedy(30))
        events = list(engine.run(request))
        sizes.extend(e.batch_size for e in events if isinstance(e, DecodeStep))
        results[index] = request.generated_ids

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    engine.stop()
    loop.join(timeout=10)
    assert expected == [results[i] for i in range(3)]
    assert max(sizes) > 1  # they decoded together
    assert (0, 0) == engine.load()


def test_a_held_request_decodes_only_the_steps_it_is_allowed(tokenizer):
    """Step by step (explain mode): held after its prefill, one token per allowed step, the others in
    the batch going on meanwhile; the same tokens as running free."""
    engine = Engine(tiny_model(tokenizer), EngineConfig(precision="fp32", prefix_caching=False))
    expected = alone(engine, PROMPTS[0], 8)
    held, other = (engine.new_request(user(p), greedy(8)) for p in PROMPTS[:2])
    events = []
    engine.allow(held, 0)  # hold it after its prefill
    engine.submit(held, [events.append])
    engine.submit(other)
    for _ in range(12):
        engine.step()
    assert (1, True) == (held.num_generated, other.is_finished)  # the prefill's token only; the other ran on
    assert 1 == engine.num_held()
    assert [] == [e for e in events if isinstance(e, DecodeStep) and e.step > 0]
    for allowed, total in ((1, 2), (2, 4), (0, 4)):
        engine.allow(held, allowed)
        for _ in range(4):
            engine.step()
        assert total == held.num_generated
    engine.allow(held, None)  # run to the end
    assert 0 == engine.num_held()
    while not held.is_finished:
        engine.step()
    assert expected == held.generated_ids
    assert [e.step for e in events if isinstance(e, DecodeStep)] == list(range(8))
    with pytest.raises(ValueError):
        engine.allow(held, -1)


def test_a_serving_engine_holds_and_steps_on_request_from_another_thread(tokenizer):
    engine = Engine(tiny_model(tokenizer), FP32)
    loop = threading.Thread(target=engine.serve_forever, daemon=True)
    loop.start()
    try:
        request = engine.new_request(user(PROMPTS[3]), greedy(6))
        tokens = queue.SimpleQueue()
        engine.allow(request, 0)
        engine.submit(request, [lambda e: tokens.put(e.step) if isinstance(e, DecodeStep) else None])
        assert 0 == tokens.get(timeout=30)  # the prefill's token
        with pytest.raises(queue.Empty):
            tokens.get(timeout=0.3)  # held
        engine.allow(request, 1)
        assert 1 == tokens.get(timeout=10)  # "Next token": exactly one more
        with pytest.raises(queue.Empty):
            tokens.get(timeout=0.3)
        engine.allow(request, None)  # "Run to end"
        assert [2, 3, 4, 5] == [tokens.get(timeout=10) for _ in range(4)]
    finally:
        engine.stop()
        loop.join(timeout=10)


def test_a_request_can_ask_for_its_attention_weights_and_stage_times(tokenizer):
    """Explain mode: a decode step reports the new token's attention over every cached position, per
    layer and head, and every forward its time per stage, without changing the tokens; the others in
    the batch report neither."""
    loaded = tiny_model(tokenizer, num_heads=4, num_kv_heads=2, hidden=256)  # head dimension 64: native
    engine = Engine(loaded, EngineConfig(precision="fp32", prefix_caching=False))
    expected = alone(engine, PROMPTS[0], 5)
    watched, other = (engine.new_request(user(p), greedy(5)) for p in PROMPTS[:2])
    watched.explain = True
    seen = {watched.request_id: [], other.request_id: []}
    chunks = {watched.request_id: [], other.request_id: []}
    engine.run_all([watched, other], hooks=[lambda e: seen[e.request_id].append(e) if isinstance(e, DecodeStep)
                                            else chunks[e.request_id].append(e) if isinstance(e, PrefillChunk)
                                            else None])
    assert expected == watched.generated_ids
    steps = seen[watched.request_id]
    assert steps[0].attention is None  # step 0 samples from the prefill's logits: no decode forward
    for step in steps[1:]:
        weights = step.attention  # [layers, heads, positions]
        assert weights.shape == (2, 4, step.kv_tokens)
        assert (weights >= 0).all() and torch.allclose(weights.sum(-1), torch.ones(2, 4), atol=1e-5)
    assert all(e.attention is None and e.stage_ms is None for e in seen[other.request_id])
    assert "attention" not in steps[1].to_dict()  # the JSON events stay as they were
    (prefill,) = chunks[watched.request_id]
    assert set(prefill.stage_ms) == {*FORWARD_STAGES, WAKE} and all(prefill.stage_ms[s] > 0 for s in FORWARD_STAGES)
    assert chunks[other.request_id][0].stage_ms is None
    assert set(steps[0].stage_ms) == {"sample"}  # token 1: the prefill's logits, sampled
    for step in steps[1:]:
        assert set(step.stage_ms) == {*FORWARD_STAGES, WAKE, "sample"}
        assert sum(step.stage_ms.values()) <= step.latency_ms  # parts of the step, not more


def test_a_request_can_time_its_stages_without_the_weights(tokenizer):
    """time_stages (the bench's Flash Decoding figures): every forward's time per stage, as in explain
    mode, but no attention weights are copied out; the tokens and the other request are unchanged."""
    loaded = tiny_model(tokenizer, num_heads=4, num_kv_heads=2, hidden=256)  # head dimension 64: native
    engine = Engine(loaded, EngineConfig(precision="fp32", prefix_caching=False))
    assert engine.runner.fused is not None
    expected = [alone(engine, p, 5) for p in PROMPTS[:2]]
    timed, other = (engine.new_request(user(p), greedy(5)) for p in PROMPTS[:2])
    timed.time_stages = True
    seen = {timed.request_id: [], other.request_id: []}
    engine.run_all([timed, other], hooks=[lambda e: seen[e.request_id].append(e)])
    assert expected == [timed.generated_ids, other.generated_ids]
    (prefill,) = [e for e in seen[timed.request_id] if isinstance(e, PrefillChunk)]
    assert set(prefill.stage_ms) == {*FORWARD_STAGES, WAKE}
    steps = [e for e in seen[timed.request_id] if isinstance(e, DecodeStep)]
    for step in steps[1:]:
        assert step.attention is None and set(step.stage_ms) == {*FORWARD_STAGES, WAKE, "sample"}
        assert 0 < step.stage_ms["attention"] and sum(step.stage_ms.values()) <= step.latency_ms
    assert all(e.stage_ms is None for e in seen[other.request_id] if isinstance(e, (DecodeStep, PrefillChunk)))
