"""Pure unit tests of lane bookkeeping and prefill chunking."""

from __future__ import annotations

import pytest

from faults import LanesBusy, SessionNotActive
from worker.core.jobs.base import chunk_bounds
from worker.runtime import LanePool


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
    assert 0 < sizes[-1] <= 256
    assert sum(sizes) == total


def test_pieces_are_cut_to_the_budget_but_not_into_crumbs() -> None:
    assert chunk_bounds(0, 300, 256, 255) == 255  # cut to what the turn has
    assert chunk_bounds(0, 300, 256, 1000) == 256  # at most one chunk
    assert chunk_bounds(0, 300, 256, 10) == 0  # less than MIN_CUT waits
    assert chunk_bounds(290, 300, 256, 10) == 10  # unless that is all that is left
    assert chunk_bounds(295, 300, 256, 10) == 5
