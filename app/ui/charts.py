"""Figures: events in, a Plotly figure's spec (a dict) out. Pure functions, testable without a browser.

One colour for prefill and one for decode, everywhere in the app (static/app.css uses the same).
Figures are plain dicts, sent to the page as they are: plotly's per-property validation costs ~20x more
than the drawing data itself, and its JSON export copies every list (4.5 ms for a reply's first update,
35 ms after 40 turns, on the thread that competes with decode); tests validate them (figure()).
"""
from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence

import plotly.graph_objects as go

from engine import DecodeStep, Event, PrefillChunk, Started

from ..i18n import DEFAULT, t
from .trace import cache_visible, held_seconds

PREFILL_COLOR = "#e8871e"  # amber: the prompt read in one burst
DECODE_COLOR = "#2f6fdf"  # blue: one token at a time
CAPACITY_COLOR = "#9aa4b2"
CACHED_COLOR = "#7d8fab"  # prompt tokens whose K/V were reused from the pool (prefix caching)
HELD_COLOR = "#6b7280"  # a token that waited for a measurement (the Lab's): not the model's time
CACHED_FILL = "rgba(125, 143, 171, 0.18)"
GRID_COLOR = "#eceff3"
# the page's own fonts, CJK included (static/app.css declares the same stack); nothing is fetched
FONT_FAMILY = 'system-ui, "Noto Sans CJK SC", "Noto Sans SC", "PingFang SC", "Microsoft YaHei", sans-serif'
MAX_MARKERS = 60
STEP_WORDS = {"kept": "step.kept", "start": "step.start", "prefill": "step.prefill", "decode": "step.decode"}
LOG_TICKS = [0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000]


def _axis(title: str, **extra) -> dict:
    return dict(title=dict(text=title), gridcolor=GRID_COLOR, zeroline=False, linecolor="#d5dae1", **extra)


def has_points(data: list[dict]) -> bool:
    """Whether any trace has a point to draw. Without one a figure leaves its axes out: Plotly's empty log
    axis from 0.1 to 10,000 ms over steps -1 to 6 says nothing true."""
    return any(value is not None for trace in data for value in trace.get("x", []))


def _figure(data: list[dict], title: str, xaxis: dict, yaxis: dict, **layout) -> dict:
    """A figure's spec in the page's style; its axes once it has points (has_points). A reply's first
    points come in a whole new figure (app/ui/live.py), which has them."""
    drawn = has_points(data)
    xaxis, yaxis = {**xaxis, "visible": drawn}, {**yaxis, "visible": drawn}
    spec = dict(data=data, layout=dict(
        title=dict(text=title, x=0.01, font=dict(size=14)), height=300, hovermode="closest",
        font=dict(family=FONT_FAMILY, size=12, color="#2a3240"),
        paper_bgcolor="white", plot_bgcolor="white", margin=dict(l=55, r=15, t=45, b=45),
        legend=dict(orientation="h", y=1.02, x=1, xanchor="right", yanchor="bottom"),
        xaxis=xaxis, yaxis=yaxis, template=_template(), **layout))
    return spec


@functools.cache
def _template() -> dict:
    """Plotly's default template, as a figure carries it into the page (its JSON: 7 KB)."""
    return json.loads(go.Figure().to_json())["layout"]["template"]


def figure(spec: dict) -> go.Figure:
    """A spec as a plotly Figure, for Gradio's Plot (the live page takes the spec itself)."""
    return go.Figure(spec, _validate=False)


def point_mode(num_points: int) -> str:
    # one SVG marker per point makes every browser redraw slower, competing with decode for the CPU
    return "lines+markers" if num_points <= MAX_MARKERS else "lines"


def _legend_dot(name: str, color: str) -> dict:
    return dict(type="scatter", x=[None], y=[None], mode="markers", name=name, marker=dict(color=color, size=8))


DECODE_TRACE = 1  # the latency figure's decode trace: the page extends it while a reply streams


def decode_points(steps: Sequence[DecodeStep], lang: str = DEFAULT) -> dict[str, list]:
    """The decode trace's values for these steps, by Plotly attribute (the figure's, and what the page
    appends to it while streaming). A token that waited for a measurement says so on hover, in grey."""
    held = [held_seconds(s.held_ms) for s in steps]
    return {"x": [s.step + 1 for s in steps], "y": [s.latency_ms for s in steps],
            "marker.color": [HELD_COLOR if h else PREFILL_COLOR if s.step == 0 else DECODE_COLOR
                             for s, h in zip(steps, held)],
            "customdata": [[repr(s.text), s.kv_tokens, t(lang, "chart.held_hover", seconds=h) if h else ""]
                           for s, h in zip(steps, held)]}


