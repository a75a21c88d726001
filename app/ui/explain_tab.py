"""The Explain tab: one generation, one token at a time, on the real model.

Start runs the prefill (the whole prompt in one forward pass, which fills the KV cache and gives the
first token) and holds the request there (Engine.allow(request, 0)); Next token lets it take exactly one
decode step (one new token through every layer, reading the cache); Run to end lets it finish; Stop ends
it. Each step shows the candidates the model weighed, the tokens so far by phase, and the shapes of
what went through the model.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from html import escape

import gradio as gr
import plotly.graph_objects as go

from engine import DecodeStep, Engine, Request, SamplingParams

from . import charts
from .session import ReplyWorker
from .trace import ReplyTrace

DEFAULT_PROMPT = "我是小"  # the classic walk-through: the model continues a three-character prompt
MAX_NEW_TOKENS = 64
SHOWN_PROMPT_TOKENS = 48  # the prompt's last tokens shown (the system prompt before them is long)
HOLD_S = 600  # a held request abandoned by its page is cancelled after this long


@dataclass
class Walkthrough:
    request: Request
    trace: ReplyTrace

    def cancel(self) -> None:
        self.request.cancel()


def _wait(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def shown(tokenizer, token_id: int) -> str:
    """A token as a reader sees it: its text, or its byte-level form when it is part of a character
    (most Chinese characters take two or three tokens); newlines as ↵."""
    text = tokenizer.decode([token_id])
    if not text or "\ufffd" in text:
        text = tokenizer.convert_ids_to_tokens(token_id)
    return text.replace("\n", "↵")


def candidates_figure(tokenizer, step: DecodeStep | None, sampling: SamplingParams | None = None):
    """The model's top candidates for this step: their probabilities, and beside them their chances under
    the rule that picked (temperature, then top-k and top-p cut the rest to 0); the one taken highlighted."""
    tops = list(step.top) if step else []
    labels = [f"{shown(tokenizer, t.token_id)!r}" for t in tops]
    taken = [charts.DECODE_COLOR if t.token_id == step.token_id else "#c9d3e3" for t in tops]
    data = [dict(type="bar", orientation="h", name="model", x=[t.prob for t in tops], y=labels,
                 marker=dict(color=taken), hovertemplate="%{y}: %{x:.1%} (model)<extra></extra>")]
    if tops and sampling is not None and not sampling.is_greedy:
        cut = [t.sample_prob == 0 for t in tops]
        data.append(dict(type="bar", orientation="h", name="after the cut-offs", x=[t.sample_prob for t in tops],
                         y=labels, marker=dict(color=["#ffffff" if c else charts.PREFILL_COLOR for c in cut],
                                               line=dict(color=charts.PREFILL_COLOR, width=1),
                                               pattern=dict(shape=["x" if c else "" for c in cut])),
                         hovertemplate="%{y}: %{x:.1%} after temperature, top-k, top-p<extra></extra>"))
    if step is None:
        title = "Candidates"
    elif sampling is None or sampling.is_greedy:
        title = f"Candidates for token {step.step + 1}: greedy takes the most probable"
    else:
        title = (f"Candidates for token {step.step + 1}: sampled at temperature {sampling.temperature:g}"
                 f"{f', top-k {sampling.top_k}' if sampling.top_k else ''}"
                 f"{f', top-p {sampling.top_p:g}' if sampling.top_p < 1 else ''} (crossed: cut to 0)")
    layout = dict(title=dict(text=title, x=0.01, font=dict(size=14)), height=260, barmode="group",
                  margin=dict(l=110, r=15, t=45, b=40), paper_bgcolor="white", plot_bgcolor="white",
                  legend=dict(orientation="h", y=-0.25), showlegend=len(data) > 1,
                  xaxis=dict(title=dict(text="probability"), tickformat=".0%", rangemode="tozero"),
                  yaxis=dict(autorange="reversed"))
    return go.Figure(dict(data=data, layout=layout), _validate=False)


def kv_grid_figure(engine: Engine, walk: Walkthrough | None):
    """The KV cache as a grid: one column per cached position (the last ones shown, as the tokens
    above), one row per layer; taken from the pool (cached prefix), written by prefill or by decode."""
    data, title = [], "KV cache: one column per token, one row per layer"
    if walk is not None and walk.trace.started is not None:
        info, request, trace = engine.info, walk.request, walk.trace
        kv_tokens = trace.kv[0]
        first = max(0, request.num_prompt_tokens - SHOWN_PROMPT_TOKENS)
        positions = list(range(first, kv_tokens))
        cached, prompt = trace.num_cached_tokens, request.num_prompt_tokens
        phase = [0 if p < cached else 1 if p < prompt else 2 for p in positions]  # cached, prefill, decode
        data = [dict(type="heatmap", x=positions, y=list(range(info.num_layers)), z=[phase] * info.num_layers,
                     zmin=0, zmax=2, showscale=False, xgap=1, ygap=1, hoverinfo="skip",
                     colorscale=[[0, charts.CACHED_COLOR], [0.33, charts.CACHED_COLOR], [0.34, charts.PREFILL_COLOR],
                                 [0.66, charts.PREFILL_COLOR], [0.67, charts.DECODE_COLOR], [1, charts.DECODE_COLOR]])]
        title = (f"KV cache: {kv_tokens:,} tokens × {info.num_layers} layers × K and V "
                 f"= {trace.kv[1] / 1e6:,.2f} MB (last {len(positions)} tokens shown)")
    layout = dict(title=dict(text=title, x=0.01, font=dict(size=14)), height=260, margin=dict(l=55, r=15, t=45, b=40),
                  paper_bgcolor="white", plot_bgcolor="white", xaxis=dict(title=dict(text="position")),
                  yaxis=dict(title=dict(text="layer"), autorange="reversed"))
    return go.Figure(dict(data=data, layout=layout), _validate=False)


def attention_row(step: DecodeStep | None, layer: str, head: str) -> list[float] | None:
    """The step's attention weights over the positions for one layer (or the mean of all) and one head
    (or the mean of all), scaled so that the largest is 1."""
    if step is None or step.attention is None:
        return None
    weights = step.attention  # [layers, heads, positions]
    weights = weights.mean(0) if layer == "mean" else weights[int(layer)]
    weights = weights.mean(0) if head == "mean" else weights[int(head)]
    return (weights / weights.max().clamp(min=1e-12)).tolist()


def steps_html(engine: Engine, walk: Walkthrough | None, layer: str = "mean", head: str = "mean") -> str:
    """The tokens so far (prompt read by prefill, generated by decode) and what the last step computed;
    under a decode step, each token shaded by the new token's attention to it."""
    if walk is None:
        return ('<div class="ps-explain" data-explain="idle">Press <b>Start</b>: prefill reads the whole prompt '
                'in one forward pass and gives the first token; then <b>Next token</b> runs one decode step.</div>')
    info, request, trace = engine.info, walk.request, walk.trace
    tokenizer = engine.tokenizer
    weights = attention_row(trace.steps[-1] if trace.steps else None, layer, head)
    first = max(0, request.num_prompt_tokens - SHOWN_PROMPT_TOKENS)

    def token(position: int, token_id: int, phase: str) -> str:
        heat = ""
        if weights is not None and position < len(weights):  # the step's own output has no key yet
            heat = f' style="box-shadow: inset 0 -4px 0 rgba(47, 111, 223, {weights[position]:.2f})"'
        piece = tokenizer.convert_ids_to_tokens(token_id)
        note = " · part of a character: its bytes alone are not valid UTF-8" if "\ufffd" in tokenizer.decode(
            [token_id]) else ""
        title = escape(f"position {position} · id {token_id} · piece {piece!r}{note}", quote=True)
        return (f'<span class="ps-tok ps-tok-{phase}" title="{title}"{heat}>'
                f'{escape(shown(tokenizer, token_id))}</span>')

    prompt = "".join(token(p, request.prompt_ids[p], "p") for p in range(first, request.num_prompt_tokens))
    generated = "".join(token(request.num_prompt_tokens + i, s.token_id, "d") for i, s in enumerate(trace.steps))
    if weights is not None:
        which = f"layer {layer}" if layer != "mean" else "mean of all layers"
        which += f", head {head}" if head != "mean" else ", mean of all heads"
        generated += (f'<div class="ps-note">underline: the new token\'s attention to each earlier token '
                      f'({which}; the strongest full)</div>')
    num_steps = len(trace.steps)
    hidden = engine.loaded.model.config.hidden_size
    weight_mb = getattr(engine.runner, "weight_bytes", 0) / 1e6
    if num_steps <= 1:
        prefill_ms = sum(c.latency_ms for c in trace.chunks)
        ttft = f"{trace.steps[0].latency_ms:,.0f} ms" if trace.steps else "–"
        what = (f"<b>Prefill</b>: {request.num_prompt_tokens:,} prompt tokens in one forward pass, "
                f"hidden states [{request.num_prompt_tokens}, {hidden}] through {info.num_layers} layers; "
                "their keys and values fill the KV cache; the last position's logits gave token 1. "
                f"It took {prefill_ms:,.1f} ms ({request.num_prompt_tokens / max(prefill_ms, 1e-6) * 1000:,.0f} "
                f"tokens/s): most of the time to the first token, {ttft}. All prompt tokens go through the "
                "weights together, as matrix products: prefill is compute-bound.")
    else:
        step = num_steps - 1
        took = (f" Its forward took {trace.steps[-1].forward_ms:,.1f} ms (a lone step after a pause is slower "
                "than one in a stream: the CPU threads had gone to sleep).")
        what = (f"<b>Decode step {step}</b>: one new token, hidden state [1, {hidden}] through "
                f"{info.num_layers} layers, attending to the {trace.kv[0] - 1:,} cached positions; its keys "
                f"and values were appended to the cache.{took} For one token the model still reads all "
                f"{weight_mb:,.0f} MB of its weights: decode is memory-bound, and the cache spares it from "
                "recomputing the earlier tokens.")
    state = "done" if trace.finished else "held"
    kv_tokens, kv_bytes = trace.kv
    return (f'<div class="ps-explain" data-explain="{state}" data-tokens="{num_steps}">'
            f'<div class="ps-tokens">{prompt}{generated}</div><p>{what}</p>'
            f'<p>KV cache: {kv_tokens:,} tokens × {info.kv_bytes_per_token:,} B = {kv_bytes / 1e6:,.2f} MB · '
            f'{"finished: " + escape(trace.finished.reason) if trace.finished else "held: press Next token"}</p></div>')


