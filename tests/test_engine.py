"""The engine on tiny random models: event order and contents, KV sizes, chunking, cancellation."""
from __future__ import annotations

import math
import threading

import pytest
import torch

from conftest import shape, tiny_model, user
from engine import (DecodeStep, Engine, EngineConfig, Finished, FirstToken, PrefillChunk, PromptTooLong,
                    SamplingParams, kv_bytes_formula)
from engine.models.hf_runner import TransformersRunner, make_runner
from engine.models.llama import LeanLlama

GREEDY = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("chunk", [0, 5, 16])
def test_event_order_with_chunked_prefill(tiny, chunk):
    engine = Engine(tiny, EngineConfig(prefill_chunk=chunk))
    request = engine.new_request(user("Explain the two phases of inference."), GREEDY)
    num_prompt = request.num_prompt_tokens
    events = list(engine.run(request))
    step = chunk or num_prompt
    chunks = [("prefill", s, min(s + step, num_prompt)) for s in range(0, num_prompt, step)]
    assert [("Started",), *chunks, ("FirstToken",), *[("decode", i) for i in range(6)], ("Finished",)] == shape(events)


def test_kv_tokens_and_bytes_follow_the_formula(tiny_engine):
    events = list(tiny_engine.stream(user("Hello there"), GREEDY))
    started, prefill = events[0], events[1]
    steps = [e for e in events if isinstance(e, DecodeStep)]
    per_token = kv_bytes_formula(num_layers=2, num_kv_heads=2, head_dim=16, element_size=4, num_tokens=1)
    prompt = started.num_prompt_tokens
    assert (prompt, prompt * per_token) == (prefill.kv_tokens, prefill.kv_bytes)
    assert [(prompt + i, (prompt + i) * per_token) for i in range(6)] == [(s.kv_tokens, s.kv_bytes) for s in steps]
    assert started.kv_capacity_bytes == started.kv_capacity_tokens * per_token
    assert started.kv_capacity_tokens == 48  # prompt 32 + 5 fed-back tokens, rounded up to 16-token blocks


def test_cache_reports_its_own_size():
    from engine import KVPool

    pool = KVPool(num_layers=3, num_kv_heads=2, head_dim=8, num_blocks=4, block_size=4, dtype=torch.float16)
    cache = pool.allocate([], 10)  # 3 blocks of 4
    for layer in range(3):
        cache.update(layer, 0, torch.ones(2, 4, 8), torch.ones(2, 4, 8))
    assert (4, 12, kv_bytes_formula(3, 2, 8, 2, 4), kv_bytes_formula(3, 2, 8, 2, 12)) == (
        cache.num_tokens, cache.capacity_tokens, cache.bytes_used, cache.bytes_allocated)
    with pytest.raises(ValueError, match="KV cache full"):
        cache.update(0, 10, torch.ones(2, 4, 8), torch.ones(2, 4, 8))
    assert (4, 3, 0, 1) == (pool.usage().num_blocks, pool.usage().num_used, pool.usage().num_cached,
                            pool.usage().num_free)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("chunks", [[1000], [1] * 7 + [1000], [3, 5, 1000]])
def test_lean_forward_matches_transformers(tokenizer, kind, chunks):
    loaded = tiny_model(tokenizer, kind)
    runner = make_runner(loaded.model, "fp32")
    assert isinstance(runner, LeanLlama)
    ids = torch.tensor(tokenizer("The KV cache holds keys and values of earlier tokens.")["input_ids"])
    with torch.no_grad():
        expected = loaded.model(ids[None]).logits[0, -1]
    cache, pos, logits = runner.new_cache(64), 0, None
    for size in chunks:
        end = min(pos + size, len(ids))
        logits = runner.forward(ids[pos:end], pos, cache, need_logits=end == len(ids))
        pos = end
        if pos == len(ids):
            break
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert len(ids) == cache.num_tokens


def test_transformers_fallback_gives_the_same_tokens(tiny):
    lean = Engine(tiny).generate(user("Hi"), GREEDY)
    fallback = Engine(tiny, runner=TransformersRunner(tiny.model)).generate(user("Hi"), GREEDY)
    assert lean.text == fallback.text
    assert lean.metrics.kv_bytes == fallback.metrics.kv_bytes


def test_the_fallback_counts_what_the_lean_formula_counts(tiny):
    lean, fallback = Engine(tiny, EngineConfig(precision="fp32")), Engine(tiny, runner=TransformersRunner(tiny.model))
    assert lean._flop_shape == fallback._flop_shape
    assert lean.runner.weight_bytes == fallback.runner.weight_bytes


