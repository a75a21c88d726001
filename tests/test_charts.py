"""Figures and panels are pure functions of events: checked here without a browser."""
from __future__ import annotations

import dataclasses
import json
import math

import plotly.graph_objects as go
import pytest

from app.i18n import LANGUAGES
from app.ui import charts, panels
from app.ui.live import LiveReply, Streams
from app.ui.session import ActiveRequests
from app.ui.trace import ReplyTrace
from engine import DecodeStep, EngineConfig, Finished, PrefillChunk, SamplingParams, Started

PER_TOKEN = 46080


def fake_reply(num_prompt: int = 10, num_steps: int = 4, chunk: int = 0, turn: int = 1) -> ReplyTrace:
    trace = ReplyTrace(turn=turn)
    trace.add(Started("r", 0.5, num_prompt, 64, 256, 256 * PER_TOKEN, "lean-llama"))
    chunk = chunk or num_prompt
    t = 1.0
    for index, start in enumerate(range(0, num_prompt, chunk)):
        end = min(start + chunk, num_prompt)
        t += 20.0
        trace.add(PrefillChunk("r", t, index, start, end, num_prompt, 20.0, end, end * PER_TOKEN))
    for step in range(num_steps):
        t += 5.0
        kv = num_prompt + step
        trace.add(DecodeStep("r", t, step, 100 + step, f"w{step}", t if step == 0 else 5.0, kv, kv * PER_TOKEN,
                             0.5, ()))
    return trace


def validated(fig: dict | go.Figure) -> go.Figure:
    """The app skips plotly's validation for speed; the tests do not."""
    return go.Figure(fig if isinstance(fig, dict) else fig.to_dict())


@pytest.mark.parametrize("num_steps", [0, 1, 5, 40])
def test_latency_figure_has_one_prefill_bar_and_a_point_per_token(num_steps):
    fig = validated(charts.latency_figure(fake_reply(num_steps=num_steps).events))
    bars, points = fig.data[0], fig.data[1]
    assert ("prefill", [0], [20.0]) == (bars.name, list(bars.x), list(bars.y))
    assert ("decode", list(range(1, num_steps + 1))) == (points.name, list(points.x))
    assert ([charts.PREFILL_COLOR] + [charts.DECODE_COLOR] * num_steps)[:num_steps] == list(points.marker.color)
    names = [t.name for t in fig.data]
    assert (num_steps >= 2) == any(name.startswith("TPOT") for name in names)


def test_latency_figure_draws_a_bar_per_prefill_chunk():
    fig = validated(charts.latency_figure(fake_reply(num_prompt=10, chunk=4).events))
    assert [-2, -1, 0] == list(fig.data[0].x)
    assert [[1, 4, 0, 4], [2, 4, 4, 8], [3, 2, 8, 10]] == [list(c) for c in fig.data[0].customdata]


def test_tpot_line_is_the_mean_decode_gap():
    fig = validated(charts.latency_figure(fake_reply(num_steps=5).events))
    tpot = next(t for t in fig.data if t.name.startswith("TPOT"))
    assert [5.0, 5.0] == list(tpot.y)


def test_a_token_that_waited_for_a_measurement_is_marked_where_it_waited():
    """The step after a Lab run: grey, its hover and an arrow at its spike say the wait; a few ms of wait
    (a reply sent as a run ended) say nothing, as the line under the reply does not."""
    steps = [e for e in fake_reply(num_steps=5).events if isinstance(e, DecodeStep)]
    steps[2] = dataclasses.replace(steps[2], latency_ms=3206.0, held_ms=3201.7)
    steps[3] = dataclasses.replace(steps[3], latency_ms=45.0, held_ms=40.0)
    for lang, said in (("en", "waited 3.2 s for a measurement"), ("zh", "因测量等待 3.2 秒")):
        fig = validated(charts.latency_figure(steps, lang))
        points = fig.data[1]
        assert [charts.PREFILL_COLOR, charts.DECODE_COLOR, charts.HELD_COLOR, charts.DECODE_COLOR,
                charts.DECODE_COLOR] == list(points.marker.color)
        assert [bool(c[2]) for c in points.customdata] == [False, False, True, False, False]
        assert "3.2" in points.customdata[2][2] and "%{customdata[2]}" in points.hovertemplate
        marks = [a for a in fig.layout.annotations if a.x == 3]
        assert [said] == [a.text for a in marks] and marks[0].y == pytest.approx(math.log10(3206.0))
        assert charts.decode_points(steps[2:3], lang)["customdata"] == [list(points.customdata[2])]  # streamed


