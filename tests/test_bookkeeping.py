"""Pure unit tests of lane bookkeeping and prefill chunking."""

from __future__ import annotations

import pytest

from faults import LanesBusy, SessionNotActive
from worker.core.jobs.base import chunk_bounds
from worker.runtime import LanePool
from worker.runtime.lanes import TOKENS_PER_RUN


def test_admit_is_all_or_nothing() -> None:
    pool = LanePool(2)
    pool.admit(["a"])
    with pytest.raises(LanesBusy, match="requires 2 new sessions but only 1"):
        pool.admit(["a", "b", "c"])
    assert set(pool.sessions) == {"a"}
    assert pool.free == 1


def test_release_returns_the_lane_and_reuses_lowest() -> None:
    pool = LanePool(3)
    a, b, c = pool.admit(["a", "b", "c"])
    assert (a.lane, b.lane, c.lane) == (0, 1, 2)
    pool.release("b")
    (d,) = pool.admit(["d"])
    assert d.lane == 1
    with pytest.raises(SessionNotActive):
        pool.release("b")


def test_known_sessions_need_no_lane() -> None:
    pool = LanePool(1)
    pool.admit(["a"])
    assert pool.admit(["a"])[0].lane == 0
    assert pool.missing(["a", "b", "b"]) == ["b"]


def _chunks(total: int, chunk: int, budget: int) -> list[int]:
    done, sizes = 0, []
    while done < total:
        n = chunk_bounds(done, total, chunk, budget)
        assert n > 0
        sizes.append(n)
        done += n
    return sizes


@pytest.mark.parametrize("total", [1, 255, 256, 257, 600, 1024])
def test_prompts_are_prefilled_in_chunk_pieces_from_the_start(total: int) -> None:
    # Where a prompt is cut does not change its numbers (rows are
    # batch-invariant), so pieces are simply chunk-sized from the start.
    sizes = _chunks(total, 256, 512)
    assert all(s == 256 for s in sizes[:-1])
    assert 0 < sizes[-1] <= 256 + 32  # an eighth more finishes a prompt in one piece
    assert sum(sizes) == total


def test_a_short_tail_goes_with_the_last_piece() -> None:
    """A 134-token prompt at chunk 128 is one piece, not 128 + a 6-token turn."""
    assert _chunks(134, 128, 512) == [134]
    assert _chunks(144, 128, 512) == [144]
    assert _chunks(145, 128, 512) == [128, 17]
    assert _chunks(300, 128, 512) == [128, 172 - 44, 44]
    assert chunk_bounds(0, 134, 128, 130) == 130  # the turn's budget still cuts it


def test_pieces_are_cut_to_the_budget_but_not_into_crumbs() -> None:
    assert chunk_bounds(0, 300, 256, 255) == 255  # cut to what the turn has
    assert chunk_bounds(0, 300, 256, 1000) == 256  # at most one chunk
    assert chunk_bounds(0, 300, 256, 10) == 0  # less than MIN_CUT waits
    assert chunk_bounds(290, 300, 256, 10) == 10  # unless that is all that is left
    assert chunk_bounds(295, 300, 256, 10) == 5


def test_a_new_session_keeps_the_held_lanes_in_one_run() -> None:
    """llama.cpp computes one micro-batch per run of consecutive lanes, each
    reading every weight: a new session fills the gap, or joins the run,
    even when that means evicting a cached lane rather than taking an empty
    one far away."""
    pool = LanePool(8, cache_limit=8)
    sessions = pool.admit(["a", "b", "c", "d"])
    assert [s.lane for s in sessions] == [0, 1, 2, 3]
    pool.release("b")  # a hole at 1: lanes 0, 2, 3 held
    (e,) = pool.admit(["e"])
    assert e.lane == 1
    # a cached lane next to the run beats an empty lane away from it
    pool.release("d", keep=False)  # lanes 0, 1, 2 held, 3 .. 7 free
    pool._cached[3] = [3]  # lane 3 caches a prefix
    pool._free.remove(3)
    (f,) = pool.admit(["f"])
    assert f.lane == 3 and pool.take_evicted() == [3]
    # equally good lanes: empty before cached, then the lowest
    pool.release("f", keep=False)
    pool.release("a", keep=False)  # lanes 1, 2 held; 0 and 3 both extend the run
    (g,) = pool.admit(["g"])
    assert g.lane == 0


def test_among_lanes_as_good_an_empty_one_goes_before_a_cached_one() -> None:
    pool = LanePool(4, cache_limit=4)
    pool.admit(["a", "b"])  # lanes 0, 1
    pool.release("a", keep=False)
    pool._cached[3] = [7]  # lane 3 holds a cached prefix, lane 2 is empty
    pool._free.remove(3)
    (c,) = pool.admit(["c"])
    assert c.lane in (0, 2)  # both keep one run with lane 1; neither is the cached 3
    assert pool.cached == 1 and pool.take_evicted() == []


def test_a_cached_lane_holding_a_long_prompt_outweighs_one_more_run() -> None:
    """Evicting a cached lane costs its tokens' prefill when its prompt comes
    back: a lane holding more than ``TOKENS_PER_RUN`` tokens beyond another
    outweighs one more run, so a short cached lane goes first even out of the
    run, and among cached lanes of equal weight the run still decides."""
    pool = LanePool(8, cache_limit=8)
    pool.admit(["a", "b", "c", "d"])  # lanes 0-3 held
    pool._free.clear()
    for lane in range(4, 8):
        pool._cached[lane] = [1] * 10  # short: no weight
    pool._cached[4] = [1] * (3 * TOKENS_PER_RUN)  # next to the run, but long
    (e,) = pool.admit(["e"])
    assert e.lane != 4 and pool.take_evicted() == [e.lane]
    assert 4 in pool._cached
    # all cached lanes short: the one next to the run, as before
    pool.release("e", keep=False)
    pool._free.remove(e.lane)
    pool._cached[e.lane] = [1] * 10
    pool._cached[4] = [1] * 10
    (f,) = pool.admit(["f"])
    assert f.lane == 4


def test_in_one_run_the_shortest_cached_prompt_goes_first() -> None:
    """Lanes that keep the run alike, the one whose loss costs the fewest
    tokens to recompute is evicted, whatever the order they were cached in;
    and one more run outweighs a cached prompt shorter than a run's worth."""
    pool = LanePool(8, cache_limit=8)
    pool.admit(["a", "b", "c"])  # lanes 0-2 held
    pool.release("a", keep=False)  # lanes 1, 2 held
    pool._free.clear()
    pool._cached[0] = [1] * (TOKENS_PER_RUN - 10)  # cached first (least recent), longer
    for lane in range(3, 8):
        pool._cached[lane] = [1] * (TOKENS_PER_RUN - 100)
    (d,) = pool.admit(["d"])  # 0 and 3 both keep one run
    assert d.lane == 3 and pool.take_evicted() == [3]
    pool.release("d", keep=False)  # lanes 1, 2 held; 3 empty
    pool._free.remove(3)
    pool._cached[3] = [1] * (TOKENS_PER_RUN - 10)
    pool._cached[4] = [1] * (TOKENS_PER_RUN - 10)
    pool._free.extend([5, 6, 7])  # empty, but away from the run
    for lane in (5, 6, 7):
        del pool._cached[lane]
    (e,) = pool.admit(["e"])
    assert e.lane in (0, 3) and pool.take_evicted() == [e.lane]
