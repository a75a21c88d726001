"""What a tab says while the model loads behind the page (LoadingEngine): a first start converts the
bundled GGUF and compiles the decode step for about ten seconds, and a click meanwhile waits without a word."""
from __future__ import annotations

from collections.abc import Callable

import gradio as gr

from . import panels
from .language import Texts


def is_loading(engine) -> bool:
    """Whether the page is built before its model (an Engine has no such attribute: it is loaded)."""
    return getattr(engine, "loading", False)


def show_loading(engine, target: gr.HTML, texts: Texts, lang: gr.Radio, inputs: list, loaded: Callable,
                 waiting: Callable = lambda *values: False) -> None:
    """While the model loads, target says what the load does and for how long so far, drawn when the page
    loads and every second after; with waiting(*inputs), that what was asked meanwhile runs once it has
    loaded. Then target becomes loaded(lang, *inputs) and the ticks stop (at once on a page opened after the
    load). A tick that saw the load still running and arrived after the page's redraw is mended by the
    next, so loaded must draw what the load leaves (or gr.skip())."""
    timer = gr.Timer(1.0)

    def tick(lang_choice, *values):
        if engine.loading:
            return panels.loading_phase_html(engine.stage, lang_choice, waiting=waiting(*values)), gr.skip()
        return loaded(lang_choice, *values), gr.Timer(active=False)

    timer.tick(tick, [lang, *inputs], [target, timer], queue=False, show_progress="hidden")
    texts.on_switch(tick, inputs, [target, timer])  # on the page's load, and in another language


def loading_line(engine, texts: Texts, lang: gr.Radio, elem_id: str) -> None:
    """Where a tab's output goes, while the model loads behind the page, the line that says what the load
    does (a button clicked then waits for it), gone once the model serves. Nothing on a loaded engine."""
    if is_loading(engine):
        line = gr.HTML(panels.loading_phase_html(engine.stage), elem_id=elem_id)
        show_loading(engine, line, texts, lang, [], loaded=lambda lang_choice: gr.HTML("", visible=False))