def test_kv_figure_continues_across_turns():
    turns = [fake_reply(num_prompt=10, num_steps=3).events, fake_reply(num_prompt=20, num_steps=2, chunk=8).events]
    fig = validated(charts.kv_figure(turns))
    first, second = (next(t for t in fig.data if t.name == f"turn {n}") for n in (1, 2))
    assert [0, 1, 2, 3, 4] == list(first.x)
    assert [0.0, 10 * PER_TOKEN / 1e6, 10 * PER_TOKEN / 1e6, 11 * PER_TOKEN / 1e6, 12 * PER_TOKEN / 1e6] == list(first.y)
    assert [5, 6, 7, 8, 9, 10] == list(second.x)  # the empty cache, 3 prefill chunks, 2 decode steps
    assert [0, 8, 16, 20, 20, 21] == [c[0] for c in second.customdata]
    # the prompt's burst in prefill's colour: the empty cache and the 3 chunks, drawn over the turn's line
    bursts = [t for t in fig.data if t.name == "prefill" and t.mode == "lines"]
    assert [[0, 1], [5, 6, 7, 8]] == [list(b.x) for b in bursts]
    assert list(second.y[:4]) == list(bursts[1].y)
    assert {charts.PREFILL_COLOR} == {b.line.color for b in bursts}
    assert [i + 1 for i, t in enumerate(fig.data) if t.name in ("turn 1", "turn 2")] == \
        [i for i, t in enumerate(fig.data) if t in bursts]  # after their turn: the page appends to the turn
    allocated = [t for t in fig.data if t.name == "allocated"]
    assert [256 * PER_TOKEN / 1e6] * 2 == list(allocated[0].y)


def test_empty_figures_are_valid_and_draw_no_axes_until_a_point():
    from app.ui.explain import views

    for empty in (charts.latency_figure([]), charts.kv_figure([]), charts.kv_figure([[]]),
                  views.candidates_figure(None, None, None, "en")):
        empty = validated(empty)
        assert empty.layout.xaxis.visible is False and empty.layout.yaxis.visible is False
    reply = fake_reply(num_steps=2)
    for drawn in (charts.latency_figure(reply.events), charts.kv_figure([reply.events])):
        drawn = validated(drawn)
        assert drawn.layout.xaxis.visible is True and drawn.layout.yaxis.visible is True


def test_an_attention_line_goes_under_a_panel_and_off_it_again():
    line = panels.attention("Select <b>first</b>.")
    assert 'class="ps-attention"' in line and "&lt;b&gt;" in line  # text, never markup
    assert "Selected: #1" == panels.without_attention("Selected: #1" + line + line)
    assert "" == panels.without_attention(None)
    assert "Selected: #1" + line == panels.with_attention("Selected: #1" + line, "Select <b>first</b>.")


def test_phase_indicator_follows_the_reply():
    assert "Ready" in panels.phase_html(None)
    trace = ReplyTrace(turn=1)
    trace.add(Started("r", 0.5, 1024, 64, 2048, 1, "lean-llama"))
    trace.add(PrefillChunk("r", 1, 0, 0, 384, 1024, 20.0, 384, 1))
    assert "<b>Prefill</b> — 384 / 1,024 prompt tokens" in panels.phase_html(trace)
    assert 'style="width:38%"' in panels.phase_html(trace)
    assert "<b>Decode</b> — token 4" in panels.phase_html(fake_reply(num_steps=4))
    assert "<b>Prefill</b> — 384 / 1,024 prompt tokens · running with 2 others" in panels.phase_html(trace, 2)
    assert "Queued</b> — 2 replies ahead of yours (16 running" in panels.queued_html(2, 16)
    assert "Queued</b> — 1 reply ahead" in panels.queued_html(1, 16)


