"""Between the engine's events and the history database: the recorder hook, and the way back.

A reply's steps are written in batches while it generates (not one transaction per token, not only at
the end), so Stop, an error or a killed process keeps every step up to the last batch.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable

from engine import DecodeStep, Event, Finished, FirstToken, ModelInfo, PrefillChunk, SamplingParams, Started
from engine.metrics import RequestMetrics, session_summary

from ..i18n import DEFAULT, t
from ..ui.session import ChatSession
from .store import FINAL_STATUS, SessionMoved, Store, StoreError
from ..ui.trace import ReplyTrace, summary_metrics

BATCH_STEPS = 32  # steps per write
BATCH_SECONDS = 0.5  # or sooner, when a write is this old (a slow prefill chunk is kept promptly)


def step_row(event: PrefillChunk | DecodeStep) -> dict:
    latency_ns = round(event.latency_ms * 1e6)
    row = dict(idx=event.chunk_index if isinstance(event, PrefillChunk) else event.step,
               start_ns=round(event.t_ms * 1e6) - latency_ns, latency_ns=latency_ns,
               kv_tokens=event.kv_tokens, kv_bytes=event.kv_bytes)
    if isinstance(event, PrefillChunk):
        return dict(phase="prefill", num_tokens=event.end - event.start, token_id=None, token_text=None,
                    token_prob=None, batch_size=None, **row)
    return dict(phase="decode", num_tokens=1, token_id=event.token_id, token_text=event.text,
                token_prob=event.prob, batch_size=event.batch_size,
                held_ns=round(event.held_ms * 1e6) if event.held_ms else None, **row)


class MessageRecorder:
    """An engine hook that writes one assistant message and its steps to the store."""

    def __init__(self, store: Store, message_id: int, on_error: Callable[[Exception], None] | None = None) -> None:
        self.store, self.message_id, self.on_error = store, message_id, on_error
        self._pending: list[dict] = []
        self._text = ""
        self._last_write = time.monotonic()
        self.error: str | None = None

    def __call__(self, event: Event) -> None:
        if self.error:
            return  # the database failed once: keep generating, stop writing
        try:
            self._record(event)
        except (StoreError, OSError, Exception) as exc:  # sqlite3 errors (disk full, locked) included
            self.error = f"the reply could not be saved to the history: {exc}"
            if self.on_error:
                self.on_error(exc)

    def _record(self, event: Event) -> None:
        if isinstance(event, (PrefillChunk, DecodeStep)):
            self._pending.append(step_row(event))
            if isinstance(event, DecodeStep):
                self._text += event.text
            if len(self._pending) >= BATCH_STEPS or time.monotonic() - self._last_write >= BATCH_SECONDS:
                self._flush(content=self._text)
        elif isinstance(event, Started):
            self.store.update_message(self.message_id, prompt_tokens=event.num_prompt_tokens,
                                      cached_prompt_tokens=event.num_cached_tokens,
                                      kv_capacity_tokens=event.kv_capacity_tokens,
                                      kv_capacity_bytes=event.kv_capacity_bytes,
                                      engine=None if event.engine is None else json.dumps(event.engine, sort_keys=True))
        elif isinstance(event, FirstToken):
            self.store.update_message(self.message_id, tokenize_ms=event.tokenize_ms, queue_ms=event.queue_ms)
        elif isinstance(event, Finished):
            m = event.metrics
            self._flush(content=event.text, status=FINAL_STATUS.get(event.reason, "complete"), writer=None,
                        finish_reason=event.reason, error=event.error, prompt_tokens=m.num_prompt_tokens,
                        cached_prompt_tokens=m.num_cached_tokens, generated_tokens=m.num_generated_tokens,
                        ttft_ms=m.ttft_ms, tpot_ms=m.tpot_ms, e2e_ms=m.e2e_ms, prefill_ms=m.prefill_ms,
                        held_ms=json.dumps(event.held_ms, sort_keys=True) if event.held_ms else None)

    def _flush(self, **message_fields) -> None:
        rows, self._pending = self._pending, []
        self.store.add_steps(self.message_id, rows, **message_fields)
        self._last_write = time.monotonic()


def sampling_settings(sampling: SamplingParams) -> dict:
    """The sampling as the history keeps it: every field by name (a session's settings, a reply's)."""
    return {name: getattr(sampling, name) for name in sampling.__slots__}


def reply_settings(session: ChatSession, messages: list[dict], sampling: SamplingParams) -> dict:
    """What a reply is asked with, saved with it (messages.settings): the system prompt sent (None: none), the
    sampling, and the chat's prefill chunk where it has one (the browser's)."""
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    return {"system": system, **sampling_settings(sampling),
            **{name: session.settings[name] for name in ("prefill_chunk",) if name in session.settings}}


def saved_as(session: ChatSession, store: Store, session_id: int) -> None:
    """The chat is the stored session session_id: its id, and its key for the page (Store.session_key)."""
    session.store_id, session.store_key = session_id, store.session_key(session_id)


def make_recorder(store: Store, model: Callable[[], ModelInfo]):
    """The chat tab's recorder factory: saves the session and the user's message, then returns the
    hook that records the assistant's reply. model: what a new session is about, read as it starts (a
    precision switch changes it)."""
    def recorder(session: ChatSession, messages: list[dict], sampling: SamplingParams, trace: ReplyTrace):
        user_text = messages[-1]["content"]
        if session.store_id is None or not store.has_session(session.store_id):  # new, or deleted meanwhile
            about = session.endpoint.info() if session.endpoint is not None else model()  # a remote chat: the endpoint
            session.saved_reply = None
            title = user_text.splitlines()[0] if user_text.strip() else "Chat"
            saved_as(session, store, store.create_session(title, about.name, about.device, about.dtype,
                                                          sampling_settings(sampling)))
        asked = reply_settings(session, messages, sampling)
        try:  # a retried turn: a new reply
            message_id = store.add_reply(session.store_id, trace.turn, user_text, session.saved_reply, asked)
        except SessionMoved:  # another tab continued this session: this chat goes on in a copy of it
            continued = session.store_id
            saved_as(session, store, store.fork_session(continued, trace.turn))
            session.warn(t(session.lang, "warning.session_forked", old=continued, new=session.store_id))
            message_id = store.add_reply(session.store_id, trace.turn, user_text, store.latest_reply(session.store_id),
                                         asked)
        session.saved_reply = message_id
        return MessageRecorder(store, message_id,
                               on_error=lambda exc: session.warn(t(session.lang, "warning.save_failed", detail=exc)))

    return recorder


# --- the way back: rows to events, for charts, restored chats and exports --------------------------

def _points(message: dict, steps: list[dict]) -> list[PrefillChunk | DecodeStep]:
    """A stored reply's steps as the events they were written from."""
    request_id, prompt = str(message["id"]), message["prompt_tokens"] or 0
    points: list[PrefillChunk | DecodeStep] = []
    position = message["cached_prompt_tokens"] or 0  # the first chunk starts after the reused prefix
    for row in steps:
        t_ms, latency_ms = (row["start_ns"] + row["latency_ns"]) / 1e6, row["latency_ns"] / 1e6
        if row["phase"] == "prefill":
            points.append(PrefillChunk(request_id, t_ms, row["idx"], position, position + row["num_tokens"], prompt,
                                       latency_ms, row["kv_tokens"], row["kv_bytes"]))
            position += row["num_tokens"]
        else:
            points.append(DecodeStep(request_id, t_ms, row["idx"], row["token_id"], row["token_text"] or "",
                                     latency_ms, row["kv_tokens"], row["kv_bytes"], row["token_prob"], (),
                                     row.get("batch_size") or 1, held_ms=(row.get("held_ns") or 0) / 1e6))
    return points


