"""The OpenAI-compatible HTTP layer over an Engine: Starlette routes, server-sent events,
errors in OpenAI's shape, Prometheus metrics. Nothing here schedules or computes: a request is
checked, submitted to the engine, and its deltas are relayed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jax_kv.decode.sampling import GREEDY_BELOW, Sampling
from jax_kv.engine import (
    FINISH_ERROR,
    Completion,
    Delta,
    Engine,
    EngineError,
    QueueFull,
)
from jax_kv.engine import Request as EngineRequest
from jax_kv.server.metrics import ServerMetrics
from jax_kv.server.protocol import APIError, ChatBody, CompletionBody, parse

MAX_BODY_BYTES = 1 << 20
RETRY_AFTER_S = 1


class ServerState:
    """What the routes share: the engine, the served name, readiness and draining flags."""

    def __init__(
        self, engine: Engine, model_name: str, api_key: str | None, max_body_bytes: int
    ) -> None:
        self.engine, self.model, self.model_name = engine, engine.model, model_name
        self.api_key, self.max_body_bytes = api_key, max_body_bytes
        self.ready = threading.Event()
        self.draining = False
        self.failure: BaseException | None = None  # the warm-up's, if it failed
        self.on_failure: Callable[[], None] | None = None  # main.run: stop the server
        self.created = int(time.time())
        self.metrics = ServerMetrics(engine)
        self._warming: threading.Thread | None = None

    def start(self, warm_up: bool = True) -> threading.Thread:
        """Warms the engine up and starts its driver on a thread; `ready` is set after. A
        failure is kept (`failure`: /health and every request say so) and reported, not
        left to the thread; a shutdown while it compiles ends it without a driver."""

        def run() -> None:
            try:
                if warm_up:
                    self.engine.warm_up()
                self.engine.start()
            except BaseException as error:  # noqa: BLE001 - kept and reported
                if self.draining:
                    return  # stopped while compiling: the refusal is the shutdown's
                self.failure = error
                print(f"jax_kv: the engine failed to warm up: {type(error).__name__}: {error}",
                      file=sys.stderr)  # fmt: skip
                if self.on_failure is not None:
                    self.on_failure()
                return
            self.ready.set()

        self._warming = threading.Thread(target=run, name="jax_kv-warm-up", daemon=True)
        self._warming.start()
        return self._warming

    def join_warm_up(self) -> None:
        """Waits for the warm-up thread (a shutdown while it compiles waits for its current
        step: the engine then has one user again)."""
        if self._warming is not None:
            self._warming.join()


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _read_body(state: ServerState, request: HttpRequest) -> bytes:
    declared = request.headers.get("content-length")
    limit = state.max_body_bytes
    too_big = APIError(413, f"the body exceeds {limit} bytes", code="body_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def _check_access(state: ServerState, request: HttpRequest) -> None:
    if state.api_key is not None:
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
            raise APIError(
                401, "a valid API key is required: Authorization: Bearer <key>",
                type="authentication_error", code="invalid_api_key",
            )  # fmt: skip


def _check_serving(state: ServerState) -> None:
    if state.failure is not None:
        raise APIError(500, f"the engine failed to warm up: {state.failure}",
                       type="server_error", code="engine_failed")  # fmt: skip
    if state.draining or not state.engine.accepting:
        raise APIError(503, "the server is shutting down", type="server_error", code="draining")
    if not state.ready.is_set():
        raise APIError(503, "the server is warming up; retry shortly", type="server_error",
                       code="warming_up", headers={"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip


class _Stream:
    """An engine request's deltas, delivered to the event loop (the engine's thread only
    calls `notify`, which schedules a wake-up)."""

    def __init__(self, request: EngineRequest) -> None:
        self.request = request
        self.loop = asyncio.get_running_loop()
        self.event = asyncio.Event()
        self.read = 0
        request.add_listener(lambda: self.loop.call_soon_threadsafe(self.event.set))

    async def next(self) -> tuple[list[Delta], Completion | None]:
        """The deltas not yet read (at least one) and the completion once all are read."""
        while True:
            self.event.clear()  # cleared before the read: a notify after it wakes the wait
            deltas, completion = self.request.deltas_from(self.read)
            if deltas or completion is not None:
                self.read += len(deltas)
                return deltas, completion
            await self.event.wait()


async def _disconnected(request: HttpRequest) -> None:
    """Returns when the client goes away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(
    engine: Engine,
    *,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    warm_up: bool = True,
) -> Starlette:
    """The ASGI app. Its lifespan warms the engine up and starts its driver (on a thread:
    /health answers 503 until it is ready) and, at shutdown, drains it."""
    state = ServerState(engine, model_name, api_key, max_body_bytes)

    def check_model(name: str) -> None:
        if name != state.model_name:
            raise APIError(
                404, f"model: {name!r} is not served here (this server serves "
                f"{state.model_name!r})", param="model", code="model_not_found",
            )  # fmt: skip

    def submit(body: Any, ids: list[int], max_tokens: int | None, param: str) -> EngineRequest:
        if body.n != 1:
            raise APIError(400, f"n: only n=1 is supported, got {body.n}", param="n")
        for name in ("logprobs", "best_of"):
            if getattr(body, name) not in (None, False, 0, 1):
                raise APIError(400, f"{name}: not supported", param=name)
        limit = state.engine.max_len
        if len(ids) >= limit:
            raise APIError(
                400, f"{param}: {len(ids)} tokens leave no room under the context length "
                f"{limit}", param=param, code="context_length_exceeded",
            )  # fmt: skip
        if max_tokens is None:
            max_tokens = limit - len(ids)
        elif len(ids) + max_tokens > limit:
            raise APIError(
                400, f"max_tokens: {len(ids)} prompt tokens + max_tokens {max_tokens} exceed "
                f"the context length {limit}", param="max_tokens",
                code="context_length_exceeded",
            )  # fmt: skip
        seed = body.seed if body.seed is not None else secrets.randbits(63)
        temperature = body.temperature if body.temperature >= GREEDY_BELOW else 0.0
        sampling = Sampling(temperature=temperature, top_k=body.top_k, top_p=body.top_p, seed=seed)
        try:
            return state.engine.submit(
                ids, max_tokens, sampling, stop=body.stop,
                request_id=f"{uuid.uuid4().hex[:24]}",
            )  # fmt: skip
        except QueueFull as e:
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None  # fmt: skip
        except EngineError as e:
            raise APIError(503, str(e), type="server_error", code="draining") from None
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None

    async def endpoint(http: HttpRequest, chat: bool) -> Response:
        try:
            _check_access(state, http)
            _check_serving(state)
            raw = await _read_body(state, http)
            body = parse(ChatBody if chat else CompletionBody, raw)
            check_model(body.model)
            if chat:
                try:
                    text = state.model.apply_chat_template(
                        [{"role": m.role, "content": m.text()} for m in body.messages]
                    )
                    ids = state.model.encode(text)
                except ValueError as e:
                    raise APIError(400, f"messages: {e}", param="messages") from None
                max_tokens = body.max_completion_tokens or body.max_tokens
                param = "messages"
            else:
                prompt = body.prompt
                if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                    if len(prompt) != 1:
                        raise APIError(400, "prompt: one prompt per request (a list of one "
                                       "string)", param="prompt")  # fmt: skip
                    prompt = prompt[0]
                if isinstance(prompt, str):
                    try:
                        ids = state.model.encode(prompt)
                    except ValueError as e:
                        raise APIError(400, f"prompt: {e}", param="prompt") from None
                else:
                    ids = list(prompt)
                if not ids:
                    raise APIError(400, "prompt: expected at least one token", param="prompt")
                max_tokens, param = body.max_tokens, "prompt"
            request = submit(body, ids, max_tokens, param)
        except APIError as e:
            state.metrics.refused(e.status)
            return _error_response(e)
        state.metrics.admitted()
        reply = _Reply(state, request, chat, len(ids), body.stream_options)
        if body.stream:
            return StreamingResponse(
                reply.events(http), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )  # fmt: skip
        return await reply.whole(http)

    async def completions(http: HttpRequest) -> Response:
        return await endpoint(http, chat=False)

    async def chat_completions(http: HttpRequest) -> Response:
        return await endpoint(http, chat=True)

    async def models(http: HttpRequest) -> Response:
        try:
            _check_access(state, http)
        except APIError as e:
            return _error_response(e)
        card = {"id": state.model_name, "object": "model", "created": state.created,
                "owned_by": "jax_kv"}  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    async def health(http: HttpRequest) -> Response:
        if state.failure is not None:
            return JSONResponse({"status": "failed", "error": str(state.failure)}, status_code=500)
        if state.draining or not state.engine.accepting:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not state.ready.is_set():
            return JSONResponse({"status": "warming up"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(http: HttpRequest) -> Response:
        data, content_type = state.metrics.render()
        return Response(data, media_type=content_type)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.start(warm_up)
        yield
        state.draining = True
        await asyncio.to_thread(state.engine.shutdown, True, DRAIN_TIMEOUT_S)
        await asyncio.to_thread(state.join_warm_up)

    app = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.jax_kv = state
    return app


DRAIN_TIMEOUT_S = 30.0


class _Reply:
    """One request's answer: whole (JSON) or streamed (server-sent events)."""

    def __init__(self, state: ServerState, request: EngineRequest, chat: bool, prompt_tokens: int,
                 stream_options: Any) -> None:  # fmt: skip
        self.state, self.request, self.chat = state, request, chat
        self.prompt_tokens = prompt_tokens
        self.include_usage = bool(stream_options and stream_options.include_usage)
        self.id = ("chatcmpl-" if chat else "cmpl-") + request.id
        self.created = int(time.time())
        self.t0 = time.perf_counter()

    def _usage(self, completion: Completion) -> dict[str, int]:
        n = completion.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n,
                "total_tokens": self.prompt_tokens + n}  # fmt: skip

    def _envelope(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.state.model_name, "choices": choices, **extra}  # fmt: skip

    async def _deltas(self) -> AsyncIterator[tuple[list[Delta], Completion | None]]:
        stream = _Stream(self.request)
        last = None
        while True:
            deltas, completion = await stream.next()
            now = time.perf_counter()
            for _ in deltas:
                if last is None:
                    self.state.metrics.first_token(now - self.t0)
                else:
                    self.state.metrics.inter_token(now - last)
                last = now
            yield deltas, completion
            if completion is not None:
                self.state.metrics.finished(completion)
                return

    async def whole(self, http: HttpRequest) -> Response:
        async def wait() -> Completion:
            async for _, completion in self._deltas():
                if completion is not None:
                    return completion
            raise AssertionError("unreachable")

        done = asyncio.ensure_future(wait())
        gone = asyncio.ensure_future(_disconnected(http))
        try:
            await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not done.done():
                self.request.cancel()  # the client left: its slot is released next step
            gone.cancel()
        if not done.done():
            done.cancel()
            return Response(status_code=499)
        completion = done.result()
        if completion.finish_reason == FINISH_ERROR:
            e = APIError(500, f"generation failed: {completion.error}", type="server_error")
            return _error_response(e)
        text = completion.text if completion.text is not None else ""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": completion.finish_reason}  # fmt: skip
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": completion.finish_reason}  # fmt: skip
        return JSONResponse(self._envelope([choice], usage=self._usage(completion)))

    def _chunk(self, text: str | None, finish: str | None, role: bool = False) -> str:
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            body = self._envelope([choice])
            body["object"] = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            body = self._envelope([choice])
        if self.include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"

    async def events(self, http: HttpRequest) -> AsyncIterator[str]:
        # A client that closes the stream makes Starlette cancel this generator: the finally
        # cancels the engine request, whose slot and granules go at the next engine step.
        finished = False
        try:
            if self.chat:
                yield self._chunk("", None, role=True)
            # A model without a tokenizer (random weights, prompts as token ids) has no text:
            # its tokens still reach the client as events, empty-text ones, so a client sees
            # progress and a benchmark its token times.
            textless = self.state.model.tokenizer is None
            async for deltas, completion in self._deltas():
                text = "".join(d.text for d in deltas)
                if text or (textless and deltas):
                    yield self._chunk(text, None)
                if completion is None:
                    continue
                finished = True
                if completion.finish_reason == FINISH_ERROR:
                    err = APIError(500, f"generation failed: {completion.error}",
                                   type="server_error")  # fmt: skip
                    yield f"data: {json.dumps(err.body())}\n\n"
                    return
                yield self._chunk(None if self.chat else "", completion.finish_reason)
                if self.include_usage:
                    usage = self._envelope([], usage=self._usage(completion))
                    if self.chat:
                        usage["object"] = "chat.completion.chunk"
                    yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                self.request.cancel()
