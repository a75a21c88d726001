"""The engine: requests run as prefill chunks, then one decode step per new token, many at a time.

    prefill(request, start, end)  one forward pass over prompt tokens [start, end) of one request
    decode_step(requests)         one forward pass over exactly one new token of each running request
    step()                        schedule -> run those -> postprocess (sample, events, finish)
    submit(request) / run(request) queue a request; run also yields its events as they happen

Each request's events go to its subscribers (hooks), in order: Started, PrefillChunk..., FirstToken,
DecodeStep..., Finished. `serve_forever()` steps on a dedicated thread (the app); without it, `run()`
steps on the caller's thread until its request is done (the CLI, tests, benchmarks).
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from typing import TypeVar

import torch

from .config import DRAFT_PREFIX, EngineConfig, SamplingParams
from .errors import EngineBusy, QueueFull
from .events import (DecodeStep, Event, Finished, FirstToken, Hook, PrefillChunk, PromptToken, Speculation, Started,
                     TopToken)
from .info import ModelInfo, PoolUsage
from .kernels.fused import start_early
from .kv_pool import blocks_for, kv_bytes_formula
from .models.hf_runner import TransformersRunner, in_dtype, make_runner
from .models.llama import matrix_numbers
from .models.loader import LoadedModel, cache_root, load_model
from .prompt import PromptTooLong, check_messages, fit_conversation, has_chat_template, render_prompt
from .request import Request, Status
from .sampling import SeenTokens, make_generator, sample, top_logits, top_tempered
from .scheduler import Scheduler
from .speculative import DraftLength, DraftModel, prompt_lookup
from .text import TextStream

NUM_TOP = 5  # alternatives reported with each token
PROMPT_LOGPROBS_CHUNK = 256  # prompt tokens per prefill chunk with prompt_logprobs: their logits, 50 MB for SmolLM2
T = TypeVar("T")


def memory_bytes(device: torch.device) -> int:
    """The memory a KV pool can take: the machine's (the GPU's free memory on CUDA)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_kv_budget_bytes(device: torch.device) -> int:
    """An eighth of the machine's memory (of the GPU's free memory on CUDA), at most 2 GiB."""
    return max(64 << 20, min(memory_bytes(device) // 8, 2 << 30))


def _checked_budget(mb: float, device: torch.device) -> int:
    """--kv-cache-mb in bytes, refused where the device has not that much memory (torch's allocator said
    it in a traceback; on a CPU an empty pool a little under the memory's size is allocated, and the
    process is killed when it fills)."""
    budget, room = int(mb * 1_000_000), memory_bytes(device)
    if budget > room:
        where = "free on this GPU" if device.type == "cuda" else "of memory on this machine"
        raise ValueError(f"--kv-cache-mb {mb:,.10g} is more than the {room / 1e6:,.0f} MB {where}: lower it")
    return budget


def _eos_ids(loaded: LoadedModel) -> frozenset[int]:
    ids = set()
    configured = getattr(loaded.model.generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    ids.add(loaded.tokenizer.eos_token_id)
    return frozenset(i for i in ids if i is not None)


def _new_pool(runner, config: EngineConfig, budget_bytes: int):
    """The runner's KV pool under the config: its format, and prefix caching (which needs a cache)."""
    # without a KV cache nothing is kept to reuse; a sliding window's blocks are its own
    prefix_caching = config.prefix_caching and config.kv_cache and config.kv_window is None
    if config.kv_window is not None and runner.name != "lean-llama":  # transformers' caches do not slide
        raise ValueError(f"--kv-window needs the lean forward, not {runner.name}")
    if config.kv_dtype == "auto":
        return runner.new_pool(budget_bytes, config.kv_block_tokens, prefix_caching)
    if runner.name != "lean-llama":
        raise ValueError(f"--kv-dtype needs the lean forward, not {runner.name}")
    kv_dtype = {"fp32": torch.float32, "fp16": torch.float16, "int8": torch.int8}[config.kv_dtype]
    return runner.new_pool(budget_bytes, config.kv_block_tokens, prefix_caching, kv_dtype)


def _set_switches(runner, config: EngineConfig) -> None:
    """The forward's switches: prefill's attention implementation, Flash Decoding in the native decode
    step, its threads bound a CPU each, and compiling the CUDA-graph decode step, where the runner has
    them. On the thread that steps the engine (the threads bound are its OpenMP team's)."""
    if hasattr(runner, "attention"):  # always set: engines sharing one runner (variant()) each bring theirs
        runner.attention = config.attention
    elif config.attention != "auto":
        raise ValueError(f"--attention needs the lean forward, not {runner.name}")
    fused = getattr(runner, "fused", None)
    if fused is not None:
        fused.split_kv = config.split_kv
        fused.bind_threads(config.bind_threads)
    elif config.bind_threads:
        raise ValueError("--bind-threads binds the native decode step's threads: it needs that step, on CPU "
                         "and in this process (not tensor-parallel ranks)")
    if config.compile_decode:
        if getattr(runner, "graphs", None) is None:
            raise ValueError("--compile-decode compiles the CUDA-graph decode step: it needs a CUDA device "
                             "and the lean forward")
        runner.graphs.compile = True


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None, runner=None,
                 draft: LoadedModel | None = None) -> None:
        """draft: the draft model of speculative decoding ("draft:PATH"), when already loaded (tests)."""
        self.loaded = loaded
        self.config = config or EngineConfig()
        self.tokenizer = loaded.tokenizer
        self.runner = runner or make_runner(loaded.model, self.config.precision, cache_dir=self.config.cache_dir,
                                            tensor_parallel=self.config.tensor_parallel)
        self.eos_ids = _eos_ids(loaded)
        self._token_strings: dict[int, str] = {}  # token_string's, as tokens come
        mb = self.config.kv_cache_mb
        self.pool_budget = _checked_budget(mb, loaded.device) if mb else default_kv_budget_bytes(loaded.device)
        self.pool = _new_pool(self.runner, self.config, self.pool_budget)
        _set_switches(self.runner, self.config)
        self.drafter = self._drafter(draft)
        size = self.config.kv_block_tokens
        self.sink_blocks = blocks_for(self.config.kv_sinks, size)
        self.kv_limit = None  # a sliding window: sinks, the window, and the block being filled
        if self.config.kv_window is not None:
            self.kv_limit = (self.sink_blocks + blocks_for(self.config.kv_window, size) + 1) * size
        if (self.config.speculative or not self.config.kv_cache) and not getattr(self.runner, "drafts", False):
            raise ValueError(f"speculative decoding and decoding without a KV cache need the lean forward, "
                             f"not {self.runner.name}")
        self.scheduler = Scheduler(self.pool, self.config.max_running, self.config.max_step_tokens)
        self._hooks: list[Hook] = []
        self._ids = itertools.count(1)
        self._step_lock = threading.Lock()  # one step at a time, whichever thread steps
        self._wakeup = threading.Event()  # a request arrived for the serving loop
        self._stopped = threading.Event()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # calls to run on the serving thread
        self.calling: str | None = None  # what the call running now is, if its caller named it (see call)
        self.is_serving = False

    @classmethod
    def from_config(cls, config: EngineConfig | None = None) -> Engine:
        config = config or EngineConfig()
        # the native decode step compiles (once, 8 s) while the model loads (a first start converts it, 6 s)
        start_early(cache_root(config.cache_dir), config.device, config.precision, config.tensor_parallel)
        # lean: a Llama-family folder is read without building transformers' model
        return cls(load_model(config.model, config.device, config.load_dtype, config.cache_dir, lean=True), config)

    @property
    def context_window(self) -> int:
        return self.runner.context_window

    @cached_property
    def info(self) -> ModelInfo:
        """What runs: the model, device, precision, and its KV-cache sizes (computed once)."""
        config = self.loaded.model.config
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dtype = self.runner.dtype  # the loaded model's, or the copy a half-precision switch made
        per_token = getattr(self.pool, "bytes_per_token", None)  # the KV cache's own format (--kv-dtype)
        if per_token is None:  # transformers' caches, in the model's dtype
            per_token = kv_bytes_formula(config.num_hidden_layers, kv_heads, head_dim,
                                         torch.tensor([], dtype=dtype).element_size(), 1)
        return ModelInfo(self.loaded.name, self.loaded.source, str(self.loaded.device),
                         str(dtype).removeprefix("torch."), self.runner.name,
                         getattr(self.runner, "decode_path", "PyTorch ops"), self.runner.precision,
                         config.num_hidden_layers, kv_heads, head_dim, self.context_window, per_token,
                         has_chat_template(self.tokenizer))

    @property
    def setup(self) -> dict:
        """How this engine runs a request, as its Started event says and the history keeps it: the weights'
        precision and the switches set away from their defaults ({"precision": "int8"} as it comes)."""
        return {"precision": self.runner.precision, **self.config.switches()}

    def kv_usage(self) -> PoolUsage:
        """The KV pool now: blocks held by running requests, kept for prefix reuse, and free."""
        return self.pool.usage()

    def load(self) -> tuple[int, int]:
        """(running, waiting) requests now."""
        return self.scheduler.counts()

    def num_held(self) -> int:
        """Running requests held step by step (explain mode, Engine.allow): they keep their place in the
        batch but decode only the steps they are allowed."""
        return sum(not request.may_decode for request in list(self.scheduler.running))

    def place_in_line(self, request: Request) -> int | None:
        """How many requests are ahead of a waiting one; None once it runs."""
        return self.scheduler.place_in_line(request)

    @contextmanager
    def hooks(self, *hooks: Hook) -> Iterator[None]:
        """Subscribe hooks to every request submitted inside the block; the previous set comes back after."""
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
                    prefill_chunk: int | None = None, fit: bool = False) -> Request:
        """Template and tokenize a conversation; raises ValueError for empty or too long input.
        prefill_chunk overrides the engine's chunk size for this request (0: the whole prompt). fit: a chat
        longer than the context window leaves out its earliest exchanges (prompt.fit_conversation); the
        request's messages are those kept."""
        submit_ns = self._now_ns()
        check_messages(messages, self.config.limits.max_message_chars)
        ids = render_prompt(self.tokenizer, messages)
        if fit:
            messages, ids = fit_conversation(self.tokenizer, messages, ids, self.prompt_budget(sampling))
        return self.new_request_from_ids(ids, sampling, prefill_chunk, messages=messages, submit_ns=submit_ns)

    def prompt_budget(self, sampling: SamplingParams | None = None) -> int:
        """The most prompt tokens a chat is fitted to (new_request(fit=True)): the context window less room
        for the reply (up to half the window), within --limit-prompt-tokens."""
        room = min((sampling or SamplingParams()).max_new_tokens, self.context_window // 2)
        return min(self.context_window - room, self.config.limits.max_prompt_tokens or self.context_window)

    def new_request_from_ids(self, prompt_ids: list[int], sampling: SamplingParams | None = None,
                             prefill_chunk: int | None = None, messages: list[dict] | None = None,
                             submit_ns: int | None = None) -> Request:
        """A request for raw prompt token ids (benchmarks, completions); no chat template."""
        submit_ns = self._now_ns() if submit_ns is None else submit_ns
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        limits = self.config.limits
        if len(prompt_ids) >= self.context_window:
            raise PromptTooLong(len(prompt_ids), self.context_window)
        if limits.max_prompt_tokens is not None and len(prompt_ids) > limits.max_prompt_tokens:
            raise PromptTooLong(len(prompt_ids), limits.max_prompt_tokens, "--limit-prompt-tokens")
        sampling = sampling or SamplingParams()
        vocab = self.loaded.model.config.vocab_size
        if any(token_id >= vocab for token_id, _ in sampling.logit_bias):
            raise ValueError(f"logit_bias names a token outside the vocabulary of {vocab:,}")
        if sampling.max_new_tokens > limits.max_new_tokens:
            raise ValueError(f"{sampling.max_new_tokens:,} new tokens asked for; the limit is "
                             f"{limits.max_new_tokens:,} (--limit-new-tokens)")
        # n new tokens need n - 1 positions after the prompt (the last one is never fed back)
        max_new = min(sampling.max_new_tokens, self.context_window - len(prompt_ids) + 1)
        chunk = self.config.prefill_chunk if prefill_chunk is None else prefill_chunk
        if chunk < 0:
            raise ValueError(f"prefill_chunk must be an integer >= 0 (0 = whole prompt), got {chunk!r}")
        if sampling.prompt_logprobs:  # every row's logits are kept for a while
            chunk = min(chunk or PROMPT_LOGPROBS_CHUNK, PROMPT_LOGPROBS_CHUNK)
        request = Request(f"req-{next(self._ids)}", list(messages or []), sampling, list(prompt_ids), max_new,
                          submit_ns=submit_ns, tokenized_ns=self._now_ns(), prefill_chunk=chunk,
                          kv_limit=self.kv_limit)
        self.pool.check_fits(request.num_kv_tokens)  # KVPoolTooSmall: it could never run
        return request

    def warm_up(self, num_tokens: int = 24) -> None:
        """One short request through prefill and a few decode steps, so that the first user's numbers
        are not those of the first call (kernel set-up, thread start-up, first page faults: a first TTFT
        several times the next one's). Call it before serving. It also renders a chat through the
        tokenizer's template, whose first use (importing Jinja2, compiling the template) took 26–115 ms of
        the first user's TTFT."""
        render_prompt(self.tokenizer, [{"role": "user", "content": "Hello"}])
        prompt = [100 + (i * 37) % 1000 for i in range(num_tokens)]
        list(self.run(self.new_request_from_ids(prompt, SamplingParams(max_new_tokens=4, temperature=0,
                                                                       ignore_eos=True))))
        self.pool.drop_cached()  # its made-up tokens are no prefix a user's prompt could share

    def check_room(self) -> None:
        """QueueFull when as many requests wait as the limits allow (submit checks it; a caller may ask
        first, before it records anything)."""
        waiting = self.scheduler.counts()[1]
        if waiting >= self.config.limits.max_waiting:
            raise QueueFull(f"busy: {waiting} requests are already waiting; try again shortly")

    def submit(self, request: Request, hooks: Iterable[Hook] = ()) -> Request:
        """Queue a request (from any thread); its events go to the engine's hooks, then to these."""
        self.check_room()
        request.subscribers = [*self._hooks, *hooks]
        self.scheduler.add(request)
        self._wakeup.set()
        return request

    def allow(self, request: Request, steps: int | None) -> None:
        """Step by step (explain mode): let a request take `steps` more decode steps and then hold, its
        KV cache kept (0 before submit: it holds after its prefill and first token); None: run to the
        end. Safe from any thread. A held request leaves the batch to the others until allowed."""
        if steps is not None and steps < 0:
            raise ValueError(f"steps must be >= 0 or None, got {steps!r}")
        request.decode_allowance = steps
        self._wakeup.set()

    def run(self, request: Request, hooks: Iterable[Hook] = ()) -> Iterator[Event]:
        """Submit a request and yield its events as they happen, ending with Finished. Closing the
        iterator early cancels the request (hooks still get its Finished event). A hook that raises
        cancels its request, and the exception comes out here."""
        inbox: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.submit(request, [*hooks, inbox.put])
        event = None
        try:
            while not isinstance(event, Finished):
                event = self._next_event(inbox)
                if isinstance(event, Finished) and request.hook_error is not None:
                    raise request.hook_error
                yield event
        finally:
            if not isinstance(event, Finished):  # closed early: end the request, and wait for its end
                request.cancel()
                while not isinstance(event, Finished):
                    event = self._next_event(inbox)

    def _next_event(self, inbox: queue.SimpleQueue) -> Event:
        """The next event of a request: stepping here, or waiting for the serving thread to."""
        while True:
            try:
                return inbox.get(timeout=0.05) if self.is_serving else inbox.get_nowait()
            except queue.Empty:
                pass
            if not self.is_serving:
                with self._step_lock:
                    if inbox.empty():
                        self._step_unlocked()

    def stream(self, messages: list[dict], sampling: SamplingParams | None = None,
               hooks: Iterable[Hook] = ()) -> Iterator[Event]:
        """Run a conversation and yield its events as they happen."""
        return self.run(self.new_request(messages, sampling), hooks)

    def generate(self, messages: list[dict], sampling: SamplingParams | None = None,
                 hooks: Iterable[Hook] = ()) -> Finished:
        """Run a conversation to the end and return its Finished event."""
        *_, finished = self.stream(messages, sampling, hooks)
        return finished

    def run_all(self, requests: list[Request], hooks: Iterable[Hook] = ()) -> list[Finished]:
        """Submit several requests and step until all are done (benchmarks); their Finished events."""
        done: dict[str, Finished] = {}
        collect = lambda e: done.__setitem__(e.request_id, e) if isinstance(e, Finished) else None  # noqa: E731
        for request in requests:
            self.submit(request, [*hooks, collect])
        while len(done) < len(requests):
            self.step()
        return [done[r.request_id] for r in requests]

    # --- the serving loop -------------------------------------------------------------------------

    def serve_forever(self) -> None:
        """Step whenever there is work, until stop(); run it on the thread that loaded the model."""
        self.is_serving = True
        try:
            while not self._stopped.is_set():
                self._run_jobs()
                try:
                    worked = self.step()
                except Exception as exc:  # a bug must not stop serving everyone: fail what ran, say it, go on
                    traceback.print_exc()
                    for r in self.scheduler.active():
                        r.cancel(f"internal error: {type(exc).__name__}: {exc}")
                    worked = True
                if not worked:
                    self._wakeup.wait(0.1)
                    self._wakeup.clear()
        finally:
            self.is_serving = False
            self._run_jobs()

    def call(self, job: Callable[[], T], name: str | None = None) -> T:
        """Run job between two steps on the engine's own thread (the serving one, which owns the OpenMP
        team; or this one when nothing serves) and return its result or raise its exception here. name:
        what requests wait for meanwhile (self.calling), e.g. "lab" for a measurement that takes a while."""
        if not self.is_serving:
            with self._step_lock:
                return self._named(name, job)
        done, outcome = threading.Event(), {}
        self._jobs.put((job, done, outcome, name))
        self._wakeup.set()
        done.wait()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def _run_jobs(self) -> None:
        while not self._jobs.empty():
            job, done, outcome, name = self._jobs.get()
            try:
                outcome["value"] = self._named(name, job)
            except BaseException as exc:  # handed back to the caller
                outcome["error"] = exc
            done.set()

    def _named(self, name: str | None, job: Callable[[], T]) -> T:
        """Run job as `name`. A named one's time, from its start or a request's submit if later, goes to the
        held_ms of every request active at its end: they waited for it."""
        self.calling, began_ns = name, time.perf_counter_ns()
        try:
            return job()
        finally:
            self.calling = None
            if name is not None:
                end_ns = time.perf_counter_ns()
                for request in self.scheduler.active():
                    held_ms = (end_ns - max(began_ns, request.submit_ns)) / 1e6
                    request.held_ms[name] = request.held_ms.get(name, 0.0) + held_ms
                    request.held_unsaid_ms += held_ms

    def switch_precision(self, precision: str) -> None:
        """Run the model in another precision from the next request on: the forward is rebuilt from the
        weights already loaded (no reload), with a new KV pool (the cached prefixes were computed in the
        old precision). Refused while requests run. Call it through call() when the engine serves."""
        config = dataclasses.replace(self.config, precision=precision)  # checks the name
        running, waiting = self.load()
        if running or waiting:
            held = self.num_held()
            raise EngineBusy(f"{running + waiting} replies are running or waiting ({held} held step by step): stop "
                             f"them or let them finish, then switch to {precision}", held)
        self.close()  # a tensor-parallel runner's workers: the new one starts its own
        runner = self._runner_for(config)
        self.runner, self.config = runner, config
        _set_switches(runner, config)
        self.pool = _new_pool(runner, config, self.pool_budget)
        self.scheduler.pool = self.pool
        self.__dict__.pop("info", None)  # the cached ModelInfo describes the old runner

    def variant(self, **changes) -> Engine:
        """This engine's model under other settings, to measure side by side (the bench, the lab): the same
        loaded weights and, unless the precision or tensor parallelism changes, the same forward, so nothing
        is converted again; its own KV pool and scheduler. Step it on the thread that steps this engine, not
        while this one serves, and close() it when it brought its own forward."""
        config = dataclasses.replace(self.config, **changes)
        same_forward = config.precision in ("auto", self.runner.precision) \
            and config.tensor_parallel == self.config.tensor_parallel
        return Engine(self.loaded, config, runner=self.runner if same_forward else self._runner_for(config))

    def _runner_for(self, config: EngineConfig):
        """A new forward over the loaded weights in the config's precision (a half-precision copy where
        it asks for one, fp32 weights where the loaded ones are half: see fp32_weights) and tensor
        parallelism."""
        dtype = getattr(torch, config.load_dtype)
        model = self.fp32_weights().model if dtype == torch.float32 else in_dtype(self.loaded.model, dtype)
        return make_runner(model, config.precision, cache_dir=config.cache_dir, tensor_parallel=config.tensor_parallel)

    def fp32_weights(self) -> LoadedModel:
        """The model in fp32 for an fp32 or int8 forward (and a precision's reference). Loaded in half precision
        (`--precision fp16`), an fp32 forward had run the half weights and called itself fp32, and int8 failed
        ('expected scalar type Float but found Half'): they are read again from their file in fp32 (an upcast
        copy would keep the half's rounding; only a model built in-process is upcast) and kept as the
        engine's from then on."""
        if self.loaded.model.dtype == torch.float32:
            return self.loaded
        if Path(self.loaded.source).exists():  # a folder, or a GGUF file (the bundled one: its converted cache)
            fp32 = load_model(self.loaded.source, self.config.device, "float32", self.config.cache_dir, lean=True)
            fp32 = dataclasses.replace(fp32, name=self.loaded.name, source=self.loaded.source)
        else:
            fp32 = dataclasses.replace(self.loaded, model=in_dtype(self.loaded.model, torch.float32),
                                       dtype=torch.float32)
        self.loaded = fp32
        return fp32

    def stop(self) -> None:
        self._stopped.set()
        self._wakeup.set()

    def close(self) -> None:
        """Let the runner go: a tensor-parallel runner stops its worker processes (else nothing to do)."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    # --- the two phases ---------------------------------------------------------------------------

    def prefill(self, request: Request, start: int, end: int) -> torch.Tensor | None:
        """One forward pass over prompt tokens [start, end), writing their K/V into the cache.
        Returns the logits of the last prompt token when the chunk ends the prompt; for a request that
        asked for prompt_logprobs, every row's logits, [end - start, vocab]."""
        assert start == request.kv_cache.num_tokens, "prefill chunks run in order"
        ids = torch.tensor(request.prompt_ids[start:end], device=self.runner.device)
        every_row = request.sampling.prompt_logprobs
        need_logits = end == request.num_prompt_tokens or every_row
        if request.reports_stages and getattr(self.runner, "explains", False):
            request.stage_ms = {}  # filled by the forward, reported with the chunk
            return self.runner.forward(ids, start, request.kv_cache, need_logits, stage_ms=request.stage_ms,
                                       every_row=every_row)
        return self.runner.forward(ids, start, request.kv_cache, need_logits=need_logits, prompt=True,
                                   every_row=every_row)

    def prompt_tokens(self, request: Request, start: int, logits: torch.Tensor) -> tuple[PromptToken, ...]:
        """The prompt tokens that a chunk's rows of logits [T, vocab] from position start predict (the row
        at position p gives the token at p + 1; the prompt's last row, the first generated token), each
        with its probability and the NUM_TOP most likely tokens there."""
        targets = request.prompt_ids[start + 1:start + 1 + logits.shape[0]]
        if not targets:
            return ()
        logprobs = torch.log_softmax(logits[:len(targets)].float(), dim=-1)
        chosen = logprobs[torch.arange(len(targets)), torch.tensor(targets, device=logprobs.device)].exp().tolist()
        top_values, top_ids = logprobs.topk(NUM_TOP, dim=-1)
        tops = [tuple(TopToken(i, self.token_string(i), p) for i, p in zip(ids, probs))
                for ids, probs in zip(top_ids.tolist(), top_values.exp().tolist())]
        return tuple(PromptToken(start + 1 + row, token_id, prob, top)
                     for row, (token_id, prob, top) in enumerate(zip(targets, chosen, tops)))

    def decode_step(self, requests: list[Request], drafts: list[list[int]] | None = None) -> torch.Tensor:
        """One forward pass over exactly one new token (the last generated) of each request, all in one
        batch: every weight is read once for all of them. Returns next-token logits [B, vocab].

        drafts (speculative decoding): a request's draft tokens ride along as more rows of the batch, each
        at the next position of its sequence, so that row i attends to the rows before it: the logits of
        every row come back, in order. The first request in explain mode gets the step's attention
        weights [layers, heads, positions] (where the runner can give them) as request.attention; each
        request that reports stages (explain mode, time_stages), the step's time per stage as
        request.stage_ms. Without a KV cache (config.kv_cache off) each request's
        whole sequence is computed again instead."""
        if not self.config.kv_cache:
            return torch.cat([self._recompute(r) for r in requests])
        tokens, positions, caches, explained = [], [], [], None
        for r, draft in zip(requests, drafts or [[]] * len(requests)):
            if r.kv_limit is not None and r.kv_cache.num_tokens == r.kv_cache.capacity_tokens:
                r.kv_cache.slide(self.sink_blocks)  # the window is full: the oldest non-sink block goes
            pos = r.kv_cache.num_tokens
            assert pos + r.kv_cache.num_dropped == r.num_prompt_tokens + r.num_generated - 1, \
                "decode runs one new token"
            if r.explain and explained is None:
                explained = len(tokens)
            for i, token in enumerate([r.generated_ids[-1], *draft]):
                tokens.append(token)
                positions.append(pos + i)
                caches.append(r.kv_cache)
        timed = [r for r in requests if r.reports_stages]
        if not timed or not getattr(self.runner, "explains", False):
            return self.runner.decode(tokens, positions, caches)
        logits, weights, stage_ms = self.runner.decode(tokens, positions, caches, capture=explained, stages=True)
        for r in timed:
            r.stage_ms = dict(stage_ms)
        if explained is not None:
            next(r for r in requests if r.explain).attention = weights
        return logits

    def _recompute(self, r: Request) -> torch.Tensor:
        """Decode without a KV cache: the whole sequence so far (prompt and tokens) in one forward, as a
        prefill would, its keys and values kept only for that forward. Returns the next logits [1, vocab]."""
        ids = torch.tensor(r.prompt_ids + r.generated_ids, device=self.runner.device)
        r.kv_cache.truncate(0)  # the request's cache is this forward's scratch space
        return self.runner.forward(ids, 0, r.kv_cache)[None]

    def forward_flops(self, num_tokens: int, num_past: int, num_logits: int = 1) -> int:
        """Floating-point operations of a forward over num_tokens new tokens after num_past cached ones:
        2 per multiply-add of every projection and MLP weight, of lm_head for num_logits rows, and of
        attention (scores and the weighted sum over each token's context)."""
        layers, layer, query_width, lm_head = self._flop_shape
        contexts = num_tokens * num_past + num_tokens * (num_tokens + 1) // 2  # keys each new token attends to
        attention = 2 * query_width * contexts  # q·k and weights·v
        return 2 * (layers * (num_tokens * layer + attention) + num_logits * lm_head)

    @cached_property
    def _flop_shape(self) -> tuple[int, int, int, int]:
        """forward_flops' constants, read from the config once (it runs for every token): layers, one
        layer's multiply-adds per token, the query width (heads x head_dim), lm_head's multiply-adds."""
        config, info = self.loaded.model.config, self.info
        if isinstance(self.runner, TransformersRunner):  # any architecture: its matrices counted
            layer, lm_head = self.runner.multiply_adds
        else:  # the lean Llama family's, from the whole model's config (a tensor-parallel runner holds slices)
            layer, lm_head = matrix_numbers(config)
        return info.num_layers, layer, config.num_attention_heads * info.head_dim, lm_head

    def _drafter(self, draft: LoadedModel | None) -> DraftModel | None:
        """The draft model of "draft:PATH" speculative decoding, in the target's precision, with a KV pool
        an eighth of the target's."""
        method = self.config.speculative or ""
        if not method.startswith(DRAFT_PREFIX):
            return None
        if draft is None:
            draft = load_model(method[len(DRAFT_PREFIX):], self.config.device, self.config.load_dtype,
                               self.config.cache_dir, lean=True)
        if draft.model.config.vocab_size != self.loaded.model.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft.model.config.vocab_size}) is not the "
                             f"target's ({self.loaded.model.config.vocab_size}): it needs the same tokenizer")
        runner = make_runner(draft.model, self.runner.precision, cache_dir=self.config.cache_dir)
        if not getattr(runner, "drafts", False):
            raise ValueError(f"the draft model needs the lean forward, not {runner.name}")
        return DraftModel(runner, self.pool_budget // 8)

    def _draft(self, r: Request) -> list[int]:
        """Speculative decoding's draft for a request's next step ([] for none: a plain step)."""
        if self.config.speculative is None or r.explain or r.decode_allowance is not None:
            return []
        if r.draft_length is None:
            r.draft_length = DraftLength(self.config.draft_tokens)
        room = r.max_new_tokens - r.num_generated - 1  # the model's own token always comes after the draft
        length = min(r.draft_length.next(), room)
        if length <= 0:
            return []
        if self.drafter is not None:
            return self.drafter.propose(r, length)
        return prompt_lookup(r.prompt_ids + r.generated_ids, length)

    # --- one step: schedule -> run -> postprocess -------------------------------------------------

    def step(self) -> bool:
        """Run one scheduler step; False when there was nothing to do."""
        with self._step_lock:
            return self._step_unlocked()

    def _step_unlocked(self) -> bool:
        _set_switches(self.runner, self.config)  # engines sharing one forward (variant()) each bring theirs
        self._enforce_time_limit()
        plan = self.scheduler.schedule()
        for r in plan.cancelled:
            self._finish_cancelled(r)
        for r in plan.admitted:
            r.started_ns = self._now_ns()
            kv = r.kv_cache
            self._deliver(r, Started(r.request_id, self._t_ms(r, r.started_ns), r.num_prompt_tokens,
                                     r.max_new_tokens, kv.capacity_tokens, kv.bytes_allocated, self.runner.name,
                                     r.num_cached_tokens, self.setup))
        if plan.decodes:
            self._run_decodes(plan.decodes)
        for r, start, end in plan.prefills:
            if not r.is_finished:  # a hook may have failed on its Started event
                self._run_prefill(r, start, end)
        return not plan.is_empty

    def _run_prefill(self, r: Request, start: int, end: int) -> None:
        begin_ns, comm_before = self._now_ns(), self._comm_ms()
        try:
            logits, prompt_tokens = self.prefill(r, start, end), ()
            r.prefill_end_ns = self._now_ns()
            if r.sampling.prompt_logprobs:  # read after the clock stopped: not the prefill's time (but TTFT's)
                prompt_tokens, logits = self.prompt_tokens(r, start, logits), logits[-1]
        except Exception as exc:  # a failed forward ends this request, not the engine
            self._finish(r, "error", error=f"{type(exc).__name__}: {exc}")
            return
        r.prefill_ns += r.prefill_end_ns - begin_ns
        r.num_prefill_chunks += 1
        self._name_blocks(r)
        cache = r.kv_cache
        self._deliver(r, PrefillChunk(r.request_id, self._t_ms(r, r.prefill_end_ns), r.num_prefill_chunks - 1,
                                      start, end, r.num_prompt_tokens, (r.prefill_end_ns - begin_ns) / 1e6,
                                      cache.num_tokens, cache.bytes_used, r.take_stage_ms(),
                                      self._comm_ms() - comm_before, prompt_tokens))
        if end == r.num_prompt_tokens and not r.is_cancelled:
            r.status = Status.DECODING
            r.text_stream = TextStream(self.tokenizer, r.sampling.stop)
            r.generator = make_generator(r.sampling.seed)
            try:
                self._take_token(r, logits, batch_size=1)
            except Exception as exc:  # sampling failed: this request ends, the others and the engine go on
                self._fail(r, exc)

    def _run_decodes(self, requests: list[Request]) -> None:
        begin_ns, comm_before = self._now_ns(), self._comm_ms()
        drafts = [self._draft(r) for r in requests]
        try:
            logits = self.decode_step(requests, drafts)
        except Exception as exc:  # a failed forward ends the requests in it, not the engine
            for r in requests:
                self._finish(r, "error", error=f"{type(exc).__name__}: {exc}")
            return
        forward_ms, comm_ms = (self._now_ns() - begin_ns) / 1e6, self._comm_ms() - comm_before
        batch_top = getattr(self.runner, "top_logits_batch", None)  # every row's top tokens in one call
        tops = batch_top(logits, NUM_TOP) if batch_top else [None] * len(logits)
        first = 0
        for r, draft in zip(requests, drafts):
            rows = slice(first, first + 1 + len(draft))
            first = rows.stop
            if r.decode_allowance is not None:
                r.decode_allowance -= 1
            if draft:
                r.kv_cache.truncate(r.kv_cache.num_tokens - len(draft))  # the drafts' rows: kept as accepted
            self._name_blocks(r)
            if r.is_cancelled:
                self._finish_cancelled(r)
                continue
            try:
                self._take_tokens(r, logits[rows], tops[rows], draft, len(requests), forward_ms, comm_ms)
            except Exception as exc:  # sampling failed: this request ends, the others and the engine go on
                self._fail(r, exc)

    def _take_tokens(self, r: Request, logits: torch.Tensor, tops: list, draft: list[int], batch_size: int,
                     forward_ms: float, comm_ms: float) -> None:
        """A request's rows of a decode step: sample row by row as plain decoding would, and go on to the
        next row only while the sampled token is the draft's (speculative decoding; engine/speculative.py)."""
        pos = r.kv_cache.num_tokens - 1  # the position of the token this step fed
        accepted_before = r.num_accepted
        r.num_decode_forwards += 1
        r.num_drafted += len(draft)
        for i, (row, top) in enumerate(zip(logits, tops)):
            if i:  # the draft token fed at pos + i was accepted: its keys and values join the sequence
                r.kv_cache.mark_written(pos + 1 + i)
            flops = self.forward_flops(r.num_prompt_tokens + r.num_generated, 0) if not self.config.kv_cache \
                else self.forward_flops(1, pos + i)
            r.num_decode_tokens += 1
            self._take_token(r, row, batch_size=batch_size, top=top, forward_ms=forward_ms if i == 0 else 0.0,
                             comm_ms=comm_ms if i == 0 else 0.0, flops=flops, draft=i > 0,
                             guess=draft[i] if i < len(draft) else None)
            if r.is_finished or i == len(draft) or r.generated_ids[-1] != draft[i]:
                break
        if draft:
            r.draft_length.update(len(draft), r.num_accepted - accepted_before)
            if not r.is_finished:
                self._name_blocks(r)

    def _comm_ms(self) -> float:
        """Time the runner has spent in collectives so far (tensor parallelism's all-reduces; else 0)."""
        return getattr(self.runner, "comm_ms", 0.0)

    def _name_blocks(self, r: Request) -> None:
        """Full blocks of the request's cache become reusable by later requests (prefix caching)."""
        # checked here, before the token list is built (once per step and request)
        if self.pool.prefix_caching and r.kv_cache.has_unnamed_full_block:
            self.pool.name_full_blocks(r.kv_cache, r.prompt_ids + r.generated_ids)

    def _take_token(self, r: Request, logits: torch.Tensor, batch_size: int, top: tuple | None = None,
                    forward_ms: float = 0.0, comm_ms: float = 0.0, flops: int = 0, draft: bool = False,
                    guess: int | None = None) -> None:
        """Sample the next token from a request's logits, report it, and end the request if it is done.
        top: the logits' top tokens and log-sum-exp, when already computed for the whole batch;
        draft: the token comes from a draft's row; guess: the draft's token for this row, counted as
        accepted when it is the one sampled."""
        sample_start_ns = self._now_ns()
        seen = ()
        if r.sampling.repetition_penalty != 1.0:  # the prompt's and reply's distinct ids, kept as the reply grows
            if r.seen_tokens is None:
                r.seen_tokens = SeenTokens(r.prompt_ids)
            seen = r.seen_tokens.ids(r.generated_ids)
        rank_fn = getattr(self.runner, "top_tempered", top_tempered)  # a runner may bring native ones
        top_fn = getattr(self.runner, "top_logits", top_logits) if top is None else lambda *_: top
        picked = sample(logits, r.sampling, r.generator, seen, top_fn=top_fn, generated_ids=r.generated_ids,
                        rank_fn=rank_fn, nucleus_fn=getattr(self.runner, "nucleus", None),
                        penalty_fn=getattr(self.runner, "penalized", None))
        now_ns = self._now_ns()
        stage_ms = None
        if r.reports_stages:  # the forward's stages (none for token 1: the prefill's were reported), and sampling
            stage_ms = {**(r.take_stage_ms() or {}), "sample": (now_ns - sample_start_ns) / 1e6}
        attention, r.attention = r.attention, None
        previous_ns = r.token_ns[-1] if r.token_ns else r.submit_ns  # so the first token's latency is its TTFT
        r.generated_ids.append(picked.token_id)
        r.token_ns.append(now_ns)
        if guess is not None and picked.token_id == guess:
            r.num_accepted += 1
        step = r.num_generated - 1
        if step == 0:
            self._deliver(r, self._first_token(r, now_ns))
        is_eos = picked.token_id in self.eos_ids and not r.sampling.ignore_eos
        piece = "" if is_eos else r.text_stream.push(picked.token_id)
        r.text = r.text_stream.text
        self._deliver(r, self._decode_event(r, step, picked, piece, now_ns, previous_ns, batch_size, forward_ms,
                                            attention, stage_ms, flops, draft, comm_ms))
        if is_eos or r.text_stream.is_stopped:
            self._finish(r, "eos" if is_eos else "stop")
        elif r.num_generated == r.max_new_tokens:
            self._finish(r, "length")

    # --- events -----------------------------------------------------------------------------------

    def _deliver(self, r: Request, event: Event) -> None:
        """Hand an event to each of the request's subscribers. A hook that raises cancels its own
        request (its exception is kept for run()), never the others."""
        for hook in r.subscribers:
            try:
                hook(event)
            except Exception as exc:
                if r.hook_error is None:
                    r.hook_error = exc
                r.cancel()

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

    def token_string(self, token_id: int) -> str:
        """The tokenizer's string for a token id (byte-level BPE's: "Ġthe"), remembered: each decode step
        names its five most likely tokens, and transformers' convert_ids_to_tokens took 30 us for them."""
        string = self._token_strings.get(token_id)
        if string is None:
            string = self._token_strings[token_id] = self.tokenizer.convert_ids_to_tokens(token_id)
        return string

    def _decode_event(self, r: Request, step: int, picked, piece: str, now_ns: int, previous_ns: int,
                      batch_size: int, forward_ms: float = 0.0, attention: torch.Tensor | None = None,
                      stage_ms: dict | None = None, flops: int = 0, draft: bool = False,
                      comm_ms: float = 0.0) -> DecodeStep:
        top = tuple(TopToken(i, self.token_string(i), p, q)
                    for i, p, q in zip(picked.top_ids, picked.top_probs, picked.top_sample_probs))
        held_ms, r.held_unsaid_ms = r.held_unsaid_ms, 0.0  # a named call held it since its last token
        return DecodeStep(r.request_id, self._t_ms(r, now_ns), step, picked.token_id, piece,
                          (now_ns - previous_ns) / 1e6, r.kv_cache.num_tokens, r.kv_cache.bytes_used,
                          picked.prob, top, batch_size, forward_ms, attention, stage_ms, flops, draft, comm_ms,
                          held_ms)

    def _enforce_time_limit(self) -> None:
        limit = self.config.limits.request_timeout_s
        if limit is None:
            return
        deadline = time.perf_counter_ns() - int(limit * 1e9)
        for r in self.scheduler.active():
            # a request held step by step (explain mode) is paced by its user, and let go when abandoned
            if r.submit_ns < deadline and not r.is_cancelled and r.decode_allowance is None:
                r.cancel(f"the request ran past the time limit of {limit:g} s")

    def _fail(self, r: Request, exc: Exception) -> None:
        """End one request with the error its step raised (unless it had ended already)."""
        if not r.is_finished:
            self._finish(r, "error", error=f"{type(exc).__name__}: {exc}")

    def finish_cancelled(self) -> None:
        """End the requests cancelled since the last step, as the next step would. For a long call on the
        engine's thread (a Lab run, between its measurements): a Stop pressed meanwhile ends its reply then,
        not when the call is over."""
        for r in self.scheduler.take_cancelled():
            self._finish_cancelled(r)

    def _finish_cancelled(self, r: Request) -> None:
        """A user's cancel ends a request as cancelled; a limit's, as failed with the limit's message."""
        if r.cancel_error is not None:
            self._finish(r, "error", r.cancel_error)
        else:
            self._finish(r, "cancelled")

    def _finish(self, r: Request, reason: str, error: str | None = None) -> None:
        end_ns = self._now_ns()
        if r.text_stream is not None:
            r.text_stream.flush()
            r.text = r.text_stream.text
        r.finish_reason = reason
        r.status = {"cancelled": Status.STOPPED, "error": Status.FAILED}.get(reason, Status.FINISHED)
        speculation = None
        if self.config.speculative:
            speculation = Speculation(r.num_drafted, r.num_accepted, r.num_decode_forwards, r.num_decode_tokens)
        finished = Finished(r.request_id, self._t_ms(r, end_ns), reason, r.text, r.metrics(end_ns), error,
                            speculation, held_ms=dict(r.held_ms) or None)
        self.scheduler.finish(r)  # its blocks go back to the pool (named ones stay cached)
        if self.drafter is not None:
            self.drafter.release(r)
        r.kv_cache = None
        self._deliver(r, finished)
