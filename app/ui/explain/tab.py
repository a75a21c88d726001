"""The Explain tab: one generation, one token at a time, on the real model.

Start runs the prefill (the whole prompt in one forward pass, which fills the KV cache and gives the
first token) and holds the request there (Engine.allow(request, 0)); Next token lets it take exactly one
decode step (one new token through every layer, reading the cache); Run takes one step after another at
a pace an audience can follow, until the reply ends or Pause holds it again; Stop ends it. Each step
shows the candidates the model weighed, the tokens so far by phase with the new token's attention, the
pipeline with this step's shapes and times, and the KV cache (views.py). Demos run the real model to
show how TTFT, TPOT and the cache behave (demos.py).
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import gradio as gr

from engine import PromptTooLong, QueueFull, SamplingParams

from ...i18n import DEFAULT, K, t
from ..language import Texts, user_error
from ..loading import is_loading, loading_line
from ..panels import with_attention
from ..session import ReplyWorker
from ..trace import ReplyTrace
from . import views
from .demos import DEMOS
from .views import Walkthrough

if TYPE_CHECKING:  # the engine's machinery imports torch: the page is served before it loads
    from engine import Engine

DEFAULT_PROMPT = "我是小"  # the classic walk-through: the model continues a three-character prompt
MAX_NEW_TOKENS = 64
HOLD_S = 600  # a held request left in an open page is cancelled after this long (at once when the page closes)
RUN_STEP_S = 0.3  # Run's pace: a token every 0.3 s, each drawn (the decode itself takes a few ms)
# A click's own work in the page (Gradio's handlers: 48 ms of Chromium's main thread in a trace, the request
# sent 20 ms in) and the outputs' progress animation ran on the cores of the forward it asked for: a Start's
# prefill of a new 12-14 token prompt took 18-48 ms (median ~30) against 14-17 from a script, a Next token's
# step 5.4-245 ms. The step now begins once the click's work is done, and the page draws no progress
# meanwhile (the steps panel dims instead: CLICK_JS): 15-39 ms (median ~20), Next 5.3-10.4 ms
# (docs/measurements.md, 2026-12-07 15:30).
CLICK_SETTLE_S = 0.06
CLICK_JS = ("(...inputs) => { document.querySelector('#ps-explain-steps .ps-explain')?.setAttribute('data-busy', '');"
            " return inputs; }")
# after the step, whatever it drew: a panel drawn the same as before (Next token on an ended walk) is not redrawn
DONE_JS = "() => { document.querySelector('#ps-explain-steps .ps-explain')?.removeAttribute('data-busy'); }"
# on the tab, not the body: Gradio scopes the app's CSS rules to its container
PRESENTER_JS = ("(on) => { document.querySelector('#ps-explain-tab').classList.toggle('ps-presenter', on); "
                "setTimeout(() => window.dispatchEvent(new Event('resize')), 50); }")


def _wait(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def _choices(count: int, lang: str) -> list[tuple[str, str]]:
    return [(t(lang, "explain.mean"), "mean"), *((str(i), str(i)) for i in range(count))]


def build(engine: Engine, texts: Texts, lang: gr.Radio) -> Callable[[gr.Request], None]:
    """The tab; returns what the app runs when a page closes (Blocks.unload): that page's walk-through ends."""
    state = gr.State(None, time_to_live=HOLD_S, delete_callback=lambda walk: walk and walk.cancel())
    # each page's latest walk-through, by its Gradio session. Gradio keeps a closed page's state for an hour
    # (its delete_callback runs then), and a walk held that long kept a request running in the engine,
    # which refused every page's precision switch meanwhile
    walks: dict[str, Walkthrough] = {}
    demo_state = gr.State(None)  # (demo name, its replies): redrawn in another language without running again
    with gr.Row():
        prompt = texts(gr.Textbox, value=DEFAULT_PROMPT, label=K("explain.prompt"), scale=4, max_lines=4,
                       elem_id="ps-explain-prompt")  # a pasted page scrolls in the box; the buttons stay in view
        # buttons 130 px wide at least (Next token 160), not Gradio's 160 each: in a 1,024-px window (a class's
        # projector) Stop went alone onto a row of its own, as wide as the page
        start = texts(gr.Button, value=K("explain.start"), variant="primary", scale=1, min_width=130,
                      elem_id="ps-explain-start")
        step = texts(gr.Button, value=K("explain.next"), scale=1, min_width=160, elem_id="ps-explain-next")
        run = texts(gr.Button, value=K("explain.run"), scale=1, min_width=130, elem_id="ps-explain-run")
        pause = texts(gr.Button, value=K("explain.pause"), scale=1, min_width=130, elem_id="ps-explain-pause")
        stop = texts(gr.Button, value=K("explain.stop"), variant="stop", scale=1, min_width=130,
                     elem_id="ps-explain-stop")
    with gr.Row(elem_id="ps-explain-sampling"):  # hidden in presenter view, as the demos
        temperature = texts(gr.Slider, 0, 2, value=0, step=0.05, label=K("chat.temperature"),
                            elem_id="ps-explain-temperature")
        top_k = texts(gr.Slider, 0, 50, value=0, step=1, label=K("chat.top_k"), elem_id="ps-explain-top-k")
        top_p = texts(gr.Slider, 0.05, 1, value=1.0, step=0.05, label=K("chat.top_p"), elem_id="ps-explain-top-p")
    with gr.Row(equal_height=True):  # what the panels below show
        # the layer and head choices and the panels below are drawn when the page loads (redraw)
        layer = texts(gr.Dropdown, _choices(0, DEFAULT), value="mean", label=K("explain.layer_choice"),
                      scale=1, elem_id="ps-explain-layer")
        head = texts(gr.Dropdown, _choices(0, DEFAULT), value="mean", label=K("explain.head_choice"),
                     scale=1, elem_id="ps-explain-head")
        presenter = texts(gr.Checkbox, value=False, label=K("explain.presenter"), scale=1, elem_id="ps-presenter")
    with gr.Row(elem_id="ps-demos"):
        texts(gr.Markdown, value=K("explain.demos"))
        demo_walk = texts(gr.Button, value=K("demo.walk"), size="sm", elem_id="ps-demo-walk")
        demo_buttons = {name: texts(gr.Button, value=K(key), size="sm", elem_id=f"ps-demo-{name.replace('_', '-')}")
                        for name, key in (("short_vs_long", "demo.short_vs_long"), ("long_answer", "demo.long_answer"),
                                          ("second_turn", "demo.second_turn"))}
    loading_line(engine, texts, "ps-explain-loading")  # what the model's load does, while it loads
    tokens = gr.HTML("", elem_id="ps-explain-tokens")
    panel = gr.HTML("", elem_id="ps-explain-steps")
    pipeline = gr.HTML("", elem_id="ps-explain-pipeline")
    with gr.Row(elem_id="ps-explain-charts"):
        candidates = gr.Plot(show_label=False, elem_id="ps-explain-candidates")
        grid = gr.Plot(show_label=False, elem_id="ps-explain-kv")
    demo_text = gr.HTML("", elem_id="ps-demo-result")
    demo_plot = gr.Plot(visible=False, show_label=False, elem_id="ps-demo-plot")
    with texts(gr.Accordion, label=K("explain.glossary_title"), open=False, elem_id="ps-glossary"):
        texts(gr.Markdown, value=K("explain.glossary"))
    with texts(gr.Accordion, label=K("explain.answer_title"), open=False, elem_id="ps-model-answer"):
        texts(gr.Markdown, value=K("explain.answer"))

    def render(walk: Walkthrough | None, layer_choice: str, head_choice: str, lang_choice: str):
        """The walk-through's views; before one, the prompt's tokens as the prompt box drew them. Nothing while
        the model loads (Pause, Stop and the layer's list are instant: they must not wait for it in a request,
        see Texts.on_switch): the page's redraw draws them once it has loaded."""
        if is_loading(engine):
            return (walk, *[gr.skip()] * 5)
        trace = walk.trace if walk else None
        last = trace.steps[-1] if trace and trace.steps else None
        return (walk, views.tokens_html(engine.tokenizer, walk.text, lang_choice) if walk else gr.skip(),
                views.steps_html(engine, walk, layer_choice, head_choice, lang_choice),
                views.pipeline_html(engine, trace, lang_choice),
                views.candidates_figure(engine.tokenizer, last, walk.request.sampling if walk else None, lang_choice),
                views.kv_grid_figure(engine, walk, lang_choice))

    def begin(text, temperature, top_k, top_p, walk, layer_choice, head_choice, lang_choice, page: gr.Request):
        """The prefill, held after its token. Outside Gradio's queue (Start, Next token): its messages kept the
        page busy while the forward ran beside it on the same two cores (medians of three runs, alternating: a
        35-token prefill 52-69 ms against 21-63, a decode step 16-32 against 8-14); and begun CLICK_SETTLE_S
        after the request, once the click's own work in the page is done. A prompt refused is said in the
        panel (no toast outside the queue)."""
        try:
            sampling = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=float(temperature),
                                      top_k=int(top_k), top_p=float(top_p))
            request = engine.new_request([{"role": "user", "content": text or ""}], sampling)
            engine.check_room()  # QueueFull
        except (ValueError, QueueFull) as exc:  # PromptTooLong: said of a prompt, not the chat's conversation
            refusal = t(lang_choice, "explain.too_long", tokens=exc.num_tokens, limit=exc.limit) \
                if isinstance(exc, PromptTooLong) else user_error(lang_choice, exc)
            shown = views.steps_html(engine, walk, layer_choice, head_choice, lang_choice)
            return walk, gr.skip(), with_attention(shown, refusal), gr.skip(), gr.skip(), gr.skip()
        if walk is not None:
            walk.cancel()
        time.sleep(CLICK_SETTLE_S)
        engine.allow(request, 0)  # held after the prefill and its token
        request.explain = True  # each step reports its time per stage, each decode step its attention
        walk = walks[page.session_hash] = Walkthrough(request, ReplyTrace(turn=1), text)
        ReplyWorker(engine, request, walk.trace)
        _wait(lambda: walk.trace.steps or walk.trace.finished)
        return render(walk, layer_choice, head_choice, lang_choice)

    def next_token(walk, layer_choice, head_choice, lang_choice):
        if walk is not None and not walk.trace.finished:
            walk.running = None
            count = len(walk.trace.steps)
            time.sleep(CLICK_SETTLE_S)
            engine.allow(walk.request, 1)
            _wait(lambda: len(walk.trace.steps) > count or walk.trace.finished)
        return render(walk, layer_choice, head_choice, lang_choice)

    def run_on(walk, layer_choice, head_choice, lang_choice):
        """One step after another, each drawn, until the reply ends or Pause holds it. It draws the views
        only, never the state, and nothing once the walk was stopped or replaced: a Start or Stop during
        its last step must not be drawn over by this walk. Its last frame changes nothing: when a
        generator ends, the page draws its last frame again, which after a Pause, Stop or Start (each
        drawing the walk as it then is) said "running"."""
        if walk is None or walk.trace.finished:
            return
        walk.running = this_run = object()  # a second Run of the same walk takes over from this one
        while walk.running is this_run and not walk.trace.finished:
            began, count = time.monotonic(), len(walk.trace.steps)
            engine.allow(walk.request, 1)
            _wait(lambda: len(walk.trace.steps) > count or walk.trace.finished)
            if walk.request.is_cancelled:
                break
            views_now = render(walk, layer_choice, head_choice, lang_choice)[1:]  # shows "done" at the end
            if walk.request.is_cancelled or walk.running is not this_run:  # stopped, replaced or paused meanwhile
                break
            yield views_now
            time.sleep(max(0.0, RUN_STEP_S - (time.monotonic() - began)))
        if walk.running is this_run:
            walk.running = None
        yield (gr.skip(),) * (len(outputs) - 1)

    def hold(walk, layer_choice, head_choice, lang_choice):
        if walk is not None:
            walk.running = None  # Run stops after its current step
        return render(walk, layer_choice, head_choice, lang_choice)

    def end(walk, layer_choice, head_choice, lang_choice):
        if walk is not None and not walk.trace.finished:
            walk.running = None
            walk.cancel()
            _wait(lambda: walk.trace.finished)
        return render(walk, layer_choice, head_choice, lang_choice)

    outputs, choices = [state, tokens, panel, pipeline, candidates, grid], [layer, head, lang]

    def on_click(listener, fn, inputs) -> None:
        """A step asked for by a click: outside the queue, the panel dimmed until it is drawn (CLICK_JS)."""
        listener(fn, inputs, outputs, queue=False, show_progress="hidden", js=CLICK_JS).then(None, js=DONE_JS,
                                                                                           queue=False)

    on_click(start.click, begin, [prompt, temperature, top_k, top_p, state, *choices])
    on_click(step.click, next_token, [state, *choices])
    # each tab's walk-through runs at once: with Gradio's default limit of 1, a Run in a second tab waited,
    # with nothing drawn, until the first tab's Run had ended (20 s)
    run.click(run_on, [state, *choices], outputs[1:], show_progress="hidden", concurrency_limit=None)
    pause.click(hold, [state, *choices], outputs, queue=False)
    stop.click(end, [state, *choices], outputs, queue=False)
    for dropdown in (layer, head):  # change, not input: Gradio 6 sends a click on an option as two inputs
        dropdown.change(render, [state, *choices], outputs, queue=False)

    def prompt_tokens(text, lang_choice):  # while the model loads, the page's redraw draws them once it has
        return gr.skip() if is_loading(engine) else views.tokens_html(engine.tokenizer, text, lang_choice)

    # always_last: with Gradio's default for input ("once"), a key pressed while the last one's tokens were
    # being drawn was dropped, and the tokens shown stopped at what was typed then ("<img sr" of a longer text)
    prompt.input(prompt_tokens, [prompt, lang], [tokens], queue=False, show_progress="hidden",
                 trigger_mode="always_last")
    presenter.change(None, [presenter], None, js=PRESENTER_JS)

    # demos: the walkthrough preset, and three runs of the real model with what their numbers show
    preset = demo_walk.click(lambda: (DEFAULT_PROMPT, 0, 0, 1.0), None, [prompt, temperature, top_k, top_p],
                             queue=False)
    on_click(preset.then, begin, [prompt, temperature, top_k, top_p, state, *choices])

    def show_demo(demo, lang_choice):
        if demo is None:
            return "", gr.Plot(visible=False)
        name, replies = demo
        html, figure = DEMOS[name][1](engine, replies, lang_choice)
        return f'<div class="ps-demo" data-demo="{name}">{html}</div>', gr.Plot(figure, visible=True)

    def run_demo(name, lang_choice):
        demo = (name, DEMOS[name][0](engine))
        return (demo, *show_demo(demo, lang_choice))

    for name, button in demo_buttons.items():
        # one demo at a time, in a group of their own: in the chats' ("engine"), this event's limit of 1
        # would become the group's once it ran (Gradio keeps the lowest), and every tab's chats reply in turn
        button.click(functools.partial(run_demo, name), [lang], [demo_state, demo_text, demo_plot],
                     concurrency_limit=1, concurrency_id="explain-demo")

    def redraw(lang_choice, walk, layer_choice, head_choice, demo, text):
        """Every panel in another language, or on a page's load; before a walk-through, the prompt's tokens.
        Nothing while the model loads: all once it has loaded."""
        if is_loading(engine):
            return [gr.skip()] * 9
        shape = views.Shape.of(engine)
        panels = render(walk, layer_choice, head_choice, lang_choice)[1:]
        if walk is None:
            panels = (views.tokens_html(engine.tokenizer, text or "", lang_choice), *panels[1:])
        return (*panels, *show_demo(demo, lang_choice),
                gr.Dropdown(choices=_choices(shape.layers, lang_choice)),
                gr.Dropdown(choices=_choices(shape.heads, lang_choice)))

    texts.on_switch(redraw, [state, layer, head, demo_state, prompt],
                    [tokens, panel, pipeline, candidates, grid, demo_text, demo_plot, layer, head], once_loaded=True)

    def close(page: gr.Request) -> None:
        walk = walks.pop(page.session_hash, None)
        if walk is not None:
            walk.cancel()

    return close
