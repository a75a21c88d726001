"""What the page is sent while a reply streams: only what is new since the last update.

A streaming reply's messages go to static/phasescope.js through a route of the app's own (Streams:
GET phasescope/live/<reply id>, one JSON message per line); whole figures drawn at other moments (a
reply's end, a new chat, a chat opened from the history) through one hidden textbox, #ps-stream. The
script applies them in place. A message is a JSON object with any of:
  reply   an id for the reply the text belongs to (a new id starts a new text)
  text    the reply's text since the previous message
  reset   whole figures, {"latency": spec, "kv": spec}: drawn anew (start and end of a reply, a new
          chat, a chat opened from the history, and whenever a figure gains a trace)
  append  new points, {"latency" | "kv": {"trace": index, "points": {attribute: [values]}, "mode": ...}}:
          added to that trace (Plotly.animate while they fit the axes as drawn, else Plotly.extendTraces)
  panels  the live panel's HTML pieces that changed, {element id: html} (phase, tiles, time split, pool):
          set in place of what Gradio drew there last
  chat    the chat's key in the history (Store.session_key; null: none yet): kept for the browser tab, so
          that a reload shows the chat again (app/ui/history_tab.py, restore)
  seq     a counter, so that every message differs from the last (the page reacts to changes)
"""
from __future__ import annotations

import asyncio
import itertools
import json
import threading
from collections.abc import AsyncIterator, Callable, Sequence

from engine import Event

from ..i18n import DEFAULT
from . import charts
from .trace import ReplyTrace

_seq = itertools.count(1)


def message(**fields) -> str:
    return json.dumps({**fields, "seq": next(_seq)}, separators=(",", ":"))


def _figures(latency_events: Sequence[Event], turns: Sequence[Sequence[Event]], lang: str,
             streaming: bool = False) -> dict:
    return {"latency": charts.latency_figure(latency_events, lang, tpot_line=not streaming),
            "kv": charts.kv_figure(turns, lang)}


def reset(latency_events: Sequence[Event], turns: Sequence[Sequence[Event]], reply: str | None = None,
          lang: str = DEFAULT, **fields) -> str:
    """Both figures whole: the latency of one reply and the KV cache over every turn of the chat; fields: more
    of the message's (chat)."""
    return message(reply=reply, reset=_figures(latency_events, turns, lang), **fields)


class LiveReply:
    """The messages for one streaming reply: whole figures when their shape changes (the prompt was
    read, the first token came), then each update's new text and new points only."""

    def __init__(self, reply_id: str, traces: Sequence[ReplyTrace], lang: str = DEFAULT,
                 chat: str | None = None) -> None:
        self.reply_id, self.lang, self.chat = reply_id, lang, chat  # chat: its key in the history, once saved
        self.traces = traces  # the chat's replies, the streaming one last
        self._shape: tuple | None = None
        self._sent_steps = 0
        # where this turn's traces begin in the KV figure: the earlier turns are done, so once
        self._kv_index, self._kv_x0 = charts.kv_turn_position([t.events for t in traces[:-1]])
        self._panels: dict[str, str] = {}  # the panel pieces last sent

    def _changed(self, panels: dict[str, str]) -> dict[str, str]:
        changed = {key: html for key, html in panels.items() if self._panels.get(key) != html}
        self._panels.update(changed)
        return changed

    @property
    def trace(self) -> ReplyTrace:
        return self.traces[-1]

    def update(self, panels: dict[str, str] | None = None) -> str:
        """What is new since the last update; panels: the live panel's pieces now ({element id: html}),
        of which the changed ones are sent."""
        fields = {"reply": self.reply_id}
        if panels and (changed := self._changed(panels)):
            fields["panels"] = changed
        trace = self.trace
        steps = list(trace.steps)
        new, first = steps[self._sent_steps:], self._sent_steps
        self._sent_steps = len(steps)
        text = "".join(s.text for s in new)
        shape = (trace.started is not None, len(trace.chunks), bool(steps))
        if shape != self._shape:  # a new trace or bar: the whole figures, still small at this point
            self._shape = shape
            return message(**fields, text=text, chat=self.chat,
                           reset=_figures(trace.events, [t.events for t in self.traces], self.lang,
                                          streaming=True))
        if not new:
            return message(**fields)
        append = {"latency": {"trace": charts.DECODE_TRACE, "points": charts.decode_points(new, self.lang),
                              "mode": charts.point_mode(len(steps))}}
        if trace.cache_visible:
            append["kv"] = self._kv_append(new, first, len(steps))
        return message(**fields, text=text, append=append)

    def _kv_append(self, new, first: int, num_steps: int) -> dict:
        """The new steps as points of this turn's trace in the KV figure (see charts.kv_figure)."""
        trace = self.trace
        points = charts.kv_step_points(new, self._kv_x0 + 1 + len(trace.chunks) + first, self.lang)
        return {"trace": self._kv_index + (1 if trace.num_cached_tokens else 0), "points": points,
                "mode": charts.point_mode(1 + len(trace.chunks) + num_steps)}


