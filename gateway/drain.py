"""Draining a worker: move its named sessions live, then stop routing to it.

``gateway_drain {"worker": EP}`` (``skiff-gateway drain EP``) runs, inside
the gateway's loop and without blocking it:

1. mark the worker *draining*: it gets no new sessions and no ephemeral
   work, but requests for the sessions it holds still reach it;
2. ask it for ``stats``; for each named session it holds (its list and the
   affinity table's), one at a time:
   a. *hold* the session: its new requests wait in the gateway;
   b. *suspend* its running streams (``suspend``: each stops between two
      tokens with a ``suspended`` event the client never sees), then wait
      until the session has nothing in flight;
   c. ``export_state`` on the old worker, ``import_state`` on the least
      loaded other worker with a free lane (the KV buffers pass through as
      the received frames, not copied), ``drop`` on the old worker — the
      migration of ``protocol.Client.migrate``;
   d. point the affinity at the new worker, resume its suspended streams
      there (``generate`` with ``resume``, answering the same client request:
      the client sees one stream, to the bit the tokens of one that never
      moved), and send the held requests on, in their order of arrival.
   A session that cannot move (no other worker with a free lane, a refused
   import) stays where it is and keeps being served there; the result
   lists it under ``failed``;
3. move sessionless streams the same way (the worker names their session
   when it suspends them), and wait for the worker's other requests;
4. mark it *drained*: nothing new is routed to it. A drained worker rejoins
   when it restarts (it goes down and answers again): drain, restart, done.

The reply to ``gateway_drain`` comes when all of this is over:
``{"worker", "moved": [{"session", "to", "position"}], "failed":
[{"session", "error"}], "seconds"}``.

A worker that gets SIGTERM says ``leaving`` (a message without an id) to
the gateway; the gateway drains it as above, first claiming its sessions
(``handoff``: the worker waits for them) and at the end letting it go
(``handoff done``). A stream or session that cannot move (no other worker
up with room) finishes where it is, as before.

A drain is a generator that yields ``Call`` (an internal request; it resumes
with the reply) or ``Wait`` (a condition polled every loop tick), so the
steps read in order while the loop keeps serving everyone else.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from edge import Request, logs
from faults import BadRequest, Fault

from .host import Host
from .ledger import Inflight
from .pool import LLM, WorkerConn

_log = logs.get_logger("skiff.gateway.drain")

Answer = tuple[dict[str, Any], list[zmq.Frame]]


@dataclass
class Call:
    worker: WorkerConn
    op: str
    session: str | None = None
    args: dict[str, Any] | None = None
    buffers: Sequence[Any] = ()


@dataclass
class Wait:
    until: Callable[[], bool]


Steps = Generator[Call | Wait, Answer, dict[str, Any]]
NOTHING: Answer = ({}, [])  # what a Wait resumes with
Done = Callable[[dict[str, Any] | Fault], None]


@dataclass(eq=False)
class _Task:
    worker: WorkerConn
    done: Done
    steps: Steps | None = None
    primed: bool = False  # the generator has run to its first step
    started: float = field(default_factory=time.monotonic)
    waiting: Callable[[], bool] | None = None
    moved: int = 0
    session: str | None = None  # the one moving now
    claim: bool = False  # the worker said it is leaving: claim, then release it
    # streams asked to suspend -> their ``suspended`` event once it came
    suspending: dict[int, tuple[Inflight, dict[str, Any]] | None] = field(default_factory=dict)


class Drainer:
    """Runs drain tasks on the service's loop."""

    def __init__(self, svc: Host) -> None:
        self.svc = svc
        self.tasks: list[_Task] = []

    def start(self, worker: WorkerConn, done: Done, claim: bool = False) -> None:
        if any(t.worker is worker for t in self.tasks) or (worker.draining and not claim):
            raise BadRequest(f"worker {worker.name} is already draining")
        task = _Task(worker, done, claim=claim)
        task.steps = self._drain(worker, task)
        self.tasks.append(task)
        _log.info("drain_started", worker=worker.name)
        self._advance(task, NOTHING)

    def leaving(self, worker: WorkerConn) -> None:
        """A worker said it is leaving (SIGTERM): move what it holds."""
        if worker.kind != LLM or any(t.worker is worker for t in self.tasks):
            return
        _log.info("worker_leaving", worker=worker.name)

        def done(result: dict[str, Any] | Fault) -> None:
            if isinstance(result, Fault):
                _log.error("leaving_drain_failed", worker=worker.name, error=str(result))
            else:
                _log.info("leaving_drained", moved=len(result["moved"]), failed=result["failed"])

        self.start(worker, done, claim=True)

    def suspended(self, rec: Inflight, header: dict[str, Any]) -> None:
        """A stream a drain asked to stop has stopped; its task goes on with it."""
        for task in self.tasks:
            if rec.gid in task.suspending:
                task.suspending[rec.gid] = (rec, header)
                self.poll()  # a drain waiting for it goes on now, not at the next tick
                return
        _log.warning("suspended_unasked", worker=rec.worker.name, id=rec.gid)

    def poll(self) -> None:
        """Resume tasks whose condition now holds."""
        for task in list(self.tasks):
            if task.waiting is not None and task.waiting():
                task.waiting = None
                self._advance(task, NOTHING)

    def active(self) -> list[dict[str, Any]]:
        return [
            {
                "worker": t.worker.name,
                "moved": t.moved,
                "moving": t.session,
                "seconds": round(time.monotonic() - t.started, 3),
            }
            for t in self.tasks
        ]

    def _advance(self, task: _Task, answer: Answer) -> None:
        assert task.steps is not None
        while True:
            try:
                step = task.steps.send(answer) if task.primed else next(task.steps)
                task.primed = True
            except StopIteration as stop:
                self._end(task, stop.value)
                return
            except Exception as exc:  # a bug must not leave a worker half drained
                _log.exception("drain_crashed", worker=task.worker.name)
                task.worker.draining = False
                self._end(task, Fault(f"drain failed: {type(exc).__name__}: {exc}"))
                return
            if isinstance(step, Wait):
                if step.until():
                    answer = NOTHING
                    continue
                task.waiting = step.until
                return
            self.svc.pool.call(
                step.worker,
                step.op,
                step.session,
                step.args,
                step.buffers,
                on_reply=functools.partial(self._resume, task),
            )
            return

    def _resume(self, task: _Task, header: dict[str, Any], frames: list[zmq.Frame]) -> None:
        self._advance(task, (header, frames))

    def _end(self, task: _Task, result: dict[str, Any] | Fault) -> None:
        if task in self.tasks:
            self.tasks.remove(task)
        _log.info("drain_finished", worker=task.worker.name, moved=task.moved)
        task.done(result)

    # -- the drain itself --------------------------------------------------------------

    def _drain(self, w: WorkerConn, task: _Task) -> Steps:
        svc = self.svc
        w.draining = True
        moved: list[dict[str, Any]] = []
        failed: list[dict[str, Any]] = []
        if task.claim:
            yield Call(w, "handoff")  # the worker now waits for us to take them
        header, _ = yield Call(w, "stats")
        listed = [
            str(s["session"])
            for s in (header.get("result") or {}).get("sessions") or ()
            if isinstance(s, dict) and not s.get("ephemeral") and s.get("session")
        ]
        names = sorted(set(listed) | set(svc.affinity.sessions_of(w.name)))
        for session in names:
            if not w.up:
                failed.append({"session": session, "error": "worker went down"})
                continue
            if svc.affinity.worker_of(session) not in (w.name, None):
                continue  # placed elsewhere since
            task.session = session
            svc.hold(session)
            try:
                if self._target(w) is not None:  # with nowhere to go, streams finish here
                    yield from self._suspend(w, task, functools.partial(_names, session))
                yield Wait(functools.partial(_settled, svc, w, session))
                # the streams go on the moment it lands (before the old copy is dropped)
                landed = functools.partial(self._resume_streams, task, session=session)
                error, where = yield from self._move(w, session, landed=landed)
                if error is not None:
                    self._resume_streams(task, w, session)  # it stayed: they go on here
            finally:
                task.session = None
                svc.release(session)
            if error is None:
                moved.append(where)
                task.moved += 1
                svc.migrated("ok")
            else:
                failed.append({"session": session, "error": error})
                svc.migrated("failed")
        # Sessionless streams: the worker names each one's session as it stops.
        if w.up and self._target(w) is not None:
            yield from self._suspend(w, task, lambda r: not r.sessions)
            yield Wait(lambda: all(v is not None for v in task.suspending.values()) or not w.up)
            for gid, got in list(task.suspending.items()):
                del task.suspending[gid]
                assert got is not None
                rec, event = got
                name = event.get("session")
                if not isinstance(name, str):  # it had not started: send it anywhere
                    target = self._target(w) or w
                    resume_stream(svc, rec, target, "", None)
                    continue
                go_on = functools.partial(_go_on, svc, rec, name, event.get("resume"))
                error, _ = yield from self._move(w, name, affinity=False, landed=go_on)
                if error is not None:
                    go_on(w)  # it stayed: it goes on here
        # Other work ends by itself; sessions that could not move keep being
        # served here and are not waited for.
        stuck = frozenset(f["session"] for f in failed)
        yield Wait(lambda: svc.client_work(w, stuck) == 0 or not w.up)
        if task.claim and w.up:
            yield Call(w, "handoff", args={"done": True})  # it may go now
        w.drained = True
        w.draining = False
        return {
            "worker": w.name,
            "moved": moved,
            "failed": failed,
            "seconds": round(time.monotonic() - task.started, 3),
        }

    def _suspend(
        self, w: WorkerConn, task: _Task, which: Callable[[Inflight], bool]
    ) -> Generator[Call | Wait, Answer, None]:
        """Ask ``w``'s streams that ``which`` picks to stop between two tokens."""
        streams = [
            r
            for r in self.svc.ledger.inflight.values()
            if r.worker is w and r.stream is not None and r.peer is not None and which(r)
        ]
        for rec in streams:
            reply, _ = yield Call(w, "suspend", args={"id": rec.gid})
            if (reply.get("result") or {}).get("suspended") is True:
                task.suspending.setdefault(rec.gid, None)

    def _resume_streams(self, task: _Task, target: WorkerConn, session: str) -> None:
        """Resume the session's suspended streams on ``target`` (where it went,
        or its old worker when it could not move)."""
        for gid, got in list(task.suspending.items()):
            if got is None or session not in got[0].sessions:
                continue
            del task.suspending[gid]
            rec, event = got
            resume_stream(self.svc, rec, target, session, event.get("resume"))

    def _move(
        self,
        w: WorkerConn,
        session: str,
        affinity: bool = True,
        landed: Callable[[WorkerConn], None] | None = None,
    ) -> Generator[Call | Wait, Answer, tuple[str | None, dict[str, Any]]]:
        """One live migration; (None, where) or (error, {}). ``landed(target)``
        runs once the import is done, before the old copy is dropped."""
        svc = self.svc
        if not w.up:
            return "worker went down", {}
        target = self._target(w)
        if target is None:
            return "no other worker is up with a free lane", {}
        exported, buffers = yield Call(w, "export_state", session)
        if not exported.get("ok"):
            return _error(exported, "export_state"), {}
        result = exported.get("result") or {}
        args = {"session_state": result.get("session_state"), "frame": result.get("frame")}
        # The lane counts as taken from the send, as a placement's does: a stats
        # request that overtakes the reply would otherwise count it twice.
        target.lanes_taken += 1
        imported, _ = yield Call(target, "import_state", session, args, buffers)
        if not imported.get("ok"):
            target.lanes_freed += 1
            return _error(imported, f"import_state on {target.name}"), {}
        if affinity:
            svc.affinity.assign(session, target.name, time.monotonic(), confirmed=True)
        if landed is not None:
            landed(target)
        dropped, _ = yield Call(w, "drop", session)
        if dropped.get("ok"):
            w.lanes_freed += 1
        else:
            _log.warning("drain_drop_failed", session=session, error=_error(dropped, "drop"))
        position = (imported.get("result") or {}).get("position")
        _log.info("session_moved", session=session, to=target.name, position=position)
        return None, {"session": session, "to": target.name, "position": position}

    def _target(self, w: WorkerConn) -> WorkerConn | None:
        """The least loaded other eligible LLM worker with a free lane."""
        others = [
            o for o in self.svc.pool.workers.values() if o is not w and o.kind == LLM and o.eligible
        ]
        roomy = [(o.candidate(), o) for o in others]
        # a worker with a park takes a session even with every lane running
        roomy = [(c, o) for c, o in roomy if c.free_lanes > 0 or o.stats.get("park")]
        if not roomy:
            return None
        return min(roomy, key=lambda co: (co[0].score, co[1].name))[1]


