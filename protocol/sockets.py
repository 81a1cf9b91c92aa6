"""The one socket factory: every skiff socket gets its options here.

Servers bind a ROUTER, clients connect a DEALER; both get bounded queues,
no linger, and a cap on the size of one ZeroMQ frame (``MAXMSGSIZE``). A
peer that sends a larger frame has its connection dropped by ZeroMQ itself
before the frame is buffered, so no process can be made to hold an
arbitrary amount of memory (measured: a 300 MiB frame used to grow a
worker's RSS by 300 MiB). Security options (CURVE) belong here too.

Memory a server may hold for received, not yet handled messages is bounded
by ``rcvhwm`` messages per peer pipe, each frame at most
``max_message_bytes``; its send queue by ``sndhwm`` messages per peer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import zmq

S = TypeVar("S", bound="zmq.Socket[Any]")

DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class SocketOptions:
    """Options every skiff socket carries; the defaults suit a worker."""

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # -1 = unlimited (clients only)
    sndhwm: int = 10_000  # messages queued per peer before sends would block
    rcvhwm: int = 10_000
    linger_ms: int = 0


def _apply(sock: zmq.Socket[Any], opts: SocketOptions) -> None:
    sock.setsockopt(zmq.LINGER, opts.linger_ms)
    sock.setsockopt(zmq.SNDHWM, opts.sndhwm)
    sock.setsockopt(zmq.RCVHWM, opts.rcvhwm)
    sock.setsockopt(zmq.MAXMSGSIZE, opts.max_message_bytes)


def router(ctx: zmq.Context[S], bind: str, opts: SocketOptions | None = None) -> S:
    """A bound ROUTER. ``ROUTER_MANDATORY`` makes a send to a vanished peer
    raise (``EHOSTUNREACH``) and a send to a peer whose queue is full raise
    ``EAGAIN`` with ``NOBLOCK``, instead of dropping silently or blocking."""
    sock = ctx.socket(zmq.ROUTER)
    _apply(sock, opts or SocketOptions())
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.bind(bind)
    return sock


def dealer(
    ctx: zmq.Context[S], endpoint: str, opts: SocketOptions | None = None, connect: bool = True
) -> S:
    """A connected DEALER. Clients default to no frame cap (a reply may carry
    large tensors from a worker they trust). ``connect=False`` leaves the
    connecting to the caller, for options and monitors that must be in place
    before the first connection (heartbeats, ``IMMEDIATE``, connect events)."""
    sock = ctx.socket(zmq.DEALER)
    _apply(sock, opts or SocketOptions(max_message_bytes=-1))
    if connect:
        sock.connect(endpoint)
    return sock
