"""What the Explain tab shows of a walkthrough, as pure functions of its events: the tokens (how the
text was split, and the new token's attention over them), the pipeline of the last forward pass with
its shapes and measured times, the candidates the model weighed, the KV cache as a grid, and the
explanation of the numbers. Words come from the language's catalogue (app/i18n).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from html import escape
from typing import TYPE_CHECKING

import plotly.graph_objects as go

from engine import WAKE, DecodeStep, Request, SamplingParams, token_bytes

from ... import STATIC
from ...i18n import t
from .. import charts
from ..trace import ReplyTrace

if TYPE_CHECKING:  # the engine's machinery imports torch: the page is served before it loads
    from engine import Engine

PIPELINE_SVG = STATIC / "pipeline.svg"
SHOWN_PROMPT_TOKENS = 48  # the prompt's last tokens shown (the chat template's system prompt is long)
SHOWN_TEXT_TOKENS = 200  # the user's text as tokens: its first ones (a pasted page would fill screens)
SHOWN_TEXT_CHARS = 120  # the text itself, quoted above them
STAGE_NAMES = {"tokenize": "pipe.tokenize", "embedding": "pipe.embedding", "norm": "pipe.norm",
               "attention": "pipe.attention", "ffn": "pipe.ffn", "final_norm": "pipe.final_norm",
               "lm_head": "pipe.lm_head", "sample": "pipe.sample"}
WOKE_SHOWN_MS = 0.5  # threads that took longer to wake before a forward are said to have (explain.woke)


@dataclass
class Walkthrough:
    """One stepped generation: the request held between steps, and its events so far."""
    request: Request
    trace: ReplyTrace
    text: str  # the user's text, as typed
    running: object | None = None  # the Run that lets it go on until it ends or is paused (its own token)

    def cancel(self) -> None:
        self.request.cancel()


@dataclass(frozen=True)
class Shape:
    """The model's sizes, for the tensor shapes the views show."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    weight_bytes: int

    @classmethod
    def of(cls, engine: Engine) -> Shape:
        config, info = engine.loaded.model.config, engine.info  # info: the sizes the engine already worked out
        return cls(info.num_layers, config.hidden_size, config.num_attention_heads, info.num_kv_heads, info.head_dim,
                   mlp_width(config), config.vocab_size, getattr(engine.runner, "weight_bytes", 0))


def mlp_width(config) -> int:
    """The MLP's inner width: the Llama family's intermediate_size, GPT-2's n_inner (4 x hidden unset), OPT's
    ffn_dim."""
    for name in ("intermediate_size", "n_inner", "ffn_dim"):
        if getattr(config, name, None):
            return getattr(config, name)
    return 4 * config.hidden_size


# --- tokens --------------------------------------------------------------------------------------

def shown(tokenizer, token_id: int) -> str:
    """A token as a reader sees it: its text, or its bytes when it is part of a character (most Chinese
    characters take two or three tokens); newlines as ↵."""
    text = tokenizer.decode([token_id])
    if not text or "\ufffd" in text:
        return " ".join(f"{b:02x}" for b in token_bytes(tokenizer, token_id))
    return text.replace("\n", "↵")


def _is_partial(tokenizer, token_id: int) -> bool:
    return "\ufffd" in tokenizer.decode([token_id])


def _chip(tokenizer, token_id: int, phase: str, lang: str, position: int | None = None,
          heat: float | None = None) -> str:
    raw = token_bytes(tokenizer, token_id)
    title = t(lang, "explain.chip_title", id=token_id, bytes=" ".join(f"{b:02x}" for b in raw))
    if position is not None:
        title = t(lang, "explain.chip_position", n=position) + " · " + title
    if _is_partial(tokenizer, token_id):
        title += " · " + t(lang, "explain.partial")
    style = f' style="box-shadow: inset 0 -4px 0 rgba(47, 111, 223, {heat:.2f})"' if heat is not None else ""
    partial = " ps-tok-partial" if _is_partial(tokenizer, token_id) else ""
    return (f'<span class="ps-tok ps-tok-{phase}{partial}" title="{escape(title, quote=True)}"{style}>'
            f'{escape(shown(tokenizer, token_id))}<sub>{token_id}</sub></span>')


