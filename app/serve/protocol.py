"""The OpenAI API's requests and answers, as PhaseScope speaks them.

Requests are pydantic models (they also make the OpenAPI document); an invalid one is answered with
OpenAI's error shape and a 4xx code. Answers are built from the engine's events: a stream's chunks, the
whole completion, usage, and a `timings` object with llama.cpp's field names.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.fields import FieldInfo

from engine import DecodeStep, Finished, IncrementalDetokenizer, PromptToken, SamplingParams, TopToken, token_bytes

MAX_TOP_LOGPROBS = 5  # the engine reports each step's five most likely tokens
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}


class APIError(Exception):
    """An error for the client: an HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class ContentPart(BaseModel):
    """One part of a message's content: text is read; any other kind (image_url, input_audio, file) is
    refused by check_supported with its name, rather than by pydantic with a union's first complaint."""
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str = ""


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(BaseModel):
    include_usage: bool = False


def _takes_null(field: FieldInfo) -> bool:
    return type(None) in get_args(field.annotation)


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")  # fields this server does not use (user, metadata, ...) pass

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=10_000_000)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, le=1_000_000)  # vLLM's extension; 0 or -1: off
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=16)  # choices for each prompt
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=10)  # vLLM's extension
    logit_bias: dict[str, float] | None = None  # token id (a string, as OpenAI's keys are) -> -100 to 100
    ignore_eos: bool = False  # vLLM's and llama.cpp's extension: exactly max_tokens (load tests)

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_set(cls, body):
        """`"temperature": null` (OpenAI's API allows null for every optional field, and some clients send
        it for what their user left unset) is the field not set, where the field has no meaning for null."""
        if not isinstance(body, dict):
            return body
        return {key: value for key, value in body.items()
                if value is not None or key not in cls.model_fields or _takes_null(cls.model_fields[key])}

    def sampling(self, max_tokens: int | None, limit: int, defaults: dict | None = None) -> SamplingParams:
        """The engine's sampling parameters; no max_tokens: up to the limit (the context caps it too).
        defaults: the model's own (engine.model_sampling) for what the request does not set, as vLLM."""
        chosen = {key: getattr(self, key) for key in ("temperature", "top_p", "top_k", "repetition_penalty")}
        chosen.update({key: value for key, value in (defaults or {}).items() if key not in self.model_fields_set})
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stop) or len(stop) > 16:
            raise APIError(400, "stop takes up to 16 non-empty strings", param="stop")
        if max_tokens is not None and max_tokens > limit:
            raise APIError(400, f"max_tokens {max_tokens:,} is over this server's limit of {limit:,}",
                           param="max_tokens")
        try:
            bias = tuple((int(token), value) for token, value in (self.logit_bias or {}).items())
        except ValueError:
            raise APIError(400, "logit_bias takes token ids as its keys", param="logit_bias") from None
        return SamplingParams(max_new_tokens=max_tokens or limit, temperature=chosen["temperature"],
                              top_p=chosen["top_p"], top_k=max(chosen["top_k"], 0), seed=self.seed, stop=tuple(stop),
                              repetition_penalty=chosen["repetition_penalty"], frequency_penalty=self.frequency_penalty,
                              presence_penalty=self.presence_penalty, logit_bias=bias, ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=10_000_000)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # asked for, these would change what comes back; refused rather than ignored (check_supported)
    response_format: dict | None = None
    tools: list | None = None

    def check_supported(self) -> None:
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise APIError(400, f"response_format {kind!r} is not supported here: replies are plain text",
                           param="response_format")
        if self.tools:
            raise APIError(400, "tools are not supported here: this server does not call tools", param="tools")
        for i, message in enumerate(self.messages):
            for j, part in enumerate(message.content if isinstance(message.content, list) else []):
                if part.type != "text":
                    raise APIError(400, f"content parts of type {part.type!r} are not supported here: the model "
                                        "reads text", param=f"messages.{i}.content.{j}")

    def chat(self) -> list[dict]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]  # one prompt, or several (an empty one: check_supported)
    max_tokens: int | None = Field(16, ge=1, le=10_000_000)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False  # the prompt before the completion; with logprobs, the prompt tokens' too
    # asked for, these would change what comes back; refused rather than ignored (check_supported)
    suffix: str | None = None
    best_of: int | None = None

    def sampling(self, max_tokens: int | None, limit: int, defaults: dict | None = None) -> SamplingParams:
        """With echo and logprobs, the engine reports the prompt's own logprobs (and prefills all of it)."""
        return replace(super().sampling(max_tokens, limit, defaults),
                       prompt_logprobs=self.echo and self.logprobs is not None)

    def check_supported(self) -> None:
        if not self.prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        if self.suffix:
            raise APIError(400, "suffix is not supported here: the model only continues the prompt", param="suffix")
        if self.best_of not in (None, self.n):
            raise APIError(400, "best_of is not supported here: ask for n choices instead", param="best_of")


