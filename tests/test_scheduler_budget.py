"""What goes into a turn's forward (on the fakes of ``_scheduler_fakes``): the
token budget and prefill chunks, the order of decode rows, atomic batches and
prompt pieces, the boost of a batch that did not fit, and a turn's prefill
cut to the time its streams can wait (cadence).
"""

from __future__ import annotations

import pytest
from _scheduler_fakes import Harness, sampled_token

from worker.core.jobs.base import Failure, Job, even_piece, piece_limit
from worker.core.outcomes import TurnClock
from worker.runtime import Session

# -- token budget --------------------------------------------------------------


def test_no_forward_exceeds_the_token_budget() -> None:
    h = Harness(lanes=8, max_batch_tokens=16, prefill_chunk=8)
    jobs: list[Job] = [
        h.generate(prompt_len=20, max_tokens=4),
        h.generate(prompt_len=13, max_tokens=4),
        h.prefill("p", 30),
        h.batch({"x": 5, "y": 5}),
        h.decode("d"),
        h.generate(prompt_len=9, max_tokens=6),
        h.batch({"z": 7}),
    ]
    for job in jobs:
        h.submit(job)
    h.run()
    assert all(job.ticket.finished for job in jobs)
    assert not any(isinstance(o, Failure) for job in jobs for o in h.out(job))
    # the budget was binding: the atomic z (7) did not fit beside d, x and y (11)
    assert h.rt.sessions_of(0) == ["d", "x", "y"] and "z" in h.rt.sessions_of(1)
    assert all(total <= 16 for total in h.rt.totals())
    # a piece is at most one chunk, or an eighth more when that ends the prompt
    assert all(len(row.tokens) <= piece_limit(8) == 9 for call in h.rt.calls for row in call)


def test_long_prefill_is_split_into_chunks_across_turns() -> None:
    h = Harness(lanes=1, max_batch_tokens=64, prefill_chunk=4)
    job = h.submit(h.prefill("s", 10, sampled=True))
    h.turn(2)
    assert h.out(job) == []
    h.turn()
    assert [[len(r.tokens) for r in call] for call in h.rt.calls] == [[4], [4], [2]]
    assert [r.sample for call in h.rt.calls for r in call] == [False, False, True]
    assert h.result(job) == {"position": 10, "token": sampled_token(10)}


def test_prefill_pieces_fit_beside_decodes_and_are_not_cut_into_crumbs() -> None:
    # 2 decode rows + a 3-token piece fill a budget of 5.
    h = Harness(lanes=3, max_batch_tokens=5, prefill_chunk=3)
    streams = [h.submit(h.generate(max_tokens=10)) for _ in range(2)]
    h.turn()  # both prompts (1 token each); both streams now decode every turn
    h.submit(h.prefill("p", 12))
    h.turn(4)
    for call in h.rt.calls[1:]:
        assert [len(r.tokens) for r in call] == [1, 1, 3]
    assert all(h.tokens(s) for s in streams)
    # A piece larger than the room left would be cut below MIN_CUT: it waits.
    h = Harness(lanes=3, max_batch_tokens=5, prefill_chunk=4)
    for _ in range(2):
        h.submit(h.generate(max_tokens=10))
    h.turn()
    h.submit(h.prefill("p", 12))
    h.turn(2)
    assert all([len(r.tokens) for r in call] == [1, 1] for call in h.rt.calls[1:])


# -- batch order ---------------------------------------------------------------


def test_decode_rows_come_first_in_lane_order_every_turn() -> None:
    h = Harness(lanes=4, max_batch_tokens=64, prefill_chunk=8)
    h.rt.admit(["c", "b", "a"])  # lanes 0, 1, 2: lane order is c, b, a
    for sid in ("a", "b", "c"):  # submit (and active) order is a, b, c
        h.submit(h.generate(session=sid, max_tokens=6))
    h.turn()
    h.submit(h.prefill("p", 100))
    h.turn(4)
    for call in h.rt.calls[1:]:
        assert [r.session for r in call] == ["c", "b", "a", "p"]