class _Reply:
    """One streaming reply's messages so far (None ends them), and the pages following it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.messages: list[str | None] = []
        self.followers: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = []
        self.on_abandoned: Callable[[], None] | None = None

    def add(self, message: str | None) -> None:
        with self.lock:
            self.messages.append(message)
            for loop, inbox in self.followers:
                loop.call_soon_threadsafe(inbox.put_nowait, message)

    def follow(self) -> tuple[list[str | None], asyncio.Queue]:
        with self.lock:
            inbox: asyncio.Queue = asyncio.Queue()
            self.followers.append((asyncio.get_running_loop(), inbox))
            return list(self.messages), inbox


class Streams:
    """The replies now streaming, by reply id: the chat tab publishes each one's messages from the thread
    that runs it, and the page reads them from GET <app>/phasescope/live/<reply id> as they come, one
    message per line. Not through a Gradio event: each Gradio update cost the page 7-15 ms of its
    client's work (the loading state of every component, a structured clone of the update), four times a
    second, on the cores decode uses. A reply id is its chat's random id (128 bits) and its turn
    (ChatSession): the route asks no login (under --auth too), only the page that sent the message
    knows the id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._replies: dict[str, _Reply] = {}

    def open(self, reply_id: str) -> None:
        with self._lock:
            self._replies[reply_id] = _Reply()

    def _get(self, reply_id: str) -> _Reply | None:
        with self._lock:
            return self._replies.get(reply_id)

    def on_abandoned(self, reply_id: str, callback: Callable[[], None]) -> None:
        """callback() when the page following the reply goes away before it ends (stop generating)."""
        reply = self._get(reply_id)
        if reply:
            reply.on_abandoned = callback

    def publish(self, reply_id: str, message: str) -> None:
        reply = self._get(reply_id)
        if reply:
            reply.add(message)

    def close(self, reply_id: str) -> None:
        with self._lock:
            reply = self._replies.pop(reply_id, None)
        if reply:
            reply.add(None)

    def is_open(self, reply_id: str) -> bool:
        return self._get(reply_id) is not None

    async def follow(self, reply_id: str) -> AsyncIterator[str]:
        """The reply's messages, those already sent first, each on its own line, until it ends."""
        reply = self._get(reply_id)
        if reply is None:
            return
        sent, inbox = reply.follow()
        ended = False
        try:
            for message in sent:
                if message is None:
                    ended = True
                    return
                yield message + "\n"
            while (message := await inbox.get()) is not None:
                yield message + "\n"
            ended = True
        finally:
            if not ended and reply.on_abandoned:  # the page went away (closed, reloaded) mid-reply
                reply.on_abandoned()

    def add_route(self, app, prefix: str = "") -> None:
        """GET {prefix}/phasescope/live/{reply_id} on a FastAPI app (the Gradio app's, or the one it is
        mounted in, with the mount's path as prefix: the page asks relative to its own address)."""
        from fastapi.responses import Response, StreamingResponse

        async def live(reply_id: str):
            if not self.is_open(reply_id):  # ended already: the page gets the whole reply from Gradio
                return Response(status_code=404)
            return StreamingResponse(self.follow(reply_id), media_type="application/x-ndjson",
                                     headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

        app.add_api_route(f"{prefix}/phasescope/live/{{reply_id}}", live, methods=["GET"])
