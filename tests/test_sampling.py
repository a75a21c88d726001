"""Sampling parameters, sampling itself, and text pieces (UTF-8 and stop strings)."""
from __future__ import annotations

import math

import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.sampling import (SeenTokens, _draw, _kept, apply_logit_bias, apply_reply_penalties,
                             apply_repetition_penalty, make_generator, sample)
from engine.text import IncrementalDetokenizer, TextStream


@pytest.mark.parametrize("field, value, allowed", [
    ("max_new_tokens", 0, ">= 1"),
    ("temperature", -0.1, r"\[0.0, 10.0\]"),
    ("temperature", 11, r"\[0.0, 10.0\]"),
    ("top_k", -1, ">= 0"),
    ("top_p", 0.0, r"\(0.0, 1.0\]"),
    ("top_p", 1.5, r"\(0.0, 1.0\]"),
    ("repetition_penalty", 0, r"\(0.0, 10.0\]"),
    ("frequency_penalty", 2.5, r"\[-2.0, 2.0\]"),
    ("presence_penalty", -3, r"\[-2.0, 2.0\]"),
    ("logit_bias", ((5, 100.5),), r"logit_bias of token 5 must be in \[-100.0, 100.0\]"),
    ("logit_bias", ((-1, 1.0),), "logit_bias takes token ids >= 0"),
    ("seed", -3, r"from 0 to 2\*\*64 - 1"),
    ("seed", 2**64, r"from 0 to 2\*\*64 - 1"),  # torch's generator overflowed: the page said "internal error"
])
def test_invalid_sampling_values_name_field_and_range(field, value, allowed):
    with pytest.raises(ValueError, match=f"{field} must .*{allowed}" if field != "logit_bias" else allowed):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("kwargs, message", [
    ({"device": "tpu"}, "device must be one of"),
    ({"dtype": "int4"}, "dtype must be one of"),
    ({"prefill_chunk": -1}, "prefill_chunk must be"),
])
def test_invalid_engine_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_stop_must_be_strings():
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop="###")
    assert SamplingParams(stop=["###"]).stop == ("###",)


def test_greedy_picks_argmax_and_reports_model_probability():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0, -1.0, 0.5])
    picked = sample(logits, SamplingParams(temperature=0), make_generator(0))
    probs = logits.softmax(-1)
    assert (1, [1, 2, 0, 5, 3]) == (picked.token_id, picked.top_ids)
    assert picked.prob == pytest.approx(float(probs[1]))


@pytest.mark.parametrize("top_k, top_p, allowed", [(1, 1.0, {1}), (2, 1.0, {1, 2}), (0, 0.5, {1}), (0, 0.8, {1, 2})])
def test_top_k_and_top_p_limit_the_choices(top_k, top_p, allowed):
    logits = torch.tensor([0.0, 3.0, 2.5, -5.0])  # probs ~ [0.03, 0.60, 0.36, 0.0003]
    generator = make_generator(0)
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
    picked = {sample(logits, params, generator).token_id for _ in range(200)}
    assert picked == allowed


def _nucleus_by_full_sort(probs: torch.Tensor, top_p: float) -> set[int]:
    """transformers' top-p: sort ascending, drop the tokens whose cumulative probability is <= 1 - top_p."""
    ascending, order = torch.sort(probs)
    remove = ascending.cumsum(-1) <= 1 - top_p
    remove[-1] = False
    return set(order[~remove].tolist())


@pytest.mark.parametrize("scale", [0.1, 1.0, 3.0, 10.0])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.99])
def test_top_p_keeps_what_a_full_sort_keeps(scale, top_p):
    # flat logits (scale 0.1) need thousands of tokens to reach top_p: the search grows past its first 64
    logits = torch.randn(49152, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * scale
    probs = logits.softmax(-1)
    ids, values = _kept(probs, 0, top_p)
    assert set(ids.tolist()) == _nucleus_by_full_sort(probs, top_p)
    assert values.tolist() == sorted(values.tolist(), reverse=True) and torch.equal(values, probs[ids])


def test_top_k_then_top_p_measures_top_p_within_the_top_k():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    assert [0, 1, 2] == _kept(probs, 3, 1.0)[0].tolist()
    assert [0, 1] == _kept(probs, 3, 0.7)[0].tolist()  # 0.4 / 0.9 < 0.7 <= 0.7 / 0.9
    assert _kept(probs, 0, 1.0) is None and _kept(probs, 4, 1.0) is None  # nothing to cut


def test_draws_follow_the_weights_and_never_pick_a_zero():
    weights = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0], dtype=torch.float64)
    generator = make_generator(3)
    counts = torch.bincount(torch.tensor([_draw(weights, generator)[0] for _ in range(20000)]), minlength=6)
    assert counts[[0, 2, 5]].tolist() == [0, 0, 0]
    assert (counts / 20000 - weights).abs().max() < 0.015  # about 4 standard deviations of the largest
    assert _draw(torch.zeros(3, dtype=torch.float64), generator) is None  # nothing to draw from
    assert _draw(torch.tensor([0.5, float("nan")], dtype=torch.float64), generator) is None


