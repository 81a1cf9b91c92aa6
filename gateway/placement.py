"""Where a request goes: the worker holding its sessions (affinity), else
the routing policy's pick among eligible LLM workers; speech ops to the
least busy speech worker.

Placement is bookkeeping too: a new session is assigned to the chosen
worker in the affinity table (confirmed by the first ok reply, see
``gateway/ledger.py``) and counted against its free lanes until the next
``stats``.
"""

from __future__ import annotations

import time

from edge import Request, logs
from faults import BadRequest, Unsupported, WorkerUnavailable

from .affinity import AffinityTable
from .ops import PROMPT_OPS, UNPLACED_OPS, carries_media, sees
from .pool import LLM, SPEECH, Pool, WorkerConn
from .router import Router, prompt_blocks

_log = logs.get_logger("skiff.gateway.placement")


class Placer:
    def __init__(self, pool: Pool, affinity: AffinityTable, router: Router) -> None:
        self.pool = pool
        self.affinity = affinity
        self.router = router

    def place(
        self, req: Request, sessions: tuple[str, ...], exclude: WorkerConn | None = None
    ) -> tuple[WorkerConn, bool, bool]:
        """The worker for ``req``, whether new placements were made, and
        whether the policy chose it (rather than the sessions' affinity)."""
        known = {w for s in sessions if (w := self.affinity.worker_of(s)) is not None}
        if len(known) > 1:
            raise BadRequest(
                f"the sessions of this {req.op} live on different workers; "
                "a batch must name sessions of one worker"
            )
        chosen = not known
        if known:
            worker = self.pool.workers[known.pop()]
            if not worker.up:
                raise WorkerUnavailable(f"worker {worker.name} holding the session is down")
        else:
            worker = self.choose(req, exclude)
        new = [s for s in sessions if self.affinity.worker_of(s) is None]
        if not new or req.op in UNPLACED_OPS:
            return worker, False, chosen
        now = time.monotonic()
        for s in new:
            self.affinity.assign(s, worker.name, now)
        worker.lanes_taken += len(new)
        return worker, True, chosen

    def choose(self, req: Request, exclude: WorkerConn | None = None) -> WorkerConn:
        """New work: the routing policy over eligible LLM workers (those that
        can see, for a request with images: ``seeing``)."""
        workers = [w for w in self.pool.workers.values() if w.kind == LLM]
        media = carries_media(req)
        if media:
            workers = self.seeing(workers)
        candidates = [w.candidate() for w in workers if w.eligible and w is not exclude]
        blocks = prompt_blocks(req.args) if req.op in PROMPT_OPS else ()
        name = self.router.choose(candidates, blocks)
        if (why := self.router.last) is not None and name is not None:
            _log.debug(
                "routed",
                worker=name,
                reason=why.reason,
                home=why.home,
                blocks=len(blocks),
                matched=why.matched,
                load={c.name: c.score for c in candidates},
            )
        if name is None:
            raise WorkerUnavailable(
                "no LLM worker that can see images (--mmproj) is up"
                if media
                else "no LLM worker is up"
            )
        return self.pool.workers[name]

    @staticmethod
    def seeing(workers: list[WorkerConn]) -> list[WorkerConn]:
        """The workers whose ``info`` says they take images. When every
        worker has answered ``info`` and none does, the request can never
        run here: ``unsupported`` (a 400 over HTTP), not "try later"."""
        found = [w for w in workers if sees(w.info)]
        if not found and workers and all(sees(w.info) is False for w in workers):
            raise Unsupported(
                "this request carries images and no worker behind this gateway can see: "
                "none was started with --mmproj (a multimodal projector)"
            )
        return found

    def speech_worker(self) -> WorkerConn:
        up = [w for w in self.pool.workers.values() if w.kind == SPEECH and w.eligible]
        if not up:
            raise WorkerUnavailable("no speech worker is up")
        # requests in flight there: the clients' and the pool's own calls
        return min(up, key=lambda w: (len(w.inflight) + len(w.peer.pending), w.name))
