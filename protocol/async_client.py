"""``AsyncClient``: the asyncio twin of ``protocol.client.Client``.

Same per-op methods (``_Ops``), same DEALER socket factory; many coroutines
may share one instance, each awaiting the replies of its own request ids
(a reader task routes replies to per-id queues).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from typing import Any

import zmq
import zmq.asyncio

from . import sockets, transport
from .client import _Ops
from .reply import Extract, Reply, SkiffError, client_options, parse_reply, request_frames


class AsyncClient(_Ops):
    """asyncio client; many coroutines may share one instance. ``curve`` as for ``Client``."""

    def __init__(
        self,
        endpoint: str,
        timeout_ms: int = 120_000,
        context: zmq.asyncio.Context | None = None,
        options: sockets.SocketOptions | None = None,
        curve: sockets.Curve | None = None,
    ) -> None:
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock = sockets.dealer(self._ctx, endpoint, client_options(options, curve))
        self.timeout_ms = timeout_ms
        self._ids = itertools.count(1)
        self._queues: dict[int, asyncio.Queue[Reply]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._sock.close(linger=0)

    def forget(self, req_id: int) -> None:
        """Stop routing replies of ``req_id`` (after ``send``: once its last
        reply came, or it was cancelled), so its queue can go."""
        self._queues.pop(req_id, None)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _read_loop(self) -> None:
        while True:
            reply = parse_reply(await self._sock.recv_multipart(copy=False))
            rid = reply.header.get("id")
            queue = self._queues.get(rid) if isinstance(rid, int) else None
            if queue is not None:
                queue.put_nowait(reply)

    def send(
        self,
        op: str,
        session: str | None = None,
        args: dict[str, Any] | None = None,
        buffers: Sequence[Any] = (),
        deadline_ms: int | None = None,
    ) -> tuple[int, asyncio.Queue[Reply]]:
        """Queue a request; returns its id and the queue its replies land in."""
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())
        req_id = next(self._ids)
        queue: asyncio.Queue[Reply] = asyncio.Queue()
        self._queues[req_id] = queue
        header = transport.request(req_id, op, session, args, deadline_ms)
        self._sock.send_multipart(request_frames(header, buffers), copy=False)
        return req_id, queue

    async def _next(self, queue: asyncio.Queue[Reply]) -> Reply:
        try:
            return await asyncio.wait_for(queue.get(), self.timeout_ms / 1000)
        except TimeoutError as exc:
            raise SkiffError("timeout", f"no reply within {self.timeout_ms} ms") from exc

    async def call(
        self,
        op: str,
        session: str | None = None,
        args: dict[str, Any] | None = None,
        buffers: Sequence[Any] = (),
        deadline_ms: int | None = None,
    ) -> Reply:
        req_id, queue = self.send(op, session, args, buffers, deadline_ms)
        try:
            return (await self._next(queue)).raise_for_error()
        finally:
            self._queues.pop(req_id, None)

    async def stream(
        self,
        op: str,
        session: str | None = None,
        args: dict[str, Any] | None = None,
        deadline_ms: int | None = None,
    ) -> AsyncIterator[Reply]:
        req_id, queue = self.send(op, session, args, deadline_ms=deadline_ms)
        try:
            while True:
                reply = (await self._next(queue)).raise_for_error()
                yield reply
                if reply.done:
                    return
        finally:
            self._queues.pop(req_id, None)

    def generate(self, args: dict[str, Any], session: str | None = None) -> AsyncIterator[Reply]:
        return self.stream("generate", session, {**args, "stream": True})

    async def _ainvoke(
        self,
        op: str,
        session: str | None,
        args: dict[str, Any] | None,
        extract: Extract,
        buffers: Sequence[Any] = (),
    ) -> Any:
        return extract(await self.call(op, session, args, buffers))

    def _invoke(
        self,
        op: str,
        session: str | None,
        args: dict[str, Any] | None,
        extract: Extract,
        buffers: Sequence[Any] = (),
    ) -> Any:
        return self._ainvoke(op, session, args, extract, buffers)
