"""The UI language: components whose words follow it, the switch, and user errors in its words.

A component is built with K("key") where its text goes, through a Texts registry, and shows English
first; when the page's language changes (the switch in the header, the browser's language on first
visit, the choice remembered in the browser), every registered component is relabelled and each tab
redraws what it shows (see Texts.on_switch).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import gradio as gr

from engine import EngineBusy, NotEnoughMemory, PromptTooLong, QueueFull

from ..i18n import DEFAULT, LANGUAGES, K, t

# the page's first language when none was chosen before: Chinese for any zh-* browser, else English
BROWSER_LANGUAGE = "(navigator.language || '').toLowerCase().startsWith('zh') ? 'zh' : 'en'"
# the page's language on its <html> element, as a page in that language has it: the browser then picks the
# Chinese forms of CJK characters (a font's Japanese ones otherwise), a screen reader its voice, and
# static/app.css the headings of Gradio's toasts
PAGE_LANGUAGE_JS = "(lang) => { document.documentElement.lang = lang === 'zh' ? 'zh-CN' : 'en'; }"
log = logging.getLogger(__name__)
EMPTY_MESSAGES = ("the message is empty", "the prompt is empty", "the conversation is empty")


class Texts:
    """The components whose words follow the language, what each tab redraws when it changes, and the lines
    that say what the model's load does while it loads behind the page (LoadingEngine: loading tells)."""

    def __init__(self, loading: Callable[[], bool] = lambda: False) -> None:
        self.loading = loading
        self.labelled: list[tuple[gr.components.Component, dict[str, K]]] = []
        self.redraws: list[tuple[Callable, list, list, bool]] = []
        self.lines: list[tuple[Callable, list, list, bool]] = []  # the redraws of while_loading's lines
        self.read_in_browser: list[tuple[gr.components.Component, str]] = []  # see from_browser

    def __call__(self, make, *args, **kwargs):
        """make(*args, **kwargs) with each K(...) keyword given as its English text, and kept for a switch."""
        keys = {name: value for name, value in kwargs.items() if isinstance(value, K)}
        component = make(*args, **{**kwargs, **{name: t(DEFAULT, key) for name, key in keys.items()}})
        self.labelled.append((component, keys))
        return component

    def on_switch(self, redraw: Callable, inputs: list, outputs: list, once_loaded: bool = False) -> None:
        """redraw(lang, *inputs) -> outputs runs when the language changes, and when the page loads; with
        once_loaded, also once the model has loaded behind a page opened before. Such a redraw draws what
        needs the model only once it is loaded (gr.skip() before): it must not wait for the load in its
        request, as the browser opens at most six connections to the app, and two tabs' redraws after a page
        load and a switch, with the queue's and a reply's streams, took the last one from the timer that
        says what the load does, and from everything else the page asked."""
        self.redraws.append((redraw, inputs, outputs, once_loaded))

    def from_browser(self, component: gr.components.Component, expression: str) -> None:
        """At a page's load, the redraws get as component's value what the JavaScript expression reads in the
        browser (its storage), in place of the component's own."""
        self.read_in_browser.append((component, expression))

    def while_loading(self, target: gr.HTML, inputs: list, loading: Callable, loaded: Callable) -> None:
        """While the model loads, target is loading(lang, *inputs) (what the load does, and for how long so
        far), drawn when the page loads, in another language and every second; then loaded(lang, *inputs)
        (or gr.skip()). One timer outside the tabs draws every such line (see _wire_model_loaded)."""
        self.on_switch(lambda lang, *values: (loading if self.loading() else loaded)(lang, *values), inputs, [target])
        self.lines.append(self.redraws[-1])

    def relabel(self, lang: str) -> list:
        return [gr.update(**{name: t(lang, key) for name, key in keys.items()}) for _, keys in self.labelled]

    def wire(self, choice: gr.Radio, remembered: gr.BrowserState, app: gr.Blocks) -> None:
        """On load, the remembered choice or else the browser's language, and every redraw in it (what shows
        the loaded model is drawn then, or once the model has loaded: the page is served before the model
        loads), in one request (three in a row took two more round trips); on a change, relabel, redraw and
        remember."""
        redraw, inputs, outputs = together(self.redraws)
        timer = self._wire_model_loaded(choice, together([each for each in self.redraws if each[3]]))

        def load(stored, browser, *values):
            """The timer that says what the load does started if the model loads now, before the redraws: a
            redraw that found it loading is then drawn again once it has loaded, where a load ending between
            the redraw and a later look would have left the redraw undone."""
            lang, ticking = stored if stored in LANGUAGES else browser, gr.Timer(active=self.loading())
            return lang, ticking, *redraw(lang, *values)

        app.load(load, [remembered, choice, *inputs], [choice, timer, *outputs], queue=False,
                 js=load_js(inputs, self.read_in_browser), show_progress="hidden")
        choice.change(None, [choice], None, js=PAGE_LANGUAGE_JS)
        choice.change(lambda lang: [lang, *self.relabel(lang)], [choice],
                      [remembered, *[component for component, _ in self.labelled]], queue=False)
        choice.change(redraw, [choice, *inputs], outputs, queue=False, show_progress="hidden")

    def _wire_model_loaded(self, choice: gr.Radio, redraws: tuple[Callable, list, list]) -> gr.Timer:
        """While the model loads behind a page opened before, and once it has: a timer outside the tabs (one
        in a tab not shown does not tick) draws the lines that say what the load does every second, and once
        it has ended their last state, and sets ready, whose change runs the redraws that wait for the model
        (Gradio tells the page that a State changed only from a queued event). The page's load starts the
        timer (returned) if the model loads then."""
        ready, timer = gr.State(False), gr.Timer(1.0, active=False)

        draw_lines, line_inputs, lines = together(self.lines)

        def tick(lang, *values):
            loading = self.loading()  # before the lines: a load that ends meanwhile is seen at the next tick
            drawn = draw_lines(lang, *values)
            return (gr.skip(), gr.skip(), *drawn) if loading else (True, gr.Timer(active=False), *drawn)

        timer.tick(tick, [choice, *line_inputs], [ready, timer, *lines], show_progress="hidden",
                   concurrency_limit=None)
        redraw, inputs, outputs = redraws
        ready.change(redraw, [choice, *inputs], outputs, queue=False, show_progress="hidden")
        return timer


