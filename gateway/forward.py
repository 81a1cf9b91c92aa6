"""Client -> worker: admit a request, place it, send it under a gateway id.

Every op that is not the gateway's own comes here (``GatewayService``'s op
table). Per request:

1. the per-client limit (``--max-inflight-per-client``; a trusted in-process
   front, the HTTP one, is spared);
2. a request naming a session being moved waits in the gateway until the
   session lands (``held``, sent on by the drain); a session whose worker
   went down answers ``worker_unavailable`` until the client drops it;
3. the worker: the session's (affinity), else the routing policy's
   (``gateway/placement.py``); speech ops go to the least busy speech worker;
4. a gateway-unique id (clients choose their own ids, so two clients' ids
   may collide) and ``[header, *buffers]`` sent on: only the header is
   encoded again, the buffer frames are the received ZeroMQ frames sent on
   with ``copy=False``; the ledger keeps who asked (``gateway/ledger.py``).

Replies come back through ``gateway/replies.py``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from edge import Request
from faults import DeadlineExceeded, LimitExceeded, WorkerUnavailable
from protocol.transport import VERSION

from .affinity import AffinityTable
from .ledger import Ledger
from .metrics import GatewayMetrics
from .ops import SPEECH_OPS, sessions_of
from .placement import Placer
from .pool import Pool, WorkerConn

STREAM_OPS = frozenset({"generate", "chat"})  # streams a drain can move mid-way


class NotSent(WorkerUnavailable):
    """The worker's socket refused the message (no live connection, or full)."""


class Forwarder:
    """Sends client requests to workers; ``GatewayService`` owns one."""

    def __init__(
        self,
        pool: Pool,
        placer: Placer,
        ledger: Ledger,
        affinity: AffinityTable,
        held: dict[str, list[Request]],
        ids: Iterator[int],
        metrics: GatewayMetrics | None,
        max_inflight_per_client: int,
    ) -> None:
        self.pool = pool
        self.placer = placer
        self.ledger = ledger
        self.affinity = affinity
        self.held = held  # sessions being moved -> requests waiting for them
        self.ids = ids  # gateway ids, shared with the pool's internal calls
        self.metrics = metrics
        self.limit = max_inflight_per_client
        self.trusted: set[bytes] = set()  # peers the per-client limit spares
        self.forwarded = 0

    def forward(self, req: Request) -> dict[str, Any] | None:
        """The op table's handler for every forwarded op: None (the worker
        answers), or a local answer (``drop`` of a lost session's name)."""
        limit = self.limit
        if (
            limit
            and self.ledger.per_client.get(req.peer, 0) >= limit
            and req.peer not in self.trusted
        ):
            raise LimitExceeded(
                f"this client has {limit} requests in flight; the limit is {limit} "
                "(--max-inflight-per-client)",
                retry_after_ms=100,
            )
        if req.op in SPEECH_OPS:
            self.dispatch(req, self.placer.speech_worker(), (), placed=False)
            return None
        sessions = sessions_of(req)
        for s in sessions:
            waiting = self.held.get(s)
            if waiting is not None:
                waiting.append(req)  # its session is moving; sent on when it lands
                return None
            lost = self.affinity.lost_on(s)
            if lost is not None and self.affinity.worker_of(s) is None:
                if req.op == "drop":  # the client lets it go: the name is free again
                    self.affinity.forget_lost(s)
                    return {}
                raise WorkerUnavailable(
                    f"session {s!r} was on worker {lost}, which went down: its state is "
                    "lost; drop it to start a new session of that name"
                )
        worker, placed, chosen = self.placer.place(req, sessions)
        try:
            self.dispatch(req, worker, sessions, placed)
        except NotSent:
            # Its connection just went (ZMQ_IMMEDIATE refused the send): let the
            # monitor say so, and give new work one more choice among the others.
            self.pool.monitor_events(worker)
            if not chosen:
                raise
            worker, placed, _ = self.placer.place(req, sessions, exclude=worker)
            self.dispatch(req, worker, sessions, placed)
        return None

    def dispatch(
        self, req: Request, w: WorkerConn, sessions: tuple[str, ...], placed: bool
    ) -> None:
        """Send ``req`` to ``w`` under a gateway id; raises a Fault when it cannot."""
        gid = next(self.ids)
        header: dict[str, Any] = {"v": VERSION, "id": gid, "op": req.op}
        if req.session is not None:
            header["session"] = req.session
        if req.args:
            header["args"] = req.args
        if req.deadline is not None:
            left = int((req.deadline - time.monotonic()) * 1000)
            if left <= 0:
                if placed:
                    self.ledger.unplace(w, sessions)
                raise DeadlineExceeded("deadline_ms passed before a worker was free")
            header["deadline_ms"] = left
        sent = self.pool.send(w, header, req.buffers)
        if not sent:
            if placed:
                self.ledger.unplace(w, sessions)
            raise NotSent(f"worker {w.name} is not accepting requests")
        rec = self.ledger.open(gid, req.peer, req.id, req.op, w, sessions, placed)
        if placed or not sessions:
            rec.retry = req
        if req.op in STREAM_OPS and req.args.get("stream", True) is True:
            rec.stream = req  # with media, movable once decoding (the worker says)
        self.forwarded += 1
        if req.op == "drop" and req.session is not None:
            self.affinity.drop_started(req.session)
        if self.metrics is not None:
            self.metrics.to_worker(sent)
