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


def show_loading(engine, target: gr.HTML, texts: Texts, inputs: list, loaded: Callable,
                 waiting: Callable = lambda *values: False) -> None:
    """While the model loads, target says what the load does and for how long so far; with waiting(*inputs),
    that what was asked meanwhile runs once it has loaded. Then target becomes loaded(lang, *inputs), which
    draws what the load leaves (or gr.skip()). Texts.while_loading draws it."""
    texts.while_loading(target, inputs, lambda lang, *values: panels.loading_phase_html(
        engine.stage, lang, waiting=waiting(*values)), loaded)


def loading_line(engine, texts: Texts, elem_id: str) -> None:
    """Where a tab's output goes, while the model loads behind the page, the line that says what the load
    does (a button clicked then waits for it), gone once the model serves. Nothing on a loaded engine."""
    if is_loading(engine):
        line = gr.HTML(panels.loading_phase_html(engine.stage), elem_id=elem_id)
        show_loading(engine, line, texts, [], loaded=lambda lang_choice: gr.HTML("", visible=False))
