"""The OpenAI-compatible HTTP front: Starlette routes served by uvicorn on the router's event loop.

    POST /v1/completions        text or token-id prompt; streamed (server-sent events) or not
    POST /v1/chat/completions   messages through the model's chat template; streamed or not
    GET  /v1/models             the served model
    GET  /health                200 while the server accepts requests, 503 while it shuts down
    GET  /metrics               Prometheus text format (``controller/metrics.py``)

Same security rules as gRPC: 127.0.0.1 unless configured, a non-local bind needs TLS and a bearer token
(the config enforces it), and with ``server.auth_token_env`` set every route but ``/health`` needs
``Authorization: Bearer <token>``. Bodies are parsed and validated here (``frontend/openai_protocol.py``);
malformed JSON or a bad parameter is an OpenAI error object with HTTP 400 naming the parameter and never
reaches the router. Router refusals map to 429 (queue full), 503 (unavailable), 504 (timeout).

A stream waits for the request's first token before it sends headers, so admission errors still get
their HTTP status; an error after that arrives as an ``error`` event followed by ``data: [DONE]``. A
client that disconnects cancels its request (its KV is freed on every worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from controller.metrics import CONTENT_TYPE, ServingMetrics
from controller.router import Router
from controller.routing import Delta, RouterError
from frontend.openai_output import ChoiceResult, ResponseBuilder, best_choices, model_list, now, usage
from frontend.openai_protocol import ROUTER_STATUS, OpenAIError, OpenAIProtocol, ParsedRequest

log = logging.getLogger("magicserve.http")

MAX_BODY_BYTES = 8 * 1024 * 1024


class OpenAIServer:
    """The routes over one router. ``status_fn``: ``Cluster.statuses``; ``store_fn``: the cluster's KV store's
    ``occupancy_now`` (None: the server runs no store); both for ``/metrics``."""

    def __init__(self, router: Router, protocol: OpenAIProtocol, metrics: ServingMetrics, status_fn,
                 token: str | None = None, max_body_bytes: int = MAX_BODY_BYTES, store_fn=None):
        self.router = router
        self.protocol = protocol
        self.metrics = metrics
        self.status_fn = status_fn
        self.store_fn = store_fn
        self._expected = f"Bearer {token}".encode() if token else None
        self.max_body_bytes = max_body_bytes
        self.created = now()
        self.accepting = True
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.scrape, methods=["GET"]),
        ], exception_handlers={404: self._not_found, 405: self._not_allowed})

    # -- routes -----------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, self.protocol.completion)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, self.protocol.chat)

    async def models(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        return JSONResponse(model_list(self.protocol.model_name, self.created, self.protocol.max_model_len))

    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if self.accepting else 503)

    async def scrape(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        q = self.router.queue_stats()
        self.metrics.queue(q["active"], q["waiting"])
        self.metrics.observe_instances(await self.status_fn())
        if self.store_fn is not None:
            self.metrics.observe_store(await self.store_fn())
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE)

    # -- generation -------------------------------------------------------------------------------

    async def _generate(self, request: Request, parse) -> Response:
        try:
            if (denied := self._denied(request)) is not None:
                return denied
            raw = await self._body(request)
            # JSON parsing and tokenization of a large body run off the event loop: other streams go on
            req = await asyncio.to_thread(lambda: parse(_parse_json(raw)))
        except OpenAIError as err:
            self.metrics.failed("NOT_FOUND" if err.status == 404 else "INVALID_ARGUMENT")
            return _error(err)
        rid = self.protocol.new_id(req.kind)
        out = ResponseBuilder(req, self.protocol.tokenizer, rid, now())
        items = self.router.generate(rid, req.prompt_ids, req.params, req.priority)
        try:
            # admission and prefill: errors here still get an HTTP status
            first = await _unless_disconnected(request, items.__anext__())
        except RouterError as err:
            return _error(_router_error(err))
        except StopAsyncIteration:
            return _error(OpenAIError(503, "request ended without output", code="unavailable"))
        except _ClientGone:
            await items.aclose()  # cancels the request wherever it waits or runs
            return Response(status_code=499)
        if req.stream:
            return StreamingResponse(self._sse(req, out, first, items), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
        try:
            choices, prompt_logprobs, final = await _unless_disconnected(request, _collect(first, items, req.n))
        except RouterError as err:
            return _error(_router_error(err))
        except _ClientGone:  # _collect closed the request's stream: cancelled everywhere
            return Response(status_code=499)
        if req.params.num_sequences > req.n:
            choices = best_choices(choices, req.n)
        body = out.response(choices, final.prompt_tokens, final.completion_tokens, prompt_logprobs,
                            final.cached.tokens)
        return JSONResponse(body, headers={"X-Request-Id": rid})

    async def _sse(self, req: ParsedRequest, out: ResponseBuilder, first, items):
        """The event stream of one request (the first item already taken). A delta goes out when it has text,
        token ids, or (echo) the prompt to carry; the chat stream's first chunk of a choice carries the role;
        each choice ends with a chunk carrying its finish reason."""
        started: set[int] = set()  # choices whose first chunk went out
        prompt_logprobs = None
        completion_tokens = 0
        try:
            item = first
            while True:
                if isinstance(item, Delta):
                    prompt_logprobs = item.prompt_logprobs if item.prompt_logprobs is not None else prompt_logprobs
                    completion_tokens += len(item.token_ids)
                    fresh = item.index not in started
                    if req.tools is not None:
                        for chunk in self._tool_chunks(req, out, item, fresh, completion_tokens):
                            started.add(item.index)
                            yield _event(chunk)
                    elif item.text or item.token_ids or (fresh and (req.kind == "chat" or req.echo)):
                        started.add(item.index)
                        yield _event(out.chunk(item.index, item.text, item.token_ids, item.logprobs, first=fresh,
                                               prompt_logprobs=prompt_logprobs,
                                               usage_so_far=self._usage_so_far(req, completion_tokens)))
                    if item.finish_reason is not None:
                        for chunk in self._last_chunks(req, out, item.index, item.finish_reason, started,
                                                       prompt_logprobs, completion_tokens):
                            yield _event(chunk)
                else:
                    for index in range(req.n):  # choices that ended without a delta of their own
                        if index not in item.finished_choices:
                            for chunk in self._last_chunks(req, out, index, item.finish_reason, started,
                                                           prompt_logprobs, completion_tokens):
                                yield _event(chunk)
                    if req.include_usage:
                        yield _event(out.usage_chunk(item.prompt_tokens, item.completion_tokens, item.cached.tokens))
                    break
                item = await items.__anext__()
        except RouterError as err:
            yield _event(_router_error(err).body())
        except StopAsyncIteration:
            yield _event(OpenAIError(503, "request ended without a final message", code="unavailable").body())
        finally:
            await items.aclose()  # a disconnected client cancels the request
        yield b"data: [DONE]\n\n"

    def _tool_chunks(self, req: ParsedRequest, out: ResponseBuilder, item: Delta, fresh: bool,
                     completion_tokens: int) -> list[dict]:
        """A chat delta's chunks when the request has tools: the content and tool-call deltas its text makes
        (text that may begin a call is held); the token ids and log-probabilities ride on the first, or on an
        empty delta when everything is held."""
        deltas = out.tool_deltas(item.index, item.text or "")
        if not deltas and (fresh or (item.token_ids and (req.return_token_ids or req.logprobs is not None))):
            deltas = [{}]
        usage_so_far = self._usage_so_far(req, completion_tokens)
        return [out.chunk(item.index, None, item.token_ids if j == 0 else (), item.logprobs if j == 0 else (),
                          first=fresh and j == 0, usage_so_far=usage_so_far, delta=delta)
                for j, delta in enumerate(deltas)]

    def _last_chunks(self, req: ParsedRequest, out: ResponseBuilder, index: int, reason: str, started: set[int],
                     prompt_logprobs, completion_tokens: int) -> list[dict]:
        """A choice's closing chunk (its finish reason), after what a tool-call stream still held; a choice
        that never sent a chunk sends its role (chat) or its echoed prompt (completions) in the first."""
        usage_so_far = self._usage_so_far(req, completion_tokens)
        chunks = []
        if req.tools is not None:
            deltas, reason = out.tool_finish(index, reason)
            for delta in deltas:
                chunks.append(out.chunk(index, None, first=index not in started, usage_so_far=usage_so_far,
                                        delta=delta))
                started.add(index)
        fresh = index not in started
        started.add(index)
        text = None if req.kind == "chat" and not fresh else ""
        chunks.append(out.chunk(index, text, reason=reason, first=fresh, prompt_logprobs=prompt_logprobs,
                                usage_so_far=usage_so_far))
        return chunks

    @staticmethod
    def _usage_so_far(req: ParsedRequest, completion_tokens: int) -> dict | None:
        """stream_options.continuous_usage_stats: the usage up to this chunk, in every chunk."""
        return usage(len(req.prompt_ids), completion_tokens) if req.continuous_usage else None

    # -- helpers ----------------------------------------------------------------------------------

    def _denied(self, request: Request) -> Response | None:
        if self._expected is None:
            return None
        got = request.headers.get("authorization", "").encode()
        if hmac.compare_digest(got, self._expected):
            return None
        self.metrics.failed("UNAUTHENTICATED")
        return _error(OpenAIError(401, "missing or wrong bearer token (Authorization: Bearer <token>)",
                                  code="invalid_api_key"))

    async def _body(self, request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise OpenAIError(400, f"request body: larger than {self.max_body_bytes} bytes", code="body_too_large")
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > self.max_body_bytes:
                raise OpenAIError(400, f"request body: larger than {self.max_body_bytes} bytes", code="body_too_large")
        return bytes(raw)

    async def _not_found(self, request: Request, exc) -> Response:
        return _error(OpenAIError(404, f"{request.url.path}: no such route; routes: /v1/completions, "
                                       "/v1/chat/completions, /v1/models, /health, /metrics", code="not_found"))

    async def _not_allowed(self, request: Request, exc) -> Response:
        return JSONResponse(OpenAIError(405, f"{request.method} {request.url.path}: method not allowed").body(),
                            status_code=405)


def _parse_json(raw: bytes):
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise OpenAIError(400, f"request body: not valid JSON ({err})", code="invalid_json") from None


async def _collect(first, items, n: int) -> tuple[list[ChoiceResult], list | None, object]:
    """(each sequence's result, the prompt's log-probabilities, the Final) of a whole request."""
    choices: dict[int, ChoiceResult] = {}
    prompt_logprobs, item = None, first
    try:
        while True:
            if isinstance(item, Delta):
                c = choices.setdefault(item.index, ChoiceResult(item.index))
                c.text += item.text
                c.token_ids.extend(item.token_ids)
                c.logprobs.extend(item.logprobs)
                c.finish_reason = item.finish_reason or c.finish_reason
                if item.prompt_logprobs is not None:
                    prompt_logprobs = list(item.prompt_logprobs)
            else:
                for index in range(max(n, len(choices))):
                    c = choices.setdefault(index, ChoiceResult(index))
                    c.finish_reason = c.finish_reason or item.finish_reason
                return list(choices.values()), prompt_logprobs, item
            item = await items.__anext__()
    finally:
        await items.aclose()


class _ClientGone(Exception):
    """The client closed its connection before the response was ready."""


async def _unless_disconnected(request: Request, awaitable):
    """``awaitable``'s result, or _ClientGone (with ``awaitable`` cancelled) if the client leaves first."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not work.done():
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        raise _ClientGone()
    return work.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _error(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def _router_error(err: RouterError) -> OpenAIError:
    status = ROUTER_STATUS.get(err.code, 503)
    return OpenAIError(status, str(err), code=err.code.lower())


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers."""

    def capture_signals(self):
        return contextlib.nullcontext()


class HttpServer:
    """uvicorn serving an ASGI app on the running event loop, on a socket bound here (a port in use is an
    error naming ``server.http_port``). uvicorn installs no signal handlers: the serving process owns
    SIGINT/SIGTERM and drains."""

    def __init__(self, app, host: str, port: int, tls_cert: str = "", tls_key: str = ""):
        self.host, self.port = host, port
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
                                ssl_certfile=tls_cert or None, ssl_keyfile=tls_key or None, timeout_graceful_shutdown=5)
        self._server = _Server(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        """Bind and serve in the background; returns the bound port."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as err:
            sock.close()
            raise RuntimeError(f"server.http_port: cannot bind {self.host}:{self.port} ({err.strerror})") from None
        sock.listen(2048)
        sock.setblocking(False)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                raise RuntimeError(f"server.http_port: uvicorn stopped at start ({self._task.exception()})")
            await asyncio.sleep(0.02)
        return sock.getsockname()[1]

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)
