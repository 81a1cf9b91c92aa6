"""Failed forwards and steps (on the fakes of ``_scheduler_fakes``): a failed
batch is retried job by job so only its culprit fails, a sampling error
fails its own job, and the scheduler goes on after a failure.
"""

from __future__ import annotations

from _scheduler_fakes import Harness, sampled_token

from faults import BadRequest, EngineFault

# -- failures ------------------------------------------------------------------


def test_a_batch_that_fails_once_is_retried_job_by_job_and_nobody_fails() -> None:
    h = Harness(lanes=3, max_batch_tokens=4)
    stream = h.submit(h.generate(max_tokens=50))
    h.turn()
    in_turn = h.submit(h.batch({"x": 2}))
    left_out = h.submit(h.batch({"y": 2}))  # 1 + 2 + 2 > 4: not in this turn
    h.rt.fail_next = True
    h.turn()
    assert h.rt.sessions_of(1) == [h.session(stream), "x"]  # failed, nothing moved
    assert h.rt.sessions_of(2) == [h.session(stream)]  # then each job alone
    assert h.rt.sessions_of(3) == ["x"]
    assert h.result(in_turn)["positions"] == [2]
    assert h.out(left_out) == []
    h.turn()
    assert set(h.rt.sessions_of(4)) == {h.session(stream), "y"}
    assert h.result(left_out)["positions"] == [2]
    h.run()
    assert h.done(stream)["finish_reason"] == "length"


def test_a_failed_batch_is_retried_job_by_job_so_only_the_culprit_fails() -> None:
    h = Harness(lanes=4, max_batch_tokens=8)
    stream = h.submit(h.generate(max_tokens=6))
    h.turn()
    culprit = h.submit(h.batch({"x": 3}))
    bystander = h.submit(h.batch({"y": 2}))
    h.rt.cannot_fit = "x"
    h.turn()
    # one forward of all three failed; then each job ran alone
    assert h.rt.sessions_of(1) == [h.session(stream), "x", "y"]
    assert h.rt.sessions_of(2) == [h.session(stream)]
    assert h.rt.sessions_of(3) == ["x"]
    assert h.rt.sessions_of(4) == ["y"]
    assert isinstance(h.error(culprit), EngineFault)
    assert h.result(bystander)["positions"] == [2]
    h.run()
    assert h.done(stream)["finish_reason"] == "length"
    assert h.rt.lanes.get("y") is not None and h.rt.lanes.get("y").position == 2


def test_a_job_whose_kv_moved_in_a_failed_batch_fails_with_it() -> None:
    h = Harness(lanes=3, max_batch_tokens=8)
    moved = h.submit(h.batch({"m": 2}))
    culprit = h.submit(h.batch({"x": 3}))
    h.rt.cannot_fit = "x"
    h.rt.advance_on_failure = {"m": 2}
    h.turn()
    assert isinstance(h.error(moved), EngineFault)  # its progress is the runtime's now
    assert isinstance(h.error(culprit), EngineFault)
    assert h.rt.sessions_of(1) == ["x"]  # only the culprit was tried alone


def test_sampling_error_of_one_step_fails_only_its_job() -> None:
    h = Harness(lanes=2)
    bad = h.submit(h.decode("bad"))
    good = h.submit(h.decode("good"))
    h.rt.step_error = "bad"
    h.turn()
    assert h.rt.sessions_of(0) == ["bad", "good"]
    assert isinstance(h.error(bad), BadRequest)
    assert h.result(good) == {"token": sampled_token(1), "position": 1}
    assert not h.sched.has_work()


def test_scheduler_keeps_working_after_a_failed_forward() -> None:
    h = Harness(lanes=1)
    h.rt.fail_next = True
    broken = h.submit(h.generate(max_tokens=3))
    h.turn()
    assert isinstance(h.error(broken), EngineFault)
    later = h.submit(h.generate(max_tokens=3))
    h.run()
    assert h.done(later)["finish_reason"] == "length"
    assert h.rt.lanes.free == 1
