"""Explain mode on a tiny model: stepping gives the greedy run's tokens, the numbers shown are the
model's, and every view renders in both languages."""
from __future__ import annotations

import dataclasses
import threading

import plotly.graph_objects as go
import pytest
import torch

from conftest import tiny_model, user
from engine import WAKE, DecodeStep, Engine, EngineConfig, SamplingParams, token_bytes
from app.i18n import LANGUAGES, t
from app.ui.explain import demos, views
from app.ui.trace import ReplyTrace

PROMPT = "我是小"


@pytest.fixture(scope="module")
def engine(tokenizer):
    # head dimension 64: the native decode step runs, and hands out attention weights
    return Engine(tiny_model(tokenizer, num_heads=4, num_kv_heads=2, hidden=256), EngineConfig(precision="fp32"))


def stepped(engine: Engine, presses: int, sampling: SamplingParams | None = None) -> views.Walkthrough:
    """Start (prefill, held), then `presses` times Next token, driving the engine's steps here."""
    request = engine.new_request(user(PROMPT), sampling or SamplingParams(max_new_tokens=16, temperature=0,
                                                                          ignore_eos=True))
    request.explain = True
    walk = views.Walkthrough(request, ReplyTrace(turn=1), PROMPT)
    engine.allow(request, 0)
    engine.submit(request, [walk.trace.add])
    for _ in range(4):
        engine.step()
    assert 1 == len(walk.trace.steps)  # after prefill, nothing more until Next
    for press in range(presses):
        engine.allow(request, 1)
        for _ in range(3):
            engine.step()
        assert press + 2 == len(walk.trace.steps)  # exactly one token per press
    return walk


def test_pressing_next_n_times_gives_the_greedy_runs_tokens(engine):
    walk = stepped(engine, 5)
    plain = engine.new_request(user(PROMPT), SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))
    list(engine.run(plain))
    assert plain.generated_ids == walk.request.generated_ids
    walk.cancel()
    engine.step()


def test_a_held_walk_through_is_named_when_it_stops_a_precision_switch(engine):
    from app.ui.language import user_error
    from engine import EngineBusy

    walk = stepped(engine, 1)
    with pytest.raises(EngineBusy) as refused:
        engine.switch_precision("fp16")
    assert refused.value.held == 1 and "(1 held step by step)" in str(refused.value)
    assert "Explain tab's walk-through holds a reply" in user_error("en", refused.value)
    assert "讲解" in user_error("zh", refused.value)
    walk.cancel()
    engine.step()


def test_a_switch_the_engine_refuses_puts_the_selector_and_the_note_back(engine):
    """The page's precision switch while a walk-through holds a reply: the note said it was switching, and
    the refusal puts the selector back at the running precision and the note back as it was."""
    import gradio as gr

    from app.ui import panels
    from app.ui.chat_tab import make_switch

    walk = stepped(engine, 1)
    running = engine.info.precision
    said = list(make_switch(engine, {"report": None})("fp16", "zh"))
    assert [panels.switching_html("fp16", "zh"), panels.precision_html(None, "zh")] == [said[0][2], said[1][2]]
    assert "正在切换到 <b>fp16</b>" in said[0][2] and running == said[1][0] == engine.info.precision
    assert [(gr.skip(),) * 3] == list(make_switch(engine, {"report": None})(running, "zh"))  # the page's load's
    walk.cancel()
    engine.step()