def together(redraws: list[tuple[Callable, list, list, bool]]) -> tuple[Callable, list, list]:
    """The redraws as one event, (redraw, inputs, outputs), that runs each with its inputs: one request where
    there were one each (ten), each of which cost the page a dispatch and a loading status for every output,
    at each page load and language switch. A component two redraws draw (the chat's status line: what the
    load does, and the chat's phase) takes the later one's value unless it skips."""
    outputs = list({id(component): component for _, _, outs, _ in redraws for component in outs}.values())
    where = {id(component): at for at, component in enumerate(outputs)}

    def redraw(lang: str, *values):
        drawn = [gr.skip()] * len(outputs)
        for each, inputs, outs, _ in redraws:
            mine, values = values[:len(inputs)], values[len(inputs):]
            try:
                out = each(lang, *mine)
            except Exception:  # one tab's failure leaves the others drawn (the model line stayed "loading")
                log.exception("redrawing %s", getattr(each, "__qualname__", each))
                continue
            for component, value in zip(outs, out if len(outs) > 1 else [out]):
                if not (isinstance(value, dict) and value == gr.skip()):  # a table's frame has no plain !=
                    drawn[where[id(component)]] = value
        return drawn

    return redraw, [component for _, inputs, _, _ in redraws for component in inputs], outputs


def load_js(inputs: list, read_in_browser: list[tuple[gr.components.Component, str]]) -> str:
    """What the page sends at its load: the language it remembers, the browser's, and the redraws' inputs,
    those read in the browser (Texts.from_browser) replaced by what their expressions read."""
    reads = "".join(f"values[{at}] = {expression}; " for component, expression in read_in_browser
                    for at, each in enumerate(inputs) if each is component)
    return f"(stored, shown, ...values) => {{ {reads}return [stored, {BROWSER_LANGUAGE}, ...values]; }}"


def switch(texts: Texts) -> tuple[gr.Radio, gr.BrowserState]:
    """The language switch (English / 简体中文) and the browser storage that remembers it."""
    choice = gr.Radio([(name, code) for code, name in LANGUAGES.items()], value=DEFAULT, label="Language · 语言",
                      show_label=False,  # the label: what a screen reader names the group
                      container=False, elem_id="ps-language", scale=0, min_width=280)
    return choice, gr.BrowserState(None, storage_key="phasescope-language")


def user_error(lang: str, error: Exception) -> str:
    """An error a user caused (or can act on), in their language, one line."""
    if isinstance(error, PromptTooLong):
        key = "error.too_long_limit" if error.option else "error.too_long"
        return t(lang, key, tokens=error.num_tokens, limit=error.limit, option=error.option)
    if isinstance(error, QueueFull):
        return t(lang, "error.queue_full")
    if isinstance(error, EngineBusy):
        return t(lang, "error.busy_held" if error.held else "error.busy")
    if isinstance(error, NotEnoughMemory):
        return t(lang, "error.memory_int8" if error.int8_gb is not None else "error.memory", needed=error.needed_gb,
                 free=error.free_gb, precision=error.precision, int8=error.int8_gb)
    if str(error) in EMPTY_MESSAGES:
        return t(lang, "error.empty")
    return t(lang, "error.other", detail=str(error))