def tokens_html(tokenizer, text: str, lang: str) -> str:
    """The user's text as the tokenizer splits it: one chip per token, id below, bytes on hover."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
    chips = "".join(_chip(tokenizer, i, "p", lang) for i in ids[:SHOWN_TEXT_TOKENS])
    if len(ids) > SHOWN_TEXT_TOKENS:
        chips += f'<span class="ps-note">{t(lang, "explain.tokens_more", n=len(ids) - SHOWN_TEXT_TOKENS)}</span>'
    partial = sum(_is_partial(tokenizer, i) for i in ids)
    note = t(lang, "explain.tokens_partial", n=partial) if partial else ""
    quoted = text if len(text) <= SHOWN_TEXT_CHARS else text[:SHOWN_TEXT_CHARS] + "…"
    head = t(lang, "explain.tokens_head", text=escape(quoted), n=len(ids), chars=len(text), bytes=len(text.encode()))
    return (f'<div class="ps-token-view" data-tokens="{len(ids)}"><div class="ps-label">{head}</div>'
            f'<div class="ps-tokens">{chips}</div><div class="ps-note">{t(lang, "explain.tokens_why")} {note}'
            '</div></div>')


def attention_row(step: DecodeStep | None, layer: str, head: str) -> list[float] | None:
    """The step's attention weights over the positions for one layer (or the mean of all) and one head
    (or the mean of all), scaled so that the largest is 1."""
    if step is None or step.attention is None:
        return None
    weights = step.attention  # [layers, heads, positions]
    weights = weights.mean(0) if layer == "mean" else weights[int(layer)]
    weights = weights.mean(0) if head == "mean" else weights[int(head)]
    return (weights / weights.max().clamp(min=1e-12)).tolist()


# --- the steps so far and what they mean ---------------------------------------------------------

def steps_html(engine: Engine, walk: Walkthrough | None, layer: str, head: str, lang: str) -> str:
    """The tokens so far (read by prefill, made by decode), shaded by the last step's attention, and
    what the last step did, in numbers."""
    if walk is None:
        return f'<div class="ps-explain" data-explain="idle">{t(lang, "explain.idle")}</div>'
    request, trace, tokenizer = walk.request, walk.trace, engine.tokenizer
    weights = attention_row(trace.steps[-1] if trace.steps else None, layer, head)
    first = max(0, request.num_prompt_tokens - SHOWN_PROMPT_TOKENS)

    def chip(position: int, token_id: int, phase: str) -> str:
        heat = weights[position] if weights is not None and position < len(weights) else None
        return _chip(tokenizer, token_id, phase, lang, position, heat)

    prompt = "".join(chip(p, request.prompt_ids[p], "p") for p in range(first, request.num_prompt_tokens))
    made = "".join(chip(request.num_prompt_tokens + i, s.token_id, "d") for i, s in enumerate(trace.steps))
    if weights is not None:
        which = t(lang, "explain.which", layer=t(lang, "explain.layer_n", n=layer) if layer != "mean" else t(
            lang, "explain.all_layers"), head=t(lang, "explain.head_n", n=head) if head != "mean" else t(
            lang, "explain.all_heads"))
        made += f'<div class="ps-note">{t(lang, "explain.attention_note", which=which)}</div>'
    state = "running" if walk.running and not trace.finished else "done" if trace.finished else "held"
    kv_tokens, kv_bytes = trace.kv
    kv_line = t(lang, "explain.kv_line" if engine.config.kv_cache else "explain.kv_line_no_cache", tokens=kv_tokens,
                per_token=engine.info.kv_bytes_per_token, mb=kv_bytes / 1e6)
    status = t(lang, "explain.finished", reason=escape(trace.finished.reason)) if trace.finished else t(
        lang, "explain.held")
    return (f'<div class="ps-explain" data-explain="{state}" data-tokens="{len(trace.steps)}">'
            f'<div class="ps-tokens">{prompt}{made}</div><p>{explanation(engine, trace, lang)}</p>'
            f'<p class="ps-note">{kv_line} · {status}</p></div>')


def woke_ms(stage_ms: dict | None) -> float:
    """The time a forward's threads took to wake before it (engine.WAKE): inside the forward's time, but
    not its work. Steps taken one by one wake them each time; a stream of tokens finds them awake."""
    return (stage_ms or {}).get(WAKE, 0.0)


def explanation(engine: Engine, trace: ReplyTrace, lang: str) -> str:
    """What the last step did, written from its measurements (never by the model). The forwards' times
    leave out their threads' waking (woke_ms), said apart."""
    shape = Shape.of(engine)
    if not trace.steps:
        return t(lang, "explain.waiting")
    prefill_woke = sum(woke_ms(c.stage_ms) for c in trace.chunks)
    prefill_ms = sum(c.latency_ms for c in trace.chunks) - prefill_woke
    prefilled = sum(c.num_tokens for c in trace.chunks)
    ttft = trace.steps[0].latency_ms
    if len(trace.steps) == 1:
        gflops = engine.forward_flops(prefilled, trace.num_cached_tokens) / max(prefill_ms, 1e-6) / 1e6
        text = t(lang, "explain.prefill", tokens=prefilled, hidden=shape.hidden, layers=shape.layers,
                 ms=prefill_ms, tps=prefilled / max(prefill_ms, 1e-6) * 1000, ttft=ttft, gflops=gflops)
        return text + _woke(prefill_woke, lang)
    step = trace.steps[-1]
    number = len(trace.steps) - 1
    weight_mb = shape.weight_bytes / 1e6
    step_woke = woke_ms(step.stage_ms)
    forward_ms = step.forward_ms - step_woke
    if not engine.config.kv_cache:  # --no-kv-cache: each step computes the whole sequence again
        text = t(lang, "explain.decode_no_cache", n=number, tokens=step.kv_tokens, layers=shape.layers,
                 ms=forward_ms, gflop=step.flops / 1e9,
                 cached_gflop=engine.forward_flops(1, step.kv_tokens - 1) / 1e9)
    else:
        text = t(lang, "explain.decode", n=number, hidden=shape.hidden, layers=shape.layers,
                 positions=step.kv_tokens - 1, ms=forward_ms, mb=weight_mb,
                 bandwidth=weight_mb / max(forward_ms, 1e-6))
    text += _woke(step_woke, lang)
    if len(trace.steps) >= 3:  # the steps' own forwards: the pauses between them are the presenter's
        step_ms = sum(s.forward_ms - woke_ms(s.stage_ms) for s in trace.steps[1:]) / number
        summary = "explain.summary" if engine.config.kv_cache else "explain.summary_no_cache"
        text += " " + t(lang, summary, prompt=trace.num_prompt_tokens, prefilled=prefilled,
                        prefill_ms=prefill_ms, ttft=ttft, steps=number, step_ms=step_ms, mb=weight_mb,
                        first_gflop=trace.steps[1].flops / 1e9, last_gflop=step.flops / 1e9)
    return text