class _Recording:
    """A drafter that drafts nothing and remembers the ``streams`` it was told."""

    def __init__(self) -> None:
        self.streams: list[int] = []

    def draft(self, session: Session, next_token: int, limit: int, streams: int = 1) -> list[int]:
        self.streams.append(streams)
        return []


def test_a_drafter_is_told_how_many_streams_its_forward_decodes() -> None:
    h = Harness(lanes=4, max_batch_tokens=64)
    drafters = [_Recording() for _ in range(3)]
    for i, drafter in enumerate(drafters):
        job = h.generate(session=f"s{i}", max_tokens=3 + 2 * i)
        job.drafter = drafter
        h.submit(job)
    h.run()
    # each decode turn: as many streams as are decoding (3, then 2, then 1)
    assert drafters[0].streams == [3, 3]
    assert drafters[1].streams == [3, 3, 2, 2]
    assert drafters[2].streams == [3, 3, 2, 2, 1, 1]


def test_a_prompt_being_prefilled_counts_among_a_drafters_streams() -> None:
    """Beside a prompt's piece every row costs a prompt token's time, so
    the drafter is told the prompt shares the forward (auto drafting stops
    above ``--speculate-streams``) for as long as its pieces last."""
    h = Harness(lanes=2, max_batch_tokens=64, prefill_chunk=4)
    drafter = _Recording()
    job = h.generate(session="s", max_tokens=8)
    job.drafter = drafter
    h.submit(job)
    h.turn(2)
    assert drafter.streams == [1]
    h.submit(h.prefill("p", 12))  # three pieces of 4
    h.turn(4)
    assert drafter.streams == [1, 2, 2, 2, 1]


def test_a_turn_batches_decode_then_atomic_then_prefill() -> None:
    h = Harness(lanes=4, max_batch_tokens=64)
    h.rt.admit(["pre", "atom"])  # lanes 0 and 1, ahead of the stream's lane 2
    stream = h.submit(h.generate(max_tokens=10))
    h.turn()
    h.submit(h.prefill("pre", 3))
    atomic = h.submit(h.batch({"atom": 2}))
    h.submit(h.decode("dec"))  # lane 3, after everyone in lane order
    h.turn()
    assert h.rt.sessions_of(1) == [h.session(stream), "dec", "atom", "pre"]
    assert h.result(atomic)["positions"] == [2]


def test_the_prompt_closest_to_done_is_prefilled_first() -> None:
    """Shortest remaining prompt first: equal prompts go one after the other
    (the first started is closer to done), a shorter one overtakes both."""
    h = Harness(lanes=3, max_batch_tokens=64, prefill_chunk=4)
    h.submit(h.prefill("p1", 12))
    h.submit(h.prefill("p2", 12))
    h.turn(2)
    h.submit(h.prefill("short", 2))  # 2 left: fewer than p1's 4
    h.turn(5)
    order = [s for i in range(7) for s in h.rt.sessions_of(i)]
    assert order == ["p1", "p1", "short", "p1", "p2", "p2", "p2"], order


def test_while_prompts_wait_a_turn_carries_one_piece_beside_the_streams() -> None:
    """Each turn finishes the next prompt (and starts its stream) instead of
    carrying every prompt a little further; streams decode every turn."""
    h = Harness(lanes=6, max_batch_tokens=64, prefill_chunk=8)
    for _ in range(2):
        h.submit(h.generate(max_tokens=50))
    h.turn()  # two streams decode from now on
    gens = [h.submit(h.generate(prompt_len=8, max_tokens=50)) for _ in range(3)]
    h.turn(3)
    for i, gen in enumerate(gens, start=1):
        prefill = [r for r in h.rt.calls[i] if len(r.tokens) > 1]
        assert [len(r.tokens) for r in prefill] == [8]  # one prompt a turn ...
        assert h.tokens(gen)  # ... whose first token is out at once
        assert len(h.rt.calls[i]) == 2 + (i - 1) + 1  # beside every stream started so far