def test_the_candidates_are_the_softmax_of_the_models_logits(engine):
    walk = stepped(engine, 3)
    ids = walk.request.prompt_ids + walk.request.generated_ids
    with torch.no_grad():
        logits = engine.loaded.model(torch.tensor([ids])).logits[0]  # transformers' own forward, no cache
    for step in walk.trace.steps:
        probs = logits[len(walk.request.prompt_ids) + step.step - 1].softmax(-1)
        top = probs.topk(len(step.top))
        assert [c.token_id for c in step.top] == top.indices.tolist()
        assert [c.prob for c in step.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert step.token_id == step.top[0].token_id  # greedy took the most probable
    walk.cancel()
    engine.step()


def test_each_steps_attention_sums_to_one_per_head_and_its_stages_are_timed(engine):
    walk = stepped(engine, 3)
    for step in walk.trace.steps[1:]:
        assert step.attention.shape == (2, 4, step.kv_tokens)  # layers, heads, positions
        assert torch.allclose(step.attention.sum(-1), torch.ones(2, 4), atol=1e-5)
        assert step.stage_ms["attention"] > 0 and step.stage_ms["lm_head"] > 0 and step.stage_ms[WAKE] >= 0
    assert views.attention_row(walk.trace.steps[-1], "1", "3") is not None
    walk.cancel()
    engine.step()


@pytest.mark.parametrize("lang", LANGUAGES)
def test_the_threads_waking_is_said_apart_from_the_forwards_time(engine, lang):
    """A step taken by hand after a pause woke its threads first (4-25 ms on a 2-core VM, where its forward
    took 6): the forward's time, its bandwidth and its stages leave that out, and a sentence says it."""
    walk = stepped(engine, 1)
    step = walk.trace.steps[-1]
    stages = {stage: 1.0 for stage in views.STAGE_NAMES if stage != "tokenize"}  # 7 ms in all, sample included
    walk.trace.steps[-1] = dataclasses.replace(step, forward_ms=15.0, stage_ms={**stages, WAKE: 9.0})
    text = views.explanation(engine, walk.trace, lang)
    assert "6.0 ms" in text and "15.0" not in text  # the forward: 15 ms less the 9 of waking
    assert text.endswith(t(lang, "explain.woke", ms=9.0))
    assert "7.0 ms" in views.pipeline_html(engine, walk.trace, lang)  # the stages' sum: no waking in it
    walk.trace.steps[-1] = dataclasses.replace(step, forward_ms=6.2, stage_ms={**stages, WAKE: 0.2})
    assert "6.0 ms" in views.explanation(engine, walk.trace, lang)
    assert t(lang, "explain.woke", ms=0.2) not in views.explanation(engine, walk.trace, lang)  # awake
    walk.cancel()
    engine.step()


@pytest.mark.parametrize("lang", LANGUAGES)
def test_every_view_renders_in_each_language(engine, lang):
    walk = stepped(engine, 2, SamplingParams(max_new_tokens=16, temperature=0.8, top_k=3, seed=1))
    html = views.steps_html(engine, walk, "0", "mean", lang)
    assert 'data-explain="held"' in html and 'data-tokens="3"' in html
    pipeline = views.pipeline_html(engine, walk.trace, lang)
    assert "{{" not in pipeline and 'data-phase="decode"' in pipeline
    assert "[1, 256]" in pipeline and "K,V [" in pipeline  # the decode step's shapes
    prefill = views.pipeline_html(engine, ReplyTrace(turn=1, chunks=walk.trace.chunks, first=walk.trace.first,
                                                     steps=walk.trace.steps[:1]), lang)
    prefilled = sum(c.num_tokens for c in walk.trace.chunks)  # the rest came from the prefix cache
    assert 'data-phase="prefill"' in prefill and f"[{prefilled}, 256]" in prefill
    tokens = views.tokens_html(engine.tokenizer, PROMPT, lang)
    ids = engine.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert f'data-tokens="{len(ids)}"' in tokens and "ps-tok-partial" in tokens  # 我 takes two byte tokens
    assert b"".join(token_bytes(engine.tokenizer, i) for i in ids) == PROMPT.encode()
    text = "The history of the bicycle. " * 100  # a pasted page: its first tokens, and how many more
    pasted, more = views.tokens_html(engine.tokenizer, text, lang), len(engine.tokenizer(text)["input_ids"]) - 200
    assert pasted.count('class="ps-tok ') == views.SHOWN_TEXT_TOKENS == 200 and pasted.count("bicycle") < 50
    assert f"{more} more" in pasted or f"另有 {more} 个" in pasted
    last = walk.trace.steps[-1]
    for figure in (views.candidates_figure(engine.tokenizer, last, walk.request.sampling, lang),
                   views.kv_grid_figure(engine, walk, lang)):
        go.Figure(figure.to_dict())  # valid for plotly
    assert 2 == len(views.candidates_figure(engine.tokenizer, last, walk.request.sampling, lang).data)
    walk.cancel()
    engine.step()


@pytest.mark.parametrize("lang", LANGUAGES)
def test_a_walk_through_on_transformers_forward_says_its_stages_are_not_timed(tokenizer, lang):
    """GPT-2 runs on transformers' forward, which times no stage: the pipeline says so rather than '0.4 ms in
    all stages' (only sampling's), and the steps read the model's own weights, not 'all 0 MB'."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from engine import LoadedModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=len(tokenizer))).eval()
    gpt2 = Engine(LoadedModel(model, tokenizer, "tiny-gpt2", "in-process", torch.device("cpu"), torch.float32))
    walk = stepped(gpt2, 2)
    pipeline = views.pipeline_html(gpt2, walk.trace, lang)
    assert "[1, 64] → [1, 256]" in pipeline  # the MLP's width, 4 x hidden (GPT-2's n_inner unset)
    assert "not timed stage by stage" in pipeline or "不按阶段计时" in pipeline
    html = views.steps_html(gpt2, walk, "mean", "mean", lang)
    assert gpt2.runner.weight_bytes > 64 * len(tokenizer) * 4  # lm_head, tied to the embedding, reads all of it
    assert f"{gpt2.runner.weight_bytes / 1e6:,.0f} MB" in html
    walk.cancel()
    gpt2.step()


@pytest.mark.parametrize("lang", LANGUAGES)
def test_a_walk_through_without_a_kv_cache_says_each_step_computes_the_sequence_again(engine, lang):
    """--no-kv-cache: a decode step is a prefill of the whole sequence so far, and its keys and values are
    scratch; the step, the pipeline, the summary and the cache's line say so, with the step's FLOPs."""
    variant = engine.variant(kv_cache=False)
    walk = stepped(variant, 2)
    step = walk.trace.steps[-1]
    html = views.steps_html(variant, walk, "mean", "mean", lang)
    assert "--no-kv-cache" in html and f"{step.flops / 1e9:,.2f} GFLOP" in html
    assert "{" not in html and "KV 缓存让它不必" not in html and "the cache spares it" not in html
    pipeline = views.pipeline_html(variant, walk.trace, lang)
    assert f"[{step.kv_tokens}, 256]" in pipeline and "[1, 256] →" not in pipeline  # the sequence, not one token
    # more than twice a cached step's work (lm_head, one row either way, weighs most in the tiny model)
    assert step.flops > 2 * variant.forward_flops(1, step.kv_tokens - 1)
    go.Figure(views.kv_grid_figure(variant, walk, lang).to_dict())
    walk.cancel()
    variant.step()


def test_demos_run_the_model_and_say_what_the_numbers_show(engine):
    for name, (run, show) in demos.DEMOS.items():
        replies = run(engine)
        assert all(r.finished and r.finished.reason == "length" for r in replies), name
        for lang in LANGUAGES:
            html, figure = show(engine, replies, lang)
            assert html.count("<tr>") == 1 + len(replies) and "<p>" in html
            assert "data-shared" not in html  # the engine ran nothing else
            go.Figure(figure.to_dict())
    first, second = demos.run_second_turn(engine)
    assert second.metrics().num_cached_tokens > 0  # the second turn continued from the first's cache
    short, long = demos.run_short_vs_long(engine)
    assert long.metrics().num_prompt_tokens > 3 * short.metrics().num_prompt_tokens  # both hold the system prompt


@pytest.mark.parametrize("changes, says", [
    (dict(kv_cache=False), {"short_vs_long": "--no-kv-cache", "long_answer": "--no-kv-cache",
                            "second_turn": "--no-kv-cache"}),
    (dict(prefix_caching=False), {"second_turn": "--no-prefix-cache"}),
    (dict(kv_window=32, kv_sinks=4), {"long_answer": "--kv-window", "second_turn": "--kv-window"}),
    (dict(speculative="prompt-lookup"), {"short_vs_long": "prompt-lookup", "long_answer": "prompt-lookup",
                                         "second_turn": "prompt-lookup"})])
def test_the_demos_tell_the_story_of_the_engine_they_ran_on(engine, changes, says):
    """Under the engine's switches the usual story is not what happened (no cache: TPOT grows; a window: the
    cache stops growing; no prefix reuse: the second turn prefills it all): each demo says what did."""
    variant = engine.variant(**changes)
    for name, (run, show) in demos.DEMOS.items():
        replies = run(variant)
        for lang in LANGUAGES:
            html, figure = show(variant, replies, lang)
            assert "{" not in html and "0 of them" not in html
            assert (says.get(name, "\0") in html) == (name in says), (name, lang)
            go.Figure(figure.to_dict())
        if name == "long_answer" and not variant.config.kv_cache:
            assert 1 == len(figure.data)  # no KV cache to draw


def test_a_demo_that_shared_the_engine_says_so(tokenizer):
    """A chat in another tab decoding meanwhile: the demo's steps ran in its batch, and its times include
    the other reply's work, which the demo's result says (in both languages) instead of passing them off."""
    engine = Engine(tiny_model(tokenizer), EngineConfig(precision="fp32"))
    loop = threading.Thread(target=engine.serve_forever, daemon=True)
    loop.start()
    other = engine.new_request(user("Another tab's long reply"),
                               SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True))
    started = threading.Event()
    engine.submit(other, [lambda event: started.set() if isinstance(event, DecodeStep) else None])
    try:
        assert started.wait(60)
        replies = demos.run_long_answer(engine, num_tokens=20)
    finally:
        other.cancel()
        engine.stop()
        loop.join(timeout=10)
    for lang in LANGUAGES:
        html, _ = demos.show_long_answer(engine, replies, lang)
        assert 'data-shared="2"' in html and "⚠️" in html


def test_decode_steps_report_their_stages_on_the_pytorch_path_too(tokenizer):
    engine = Engine(tiny_model(tokenizer, num_heads=4, num_kv_heads=2, hidden=256), EngineConfig(precision="fp32"))
    request = engine.new_request(user(PROMPT), SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True))
    request.explain = True
    with engine.runner.pytorch_decode():  # the native step set aside
        steps = [e for e in engine.run(request) if isinstance(e, DecodeStep)]
    assert steps[1].attention is None and steps[1].stage_ms["ffn"] > 0
