"""Per-user chat state (kept in gr.State) and the map of running requests that Stop reaches."""
from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from html import escape
from typing import TYPE_CHECKING

from engine import DecodeStep, Event, Finished, Request, SamplingParams, Status, reply_message

from ..i18n import DEFAULT, t
from .markdown import as_text, closed
from .panels import stats_line
from .trace import ReplyTrace

if TYPE_CHECKING:  # the engine's machinery imports torch: the page is served before it loads
    from engine import Engine


def live_span(reply_id: str) -> str:
    """A reply while it streams: an empty span that static/phasescope.js fills with the reply's text,
    following its stream (app/ui/live.py, Streams) by the id it carries, in a class (the Chatbot's
    sanitizer keeps classes, not data attributes)."""
    return f'<span class="ps-live ps-reply-{escape(reply_id)}"></span>'


@dataclass
class ChatSession:
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    messages: list[dict] = field(default_factory=list)  # what the model sees (raw text)
    display: list[dict] = field(default_factory=list)  # what the Chatbot shows
    traces: list[ReplyTrace] = field(default_factory=list)  # one per assistant reply
    store_id: int | None = None  # the history database's session id, once saved
    store_key: str | None = None  # store_id with its creation time (Store.session_key): the page keeps it
    saved_reply: int | None = None  # the id of store_id's latest reply as this chat knows it (Store.add_reply)
    pending: str = ""  # a message accepted and waiting for the engine
    taken: str = ""  # the reply id whose message a respond took (take)
    warnings: list[str] = field(default_factory=list)  # e.g. the history could not be saved
    lang: str = DEFAULT  # the page's language when the chat last sent or switched (app/i18n)
    endpoint: object | None = None  # an app.remote.Endpoint when this chat talks to a remote server
    # the accepted message's settings (chat_tab's SETTINGS); in a chat opened from the history, what its last reply
    # was asked with (app/history/recorder.py, reply_settings) until a message is accepted
    settings: dict = field(default_factory=dict)
    reply_id: str = ""  # the accepted message's reply: this chat's random id and the reply's number
    asked: str = ""  # the last exchange's message (raw text), for Retry
    refused: set[int] = field(default_factory=set)  # the exchanges (0, 1, ...) the engine refused: no trace
    sent: int = 0  # messages accepted in this chat: a retried one gets a reply id of its own
    left_out: int = 0  # the earliest messages no longer sent to the model: the chat outgrew its context window

    def accept(self, user_text: str) -> None:
        """Show the user's message at once, and the reply as an empty span (shown as "…") that the page
        fills as text streams (static/phasescope.js): the conversation is sent to the page once per
        reply, before decode, and again when the reply ends (a re-render of the chat, while decode runs,
        took ~140 ms of the page's CPU from it)."""
        self.pending = self.asked = user_text
        self.sent += 1
        self.reply_id = f"{self.id}-{self.sent}"
        self.display += [{"role": "user", "content": as_text(user_text)},
                         {"role": "assistant", "content": live_span(self.reply_id)}]

    def take(self) -> str:
        """The accepted message, for the one respond that runs it; "" for any other. Every send queues a
        respond, also one that accept turned down because a reply was running: that one must not run the
        running reply's message a second time."""
        if not self.pending or self.taken == self.reply_id:
            return ""
        self.taken = self.reply_id
        return self.pending

    def prompt(self, system: str | None, text: str) -> list[dict]:
        """The conversation sent to the model with a new message: the system prompt, the chat from its
        first message still sent (left_out), the message."""
        head = [{"role": "system", "content": system}] if system and system.strip() else []
        return head + self.messages[self.left_out:] + [{"role": "user", "content": text}]

    def sent_as(self, prompt: list[dict], request: Request, limit: int) -> None:
        """The engine fitted prompt to limit tokens (Engine.new_request(fit=True), Engine.prompt_budget):
        the exchanges it left out stay out of this chat's next prompts (which then start alike, for the
        prefix cache), and the user is told, when it happens."""
        if dropped := len(prompt) - len(request.messages):
            self.left_out += dropped
            self.warn(t(self.lang, "warning.context_full", limit=limit, count=self.left_out))

    def show_reply(self, trace: ReplyTrace) -> None:
        content = closed(trace.text)  # a reply cut short in a block of code: its stats line after the block
        if trace.finished and trace.finished.reason == "error":  # after what came before it (as saved)
            error = f"⚠️ {as_text(trace.finished.error or 'error')}"
            content = f"{content}\n\n{error}" if content else error
        elif trace.finished:
            finished = trace.finished
            stats = stats_line(finished.metrics, finished.reason, self.lang, finished.held_ms)
            content += f'\n\n<span class="ps-stats">{stats}</span>'
        self.display[-1] = {"role": "assistant", "content": content or "…"}

    def restore_exchange(self, user_text: str, trace: ReplyTrace) -> None:
        """Add a stored exchange: shown as it was, and part of the conversation unless it failed."""
        self.accept(user_text)
        self.pending = ""
        self.traces.append(trace)
        self.show_reply(trace)
        if not trace.failed:
            self.converse(user_text, trace)

    def converse(self, user_text: str, trace: ReplyTrace) -> None:
        """A message and its reply join the conversation the model sees: the reply with the token ids it was
        generated as, which the next prompt reuses where they spell its text (engine.render_prompt), so
        that the prefix cache finds all of it."""
        self.messages += [{"role": "user", "content": user_text}, reply_message(trace.text, trace.token_ids)]

    @property
    def num_exchanges(self) -> int:
        """The messages shown with their replies (or the engine's refusal)."""
        return len(self.display) // 2

    def retract(self) -> str:
        """Take back the last exchange, for Retry: its message and reply leave the chat, and the message is
        returned, to be sent again (the history keeps the reply, marked replaced: app/history/store.py)."""
        last = self.num_exchanges - 1
        del self.display[-2:]
        if last in self.refused:
            self.refused.discard(last)
        elif not self.traces.pop().failed:  # it was part of the conversation
            del self.messages[-2:]
        if self.left_out > len(self.messages):  # taken back to before the part left out: it may all fit again
            self.left_out = 0
        return self.asked

    def cut(self, exchange: int) -> None:
        """Take back exchange (0 the first) and every one after it, for an edited message: the chat goes on
        from the conversation before it (the history keeps what is taken back, marked replaced)."""
        while self.num_exchanges > exchange:
            self.retract()

    def warn(self, message: str) -> None:
        self.warnings.append(message)

    def show_error(self, error: str) -> None:
        """The engine refused the message (its settings, a full queue): said in the reply's place."""
        self.refused.add(self.num_exchanges - 1)
        self.display[-1] = {"role": "assistant", "content": f"⚠️ {as_text(error)}"}


