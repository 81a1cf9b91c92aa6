"""The gateway's HTTP front: OpenAI-compatible endpoints over the skiff protocol.

``HttpFront`` runs an aiohttp server on a thread of its own with its own event
loop, so whatever embeds it (the gateway's ZeroMQ loop, a test) keeps its own
loop; it reaches skiff through ``protocol.AsyncClient`` on ``upstream``, which
may be a worker or the gateway's ZeroMQ front (the gateway then routes).

Endpoints: ``POST /v1/completions`` (``generate``), ``POST
/v1/chat/completions`` (``chat``: the worker renders its chat template),
``POST /v1/embeddings`` (``embed``), ``POST /v1/audio/speech``
(``synthesize`` on ``speech_upstream``, else on ``upstream``), ``GET
/v1/models`` (``models``: the served name, then each worker's real model,
also accepted in requests when every worker serves it), ``GET /health``.
Field mapping: ``shapes``; responses: ``render``; error statuses: ``errors``.

Streams are server-sent events ending in ``data: [DONE]``. The first upstream
reply is awaited before any byte is sent, so a refused request (bad argument,
``queue_full``...) still gets its proper HTTP status; an error after that
arrives as a ``data: {"error": ...}`` event (the ``openai`` client raises it).
A client that disconnects mid-request has its skiff request cancelled.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from edge.logs import get_logger
from protocol.sockets import Curve

from . import models
from .errors import ApiError, bad, not_found
from .media import Speech, embeddings
from .render import Shaper, finish_reason, tokens_of
from .shapes import GenPlan, plan_chat, plan_completion
from .upstream import Pending, Upstream, api_error_of

log = get_logger("gateway.http")

MAX_BODY_BYTES = 8 << 20  # a prompt of a full lane is far smaller
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    return body


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes OpenAI-style JSON with its status."""
    try:
        return await handler(request)
    except ApiError as exc:
        return web.json_response(exc.body(), status=exc.status, headers=exc.headers())
    except web.HTTPException as exc:  # routing: 404, 405, 413 from aiohttp itself
        message = f"{exc.reason}: {request.method} {request.path[:200]}"
        if exc.status == 413:
            message = f"the body is larger than {MAX_BODY_BYTES} bytes"
        error = ApiError(exc.status, message, code=exc.reason.lower().replace(" ", "_"))
        keep = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}  # 405's
        return web.json_response(error.body(), status=exc.status, headers=keep)
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception as exc:
        log.exception("http_internal_error", path=request.path)
        error = api_error_of(exc)
        return web.json_response(error.body(), status=error.status)