def test_an_architecture_the_lean_path_does_not_know_runs_with_its_cache_in_sight(tokenizer):
    """GPT-2 names no Llama-style sizes (intermediate_size): its FLOPs are counted from its matrices, and its
    cache, which transformers grows as it goes, is the engine's own, not a remote server's."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from app.ui.explain.views import Shape
    from app.ui.trace import cache_visible
    from engine import LoadedModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=128,
                                       vocab_size=len(tokenizer))).eval()
    engine = Engine(LoadedModel(model, tokenizer, "tiny-gpt2", "in-process", torch.device("cpu"), torch.float32))
    assert "transformers" == engine.runner.name
    events = list(engine.stream(user("Hi"), GREEDY))
    steps = [e for e in events if isinstance(e, DecodeStep)]
    assert 6 == len(steps) and events[-1].error is None
    layer = 32 * 3 * 32 + 32 * 32 + 2 * 32 * 4 * 32  # c_attn (q, k, v), c_proj, the MLP's c_fc and c_proj
    assert (2, layer, 32, 32 * len(tokenizer)) == engine._flop_shape and steps[1].flops > 2 * 2 * layer
    assert 128 == events[0].kv_capacity_tokens and cache_visible(events[0])
    assert (4 * 32, 2 * 2 * 32 * 4 * steps[-1].kv_tokens) == (Shape.of(engine).intermediate, steps[-1].kv_bytes)
    for switch in (dict(kv_window=64), dict(kv_dtype="int8"), dict(attention="eager"), dict(kv_cache=False)):
        with pytest.raises(ValueError, match="need the lean forward, not transformers|needs the lean forward"):
            engine.variant(**switch)  # said, not ignored (a window on transformers' cache ran as no window)


def test_penalties_give_the_tokens_of_a_plain_greedy_loop_that_applies_them(tiny):
    """OpenAI's frequency and presence penalties over the reply, CTRL's repetition penalty over prompt and
    reply, then argmax: transformers' model step by step against the engine (the lean forward)."""
    # a random model seldom repeats itself: a negative presence penalty makes it, and the frequency
    # penalty then counts the repeats
    sampling = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True, frequency_penalty=1.0,
                              presence_penalty=-1.5, repetition_penalty=1.2)
    prompt = tiny.tokenizer("a b a b a b a b", add_special_tokens=False)["input_ids"]
    ids, reply = list(prompt), []
    with torch.no_grad():
        for _ in range(sampling.max_new_tokens):
            logits = tiny.model(torch.tensor([ids])).logits[0, -1]
            seen = torch.tensor(sorted(set(ids)))
            logits[seen] = torch.where(logits[seen] > 0, logits[seen] / 1.2, logits[seen] * 1.2)
            for token in set(reply):
                logits[token] -= 1.0 * reply.count(token) - 1.5
            reply.append(int(logits.argmax()))
            ids.append(reply[-1])
    engine = Engine(tiny, EngineConfig(precision="fp32"))  # transformers' numbers

    def tokens(params: SamplingParams) -> list[int]:
        request = engine.new_request_from_ids(prompt, params)
        return [e.token_id for e in engine.run(request) if isinstance(e, DecodeStep)]

    assert tokens(sampling) == reply
    assert len(set(reply)) < len(reply) - 4  # it repeated itself, as plain greedy decoding does not here:
    assert len(set(tokens(SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)))) == len(reply)


def test_first_token_breakdown_adds_up(tiny_engine):
    events = list(tiny_engine.stream(user("Hi"), GREEDY))
    first = next(e for e in events if isinstance(e, FirstToken))
    parts = first.tokenize_ms + first.queue_ms + first.setup_ms + first.prefill_ms + first.first_sample_ms
    assert parts == pytest.approx(first.ttft_ms, abs=1e-3)
    finished = events[-1]
    assert finished.metrics.ttft_ms == first.ttft_ms
    assert finished.metrics.num_generated_tokens == 6
    assert len(finished.metrics.itl_ms) == 5


def test_hooks_see_every_event_in_order(tiny_engine):
    seen, extra = [], []
    with tiny_engine.hooks(seen.append):
        yielded = list(tiny_engine.stream(user("Hi"), GREEDY, hooks=[extra.append]))
    assert yielded == seen == extra
    list(tiny_engine.stream(user("Hi"), GREEDY))  # outside the block: the hook is gone
    assert len(seen) == len(yielded)