def _woke(ms: float, lang: str) -> str:
    return " " + t(lang, "explain.woke", ms=ms) if ms >= WOKE_SHOWN_MS else ""


# --- the pipeline of the last forward pass ---------------------------------------------------------

def _stage_times(trace: ReplyTrace) -> tuple[str, dict[str, float | None], int]:
    """("prefill" | "decode", {stage: ms or None}, tokens in the forward) for the latest forward."""
    latest = next((s for s in reversed(trace.steps) if s.step > 0 and s.stage_ms), None)
    if latest is not None:
        return "decode", {"tokenize": None, **{stage: ms for stage, ms in latest.stage_ms.items() if stage != WAKE}}, 1
    times: dict[str, float | None] = {}
    for chunk in trace.chunks:
        for stage, ms in (chunk.stage_ms or {}).items():
            if stage != WAKE:  # not a stage (explanation says it)
                times[stage] = times.get(stage, 0.0) + ms
    times["tokenize"] = trace.first.tokenize_ms if trace.first else None
    if trace.steps and trace.steps[0].stage_ms:
        times["sample"] = trace.steps[0].stage_ms.get("sample")
    return "prefill", times, sum(c.num_tokens for c in trace.chunks)


def pipeline_html(engine: Engine, trace: ReplyTrace | None, lang: str) -> str:
    """static/pipeline.svg filled in: each stage's tensor shape in this forward and its measured time."""
    shape = Shape.of(engine)
    phase, times, tokens = _stage_times(trace) if trace is not None else ("idle", {}, 0)
    recomputed = phase == "decode" and not engine.config.kv_cache  # the whole sequence again (--no-kv-cache)
    if recomputed:
        tokens = trace.steps[-1].kv_tokens
    T = "T" if phase == "idle" else str(tokens)
    n = f"{trace.kv[0]:,}" if trace is not None and trace.kv[0] else "n"
    C, V = shape.hidden, shape.vocab
    tokenize = (t(lang, "pipe.shape_previous"), "") if phase == "decode" and not recomputed \
        else (t(lang, "pipe.shape_text"), f"→ [{T}]")
    shapes = {  # two lines each: what goes in, what comes out
        "tokenize": tokenize,
        "embedding": (f"[{T}]", f"→ [{T}, {C}]"), "norm": (f"[{T}, {C}]", ""),
        "attention": (f"q [{T}, {shape.heads}, {shape.head_dim}]", f"K,V [{n}, {shape.kv_heads}, {shape.head_dim}]"),
        "ffn": (f"[{T}, {C}] → [{T}, {shape.intermediate}]", f"→ [{T}, {C}]"), "final_norm": (f"[1, {C}]", ""),
        "lm_head": (f"[1, {C}]", f"→ [1, {V:,}]"), "sample": (f"[1, {V:,}]", "→ 1")}
    forward = sum(ms for stage, ms in times.items() if ms and stage not in ("tokenize", "sample")) or 1.0
    fields = {"title": t(lang, "pipe.title"), "layers": t(lang, "pipe.layers", n=shape.layers)}
    for stage, key in STAGE_NAMES.items():
        ms = times.get(stage)
        fields[f"{stage}.name"] = t(lang, key)
        fields[f"{stage}.shape"], fields[f"{stage}.shape2"] = shapes[stage]
        fields[f"{stage}.ms"] = "–" if ms is None else f"{ms:,.2f} ms"
        fields[f"{stage}.bar"] = f"{0 if ms is None else min(96.0, 96 * ms / forward):.1f}"
    total = sum(ms for ms in times.values() if ms)
    fields["note"] = {"idle": t(lang, "pipe.note_idle"),
                      "prefill": t(lang, "pipe.note_prefill", tokens=tokens, ms=total),
                      "decode": t(lang, "pipe.note_decode", ms=total)}[phase]
    if recomputed:
        fields["note"] = t(lang, "pipe.note_decode_no_cache", tokens=tokens, ms=trace.steps[-1].forward_ms)
    if phase == "prefill" and trace.num_cached_tokens:
        fields["note"] += " " + t(lang, "pipe.note_cached", n=trace.num_cached_tokens)
    if phase != "idle" and not getattr(engine.runner, "explains", False):  # transformers', tensor parallelism's
        fields["note"] += " " + t(lang, "pipe.note_untimed")
    svg = _svg_template()
    for name, value in fields.items():
        svg = svg.replace("{{" + name + "}}", escape(value))
    return f'<div class="ps-pipeline" data-phase="{phase}">{svg}</div>'


