"""`phasescope chat`: a chat in the terminal, saved in the history as the browser's, with a timing line after
each reply, with the local engine or a remote server measured from here."""
from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .lines import dim, engine_line, local_line, print_reply, remote_line
from .options import endpoint_of, make_engine, print_model_sampling, sampling_of


def cmd_chat(args: argparse.Namespace) -> int:
    """The terminal chat, with the local engine or (--endpoint) a remote server measured from here; each
    conversation is saved in the history as the browser's chats are (`phasescope sessions`, `export`)."""
    from app.history.recorder import load_chat, make_recorder
    from app.history.store import Store
    from app.i18n import t
    from app.ui.session import ChatSession
    from app.ui.trace import ReplyTrace

    sampling, taken = sampling_of(args)
    # first: a bad --db or --session fails before the model loads (and a chat to continue needs its database)
    store = Store.open(args.db, create=args.session is None)
    if args.session is not None and not store.has_session(args.session):
        raise ValueError(f"no session with id {args.session} in {store.path} (see `phasescope sessions`)")
    endpoint = endpoint_of(args) if args.endpoint else None
    engine = None if endpoint else make_engine(args)
    if endpoint:
        about, what = endpoint.info, f"{endpoint.model} at {endpoint.url} (client-side timings)"
    else:
        about = lambda: engine.info  # noqa: E731  (a session is about the model running when it starts)
        what = engine_line(engine)
    print(f"{what}; history: {store.path}. {CHAT_COMMANDS}.")
    print_model_sampling(args.model, taken)
    record = make_recorder(store, about)
    session = ChatSession() if args.session is None else load_chat(store, args.session)
    for user, reply in zip(session.messages[::2], session.messages[1::2]):  # a continued chat so far
        print(f"\n>>> {user['content']}\n{reply['content']}")
    system = args.system
    if system is None and session.settings.get("system"):  # a continued chat goes on with its own
        system = session.settings["system"]
        print(dim(f"system prompt (the session's): {system}"))

    def clear() -> None:
        nonlocal session, system
        session, system = ChatSession(), args.system

    def retry() -> str | None:
        """The last message, taken back with its reply to be sent again (the history marks that reply
        replaced); None before any reply."""
        return session.retract() if session.traces else None

    for text in _user_lines(clear, retry):
        messages = session.prompt(system, text)
        try:
            request = None if endpoint else engine.new_request(messages, sampling, fit=True)
        except ValueError as exc:  # empty, or a message longer than the context window: nothing is saved
            print(f"error: {exc}")
            continue
        if request is not None:
            session.sent_as(messages, request, engine.prompt_budget(sampling))
            messages = request.messages
        _print_warnings(session)
        trace = ReplyTrace(turn=len(session.traces) + 1)
        session.traces.append(trace)
        session.asked = text
        hooks = [trace.add]
        try:
            hooks.append(record(session, messages, sampling, trace))
        except Exception as exc:  # a full disk or a broken database must not stop the chat
            session.warn(t(session.lang, "warning.not_saved", detail=exc))
        if endpoint:
            stopped = threading.Event()
            events, stop = _through(endpoint.stream(messages, sampling, cancelled=stopped.is_set), hooks), stopped.set
        else:
            events, stop = engine.run(request, hooks), request.cancel
        try:
            with _ctrl_c_calls(stop):
                finished = print_reply(events)
        except KeyboardInterrupt:  # a second Ctrl-C, or one a tensor-parallel forward held until it ended
            events.close()  # cancels the request, or closes the remote connection
            print()
            finished = trace.finished
        _print_warnings(session)
        if trace.failed:
            print(f"error: {trace.finished.error}")
        else:
            session.converse(text, trace)
        if finished is not None and finished.metrics.num_generated_tokens:  # none: nothing was measured
            print(dim(remote_line(finished) if endpoint else local_line(finished)))
    return 0


def _print_warnings(session) -> None:
    for warning in session.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    session.warnings.clear()


@contextmanager
def _ctrl_c_calls(stop: Callable[[], None]):
    """While a reply streams, Ctrl-C calls stop, as the page's Stop does: the reply ends with its text so
    far, saved as stopped, within a step (or a chunk, from a remote server). A second Ctrl-C interrupts."""
    def first(signum, frame) -> None:
        signal.signal(signal.SIGINT, previous)
        stop()

    previous = signal.signal(signal.SIGINT, first)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


CHAT_COMMANDS = ("Type /retry for another reply to your last message, /edit TEXT to send TEXT in its place, "
                 "/clear for a new chat, /bye or Ctrl-D to leave, /? for help; Ctrl-C stops a reply")


def _line_editing() -> None:
    """At a terminal, the prompt edits its line (arrow keys, Ctrl-A, Ctrl-E...) and the up arrow brings back
    the lines typed before, as in `ollama run`: Python's input() does so once readline is imported. Kept in
    memory only: the conversations are in the history database, which only the user can read."""
    if sys.stdin.isatty():
        try:
            importlib.import_module("readline")  # importing it is all it takes
        except ImportError:  # not on every platform (Windows)
            pass


def _several_lines(line: str) -> str:
    """A message begun with three double quotes: its lines up to the one that ends with three more, as
    `ollama run` reads them, so that a pasted paragraph or a piece of code goes as one message, not a
    message a line. The lines stay as typed (code keeps its indentation)."""
    lines = []
    while not line.rstrip().endswith('"""'):
        lines.append(line)
        line = input("... ")
    lines.append(line.rstrip()[:-3])
    return "\n".join(lines).strip("\n")


def _user_lines(clear: Callable[[], None], retry: Callable[[], str | None]) -> Iterator[str]:
    """What the user types at the >>> prompt, line by line; /retry sends the last message again, /edit TEXT
    sends TEXT in its place (both take back the last exchange: retry), /clear starts a new chat, /bye or
    Ctrl-D ends (Ctrl-C drops the line being typed)."""
    _line_editing()
    while True:
        try:
            text = input("\n>>> ").strip()
            if text.startswith('"""'):
                text = _several_lines(text[3:])
        except EOFError:
            print()
            return
        except KeyboardInterrupt:  # the line is dropped and the chat goes on, as at a shell's prompt: a second
            print("\n(/bye or Ctrl-D leaves)")  # Ctrl-C meant for a reply that had just ended left the chat
            continue
        if text in ("/bye", "/exit", "/quit"):
            return
        if text == "/clear":
            clear()
            print("(new chat)")
        elif text == "/retry":
            again = retry()
            print(f"(again: {again})" if again else "(no reply to retry yet)")
            if again:
                yield again
        elif text == "/edit" or text.startswith("/edit "):
            edited = text[len("/edit"):].strip()
            if not edited:
                print("(/edit TEXT sends TEXT in place of your last message)")
            elif retry() is None:
                print("(no message to edit yet)")
            else:
                yield edited
        elif text in ("/?", "/help"):
            print(f"{CHAT_COMMANDS}. Any other line is sent to the model; a message of several lines (a pasted "
                  'paragraph, code) begins and ends with """, as in `ollama run`.')
        elif text.startswith("/") and " " not in text:  # a mistyped command, not a message (/usr/bin? is sent)
            print(f"(no command {text}: /? lists them)")
        elif text.strip():
            yield text


def _through(events, hooks):
    """Each event handed to the hooks, then passed on; closing this closes the source."""
    try:
        for event in events:
            for hook in hooks:
                hook(event)
            yield event
    finally:
        events.close()