class ActiveRequests:
    """Which chats are about to hand a request to the engine or have one running, so that Stop can
    reach them from another thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: list[str] = []
        self._stopped_while_waiting: set[str] = set()
        self._running: dict[str, Request] = {}

    def wait(self, session_id: str) -> None:
        """A chat is about to hand its message to the engine (Stop may come before it does)."""
        with self._lock:
            self._waiting.append(session_id)

    def start(self, session_id: str, request: Request) -> None:
        with self._lock:
            if session_id in self._waiting:
                self._waiting.remove(session_id)
            self._running[session_id] = request
            if session_id in self._stopped_while_waiting:
                self._stopped_while_waiting.discard(session_id)
                request.cancel()  # Stop came while it was waiting: it ends before its prefill

    def finish(self, session_id: str, request: Request | None = None) -> None:
        with self._lock:
            if session_id in self._waiting:
                self._waiting.remove(session_id)
            if request is not None and self._running.get(session_id) is request:
                del self._running[session_id]

    def is_busy(self, session_id: str) -> bool:
        """Whether a chat has a message waiting for the engine or a reply running."""
        with self._lock:
            return session_id in self._waiting or session_id in self._running

    def cancel(self, session_id: str) -> bool:
        with self._lock:
            request = self._running.get(session_id)
            if request is None and session_id in self._waiting:
                self._stopped_while_waiting.add(session_id)
                return True
        if request is None:
            return False
        request.cancel()
        return True


class EngineThread:
    """Runs every engine job on one thread, the one that loaded the model: then the engine's
    scheduler loop, which runs every reply.

    PyTorch's OpenMP keeps a team of worker threads for each thread that calls it. A second calling
    thread on a 2-core machine doubles the teams and libgomp then sleeps between parallel regions;
    a decode step is hundreds of small ones, and it ran about 40% slower (int8: 48 vs 80 tok/s).
    The app start()s one, loads the model on it with call(), then serve()s the engine on it.
    """

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._stopped = threading.Event()
        self._engine: Engine | None = None

    def submit(self, job: Callable[[], None]) -> threading.Event:
        done = threading.Event()
        self._jobs.put((job, done))
        return done

    def serve_forever(self) -> None:
        while not self._stopped.is_set():
            try:
                job, done = self._jobs.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                job()
            finally:
                done.set()

    def call(self, job: Callable[[], object]) -> object:
        """Run job on the engine thread and return its result (or raise its exception) here."""
        outcome: dict = {}

        def capture() -> None:
            try:
                outcome["value"] = job()
            except BaseException as exc:  # handed back to the caller
                outcome["error"] = exc

        self.submit(capture).wait()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def start(self) -> EngineThread:
        threading.Thread(target=self.serve_forever, name="engine", daemon=True).start()
        return self

    def serve(self, engine: Engine) -> EngineThread:
        """From now on the thread runs the engine's scheduler loop (until stop())."""
        self._engine = engine
        self.submit(engine.serve_forever)
        while not engine.is_serving and not self._stopped.is_set():
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._engine is not None:
            self._engine.stop()


