"""The `phasescope` command: the browser app (default), one-shot generation, a terminal chat, the history's
sessions and exports, the bench, the Lab and the API server. One module per command (or pair), the options in
parser.py, what they configure in options.py, what the terminal prints about a run in lines.py."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable

from .. import startup
from .bench import cmd_bench, cmd_lab
from .chat import cmd_chat
from .generate import cmd_generate
from .history import cmd_export, cmd_sessions
from .lines import engine_line, setup_flags, switch_flags
from .options import engine_config, sampling_of
from .parser import build_parser
from .serve import cmd_serve, cmd_ui

__all__ = ["main", "build_parser", "engine_config", "sampling_of", "engine_line", "setup_flags", "switch_flags"]


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "bench": cmd_bench,
    "ui": cmd_ui,
    "generate": cmd_generate,
    "chat": cmd_chat,
    "sessions": cmd_sessions,
    "export": cmd_export,
    "lab": cmd_lab,
    "serve": cmd_serve,
}


def _one_line(exc: BaseException) -> str:
    """An error as the user reads it: a file's error names the file and the reason, not "[Errno 2] …"."""
    if isinstance(exc, OSError) and exc.filename and exc.strerror:
        return f"{exc.filename}: {exc.strerror[0].lower()}{exc.strerror[1:]}"
    return str(exc)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        argv = ["ui", *argv]  # `phasescope` alone starts the app
    args = parser.parse_args(argv)
    if args.command in ("generate", "ui", "serve"):
        startup.pause_collector()  # until the engine's modules are imported (see app/startup.py)
    from app.history.errors import StoreError
    from engine import ModelError

    engine_log = logging.getLogger("engine")  # what a first start does once (a conversion, int8 rows) that
    if not engine_log.handlers:  # takes a while
        said = logging.StreamHandler(sys.stderr)
        said.setFormatter(logging.Formatter("%(message)s"))
        engine_log.addHandler(said)
        engine_log.setLevel(logging.INFO)
    try:
        return COMMANDS[args.command](args)
    except BrokenPipeError:  # what read the output went away (`phasescope generate --json | head -1`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor fail again flushing at exit
        return 128 + signal.SIGPIPE  # quietly, as a tool the signal ends: the shell's 141
    except (ModelError, StoreError, ValueError, OSError) as exc:
        print(f"phasescope: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
