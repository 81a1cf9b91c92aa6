"""ZAP: who may talk to a CURVE server, answered by the server's own loop.

A CURVE ROUTER only encrypts; which client keys it accepts is decided by
the ZAP handler (ZeroMQ RFC 27) bound at ``inproc://zeromq.zap.01`` in the
socket's context. Without a handler libzmq accepts every client that knows
the server's public key, so ``ZapHandler`` is bound *before* the ROUTER
binds and nothing is ever served unchecked.

The handler is a REP socket the edge's single poller watches beside the
ROUTER (``EdgeServer.run_once``): no thread, no lock, and a busy service
(polling with timeout 0) still answers handshakes between turns. pyzmq's
``zmq.auth.Authenticator`` is not used: its ``handle_zap_message`` is a
coroutine since pyzmq 25, which a synchronous loop would have to drive by
hand; the protocol itself is six frames each way.

The allow-list is the ``*.key`` public certificates in one directory
(``--curve-authorized``), re-read when the directory's listing or a file's
mtime changes, so a client can be added or removed without a restart (a
connection already made stays up). The server's own public key is always
allowed: whoever holds its secret could impersonate the server anyway, and
it lets a process's own parts (the gateway's HTTP front) dial its server.
Every other client, and every mechanism but CURVE, is denied: ZeroMQ then
drops the handshake and the client sees no reply at all.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.utils import z85

from protocol import sockets

from . import logs

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_VERSION = b"1.0"
_DENIED_LOG_EVERY_S = 1.0  # a flood of bad handshakes logs once a second, with a count

_log = logs.get_logger("skiff.zap")


def _stamp(directory: Path) -> tuple[tuple[str, int, int], ...]:
    """What changes when a certificate is added, removed or rewritten."""
    out = []
    with os.scandir(directory) as entries:
        for e in entries:
            if e.name.endswith(".key"):
                st = e.stat()
                out.append((e.name, st.st_mtime_ns, st.st_size))
    return tuple(sorted(out))


def authorized_keys(directory: str | os.PathLike[str]) -> frozenset[bytes]:
    """The z85 public keys of every ``*.key`` certificate in ``directory``."""
    try:
        return frozenset(zmq.auth.load_certificates(directory))
    except (OSError, ValueError) as exc:
        raise sockets.CurveKeyError(f"{os.fspath(directory)}: {exc}") from None


class ZapHandler:
    """Answers ZAP requests for every CURVE socket of one context."""

    def __init__(
        self,
        context: zmq.Context[Any],
        authorized: str | os.PathLike[str],
        always: Iterable[bytes] = (),
    ) -> None:
        self.directory = Path(authorized)
        self._always = frozenset(always)
        self._keys: frozenset[bytes] = frozenset()
        self._stamp: tuple[tuple[str, int, int], ...] | None = None
        self.allowed = 0
        self.denied = 0
        self._denied_unlogged = 0
        self._denied_logged_at = 0.0
        self._reload()  # a bad directory fails startup, before any socket exists
        if not self._keys:
            _log.warning(
                "curve_no_authorized_keys",
                directory=str(self.directory),
                note="no *.key certificates: only this process's own key can connect",
            )
        self.socket: zmq.Socket[Any] = context.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        try:
            self.socket.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            self.socket.close(linger=0)
            if exc.errno == zmq.EADDRINUSE:
                raise RuntimeError(
                    "this ZeroMQ context already has a ZAP handler (one CURVE server per context)"
                ) from None
            raise

    def close(self) -> None:
        self.socket.close(linger=0)

    def _reload(self) -> None:
        stamp = _stamp(self.directory)
        if stamp == self._stamp:
            return
        self._keys = authorized_keys(self.directory)
        self._stamp = stamp
        _log.info("curve_authorized_loaded", directory=str(self.directory), keys=len(self._keys))

    def allows(self, key: bytes) -> bool:
        """``key`` (z85) may connect; re-reads the directory if it changed."""
        try:
            self._reload()
        except (OSError, ValueError) as exc:  # keep the last good list
            _log.error("curve_authorized_unreadable", directory=str(self.directory), error=str(exc))
        return key in self._always or key in self._keys

    def serve(self) -> None:
        """Answer every pending ZAP request without blocking."""
        while True:
            try:
                msg = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = self._answer(msg)
            except Exception:  # nothing a handshake carries may end the loop
                _log.exception("zap_failed")
                req_id = msg[1] if len(msg) > 1 else b""
                reply = [_VERSION, req_id, b"500", b"internal error", b"", b""]
            try:
                self.socket.send_multipart(reply)  # REP: every request gets its answer
            except zmq.ZMQError as exc:
                _log.error("zap_reply_failed", error=str(exc))

    def _answer(self, msg: list[bytes]) -> list[bytes]:
        if len(msg) < 6 or msg[0] != _VERSION:
            req_id = msg[1] if len(msg) > 1 else b""
            return [_VERSION, req_id, b"400", b"malformed ZAP request", b"", b""]
        _, req_id, _domain, address, _identity, mechanism = msg[:6]
        credentials = msg[6:]
        key = z85.encode(credentials[0]) if mechanism == b"CURVE" and credentials else None
        if key is not None and self.allows(key):
            self.allowed += 1
            return [_VERSION, req_id, b"200", b"OK", key, b""]
        self.denied += 1
        self._denied_unlogged += 1
        now = time.monotonic()
        if now - self._denied_logged_at >= _DENIED_LOG_EVERY_S:
            _log.warning(
                "curve_client_denied",
                address=address.decode(errors="replace"),
                mechanism=mechanism.decode(errors="replace"),
                client_key=key.decode() if key is not None else None,
                denied=self._denied_unlogged,
            )
            self._denied_logged_at = now
            self._denied_unlogged = 0
        return [_VERSION, req_id, b"400", b"client key not authorized", b"", b""]


def warn_if_exposed(bind: str, curve: sockets.Curve | None) -> None:
    """A loud warning when a plain (no CURVE) server is reachable from other hosts."""
    if curve is None and not sockets.is_loopback(bind):
        _log.warning(
            "curve_off_non_loopback",
            endpoint=bind,
            note="CURVE is off and this endpoint is reachable from other hosts: anyone who "
            "can reach it can use it and read its traffic; give --curve-secret-key and "
            "--curve-authorized, or bind 127.0.0.1 / ipc://",
        )


def for_server(
    context: zmq.Context[Any], bind: str, curve: sockets.Curve | None, authorized: str
) -> ZapHandler | None:
    """The ZAP handler a server about to bind ``bind`` needs (None when
    plain, after warning if the endpoint is exposed). Call before binding."""
    if curve is None:
        warn_if_exposed(bind, curve)
        return None
    if not authorized:
        raise ValueError("a CURVE server needs an allow-list directory (--curve-authorized)")
    return ZapHandler(context, authorized, always=(curve.public_key,))


def keys_from_flags(
    prog: str, secret_key: str, authorized: str, server_key: str = "", dials: str = ""
) -> sockets.Curve | None:
    """The CURVE keys a process's flags name, checked at startup (None: CURVE
    off). ``dials`` names the servers the process connects to, if any: with
    CURVE on it then needs ``--curve-server-key``. Every mistake is a
    ``SystemExit`` naming the flag, never a server that silently runs open."""
    if not (secret_key or authorized or server_key):
        return None
    if server_key and not secret_key:
        raise SystemExit(
            f"{prog}: --curve-server-key needs --curve-secret-key and --curve-authorized "
            "(the process's own key pair is its identity toward the servers it dials)"
        )
    if bool(secret_key) != bool(authorized):
        raise SystemExit(
            f"{prog}: --curve-secret-key and --curve-authorized go together "
            "(CURVE without an allow-list lets in anyone who knows the server key)"
        )
    if dials and not server_key:
        raise SystemExit(
            f"{prog}: CURVE is on and this process dials {dials}: "
            "give --curve-server-key (their public certificate)"
        )
    if not os.path.isdir(authorized):
        raise SystemExit(f"{prog}: --curve-authorized {authorized}: not a directory")
    try:
        authorized_keys(authorized)
        return sockets.Curve.load(secret_key, server_key or None)
    except sockets.CurveKeyError as exc:
        raise SystemExit(f"{prog}: {exc}") from None


def split_events(zap: ZapHandler | None, events: list[tuple[Any, int]]) -> list[tuple[Any, int]]:
    """Serve ZAP if its socket is among ``events``; the other events."""
    if zap is None or not events:
        return events
    rest = [e for e in events if e[0] is not zap.socket]
    if len(rest) != len(events):
        zap.serve()
    return rest
