"""The one socket factory: every skiff socket gets its options here.

Servers bind a ROUTER, clients connect a DEALER; both get bounded queues,
no linger, and a cap on the size of one ZeroMQ frame (``MAXMSGSIZE``). A
peer that sends a larger frame has its connection dropped by ZeroMQ itself
before the frame is buffered, so no process can be made to hold an
arbitrary amount of memory (measured: a 300 MiB frame used to grow a
worker's RSS by 300 MiB).

CURVE (``SocketOptions.curve``) is set here too, so no socket can be made
half-secured: a ROUTER becomes a CURVE server (its own key pair, and a ZAP
domain so the process's ZAP handler, ``edge/zap.py``, checks every client
key), a DEALER a CURVE client (its own key pair and the server's public
key). Keys come from pyzmq certificate files (``skiff-keys``,
``zmq.auth.create_certificates``): ``NAME.key`` holds the public key,
``NAME.key_secret`` both.

Memory a server may hold for received, not yet handled messages is bounded
by ``rcvhwm`` messages per peer pipe, each frame at most
``max_message_bytes``; its send queue by ``sndhwm`` messages per peer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import zmq
import zmq.auth
from zmq.utils import z85

S = TypeVar("S", bound="zmq.Socket[Any]")

DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
ZAP_DOMAIN = b"skiff"  # what a CURVE ROUTER asks the process's ZAP handler about
_Z85_KEY_CHARS = 40  # a 32-byte CURVE key in z85 text


class CurveKeyError(ValueError):
    """A certificate file that is missing, unreadable or not a CURVE key."""


def _checked(key: bytes | None, path: str | os.PathLike[str], what: str) -> bytes:
    if key is None or len(key) != _Z85_KEY_CHARS:
        raise CurveKeyError(f"{os.fspath(path)}: no valid CURVE {what} key in it")
    try:
        z85.decode(key)
    except (ValueError, KeyError):
        raise CurveKeyError(f"{os.fspath(path)}: the {what} key is not z85 text") from None
    return key


def load_public_key(path: str | os.PathLike[str]) -> bytes:
    """The z85 public key of a certificate file (``NAME.key`` or ``NAME.key_secret``)."""
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"{os.fspath(path)}: {exc}") from None
    return _checked(public, path, "public")


@dataclass(frozen=True)
class Curve:
    """One socket's CURVE keys, z85 text (40 bytes each).

    A server (ROUTER) uses its own pair; a client (DEALER) its own pair as
    its identity plus ``server_key``, the public key of the server it
    dials, which it verifies during the handshake (a server without that
    secret key cannot answer). The secret never shows in a ``repr``.
    """

    public_key: bytes
    secret_key: bytes = field(repr=False)
    server_key: bytes | None = None

    @classmethod
    def load(
        cls,
        secret_file: str | os.PathLike[str],
        server_file: str | os.PathLike[str] | None = None,
    ) -> Curve:
        """Own pair from a ``.key_secret`` certificate; with ``server_file``
        (a public certificate) the server key a client verifies."""
        try:
            public, secret = zmq.auth.load_certificate(secret_file)
        except (OSError, ValueError) as exc:
            raise CurveKeyError(f"{os.fspath(secret_file)}: {exc}") from None
        if secret is None:
            raise CurveKeyError(
                f"{os.fspath(secret_file)}: a public certificate; give the NAME.key_secret file"
            )
        server = load_public_key(server_file) if server_file is not None else None
        return cls(
            _checked(public, secret_file, "public"),
            _checked(secret, secret_file, "secret"),
            server,
        )

    def toward(self, server_key: bytes) -> Curve:
        """The same identity, dialling the server whose public key is ``server_key``."""
        return replace(self, server_key=server_key)


@dataclass(frozen=True)
class SocketOptions:
    """Options every skiff socket carries; the defaults suit a worker."""

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # -1 = unlimited (clients only)
    sndhwm: int = 10_000  # messages queued per peer before sends would block
    rcvhwm: int = 10_000
    linger_ms: int = 0
    curve: Curve | None = None  # None = plain (NULL mechanism)
    routing_id: bytes | None = None  # a DEALER's identity at the ROUTER; None = random
    # A DEALER toward one peer (protocol/peer.py) that must not queue work for
    # a peer that is not there: ``immediate`` (ZMQ_IMMEDIATE) makes a send with
    # no finished connection fail (EAGAIN) instead of queueing.
    immediate: bool = False
    # ZMTP heartbeats: the peer's I/O thread answers them even while its loop is
    # busy, so only a gone or unreachable peer misses ``heartbeat_timeout_ms``
    # and has its connection dropped. 0 = none.
    heartbeat_ms: int = 0
    heartbeat_timeout_ms: int = 0
    reconnect_max_ms: int = 0  # backoff cap between reconnect attempts; 0 = libzmq's default


def _apply(sock: zmq.Socket[Any], opts: SocketOptions) -> None:
    sock.setsockopt(zmq.LINGER, opts.linger_ms)
    sock.setsockopt(zmq.SNDHWM, opts.sndhwm)
    sock.setsockopt(zmq.RCVHWM, opts.rcvhwm)
    sock.setsockopt(zmq.MAXMSGSIZE, opts.max_message_bytes)
    if opts.routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, opts.routing_id)
    # These apply to connections made after they are set (dealer(connect=False)).
    if opts.immediate:
        sock.setsockopt(zmq.IMMEDIATE, 1)
    if opts.reconnect_max_ms:
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, opts.reconnect_max_ms)
    if opts.heartbeat_ms:
        sock.setsockopt(zmq.HEARTBEAT_IVL, opts.heartbeat_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, opts.heartbeat_timeout_ms)
        sock.setsockopt(zmq.HEARTBEAT_TTL, min(opts.heartbeat_timeout_ms, 6_553_500))


def curve_server(sock: zmq.Socket[Any], curve: Curve) -> None:
    """Make ``sock`` a CURVE server. Its clients are checked by the ZAP
    handler of the socket's context, which must be bound before ``bind``:
    without one, libzmq lets in every client that knows the server key."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public_key)
    sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)


def curve_client(sock: zmq.Socket[Any], curve: Curve) -> None:
    """Make ``sock`` a CURVE client of the server ``curve.server_key`` (before connecting)."""
    if curve.server_key is None:
        raise ValueError("a CURVE client needs the server's public key (server_key)")
    sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_key)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public_key)
    sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key)


def is_loopback(endpoint: str) -> bool:
    """True when only this host can reach ``endpoint``: ``ipc://``,
    ``inproc://``, or TCP on 127.x, ``::1`` or ``localhost``. Wildcards,
    interface names and other addresses are reachable from elsewhere."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rpartition(":")[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def router(ctx: zmq.Context[S], bind: str, opts: SocketOptions | None = None) -> S:
    """A bound ROUTER. ``ROUTER_MANDATORY`` makes a send to a vanished peer
    raise (``EHOSTUNREACH``) and a send to a peer whose queue is full raise
    ``EAGAIN`` with ``NOBLOCK``, instead of dropping silently or blocking."""
    sock = ctx.socket(zmq.ROUTER)
    opts = opts or SocketOptions()
    _apply(sock, opts)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if opts.curve is not None:
        curve_server(sock, opts.curve)
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
    opts = opts or SocketOptions(max_message_bytes=-1)
    _apply(sock, opts)
    if opts.curve is not None:
        curve_client(sock, opts.curve)
    if connect:
        sock.connect(endpoint)
    return sock
