"""``DealerPeer``: one DEALER toward one peer, and the requests awaiting it.

Three parts of skiff talk to one peer over a DEALER and need the same
machinery: a pipeline stage to the next stage (``worker/chain/link.py``),
the gateway to each worker (``gateway/pool.py``) and the HTTP front to its
upstream (``gateway/openai/upstream.py``). It lives here once:

- a request goes out with an id (``transport.send``: never blocking) and
  waits in ``pending`` until its final reply: a single result, an error, or
  the stream event with ``done``. Replies are routed by id, events included;
  one for an id nobody waits for goes to ``other`` (the gateway relays its
  clients' requests that way) or, late, is dropped;
- a request may have a deadline: past it, that request alone fails
  (``expire``), the others keep waiting;
- the connection is watched with a ZeroMQ socket monitor. A dropped
  connection fails every pending request at once: the peer's ROUTER can no
  longer address their replies, so none will come, and a killed process
  closes its socket, so no timeout is needed to notice. With
  ``SocketOptions.immediate`` a send while no connection is up is refused
  (``NotSent``) rather than queued for a peer that may come back without
  the state the request needs. ZeroMQ reconnects by itself.

What a failure means is the owner's policy: the ``faults.Fault`` a request
fails with comes from the owner's ``gone`` (connection lost) and ``late``
(deadline) makers, so each keeps its own codes and messages; the owner's
hooks (``on_connected``, ``on_dropped``) run before pending requests fail.

The peer does no I/O by itself: its owner reads and watches when the
sockets are readable (the gateway's poller), blocks on ``pump`` (a stage
waiting for the next), or ``attach``es it to an asyncio loop (the HTTP
front).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from faults import DeadlineExceeded, Fault

from . import sockets, transport

# Plain ints: combining zmq's enum flags per message costs a microsecond or two.
_NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)

# A reply for a pending request: its header and buffer frames. True keeps the
# request pending (an acknowledgement whose answer comes later).
OnReply = Callable[[dict[str, Any], list[zmq.Frame]], bool | None]
OnFail = Callable[[Fault], None]
# A reply nobody waits for: header, buffer frames, size of the header frame.
OnOther = Callable[[dict[str, Any], list[zmq.Frame], int], None]
# The owner's fault for a request (by op) that cannot be answered any more.
MakeFault = Callable[[str], Fault]


class NotSent(Exception):
    """The socket refused a request (``transport``'s reason); nothing was sent."""

    def __init__(self, req_id: int, reason: str) -> None:
        super().__init__(reason)
        self.req_id = req_id
        self.reason = reason


@dataclass(slots=True)
class Pending:
    op: str
    on_reply: OnReply
    on_fail: OnFail
    deadline: float | None  # time.monotonic(); None = waits until answered or lost


def readable(sock: zmq.Socket[Any]) -> bool:
    """A message waits (cheaper than a ``recv`` that raises ``zmq.Again``)."""
    events = sock.getsockopt(_EVENTS)
    return isinstance(events, int) and bool(events & _POLLIN)


def final(header: dict[str, Any]) -> bool:
    """The last reply of its request: an error, a single result, or ``done``."""
    return header.get("ok") is not True or "event" not in header or bool(header.get("done"))


class DealerPeer:
    """One DEALER toward ``endpoint`` (see the module doc).

    ``ids`` may be shared with the owner's other ids (the gateway numbers its
    forwarded client requests from the same counter, so they never collide
    with this peer's own). ``max_header_bytes`` caps a reply's header (and
    its nesting, ``codec``); None reads a trusted peer's headers uncapped,
    the cheapest decode."""

    def __init__(
        self,
        context: zmq.Context[Any],
        endpoint: str,
        options: sockets.SocketOptions | None = None,
        *,
        gone: MakeFault,
        late: MakeFault | None = None,
        ids: itertools.count[int] | None = None,
        max_header_bytes: int | None = 1 << 30,
    ) -> None:
        self.endpoint = endpoint
        self.gone = gone
        self.late = late or (lambda op: DeadlineExceeded(f"{endpoint} did not answer {op}"))
        self.ids = ids or itertools.count(1)
        self.max_header_bytes = max_header_bytes
        self.sock: zmq.Socket[Any] = sockets.dealer(context, endpoint, options, connect=False)
        # set up before connecting, so the first connection is not missed
        self.monitor: zmq.Socket[Any] = self.sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
        )
        self.sock.connect(endpoint)
        self.connected = False  # the monitor's last word; False until it says so
        self.pending: dict[int, Pending] = {}
        # The owner's hooks (all optional).
        self.other: OnOther | None = None
        self.on_connected: Callable[[], None] | None = None
        self.on_dropped: Callable[[], None] | None = None  # runs before pending fail
        self.on_garbage: Callable[[str], None] | None = None  # an undecodable reply
        self._inputs: list[zmq.Socket[Any]] = [self.sock]
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self.monitor, zmq.POLLIN)
        self._loop: asyncio.AbstractEventLoop | None = None

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            for sock in (self.sock, self.monitor):
                self._loop.remove_reader(sock.fileno())
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)

    def also(self, sock: zmq.Socket[Any]) -> None:
        """Replies to this peer's requests may also come home on ``sock`` (a
        stage's direct return from the chain's last stage): read and wait on
        it with this one. Its owner closes it."""
        self._inputs.append(sock)
        self._poller.register(sock, zmq.POLLIN)

    # -- sending -----------------------------------------------------------------------

    def next_id(self) -> int:
        return next(self.ids)

    def send(self, payload: bytes, buffers: Sequence[Any] = ()) -> str | None:
        """``[payload, *buffers]`` as it is (``transport.send``); None once
        queued, else why not."""
        reason = transport.send(self.sock, payload, buffers)
        if self._loop is not None and readable(self.sock):
            # A send may take the socket's wake-up for a reply already in
            # (ZeroMQ's descriptor is edge-triggered): read it on the next pass.
            self._loop.call_soon(self._serve)
        return reason

    def post(
        self,
        op: str,
        session: str | None = None,
        args: dict[str, Any] | None = None,
        buffers: Sequence[Any] = (),
        req_id: int | None = None,
    ) -> int:
        """Send a request nobody waits for (its reply is dropped); its id.
        Raises ``NotSent`` when the socket refuses it."""
        req_id = self.next_id() if req_id is None else req_id
        reason = self.send(transport.encode(transport.request(req_id, op, session, args)), buffers)
        if reason is not None:
            raise NotSent(req_id, reason)
        return req_id

    def request(
        self,
        op: str,
        session: str | None = None,
        args: dict[str, Any] | None = None,
        buffers: Sequence[Any] = (),
        *,
        on_reply: OnReply,
        on_fail: OnFail,
        timeout_s: float | None = None,
        req_id: int | None = None,
    ) -> int:
        """Send a request and wait for it: each reply goes to ``on_reply``
        until the final one; a lost connection or ``timeout_s`` passing
        first goes to ``on_fail`` instead. Raises ``NotSent`` (nothing is
        pending then). The callbacks run inside ``read``, ``watch`` and
        ``expire`` and must not raise: the rest of the batch waits behind them."""
        req_id = self.post(op, session, args, buffers, req_id)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.pending[req_id] = Pending(op, on_reply, on_fail, deadline)
        return req_id

    def forget(self, req_id: int) -> None:
        """Stop waiting for ``req_id``; its later replies are dropped."""
        self.pending.pop(req_id, None)

    # -- receiving ---------------------------------------------------------------------

    def read(self, limit: int = 0) -> int:
        """Take in the replies that have arrived, without waiting (at most
        ``limit`` per socket; 0 = all); how many were read."""
        n = 0
        for sock in self._inputs:
            taken = 0
            while not limit or taken < limit:
                try:  # until empty: a failed recv beats a ZMQ_EVENTS check per message
                    first = sock.recv(_NOBLOCK, copy=False)
                except zmq.Again:
                    break
                buffers: list[zmq.Frame] = []
                more = first.more
                while more:
                    frame = sock.recv(_NOBLOCK, copy=False)
                    buffers.append(frame)
                    more = frame.more
                taken += 1
                self._route(first, buffers)
            n += taken
        return n

    def _route(self, first: zmq.Frame, buffers: list[zmq.Frame]) -> None:
        header: dict[str, Any]
        try:
            if self.max_header_bytes is None:
                header = msgpack.unpackb(first.buffer, raw=False, strict_map_key=False)
                if not isinstance(header, dict):
                    raise transport.CodecError(f"header must be a map, got {type(header).__name__}")
            else:
                header = transport.decode(first.buffer, max_bytes=self.max_header_bytes)
        except Exception as exc:  # a broken reply must not stop the reading
            if self.on_garbage is not None:
                self.on_garbage(str(exc))
            return
        rid = header.get("id")
        if type(rid) is not int or rid not in self.pending:  # (a bool is no id)
            if self.other is not None:
                self.other(header, buffers, len(first))
            return
        if not self.pending[rid].on_reply(header, buffers) and final(header):
            self.forget(rid)

    def watch(self) -> bool:
        """Take in connection events; True when the connection dropped (every
        pending request has failed with ``gone`` then)."""
        dropped = False
        while readable(self.monitor):
            try:
                event = recv_monitor_message(self.monitor, _NOBLOCK)
            except zmq.Again:
                break
            if event["event"] == zmq.EVENT_CONNECTED:
                self.connected = True
                if self.on_connected is not None:
                    self.on_connected()
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.connected = False
                dropped = True
                if self.on_dropped is not None:
                    self.on_dropped()
                self.fail_all(self.gone)
        return dropped

    # -- failing -----------------------------------------------------------------------

    def expire(self, now: float | None = None) -> int:
        """Fail the requests past their deadline (``late``); how many."""
        now = time.monotonic() if now is None else now
        due = [r for r, p in self.pending.items() if p.deadline is not None and p.deadline <= now]
        for req_id in due:
            entry = self.pending.pop(req_id)
            entry.on_fail(self.late(entry.op))
        return len(due)

    def fail_all(self, fault: MakeFault) -> int:
        """Fail every pending request with ``fault(op)``; how many. Requests
        their callbacks send meanwhile are not failed."""
        lost, self.pending = self.pending, {}
        for entry in lost.values():
            entry.on_fail(fault(entry.op))
        return len(lost)

    # -- driving -----------------------------------------------------------------------

    def next_deadline_ms(self, now: float) -> int | None:
        """Milliseconds until the nearest deadline (at least 0); None without one."""
        due = [p.deadline for p in self.pending.values() if p.deadline is not None]
        return max(0, int((min(due) - now) * 1000) + 1) if due else None

    def pump(self, timeout_ms: int) -> None:
        """The blocking driver: fail what is past its deadline, take in
        connection events, then wait up to ``timeout_ms`` (less when a
        deadline comes first) for replies and take in all that arrived.
        Returns at once with nothing pending."""
        now = time.monotonic()
        self.expire(now)
        if self.watch() or not self.pending:
            return
        due = self.next_deadline_ms(now)
        ready = dict(self._poller.poll(timeout_ms if due is None else min(timeout_ms, due)))
        if self.monitor in ready and self.watch():
            return
        self.read()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve this peer from ``loop``: replies and connection events are
        taken in as soon as the sockets signal. Deadlines are not timed here:
        an asyncio owner times its own waits."""
        self._loop = loop
        for sock in (self.sock, self.monitor):
            loop.add_reader(sock.fileno(), self._serve)
        loop.call_soon(self._serve)

    def _serve(self) -> None:
        if not self.sock.closed:
            self.watch()
            self.read()