def test_decode_phase_says_who_runs_beside_it():
    trace = fake_reply(num_steps=2)
    trace.add(DecodeStep("r", 99.0, 2, 7, "x", 5.0, 12, 12 * PER_TOKEN, 0.5, (), batch_size=3))
    assert "<b>Decode</b> — token 3 · running with 2 others (batch of 3)" in panels.phase_html(trace, 2)
    assert "<b>Decode</b> — token 3 · running with 1 other (batch of 3)" in panels.phase_html(trace, 1)
    # another tab's Explain walk-through, held between its steps: in the count, not in the batch
    assert ("<b>Decode</b> — token 3 · running with 2 others, 1 of them paused step by step in Explain (batch of 3)"
            in panels.phase_html(trace, 2, num_held=1))


def test_pool_gauge():
    from engine import PoolUsage

    usage = PoolUsage(num_blocks=1000, block_size=16, bytes_per_block=16 * PER_TOKEN, num_used=250, num_cached=100)
    html = panels.pool_html(usage, 3, 2)
    assert 'data-kpi="pool_usage">25.0%</b> in use' in html
    assert "184.3 MB held by 3 requests · 2 waiting" in html and "73.7 MB cached prefixes" in html
    assert "479 of 737 MB free" in html
    assert "no pool" in panels.pool_html(PoolUsage(0, 1, 0, 0, 0), 1, 0)


def test_kv_figure_draws_the_reused_prefix_as_kept():
    trace = ReplyTrace(turn=2)
    trace.add(Started("r", 0.5, 40, 64, 112, 112 * PER_TOKEN, "lean-llama", num_cached_tokens=32))
    trace.add(PrefillChunk("r", 2.0, 0, 32, 40, 40, 3.0, 40, 40 * PER_TOKEN))
    trace.add(DecodeStep("r", 5.0, 0, 9, "a", 5.0, 40, 40 * PER_TOKEN, 0.5, ()))
    fig = validated(charts.kv_figure([fake_reply().events, trace.events]))
    turn = next(t for t in fig.data if t.name == "turn 2")
    assert [32 * PER_TOKEN / 1e6, 40 * PER_TOKEN / 1e6, 40 * PER_TOKEN / 1e6] == list(turn.y)  # not from zero
    assert [[32, "kept"], [40, "prefill"], [40, "decode"]] == [list(c) for c in turn.customdata]
    kept = next(t for t in fig.data if t.name == "kept from cache" and t.fill == "tozeroy")
    assert [32 * PER_TOKEN / 1e6] * 2 == list(kept.y)
    tiles = panels.kpi_html(trace)
    assert 'data-kpi="prompt_tokens_note">cached 32 / 40<' in tiles
    # the last turn's levels (kept, allocated) follow its streaming points in the page; the first turn's stay
    levels = [(t.name, t.x[0], t.meta) for t in fig.data if t.name == "allocated" or t.fill == "tozeroy"]
    second = turn.x[0]
    assert [("allocated", 0, None), ("kept from cache", second, "level"), ("allocated", second, "level")] == levels


def remote_reply(turn: int, cached: int) -> ReplyTrace:
    """A remote endpoint's reply as app/remote gives it: no capacity, no prefill chunks, steps of no size,
    and the server's prompt and cached tokens learned from its usage at the end."""
    trace = ReplyTrace(turn=turn)
    trace.add(Started("r", 0.0, 0, 64, 0, 0, "remote http://127.0.0.1:8080/v1"))
    for step in range(3):
        trace.add(DecodeStep("r", 50.0 + 10 * step, step, -1, "a", 10.0, 0, 0, None, ()))
    metrics = dataclasses.replace(fake_reply().metrics(), num_prompt_tokens=38, num_cached_tokens=cached)
    trace.add(Finished("r", 80.0, "eos", "aaa", metrics))
    return trace


@pytest.mark.parametrize("lang", LANGUAGES)
def test_a_remote_servers_turns_draw_no_kv_cache(lang):
    """A server's cache is out of sight (not zero): its turns add nothing to the KV figure, which says so when
    they are all it has, nor to the tile and the stream's new points; a prompt it took from its own prefix
    cache is said in the prompt tile (that second turn once divided by the zero capacity)."""
    first, second = remote_reply(1, 0), remote_reply(2, 37)
    assert not second.cache_visible and second.num_cached_tokens == 37
    fig = validated(charts.kv_figure([first.events, second.events], lang))
    assert not fig.data and [a.text for a in fig.layout.annotations] == [charts.t(lang, "chart.kv_remote")]
    local = fake_reply(turn=1)  # a chat that began on this machine's engine keeps its turn drawn
    fig = validated(charts.kv_figure([local.events, second.events], lang))
    assert [t.name for t in fig.data if t.name.startswith(("turn", "第"))] == [charts.t(lang, "chart.turn", n=1)]
    assert not fig.layout.annotations
    tiles = panels.kpi_html(second, lang)
    assert f'<div class="ps-label">{charts.t(lang, "kpi.kv_remote")}</div><div class="ps-value">–<' in tiles
    assert charts.t(lang, "kpi.cached", cached=37, total=38) in tiles
    live = LiveReply("x", [first, second], lang)
    live.update()
    second.add(DecodeStep("r", 90.0, 3, -1, "b", 10.0, 0, 0, None, ()))
    assert set(json.loads(live.update())["append"]) == {"latency"}


