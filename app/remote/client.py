"""Any OpenAI-compatible streaming server (vLLM, SGLang, llama.cpp's server, Ollama, `phasescope serve`)
measured from the client side, as the engine's own events: Started, FirstToken, a DecodeStep per
streamed chunk, Finished. The charts, the history and the exports then treat it as a local reply.

Client-side: TTFT (request sent -> first content chunk), ITL per chunk, TPOT, E2E, all read on this
machine's clock and including the network. Server-side, where the server gives them: llama.cpp's (and
phasescope's) `timings`, Ollama's `prompt_eval_duration`/`eval_duration`, the usage's token counts and
cached tokens, and what /metrics says before and after (KV cache use, prefix-cache hits, queue length).
Every failure ends the reply with a one-line error and the text received so far.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit, urlunsplit

import httpx

from engine import DecodeStep, Event, Finished, FirstToken, ModelInfo, SamplingParams, Started
from engine.metrics import request_metrics

_ids = itertools.count(1)
# a server's gauges worth reporting from its /metrics, by what they say, each with the names vLLM, SGLang,
# llama.cpp's server and PhaseScope give it (after the prefix: vllm:, sglang:, llamacpp:, phasescope:)
SERVER_GAUGES = {"kv_cache_usage": ("kv_cache_usage_perc", "gpu_cache_usage_perc", "token_usage",
                                    "kv_cache_usage_ratio"),
                 "running": ("num_requests_running", "num_running_reqs", "requests_processing"),
                 "waiting": ("num_requests_waiting", "num_queue_reqs", "requests_deferred")}
# those, and its prefix cache's counters, as each request's Finished.server keeps them (metrics_before / _after)
SERVER_METRICS = (*(name for names in SERVER_GAUGES.values() for name in names), "prefix_cache_hits", "cache_hit_rate",
                  "prefix_cache_queries", "prompt_tokens_cached")
# Prometheus gauges whose labels say how a server runs: PhaseScope's engine_info, vLLM's cache_config_info
SERVER_INFO = ("engine_info", "cache_config_info")


def server_timings(server: dict) -> dict:
    """A server's `timings` (llama.cpp's, PhaseScope's) as kept in Finished.server; {} where it sent none, or
    sent something of another shape (they are only read as a dict)."""
    timings = server.get("timings")
    return timings if isinstance(timings, dict) else {}


def server_gauges(scraped: dict[str, float]) -> dict[str, float]:
    """A scrape's SERVER_GAUGES by what they say ({"kv_cache_usage": 0.12, "running": 3.0, "waiting": 0.0}),
    each from the first of its names the server has: a fraction of the KV cache in use, and requests."""
    return {what: next(scraped[name] for name in names if name in scraped)
            for what, names in SERVER_GAUGES.items() if any(name in scraped for name in names)}


def gauges_text(gauges: dict[str, float]) -> str:
    """"KV cache 12.0%, 3 running, 0 waiting", of what the server has."""
    words = {"kv_cache_usage": lambda v: f"KV cache {v:.1%}", "running": lambda v: f"{v:,.0f} running",
             "waiting": lambda v: f"{v:,.0f} waiting"}
    return ", ".join(words[what](value) for what, value in gauges.items())


class KeyRefused(ValueError):
    """The endpoint wants an API key, or another one (HTTP 401 or 403)."""


@dataclass
class Endpoint:
    """An OpenAI-compatible server: its base URL (…/v1), the model to ask for, an optional API key."""

    url: str
    model: str | None = None
    api_key: str | None = field(default=None, repr=False)
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0  # the longest silence accepted between two chunks
    scrape_metrics: bool = True
    auth: httpx.BasicAuth | None = field(default=None, repr=False)  # from the URL's user:password@, if any

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"an endpoint is an http:// or https:// URL, got {self.url!r}")
        parts = urlsplit(self.url)
        if "@" in parts.netloc:  # a server behind a proxy's basic auth: the password is sent, never shown
            self.auth = httpx.BasicAuth(unquote(parts.username or ""), unquote(parts.password or ""))
            self.url = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
        if not self.url.endswith("/v1"):
            self.url += "/v1"

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.read_timeout_s, connect=self.connect_timeout_s)

    def resolve_model(self) -> str:
        """The model to ask for: the one given, else the first the server lists."""
        if self.model:
            return self.model
        try:
            answer = httpx.get(f"{self.url}/models", headers=self.headers, auth=self.auth, timeout=self._timeout())
            answer.raise_for_status()
            self.model = answer.json()["data"][0]["id"]
        except (httpx.ConnectError, httpx.TimeoutException) as exc:  # no server there: a model's name won't help
            raise ValueError(f"cannot reach {self.url}: {_say(exc)}") from None
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            status = exc.response.status_code if isinstance(exc, httpx.HTTPStatusError) else None
            if status in (401, 403):  # a model's name won't help either
                said = "refused the API key" if self.api_key else "needs an API key"
                raise KeyRefused(f"{self.url} {said} (HTTP {status})") from None
            raise ValueError(f"cannot list the models of {self.url}: {_say(exc)}; give the model's name") from None
        return self.model

    def info(self) -> ModelInfo:
        """What the history records for a session against this endpoint (the endpoint as its device)."""
        return ModelInfo(self.model or "remote", self.url, f"endpoint {self.url}", "remote", "remote", "remote",
                         "remote", 0, 0, 0, 0, 0)

    def _samples(self) -> list:
        """The samples of the server's /metrics (beside /v1); [] where it has none."""
        if not self.scrape_metrics:
            return []
        try:
            answer = httpx.get(self.url.removesuffix("/v1") + "/metrics", headers=self.headers, auth=self.auth,
                               timeout=2.0)
        except httpx.HTTPError:
            return []
        if answer.status_code != 200:
            return []
        from prometheus_client.parser import text_string_to_metric_families

        try:
            return [sample for family in text_string_to_metric_families(answer.text) for sample in family.samples]
        except ValueError:  # not Prometheus text after all
            return []

    def scrape(self) -> dict[str, float]:
        """The server's /metrics reduced to SERVER_METRICS, summed over labels; {} if it has none."""
        values: dict[str, float] = {}
        for sample in self._samples():
            base = sample.name.split(":")[-1].removesuffix("_total")
            if base in SERVER_METRICS:
                values[base] = values.get(base, 0.0) + sample.value
        return values

    def server_info(self) -> dict[str, dict[str, str]]:
        """How the server says it runs: the labels of its SERVER_INFO gauges by name, without the model's,
        e.g. {"phasescope:engine_info": {"precision": "int8", "switches": "--no-kv-cache"}}; {} if none."""
        return {sample.name: {k: v for k, v in sample.labels.items() if k != "model_name"}
                for sample in self._samples() if sample.name.split(":")[-1] in SERVER_INFO}

    def stream(self, messages: list[dict], sampling: SamplingParams, cancelled=lambda: False) -> Iterator[Event]:
        """Send a chat and yield its events as the chunks arrive; cancelled() is checked between chunks."""
        return _Stream(self, messages, sampling, cancelled).events()