def test_same_seed_gives_same_tokens(tiny_engine):
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=7, ignore_eos=True)
    first = tiny_engine.generate(user("Tell me a story"), params)
    second = tiny_engine.generate(user("Tell me a story"), params)
    other = tiny_engine.generate(user("Tell me a story"), SamplingParams(**{**_fields(params), "seed": 8}))
    assert first.text == second.text
    assert first.text != other.text


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__slots__}


def test_cancel_from_another_thread_takes_effect_within_one_step(tiny_engine):
    request = tiny_engine.new_request(user("Count to one hundred"), SamplingParams(max_new_tokens=50, ignore_eos=True))

    def cancel_at_step_3(event):
        if isinstance(event, DecodeStep) and event.step == 3:
            worker = threading.Thread(target=request.cancel)
            worker.start()
            worker.join()

    events = list(tiny_engine.run(request, hooks=[cancel_at_step_3]))
    steps = [e for e in events if isinstance(e, DecodeStep)]
    assert [0, 1, 2, 3] == [s.step for s in steps]
    assert ("cancelled", "".join(s.text for s in steps)) == (events[-1].reason, events[-1].text)
    assert 4 == events[-1].metrics.num_generated_tokens


def test_cancel_during_prefill(tiny):
    engine = Engine(tiny, EngineConfig(prefill_chunk=2))
    request = engine.new_request(user("A long enough prompt to take several chunks"), GREEDY)
    cancel_after_first_chunk = lambda e: request.cancel() if isinstance(e, PrefillChunk) else None  # noqa: E731
    events = list(engine.run(request, hooks=[cancel_after_first_chunk]))
    assert [("Started",), ("prefill", 0, 2), ("Finished",)] == shape(events)
    assert "cancelled" == events[-1].reason


def test_closing_the_stream_cancels_and_hooks_get_finished(tiny_engine):
    seen = []
    stream = tiny_engine.stream(user("Hi"), SamplingParams(max_new_tokens=50, ignore_eos=True), hooks=[seen.append])
    for event in stream:
        if isinstance(event, DecodeStep) and event.step == 2:
            break
    stream.close()
    assert isinstance(seen[-1], Finished)
    assert ("cancelled", 3) == (seen[-1].reason, seen[-1].metrics.num_generated_tokens)
    assert tiny_engine.generate(user("Hi"), GREEDY).reason == "length"  # the engine is free again


def test_prompt_longer_than_the_context_window_is_refused(tiny_engine):
    with pytest.raises(PromptTooLong, match=r"context window is 256 tokens") as info:
        tiny_engine.new_request(user("word " * 400))
    assert info.value.num_tokens > 256 and info.value.limit == 256
    assert tiny_engine.generate(user("Hi"), GREEDY).reason == "length"


def test_a_chat_longer_than_the_context_window_leaves_out_its_earliest_exchanges(tiny_engine):
    system = [{"role": "system", "content": "Be brief."}]
    exchanges = [message for i in range(12) for message in
                 ({"role": "user", "content": f"Question {i}: " + "word " * 12},
                  {"role": "assistant", "content": f"Answer {i}: " + "more " * 8})]
    chat = system + exchanges + user("And now?")
    sampling = SamplingParams(max_new_tokens=16)
    with pytest.raises(PromptTooLong):
        tiny_engine.new_request(chat, sampling)
    request = tiny_engine.new_request(chat, sampling, fit=True)
    kept = request.messages
    assert kept[0] == system[0] and kept[-1] == chat[-1] and kept[1]["role"] == "user"
    assert kept[1:] == chat[len(chat) - len(kept) + 1:]  # the latest exchanges, whole
    budget = tiny_engine.prompt_budget(sampling)
    assert budget == tiny_engine.context_window - 16
    assert len(request.prompt_ids) <= budget // 2  # half the budget: the next turns fit as they are
    one_more = tiny_engine.new_request(chat[:1] + chat[len(chat) - len(kept) - 1:], sampling)
    assert len(one_more.prompt_ids) > budget // 2  # no more left out than needed for that
    short = system + exchanges[:2] + user("And now?")
    assert short == tiny_engine.new_request(short, sampling, fit=True).messages  # fits: unchanged
    for before in (exchanges, system, []):  # a message too long by itself is still refused
        with pytest.raises(PromptTooLong):
            tiny_engine.new_request(before + user("word " * 400), sampling, fit=True)