@cache
def _svg_template() -> str:
    svg = PIPELINE_SVG.read_text(encoding="utf-8")
    return svg[:svg.index("<!--")] + svg[svg.index("-->") + 4:]  # the comment says how it is filled


# --- figures ----------------------------------------------------------------------------------------

def _layout(title: str, height: int = 260, **extra) -> dict:
    return dict(title=dict(text=title, x=0.01, font=dict(size=14)), height=height, paper_bgcolor="white",
                plot_bgcolor="white", font=dict(family=charts.FONT_FAMILY, size=12, color="#2a3240"), **extra)


def candidates_figure(tokenizer, step: DecodeStep | None, sampling: SamplingParams | None, lang: str):
    """The model's top candidates for this step: their probabilities, and beside them their chances under
    the rule that picked (temperature, then top-k and top-p cut the rest to 0); the one taken highlighted."""
    tops = list(step.top) if step else []
    labels = [f"{shown(tokenizer, c.token_id)!r}" for c in tops]
    taken = [charts.DECODE_COLOR if c.token_id == step.token_id else "#c9d3e3" for c in tops]
    data = [dict(type="bar", orientation="h", name=t(lang, "explain.model_probs"), x=[c.prob for c in tops],
                 y=labels, marker=dict(color=taken),
                 hovertemplate="%{y}: %{x:.1%} " + t(lang, "explain.model_hover") + "<extra></extra>")]
    if tops and sampling is not None and not sampling.is_greedy:
        cut = [c.sample_prob == 0 for c in tops]
        data.append(dict(type="bar", orientation="h", name=t(lang, "explain.after_cutoffs"),
                         x=[c.sample_prob for c in tops], y=labels,
                         marker=dict(color=["#ffffff" if c else charts.PREFILL_COLOR for c in cut],
                                     line=dict(color=charts.PREFILL_COLOR, width=1),
                                     pattern=dict(shape=["x" if c else "" for c in cut])),
                         hovertemplate="%{y}: %{x:.1%} " + t(lang, "explain.cutoffs_hover") + "<extra></extra>"))
    if step is None:
        title = t(lang, "explain.candidates")
    elif sampling is None or sampling.is_greedy:
        title = t(lang, "explain.candidates_greedy", n=step.step + 1)
    else:
        rule = [t(lang, "explain.rule_temperature", value=sampling.temperature)]
        rule += [t(lang, "explain.rule_top_k", value=sampling.top_k)] if sampling.top_k else []
        rule += [t(lang, "explain.rule_top_p", value=sampling.top_p)] if sampling.top_p < 1 else []
        title = t(lang, "explain.candidates_sampled", n=step.step + 1, rule=", ".join(rule))
    drawn = charts.has_points(data)
    layout = _layout(title, barmode="group", margin=dict(l=110, r=15, t=45, b=40),
                     legend=dict(orientation="h", y=-0.25), showlegend=len(data) > 1,
                     xaxis=dict(title=dict(text=t(lang, "explain.probability")), tickformat=".0%", rangemode="tozero",
                                visible=drawn),
                     yaxis=dict(autorange="reversed", visible=drawn))
    return go.Figure(dict(data=data, layout=layout), _validate=False)


