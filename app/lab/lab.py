"""What every experiment uses: the engine it measures, its size (quick or full), progress and stop, and
the runs it makes, greedy and through the engine's events."""
from __future__ import annotations

import statistics
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine import SWITCHES, DecodeStep, EngineConfig, Event, Finished, Request, SamplingParams

if TYPE_CHECKING:
    from engine import Engine


# Each experiment's settings start from the engine's default switches, however the app was started: under
# `phasescope ui --no-kv-cache` the kv-cache experiment's "KV cache" side ran without one, and under
# --kv-window the speculative one could not start. The weights' precision, the device, tensor parallelism,
# the draft length, compilation, the threads' binding and the pool's size stay the engine's.
BASELINE = {name: getattr(EngineConfig(), name) for name in SWITCHES
            if name not in ("draft_tokens", "tensor_parallel", "compile_decode", "bind_threads")}


class LabStopped(Exception):
    """The run was stopped (the Stop button) between two of its measurements."""


@dataclass
class Lab:
    engine: Engine
    quick: bool = False
    progress: Callable[[str | list], None] | None = None  # given said(...): put in a language by words()
    stop: threading.Event | None = None

    def step(self, text: str | list) -> None:
        """Between two measurements: stop here if asked to, else say what comes next (said(...)). The chats
        waiting for the run that were stopped meanwhile end here (the run holds the engine's thread)."""
        self.engine.finish_cancelled()
        if self.stop is not None and self.stop.is_set():
            raise LabStopped("stopped")
        if self.progress is not None:
            self.progress(text)

    def variant(self, **changes) -> Engine:
        """The engine under an experiment's settings, from BASELINE (Engine.variant: the same weights)."""
        return self.engine.variant(**{**BASELINE, **changes})

    def size(self, quick, full):
        return quick if self.quick else full

    def encode(self, text: str) -> list[int]:
        """The text's tokens, as plain text (no chat template)."""
        return self.engine.tokenizer(text.strip() or "Hello", add_special_tokens=False)["input_ids"]

    def tokens(self, text: str, count: int) -> list[int]:
        """The text's tokens, repeated until there are `count` (a prompt of a chosen length from any text)."""
        ids = self.encode(text)
        return (ids * (count // len(ids) + 1))[:count]

    def request(self, engine: Engine, prompt: list[int] | list[dict] | str, max_new_tokens: int,
                **options) -> Request:
        """A greedy request: for token ids exactly max_new_tokens (as a benchmark); for a chat's messages or
        a text (a one-message chat) at most that many, ending where the model ends its reply."""
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        is_chat = bool(prompt) and isinstance(prompt[0], dict)
        sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=not is_chat)
        if is_chat:
            return engine.new_request(prompt, sampling, **options)
        return engine.new_request_from_ids(prompt, sampling, **options)

    def run(self, engine: Engine, prompt: list[int] | list[dict] | str, max_new_tokens: int, explain: bool = False,
            time_stages: bool = False, **options) -> tuple[Request, list[Event]]:
        """One request to the end: the request (its tokens) and its events. explain: with attention
        weights and time per stage; time_stages: the time per stage alone."""
        request = self.request(engine, prompt, max_new_tokens, **options)
        request.explain, request.time_stages = explain, time_stages
        events = list(engine.run(request))
        if isinstance(events[-1], Finished) and events[-1].error:  # said as it is, not as a figure of nothing
            raise RuntimeError(events[-1].error)
        return request, events


def decode_steps(events: list[Event]) -> list[DecodeStep]:
    """The decode steps that ran a forward of their own (step 0 samples from the prefill's logits)."""
    return [e for e in events if isinstance(e, DecodeStep) and e.step > 0]


def median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else 0.0


def r(value: float, digits: int = 1) -> float:
    return round(float(value), digits)
