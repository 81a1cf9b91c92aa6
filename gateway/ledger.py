"""The ledger of forwarded requests: who asked, under which id, where it went.

Every client request the gateway forwards gets a gateway-unique id (``gid``)
and an ``Inflight`` entry until its final reply (an error, a single result,
or the stream event with ``done``). From the entries the gateway knows

- which client and id a worker's reply belongs to;
- which worker runs a request (``cancel`` goes there) and which requests a
  worker that went down leaves unanswered;
- which sessions have requests in flight (a drain waits for them; the
  affinity table keeps them);
- the worker's load between two ``stats`` (sent and finished work, lanes
  taken and freed: ``WorkerConn.candidate``).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from .affinity import AffinityTable
from .ops import EPHEMERAL_LANE_OPS, WORK_OPS
from .pool import WorkerConn


@dataclass(slots=True)
class Inflight:
    """A client request forwarded to a worker, until its final reply."""

    gid: int
    peer: bytes | None  # None once the client is gone: replies are dropped
    client_id: int
    op: str
    worker: WorkerConn
    sessions: tuple[str, ...]
    placed: bool  # made placements not yet confirmed by an ok reply
    work: bool
    lane: bool
    # The request itself while another worker could still take it instead
    # (new placement or sessionless, no ok reply yet): a worker that answers
    # ``shutting_down`` ran nothing, so the gateway sends it elsewhere.
    retry: Any = None
    # A streamed generation (the request, without media): a drain can move it
    # to another worker mid-stream (``suspend``, then ``generate`` with resume).
    stream: Any = None


class Ledger:
    def __init__(self, affinity: AffinityTable) -> None:
        self.affinity = affinity
        self.inflight: dict[int, Inflight] = {}
        self.by_client: dict[tuple[bytes, int], int] = {}
        self.session_busy: dict[str, int] = {}  # session -> requests in flight naming it
        self.per_client: dict[bytes, int] = {}  # client -> its requests in flight

    def __len__(self) -> int:
        return len(self.inflight)

    def open(
        self,
        gid: int,
        peer: bytes,
        client_id: int,
        op: str,
        w: WorkerConn,
        sessions: tuple[str, ...],
        placed: bool,
    ) -> Inflight:
        work = op in WORK_OPS
        lane = not sessions and op in EPHEMERAL_LANE_OPS
        rec = Inflight(gid, peer, client_id, op, w, sessions, placed, work, lane)
        self.inflight[gid] = rec
        self.by_client[(peer, client_id)] = gid
        self.per_client[peer] = self.per_client.get(peer, 0) + 1
        w.inflight.add(gid)
        if work:
            w.sent_work += 1
        if lane:
            w.lanes_taken += 1
        busy = self.session_busy
        for s in sessions:
            busy[s] = busy.get(s, 0) + 1
        return rec

    def get(self, gid: int) -> Inflight | None:
        return self.inflight.get(gid)

    def of_client(self, peer: bytes, client_id: int) -> Inflight | None:
        gid = self.by_client.get((peer, client_id))
        return self.inflight.get(gid) if gid is not None else None

    def orphan(self, peer: bytes) -> list[Inflight]:
        """The requests of a client that went away; their replies will be dropped."""
        gone = [rec for rec in self.inflight.values() if rec.peer == peer]
        for rec in gone:
            self.by_client.pop((peer, rec.client_id), None)
            rec.peer = None
        self.per_client.pop(peer, None)
        return gone

    def confirm(self, rec: Inflight) -> None:
        """An ok reply: the sessions this request placed exist on its worker."""
        for s in rec.sessions:
            self.affinity.confirm(s)
        rec.placed = False
        rec.retry = None

    def finish(self, rec: Inflight, ok: bool) -> None:
        """Bookkeeping at a request's final reply (or its worker's end)."""
        self.inflight.pop(rec.gid, None)
        if rec.peer is not None:
            self.by_client.pop((rec.peer, rec.client_id), None)
            left = self.per_client.get(rec.peer, 1) - 1
            if left > 0:
                self.per_client[rec.peer] = left
            else:
                self.per_client.pop(rec.peer, None)
        w = rec.worker
        w.inflight.discard(rec.gid)
        if rec.work:
            w.done_work += 1
        if rec.lane or (ok and rec.op == "drop"):
            w.lanes_freed += 1
        if rec.op == "drop":
            for s in rec.sessions:
                self.affinity.drop_finished(s)
        busy = self.session_busy
        for s in rec.sessions:
            left = busy.get(s, 1) - 1
            if left > 0:
                busy[s] = left
            else:
                busy.pop(s, None)
        if rec.placed and not ok:
            # The request that placed these sessions failed before any ok reply:
            # nothing was admitted (lanes_busy, ...); the next try is placed afresh.
            self.unplace(w, rec.sessions)

    def unplace(self, w: WorkerConn, sessions: tuple[str, ...]) -> None:
        """Undo placements on ``w`` that no reply confirmed and nothing uses."""
        w.lanes_freed += len(sessions)
        for s in sessions:
            placed = self.affinity.get(s)
            if (
                placed is not None
                and placed.worker == w.name
                and not placed.confirmed
                and s not in self.session_busy
            ):
                self.affinity.remove(s)

    def busy(self, session: str) -> bool:
        return session in self.session_busy

    def client_work(self, w: WorkerConn, ignore: Collection[str] = ()) -> int:
        """Client requests in flight on ``w`` (internal calls not counted),
        leaving out those naming only sessions in ``ignore``."""
        inflight = self.inflight
        n = 0
        for gid in w.inflight:
            rec = inflight.get(gid)
            if rec is not None and not (
                ignore and rec.sessions and all(s in ignore for s in rec.sessions)
            ):
                n += 1
        return n