def test_sampled_tokens_follow_temperature_and_top_k():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    generator = make_generator(5)
    params = SamplingParams(temperature=0.7, top_k=3)
    counts = torch.bincount(torch.tensor([sample(logits, params, generator).token_id for _ in range(20000)]),
                            minlength=5)
    expected = torch.cat([logits[:3].div(0.7).softmax(-1), torch.zeros(2)])
    assert (counts / 20000 - expected).abs().max() < 0.015


def test_a_temperature_alone_draws_from_the_whole_softmax_in_and_past_the_most_likely():
    """_tempered: the NUCLEUS_FIRST most likely first, the rest past their share (here about 0.7); each
    token keeps its chance."""
    from engine.sampling import NUCLEUS_FIRST

    logits = torch.cat([torch.full((NUCLEUS_FIRST,), 1.0), torch.zeros(400), torch.full((8,), 0.8)])
    params = SamplingParams(temperature=1.0)
    expected = logits.softmax(-1)
    generator = make_generator(9)
    drawn = [sample(logits, params, generator) for _ in range(20000)]
    counts = torch.bincount(torch.tensor([d.token_id for d in drawn]), minlength=len(logits)) / 20000
    groups = [slice(0, NUCLEUS_FIRST), slice(NUCLEUS_FIRST, NUCLEUS_FIRST + 400), slice(-8, None)]
    for group in groups:  # about 0.29, 0.68 and 0.03: within 4 standard deviations
        assert abs(float(counts[group].sum() - expected[group].sum())) < 0.015
    assert drawn[0].top_sample_probs == pytest.approx(expected[drawn[0].top_ids].tolist())


def test_repetition_penalty_discourages_seen_tokens():
    logits = torch.tensor([2.0, -2.0, 1.0])
    assert [1.0, -4.0, 1.0] == apply_repetition_penalty(logits, [0, 1], 2.0).tolist()


def test_seen_tokens_kept_as_the_reply_grows_penalize_as_the_whole_list_does():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    prompt, reply = [3, 7, 3, 9], []
    seen = SeenTokens(prompt)
    for token in [7, 11, 11, 2, 3, 40]:  # seen in the prompt, new, repeated
        reply.append(token)
        ids = seen.ids(reply)
        assert sorted(ids.tolist()) == sorted(set(prompt + reply))
        whole = apply_repetition_penalty(logits, prompt + reply, 1.3)
        assert torch.equal(apply_repetition_penalty(logits, ids, 1.3), whole)
    assert apply_repetition_penalty(logits, SeenTokens([]).ids([]), 1.3) is logits  # nothing seen: untouched


def test_frequency_and_presence_penalties_count_the_reply():
    logits = torch.zeros(6)
    assert [0, 0, 0, -1.25, 0, -0.75] == apply_reply_penalties(logits, [3, 5, 3], 0.5, 0.25).tolist()
    assert [0, 0, 0, 1.0, 0, 0.5] == apply_reply_penalties(logits, [3, 5, 3], -0.5, 0.0).tolist()  # negative: favoured
    assert logits.eq(0).all()  # the caller's logits stay as they were
    top = torch.tensor([5.0, 4.0, 0.0])
    assert 0 == sample(top, SamplingParams(temperature=0), make_generator(0), generated_ids=[0]).token_id
    penalized = sample(top, SamplingParams(temperature=0, presence_penalty=1.5), make_generator(0), generated_ids=[0])
    assert (1, [0.0, 1.0, 0.0]) == (penalized.token_id, penalized.top_sample_probs)
    assert penalized.top_probs == pytest.approx(top.softmax(-1).tolist())  # the model's own, unchanged
    sampled = sample(top, SamplingParams(temperature=1, frequency_penalty=2), make_generator(0), generated_ids=[0, 0])
    assert sampled.top_sample_probs == pytest.approx(torch.tensor([1.0, 4.0, 0.0]).softmax(-1).tolist())