def test_phase_and_tiles_when_finished(tiny_engine):
    trace = ReplyTrace(turn=1)
    for event in tiny_engine.stream([{"role": "user", "content": "Hi"}],
                                    SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)):
        trace.add(event)
    assert isinstance(trace.events[-1], Finished)
    assert "<b>Done</b> — 5 tokens · max new tokens reached" in panels.phase_html(trace)
    tiles = panels.kpi_html(trace)
    assert 'data-kpi="generated_tokens"><div class="ps-label">Generated</div><div class="ps-value">5<' in tiles
    assert f"{trace.finished.metrics.ttft_ms:,.0f} ms" in tiles
    line = panels.stats_line(trace.finished.metrics, "length")
    assert line.endswith("5 tok") and "TTFT" in line and " prompt tok · cached 0 · TTFT" in line
    unknown = dataclasses.replace(trace.finished.metrics, num_prompt_tokens=0)  # a remote reply stopped early
    shown = panels.stats_line(unknown, "cancelled")
    assert shown.startswith("TTFT ") and shown.endswith(" · 5 tok · stopped") and "prompt" not in shown
    held = panels.stats_line(trace.finished.metrics, "length", "zh", held_ms={"lab": 3201.7})  # a Lab run held it
    assert held.endswith(" · 因测量等待 3.2 秒")
    brief = panels.stats_line(trace.finished.metrics, "length", held_ms={"lab": 40.0})  # sent as the run ended
    assert brief == line  # a few ms are not worth a word, here as in the toast and the History tab


def test_live_metrics_use_the_engine_definitions():
    trace = fake_reply(num_prompt=10, num_steps=5)
    m = trace.metrics()
    assert (5, 5.0, 10) == (m.num_generated_tokens, m.tpot_ms, m.num_prompt_tokens)
    assert m.prefill_tokens_per_s == pytest.approx(500.0)  # 10 tokens in 20 ms


def test_model_panel_shows_the_kv_formula(tiny_engine):
    html = panels.model_html(tiny_engine.info)
    assert "2 × 2 layers × 2 KV heads × 16 head dim × 4 B = 512 B/token" in html
    assert "switches" not in panels.model_html(tiny_engine.info, config=EngineConfig())  # all at their defaults


@pytest.mark.parametrize("lang", LANGUAGES)
def test_a_tokenizer_without_a_chat_template_is_said_where_the_model_is(tiny, lang):
    """A base model's tokenizer names no chat template: the messages are joined as plain text, which the
    model continues; the model line says so, and the terminal's first line."""
    import copy

    from app.cli import engine_line
    from engine import Engine, LoadedModel

    note = {"en": "No chat template", "zh": "没有对话模板"}[lang]
    assert note not in panels.model_html(Engine(tiny).info, lang)
    tokenizer = copy.copy(tiny.tokenizer)
    tokenizer.chat_template = None
    plain = Engine(LoadedModel(tiny.model, tokenizer, "tiny-base", "in-process", tiny.device, tiny.dtype))
    assert note in panels.model_html(plain.info, lang) and "no chat template)" in engine_line(plain)


