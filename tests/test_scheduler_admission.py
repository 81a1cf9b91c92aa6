"""The scheduler's admission (on the fakes of ``_scheduler_fakes``): who takes
a lane and when, ``lanes_busy``, the bounded queue, and ephemeral sessions
dropped when their job ends.
"""

from __future__ import annotations

import pytest
from _scheduler_fakes import PEER, Harness, Row, sampled_token

from faults import ContextOverflow, ErrorCode, LanesBusy, QueueFull
from worker.core.jobs.session import SessionOpJob

# -- admission -----------------------------------------------------------------


def test_jobs_start_in_submit_order() -> None:
    h = Harness(lanes=3)
    jobs = [h.submit(h.generate()) for _ in range(3)]
    h.turn()
    assert h.sched.active == jobs
    assert [h.rt.lanes.require(h.session(j)).lane for j in jobs] == [0, 1, 2]


def test_waiting_generations_take_the_lane_in_submit_order() -> None:
    h = Harness(lanes=1)
    jobs = [h.submit(h.generate(max_tokens=3)) for _ in range(3)]
    h.run()
    spans = [h.rt.turns_with(h.session(j)) for j in jobs]
    # one at a time, in order: each starts after the previous one's last forward
    assert all(spans)
    assert spans[0][-1] < spans[1][0] and spans[1][-1] < spans[2][0]
    assert [h.done(j)["finish_reason"] for j in jobs] == ["length"] * 3


def test_second_job_on_a_busy_session_waits_for_the_first() -> None:
    h = Harness(lanes=2, max_batch_tokens=64, prefill_chunk=4)
    long = h.submit(h.prefill("s", 12))  # three chunks, three turns
    queued = h.submit(h.decode("s"))
    other = h.submit(h.decode("t"))
    h.turn()
    assert h.rt.sessions_of(0) == ["t", "s"]  # another session's decode is not held back
    assert h.result(other)["position"] == 1
    assert h.out(queued) == []
    h.turn(2)
    assert h.out(queued) == []  # the prefill ended this turn; the decode starts next
    assert h.result(long) == {"position": 12}
    h.turn()
    assert h.rt.calls[3] == [Row("s", (7,), True, False)]
    assert h.result(queued) == {"token": sampled_token(13), "position": 13}


def test_job_behind_a_waiting_generate_on_its_session_waits_too() -> None:
    h = Harness(lanes=1)
    h.submit(h.generate(max_tokens=3))  # holds the only lane for three turns
    waiting = h.submit(h.generate(session="n", max_tokens=2))
    behind = h.submit(h.decode("n"))  # needs no lane of its own once "n" exists
    h.turn()
    assert list(h.sched.pending) == [waiting, behind]
    assert h.out(behind) == []
    h.run()
    assert h.done(waiting)["finish_reason"] == "length"
    assert h.rt.turns_with("n") == [3, 4, 5]
    assert h.result(behind)["position"] == 3


def test_decode_on_a_new_session_without_a_free_lane_fails_lanes_busy() -> None:
    h = Harness(lanes=1)
    running = h.submit(h.generate(max_tokens=10))
    h.turn()
    refused = h.submit(h.decode("new"))
    h.turn()
    err = h.error(refused)
    assert isinstance(err, LanesBusy) and err.code == ErrorCode.LANES_BUSY
    assert h.rt.lanes.get("new") is None
    assert h.rt.turns_with("new") == []
    assert h.sched.active == [running]
    assert h.sched.stats.rejected == 1


def test_atomic_batch_needing_more_lanes_than_free_admits_nothing() -> None:
    h = Harness(lanes=3)
    h.rt.admit(["held"])
    refused = h.submit(h.batch({"held": 1, "a": 1, "b": 1, "c": 1}))  # 3 new, 2 free
    h.turn()
    err = h.error(refused)
    assert isinstance(err, LanesBusy) and err.code == ErrorCode.LANES_BUSY
    assert sorted(map(str, h.rt.lanes.sessions)) == ["held"]
    assert h.rt.lanes.free == 2
    assert h.rt.calls == []
    assert not h.sched.has_work()


def test_generate_waits_for_a_lane_instead_of_failing() -> None:
    h = Harness(lanes=1)
    first = h.submit(h.generate(max_tokens=3))
    second = h.submit(h.generate(max_tokens=2))
    h.turn(3)  # first: prefill + two decodes, then it ends and frees the lane
    assert h.done(first)["finish_reason"] == "length"
    assert h.out(second) == []
    assert list(h.sched.pending) == [second]
    assert h.rt.turns_with(h.session(second)) == []
    h.run()
    assert h.rt.turns_with(h.session(second)) == [3, 4]
    assert h.done(second)["finish_reason"] == "length"
    assert h.tokens(second) == [sampled_token(1), sampled_token(2)]


def test_lane_freed_during_admission_goes_to_the_earlier_waiting_generate() -> None:
    """A waiting generate is first in line for a lane; a later request must not
    take a lane that frees in the same admission pass (here by ``drop``)."""
    h = Harness(lanes=1)
    h.rt.admit(["idle"])  # an idle named session holds the only lane
    waiting = h.submit(h.generate())
    h.turn()
    assert list(h.sched.pending) == [waiting]
    h.submit(SessionOpJob(h.ticket("drop"), "idle", "drop"))
    later = h.submit(h.generate())
    h.run()
    assert h.rt.lanes.get("idle") is None
    first_turns = [h.rt.turns_with(h.session(j))[0] for j in (waiting, later)]
    assert first_turns[0] < first_turns[1], first_turns


# -- queue bound ---------------------------------------------------------------


def test_submit_refuses_when_queue_is_full_counting_free_lanes() -> None:
    h = Harness(lanes=2, max_queue=1)
    for _ in range(3):  # max_queue + 2 free lanes
        h.submit(h.generate(max_tokens=50))
    with pytest.raises(QueueFull) as caught:
        h.submit(h.generate())
    assert caught.value.code == ErrorCode.QUEUE_FULL
    assert isinstance(caught.value.retry_after_ms, int) and caught.value.retry_after_ms > 0
    assert len(h.sched.pending) == 3
    h.turn()  # two start and hold both lanes; one still waits
    assert len(h.sched.pending) == 1
    with pytest.raises(QueueFull):
        h.submit(h.generate())  # 1 waiting >= max_queue + 0 free lanes
    assert h.sched.stats.rejected == 2


# -- ephemeral sessions --------------------------------------------------------


def test_ephemeral_session_is_dropped_when_its_job_ends() -> None:
    h = Harness(lanes=3)
    finishes = h.submit(h.generate(max_tokens=2))
    cancelled = h.submit(h.generate(max_tokens=50))
    named = h.submit(h.generate(session="keep", max_tokens=2))
    h.turn()
    assert h.rt.lanes.free == 0
    h.sched.cancel(PEER, cancelled.ticket.id)
    h.run()
    assert h.done(finishes)["finish_reason"] == "length"
    assert h.done(cancelled)["finish_reason"] == "cancelled"
    assert h.done(named)["finish_reason"] == "length"
    assert [str(s) for s in h.rt.lanes.sessions] == ["keep"]  # a named session stays
    assert h.rt.lanes.require("keep").pending == [sampled_token(2)]
    assert h.rt.lanes.free == 2


def test_ephemeral_session_is_dropped_when_start_fails() -> None:
    h = Harness(lanes=1, ctx=8)
    too_long = h.submit(h.generate(prompt_len=9))
    h.turn()
    assert isinstance(h.error(too_long), ContextOverflow)
    assert h.rt.lanes.free == 1
    assert h.rt.calls == []
