"""The OpenAI-compatible HTTP API over an `Engine`, with FastAPI (routes, validation) and
sse-starlette (server-sent events, client hang-ups).

Every error is an OpenAI error object `{"error": {"message", "type", "param", "code"}}`: 400 for
a body the client can fix (malformed, unknown or ill-typed fields, a prompt beyond the context),
401 for a missing or wrong API key (when the server has one), 404 for an unknown model or route,
429 with `Retry-After` when the queue is full, 500 for a request that failed while decoding (only
that one), 503 while shutting down.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException

from dflow_rt.serve.engine import Engine, Event, Handle, Params, Refused
from dflow_rt.serve.schemas import ChatRequest, CompletionRequest, Sampling

COMPLETION_DEFAULT_MAX_TOKENS = 16  # the OpenAI completions default; chat defaults to the rest of the context
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
               429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}
STATUS_OF_FINISH = {"error": 500, "shutdown": 503}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def chat_ids(tokenizer, request: ChatRequest) -> list[int]:
    """The conversation in the target tokenizer's chat template (the project's template for a
    tokenizer without one), ready for the assistant's turn; `dflow_rt.data.prompts.chat_text` for
    one user message."""
    turns = [{"role": m.role, "content": m.text()} for m in request.messages]
    try:
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        else:
            from dflow_rt.data.synth import render_chat

            text = render_chat(turns, add_generation_prompt=True)
    except Exception as err:  # jinja raises plain exceptions (roles out of order, ...)
        raise Refused(400, f"the chat template refused these messages: {err}", "messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


def create_app(engine: Engine, model_name: str, shutdown_grace_s: float = 10.0, api_key: str | None = None) -> FastAPI:
    """The app; its lifespan starts the engine thread and, at shutdown, ends what is left. With
    `api_key`, every route but /health answers only requests that carry `Authorization: Bearer KEY`."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not engine.alive():
            engine.start()
        yield
        engine.drain(0.0)
        await asyncio.to_thread(engine.close)

    app = FastAPI(title="dflow-rt", lifespan=lifespan)
    app.state.engine = engine
    created = int(time.time())

    if api_key:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def _authorized(request: Request, call_next):
            given = request.headers.get("authorization", "").encode()
            if request.url.path != "/health" and not hmac.compare_digest(given, expected):  # constant time
                what = "a wrong API key" if given else "no API key"
                return error_response(401, f"this server needs an API key (Authorization: Bearer KEY); the request "
                                           f"carried {what}", code="invalid_api_key",
                                      headers={"WWW-Authenticate": "Bearer"})
            return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return _refuse(engine, 400, f"malformed JSON body: {first.get('msg')}")
        param = ".".join(loc) or None
        return _refuse(engine, 400, f"{param or 'body'}: {first.get('msg')}" + (
            f" ({len(exc.errors()) - 1} more errors)" if len(exc.errors()) > 1 else ""), param)

    @app.exception_handler(Refused)
    async def _refused(_: Request, exc: Refused) -> JSONResponse:
        return _refuse(engine, exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = engine.alive()
        return JSONResponse({"status": "ok" if ok else "stopped", "failure": engine.failure,
                             "running": engine.running(), "in_flight": engine.in_flight()},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = engine.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "dflow-rt", "max_model_len": engine.max_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(body, model_name)
        prompt = body.prompt
        ids = prompt if isinstance(prompt, list) else engine.tokenizer.encode(prompt, add_special_tokens=False)
        params = _params(engine, body, ids, body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "prompt")
        return await _answer(request, engine, params, body, chat=False, grace_s=shutdown_grace_s)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        _check_model(body, model_name)
        params = _params(engine, body, chat_ids(engine.tokenizer, body), body.limit(), None, "messages")
        return await _answer(request, engine, params, body, chat=True, grace_s=shutdown_grace_s)

    return app


def _refuse(engine: Engine, status: int, message: str, param: str | None = None,
            code: str | None = None) -> JSONResponse:
    if status == 400:
        engine.metrics.rejected.labels("400").inc()
    headers = {"Retry-After": "1"} if status == 429 else None
    return error_response(status, message, param, code, headers)


def _check_model(body: Sampling, model_name: str) -> None:
    if body.model != model_name:
        raise Refused(404, f"the model {body.model!r} does not exist: this server serves {model_name!r}",
                      "model", "model_not_found")


def _params(engine: Engine, body: Sampling, ids: list[int], max_tokens: int | None, default: int | None,
            prompt_param: str) -> Params:
    asked = Params(tuple(ids), max_tokens, body.temperature, body.top_p, max(body.top_k, 0), body.seed,
                   tuple(body.stops()), tuple(body.stop_token_ids))
    return engine.check(asked, default, prompt_param)


async def _answer(request: Request, engine: Engine, params: Params, body: Sampling, chat: bool,
                  grace_s: float) -> Response:
    handle = engine.submit(params)
    head = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
            "model": body.model}
    prompt_tokens = len(params.prompt_ids)

    def usage(n: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}

    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = _stream(handle, head, chat, usage if include_usage else None)
        # on shutdown sse-starlette waits this long for the stream; the engine ends it within grace_s
        return EventSourceResponse(events, sep="\n", shutdown_grace_period=grace_s + 2.0)
    text, last = await _collect(request, handle)
    if last.finish in STATUS_OF_FINISH:
        status = STATUS_OF_FINISH[last.finish]
        return error_response(status, last.error or "the request failed", code=last.finish)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": last.finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish}
    obj = "chat.completion" if chat else "text_completion"
    return JSONResponse({**head, "object": obj, "choices": [choice], "usage": usage(last.completion_tokens)})


async def _collect(request: Request, handle: Handle) -> tuple[str, Event]:
    """The whole answer; a client that hangs up meanwhile has its request cancelled."""

    async def hangup() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        handle.cancel()

    watcher = asyncio.ensure_future(hangup())
    parts, last = [], Event()
    try:
        async for event in handle.events():
            parts.append(event.text)
            last = event
    finally:
        watcher.cancel()
        handle.cancel()  # a no-op once finished; frees the row if this task itself was cancelled
    return "".join(parts), last


async def _stream(handle: Handle, head: dict, chat: bool, usage: Callable[[int], dict] | None) -> AsyncIterator[str]:
    """Server-sent events: one chunk per step's new text, the finish reason, usage if asked, [DONE].
    A hang-up ends this generator (sse-starlette cancels it), which frees the row before the next step."""
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str, finish: str | None, first: bool = False) -> str:
        if chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text} if text or not finish else {}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return json.dumps({**head, "object": obj, "choices": [choice]})

    try:
        if chat:
            yield chunk("", None, first=True)
        async for event in handle.events():
            if event.finish in STATUS_OF_FINISH or event.finish == "cancelled":
                if event.text:
                    yield chunk(event.text, None)
                status = STATUS_OF_FINISH.get(event.finish, 500)
                yield json.dumps(error_body(status, event.error or "the request was cancelled", code=event.finish))
                break
            if event.text or event.finish:
                yield chunk(event.text, event.finish)
            if event.finish and usage is not None:
                yield json.dumps({**head, "object": obj, "choices": [], "usage": usage(event.completion_tokens)})
        yield "[DONE]"
    finally:
        handle.cancel()