@pytest.mark.parametrize("lang", LANGUAGES)
def test_model_panel_names_the_switches_that_change_what_the_page_shows(tiny_engine, lang):
    """A class comparing runs sees how this engine runs: without a KV cache, a window, speculation..."""
    config = EngineConfig(kv_cache=False, attention="eager", split_kv=False, bind_threads=True)
    html = panels.model_html(tiny_engine.info, lang, config)
    assert all(flag in html for flag in ("--no-kv-cache", "eager", "--no-split-kv", "--bind-threads")), html
    assert "{" not in html and "--no-prefix-cache" not in html  # implied by no KV cache: not said twice
    assert "prompt-lookup" in panels.model_html(tiny_engine.info, lang, EngineConfig(speculative="prompt-lookup"))
    window = panels.model_html(tiny_engine.info, lang, EngineConfig(kv_window=64, kv_sinks=4))
    assert "--kv-window" in window and "64" in window and "--no-prefix-cache" not in window
    assert "--no-prefix-cache" in panels.model_html(tiny_engine.info, lang, EngineConfig(prefix_caching=False))


def test_stop_reaches_a_waiting_chat_and_a_running_one(tiny_engine):
    active = ActiveRequests()
    active.wait("a")
    active.wait("b")
    assert active.cancel("b")  # stopped while waiting
    request = tiny_engine.new_request([{"role": "user", "content": "Hi"}])
    active.start("b", request)
    assert request.is_cancelled
    other = tiny_engine.new_request([{"role": "user", "content": "Hi"}])
    active.start("a", other)
    assert not other.is_cancelled and active.cancel("a") and other.is_cancelled
    active.finish("a", other)
    assert not active.cancel("a")


@pytest.mark.parametrize("seed, expected", [(-1, None), (None, None), (0, 0), (42, 42)])
def test_seed_setting(seed, expected):
    from app.ui.chat_tab import _settings

    assert expected == _settings(16, 0.7, 1.0, 0, seed).seed


def test_a_failing_hook_ends_the_reply_with_a_warning(tiny_engine):
    from app.ui.chat_tab import SETTINGS, make_finish, make_respond
    from app.ui.session import ChatSession, EngineThread

    asked = []

    def recorder(session, messages, sampling, trace):
        asked.append(sampling)

        def hook(event):
            if isinstance(event, DecodeStep) and event.step == 2:
                raise RuntimeError("hook broke")
        return hook

    runner = EngineThread().start().serve(tiny_engine)
    session = ChatSession()
    session.accept("Hi")
    session.settings = dict(zip(SETTINGS, ("", 50, 0, 1.0, 0, 1.15, -1, 0)))  # as accept keeps them
    active, streams = ActiveRequests(), Streams()
    streams.open(session.reply_id)
    # outside a browser request, gr.Warning is a Python warning; the page is drawn whole when respond ends
    with pytest.warns(UserWarning, match="^the reply ended early: RuntimeError: hook broke$"):
        make_respond(tiny_engine, active, recorder, streams)(session)
        make_finish(tiny_engine, active)(session)
    assert not streams.is_open(session.reply_id)  # its stream ended with it
    runner.stop()
    assert [] == session.warnings  # delivered to the page
    assert "cancelled" == session.traces[-1].finished.reason  # the engine ended it; the thread lives on
    assert "" == session.pending
    assert [(50, 0.0, 1.15)] == [(s.max_new_tokens, s.temperature, s.repetition_penalty) for s in asked]


def test_a_fault_before_the_reply_starts_is_said_in_its_place_and_the_chat_goes_on(tiny_engine, monkeypatch, capsys):
    from app.ui.chat_tab import SETTINGS, make_respond
    from app.ui.session import ChatSession, EngineThread

    def broken(*args, **kwargs):
        raise IndexError("list index out of range")

    active, streams = ActiveRequests(), Streams()
    session = ChatSession()
    session.settings = dict(zip(SETTINGS, ("", 4, 0, 1.0, 0, 1.0, -1, 0)))
    respond = make_respond(tiny_engine, active, None, streams)
    with monkeypatch.context() as patch:
        patch.setattr(tiny_engine, "new_request", broken)
        session.accept("Hi")
        active.wait(session.id)
        respond(session)
    assert "list index out of range" in session.display[-1]["content"] and "IndexError" in capsys.readouterr().err
    assert not active.is_busy(session.id) and "" == session.pending and [] == session.messages
    runner = EngineThread().start().serve(tiny_engine)
    session.accept("Hi again")  # the chat goes on
    active.wait(session.id)
    respond(session)
    runner.stop()
    assert session.traces[-1].finished.reason == "length" and 2 == len(session.messages)