def latency_figure(events: Sequence[Event], lang: str = DEFAULT, tpot_line: bool = True) -> dict:
    """Per-step latency: a bar per prefill chunk, then one point per generated token.

    Prefill chunks sit at x <= 0 (the last chunk at 0); token k of the reply sits at x = k. Token 1
    comes from the prefill's logits, so its latency is the TTFT; later tokens show their ITL. The TPOT
    line (tpot_line): the mean ITL of the steps so far, left out of a streaming reply's figure, where it
    would stay at its first value while points are added.
    """
    chunks = [e for e in events if isinstance(e, PrefillChunk)]
    steps = [e for e in events if isinstance(e, DecodeStep)]
    points = decode_points(steps, lang)
    data = [dict(
        type="bar", name=t(lang, "chart.prefill"), x=[i - len(chunks) + 1 for i in range(len(chunks))],
        y=[c.latency_ms for c in chunks], marker=dict(color=PREFILL_COLOR), width=0.8,
        customdata=[[c.chunk_index + 1, c.end - c.start, c.start, c.end] for c in chunks],
        hovertemplate=t(lang, "chart.chunk_hover") + "<extra></extra>",
    ), dict(
        type="scatter", name=t(lang, "chart.decode"), mode=point_mode(len(steps)), x=points["x"], y=points["y"],
        line=dict(color=DECODE_COLOR, width=1), marker=dict(color=points["marker.color"], size=5),
        customdata=points["customdata"],
        hovertemplate=t(lang, "chart.token_hover") + "<extra></extra>",
    )]
    shapes, annotations = [], []
    if tpot_line and len(steps) >= 2:
        tpot = (steps[-1].t_ms - steps[0].t_ms) / (len(steps) - 1)
        data.append(dict(type="scatter", mode="lines", name=f"TPOT {tpot:.1f} ms", x=[1, steps[-1].step + 1],
                         y=[tpot, tpot], line=dict(color=DECODE_COLOR, dash="dash", width=1.5), hoverinfo="skip"))
    if steps:
        shapes.append(dict(type="line", x0=0.5, x1=0.5, y0=0, y1=1, yref="paper",
                           line=dict(color=PREFILL_COLOR, dash="dot", width=1)))
        annotations.append(dict(x=0.5, y=1, yref="paper", text=f"TTFT {steps[0].latency_ms:,.0f} ms",
                                showarrow=False, font=dict(color=PREFILL_COLOR), yanchor="bottom"))
    for s in steps:  # where a measurement held the reply: its spike is not the model's
        if seconds := held_seconds(s.held_ms):
            annotations.append(dict(x=s.step + 1, y=math.log10(max(s.latency_ms, 1e-3)),  # a log axis: log10
                                    text=t(lang, "stats.held", seconds=seconds), showarrow=True, arrowhead=0, ax=0,
                                    ay=-18, font=dict(color=HELD_COLOR, size=11)))
    ticks = dict(tickvals=LOG_TICKS, ticktext=[f"{v:g}" for v in LOG_TICKS])
    return _figure(data, t(lang, "chart.latency_title"), _axis(t(lang, "chart.latency_x")),
                   _axis(t(lang, "chart.latency_y"), type="log", **ticks), shapes=shapes, annotations=annotations)


def _started(events: Sequence[Event]) -> Started | None:
    return next((e for e in events if isinstance(e, Started)), None)


# A turn's level lines in the KV chart (what was kept, what is allocated), marked for the page: while a reply
# streams they reach the x axis's end as it widens (static/phasescope.js), or they stopped where it began
LEVEL = "level"


