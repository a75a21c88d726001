"""One request and everything it carries: its prompt, its tokens, its cache, its state and timings."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from enum import StrEnum

from .config import SamplingParams
from .metrics import RequestMetrics, request_metrics


class Status(StrEnum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    STOPPED = "stopped"  # cancelled by the user
    FAILED = "failed"


@dataclass(eq=False)
class Request:
    request_id: str
    messages: list[dict]
    sampling: SamplingParams
    prompt_ids: list[int]
    max_new_tokens: int  # sampling.max_new_tokens, clipped to the context window
    submit_ns: int  # when the request was handed to the engine (before templating)
    tokenized_ns: int
    prefill_chunk: int = 0  # prompt tokens per prefill pass; 0 = the whole prompt in one pass
    status: Status = Status.WAITING
    generated_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the pool (prefix caching)
    num_prefill_chunks: int = 0
    # time the engine spent on a named call (Engine.call: the Lab's, a precision check's) while this request was
    # active: it waited that long, within its TTFT or between two of its tokens
    held_ms: dict[str, float] = field(default_factory=dict)
    held_unsaid_ms: float = 0.0  # of held_ms, what no token has carried yet: the next DecodeStep's held_ms
    started_ns: int | None = None  # left the queue
    prefill_ns: int = 0  # time inside prefill forward passes
    prefill_end_ns: int | None = None
    token_ns: list[int] = field(default_factory=list)  # when each generated token became available
    text: str = ""  # the reply's text released so far
    finish_reason: str | None = None
    kv_cache: object | None = None  # SequenceKV (or DynamicKVCache) while running
    subscribers: list = field(default_factory=list, repr=False)  # hooks this request's events go to
    hook_error: Exception | None = None  # the first exception a hook raised (it cancels the request)
    text_stream: object | None = field(default=None, repr=False)  # TextStream while decoding
    generator: object | None = field(default=None, repr=False)  # torch.Generator for sampling
    seen_tokens: object | None = field(default=None, repr=False)  # sampling.SeenTokens, for a repetition penalty
    # decode steps it may still take (step by step, explain mode); None: as many as it needs
    decode_allowance: int | None = None
    # explain mode: its decode steps report their attention weights, its forwards their time per stage
    explain: bool = False
    time_stages: bool = False  # its forwards report their time per stage, without the weights (a benchmark's)
    attention: object | None = field(default=None, repr=False)  # explain mode: the last decode step's weights
    stage_ms: dict | None = None  # the last forward's time per stage (reports_stages), until an event takes it
    # speculative decoding: how many tokens to draft next, and what drafting did so far
    draft_length: object | None = field(default=None, repr=False)  # speculative.DraftLength
    num_drafted: int = 0
    num_accepted: int = 0
    num_decode_forwards: int = 0  # decode forwards this request took part in
    num_decode_tokens: int = 0  # tokens those forwards gave it
    kv_limit: int | None = None  # a sliding window's cache size in tokens (the cache stops growing there)
    cancel_error: str | None = None  # why the engine itself ended it (a limit), else None: a user's cancel
    _cancelled: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def reports_stages(self) -> bool:
        return self.explain or self.time_stages

    def take_stage_ms(self) -> dict | None:
        """The last forward's time per stage (reports_stages), for the event that reports it; then None."""
        stage_ms, self.stage_ms = self.stage_ms, None
        return stage_ms

    def cancel(self, error: str | None = None) -> None:
        """Ask the engine to stop; safe from any thread, takes effect within one step. With an error (a
        limit reached) the request ends as failed, with that message, its text so far kept."""
        if error is not None and not self._cancelled.is_set():
            self.cancel_error = error
        self._cancelled.set()

    @property
    def may_decode(self) -> bool:
        """Not held: free to decode, or allowed more steps (Engine.allow)."""
        allowance = self.decode_allowance
        return allowance is None or allowance > 0

    @property
    def is_cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def is_finished(self) -> bool:
        return self.status in (Status.FINISHED, Status.STOPPED, Status.FAILED)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_kv_tokens(self) -> int:
        """Positions the request needs in the KV cache: the prompt and every token fed back (the last
        generated token never is)."""
        needed = self.num_prompt_tokens + self.max_new_tokens - 1
        if self.kv_limit is not None:  # a sliding window: the prompt whole, then as much as the window keeps
            return min(needed, max(self.num_prompt_tokens + 1, self.kv_limit))
        return needed

    @property
    def num_generated(self) -> int:
        return len(self.generated_ids)

    @property
    def ttft_ms(self) -> float | None:
        return (self.token_ns[0] - self.submit_ns) / 1e6 if self.token_ns else None

    def metrics(self, end_ns: int) -> RequestMetrics:
        cache = self.kv_cache
        return request_metrics(
            submit_ns=self.submit_ns,
            token_ns=self.token_ns,
            end_ns=end_ns,
            prefill_ms=self.prefill_ns / 1e6,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            kv_tokens=cache.num_tokens if cache is not None else 0,
            kv_bytes=cache.bytes_used if cache is not None else 0,
        )