def kv_grid_figure(engine: Engine, walk: Walkthrough | None, lang: str):
    """The KV cache as a grid: one column per cached position (the last ones shown, as the tokens
    above), one row per layer; taken from the pool (cached prefix), written by prefill or by decode."""
    data, title = [], t(lang, "explain.kv_grid")
    info = engine.info
    if walk is not None and walk.trace.started is not None:
        request, trace = walk.request, walk.trace
        kv_tokens = trace.kv[0]
        positions = list(range(max(0, request.num_prompt_tokens - SHOWN_PROMPT_TOKENS), kv_tokens))
        cached, prompt = trace.num_cached_tokens, request.num_prompt_tokens
        phase = [0 if p < cached else 1 if p < prompt else 2 for p in positions]  # cached, prefill, decode
        names = [t(lang, "step.kept"), t(lang, "step.prefill"), t(lang, "step.decode")]
        data = [dict(type="heatmap", x=positions, y=list(range(info.num_layers)), z=[phase] * info.num_layers,
                     zmin=0, zmax=2, showscale=False, xgap=1, ygap=1,
                     customdata=[[names[p] for p in phase]] * info.num_layers,
                     hovertemplate=t(lang, "explain.kv_hover", per_token=info.kv_bytes_per_token // info.num_layers)
                     + "<extra></extra>",
                     colorscale=[[0, charts.CACHED_COLOR], [0.33, charts.CACHED_COLOR], [0.34, charts.PREFILL_COLOR],
                                 [0.66, charts.PREFILL_COLOR], [0.67, charts.DECODE_COLOR], [1, charts.DECODE_COLOR]])]
        title = t(lang, "explain.kv_grid_sized" if engine.config.kv_cache else "explain.kv_grid_no_cache",
                  tokens=kv_tokens, layers=info.num_layers, mb=trace.kv[1] / 1e6, shown=len(positions))
    drawn = charts.has_points(data)
    # the title on two lines (<br>): on one, a phone's width cut its end off
    layout = _layout(title, margin=dict(l=55, r=15, t=60, b=40),
                     xaxis=dict(title=dict(text=t(lang, "explain.position")), visible=drawn),
                     yaxis=dict(title=dict(text=t(lang, "explain.layer")), autorange="reversed", visible=drawn))
    return go.Figure(dict(data=data, layout=layout), _validate=False)
