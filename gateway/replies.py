"""Worker -> client, the hot path: each reply and stream event back to its client.

Per readable worker socket, up to ``RECV_BATCH`` messages a turn: decode the
header (a worker is a trusted peer: no size or depth caps), find the request
by its gateway id in the ledger (an id the ledger does not hold may be the
pool's own call: ``Pool.answer_call``), put the client's id back and send it
on with the received buffer frames untouched (``gateway/relay.py``).

A worker that refuses a request because it is shutting down has run
nothing: it gets no new work from then on, and the request is routed again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from edge import Outgoing, Request, logs
from faults import ErrorCode

from .ledger import Inflight, Ledger
from .metrics import GatewayMetrics
from .pool import NOBLOCK, Pool, WorkerConn
from .relay import Relay

_log = logs.get_logger("skiff.gateway")

RECV_BATCH = 512  # messages taken from one worker per turn


class Replies:
    """Maps worker replies to clients; ``GatewayService`` owns one."""

    def __init__(
        self,
        pool: Pool,
        ledger: Ledger,
        metrics: GatewayMetrics | None,
        resend: Callable[[Request], None],
        emit: Callable[[Outgoing], None],
    ) -> None:
        self.pool = pool
        self.ledger = ledger
        self.metrics = metrics
        self._resend = resend  # route a request again (one a shutting-down worker refused)
        self._emit = emit  # the edge's way out, used until a relay is set
        self.relay: Relay | None = None  # set by GatewayService.attach

    def recv(self, w: WorkerConn, now: float) -> None:
        """Up to ``RECV_BATCH`` replies from ``w``, each mapped to its client."""
        sock = w.sock
        relay = self.relay
        for _ in range(RECV_BATCH):
            try:  # until empty: a failed recv (~8 us) beats a ZMQ_EVENTS check per message (~4 us)
                first = sock.recv(NOBLOCK, copy=False)
            except zmq.Again:
                break
            buffers: list[zmq.Frame] = []
            more = first.more
            while more:
                frame = sock.recv(NOBLOCK, copy=False)
                buffers.append(frame)
                more = frame.more
            w.last_seen = now
            try:
                # A worker is a trusted peer: no size or depth caps on its headers.
                header = msgpack.unpackb(first.bytes, raw=False, strict_map_key=False)
                gid = header.get("id")
            except Exception as exc:
                _log.error("worker_reply_undecodable", worker=w.name, error=str(exc))
                continue
            rec = self.ledger.get(gid) if type(gid) is int else None
            if rec is None:
                if type(gid) is int and not self.pool.answer_call(gid, header, buffers):
                    _log.debug("stale_reply", worker=w.name, id=gid)
                continue
            ok = header.get("ok") is True
            if not ok and rec.retry is not None and self._reroute(w, rec, header):
                continue
            if rec.placed and ok:
                self.ledger.confirm(rec)
            if not ok or "event" not in header or header.get("done"):
                self.ledger.finish(rec, ok)
            if rec.peer is None:
                continue
            header["id"] = rec.client_id
            if relay is not None:
                relay.send(rec.peer, header, buffers)
            else:
                self._emit(Outgoing(rec.peer, header, buffers))
            if self.metrics is not None:
                self.metrics.to_client(len(first), buffers)

    def _reroute(self, w: WorkerConn, rec: Inflight, header: dict[str, Any]) -> bool:
        """A worker refused new work because it is shutting down (nothing ran):
        route no new work to it and send the request to another worker. False
        when this reply is some other failure."""
        error = header.get("error")
        if not isinstance(error, dict) or error.get("code") != ErrorCode.SHUTTING_DOWN:
            return False
        if not w.draining:
            w.draining = True  # until it goes down and comes back (pool: rejoin)
            _log.warning("worker_shutting_down", worker=w.name)
        self.ledger.finish(rec, False)
        if rec.peer is not None:
            self._resend(rec.retry)
        return True
