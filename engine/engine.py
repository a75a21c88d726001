"""The engine: one request runs as prefill chunks, then one decode step per new token.

    prefill(request, start, end)  one forward pass over prompt tokens [start, end)
    decode_step(request)          one forward pass over exactly one new token
    run(request)                  orchestrates them and yields an event after each

Every event also goes to the subscribed hooks, in order, before it is yielded.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property

import torch

from .config import EngineConfig, SamplingParams
from .events import DecodeStep, Event, Finished, FirstToken, Hook, PrefillChunk, Started, TopToken
from .hf_runner import make_runner
from .kv_cache import kv_bytes_formula, round_up
from .loader import LoadedModel, load_model
from .request import Request, Status
from .sampling import make_generator, sample, top_logits
from .text import TextStream

ROLES = ("system", "user", "assistant")


class PromptTooLong(ValueError):
    def __init__(self, num_tokens: int, limit: int) -> None:
        super().__init__(f"the conversation is {num_tokens:,} tokens, but the model's context window "
                         f"is {limit:,} tokens: start a new chat or shorten the message")
        self.num_tokens, self.limit = num_tokens, limit


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    source: str
    device: str
    dtype: str
    model_path: str  # which forward runs: "lean-llama" or "transformers"
    decode_path: str  # how a decode step runs: "fused C++" (one native call) or "PyTorch ops"
    precision: str  # fp32, fp16, bf16 or int8
    num_layers: int
    num_kv_heads: int
    head_dim: int
    context_window: int
    kv_bytes_per_token: int  # by the formula


def _eos_ids(loaded: LoadedModel) -> frozenset[int]:
    ids = set()
    configured = getattr(loaded.model.generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    ids.add(loaded.tokenizer.eos_token_id)
    return frozenset(i for i in ids if i is not None)


def check_messages(messages: list[dict]) -> None:
    if not messages:
        raise ValueError("the conversation is empty")
    for message in messages:
        if message.get("role") not in ROLES or not isinstance(message.get("content"), str):
            raise ValueError(f"each message needs a role ({', '.join(ROLES)}) and text content")
    if messages[-1]["role"] != "user" or not messages[-1]["content"].strip():
        raise ValueError("the message is empty")


def render_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """The whole conversation through the tokenizer's chat template, as token ids."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"]


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None, runner=None) -> None:
        self.loaded = loaded
        self.config = config or EngineConfig()
        self.tokenizer = loaded.tokenizer
        self.runner = runner or make_runner(loaded.model, self.config.precision, cache_dir=self.config.cache_dir)
        self.eos_ids = _eos_ids(loaded)
        self._lock = threading.Lock()  # one request runs at a time; others wait (queue time)
        self._hooks: list[Hook] = []
        self._ids = itertools.count(1)

    @classmethod
    def from_config(cls, config: EngineConfig | None = None) -> Engine:
        config = config or EngineConfig()
        return cls(load_model(config.model, config.device, config.load_dtype, config.cache_dir), config)

    @property
    def context_window(self) -> int:
        return self.runner.context_window

    @cached_property
    def info(self) -> ModelInfo:
        """What runs: the model, device, precision, and its KV-cache sizes (computed once)."""
        config = self.loaded.model.config
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        element = torch.tensor([], dtype=self.loaded.dtype).element_size()
        return ModelInfo(self.loaded.name, self.loaded.source, str(self.loaded.device),
                         str(self.loaded.dtype).removeprefix("torch."), self.runner.name,
                         getattr(self.runner, "decode_path", "PyTorch ops"), self.runner.precision,
                         config.num_hidden_layers, kv_heads, head_dim, self.context_window,
                         kv_bytes_formula(config.num_hidden_layers, kv_heads, head_dim, element, 1))

    @contextmanager
    def hooks(self, *hooks: Hook) -> Iterator[None]:
        """Subscribe hooks to every request run inside the block; the previous set comes back after."""
        previous = self._hooks
        self._hooks = [*previous, *hooks]
        try:
            yield
        finally:
            self._hooks = previous

    def _now_ns(self) -> int:
        if self.loaded.device.type == "cuda":
            torch.cuda.synchronize()  # time what the GPU has done, not what was queued
        return time.perf_counter_ns()

    # --- requests -------------------------------------------------------------------------------

    def new_request(self, messages: list[dict], sampling: SamplingParams | None = None,
                    prefill_chunk: int | None = None) -> Request:
        """Template and tokenize a conversation; raises ValueError for empty or too long input.
        prefill_chunk overrides the engine's chunk size for this request (0: the whole prompt)."""
        submit_ns = self._now_ns()
        check_messages(messages)
        return self.new_request_from_ids(render_prompt(self.tokenizer, messages), sampling, prefill_chunk,
                                         messages=messages, submit_ns=submit_ns)

    def new_request_from_ids(self, prompt_ids: list[int], sampling: SamplingParams | None = None,
                             prefill_chunk: int | None = None, messages: list[dict] | None = None,
                             submit_ns: int | None = None) -> Request:
        """A request for raw prompt token ids (benchmarks, completions); no chat template."""
        submit_ns = self._now_ns() if submit_ns is None else submit_ns
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.context_window:
            raise PromptTooLong(len(prompt_ids), self.context_window)
        sampling = sampling or SamplingParams()
        # n new tokens need n - 1 positions after the prompt (the last one is never fed back)
        max_new = min(sampling.max_new_tokens, self.context_window - len(prompt_ids) + 1)
        chunk = self.config.prefill_chunk if prefill_chunk is None else prefill_chunk
        if chunk < 0:
            raise ValueError(f"prefill_chunk must be an integer >= 0 (0 = whole prompt), got {chunk!r}")
        return Request(f"req-{next(self._ids)}", list(messages or []), sampling, list(prompt_ids), max_new,
                       submit_ns=submit_ns, tokenized_ns=self._now_ns(), prefill_chunk=chunk)

    def stream(self, messages: list[dict], sampling: SamplingParams | None = None,
               hooks: Iterable[Hook] = ()) -> Iterator[Event]:
        """Run a conversation and yield its events as they happen."""
        return self.run(self.new_request(messages, sampling), hooks)

    def generate(self, messages: list[dict], sampling: SamplingParams | None = None,
                 hooks: Iterable[Hook] = ()) -> Finished:
        """Run a conversation to the end and return its Finished event."""
        *_, finished = self.stream(messages, sampling, hooks)
        return finished

    # --- the two phases ---------------------------------------------------------------------------

    def prefill(self, request: Request, start: int, end: int) -> torch.Tensor | None:
        """One forward pass over prompt tokens [start, end), writing their K/V into the cache.
        Returns the logits of the last prompt token when the chunk ends the prompt."""
        assert start == request.kv_cache.num_tokens, "prefill chunks run in order"
        ids = torch.tensor(request.prompt_ids[start:end], device=self.runner.device)
        return self.runner.forward(ids, start, request.kv_cache, need_logits=end == request.num_prompt_tokens)

    def decode_step(self, request: Request) -> torch.Tensor:
        """One forward pass over exactly one new token (the last generated), returning next logits."""
        pos = request.kv_cache.num_tokens
        assert pos == request.num_prompt_tokens + request.num_generated - 1, "decode runs one new token"
        ids = torch.tensor(request.generated_ids[-1:], device=self.runner.device)
        return self.runner.forward(ids, pos, request.kv_cache)

    # --- orchestration ----------------------------------------------------------------------------

    def run(self, request: Request, hooks: Iterable[Hook] = ()) -> Iterator[Event]:
        """Run a request, yielding Started, PrefillChunk..., FirstToken, DecodeStep..., Finished.
        Closing the iterator early cancels the request (hooks still get its Finished event)."""
        subscribers = [*self._hooks, *hooks]
        with self._lock:
            request.started_ns = self._now_ns()
            events = self._events(request)
            try:
                for event in events:
                    for hook in subscribers:
                        hook(event)
                    yield event
            finally:
                events.close()
                if not request.is_finished:  # the consumer stopped reading, or a hook raised
                    finished = self._finish(request, "cancelled")
                    for hook in subscribers:
                        hook(finished)
                request.kv_cache = None  # free the memory; the metrics already hold its size

    def _events(self, r: Request) -> Iterator[Event]:
        try:
            yield from self._run_phases(r)
        except Exception as exc:  # a failed forward ends this request, not the engine
            yield self._finish(r, "error", error=f"{type(exc).__name__}: {exc}")

    def _run_phases(self, r: Request) -> Iterator[Event]:
        capacity = min(round_up(r.num_prompt_tokens + r.max_new_tokens, self.config.kv_block_tokens),
                       self.context_window)
        r.kv_cache = cache = self.runner.new_cache(capacity)
        yield Started(r.request_id, self._t_ms(r, r.started_ns), r.num_prompt_tokens, r.max_new_tokens,
                      cache.capacity_tokens, cache.bytes_allocated, self.runner.name)
        r.status = Status.PREFILLING
        logits = None
        chunk = r.prefill_chunk or r.num_prompt_tokens
        for index, start in enumerate(range(r.num_cached_tokens, r.num_prompt_tokens, chunk)):
            if r.is_cancelled:
                yield self._finish(r, "cancelled")
                return
            end = min(start + chunk, r.num_prompt_tokens)
            begin_ns = self._now_ns()
            logits = self.prefill(r, start, end)
            r.prefill_end_ns = self._now_ns()
            r.prefill_ns += r.prefill_end_ns - begin_ns
            yield PrefillChunk(r.request_id, self._t_ms(r, r.prefill_end_ns), index, start, end,
                               r.num_prompt_tokens, (r.prefill_end_ns - begin_ns) / 1e6,
                               cache.num_tokens, cache.bytes_used)
        yield from self._decode_loop(r, logits)

    def _decode_loop(self, r: Request, logits: torch.Tensor) -> Iterator[Event]:
        r.status = Status.DECODING
        text = TextStream(self.tokenizer, r.sampling.stop)
        generator = make_generator(r.sampling.seed)
        penalize = r.sampling.repetition_penalty != 1.0
        top_fn = getattr(self.runner, "top_logits", top_logits)  # a runner may bring a native one
        previous_ns = r.submit_ns  # so the first token's latency is its TTFT
        reason = "length"
        for step in range(r.max_new_tokens):
            if step > 0:
                if r.is_cancelled:
                    reason = "cancelled"
                    break
                logits = self.decode_step(r)
            picked = sample(logits, r.sampling, generator, r.prompt_ids + r.generated_ids if penalize else (),
                            top_fn=top_fn)
            now_ns = self._now_ns()
            r.generated_ids.append(picked.token_id)
            r.token_ns.append(now_ns)
            if step == 0:
                yield self._first_token(r, now_ns)
            is_eos = picked.token_id in self.eos_ids and not r.sampling.ignore_eos
            piece = "" if is_eos else text.push(picked.token_id)
            r.text = text.text
            yield self._decode_event(r, step, picked, piece, now_ns, previous_ns)
            previous_ns = now_ns
            if is_eos or text.is_stopped:
                reason = "eos" if is_eos else "stop"
                break
        text.flush()
        r.text = text.text
        yield self._finish(r, reason)

    # --- events -----------------------------------------------------------------------------------

    @staticmethod
    def _t_ms(r: Request, ns: int) -> float:
        return (ns - r.submit_ns) / 1e6

    def _first_token(self, r: Request, now_ns: int) -> FirstToken:
        prefill_wall_ns = r.prefill_end_ns - r.started_ns
        return FirstToken(r.request_id, self._t_ms(r, now_ns), ttft_ms=(now_ns - r.submit_ns) / 1e6,
                          tokenize_ms=(r.tokenized_ns - r.submit_ns) / 1e6,
                          queue_ms=(r.started_ns - r.tokenized_ns) / 1e6,
                          setup_ms=(prefill_wall_ns - r.prefill_ns) / 1e6,
                          prefill_ms=r.prefill_ns / 1e6,
                          first_sample_ms=(now_ns - r.prefill_end_ns) / 1e6)

    def _decode_event(self, r: Request, step: int, picked, piece: str, now_ns: int, previous_ns: int) -> DecodeStep:
        decode = self.tokenizer.convert_ids_to_tokens
        top = tuple(TopToken(i, decode(i), p) for i, p in zip(picked.top_ids, picked.top_probs))
        return DecodeStep(r.request_id, self._t_ms(r, now_ns), step, picked.token_id, piece,
                          (now_ns - previous_ns) / 1e6, r.kv_cache.num_tokens, r.kv_cache.bytes_used,
                          picked.prob, top)

    def _finish(self, r: Request, reason: str, error: str | None = None) -> Finished:
        end_ns = self._now_ns()
        r.finish_reason = reason
        r.status = {"cancelled": Status.STOPPED, "error": Status.FAILED}.get(reason, Status.FINISHED)
        return Finished(r.request_id, self._t_ms(r, end_ns), reason, r.text, r.metrics(end_ns), error)