def _say(exc: Exception) -> str:
    if isinstance(exc, httpx.ConnectError):
        return "connection refused or host unreachable"
    if isinstance(exc, httpx.TimeoutException):
        return "timed out"
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}"
    return str(exc) or type(exc).__name__


class _Stream:
    def __init__(self, endpoint: Endpoint, messages: list[dict], sampling: SamplingParams, cancelled) -> None:
        self.endpoint, self.messages, self.sampling, self.cancelled = endpoint, messages, sampling, cancelled
        self.id = f"remote-{next(_ids)}"
        self.submit_ns = 0  # set as the request goes (events)
        self.token_ns: list[int] = []
        self.text = ""
        self.usage: dict = {}
        self.server: dict = {}
        self.reason: str | None = None

    def _t_ms(self, ns: int) -> float:
        return (ns - self.submit_ns) / 1e6

    def _body(self) -> dict:
        s = self.sampling
        # role and text only: a local chat's replies also carry their token ids, which mean nothing to a server
        messages = [{"role": m["role"], "content": m["content"]} for m in self.messages]
        body = {"model": self.endpoint.model, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}, "max_tokens": s.max_new_tokens,
                "temperature": s.temperature, "top_p": s.top_p}
        if s.seed is not None:
            body["seed"] = s.seed
        if s.stop:
            body["stop"] = list(s.stop)
        if s.top_k:
            body["top_k"] = s.top_k
        if s.frequency_penalty or s.presence_penalty:
            body.update(frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty)
        if s.repetition_penalty != 1.0:  # vLLM's, SGLang's and PhaseScope's extension, and llama.cpp's server's
            # name for it (over the last 64 tokens there, its repeat_last_n); each server ignores the other name
            body.update(repetition_penalty=s.repetition_penalty, repeat_penalty=s.repetition_penalty)
        if s.ignore_eos:
            body["ignore_eos"] = True  # vLLM's and llama.cpp's extension (load sweeps: exact output lengths)
        return body

    def events(self) -> Iterator[Event]:
        yield Started(self.id, 0.0, 0, self.sampling.max_new_tokens, 0, 0, f"remote {self.endpoint.url}")
        before = self.endpoint.scrape()
        self.submit_ns = time.perf_counter_ns()  # TTFT from here: the /metrics read above is not the request's
        error = None
        try:
            yield from self._chunks()
        except httpx.ConnectError:
            error = f"cannot connect to {self.endpoint.url}: connection refused or host unreachable"
        except httpx.TimeoutException:
            error = (f"{self.endpoint.url} sent nothing for {self.endpoint.read_timeout_s:g} s"
                     if self.token_ns else f"{self.endpoint.url} did not answer in time")
        except (httpx.RemoteProtocolError, httpx.ReadError):
            error = "the server closed the stream before it ended"
        except _Refused as exc:
            error = str(exc)
        except httpx.HTTPError as exc:
            error = f"{self.endpoint.url}: {_say(exc)}"
        if error is None and self.reason is None:
            error = "the server closed the stream before it ended (no finish reason)"
        after = self.endpoint.scrape()
        if before or after:
            self.server["metrics_before"], self.server["metrics_after"] = before, after
        yield self._finished(error)

    def _chunks(self) -> Iterator[Event]:
        endpoint = self.endpoint
        with httpx.stream("POST", f"{endpoint.url}/chat/completions", json=self._body(), headers=endpoint.headers,
                          auth=endpoint.auth, timeout=endpoint._timeout()) as answer:
            if answer.status_code != 200:
                answer.read()
                raise _Refused(f"{endpoint.url} answered HTTP {answer.status_code}: {_error_message(answer)}")
            kind = answer.headers.get("content-type", "")
            if "text/event-stream" not in kind:
                raise _Refused(f"{endpoint.url} did not answer with a stream (content-type {kind or 'none'})")
            for line in answer.iter_lines():
                if self.cancelled():
                    self.reason = "cancelled"
                    return
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    raise _Refused(f"{endpoint.url} sent a chunk that is not JSON: {data[:80]!r}") from None
                yield from self._take(chunk)

    def _take(self, chunk: dict) -> Iterator[Event]:
        if chunk.get("error"):
            error = chunk["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            raise _Refused(f"the server reported an error: {message}")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for key in ("timings", "prompt_eval_duration", "eval_duration", "prompt_eval_count", "eval_count"):
            if key in chunk:
                self.server[key] = chunk[key]
        for choice in chunk.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
            if piece:
                now = time.perf_counter_ns()
                previous = self.token_ns[-1] if self.token_ns else self.submit_ns
                self.token_ns.append(now)
                self.text += piece
                step = len(self.token_ns) - 1
                if step == 0:
                    ttft = self._t_ms(now)
                    yield FirstToken(self.id, ttft, ttft, 0.0, 0.0, 0.0, ttft, 0.0)
                yield DecodeStep(self.id, self._t_ms(now), step, -1, piece, (now - previous) / 1e6, 0, 0, None, ())
            if choice.get("finish_reason"):
                # "stop": the model ended its reply or met a stop string; the server does not say which
                self.reason = "length" if choice["finish_reason"] == "length" else "eos"

    def _finished(self, error: str | None) -> Finished:
        end_ns = time.perf_counter_ns()
        usage = self.usage
        prompt = usage.get("prompt_tokens", 0)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        timings = server_timings(self.server)
        prefill_ms = timings.get("prompt_ms") or (self._t_ms(self.token_ns[0]) if self.token_ns else 0.0)
        metrics = request_metrics(submit_ns=self.submit_ns, token_ns=self.token_ns, end_ns=end_ns,
                                  prefill_ms=prefill_ms, num_prompt_tokens=prompt,
                                  num_cached_tokens=cached or timings.get("cache_n", 0), kv_tokens=0, kv_bytes=0)
        completion = usage.get("completion_tokens") or 0
        if completion > len(self.token_ns) > 0:  # chunks of several tokens: TPOT per token, not per chunk
            metrics = dataclasses.replace(metrics, tpot_ms=metrics.decode_ms / (completion - 1),
                                          decode_tokens_per_s=(completion - 1) * 1000 / metrics.decode_ms
                                          if metrics.decode_ms > 0 else None)
        if usage:
            self.server["usage"] = usage
        reason = "error" if error else self.reason
        return Finished(self.id, self._t_ms(end_ns), reason, self.text, metrics, error, server=self.server or None,
                        held_ms=_held_ms(timings))


def _held_ms(timings: dict) -> dict | None:
    """A PhaseScope server's `held_ms` ({"lab": ms}: its Lab held the request there), kept only as it should be."""
    held = timings.get("held_ms")
    if not isinstance(held, dict):
        return None
    return {str(name): float(ms) for name, ms in held.items() if isinstance(ms, (int, float))} or None


class _Refused(Exception):
    """The server answered, but not with a stream this client can read."""


def _error_message(answer: httpx.Response) -> str:
    try:
        error = answer.json().get("error")
        message = error.get("message") if isinstance(error, dict) else error
        return str(message or answer.text[:200])
    except ValueError:
        return answer.text[:200].strip() or answer.reason_phrase
