"""The HTTP front's link to one skiff endpoint: requests, cancels, health.

A ``protocol.peer.DealerPeer`` (served by this event loop) matches replies
to requests by id and watches the connection; this wrapper adds what an
HTTP front needs on top of it:

- ``open`` / ``next`` / ``release``: a request whose replies we read one by
  one, each within ``timeout_s`` (504 after it); one we let go unfinished
  (a client that went away mid-stream) is cancelled upstream (``cancel``
  op) instead of decoding for nobody;
- liveness from two signals. The DEALER's connection (the peer's monitor)
  says whether any process is there: when it drops, the requests in flight
  end with ``worker_unavailable`` at once (the worker cancels a gone peer's
  requests anyway, so no reply will ever come) instead of hanging until
  the reply timeout. A ``ping`` every ``interval_s`` says whether it
  answers: ``up`` drives ``/health``. A missed ping alone never fails a
  request: a worker answers ping only between scheduler turns, and on a
  loaded machine a turn (a grammar being compiled, a long prefill) can
  outlast any threshold. Only a peer that is both unconnected and silent is
  "down": new requests then fail fast with 503, and any in flight end as
  above;
- token texts for logprobs (``detokenize``, cached: the vocabulary is fixed).

Everything runs on the HTTP front's own event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from edge.logs import get_logger
from faults import Fault, WorkerUnavailable
from protocol import Reply
from protocol.peer import DealerPeer, NotSent
from protocol.sockets import Curve, SocketOptions
from protocol.transport import fault_of

from .errors import ApiError, from_fault, timed_out, unavailable

log = get_logger("gateway.http")

TEXT_CACHE_LIMIT = 1 << 16  # token texts kept (a few MiB at most)


@dataclass
class Pending:
    """A request sent upstream whose replies we are reading: each reply, or
    the fault that ended it here (the upstream lost), in order."""

    req_id: int
    queue: asyncio.Queue[Reply | Fault] = field(default_factory=asyncio.Queue)
    finished: bool = False

    def reply(self, header: dict[str, Any], frames: list[zmq.Frame]) -> None:
        self.queue.put_nowait(Reply(header, [f.buffer for f in frames]))

    def fail(self, fault: Fault) -> None:
        self.finished = True  # the upstream has forgotten it; nothing to cancel
        self.queue.put_nowait(fault)


class Upstream:
    """One skiff endpoint (a worker, or the gateway's front) seen from HTTP."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float,
        interval_s: float = 0.5,
        down_after_s: float = 3.0,
        curve: Curve | None = None,
        routing_id: bytes | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_ms = int(timeout_s * 1000)
        self.peer = DealerPeer(
            zmq.Context.instance(),
            endpoint,
            SocketOptions(max_message_bytes=-1, routing_id=routing_id, curve=curve),
            gone=lambda op: WorkerUnavailable(f"upstream {endpoint} lost its connection"),
        )
        self.peer.on_dropped = lambda: log.warning("upstream_disconnected", endpoint=endpoint)
        self.interval_s = interval_s
        self.down_after_s = down_after_s
        self.up: bool | None = None  # answers ping; None until the first ping settles it
        self._texts: dict[int, str] = {}
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.peer.attach(loop)
        self._tasks = [loop.create_task(self._health_loop())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.peer.close()

    @property
    def connected(self) -> bool:
        """The DEALER holds a connection to a peer."""
        return self.peer.connected

    @property
    def down(self) -> bool:
        """Nothing is connected and nothing answers: no request can succeed."""
        return not self.connected and self.up is False

    async def _health_loop(self) -> None:
        last_ok = time.monotonic()
        while True:
            pending = self.open("ping", None)
            try:
                await asyncio.wait_for(self.next(pending), self.down_after_s)
                last_ok = time.monotonic()
                if self.up is not True:
                    log.info("upstream_up", endpoint=self.endpoint)
                self.up = True
            except (ApiError, TimeoutError):
                if time.monotonic() - last_ok >= self.down_after_s and self.up is not False:
                    self.up = False
                    log.warning("upstream_not_answering", endpoint=self.endpoint)
            finally:
                self.release(pending, cancel=False)
            if self.down:
                self._fail_inflight("is not connected and does not answer ping")
            await asyncio.sleep(self.interval_s)

    def _fail_inflight(self, why: str) -> None:
        """End every request in flight: no reply can come for it any more."""
        message = f"upstream {self.endpoint} {why}"
        self.peer.fail_all(lambda op: WorkerUnavailable(message))

    def check_up(self) -> None:
        """Fail fast (503) while the upstream is known to be gone."""
        if self.down:
            raise unavailable(f"upstream {self.endpoint} is not connected and does not answer ping")

    # -- requests ------------------------------------------------------------------

    async def call(self, op: str, args: dict[str, Any] | None = None) -> Reply:
        """One request, one reply; errors become ``ApiError``."""
        self.check_up()
        pending = self.open(op, args)
        try:
            reply = await self.next(pending)
            pending.finished = True
            return reply
        finally:
            self.release(pending)

    def open(self, op: str, args: dict[str, Any] | None) -> Pending:
        pending = Pending(self.peer.next_id())
        try:
            self.peer.request(
                op, None, args, on_reply=pending.reply, on_fail=pending.fail, req_id=pending.req_id
            )
        except NotSent as exc:  # its queue is full
            raise unavailable(f"upstream {self.endpoint} cannot take it: {exc.reason}") from None
        return pending

    async def next(self, pending: Pending) -> Reply:
        """The request's next reply; an error reply (or none in time) raises ``ApiError``."""
        try:
            if pending.queue.empty():
                # a timer on this task, not ``wait_for``'s extra task per reply
                async with asyncio.timeout(self.timeout_ms / 1000):
                    reply = await pending.queue.get()
            else:  # no timer at all when replies are already waiting
                reply = pending.queue.get_nowait()
        except TimeoutError:  # still unfinished: ``release`` cancels it upstream
            raise timed_out(f"no reply within {self.timeout_ms} ms") from None
        if isinstance(reply, Fault):
            raise from_fault(reply)
        if not reply.header.get("ok", False):
            pending.finished = True  # an error reply ends a request
            raise from_fault(fault_of(reply.header))
        if reply.done:
            pending.finished = True
        return reply

    def release(self, pending: Pending, *, cancel: bool = True) -> None:
        """Forget the request; cancel it upstream if it has not finished."""
        self.peer.forget(pending.req_id)
        if cancel and not pending.finished:
            # sent at once (no task to schedule); its reply is not awaited. If it
            # cannot go, nothing reaches the worker now: it drops a gone peer's work.
            with contextlib.suppress(NotSent):
                self.peer.post("cancel", None, {"id": pending.req_id})

    # -- token texts -----------------------------------------------------------------

    async def token_texts(self, tokens: set[int]) -> dict[int, str]:
        """Each token's own text (``detokenize`` of it alone), cached."""
        out = {t: self._texts[t] for t in tokens if t in self._texts}
        missing = sorted(tokens - out.keys())
        if missing:
            replies = await asyncio.gather(
                *(self.call("detokenize", {"tokens": [t]}) for t in missing)
            )
            if len(self._texts) + len(missing) > TEXT_CACHE_LIMIT:
                self._texts.clear()
            for token, reply in zip(missing, replies, strict=True):
                out[token] = self._texts[token] = str(reply.result.get("text", ""))
        return out


def api_error_of(exc: BaseException) -> ApiError:
    """Any failure while talking upstream, as the HTTP error to answer."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, Fault):
        return from_fault(exc)
    return ApiError(
        500, f"internal error: {type(exc).__name__}", type_="server_error", code="internal"
    )
