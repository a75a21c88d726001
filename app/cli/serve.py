"""`phasescope ui` and `phasescope serve`: the browser app, and the OpenAI-compatible API."""
from __future__ import annotations

import argparse

from ..gradio_import import private_cache
from .options import engine_config


def cmd_ui(args: argparse.Namespace) -> int:
    private_cache()  # before gradio is imported
    from app.main import launch
    from app.serve.access import check_exposure, check_port, parse_auth

    auth = parse_auth(args.auth)
    check_port(args.host, args.port)
    check_exposure(args.host, ui=True, api=False, auth=auth, api_key=None, insecure=args.insecure)
    launch(engine_config(args), host=args.host, port=args.port, db_path=args.db, open_browser=args.open, auth=auth)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    if args.ui:
        private_cache()  # before gradio is imported
    from app.serve import check_exposure, check_port, parse_auth, serve

    auth = parse_auth(args.auth)
    check_port(args.host, args.port)
    check_exposure(args.host, ui=args.ui, api=True, auth=auth, api_key=args.api_key, insecure=args.insecure)
    serve(engine_config(args), host=args.host, port=args.port, api_key=args.api_key, auth=auth, with_ui=args.ui,
          db_path=args.db)
    return 0