# --- answers ------------------------------------------------------------------------------------------


def timings(finished: Finished) -> dict:
    """llama.cpp's `timings`: the prompt tokens prefilled (not taken from the cache) and their time, the
    tokens generated and theirs, the prompt tokens reused; and PhaseScope's own held_ms where the request
    waited for a measurement (a Lab run in `serve --ui`), which its times include."""
    m = finished.metrics
    prompt_n = m.num_prompt_tokens - m.num_cached_tokens
    predicted_n = m.num_generated_tokens
    predicted_ms = m.decode_ms
    return {"prompt_n": prompt_n, "prompt_ms": round(m.prefill_ms, 3),
            "prompt_per_second": round(m.prefill_tokens_per_s or 0.0, 3),
            "predicted_n": predicted_n, "predicted_ms": round(predicted_ms, 3),
            "predicted_per_token_ms": round(m.tpot_ms or 0.0, 3),
            "predicted_per_second": round(m.decode_tokens_per_s or 0.0, 3), "cache_n": m.num_cached_tokens,
            **({"held_ms": {name: round(ms, 3) for name, ms in finished.held_ms.items()}} if finished.held_ms else {})}


def usage(finished: list[Finished], n: int = 1) -> dict:
    """The tokens of an answer's choices, in order (n for each prompt): each prompt counted once, as
    OpenAI bills it, with its first choice's cached tokens; every choice's generated tokens."""
    prompts = [f.metrics for f in finished[::n]]
    prompt_tokens = sum(m.num_prompt_tokens for m in prompts)
    completion_tokens = sum(f.metrics.num_generated_tokens for f in finished)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(m.num_cached_tokens for m in prompts)}}


def finish_reason(finished: Finished) -> str:
    return FINISH_REASONS.get(finished.reason, "stop")


def _logprob(prob: float) -> float:
    return math.log(prob) if prob > 0 else -9999.0


def _token(tokenizer, token_id: int) -> tuple[str, list[int]]:
    """A token's text and its bytes: the bytes are exact also for a token that is only part of a
    character (most Chinese characters take two or three tokens), whose text alone is U+FFFD."""
    return tokenizer.decode([token_id]), list(token_bytes(tokenizer, token_id))


def chat_logprob(step: DecodeStep, tokenizer, top: int) -> dict:
    def entry(token_id: int, prob: float) -> dict:
        text, raw = _token(tokenizer, token_id)
        return {"token": text, "logprob": _logprob(prob), "bytes": raw}

    return {**entry(step.token_id, step.prob), "top_logprobs": [entry(t.token_id, t.prob) for t in step.top[:top]]}


# a token as a completion's logprobs list it: its id, probability (None for an echoed prompt's first
# token, which nothing predicts), most likely alternatives, and the text it completes
Listed = tuple[int, float | None, tuple[TopToken, ...], str]


def completion_logprobs(tokens: list[Listed], tokenizer, top: int, offset: int = 0) -> dict:
    """Logprobs of a completion's tokens; text_offset counts characters of the text, which a token that
    completes a character enters whole (offset: the characters streamed before these tokens)."""
    offsets = []
    for *_, piece in tokens:
        offsets.append(offset)
        offset += len(piece)
    text = tokenizer.decode
    return {"tokens": [text([token_id]) for token_id, *_ in tokens],
            "token_logprobs": [None if prob is None else _logprob(prob) for _, prob, _, _ in tokens],
            "top_logprobs": [None if prob is None else {text([t.token_id]): _logprob(t.prob) for t in others[:top]}
                             for _, prob, others, _ in tokens],
            "text_offset": offsets}


def listed_steps(steps: list[DecodeStep]) -> list[Listed]:
    return [(s.token_id, s.prob, s.top, s.text) for s in steps]


def listed_prompt(prompt_ids: list[int], known: list[PromptToken], tokenizer) -> list[Listed]:
    """An echoed prompt's tokens: each with the probability its prefill chunk reported (known; none for
    the first token, or without logprobs) and the text it completes."""
    at = {t.position: t for t in known}
    detokenizer = IncrementalDetokenizer(tokenizer)
    return [(token_id, at[p].prob if p in at else None, at[p].top if p in at else (), detokenizer.push(token_id))
            for p, token_id in enumerate(prompt_ids)]


def now() -> int:
    return int(time.time())
