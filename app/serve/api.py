"""The OpenAI-compatible HTTP API over a serving engine: /v1/chat/completions, /v1/completions (streamed
as server-sent events or whole), /v1/models (and /v1/models/NAME), /health and /metrics.

Each choice of a completion (n for each prompt) is one engine request; their events come from the
engine's thread into the answer's asyncio queue. A client that goes away cancels its requests (the engine
stops them within a step).
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from engine import (DecodeStep, Engine, Event, Finished, KVPoolTooSmall, PrefillChunk, PromptToken, PromptTooLong,
                    QueueFull, model_sampling, valid_text)
from engine import Request as EngineRequest

from .metrics import ServerMetrics
from .protocol import (APIError, ChatRequest, CompletionRequest, Listed, chat_logprob, completion_logprobs,
                       finish_reason, listed_prompt, listed_steps, now, timings, usage)
from .replies import RecentReplies

WAIT_S = 0.25  # how often an answer checks that its client is still there
# what an Engine.call named so holds the engine for (the page's Lab, its precision check): a streamed answer
# waiting behind one says so in a comment
HELD_BY = {"lab": "a measurement of the Lab", "precision": "a precision check"}
MAX_CHOICES = 16  # choices in one answer: n, times the prompts of a completion


def create_api(engine: Engine, api_key: str | None = None, metrics: ServerMetrics | None = None) -> FastAPI:
    """The API for an engine that serves (its scheduler loop runs on its own thread)."""
    model = engine.info.name
    model_defaults = model_sampling(engine.config.model)  # the model's own, for what a request leaves out
    metrics = metrics or ServerMetrics(engine, model)
    replies = RecentReplies()
    # /openapi.json stays; FastAPI's /docs and /redoc pages load their scripts from a CDN: blank offline, and
    # a call to another host from the user's browser when online
    api = FastAPI(title="PhaseScope", summary="An OpenAI-compatible API that measures prefill and decode.",
                  docs_url=None, redoc_url=None)
    api.state.metrics = metrics

    @api.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @api.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        message, param = _validation_message(exc.errors()[0] if exc.errors() else {})
        return JSONResponse(APIError(400, message, param=param).body(), status_code=400)

    @api.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        """A path or method this server does not serve (an embeddings client, a GET to a POST's path): said
        with what it serves, rather than starlette's bare 'Not Found'."""
        message, kind = str(exc.detail), "invalid_request_error"
        if exc.status_code in (404, 405):
            message = (f"{request.method} {request.url.path} is not served here; this server serves "
                       f"{', '.join(api.state.served)}")
            kind = "not_found_error" if exc.status_code == 404 else kind
        return JSONResponse(APIError(exc.status_code, message, kind).body(), status_code=exc.status_code)

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

    def submit(new_requests: list, body, max_tokens) -> tuple[list[EngineRequest], asyncio.Queue]:
        """One engine request per choice: n for each prompt (seeds seed, seed + 1, ...), submitted
        together, so that the scheduler decodes them as one batch. Their events come into one queue,
        each with its choice's index. A queue full part-way cancels those already submitted: all run or
        none."""
        choices, queue_limit = len(new_requests) * body.n, engine.config.limits.max_waiting
        if choices > MAX_CHOICES:
            raise APIError(400, f"at most {MAX_CHOICES} choices per request (prompts × n)", param="n")
        if choices > queue_limit:  # never room for them all at once: not a 429 to retry forever
            raise APIError(400, f"{choices} choices in one request (prompts × n), but this server queues at most "
                                f"{queue_limit} requests (--limit-waiting)", param="n")
        try:
            sampling = body.sampling(max_tokens, engine.config.limits.max_new_tokens, model_defaults)
            jobs = [new_request(sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + i))
                    for new_request in new_requests for i in range(body.n)]
        except PromptTooLong as exc:  # in an API's words: no chat to start anew
            raise APIError(400, f"the prompt is {exc.num_tokens:,} tokens, but {exc.which_limit}: shorten it",
                           param="messages" if hasattr(body, "messages") else "prompt",
                           code="context_length_exceeded") from None
        except (KVPoolTooSmall, ValueError) as exc:
            raise APIError(400, str(exc)) from None
        loop, inbox = asyncio.get_running_loop(), asyncio.Queue()
        try:
            for index, job in enumerate(jobs):
                engine.submit(job, [lambda event, index=index: loop.call_soon_threadsafe(inbox.put_nowait,
                                                                                           (index, event))])
        except QueueFull as exc:
            for job in jobs:
                job.cancel()
            raise APIError(429, str(exc), "rate_limit_error", code="server_busy") from None
        return jobs, inbox

    @api.get("/health")
    async def health():
        return {"status": "ok"}

    @api.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict:
        return {"id": model, "object": "model", "created": now(), "owned_by": "phasescope",
                "max_model_len": engine.context_window}

    @api.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        return {"object": "list", "data": [model_card()]}

    @api.get("/v1/models/{name:path}")
    async def one_model(name: str, request: Request):
        check_key(request)
        check_model(name)
        return model_card()

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        check_key(request)
        check_model(body.model)
        body.check_supported()
        messages = replies.attach(body.chat())  # the engine refuses an empty or ill-formed conversation (400 below)
        top = (body.top_logprobs or 0) if body.logprobs else None
        jobs, inbox = submit([lambda sampling: engine.new_request(messages, sampling)], body,
                             body.max_completion_tokens or body.max_tokens)
        answer = _Answer(engine, jobs, inbox, request, f"chatcmpl-{uuid.uuid4().hex}", model, chat=True, top=top,
                         n=body.n, replies=replies)
        if body.stream:
            return _sse(answer.chunks(body.include_usage))
        return await answer.whole()

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_key(request)
        check_model(body.model)
        body.check_supported()
        prompts = [body.prompt] if isinstance(body.prompt, str) or isinstance(body.prompt[0], int) else body.prompt
        ids = [prompt if isinstance(prompt, list) else engine.tokenizer(valid_text(prompt),
                                                                         add_special_tokens=False)["input_ids"]
               for prompt in prompts]
        if any(not 0 <= i < len(engine.tokenizer) for prompt in ids for i in prompt):
            raise APIError(400, "prompt token ids must be within the vocabulary", param="prompt")
        jobs, inbox = submit([lambda sampling, prompt=prompt: engine.new_request_from_ids(prompt, sampling)
                              for prompt in ids], body, body.max_tokens)
        echo = [prompt if isinstance(prompt, str) else None for prompt in prompts] if body.echo else None
        answer = _Answer(engine, jobs, inbox, request, f"cmpl-{uuid.uuid4().hex}", model, chat=False,
                         top=body.logprobs, n=body.n, echo=echo)
        if body.stream:
            return _sse(answer.chunks(body.include_usage))
        return await answer.whole()

    # the API's own routes, as a 404 lists them (`serve --ui` adds its page's)
    api.state.served = [f"{method} {route.path_format}" for route in api.routes if isinstance(route, APIRoute)
                        for method in sorted(route.methods)]
    return api


