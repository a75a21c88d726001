"""Composes the app's tabs and starts the Gradio server."""
from __future__ import annotations

import ctypes
import logging
import signal
import sys
import threading
import time
import webbrowser
from pathlib import Path
from typing import TYPE_CHECKING

import gradio as gr

from engine import EngineConfig

from . import STATIC
from .cli import engine_line
from .i18n import DEFAULT, K, t
from .ui import chat_tab, explain, history_tab, lab_tab, language
from .ui.live import Streams
from .ui.language import Texts
from .ui.loading import is_loading
from .history.recorder import make_recorder
from .ui.session import ActiveRequests, EngineThread
from .history.store import Store
from .serve.access import url_host, url_of
from .startup import settle

if TYPE_CHECKING:
    from engine import Engine

TITLE = "PhaseScope"
FONTS = ("system-ui", "Noto Sans CJK SC", "Noto Sans SC", "PingFang SC", "Microsoft YaHei", "sans-serif")


def header_html(lang: str) -> str:
    return (f'<div class="ps-header"><span class="ps-logo">{TITLE}</span> '
            f'<span class="ps-tagline">{t(lang, "header.tagline")}</span></div>')


def build_app(engine: Engine | LoadingEngine, store: Store) -> gr.Blocks:
    """The page. It reads nothing but the engine's config while it is built: what shows the loaded model
    (model line, precision list, pool gauge, the Explain tab's panels) is drawn when a page loads."""
    active, texts, streams = ActiveRequests(), Texts(lambda: is_loading(engine)), Streams()
    # delete_cache: the files Gradio copies to serve (the exports, which the page downloads at once) go after
    # an hour, and all at shutdown: an export of a long history is hundreds of MB, where /tmp may be memory;
    # analytics_enabled: Gradio would send telemetry about the page (to api.gradio.app and huggingface.co)
    # and ask for its latest version as the app starts: a local chat app calls nobody
    with gr.Blocks(title=TITLE, delete_cache=(3600, 3600), analytics_enabled=False) as app:
        with gr.Row(equal_height=True, elem_id="ps-top"):
            header = gr.HTML(header_html(DEFAULT))
            lang, remembered = language.switch(texts)
        with gr.Tabs() as tabs:
            with texts(gr.Tab, label=K("tab.chat"), id="chat"):
                recorder = make_recorder(store, lambda: engine.info)
                chat = chat_tab.build(engine, active, texts, lang, streams, recorder)
            with texts(gr.Tab, label=K("tab.explain"), id="explain", elem_id="ps-explain-tab"):
                close_explain = explain.build(engine, texts, lang)
            with texts(gr.Tab, label=K("tab.history"), id="history", elem_id="ps-history-tab") as history:
                history_tab.build(engine, store, chat, tabs, history, texts, lang)
            with texts(gr.Tab, label=K("tab.lab"), id="lab", elem_id="ps-lab-tab"):
                lab_tab.build(engine, store, texts, lang)
        texts.on_switch(header_html, [], [header])
        texts.wire(lang, remembered, app)
        app.unload(close_explain)  # a page's held walk-through ends with the page
    app.live_streams = streams  # their route goes on the web app that serves this page (Streams.add_route)
    _calm_queue(app)
    return app


QUEUE_POLL_S = 0.02


def _calm_queue(app: gr.Blocks) -> None:
    """Gradio's queue looks for new events every millisecond while it has none (every 50 ms on Windows),
    and for progress every 10 ms: 10 % of a core with the app idle, and during a reply a thousand
    wake-ups a second that take a core from the decode step's two threads, and so hold up the step.
    Every 20 ms instead (progress every 100 ms; the app sends none): decode in the page measured 22 %
    faster in int8 (median of six alternating 256-token replies, every pair faster) and 8.5 % in fp32,
    the idle app 1.6 % of a core. A click waits at most 20 ms more to start."""
    queue = getattr(app, "_queue", None)
    if queue is not None and hasattr(queue, "sleep_when_free"):
        queue.sleep_when_free = QUEUE_POLL_S
        queue.progress_update_sleep_when_free = 5 * QUEUE_POLL_S


def _plotly_js() -> Path:
    """plotly.js as the plotly package ships it: the page draws the charts itself (no CDN)."""
    import plotly

    return Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"


def launch_options() -> dict:
    # frames.js first (see there); markdown.js before phasescope.js, which uses it; plotly.js is loaded by
    # phasescope.js once the page is up (evaluated with Gradio's scripts, its 4.5 MB held the page's controls
    # back: the message box showed 2.3 s after the page was asked for, 1.4 s without it)
    scripts, plotly = [STATIC / "frames.js", STATIC / "markdown.js", STATIC / "phasescope.js"], _plotly_js()
    gr.set_static_paths([*scripts, plotly])  # served as files, cached by the browser
    # relative: under `serve --ui` the app lives at /ui/
    head = "".join(f'<script src="gradio_api/file={path}"></script>' for path in scripts[:-1])
    head += f'<script src="gradio_api/file={scripts[-1]}" data-plotly="gradio_api/file={plotly}"></script>'
    # the machine's own fonts, CJK included: a theme's default web font would be fetched from outside
    theme = gr.themes.Soft(primary_hue="blue", font=list(FONTS), font_mono=["ui-monospace", "monospace"])
    # run_history off: Gradio (since 6.24) keeps each event's inputs and outputs, a chat's text and figures
    # included, in the browser's localStorage, rewritten whole at every event (~200 ms of the page's CPU per
    # message in a 12-turn chat) and left there when the chat is deleted from the History; off, it also
    # deletes what an earlier start saved
    return dict(theme=theme, css_paths=[STATIC / "app.css"], head=head, run_history=False,
                js="() => { const go = () => window.phasescope ? window.phasescope.start() : setTimeout(go, 100); "
                   "go(); }")