def test_reply_is_clipped_to_the_context_window(tokenizer):
    engine = Engine(tiny_model(tokenizer, max_positions=64))
    request = engine.new_request(user("word " * 10), SamplingParams(max_new_tokens=500, temperature=0, ignore_eos=True))
    finished = list(engine.run(request))[-1]
    assert ("length", 64 - request.num_prompt_tokens + 1) == (finished.reason, finished.metrics.num_generated_tokens)


@pytest.mark.parametrize("messages, message", [
    ([], "conversation is empty"),
    (user(""), "message is empty"),
    (user("   \n"), "message is empty"),
    ([{"role": "robot", "content": "x"}], "role"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], "must be the user's, not the assistant's"),
])
def test_bad_conversations_are_refused(tiny_engine, messages, message):
    with pytest.raises(ValueError, match=message):
        tiny_engine.new_request(messages)


def test_a_failing_forward_finishes_with_error_and_engine_stays_usable(tiny_engine, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(tiny_engine.runner, "forward", broken)
    finished = tiny_engine.generate(user("Hi"), GREEDY)
    assert ("error", "RuntimeError: out of memory") == (finished.reason, finished.error)
    monkeypatch.undo()
    assert tiny_engine.generate(user("Hi"), GREEDY).reason == "length"


def test_stop_string_ends_the_reply_and_is_not_shown(tiny_engine):
    free = tiny_engine.generate(user("Hi"), SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))
    stop = free.text[5:8]
    assert stop.strip(), "the random model produced whitespace; pick another slice"
    stopped = tiny_engine.generate(user("Hi"), SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True,
                                                              stop=(stop,)))
    assert ("stop", free.text[:free.text.index(stop)]) == (stopped.reason, stopped.text)


def test_decode_events_carry_probabilities(tiny_engine):
    steps = [e for e in tiny_engine.stream(user("Hi"), GREEDY) if isinstance(e, DecodeStep)]
    for step in steps:
        assert len(step.top) == 5
        assert step.top[0].token_id == step.token_id  # greedy picks the most likely
        assert step.prob == pytest.approx(step.top[0].prob)
        assert [t.prob for t in step.top] == sorted((t.prob for t in step.top), reverse=True)


def test_events_serialize_to_json(tiny_engine):
    import json

    for event in tiny_engine.stream(user("Hi"), GREEDY):
        data = json.loads(json.dumps(event.to_dict()))
        assert data["type"] == event.type


def test_warm_up_leaves_nothing_running(tiny_engine):
    tiny_engine.warm_up()
    usage = tiny_engine.kv_usage()
    assert (0, 0) == tiny_engine.load() and usage.num_used == 0 == usage.num_cached


@pytest.mark.parametrize("runner, chunk", [("lean", 0), ("lean", 7), ("transformers", 7)])
def test_prompt_logprobs_are_the_models_own_at_every_position(tiny, runner, chunk):
    """Echo with logprobs: each prompt token's log-probability given those before it, as one forward of
    transformers' model over the whole prompt gives it, chunk by chunk; a prompt already in the prefix
    cache is prefilled again, since its rows' logits are needed."""
    engine = Engine(tiny, EngineConfig(precision="fp32", prefill_chunk=chunk),
                    runner=TransformersRunner(tiny.model) if runner == "transformers" else None)
    prompt = [(7 + 31 * i) % 900 for i in range(40)]
    list(engine.run(engine.new_request_from_ids(prompt, SamplingParams(max_new_tokens=2, temperature=0))))
    request = engine.new_request_from_ids(prompt, SamplingParams(max_new_tokens=2, temperature=0,
                                                                 prompt_logprobs=True))
    events = list(engine.run(request))
    assert request.num_cached_tokens == 0
    chunks = [e for e in events if isinstance(e, PrefillChunk)]
    assert len(chunks) == (6 if chunk else 1)
    reported = [t for c in chunks for t in c.prompt_logprobs]
    assert [(t.position, t.token_id) for t in reported] == list(enumerate(prompt))[1:]
    with torch.no_grad():
        expected = torch.log_softmax(tiny.model(torch.tensor([prompt])).logits[0], dim=-1)
    got = torch.tensor([math.log(t.prob) for t in reported])
    assert torch.allclose(got, expected[torch.arange(39), torch.tensor(prompt[1:])], atol=1e-4)
    for t in reported:
        assert [top.token_id for top in t.top] == expected[t.position - 1].topk(5).indices.tolist()
    # the generated tokens are those of a plain request
    plain = engine.new_request_from_ids(prompt, SamplingParams(max_new_tokens=2, temperature=0))
    assert events[-1].text == list(engine.run(plain))[-1].text