def _turn_traces(number: int, events: Sequence[Event], x0: int, lang: str = DEFAULT,
                 levels: bool = False) -> tuple[list[dict], int]:
    """levels: its level lines marked LEVEL (the last turn's, which a streaming reply extends)."""
    started = _started(events)
    points = [e for e in events if isinstance(e, (PrefillChunk, DecodeStep))]
    if not points or not cache_visible(started):  # a remote endpoint's turn: no cache to draw
        return [], x0
    xs = list(range(x0, x0 + len(points) + 1))
    level = {"meta": LEVEL} if levels else {}
    phases = ["kept" if started and started.num_cached_tokens else "start"] + [
        "prefill" if isinstance(p, PrefillChunk) else "decode" for p in points]
    kept_tokens, kept_mb = 0, 0.0
    if started is not None and started.num_cached_tokens:  # the prefix reused from the pool: kept, not rebuilt
        kept_tokens = started.num_cached_tokens
        kept_mb = kept_tokens * started.kv_capacity_bytes / started.kv_capacity_tokens / 1e6
    traces = [dict(
        type="scatter", mode=point_mode(len(xs)), name=t(lang, "chart.turn", n=number), showlegend=False, x=xs,
        y=[kept_mb] + [p.kv_bytes / 1e6 for p in points], line=dict(color=DECODE_COLOR, width=1.5, shape="hv"),
        marker=dict(color=[{"decode": DECODE_COLOR, "kept": CACHED_COLOR}.get(ph, PREFILL_COLOR) for ph in phases],
                    size=5),
        customdata=[[tokens, t(lang, STEP_WORDS[phase])]
                    for tokens, phase in zip([kept_tokens] + [p.kv_tokens for p in points], phases)],
        hovertemplate=t(lang, "chart.turn", n=number) + " · " + t(lang, "chart.kv_hover") + "<extra></extra>",
    )]
    num_chunks = phases.count("prefill")
    if num_chunks:  # the prompt's burst drawn in prefill's colour over the turn's line (hover stays on the turn)
        traces.append(dict(type="scatter", mode="lines", name=t(lang, "chart.prefill"), showlegend=False,
                           x=xs[:num_chunks + 1], y=traces[0]["y"][:num_chunks + 1], hoverinfo="skip",
                           line=dict(color=PREFILL_COLOR, width=2, shape="hv")))
    if kept_tokens:
        traces.insert(0, dict(type="scatter", mode="lines", name=t(lang, "chart.kept"), showlegend=False,
                              x=[xs[0], xs[-1]], y=[kept_mb, kept_mb], fill="tozeroy", fillcolor=CACHED_FILL,
                              line=dict(color=CACHED_COLOR, width=1), **level,
                              hovertemplate=t(lang, "chart.kept_hover", n=number, tokens=kept_tokens, mb=kept_mb)
                              + "<extra></extra>"))
    if started is not None and started.kv_capacity_bytes:  # transformers' caches allocate nothing ahead
        capacity = started.kv_capacity_bytes / 1e6
        traces.append(dict(type="scatter", mode="lines", name=t(lang, "chart.allocated"), showlegend=number == 1,
                           x=[xs[0], xs[-1]], y=[capacity, capacity], **level,
                           line=dict(color=CAPACITY_COLOR, dash="dot", width=1),
                           hovertemplate=t(lang, "chart.allocated_hover", tokens=started.kv_capacity_tokens,
                                           mb=capacity) + "<extra></extra>"))
    return traces, xs[-1] + 1


def kv_turn_position(earlier_turns: Sequence[Sequence[Event]]) -> tuple[int, int]:
    """Where the next turn begins in kv_figure: the index of its first trace and its first x."""
    count, x = 0, 0
    for number, events in enumerate(earlier_turns, start=1):
        traces, x = _turn_traces(number, events, x)
        count += len(traces)
    return count, x


def kv_step_points(steps: Sequence[DecodeStep], x_start: int, lang: str = DEFAULT) -> dict[str, list]:
    """Decode steps as points of their turn's trace in kv_figure, the first at x_start (what the page
    appends to the trace while a reply streams)."""
    return {"x": list(range(x_start, x_start + len(steps))), "y": [s.kv_bytes / 1e6 for s in steps],
            "marker.color": [DECODE_COLOR] * len(steps),
            "customdata": [[s.kv_tokens, t(lang, STEP_WORDS["decode"])] for s in steps]}


def kv_figure(turns: Sequence[Sequence[Event]], lang: str = DEFAULT) -> dict:
    """KV cache size after every prefill chunk and decode step, over all turns of a chat.

    A turn starts from what the engine kept of the conversation (prefix caching: the earlier turns'
    blocks, shaded), jumps by the new part of the prompt in its prefill, then grows by one token per
    decode step. Without reuse a turn starts from zero and prefills the whole conversation again.
    """
    data, x = [], 0
    for number, events in enumerate(turns, start=1):
        traces, x = _turn_traces(number, events, x, lang, levels=number == len(turns))  # it may be streaming
        data += traces
    if not data and any(not cache_visible(_started(events)) for events in turns):
        # only a remote endpoint's turns: said, instead of an empty chart
        return _figure([], t(lang, "chart.kv_title"), _axis(t(lang, "chart.kv_x")), _axis(t(lang, "chart.kv_y")),
                       annotations=[dict(text=t(lang, "chart.kv_remote"), x=0.5, y=0.5, xref="paper", yref="paper",
                                         showarrow=False, font=dict(color=CAPACITY_COLOR))])
    if any(trace.get("fill") for trace in data):
        data.append(_legend_dot(t(lang, "chart.kept"), CACHED_COLOR))
    data += [_legend_dot(t(lang, "chart.prefill"), PREFILL_COLOR), _legend_dot(t(lang, "chart.decode"), DECODE_COLOR)]
    return _figure(data, t(lang, "chart.kv_title"), _axis(t(lang, "chart.kv_x")),
                   _axis(t(lang, "chart.kv_y"), rangemode="tozero"))