def build(engine: Engine) -> None:
    state = gr.State(None, time_to_live=HOLD_S, delete_callback=lambda walk: walk and walk.cancel())
    with gr.Row():
        prompt = gr.Textbox(DEFAULT_PROMPT, label="Prompt", scale=4, elem_id="ps-explain-prompt")
        start = gr.Button("Start", variant="primary", scale=1, elem_id="ps-explain-start")
        step = gr.Button("Next token", scale=1, elem_id="ps-explain-next")
        finish = gr.Button("Run to end", scale=1, elem_id="ps-explain-run")
        stop = gr.Button("Stop", variant="stop", scale=1, elem_id="ps-explain-stop")
    with gr.Row():
        temperature = gr.Slider(0, 2, value=0, step=0.05, label="Temperature (0 = greedy)",
                                elem_id="ps-explain-temperature")
        top_k = gr.Slider(0, 50, value=0, step=1, label="Top-k (0 = off)", elem_id="ps-explain-top-k")
        top_p = gr.Slider(0.05, 1, value=1.0, step=0.05, label="Top-p", elem_id="ps-explain-top-p")
    with gr.Row():
        info = engine.info
        layer = gr.Dropdown(["mean", *map(str, range(info.num_layers))], value="mean", label="Attention: layer",
                            scale=1, elem_id="ps-explain-layer")
        head = gr.Dropdown(["mean", *map(str, range(engine.loaded.model.config.num_attention_heads))], value="mean",
                           label="head", scale=1, elem_id="ps-explain-head")
    panel = gr.HTML(steps_html(engine, None), elem_id="ps-explain-steps")
    with gr.Row():
        figure = gr.Plot(candidates_figure(engine.tokenizer, None), show_label=False,
                         elem_id="ps-explain-candidates")
        grid = gr.Plot(kv_grid_figure(engine, None), show_label=False, elem_id="ps-explain-kv")

    def render(walk: Walkthrough | None, layer_choice: str = "mean", head_choice: str = "mean"):
        last = walk.trace.steps[-1] if walk and walk.trace.steps else None
        sampling = walk.request.sampling if walk else None
        return (walk, steps_html(engine, walk, layer_choice, head_choice),
                candidates_figure(engine.tokenizer, last, sampling), kv_grid_figure(engine, walk))

    def begin(text: str, temperature, top_k, top_p, walk: Walkthrough | None, layer_choice: str, head_choice: str):
        if walk is not None:
            walk.cancel()
        try:
            sampling = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=float(temperature),
                                      top_k=int(top_k), top_p=float(top_p))
            request = engine.new_request([{"role": "user", "content": text or ""}], sampling)
        except ValueError as exc:
            raise gr.Error(str(exc)) from None
        engine.allow(request, 0)  # held after the prefill and its token
        request.explain = True  # each step reports its time per stage, each decode step its attention
        walk = Walkthrough(request, ReplyTrace(turn=1))
        ReplyWorker(engine, request, walk.trace)
        _wait(lambda: walk.trace.steps or walk.trace.finished)
        return render(walk, layer_choice, head_choice)

    def next_token(walk: Walkthrough | None, layer_choice: str, head_choice: str):
        if walk is not None and not walk.trace.finished:
            count = len(walk.trace.steps)
            engine.allow(walk.request, 1)
            _wait(lambda: len(walk.trace.steps) > count or walk.trace.finished)
        return render(walk, layer_choice, head_choice)

    def run_to_end(walk: Walkthrough | None, layer_choice: str, head_choice: str):
        if walk is not None and not walk.trace.finished:
            engine.allow(walk.request, None)
            _wait(lambda: walk.trace.finished)
        return render(walk, layer_choice, head_choice)

    def end(walk: Walkthrough | None, layer_choice: str, head_choice: str):
        if walk is not None and not walk.trace.finished:
            walk.cancel()
            _wait(lambda: walk.trace.finished)
        return render(walk, layer_choice, head_choice)

    outputs, choices = [state, panel, figure, grid], [layer, head]
    start.click(begin, [prompt, temperature, top_k, top_p, state, *choices], outputs)
    step.click(next_token, [state, *choices], outputs)
    finish.click(run_to_end, [state, *choices], outputs)
    stop.click(end, [state, *choices], outputs, queue=False)
    for dropdown in choices:
        dropdown.input(render, [state, *choices], outputs, queue=False)
