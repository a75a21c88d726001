"""Decode-side switches: speculative decoding (prompt lookup, a draft model) gives plain decoding's
tokens (greedy, and seeded sampling), its rollback leaves the cache as plain decoding would; without a
KV cache the tokens are the cached decode's while each step recomputes everything; a sliding window with
attention sinks keeps the cache from growing (and is exact while nothing has been dropped)."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import tiny_model, user
from engine import DecodeStep, Engine, EngineConfig, Finished, SamplingParams
from engine.speculative import DraftLength, prompt_lookup

PARAGRAPH = ("The quick brown fox jumps over the lazy dog. Prefill reads the whole prompt in one pass; decode "
             "then makes one token per forward pass.")
REPEAT = "Repeat this paragraph exactly:\n\n" + PARAGRAPH


def greedy(max_new: int, **extra) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0, **extra)


def run(engine: Engine, prompt: str, sampling: SamplingParams) -> tuple[list[int], list[DecodeStep], Finished]:
    request = engine.new_request(user(prompt), sampling)
    events = list(engine.run(request))
    return request.generated_ids, [e for e in events if isinstance(e, DecodeStep)], events[-1]


def test_prompt_lookup_drafts_what_followed_the_latest_match():
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 8, 2, 3, 4]
    assert [6, 7, 8] == prompt_lookup(tokens, 3)  # the latest earlier "2 3 4", not the first
    assert [6] == prompt_lookup(tokens, 1)
    assert [] == prompt_lookup([1, 2, 3, 4, 5], 4)  # nothing repeats
    assert [5, 1, 7, 8] == prompt_lookup([7, 8, 5, 1, 7, 8], 4)  # a bigram; what followed runs to the end
    assert [] == prompt_lookup(tokens, 0)
    # the last token replaced the earlier text's 5 (a paraphrase): the three before it match, so what
    # followed the 5 is drafted; with only two tokens of matching context, nothing is
    assert [6, 7] == prompt_lookup([1, 2, 3, 4, 5, 6, 7, 9, 2, 3, 4, 8], 2)
    assert [] == prompt_lookup([1, 2, 5, 6, 9, 2, 8], 2)


def test_prompt_lookup_equals_the_plain_search_it_speeds_up():
    """Every earlier window compared, latest first: the rule written as plainly as it can be."""
    def plain(tokens, max_draft, longest=3, shortest=2):
        if max_draft < 1 or len(tokens) <= shortest:
            return []
        for n in range(min(longest, len(tokens) - 1), shortest - 1, -1):
            for start in range(len(tokens) - 1 - n, -1, -1):
                if tokens[start:start + n] == tokens[-n:]:
                    return tokens[start + n:start + n + max_draft]
        if len(tokens) > longest + 2:  # the last token replaced one: match the three before it
            for start in range(len(tokens) - 2 - longest, -1, -1):
                if tokens[start:start + longest] == tokens[-longest - 1:-1]:
                    return tokens[start + longest + 1:start + longest + 1 + max_draft]
        return []

    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(rng.choice([3, 6, 40])) for _ in range(rng.randint(0, 40))]
        max_draft = rng.randint(0, 8)
        assert plain(tokens, max_draft) == prompt_lookup(tokens, max_draft), (tokens, max_draft)


def test_the_draft_length_grows_on_success_and_drafting_pauses_after_misses():
    length = DraftLength(8)
    length.update(8, 8)
    assert 8 == length.next()
    length.update(8, 3)
    assert 4 == length.next()  # one more than were accepted
    length.update(4, 0)
    length.update(0 + 1, 0)  # (a second miss)
    assert [0, 0, 1] == [length.next(), length.next(), length.next()]  # paused 2 steps, then 1 token
    length.update(1, 1)
    assert 3 == length.next()


@pytest.fixture(scope="module")
def engines(bundled):
    config = dict(precision="fp32", prefix_caching=False)
    return Engine(bundled, EngineConfig(**config)), Engine(bundled, EngineConfig(speculative="prompt-lookup", **config))


def test_prompt_lookup_gives_plain_greedy_tokens_and_accepts_repeats(engines):
    plain, speculative = engines
    expected, _, _ = run(plain, REPEAT, greedy(64))
    tokens, steps, finished = run(speculative, REPEAT, greedy(64))
    assert expected == tokens
    spec = finished.speculation
    assert spec.accepted > 10 and spec.tokens_per_forward > 2  # the repeat was drafted and accepted
    assert spec.tokens == len(tokens) - 1 and spec.forwards < spec.tokens  # token 1 comes from the prefill
    assert any(s.draft for s in steps)  # drafted tokens come in bursts, one event each
    assert {1} == {s.batch_size for s in steps}  # one sequence per forward, however many rows it verified
    assert [s.step for s in steps] == list(range(len(tokens)))
    assert finished.reason == "eos" or len(tokens) == 64


def test_a_draft_crossing_a_stop_string_or_the_length_ends_where_plain_decoding_does(engines):
    plain, speculative = engines
    for sampling in (greedy(64, stop=("lazy",)), greedy(9)):
        expected, _, plain_end = run(plain, REPEAT, sampling)
        tokens, _, end = run(speculative, REPEAT, sampling)
        assert (expected, plain_end.text, plain_end.reason) == (tokens, end.text, end.reason)


def test_seeded_sampling_draws_the_same_tokens(engines):
    plain, speculative = engines
    sampling = SamplingParams(max_new_tokens=48, temperature=0.7, top_p=0.9, seed=3)
    assert run(plain, REPEAT, sampling)[0] == run(speculative, REPEAT, sampling)[0]


def test_every_draft_rejected_still_gives_plain_tokens(tokenizer):
    """A random model never continues as the text did: drafts are tried, rejected, and paused."""
    loaded = tiny_model(tokenizer, num_heads=4, num_kv_heads=2, hidden=256)
    plain = Engine(loaded, EngineConfig(precision="fp32"))
    speculative = Engine(loaded, EngineConfig(precision="fp32", speculative="prompt-lookup", draft_tokens=4))
    prompt = "one two three one two three one two three one two three"
    expected, _, _ = run(plain, prompt, greedy(40, ignore_eos=True))
    tokens, _, finished = run(speculative, prompt, greedy(40, ignore_eos=True))
    assert expected == tokens
    assert finished.speculation.drafted > 0


def test_rollback_leaves_the_cache_as_plain_decoding_would(engines):
    plain, speculative = engines
    requests = [engine.new_request(user(REPEAT), greedy(64)) for engine in engines]
    for engine, request in zip(engines, requests):
        engine.submit(request)
    while requests[1].num_generated < 30:  # several bursts, and rejected drafts among them
        speculative.step()
    while requests[0].num_generated < requests[1].num_generated:
        plain.step()
    caches = [r.kv_cache for r in requests]
    assert requests[0].generated_ids == requests[1].generated_ids
    assert caches[0].num_tokens == caches[1].num_tokens == requests[1].num_prompt_tokens + requests[1].num_generated - 1
    for layer in range(plain.info.num_layers):
        for ours, theirs in zip(caches[1].layer_kv(layer, caches[1].num_tokens),
                                caches[0].layer_kv(layer, caches[0].num_tokens)):
            assert torch.equal(ours, theirs)
    for engine, request in zip(engines, requests):
        request.cancel()
        while not request.is_finished:
            engine.step()


def test_without_a_kv_cache_the_tokens_are_the_same_and_every_step_costs_more(tokenizer):
    loaded = tiny_model(tokenizer, num_heads=4, num_kv_heads=2, hidden=256)
    cached = Engine(loaded, EngineConfig(precision="fp32"))
    uncached = Engine(loaded, EngineConfig(precision="fp32", kv_cache=False))
    expected, cached_steps, _ = run(cached, "Tell me about the sea.", greedy(24, ignore_eos=True))
    tokens, steps, _ = run(uncached, "Tell me about the sea.", greedy(24, ignore_eos=True))
    assert expected == tokens
    assert uncached.pool.prefix_caching is False
    # FLOPs: the cached step grows only by its attention; the uncached one recomputes every token
    assert steps[-1].flops > steps[1].flops > 2 * cached_steps[1].flops  # (the tiny model is mostly lm_head)
    assert steps[-1].flops == uncached.forward_flops(steps[-1].kv_tokens, 0)
    assert cached_steps[-1].flops < 1.1 * cached_steps[1].flops


def test_speculation_needs_the_kv_cache():
    with pytest.raises(ValueError, match="verifies drafts against the KV cache: it cannot run without one"):
        EngineConfig(speculative="prompt-lookup", kv_cache=False)
    with pytest.raises(ValueError, match="speculative must be one of"):
        EngineConfig(speculative="guess")


def draft_engines(tokenizer, draft):
    target = tiny_model(tokenizer, num_heads=4, num_kv_heads=2, hidden=256)
    draft = target if draft == "same" else tiny_model(tokenizer, seed=7, num_heads=2, num_kv_heads=1, hidden=128)
    plain = Engine(target, EngineConfig(precision="fp32"))
    drafted = Engine(target, EngineConfig(precision="fp32", speculative="draft:in-process", draft_tokens=4),
                     draft=draft)
    return plain, drafted


def test_a_draft_model_that_is_the_target_has_every_draft_accepted(tokenizer):
    plain, drafted = draft_engines(tokenizer, "same")
    expected, _, _ = run(plain, "Tell me about the sea.", greedy(30, ignore_eos=True))
    tokens, steps, finished = run(drafted, "Tell me about the sea.", greedy(30, ignore_eos=True))
    assert expected == tokens
    spec = finished.speculation
    assert spec.accepted == spec.drafted > 0 and spec.tokens_per_forward > 3  # 4 drafted + the model's own
    assert drafted.drafter.pool.usage().num_used == 0  # the draft's cache went back with the request


@pytest.mark.parametrize("sampling", [greedy(30, ignore_eos=True),
                                      SamplingParams(max_new_tokens=30, temperature=0.9, seed=5, ignore_eos=True)])
def test_a_smaller_draft_model_leaves_the_output_unchanged(tokenizer, sampling):
    plain, drafted = draft_engines(tokenizer, "smaller")
    expected, _, _ = run(plain, "Tell me about the sea.", sampling)
    tokens, _, finished = run(drafted, "Tell me about the sea.", sampling)
    assert expected == tokens and finished.speculation.drafted > 0


def test_a_draft_model_needs_the_targets_vocabulary(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM
    from engine import LoadedModel

    small = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    other = LoadedModel(small, tokenizer, "other", "in-process", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="same tokenizer"):
        Engine(tiny_model(tokenizer), EngineConfig(precision="fp32", speculative="draft:x"), draft=other)


def test_a_sliding_window_stops_the_cache_growing(tokenizer):
    loaded = tiny_model(tokenizer, num_heads=4, num_kv_heads=2, hidden=256)
    full = Engine(loaded, EngineConfig(precision="fp32", prefix_caching=False))
    windowed = Engine(loaded, EngineConfig(precision="fp32", kv_window=32, kv_sinks=4), runner=full.runner)
    assert windowed.kv_limit == (1 + 2 + 1) * 16 and windowed.pool.prefix_caching is False
    expected, _, _ = run(full, "Tell me about the sea.", greedy(120, ignore_eos=True))
    tokens, steps, finished = run(windowed, "Tell me about the sea.", greedy(120, ignore_eos=True))
    assert max(s.kv_tokens for s in steps) <= windowed.kv_limit  # it stopped growing
    assert finished.metrics.kv_bytes <= windowed.kv_limit * windowed.info.kv_bytes_per_token
    prompt = steps[0].kv_tokens
    first_drop = windowed.kv_limit - prompt + 1  # tokens before the window first fills are exact
    assert expected[:first_drop] == tokens[:first_drop]
    wide = Engine(loaded, EngineConfig(precision="fp32", kv_window=1000), runner=full.runner)
    assert expected == run(wide, "Tell me about the sea.", greedy(120, ignore_eos=True))[0]  # never full: exact


def test_after_a_slide_the_native_step_and_pytorch_agree(tokenizer):
    """Tokens after the dropped block keep their places in the text for the rotary embedding, in the
    native step and in the PyTorch ops alike."""
    from engine.models.llama import LeanLlama

    lean = LeanLlama(tiny_model(tokenizer, num_heads=4, num_kv_heads=2, hidden=256).model, precision="fp32")
    pool = lean.new_pool(4_000_000, prefix_caching=False)
    sequence = pool.allocate([], 48)  # 3 blocks of 16
    lean.forward(torch.arange(48) % 300 + 5, 0, sequence)
    sequence.slide(1)  # the second block (positions 16-31) goes; the third moves down
    assert (32, 16) == (sequence.num_tokens, sequence.num_dropped)
    native = lean.decode([7], [32], [sequence])
    sequence.truncate(32)
    with lean.pytorch_decode():
        ops = lean.decode([7], [32], [sequence])
    torch.testing.assert_close(native, ops, rtol=1e-4, atol=1e-4)


def test_a_window_and_speculation_do_not_mix():
    with pytest.raises(ValueError, match="one or the other"):
        EngineConfig(kv_window=64, speculative="prompt-lookup")
    with pytest.raises(ValueError, match="kv_window"):
        EngineConfig(kv_window=0)