class _Worker:
    """What the chat's respond waits on between updates: the reply's end, or its first token, which the
    page is sent when it comes rather than at the next update (the loop's UPDATE_EVERY_S: a 40-ms TTFT's
    token showed in the page ~250 ms after it was there)."""

    def __init__(self) -> None:
        self.error: str | None = None
        self._done, self._news = threading.Event(), threading.Event()

    def _note_first(self, event: Event) -> None:
        if isinstance(event, DecodeStep) and event.step == 0:  # (a hook after the trace's: the trace has it)
            self._news.set()

    def _end(self) -> None:
        self._done.set()
        self._news.set()

    @property
    def is_running(self) -> bool:
        return not self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Until the reply ends or its first token comes, at most timeout seconds."""
        self._news.wait(timeout)
        if not self._done.is_set():
            self._news.clear()


class ReplyWorker(_Worker):
    """Hands one request to the serving engine, feeding a trace, so that drawing the page never holds
    up a decode step (the UI's thread only reads the trace)."""

    def __init__(self, engine: Engine, request: Request, trace: ReplyTrace,
                 hooks: Iterable[Callable[[Event], None]] = ()) -> None:
        if not engine.is_serving:
            raise RuntimeError("the engine is not serving: start its loop (EngineThread.serve) first")
        super().__init__()
        self.request = request
        engine.submit(request, hooks=[trace.add, *hooks, self._on_event])

    def _on_event(self, event: Event) -> None:
        self._note_first(event)
        if isinstance(event, Finished):
            error = self.request.hook_error
            if error is not None:  # a hook failed; the engine ended the request
                self.error = f"{type(error).__name__}: {error}"
            self._end()


class RemoteWorker(_Worker):
    """A reply from a remote endpoint (app/remote), streamed on its own thread into a trace and hooks, as
    ReplyWorker does for the engine; it also stands in for the engine's Request where the chat tab
    reads one (cancel, status, is_finished)."""

    remote = True

    def __init__(self, endpoint, messages: list[dict], sampling: SamplingParams, trace: ReplyTrace,
                 hooks: Iterable[Callable[[Event], None]] = ()) -> None:
        super().__init__()
        self.status = Status.DECODING
        self._cancelled = threading.Event()
        hooks = [trace.add, *hooks, self._note_first]

        def run() -> None:
            try:
                for event in endpoint.stream(messages, sampling, cancelled=self._cancelled.is_set):
                    for hook in hooks:
                        hook(event)
            except Exception as exc:  # a hook failed: the reply ends here, said
                self.error = f"{type(exc).__name__}: {exc}"
            finally:
                self.status = Status.FINISHED
                self._end()

        threading.Thread(target=run, name="remote-reply", daemon=True).start()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def is_finished(self) -> bool:
        return self._done.is_set()
