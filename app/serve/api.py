"""The OpenAI-compatible HTTP API over a serving engine: /v1/chat/completions, /v1/completions (streamed
as server-sent events or whole), /v1/models, /health and /metrics.

Each completion is one engine request; its events come from the engine's thread into the request's
asyncio queue. A client that goes away cancels its request (the engine stops it within a step).
"""
from __future__ import annotations

import asyncio
import json
import secrets
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from engine import DecodeStep, Engine, Event, Finished, KVPoolTooSmall, PromptTooLong, QueueFull, valid_text
from engine import Request as EngineRequest

from .metrics import ServerMetrics
from .protocol import (APIError, ChatRequest, CompletionRequest, chat_logprob, completion_logprobs, finish_reason,
                       now, timings, usage)

WAIT_S = 0.25  # how often a whole (non-streamed) answer checks that its client is still there


def create_api(engine: Engine, api_key: str | None = None, metrics: ServerMetrics | None = None) -> FastAPI:
    """The API for an engine that serves (its scheduler loop runs on its own thread)."""
    model = engine.info.name
    metrics = metrics or ServerMetrics(engine, model)
    api = FastAPI(title="PhaseScope", summary="An OpenAI-compatible API that measures prefill and decode.")
    api.state.metrics = metrics

    @api.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @api.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:])
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return JSONResponse(APIError(400, message, param=where or None).body(), status_code=400)

    @api.exception_handler(HTTPException)
    async def http_error(_, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(exc.status_code, str(exc.detail), kind).body(), status_code=exc.status_code)

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "a valid API key is required (Authorization: Bearer KEY)", "authentication_error",
                           code="invalid_api_key")

    def check_model(name: str | None) -> None:
        if name and name != model:
            raise APIError(404, f"the model {name!r} does not exist here; this server runs {model!r}",
                           "not_found_error", param="model", code="model_not_found")

    def submit(new_request, sampling_body, max_tokens) -> tuple[EngineRequest, asyncio.Queue]:
        try:
            request = new_request(sampling_body.sampling(max_tokens, engine.config.limits.max_new_tokens))
        except PromptTooLong as exc:
            raise APIError(400, str(exc), param="messages", code="context_length_exceeded") from None
        except (KVPoolTooSmall, ValueError) as exc:
            raise APIError(400, str(exc)) from None
        loop, inbox = asyncio.get_running_loop(), asyncio.Queue()
        try:
            engine.submit(request, [lambda event: loop.call_soon_threadsafe(inbox.put_nowait, event)])
        except QueueFull as exc:
            raise APIError(429, str(exc), "rate_limit_error", code="server_busy") from None
        return request, inbox

    @api.get("/health")
    async def health():
        return {"status": "ok"}

    @api.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @api.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        return {"object": "list", "data": [{"id": model, "object": "model", "created": now(), "owned_by": "phasescope",
                                            "max_model_len": engine.context_window}]}

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        check_key(request)
        check_model(body.model)
        messages = body.chat()  # the engine refuses an empty or ill-formed conversation (400 below)
        top = (body.top_logprobs or 0) if body.logprobs else None
        job, inbox = submit(lambda sampling: engine.new_request(messages, sampling), body,
                            body.max_completion_tokens or body.max_tokens)
        answer = _Answer(engine, job, inbox, request, f"chatcmpl-{uuid.uuid4().hex}", model, chat=True, top=top)
        if body.stream:
            return _sse(answer.chunks(body.include_usage))
        return await answer.whole()

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_key(request)
        check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request here (n = 1)", param="prompt")
            prompt = prompt[0]
        ids = prompt if isinstance(prompt, list) else engine.tokenizer(valid_text(prompt),
                                                                        add_special_tokens=False)["input_ids"]
        if any(not 0 <= i < len(engine.tokenizer) for i in ids):
            raise APIError(400, "prompt token ids must be within the vocabulary", param="prompt")
        job, inbox = submit(lambda sampling: engine.new_request_from_ids(ids, sampling), body, body.max_tokens)
        answer = _Answer(engine, job, inbox, request, f"cmpl-{uuid.uuid4().hex}", model, chat=False,
                         top=body.logprobs)
        if body.stream:
            return _sse(answer.chunks(body.include_usage))
        return await answer.whole()

    return api


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def lines():
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class _Answer:
    """One completion's events turned into OpenAI's answer: chunk by chunk, or whole at the end."""

    def __init__(self, engine: Engine, job: EngineRequest, inbox: asyncio.Queue, http: Request, answer_id: str,
                 model: str, chat: bool, top: int | None) -> None:
        self.engine, self.job, self.inbox, self.http = engine, job, inbox, http
        self.id, self.model, self.chat, self.top = answer_id, model, chat, top
        self.created = now()

    async def events(self) -> AsyncIterator[Event]:
        """The request's events until Finished; cancels it if the client leaves or the caller stops."""
        try:
            while True:
                try:
                    event = await asyncio.wait_for(self.inbox.get(), WAIT_S)
                except asyncio.TimeoutError:
                    if await self.http.is_disconnected():
                        return
                    continue
                yield event
                if isinstance(event, Finished):
                    return
        finally:
            if not self.job.is_finished:
                self.job.cancel()

    def _logprobs(self, steps: list[DecodeStep], offset: int = 0) -> dict | None:
        """The steps' logprobs as the API shapes them; offset: the characters of text streamed before."""
        if self.top is None:
            return None
        tokenizer = self.engine.tokenizer
        if self.chat:
            return {"content": [chat_logprob(step, tokenizer, self.top) for step in steps]}
        return completion_logprobs(steps, tokenizer, self.top, offset)

    def _choice(self, **fields) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": [{"index": 0, **fields}]}

    async def chunks(self, include_usage: bool) -> AsyncIterator[dict]:
        if self.chat:
            yield self._choice(delta={"role": "assistant", "content": ""}, logprobs=None, finish_reason=None)
        streamed = 0  # characters of text sent
        async for event in self.events():
            if isinstance(event, DecodeStep) and (event.text or self.top is not None):
                logprobs = self._logprobs([event], streamed)
                streamed += len(event.text)
                if self.chat:
                    yield self._choice(delta={"content": event.text}, logprobs=logprobs, finish_reason=None)
                else:
                    yield self._choice(text=event.text, logprobs=logprobs, finish_reason=None)
            elif isinstance(event, Finished):
                if event.reason == "error":
                    yield {"error": APIError(500, event.error or "the engine failed", "server_error").body()["error"]}
                    return
                end = {"delta": {}} if self.chat else {"text": ""}
                chunk = self._choice(**end, logprobs=None, finish_reason=finish_reason(event))
                chunk["timings"] = timings(event)
                yield chunk
                if include_usage:
                    yield {**self._choice(), "choices": [], "usage": usage(event)}

    async def whole(self) -> dict:
        steps: list[DecodeStep] = []
        finished = None
        async for event in self.events():
            if isinstance(event, DecodeStep):
                steps.append(event)
            elif isinstance(event, Finished):
                finished = event
        if finished is None:  # the client left; nobody reads this
            return JSONResponse({}, status_code=499)
        if finished.reason == "error":
            raise APIError(500, finished.error or "the engine failed", "server_error")
        logprobs = self._logprobs(steps)
        kind = "chat.completion" if self.chat else "text_completion"
        content = {"message": {"role": "assistant", "content": finished.text}} if self.chat else {"text": finished.text}
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": [{"index": 0, **content, "logprobs": logprobs, "finish_reason": finish_reason(finished)}],
                "usage": usage(finished), "timings": timings(finished)}