def _metrics(message: dict, points: list[PrefillChunk | DecodeStep]) -> RequestMetrics:
    prefilled = sum(p.num_tokens for p in points if isinstance(p, PrefillChunk))
    return summary_metrics(points, message["prompt_tokens"] or prefilled, message["cached_prompt_tokens"] or 0)


def message_metrics(message: dict, steps: list[dict]) -> RequestMetrics:
    """The summary metrics of a stored reply, by the engine's definitions, from its steps."""
    return _metrics(message, _points(message, steps))


def replies_summary(replies: list[RequestMetrics]) -> tuple[int, dict[str, dict[str, float | None]]]:
    """How many of a session's replies gave a first token, and p50/p90/p99 of their TTFT, TPOT, ITL and
    E2E (engine.metrics.session_summary; replies that Retry replaced count: they were measured)."""
    measured = [m for m in replies if m.ttft_ms is not None]
    return len(measured), session_summary(measured)


def message_events(message: dict, steps: list[dict]) -> list[Event]:
    """Rebuild a reply's events from its stored rows (top-5 alternatives are not stored)."""
    request_id = str(message["id"])
    events: list[Event] = []
    if message.get("kv_capacity_tokens") is not None:
        events.append(Started(request_id, 0.0, message["prompt_tokens"] or 0, 0, message["kv_capacity_tokens"],
                              message["kv_capacity_bytes"], "", message["cached_prompt_tokens"] or 0,
                              json.loads(message["engine"]) if message.get("engine") else None))
    points = _points(message, steps)
    events += points
    if message["status"] != "in_progress":
        reason = message["finish_reason"] or "interrupted"
        events.append(Finished(request_id, events[-1].t_ms if events else 0.0, reason, message["content"],
                               _metrics(message, points), message.get("error"),
                               held_ms=json.loads(message["held_ms"]) if message.get("held_ms") else None))
    return events


def questions(messages: list[dict]) -> dict[int, str]:
    """Each turn's message as the session stands (one a Retry kept, or the edited text; not what an edit
    replaced), by turn, from a session's stored or exported messages."""
    return {m["turn"]: m["content"] for m in messages if m["role"] == "user" and m["replaced_by"] is None}


def load_chat(store: Store, session_id: int, lang: str = DEFAULT) -> ChatSession:
    """A stored session as the chat tab holds it, to show it again and continue it (in the page's language):
    each turn with its latest reply (one a Retry replaced is left out), and as settings what the last reply
    was asked with (reply_settings; {} where it saved none)."""
    session = ChatSession(lang=lang)
    saved_as(session, store, session_id)
    messages = store.messages(session_id)
    asked = questions(messages)
    for message in messages:
        if message["role"] == "assistant" and message["replaced_by"] is None:
            trace = ReplyTrace(turn=message["turn"])
            for event in message_events(message, store.steps(message["id"])):
                trace.add(event)
            session.restore_exchange(asked.get(message["turn"], ""), trace)
            session.saved_reply = message["id"]
            session.settings = json.loads(message["settings"]) if message.get("settings") else {}
    return session