class HttpFront:
    """OpenAI-compatible HTTP on its own thread and event loop (see module doc).

    ``ready`` (called on the HTTP thread, so it must be cheap and thread-safe)
    decides ``/health``; without it ``/health`` is 200 while ``upstream``
    answers ``ping``. ``request_timeout_s`` bounds the wait for each upstream
    reply (504 after it); ``health_interval_s`` / ``down_after_s`` pace the
    ping that ``/health`` and the fail-fast 503 rely on (``upstream``).
    """

    def __init__(
        self,
        upstream: str,
        *,
        speech_upstream: str | None = None,
        model_name: str = "skiff",
        ready: Callable[[], bool] | None = None,
        request_timeout_s: float = 120.0,
        health_interval_s: float = 0.5,
        down_after_s: float = 3.0,
        curve: Curve | None = None,
        routing_id: bytes | None = None,
    ) -> None:
        self.upstream_endpoint = upstream
        self._routing_id = routing_id  # the gateway's per-client limits spare this peer
        self.speech_endpoint = speech_upstream
        self.model_name = model_name
        self.ready = ready
        self.request_timeout_s = request_timeout_s
        self._health_timing = {"interval_s": health_interval_s, "down_after_s": down_after_s}
        self._curve = curve  # CURVE keys toward ``upstream`` (and ``speech_upstream``)
        self.port = 0  # the bound port once started (useful with port 0)
        self.created = int(time.time())
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._up: Upstream | None = None
        self._speech: Speech | None = None
        self._upstreams: list[Upstream] = []
        self._ctx_per_lane: int | None = None
        self._aliases: frozenset[str] = frozenset()  # real model names requests may use

    # -- lifecycle (called from any thread) -----------------------------------------

    def start(self, host: str, port: int) -> None:
        """Serve on ``host:port``; returns once the socket is listening."""
        if self._thread is not None:
            raise RuntimeError("HttpFront already started")
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._startup(host, port))
            except BaseException as exc:
                failure.append(exc)
                started.set()
                loop.run_until_complete(self._shutdown())
                loop.close()
                return
            started.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self._shutdown())
                loop.close()

        self._thread = threading.Thread(target=run, name="skiff-http", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0]

    def stop(self) -> None:
        """Stop serving; in-flight requests are cancelled upstream."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        self._thread = None

    async def _startup(self, host: str, port: int) -> None:
        timeout = self.request_timeout_s
        self._up = Upstream(
            self.upstream_endpoint,
            timeout_s=timeout,
            curve=self._curve,
            routing_id=self._routing_id,
            interval_s=self._health_timing["interval_s"],
            down_after_s=self._health_timing["down_after_s"],
        )
        self._upstreams = [self._up]
        speech_up = self._up
        if self.speech_endpoint is not None:
            speech_up = Upstream(
                self.speech_endpoint,
                timeout_s=timeout,
                curve=self._curve,
                interval_s=self._health_timing["interval_s"],
                down_after_s=self._health_timing["down_after_s"],
            )
            self._upstreams.append(speech_up)
        self._speech = Speech(speech_up)
        for up in self._upstreams:
            up.start()
        app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_post("/v1/audio/speech", self._audio_speech)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model}", self._model)
        app.router.add_get("/health", self._health)
        # handler_cancellation: a client that hangs up cancels its handler at
        # once, and the handler's ``finally`` cancels the skiff request.
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        addresses = self._runner.addresses
        self.port = int(addresses[0][1]) if addresses else port
        log.info("http_listening", host=host, port=self.port, upstream=self.upstream_endpoint)

    async def _shutdown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for up in self._upstreams:
            await up.close()
        self._upstreams = []

    @property
    def _upstream(self) -> Upstream:
        assert self._up is not None
        return self._up

    # -- plain endpoints --------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.StreamResponse:
        ready = self.ready() if self.ready is not None else self._upstream.up is True
        if ready:
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "unavailable"}, status=503)

    async def _models(self, request: web.Request) -> web.StreamResponse:
        info = (await self._upstream.call("info")).result
        self._aliases = models.aliases(info, self.model_name)
        data = models.listing(info, self.model_name, self.created)
        return web.json_response({"object": "list", "data": data})

    async def _model(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["model"]
        info = (await self._upstream.call("info")).result
        for entry in models.listing(info, self.model_name, self.created):
            if entry["id"] == name:
                return web.json_response(entry)
        raise not_found(f"The model '{name[:128]}' does not exist", "model_not_found", "model")

    async def _served(self, body: dict[str, Any]) -> dict[str, Any]:
        """The body with a worker's real model name (one every worker serves,
        ``models.aliases``) replaced by the served name; others unchanged."""
        name = body.get("model")
        if not isinstance(name, str) or name == self.model_name:
            return body
        if name not in self._aliases:  # learn the workers' model (a miss is rare)
            try:
                info = (await self._upstream.call("info")).result
                self._aliases = models.aliases(info, self.model_name)
            except ApiError:
                return body  # the model check answers, as with no alias
        return {**body, "model": self.model_name} if name in self._aliases else body

    async def _embeddings(self, request: web.Request) -> web.StreamResponse:
        body = await self._served(await _json_body(request))
        return web.json_response(await embeddings(self._upstream, body, self.model_name))

    async def _audio_speech(self, request: web.Request) -> web.StreamResponse:
        assert self._speech is not None
        return await self._speech.handle(request, await _json_body(request))

    # -- completions ----------------------------------------------------------------

    async def _default_max_tokens(self) -> int | None:
        """A chat with no max_tokens may fill the lane, as OpenAI fills the context."""
        if self._ctx_per_lane is None:
            try:
                info = (await self._upstream.call("info")).result
                self._ctx_per_lane = int(info["n_ctx_per_lane"])
            except (ApiError, KeyError, TypeError, ValueError):
                return None  # skiff's own default then
        return self._ctx_per_lane

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        plan = plan_completion(await self._served(await _json_body(request)), self.model_name)
        return await self._generate(request, plan)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._served(await _json_body(request))
        plan = plan_chat(body, self.model_name, await self._default_max_tokens())
        return await self._generate(request, plan)

    async def _logprobs(
        self, shaper: Shaper, tokens: list[int], infos: list[dict[str, Any]]
    ) -> dict[str, Any] | None:
        if shaper.plan.top_logprobs is None:
            return None
        texts = await self._upstream.token_texts(tokens_of(tokens, infos))
        return shaper.logprobs(tokens, infos, texts)

    async def _generate(self, request: web.Request, plan: GenPlan) -> web.StreamResponse:
        up = self._upstream
        up.check_up()
        shaper = Shaper(plan, self.model_name)
        pending = up.open(plan.op, plan.args)
        try:
            try:
                first = await up.next(pending)
            except ApiError as exc:
                if plan.tools is not None and exc.param == "response_format":
                    exc.param = "tools"  # the worker refused the forced call's schema
                raise
            if not plan.stream:
                result = first.result
                infos = result.get("logprobs") or []
                tokens = [int(t) for t in result.get("tokens", [])][: len(infos)]
                logprobs = await self._logprobs(shaper, tokens, infos)
                return web.json_response(shaper.full(result, logprobs))
            return await self._stream(request, shaper, pending, first.header)
        finally:
            up.release(pending)

    async def _stream(
        self, request: web.Request, shaper: Shaper, pending: Pending, header: dict[str, Any]
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        if shaper.plan.chat:
            await response.write(_sse(shaper.role_chunk()))
        try:
            while True:
                if header.get("event") == "token":
                    token = int(header["token"])
                    logprobs = await self._logprobs(shaper, [token], [header])
                    text = str(header.get("text", ""))
                    if logprobs is not None:  # never with tools (shapes.py refuses it)
                        await response.write(_sse(shaper.text_chunk(text, logprobs)))
                    else:
                        for chunk in shaper.text_chunks(text):
                            await response.write(_sse(chunk))
                if header.get("done"):
                    for chunk in shaper.text_chunks(str(header.get("text", "")), end=True):
                        await response.write(_sse(chunk))
                    reason = shaper.finish(finish_reason(header.get("finish_reason")))
                    await response.write(_sse(shaper.text_chunk("", finish=reason)))
                    if shaper.plan.include_usage:
                        await response.write(_sse(shaper.usage_chunk(header.get("usage"))))
                    break
                header = (await self._upstream.next(pending)).header
        except ApiError as exc:  # too late for a status: an error event, as OpenAI does
            log.warning("http_stream_error", code=exc.code, message=exc.message)
            await response.write(_sse(exc.body()))
        await response.write(_sse("[DONE]"))
        await response.write_eof()
        return response
