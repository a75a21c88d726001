"""What the UI keeps of a reply: the engine's events, grouped, and the figures derived from them.

A ReplyTrace is filled by a hook on the engine's thread and read by the UI's thread; it only ever
appends, so a reader sees a consistent prefix.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine import DecodeStep, Event, Finished, FirstToken, PrefillChunk, RequestMetrics, Started
from engine.metrics import request_metrics


def summary_metrics(points: Sequence[PrefillChunk | DecodeStep], num_prompt_tokens: int,
                    num_cached_tokens: int = 0) -> RequestMetrics:
    """The engine's definitions (engine/metrics.py) over a reply's prefill chunks and decode steps,
    in order, timed from the request's submission: for a reply still running, or one read back."""
    chunks = [p for p in points if isinstance(p, PrefillChunk)]
    steps = [p for p in points if isinstance(p, DecodeStep)]
    last = points[-1] if points else None
    return request_metrics(submit_ns=0, token_ns=[round(s.t_ms * 1e6) for s in steps],
                           end_ns=round(last.t_ms * 1e6) if last else 0,
                           prefill_ms=sum(c.latency_ms for c in chunks), num_prompt_tokens=num_prompt_tokens,
                           num_cached_tokens=num_cached_tokens, kv_tokens=last.kv_tokens if last else 0,
                           kv_bytes=last.kv_bytes if last else 0)


def cache_visible(started: Started | None) -> bool:
    """Whether a reply's KV cache can be shown here: the engine's can; a remote endpoint's server keeps its
    own out of sight (its replies' Started names no capacity, and their steps no sizes)."""
    return started is None or started.kv_capacity_tokens > 0


HELD_SAID_MS = 100  # a wait for a measurement this long or longer is said (see held_seconds)


def held_seconds(held_ms: dict | float | None) -> float:
    """How long a reply (Finished.held_ms, by name) or a token (DecodeStep.held_ms) waited for measurements
    that held the engine, in seconds, where it is worth saying: 0.0 below HELD_SAID_MS (a reply sent as a
    Lab run ended waited a few ms)."""
    total_ms = sum(held_ms.values()) if isinstance(held_ms, dict) else held_ms or 0.0
    return total_ms / 1000 if total_ms >= HELD_SAID_MS else 0.0


@dataclass
class ReplyTrace:
    turn: int
    started: Started | None = None
    chunks: list[PrefillChunk] = field(default_factory=list)
    first: FirstToken | None = None
    steps: list[DecodeStep] = field(default_factory=list)
    finished: Finished | None = None

    def add(self, event: Event) -> None:
        if isinstance(event, PrefillChunk):
            self.chunks.append(event)
        elif isinstance(event, DecodeStep):
            self.steps.append(event)
        elif isinstance(event, Started):
            self.started = event
        elif isinstance(event, FirstToken):
            self.first = event
        elif isinstance(event, Finished):
            self.finished = event
            m = event.metrics
            if self.started is not None and not self.started.num_prompt_tokens and m.num_prompt_tokens:
                # a remote server's prompt size is known only from its usage, at the end
                self.started = dataclasses.replace(self.started, num_prompt_tokens=m.num_prompt_tokens,
                                                   num_cached_tokens=m.num_cached_tokens)

    @property
    def events(self) -> list[Event]:
        head = [e for e in (self.started,) if e is not None]
        middle = [e for e in (self.first,) if e is not None]
        tail = [e for e in (self.finished,) if e is not None]
        return [*head, *self.chunks, *middle, *self.steps, *tail]

    @property
    def text(self) -> str:
        return self.finished.text if self.finished else "".join(s.text for s in list(self.steps))

    @property
    def token_ids(self) -> list[int]:
        return [s.token_id for s in list(self.steps)]

    @property
    def phase(self) -> str:
        if self.finished:
            return "stopped" if self.finished.reason == "cancelled" else (
                "error" if self.finished.reason == "error" else "done")
        if self.steps:
            return "decode"
        return "prefill" if self.started else "queued"

    @property
    def failed(self) -> bool:
        """Whether the reply ended in an error: then it is shown, but not part of the conversation the
        model sees next."""
        return self.finished is not None and self.finished.reason == "error"

    @property
    def num_prompt_tokens(self) -> int:
        return self.started.num_prompt_tokens if self.started else 0

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens whose K/V the engine took from its pool instead of prefilling them."""
        return self.started.num_cached_tokens if self.started else 0

    @property
    def cache_visible(self) -> bool:
        return cache_visible(self.started)

    @property
    def kv(self) -> tuple[int, int]:
        """(tokens, bytes) held by the KV cache after the latest step."""
        latest = self.steps[-1] if self.steps else (self.chunks[-1] if self.chunks else None)
        return (latest.kv_tokens, latest.kv_bytes) if latest else (0, 0)

    def metrics(self) -> RequestMetrics:
        """The engine's own summary once finished; the same definitions on the events so far before."""
        if self.finished:
            return self.finished.metrics
        chunks = list(self.chunks)
        prompt = self.num_prompt_tokens or sum(c.num_tokens for c in chunks)
        return summary_metrics([*chunks, *list(self.steps)], prompt, self.num_cached_tokens)
