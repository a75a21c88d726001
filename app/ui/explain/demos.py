"""One-click demonstrations for a class: each runs the real model and says what its numbers show.

short_vs_long: TTFT grows with the prompt, TPOT does not. long_answer: TPOT stays flat while the KV
cache grows by the same bytes every token. second_turn: the next turn of a chat continues from the
cache (prefix caching) instead of reading the conversation again. Each demo is a run (the engine's
replies) and a view of them in a language, so that a language switch redraws without running again.
"""
from __future__ import annotations

import itertools
from html import escape
from typing import TYPE_CHECKING

import plotly.graph_objects as go

from engine import SamplingParams, reply_message

from ...i18n import t
from .. import charts
from ..trace import ReplyTrace

if TYPE_CHECKING:  # the engine's machinery imports torch: the page is served before it loads
    from engine import Engine, EngineConfig

_runs = itertools.count(1)
LONG_TEXT = ("Prefill reads every token of the prompt in one forward pass; decode then makes one token per "
             "forward pass, reading all the weights each time. ")


def _reply(engine: Engine, messages: list[dict], max_new_tokens: int) -> ReplyTrace:
    trace = ReplyTrace(turn=1)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)
    for event in engine.stream(messages, sampling):
        trace.add(event)
    return trace


def _fresh(text: str) -> str:
    """A prompt the prefix cache has not seen (each click is measured from scratch)."""
    return f"({next(_runs)}) {text}"


def _row(lang: str, name: str, trace: ReplyTrace) -> str:
    m = trace.metrics()
    return (f"<tr><td>{name}</td><td>{m.num_prompt_tokens:,}</td><td>{m.num_cached_tokens:,}</td>"
            f"<td>{m.ttft_ms:,.1f}</td><td>{m.tpot_ms:,.2f}</td></tr>")


def _table(lang: str, rows: list[str]) -> str:
    head = "".join(f"<th>{t(lang, key)}</th>" for key in ("demo.col_run", "demo.col_prompt", "demo.col_cached",
                                                          "demo.col_ttft", "demo.col_tpot"))
    return f'<table class="ps-demo-table"><tr>{head}</tr>{"".join(rows)}</table>'


def _notes(engine: Engine, replies: list[ReplyTrace], lang: str) -> str:
    """What else shaped the demo's numbers: speculative decoding (several tokens per forward), and other
    replies sharing its decode steps (a chat in another tab, an API client: their times include the others'
    work, so what the demo points at may not show)."""
    notes = ""
    if engine.config.speculative:
        note = t(lang, "demo.speculative", method=engine.config.speculative)
        notes += f'<p class="ps-demo-note">{escape(note)}</p>'
    batch = max((step.batch_size for trace in replies for step in trace.steps), default=1)
    if batch > 1:
        warning = t(lang, "demo.shared", batch=batch)
        notes += f'<p class="ps-attention" data-shared="{batch}">⚠️ {escape(warning)}</p>'
    return notes


