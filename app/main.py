"""Composes the app's tabs and starts the Gradio server."""
from __future__ import annotations

import sys
import webbrowser
from pathlib import Path

import gradio as gr

from engine import Engine, EngineConfig

from .ui import chat_tab, explain_tab, history_tab
from .history.recorder import make_recorder
from .ui.session import ActiveRequests, EngineThread
from .history.store import Store

STATIC = Path(__file__).resolve().parent.parent / "static"
TITLE = "PhaseScope"


def build_app(engine: Engine, store: Store) -> gr.Blocks:
    active = ActiveRequests()
    with gr.Blocks(title=TITLE) as app:
        gr.HTML(f'<div class="ps-header"><span class="ps-logo">{TITLE}</span> '
                '<span class="ps-tagline">watch the prompt being read in one burst (<b class="ps-p-fg">prefill</b>) '
                'and the reply come token by token (<b class="ps-d-fg">decode</b>)</span></div>')
        with gr.Tabs() as tabs:
            with gr.Tab("Chat", id="chat"):
                chat = chat_tab.build(engine, active, make_recorder(store, engine.info))
            with gr.Tab("Explain", id="explain", elem_id="ps-explain-tab"):
                explain_tab.build(engine)
            with gr.Tab("History", id="history", elem_id="ps-history-tab"):
                history_tab.build(engine, store, chat, tabs)
    app.queue(default_concurrency_limit=1)
    return app


def _plotly_js() -> Path:
    """plotly.js as the plotly package ships it: the page draws the charts itself (no CDN)."""
    import plotly

    return Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"


def launch_options() -> dict:
    scripts = [_plotly_js(), STATIC / "phasescope.js"]
    gr.set_static_paths(scripts)  # served as files, cached by the browser
    head = "".join(f'<script src="/gradio_api/file={path}"></script>' for path in scripts)
    return dict(theme=gr.themes.Soft(primary_hue="blue"), css_paths=[STATIC / "app.css"], head=head,
                js="() => { const go = () => window.phasescope ? window.phasescope.start() : setTimeout(go, 100); "
                   "go(); }")


def launch(config: EngineConfig, host: str = "127.0.0.1", port: int = 7860, db_path: str | None = None,
           open_browser: bool = False) -> None:
    store = Store.open(db_path)  # first: a bad --db fails before the model loads
    print(f"History: {store.path}", file=sys.stderr, flush=True)
    print("Loading the model…", file=sys.stderr, flush=True)
    # the engine thread loads the model, then runs the scheduler loop: one OpenMP team (see EngineThread)
    runner = EngineThread().start()
    engine = runner.call(lambda: Engine.from_config(config))
    runner.serve(engine)
    info = engine.info
    print(f"{info.name} on {info.device} ({info.precision}, {info.model_path}, decode: {info.decode_path})",
          file=sys.stderr, flush=True)
    app = build_app(engine, store)
    url = f"http://{host}:{port}"
    print(f"PhaseScope is running at {url}  (Ctrl-C to stop)", flush=True)
    if open_browser:
        webbrowser.open(url)
    app.launch(server_name=host, server_port=port, quiet=True, show_error=True, footer_links=[],
               **launch_options())
