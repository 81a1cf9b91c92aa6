"""Jobs ended before their time (on the fakes of ``_scheduler_fakes``): cancel
of a queued or running job and of every job of an owner, expired deadlines
and the admission timeout.
"""

from __future__ import annotations

import time

from _scheduler_fakes import PEER, Harness

from faults import Cancelled, DeadlineExceeded, ErrorCode

# -- cancel --------------------------------------------------------------------


def test_cancel_queued_job_fails_cancelled_and_never_runs() -> None:
    h = Harness(lanes=1)
    h.submit(h.generate(max_tokens=10))
    queued = h.submit(h.generate())
    h.turn()
    assert h.sched.cancel(PEER, queued.ticket.id)
    assert not h.sched.cancel(PEER, 999)
    h.turn()
    err = h.error(queued)
    assert isinstance(err, Cancelled) and err.code == ErrorCode.CANCELLED
    assert len(h.out(queued)) == 1
    assert queued not in h.sched.pending
    h.run()
    assert h.rt.turns_with(h.session(queued)) == []
    assert h.sched.stats.cancelled == 1


def test_cancel_running_generate_ends_stream_with_cancelled_done() -> None:
    h = Harness(lanes=2)
    job = h.submit(h.generate(max_tokens=50))
    other = h.submit(h.generate(max_tokens=50))
    h.turn(3)
    assert len(h.tokens(job)) == 3
    assert h.sched.cancel(PEER, job.ticket.id)
    h.turn()
    done = h.done(job)
    assert done["finish_reason"] == "cancelled"
    assert done["usage"]["completion_tokens"] == 3
    assert h.rt.sessions_of(3) == [h.session(other)]  # no row for the cancelled one
    assert h.sched.active == [other]
    assert h.rt.lanes.get(h.session(job)) is None


def test_cancel_owner_cancels_every_job_of_that_owner() -> None:
    h = Harness(lanes=2)
    running = h.submit(h.generate(max_tokens=50, owner=b"gone"))
    kept = h.submit(h.generate(max_tokens=5, owner=b"stays"))
    queued = h.submit(h.generate(owner=b"gone"))
    h.turn()
    assert h.sched.cancel_owner(b"gone") == 2
    h.turn()
    assert h.done(running)["finish_reason"] == "cancelled"
    assert isinstance(h.error(queued), Cancelled)
    assert h.sched.active == [kept]
    assert not h.sched.pending
    h.run()
    assert h.done(kept)["finish_reason"] == "length"
    assert h.rt.turns_with(h.session(queued)) == []


# -- deadlines -----------------------------------------------------------------


def test_expired_deadline_ends_queued_and_running_jobs() -> None:
    h = Harness(lanes=1)
    running = h.submit(h.generate(max_tokens=50))
    queued = h.submit(h.generate())
    queued.ticket.deadline = time.monotonic() + 3600
    h.turn(2)
    assert list(h.sched.pending) == [queued]
    running.ticket.deadline = time.monotonic() - 1
    queued.ticket.deadline = time.monotonic() - 1
    forwards = len(h.rt.calls)
    h.turn()
    assert isinstance(h.error(running), DeadlineExceeded)
    err = h.error(queued)
    assert isinstance(err, DeadlineExceeded) and err.code == ErrorCode.DEADLINE_EXCEEDED
    assert len(h.rt.calls) == forwards  # nothing ran for either
    assert not h.sched.has_work()
    assert h.rt.lanes.free == 1
    assert h.sched.stats.expired == 2


def test_admission_timeout_applies_to_jobs_waiting_for_a_lane() -> None:
    # The scheduler reads the real clock: jobs "waited" by moving their receipt
    # an hour back, and ``fresh`` has ten minutes before it would expire, so a
    # slow machine between its submit and the turn changes nothing.
    h = Harness(lanes=1, admission_timeout_ms=600_000)
    running = h.submit(h.generate(session="s", max_tokens=50))
    h.turn()
    running.ticket.received -= 3600  # running: admission is over for it
    late = h.submit(h.generate())
    late.ticket.received -= 3600
    fresh = h.submit(h.generate())
    behind = h.submit(h.decode("s"))  # waits for its session, not for a lane
    behind.ticket.received -= 3600
    h.turn()
    err = h.error(late)
    assert isinstance(err, DeadlineExceeded)
    assert h.out(fresh) == [] and h.out(behind) == []
    assert list(h.sched.pending) == [fresh, behind]
    assert h.sched.active == [running]
    assert h.rt.turns_with(h.session(late)) == []