def run_short_vs_long(engine: Engine, max_repeats: int = 16) -> list[ReplyTrace]:
    """The same question short and long: the long one ~500 tokens, or half the model's context if less."""
    per_repeat = len(engine.tokenizer(LONG_TEXT, add_special_tokens=False)["input_ids"])
    repeats = max(1, min(max_repeats, engine.context_window // 2 // per_repeat))
    return [_reply(engine, [{"role": "user", "content": _fresh("我是小")}], 16),
            _reply(engine, [{"role": "user", "content": _fresh(LONG_TEXT * repeats)}], 16)]


def show_short_vs_long(engine: Engine, replies: list[ReplyTrace], lang: str) -> tuple[str, go.Figure]:
    short, long = replies
    s, l = short.metrics(), long.metrics()
    cached = engine.config.kv_cache  # without it, each decode step recomputes the prompt: TPOT grows too
    names = [t(lang, "demo.short"), t(lang, "demo.long")]
    figure = charts.figure(dict(data=[
        dict(type="bar", name="TTFT (ms)", x=names, y=[s.ttft_ms, l.ttft_ms], marker=dict(color=charts.PREFILL_COLOR)),
        dict(type="bar", name="TPOT (ms)", x=names, y=[s.tpot_ms, l.tpot_ms], marker=dict(color=charts.DECODE_COLOR)),
    ], layout=dict(title=dict(text=t(lang, "demo.short_long_title" if cached else "demo.short_long_title_no_cache"),
                              x=0.01), barmode="group", height=300,
                   font=dict(family=charts.FONT_FAMILY), paper_bgcolor="white", plot_bgcolor="white",
                   yaxis=dict(title=dict(text="ms")))))
    text = t(lang, "demo.short_long_result" if cached else "demo.short_long_result_no_cache",
             short=s.num_prompt_tokens - s.num_cached_tokens,
             long=l.num_prompt_tokens - l.num_cached_tokens, short_ttft=s.ttft_ms, long_ttft=l.ttft_ms,
             ttft_ratio=l.ttft_ms / max(s.ttft_ms, 1e-6), short_tpot=s.tpot_ms, long_tpot=l.tpot_ms)
    rows = [_row(lang, names[0], short), _row(lang, names[1], long)]
    return _table(lang, rows) + f"<p>{text}</p>" + _notes(engine, replies, lang), figure


def run_long_answer(engine: Engine, num_tokens: int = 200) -> list[ReplyTrace]:
    num_tokens = min(num_tokens, engine.context_window // 2)
    return [_reply(engine, [{"role": "user", "content": _fresh("Write a long story about a lighthouse.")}],
                   num_tokens)]


def show_long_answer(engine: Engine, replies: list[ReplyTrace], lang: str) -> tuple[str, go.Figure]:
    """TPOT flat while the cache grows linearly; the engine's switches change the story: without a KV cache
    each step recomputes the sequence (time per token grows), a sliding window caps the cache."""
    (trace,) = replies
    steps = trace.steps[1:]
    xs = [s.step + 1 for s in steps]
    config = engine.config
    half = len(steps) // 2
    first = sum(s.latency_ms for s in steps[:half]) / max(half, 1)
    second = sum(s.latency_ms for s in steps[half:]) / max(len(steps) - half, 1)
    numbers = dict(n=len(trace.steps), first=first, second=second, ratio=second / max(first, 1e-6),
                   per_token=engine.info.kv_bytes_per_token, start=steps[0].kv_bytes / 1e6 if steps else 0,
                   end=steps[-1].kv_bytes / 1e6 if steps else 0, window=config.kv_window, sinks=config.kv_sinks)
    if not config.kv_cache:
        title, text = t(lang, "demo.long_title_no_cache"), t(lang, "demo.long_result_no_cache", **numbers)
    elif config.kv_window:
        title, text = t(lang, "demo.long_title_window"), t(lang, "demo.long_result_window", **numbers)
    else:
        title, text = t(lang, "demo.long_title"), t(lang, "demo.long_result", **numbers)
    lines = [dict(type="scatter", mode="lines", name=t(lang, "demo.itl"), x=xs, y=[s.latency_ms for s in steps],
                  line=dict(color=charts.DECODE_COLOR, width=1))]
    if config.kv_cache:  # without one, the keys and values are each step's scratch: no cache to draw
        lines.append(dict(type="scatter", mode="lines", name=t(lang, "demo.kv_mb"), x=xs, yaxis="y2",
                          y=[s.kv_bytes / 1e6 for s in steps], line=dict(color=charts.PREFILL_COLOR, width=2)))
    figure = charts.figure(dict(data=lines, layout=dict(
        title=dict(text=title, x=0.01), height=300, paper_bgcolor="white",
        plot_bgcolor="white", font=dict(family=charts.FONT_FAMILY),
        legend=dict(orientation="h", y=1.02, x=1, xanchor="right", yanchor="bottom"),
        xaxis=dict(title=dict(text=t(lang, "demo.token"))),
        yaxis=dict(title=dict(text=t(lang, "demo.itl")), rangemode="tozero"),
        yaxis2=dict(title=dict(text=t(lang, "demo.kv_mb")), overlaying="y", side="right", rangemode="tozero",
                    tickmode="auto", showgrid=False))))  # round ticks of its own, not synced to the grid
    rows = [_row(lang, t(lang, "demo.long_answer"), trace)]
    return _table(lang, rows) + f"<p>{text}</p>" + _notes(engine, replies, lang), figure


def run_second_turn(engine: Engine) -> list[ReplyTrace]:
    question = {"role": "user", "content": _fresh("What is the KV cache?")}
    first = _reply(engine, [question], 32)
    second = _reply(engine, [question, reply_message(first.text, first.token_ids),
                             {"role": "user", "content": "And why does it grow?"}], 32)
    second.turn = 2
    return [first, second]


def _no_reuse(config: EngineConfig, lang: str) -> str:
    """Why a second turn reused nothing of the first's cache."""
    if not config.kv_cache:
        return t(lang, "demo.no_reuse_no_cache")
    if config.kv_window:
        return t(lang, "demo.no_reuse_window")
    if not config.prefix_caching:
        return t(lang, "demo.no_reuse_off")
    return t(lang, "demo.no_reuse_evicted")  # the pool needed the room


def show_second_turn(engine: Engine, replies: list[ReplyTrace], lang: str) -> tuple[str, go.Figure]:
    first, second = replies
    figure = charts.figure(charts.kv_figure([first.events, second.events], lang))
    f, s = first.metrics(), second.metrics()
    numbers = dict(prompt=s.num_prompt_tokens, cached=s.num_cached_tokens,
                   new=s.num_prompt_tokens - s.num_cached_tokens, first_new=f.num_prompt_tokens - f.num_cached_tokens,
                   first_ttft=f.ttft_ms, second_ttft=s.ttft_ms)
    if s.num_cached_tokens:
        text = t(lang, "demo.second_result", **numbers)
    else:  # nothing reused: say why, instead of "0 of them were already in the KV pool"
        text = t(lang, "demo.second_result_no_reuse", why=_no_reuse(engine.config, lang), **numbers)
    rows = [_row(lang, t(lang, "chart.turn", n=1), first), _row(lang, t(lang, "chart.turn", n=2), second)]
    return _table(lang, rows) + f"<p>{text}</p>" + _notes(engine, replies, lang), figure


# name: (run, show)
DEMOS = {"short_vs_long": (run_short_vs_long, show_short_vs_long), "long_answer": (run_long_answer, show_long_answer),
         "second_turn": (run_second_turn, show_second_turn)}