def test_the_page_is_sent_a_replys_first_token_when_it_comes_not_at_the_next_update(tiny_engine, monkeypatch):
    """respond publishes at the first token, then every UPDATE_EVERY_S: here the updates are 30 s apart and
    the engine holds its second token until the page has been sent the first."""
    import threading

    from app.ui import chat_tab
    from app.ui.session import ChatSession, EngineThread

    sent, first_sent, sent_by_step_1 = [], threading.Event(), []

    class Recorded(Streams):
        def publish(self, reply_id, message):
            sent.append(json.loads(message))
            first_sent.set()  # (its text may be "": a token can be part of a character)
            super().publish(reply_id, message)

    def recorder(session, messages, sampling, trace):
        def hook(event):
            if isinstance(event, DecodeStep) and event.step == 1:
                sent_by_step_1.append(first_sent.wait(5))
        return hook

    monkeypatch.setattr(chat_tab, "UPDATE_EVERY_S", 30)
    runner = EngineThread().start().serve(tiny_engine)
    session, active, streams = ChatSession(), ActiveRequests(), Recorded()
    session.accept("Hi")
    session.settings = dict(zip(chat_tab.SETTINGS, ("", 4, 0, 1.0, 0, 1.0, -1, 0)))
    streams.open(session.reply_id)
    chat_tab.make_respond(tiny_engine, active, recorder, streams)(session)
    runner.stop()
    assert [True] == sent_by_step_1 and 2 == len(sent)  # the first token's message, then the rest at the end
    steps = session.traces[-1].steps  # (the first message may have the second token too: it was in the trace)
    assert sent[0]["text"].startswith(steps[0].text) and "".join(s.text for s in steps).startswith(sent[0]["text"])
    assert session.traces[-1].finished.reason == "length"


def test_a_remote_reply_wakes_its_waiter_at_the_first_token_and_at_the_end():
    import threading
    import time

    from app.ui.session import RemoteWorker

    release = threading.Event()

    class Endpoint:
        def stream(self, messages, sampling, cancelled):
            yield Started("r", 0.1, 3, 8, 0, 0, "remote")
            yield DecodeStep("r", 5.0, 0, -1, "Hi", 5.0, 0, 0, None, ())
            release.wait(10)
            yield DecodeStep("r", 9.0, 1, -1, "!", 4.0, 0, 0, None, ())

    worker = RemoteWorker(Endpoint(), [], SamplingParams(), ReplyTrace(turn=1))
    start = time.monotonic()
    worker.wait(30)
    assert worker.is_running and time.monotonic() - start < 10  # woken by the first token
    release.set()
    worker.wait(30)
    assert not worker.is_running and worker.error is None


def test_messages_are_editable_unless_the_chat_has_one_pending():
    from app.ui.chat_tab import chat_view
    from app.ui.session import ChatSession

    session = ChatSession()
    session.accept("Hi")  # waiting for the engine, then replying: no pencils
    assert None is chat_view(session.display, session).editable
    session.pending = ""
    assert "user" == chat_view(session.display, session).editable
    assert "user" == chat_view([], None).editable


def _replay(messages: list[str]) -> tuple[dict, dict, str]:
    """What static/phasescope.js does with the stream's messages: figures reset, then traces extended."""
    figures, text = {}, ""
    for raw in messages:
        message = json.loads(raw)
        text += message.get("text", "")
        for name, spec in (message.get("reset") or {}).items():
            figures[name] = spec
        for name, ext in (message.get("append") or {}).items():
            trace = figures[name]["data"][ext["trace"]]
            for key, values in ext["points"].items():
                holder, attribute = (trace["marker"], "color") if key == "marker.color" else (trace, key)
                holder[attribute] = list(holder[attribute]) + values
            trace["mode"] = ext["mode"]
    return figures["latency"], figures["kv"], text


def test_a_streaming_figure_has_no_tpot_line_until_the_reply_ends():
    """The figure a streaming reply starts from may come after several tokens; a TPOT line drawn from
    them would stay at that value while points are added. The whole figure at the end has it."""
    done = fake_reply(num_steps=6)
    streaming = ReplyTrace(turn=1)
    for event in done.events:  # six tokens in, not finished yet
        streaming.add(event)
    started = json.loads(LiveReply("chat-1", [streaming]).update())["reset"]["latency"]
    assert 6 == len(started["data"][charts.DECODE_TRACE]["x"])
    assert not any(trace["name"].startswith("TPOT") for trace in started["data"])
    ended = charts.latency_figure(done.events)
    assert any(trace["name"].startswith("TPOT") for trace in ended["data"])