# What a moved stream's request loses: its prompt is in the session already.
_PROMPT_ARGS = frozenset({"prompt", "tokens", "messages", "media", "resume"})


def resume_stream(
    svc: Host, rec: Inflight, target: WorkerConn, session: str, resume: dict[str, Any] | None
) -> None:
    """Go on with a stream suspended on its worker: ``generate`` with
    ``resume`` on ``target`` (``None``: it had not started, send it as it
    was), answering the same client request under a new gateway id."""
    req = rec.stream
    if rec.peer is None or not isinstance(req, Request):
        return  # its client went away
    if resume is not None:
        args = {k: v for k, v in req.args.items() if k not in _PROMPT_ARGS}
        req = dataclasses.replace(
            req, op="generate", session=session, args={**args, "resume": resume}
        )
    named = (session,) if not (resume or {}).get("ephemeral") else ()
    if not svc.dispatch(req, target, named):
        return
    moved = svc.ledger.of_client(req.peer, req.id)
    if moved is not None:
        moved.retry = None  # its session is on ``target`` only
    svc.streams_moved += 1
    _log.info("stream_moved", to=target.name, session=session, resumed=resume is not None)


def _go_on(
    svc: Host, rec: Inflight, name: str, resume: dict[str, Any] | None, target: WorkerConn
) -> None:
    resume_stream(svc, rec, target, name, resume)


def _names(session: str, rec: Inflight) -> bool:
    return session in rec.sessions


def _settled(svc: Host, w: WorkerConn, session: str) -> bool:
    """Nothing in flight for ``session`` any more (or its worker is gone)."""
    return not svc.busy(session) or not w.up


def _error(header: dict[str, Any], what: str) -> str:
    err = header.get("error") or {}
    return f"{what}: {err.get('code', 'internal')}: {err.get('message', '')}"