def _validation_message(error: dict) -> tuple[str, str | None]:
    """pydantic's first complaint about a request as one line, and the field it names (if any)."""
    kind, loc = error.get("type"), tuple(error.get("loc", ()))
    if kind == "json_invalid":  # loc: ("body", the character where parsing stopped)
        where = f" at character {loc[1]}" if len(loc) > 1 else ""
        return f"the request body is not valid JSON ({error.get('ctx', {}).get('error', 'decode error')}{where})", None
    if loc == ("body",):  # no body, or one that is not a JSON object (a form, text, a list)
        return "the request body must be a JSON object (Content-Type: application/json)", None
    where = ".".join(str(part) for part in loc[1:])
    if kind == "too_short" and error.get("ctx", {}).get("actual_length") == 0:  # an empty list of messages
        return f"{where} is empty", where or None  # not "List should have at least 1 item after validation, not 0"
    message = error.get("msg", "invalid request")
    return (f"{where}: {message}" if where else message), where or None


def _sse(chunks: AsyncIterator[dict | str]) -> StreamingResponse:
    """A stream's chunks as server-sent events; a str is a comment line (`: text`), which clients skip."""
    async def lines():
        async for chunk in chunks:
            yield f": {chunk}\n\n" if isinstance(chunk, str) else f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class _Answer:
    """A completion's choices (one engine request each) turned into OpenAI's answer: chunk by chunk, or
    whole at the end. echo: each prompt's text as given (None: a prompt of token ids) to put before its
    choices' completions; None: no echo."""

    def __init__(self, engine: Engine, jobs: list[EngineRequest], inbox: asyncio.Queue, http: Request,
                 answer_id: str, model: str, chat: bool, top: int | None, n: int = 1,
                 echo: list[str | None] | None = None, replies: RecentReplies | None = None) -> None:
        self.engine, self.jobs, self.inbox, self.http, self.replies = engine, jobs, inbox, http, replies
        self.id, self.model, self.chat, self.top, self.n, self.echo = answer_id, model, chat, top, n, echo
        self.created = now()
        self.prompt_tokens: list[list[PromptToken]] = [[] for _ in jobs]  # each choice's, as its chunks report them

    async def events(self) -> AsyncIterator[tuple[int, Event | None]]:
        """The choices' events, each with its index, until every one has finished; cancels those still
        running if the client leaves or the caller stops. (0, None) when nothing came for a while and a
        measurement holds the engine (Engine.call: the page's Lab or precision check)."""
        running, check_at = len(self.jobs), time.monotonic() + WAIT_S
        try:
            while running:
                try:
                    index, event = await asyncio.wait_for(self.inbox.get(), WAIT_S)
                except asyncio.TimeoutError:
                    event = None
                if time.monotonic() >= check_at:  # also while tokens flow: a whole answer's client may go
                    if await self.http.is_disconnected():
                        return
                    check_at = time.monotonic() + WAIT_S
                if event is not None:
                    if isinstance(event, Finished) and self.replies is not None:
                        self.replies.remember(event.text, self.jobs[index].generated_ids)
                    yield index, event
                    running -= isinstance(event, Finished)
                elif self.engine.calling in HELD_BY:
                    yield 0, None
        finally:
            for job in self.jobs:
                if not job.is_finished:
                    job.cancel()

    def _logprobs(self, steps: list[DecodeStep], offset: int = 0, echoed: list[Listed] | None = None) -> dict | None:
        """The steps' logprobs as the API shapes them, after an echoed prompt's; offset: the characters of
        text streamed before."""
        if self.top is None:
            return None
        tokenizer = self.engine.tokenizer
        if self.chat:
            return {"content": [chat_logprob(step, tokenizer, self.top) for step in steps]}
        return completion_logprobs([*(echoed or []), *listed_steps(steps)], tokenizer, self.top, offset)

    def _echoed(self, index: int) -> tuple[str, list[Listed]]:
        """Choice index's prompt as echo returns it: its text, and its tokens with the logprobs reported."""
        listed = listed_prompt(self.jobs[index].prompt_ids, self.prompt_tokens[index], self.engine.tokenizer)
        given = self.echo[index // self.n]
        return (given if given is not None else "".join(piece for *_, piece in listed)), listed

    def _chunk(self, *choices: dict) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": list(choices)}

    async def chunks(self, include_usage: bool) -> AsyncIterator[dict | str]:
        if self.chat:
            yield self._chunk(*({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None} for index in range(len(self.jobs))))
        streamed = [0] * len(self.jobs)  # characters of text sent, for each choice
        finished: list[Finished | None] = [None] * len(self.jobs)
        echoed = [self.echo is None] * len(self.jobs)  # whether the prompt went out (or has not to)
        told = False  # that a measurement holds the engine (once: a comment, which clients skip)
        async for index, event in self.events():
            if event is None:
                if not told:
                    told = True
                    held_by = HELD_BY.get(self.engine.calling, "a measurement")  # it may have ended meanwhile
                    yield f"waiting: {held_by} holds the engine until it ends"
            elif isinstance(event, PrefillChunk):
                self.prompt_tokens[index] += event.prompt_logprobs
            elif not echoed[index] and (isinstance(event, DecodeStep)
                                        or isinstance(event, Finished) and event.reason != "error"):
                echoed[index] = True  # the prompt once it is prefilled, before its completion
                text, listed = self._echoed(index)
                yield self._chunk({"index": index, "text": text, "logprobs": self._logprobs([], 0, listed),
                                   "finish_reason": None})
                streamed[index] = len(text)
            if isinstance(event, DecodeStep) and (event.text or self.top is not None):
                logprobs = self._logprobs([event], streamed[index])
                streamed[index] += len(event.text)
                text = {"delta": {"content": event.text}} if self.chat else {"text": event.text}
                yield self._chunk({"index": index, **text, "logprobs": logprobs, "finish_reason": None})
            elif isinstance(event, Finished):
                if event.reason == "error":
                    yield {"error": APIError(500, event.error or "the engine failed", "server_error").body()["error"]}
                    return
                finished[index] = event
                end = {"delta": {}} if self.chat else {"text": ""}
                chunk = self._chunk({"index": index, **end, "logprobs": None, "finish_reason": finish_reason(event)})
                chunk["timings"] = timings(event)  # this choice's
                yield chunk
        if include_usage and all(finished):
            yield {**self._chunk(), "usage": usage(finished, self.n)}

    async def whole(self) -> dict:
        steps: list[list[DecodeStep]] = [[] for _ in self.jobs]
        finished: list[Finished | None] = [None] * len(self.jobs)
        async for index, event in self.events():
            if isinstance(event, DecodeStep):
                steps[index].append(event)
            elif isinstance(event, PrefillChunk):
                self.prompt_tokens[index] += event.prompt_logprobs
            elif isinstance(event, Finished):
                finished[index] = event
        if not all(finished):  # the client left; nobody reads this
            return JSONResponse({}, status_code=499)
        if error := next((f for f in finished if f.reason == "error"), None):
            raise APIError(500, error.error or "the engine failed", "server_error")
        choices = []
        for index, (done, its_steps) in enumerate(zip(finished, steps)):
            prompt, echoed = self._echoed(index) if self.echo is not None else ("", None)
            if self.chat:
                content = {"message": {"role": "assistant", "content": done.text}}
            else:
                content = {"text": prompt + done.text}
            choices.append({"index": index, **content, "logprobs": self._logprobs(its_steps, 0, echoed),
                            "finish_reason": finish_reason(done)})
        answer = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                  "created": self.created, "model": self.model, "choices": choices, "usage": usage(finished, self.n)}
        if len(choices) == 1:
            answer["timings"] = timings(finished[0])  # llama.cpp's, for its one request
        else:
            for choice, done in zip(choices, finished):
                choice["timings"] = timings(done)
        return answer
