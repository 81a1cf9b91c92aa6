"""Worker -> client, the hot path: each reply and stream event back to its client;
and what else comes from the workers (one going down, its ``stats``).

The pool's ``DealerPeer`` reads a worker's messages (up to ``RECV_BATCH`` a
turn, ``server._recv``) and hands every one that is no internal call of the
pool here (``GatewayService.worker_reply``): find the request by its gateway
id in the ledger, put the client's id back and send it on with the received
buffer frames untouched (``gateway/relay.py``).

A worker that refuses a request because it is shutting down has run
nothing: it gets no new work from then on, and the request is routed again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import zmq

from edge import Outgoing, Request, logs
from faults import ErrorCode
from protocol.transport import error_reply

from .affinity import AffinityTable
from .drain import Drainer
from .ledger import Inflight, Ledger
from .metrics import GatewayMetrics
from .pool import LLM, WorkerConn
from .relay import Relay
from .router import Router

_log = logs.get_logger("skiff.gateway")


class Replies:
    """Maps worker replies to clients; ``GatewayService`` owns one."""

    def __init__(
        self,
        ledger: Ledger,
        metrics: GatewayMetrics | None,
        resend: Callable[[Request], None],
        emit: Callable[[Outgoing], None],
        affinity: AffinityTable,
        router: Router,
        held: dict[str, list[Request]],
        drainer: Drainer,
    ) -> None:
        self.drainer = drainer  # told of a worker leaving, and of each stream it suspends
        self.affinity = affinity
        self.router = router
        self.held = held  # sessions being moved -> their waiting requests
        self.ledger = ledger
        self.metrics = metrics
        self._resend = resend  # route a request again (one a shutting-down worker refused)
        self._emit = emit  # the edge's way out, used until a relay is set
        self.relay: Relay | None = None  # set by GatewayService.attach

    def reply(
        self, w: WorkerConn, header: dict[str, Any], buffers: list[zmq.Frame], size: int
    ) -> None:
        """A reply to a forwarded client request, mapped to its client
        (``size``: its header frame's bytes, for the metrics)."""
        gid = header.get("id")
        rec = self.ledger.get(gid) if type(gid) is int else None
        if rec is None:
            if type(gid) is int:
                _log.debug("stale_reply", worker=w.name, id=gid)
            elif header.get("event") == "leaving":  # SIGTERM: take what it holds
                self.drainer.leaving(w)
            return
        if header.get("event") == "suspended":  # a drain moves this stream: not the client's
            self.ledger.finish(rec, True)
            self.drainer.suspended(rec, header)
            return
        ok = header.get("ok") is True
        if not ok and rec.retry is not None and self._reroute(w, rec, header):
            return
        if rec.placed and ok:
            self.ledger.confirm(rec)
        if not ok or "event" not in header or header.get("done"):
            self.ledger.finish(rec, ok)
        if rec.peer is None:
            return
        header["id"] = rec.client_id
        if self.relay is not None:
            self.relay.send(rec.peer, header, buffers)
        else:
            self._emit(Outgoing(rec.peer, header, buffers))
        if self.metrics is not None:
            self.metrics.to_client(size, buffers)

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

    # -- a worker's downs and stats (the pool's listener hands them here) -----------

    def worker_down(self, worker: WorkerConn, reason: str) -> None:
        """End every request in flight on ``worker`` with ``worker_unavailable``;
        its sessions are lost."""
        message = f"worker {worker.name} is unavailable: {reason}"
        for gid in list(worker.inflight):
            rec = self.ledger.get(gid)
            if rec is None:
                continue
            self.ledger.finish(rec, False)
            if rec.peer is not None:
                self._emit(
                    Outgoing(rec.peer, error_reply(rec.client_id, "worker_unavailable", message))
                )
        worker.inflight.clear()
        dropped = self.affinity.drop_worker(worker.name)
        self.router.forget(worker.name)
        if dropped:
            _log.warning("sessions_lost", worker=worker.name, sessions=len(dropped))
        if self.metrics is not None:
            self.metrics.worker_down(worker)

    def worker_stats(self, worker: WorkerConn, stats: dict[str, Any], asked_at: float) -> None:
        """Rebuild ``worker``'s affinity from the sessions its ``stats`` list
        (a restarted gateway finds them; parked ones are listed too)."""
        if worker.kind != LLM:
            return
        if stats.get("draining") is True and worker.up and not worker.drained:
            # SIGTERM: a worker holding no named session has no peer to tell
            # ``leaving``; its streams move all the same (a drain already
            # running for it goes on, Drainer.leaving does nothing then).
            self.drainer.leaving(worker)
        listed = [
            str(s.get("session"))
            for s in stats.get("sessions") or ()
            if isinstance(s, dict) and not s.get("ephemeral") and s.get("session")
        ]

        def busy(session: str) -> bool:
            return self.ledger.busy(session) or session in self.held

        added, removed = self.affinity.rebuild(worker.name, listed, asked_at, busy)
        if added or removed:
            _log.info(
                "affinity_rebuilt", worker=worker.name, added=added[:16], removed=removed[:16]
            )