def _return_memory_when_idle(engine: Engine, every_s: float = 5.0) -> None:
    """After a busy spell, once the engine is idle, hand freed heap back to the OS (glibc's malloc_trim):
    otherwise the process keeps the peak of a load as its resident size. No-op where there is no glibc."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return

    def loop() -> None:
        busy = False
        while True:
            time.sleep(every_s)
            running, waiting = engine.load()
            if running or waiting:
                busy = True
            elif busy:
                trim(0)
                busy = False

    threading.Thread(target=loop, name="trim-memory", daemon=True).start()


def start_engine(config: EngineConfig, on_stage=lambda name, **params: None) -> Engine:
    """Load the model and serve it: the engine thread loads it, then runs the scheduler loop, so that one
    OpenMP team does all the work (see EngineThread). on_stage(name, **params) is told what the load does
    now: "import", "read", "warm", and the stages the engine's log names (see LoadStages)."""
    print("Loading the model…", file=sys.stderr, flush=True)
    on_stage("import")
    from engine import Engine  # here: torch loads with it

    settle()  # the imports are done (see app/startup.py)

    runner = EngineThread().start()
    on_stage("read")
    engine = runner.call(lambda: Engine.from_config(config))
    on_stage("warm")
    runner.call(engine.warm_up)  # the first chat's TTFT is then a prefill's, not a cold start's
    runner.serve(engine)
    _return_memory_when_idle(engine)
    print(engine_line(engine), file=sys.stderr, flush=True)
    return engine


class LoadStages(logging.Handler):
    """The stages of a load that the engine's log names (a GGUF file converted, int8 rows made, the native
    step compiled, each once: records with a "stage", see engine.models.loader.stage), passed on to on_stage while
    it is attached."""

    def __init__(self, on_stage) -> None:
        super().__init__(logging.INFO)
        self.on_stage = on_stage

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "stage"):
            self.on_stage(record.stage, **getattr(record, "params", {}))

    def __enter__(self) -> LoadStages:
        log = logging.getLogger("engine")
        log.addHandler(self)
        if not log.isEnabledFor(logging.INFO):  # else the records are not made (the CLI sets INFO already)
            log.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("engine").removeHandler(self)


class LoadingEngine:
    """The engine behind a page that is served before it has loaded (importing torch and loading the model
    take about a second; a first start converts the bundled GGUF for about six seconds): its config is known at
    once, and what the load does now (stage); reading anything else waits until the engine serves, so a
    message sent meanwhile waits for it and then runs."""

    def __init__(self, config: EngineConfig) -> None:
        self._config, self._engine, self._error = config, None, None
        self._done = threading.Event()
        self._stage, self._started = ("start", {}), time.monotonic()

    def start(self) -> LoadingEngine:
        def load() -> None:
            try:
                with LoadStages(self._set_stage):
                    self._engine = start_engine(self._config, on_stage=self._set_stage)
            except BaseException as exc:  # noqa: BLE001 - raised again by wait()
                self._error = exc
            finally:
                self._done.set()

        self._started = time.monotonic()
        threading.Thread(target=load, name="load-model", daemon=True).start()
        return self

    def _set_stage(self, name: str, **params) -> None:
        self._stage = (name, params)

    @property
    def stage(self) -> tuple[str, dict, float]:
        """What the load does now ("start", "import", "read", "convert", "quantize", "compile", "warm"), its
        parameters (a file's name), and the seconds since the load started."""
        name, params = self._stage
        return name, params, time.monotonic() - self._started

    def wait(self) -> Engine:
        """The serving engine, once loaded (a page that asks before start() waits too); the load's error if
        it failed. Building the page must not read it: it would wait for a load not yet started."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._engine

    @property
    def config(self) -> EngineConfig:
        return self._engine.config if self._engine is not None else self._config

    @property
    def loading(self) -> bool:
        """Whether reading the engine would still wait (an Engine has no such attribute: it is loaded)."""
        return not self._done.is_set()

    def __getattr__(self, name: str):
        return getattr(self.wait(), name)


def stop_on_sigterm() -> None:
    """SIGTERM (kill, systemd, docker stop) ends the app as Ctrl-C does: the server closes and the process's
    temporary folders (gradio's cache, the exports) are removed, where the signal's default left them in
    /tmp. Gradio's loop catches the KeyboardInterrupt (before it, the command ends with status 130, as at a
    Ctrl-C); uvicorn (`serve`) shuts down on the signal, then sends it again to the handler it found, this
    one."""
    def stop(signum, frame) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():  # the only thread a handler may be set from
        signal.signal(signal.SIGTERM, stop)


def launch(config: EngineConfig, host: str = "127.0.0.1", port: int = 7860, db_path: str | None = None,
           open_browser: bool = False, auth: tuple[str, str] | None = None) -> None:
    stop_on_sigterm()  # from the start: a page served while the model loads can be stopped so too
    store = Store.open(db_path)  # first: a bad --db fails before the model loads
    print(f"History: {store.path}", file=sys.stderr, flush=True)
    engine = LoadingEngine(config)
    app = build_app(engine, store)
    url = url_of(host, port)
    # the page first, then the model behind it: the page is up in about two seconds, the model a second later
    server, _, _ = app.launch(server_name=url_host(host), server_port=port, quiet=True, show_error=True,
                              footer_links=[], auth=auth, prevent_thread_lock=True, **launch_options())
    app.live_streams.add_route(server)
    print(f"PhaseScope is running at {url}  (Ctrl-C to stop)", flush=True)
    if open_browser:
        webbrowser.open(url)
    try:
        engine.start().wait()
    except BaseException:
        app.close()  # a model that cannot load ends the app with its one-line message, as before the page
        raise
    app.block_thread()