def test_a_prompt_that_waited_long_goes_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long prompt is not starved by short ones arriving all the time."""
    from worker.core import scheduler as sched_mod

    h = Harness(lanes=4, max_batch_tokens=64, prefill_chunk=4)
    long = h.submit(h.prefill("long", 40))
    h.turn()
    h.submit(h.prefill("s1", 4))
    h.turn()
    assert h.rt.sessions_of(1) == ["s1"]  # shorter first while the long one is young
    monkeypatch.setattr(sched_mod, "PREFILL_AGE_S", 0.0)
    h.submit(h.prefill("s2", 4))
    h.turn()
    assert h.rt.sessions_of(2) == ["long"]  # it has waited: it goes first
    assert not h.out(long)


# -- boost ---------------------------------------------------------------------


def test_atomic_batch_that_did_not_fit_goes_first_next_turn() -> None:
    h = Harness(lanes=2, max_batch_tokens=4)
    first = h.submit(h.batch({"a": 3}))
    starved = h.submit(h.batch({"b": 2}))  # 2 > the 1 token left this turn
    h.turn()
    assert h.rt.sessions_of(0) == ["a"]
    assert h.out(starved) == []
    again = h.submit(h.batch({"a": 3}))  # lane 0 would go before lane 1 by lane order
    h.turn()
    assert h.rt.sessions_of(1) == ["b"]  # and "a" (3) no longer fits behind it
    assert h.result(starved)["positions"] == [2]
    h.turn()
    assert h.rt.sessions_of(2) == ["a"]
    assert h.result(first)["positions"] == [3]
    assert h.result(again)["positions"] == [6]


def test_atomic_batch_goes_first_next_turn_after_budget_ran_out() -> None:
    """A batch skipped because the budget was used up exactly did not fit
    either: it must go first next turn, or a client pipelining full-budget
    batches on a lower lane starves it."""
    h = Harness(lanes=2, max_batch_tokens=4)
    h.submit(h.batch({"a": 4}))
    starved = h.submit(h.batch({"b": 1}))
    h.turn()
    assert h.rt.sessions_of(0) == ["a"]
    h.submit(h.batch({"a": 4}))
    h.turn()
    assert h.rt.sessions_of(1)[0] == "b"
    assert h.result(starved)["positions"] == [1]


def test_boosted_atomic_batch_goes_before_decode_rows() -> None:
    h = Harness(lanes=3, max_batch_tokens=4)
    stream = h.submit(h.generate(max_tokens=20))
    h.turn()
    h.submit(h.batch({"x": 2}))  # 1 + 2 fits
    starved = h.submit(h.batch({"y": 2}))  # 1 token left: does not fit
    h.turn()
    assert h.rt.sessions_of(1) == [h.session(stream), "x"]
    h.turn()
    assert h.rt.sessions_of(2) == ["y", h.session(stream)]
    assert h.result(starved)["positions"] == [2]


# -- cadence: turns budgeted by time -------------------------------------------------


def test_turn_clock_learns_decode_and_prefill_costs() -> None:
    clock = TurnClock()
    assert clock.prefill_allowance(2.5, 8) is None  # nothing measured yet: no time limit
    clock.record(rows=8, pieces=0, tokens=0, ms=80.0)
    clock.record(rows=4, pieces=0, tokens=0, ms=50.0)
    assert clock.decode_at(8) == 80.0 and clock.decode_at(3) == 50.0  # the nearest count
    clock.record(rows=0, pieces=1, tokens=100, ms=500.0)  # a prompt by itself: 5 ms a token
    clock.record(rows=0, pieces=1, tokens=100, ms=500.0)
    assert clock.piece_cost() == (0.0, 5.0)  # stands in until pieces ran beside streams
    clock.record(rows=8, pieces=1, tokens=30, ms=80.0 + 120.0)  # 30 tokens added 120 ms
    clock.record(rows=8, pieces=1, tokens=30, ms=80.0 + 120.0)
    assert clock.piece_cost() == (0.0, 4.0)  # one size only: all of it per token
    # a turn of 8 streams + the prompt's = 80 ms: 2.5 x 80 leaves 120 ms, 30 tokens
    assert clock.prefill_allowance(2.5, 8) == 30
    # pieces of other sizes show the fixed part: 20 ms + 2 ms a token
    clock.pieces.clear()
    clock.record(rows=8, pieces=1, tokens=30, ms=80.0 + 80.0)
    clock.record(rows=4, pieces=1, tokens=10, ms=50.0 + 40.0)
    clock.record(rows=4, pieces=1, tokens=60, ms=50.0 + 140.0)
    fixed, per = clock.piece_cost() or (0.0, 0.0)
    assert abs(fixed - 20.0) < 1e-6 and abs(per - 2.0) < 1e-6
    assert clock.prefill_allowance(2.5, 8) == 50  # (2.5 x 80 - 80 - 20) / 2
    assert clock.prefill_allowance(2.5, 3) == 27  # beside 3 rows, 4 with it: (125 - 50 - 20) / 2
    clock.record(rows=8, pieces=0, tokens=0, ms=100.0, gaps=1)  # a gap: 20 ms more
    assert clock.gap_ms == 20.0 and clock.decode_at(8) == 80.0  # gapped: not a decode turn
    assert clock.prefill_allowance(2.5, 8, gaps=1) == 40  # (200 - 80 - 20 - 20) / 2
    assert clock.prefill_allowance(2.5, 8, drafts=5) == 45  # 5 draft tokens at 2 ms
    assert clock.prefill_allowance(2.5, 8, spent_ms=8.0) == 46  # admission took 8 ms of it
    assert clock.prefill_allowance(0, 8) is None  # cadence off
    assert clock.prefill_allowance(1.0, 8) == 16  # never below MIN_CUT: prompts always progress
    clock.record(rows=8, pieces=2, tokens=64, ms=500.0)  # two pieces: not a sample of one
    assert len(clock.pieces) == 3


def test_a_paced_prompt_goes_in_pieces_of_one_size() -> None:
    assert [even_piece(100, 30), even_piece(75, 30), even_piece(50, 30)] == [25, 25, 25]
    assert even_piece(25, 30) == 30 and even_piece(130, 36) == 33
    assert even_piece(100, 16) == 16  # 15 x 7 would be under MIN_CUT: such a piece waits


def _fixed_costs(clock: TurnClock) -> None:
    """A decode turn of 80 ms at any row count, a prompt token 4 ms, learned no more."""
    clock.decode_ms = {1: 80.0}
    clock.pieces.extend([(30, 120.0), (30, 120.0)])
    clock.record = lambda *a: None  # type: ignore[method-assign]


def test_prefill_is_cut_to_the_time_left_while_streams_decode() -> None:
    h = Harness(lanes=3, max_batch_tokens=512, prefill_chunk=256, cadence=2.5)
    h.submit(h.generate(max_tokens=50))
    h.turn()  # the stream is decoding from now on
    _fixed_costs(h.sched.outcomes.clock)
    h.submit(h.prefill("p", 100))
    h.turn(4)
    sizes = [[len(r.tokens) for r in call] for call in h.rt.calls[1:5]]
    assert sizes == [[1, 25], [1, 25], [1, 25], [1, 25]]  # 30 fit a turn: 4 even pieces
    # Without streams, the prompt's piece is taken whole.
    h = Harness(lanes=3, max_batch_tokens=512, prefill_chunk=256, cadence=2.5)
    _fixed_costs(h.sched.outcomes.clock)
    h.submit(h.prefill("p", 100))
    h.turn()
    assert [len(r.tokens) for r in h.rt.calls[0]] == [100]