def test_logit_bias_bans_and_forces():
    logits = torch.tensor([5.0, 4.0, 0.0])
    assert [5.0, -96.0, 0.5] == apply_logit_bias(logits, ((1, -100.0), (2, 0.5))).tolist()
    banned = SamplingParams(temperature=0, logit_bias=((0, -100.0),))
    assert 1 == sample(logits, banned, make_generator(0)).token_id
    forced = SamplingParams(temperature=1.0, logit_bias=((2, 100.0),))
    assert {2} == {sample(logits, forced, make_generator(i)).token_id for i in range(20)}


TEXTS = ["Hello, world!", "你好，世界！今天天气很好。", "Emoji 🌍🚀 and café — naïve", "日本語のテキスト", "🇫🇷 flags 👩‍👩‍👧"]


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_are_complete_utf8_and_add_up(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_pieces_from_the_rust_tokenizer_are_the_wrappers(tokenizer):
    """The detokenizer decodes with the Rust tokenizer under transformers' where the wrapper adds nothing:
    the same pieces as through the wrapper, special tokens skipped."""
    ids = [i for text in TEXTS for i in tokenizer(text + "<|im_end|> ", add_special_tokens=False)["input_ids"]]
    fast, wrapped = IncrementalDetokenizer(tokenizer), IncrementalDetokenizer(tokenizer)
    wrapped._backend = None
    assert fast._backend is not None
    assert [fast.push(i) for i in ids] == [wrapped.push(i) for i in ids]


def test_multibyte_character_waits_for_its_last_token(tokenizer):
    ids = tokenizer("🚀", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1  # the emoji spans several byte-level tokens
    detok = IncrementalDetokenizer(tokenizer)
    assert [""] * (len(ids) - 1) + ["🚀"] == [detok.push(i) for i in ids]


@pytest.mark.parametrize("text, stops, shown, stopped", [
    ("Answer: 42\nUser: next", ("\nUser:",), "Answer: 42", True),
    ("no stop here", ("###",), "no stop here", False),
    ("a ## b", ("###",), "a ## b", False),
])
def test_text_stream_stops_and_holds_back(tokenizer, text, stops, shown, stopped):
    stream = TextStream(tokenizer, stops)
    released = ""
    for token_id in tokenizer(text, add_special_tokens=False)["input_ids"]:
        released += stream.push(token_id)
        if stream.is_stopped:
            break
    released += stream.flush()
    assert (shown, stopped) == (released, stream.is_stopped)
    assert stream.text == released


def test_the_candidates_chances_under_the_rule_that_picked():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0])
    greedy = sample(logits, SamplingParams(temperature=0), make_generator(0))
    assert [1.0, 0.0, 0.0, 0.0, 0.0] == greedy.top_sample_probs
    cut = sample(logits, SamplingParams(temperature=0.7, top_k=2), make_generator(0))
    assert cut.top_ids == [0, 1, 2, 3, 4]
    assert cut.top_sample_probs[2:] == [0.0, 0.0, 0.0]  # cut by top-k
    expected = torch.tensor([4.0, 3.0]).div(0.7).softmax(-1).tolist()
    assert cut.top_sample_probs[:2] == pytest.approx(expected)
    assert cut.top_probs[:2] == pytest.approx(logits.softmax(-1)[:2].tolist())  # the model's own, unchanged


def test_greedy_reads_the_top_alone_and_leaves_the_logits_where_they_are():
    # meta tensors have no values: copying one to the host raises, as a GPU's copy would cost a sync
    logits = torch.empty(49152, device="meta")
    top = ([7, 3, 9], [4.0, 2.0, 1.0], 4.5)
    picked = sample(logits, SamplingParams(temperature=0), make_generator(0), top_fn=lambda *_: top)
    assert (7, [7, 3, 9], [1.0, 0.0, 0.0]) == (picked.token_id, picked.top_ids, picked.top_sample_probs)
    assert abs(picked.prob - math.exp(4.0 - 4.5)) < 1e-12
    with pytest.raises(NotImplementedError):  # a penalty needs the whole row
        sample(logits, SamplingParams(temperature=0, repetition_penalty=1.3), make_generator(0), seen_ids=[7],
               top_fn=lambda *_: top)
