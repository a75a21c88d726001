"""What runs in the next step: continuous batching with chunked prefill (Orca, vLLM, Sarathi-Serve).

Each step the scheduler takes, within a budget of tokens:
  1. one decode token for every running request that has its first token (they form one batch);
  2. the next prefill chunk of each request still reading its prompt;
  3. waiting requests, first come first served, while the batch has room and the KV pool has blocks
     for them (their cached prompt prefix is taken from the pool on the way in).
Requests join and leave between steps. A cancelled request leaves at the next step. The engine runs
the plan (engine.py); the scheduler only chooses and keeps the queues. Requests may be added from any
thread; everything else runs on the thread that steps.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from .request import Request, Status


@dataclass
class StepPlan:
    cancelled: list[Request] = field(default_factory=list)  # to end without running
    admitted: list[Request] = field(default_factory=list)  # left the queue this step
    decodes: list[Request] = field(default_factory=list)  # one token each, one batch
    prefills: list[tuple[Request, int, int]] = field(default_factory=list)  # (request, start, end)

    @property
    def is_empty(self) -> bool:
        return not (self.cancelled or self.admitted or self.decodes or self.prefills)


class Scheduler:
    def __init__(self, pool, max_running: int, max_step_tokens: int) -> None:
        self.pool = pool  # KVPool, or hf_runner.DynamicPool
        self.max_running, self.max_step_tokens = max_running, max_step_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._inbox: list[Request] = []
        self._lock = threading.Lock()  # guards the inbox and the queue views read from other threads

    def add(self, request: Request) -> None:
        """Queue a request (from any thread); it is taken in at the next step."""
        with self._lock:
            self._inbox.append(request)

    def place_in_line(self, request: Request) -> int | None:
        """0 for the next request to be admitted; None once it runs (or if unknown)."""
        with self._lock:
            queue = [*self.waiting, *self._inbox]
        return queue.index(request) if request in queue else None

    def active(self) -> list[Request]:
        """Every request not yet finished: running, waiting, just added."""
        with self._lock:
            return [*self.running, *self.waiting, *self._inbox]

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        with self._lock:
            return len(self.running), len(self.waiting) + len(self._inbox)

    def take_cancelled(self) -> list[Request]:
        """The requests cancelled since the last step, out of the running and waiting ones: to end."""
        with self._lock:
            self.waiting.extend(self._inbox)
            self._inbox.clear()
            cancelled = [r for queue in (self.running, self.waiting) for r in queue if r.is_cancelled]
            self.running = [r for r in self.running if not r.is_cancelled]
            self.waiting = deque(r for r in self.waiting if not r.is_cancelled)
        return cancelled

    def schedule(self) -> StepPlan:
        plan = StepPlan(cancelled=self.take_cancelled())
        budget = self.max_step_tokens
        plan.decodes = [r for r in self.running if r.status == Status.DECODING and r.may_decode]
        budget -= len(plan.decodes)
        for request in self.running:
            if request.status == Status.PREFILLING and budget > 0:
                budget -= self._plan_chunk(plan, request, budget)
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            request = self.waiting[0]
            sequence = self.pool.allocate(request.prompt_ids, request.num_kv_tokens,
                                          reuse=not request.sampling.prompt_logprobs)
            if sequence is None:
                break  # no room in the pool now: it waits for running requests to finish
            with self._lock:
                self.waiting.popleft()
                self.running.append(request)
            request.kv_cache = sequence
            request.num_cached_tokens = sequence.num_tokens
            request.status = Status.PREFILLING
            plan.admitted.append(request)
            budget -= self._plan_chunk(plan, request, budget)
        return plan

    @staticmethod
    def _plan_chunk(plan: StepPlan, request: Request, budget: int) -> int:
        start = request.kv_cache.num_tokens  # the prompt positions cached or prefilled so far
        size = min(request.prefill_chunk or request.num_prompt_tokens, budget)
        end = min(start + size, request.num_prompt_tokens)
        plan.prefills.append((request, start, end))
        return end - start

    def finish(self, request: Request) -> None:
        """Take a finished request out and give its blocks back to the pool."""
        with self._lock:
            if request in self.running:
                self.running.remove(request)
            if request in self.waiting:
                self.waiting.remove(request)
        if request.kv_cache is not None:  # with its tokens: the pool may keep its part-filled last block
            self.pool.free(request.kv_cache, request.prompt_ids + request.generated_ids)