@pytest.mark.parametrize("cached", [0, 16])
def test_streamed_points_rebuild_the_final_figures(cached):
    """The page draws whole figures once the first token came, then only appends points; what it then
    shows equals the figures built from every event (all but the TPOT line and the allocated span,
    which the final figures sent at the end of a reply add)."""
    first = fake_reply(num_steps=3)
    full = fake_reply(num_prompt=40, num_steps=70, turn=2)
    if cached:
        full.started = dataclasses.replace(full.started, num_cached_tokens=cached)
    streaming = ReplyTrace(turn=2)
    live = LiveReply("chat-2", [first, streaming])
    messages = []
    for event in full.events:
        streaming.add(event)
        if isinstance(event, DecodeStep) and event.step % 7 in (0, 3):  # updates at uneven intervals
            messages.append(live.update())
    messages.append(live.update())
    latency, kv, text = _replay(messages)
    expected_latency = charts.latency_figure(full.events)
    expected_kv = charts.kv_figure([first.events, full.events])
    decode = expected_latency["data"][charts.DECODE_TRACE]
    assert {k: decode[k] for k in ("x", "y", "customdata", "mode")} == \
        {k: latency["data"][charts.DECODE_TRACE][k] for k in ("x", "y", "customdata", "mode")}
    assert decode["marker"]["color"] == latency["data"][charts.DECODE_TRACE]["marker"]["color"]
    turn = next(i for i, t in enumerate(expected_kv["data"]) if t["name"] == "turn 2")
    for key in ("x", "y", "customdata", "mode"):
        assert expected_kv["data"][turn][key] == kv["data"][turn][key], key
    assert expected_kv["data"][turn]["marker"]["color"] == kv["data"][turn]["marker"]["color"]
    assert "".join(s.text for s in full.steps) == text


def test_a_streaming_reply_sends_the_panel_pieces_that_changed():
    """The live panel travels in the stream messages, each piece only when it changed (static/phasescope.js
    sets it in its box)."""
    streaming = ReplyTrace(turn=1)
    live = LiveReply("chat-1", [streaming])
    first = json.loads(live.update({"ps-phase": "<div>prefill</div>", "ps-pool": "<div>3%</div>"}))
    assert {"ps-phase": "<div>prefill</div>", "ps-pool": "<div>3%</div>"} == first["panels"]
    assert "panels" not in json.loads(live.update({"ps-phase": "<div>prefill</div>", "ps-pool": "<div>3%</div>"}))
    later = json.loads(live.update({"ps-phase": "<div>decode 4</div>", "ps-pool": "<div>3%</div>"}))
    assert {"ps-phase": "<div>decode 4</div>"} == later["panels"]
    assert "chat-1" == later["reply"]


def test_a_reply_stream_sends_what_came_before_the_page_followed_then_the_rest_and_ends():
    """Streams: the page may follow a reply after its first messages; it gets them, then each new one as
    it is published from another thread, and the stream ends with the reply. A page that goes away
    before the end calls the reply's on_abandoned (which stops generating)."""
    import asyncio
    import threading

    streams = Streams()
    streams.open("r-1")
    streams.publish("r-1", '{"text":"a"}')

    def rest_of_the_reply(reply_id):  # from the thread that runs the reply
        streams.publish(reply_id, '{"text":"b"}')
        streams.close(reply_id)

    async def read(reply_id):
        lines = []
        async for line in streams.follow(reply_id):
            lines.append(line)
            if len(lines) == 1:
                threading.Thread(target=rest_of_the_reply, args=(reply_id,)).start()
        return lines

    assert ['{"text":"a"}\n', '{"text":"b"}\n'] == asyncio.run(read("r-1"))
    assert not streams.is_open("r-1")
    assert [] == asyncio.run(read("r-1"))  # ended: nothing to follow (the page gets the reply from Gradio)
    abandoned = []
    streams.open("r-2")
    streams.on_abandoned("r-2", lambda: abandoned.append(True))
    streams.publish("r-2", '{"text":"a"}')

    async def leave():
        follower = streams.follow("r-2")
        assert '{"text":"a"}\n' == await follower.__anext__()
        await follower.aclose()  # the page closed

    asyncio.run(leave())
    assert [True] == abandoned
