"""`phasescope serve`: the engine behind an OpenAI-compatible API with Prometheus metrics, the UI
beside it on request (api.py, metrics.py, protocol.py: imported when it serves, as they import the
engine's machinery); and the rules for who may reach either (access.py, which `phasescope ui` uses too)."""
from __future__ import annotations

import sys

from engine import EngineConfig

from .access import check_exposure, check_port, is_loopback, parse_auth, url_of

__all__ = ["check_exposure", "check_port", "is_loopback", "parse_auth", "serve"]


def serve(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          auth: tuple[str, str] | None = None, with_ui: bool = False, db_path: str | None = None) -> None:
    import uvicorn

    from ..main import start_engine, stop_on_sigterm
    from .api import create_api

    stop_on_sigterm()  # from the start: a server stopped while its model loads goes as Ctrl-C would
    store = None
    if with_ui:
        from ..history.store import Store

        store = Store.open(db_path)  # first: a bad --db fails before the model loads
    engine = start_engine(config)
    api = metrics_api = create_api(engine, api_key)
    if with_ui:
        import gradio as gr
        from fastapi.responses import RedirectResponse

        from ..main import build_app, launch_options

        page = build_app(engine, store)
        page.live_streams.add_route(api, prefix="/ui")  # before the mount, which would take the path
        # a browser at the server's root: the page, and its icon
        api.add_api_route("/", lambda: RedirectResponse("/ui/"), include_in_schema=False)
        api.add_api_route("/favicon.ico", lambda: RedirectResponse("/ui/favicon.ico"), include_in_schema=False)
        api.state.served.append("GET /ui/ (the page)")  # what a 404 lists
        api = gr.mount_gradio_app(api, page, path="/ui", auth=auth, footer_links=[], **launch_options())
    url = url_of(host, port)
    print(f"PhaseScope API at {url}/v1 (metrics at {url}/metrics{', UI at ' + url + '/ui' if with_ui else ''})  "
          "(Ctrl-C to stop)", flush=True)
    with engine.hooks(metrics_api.state.metrics.observe):  # every request counts, the UI's too
        uvicorn.run(api, host=host, port=port, log_level="warning")
    print("stopped", file=sys.stderr)
