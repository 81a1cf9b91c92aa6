"""``engine.tap.ubatch_rows``: the micro-batches llama.cpp computes, which the
engine uses to put a layer tap's rows back in batch order. Whether it agrees
with llama.cpp is checked on every tapped decode (sizes) and by the chain
tests (logits); here, its shape rules."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from worker.engine.tap import ubatch_rows


def test_a_unified_cache_keeps_batch_order() -> None:
    assert ubatch_rows([3, 0, 3, 1, 2], 2, per_lane_streams=False) == [[0, 1], [2, 3], [4]]


def test_per_lane_streams_group_consecutive_lanes_with_equal_rows() -> None:
    assert ubatch_rows([0, 1, 2], 512, True) == [[0, 1, 2]]
    assert ubatch_rows([0, 2, 5], 512, True) == [[0], [1], [2]]  # not consecutive
    assert ubatch_rows([1, 0], 512, True) == [[0], [1]]  # ids must increase
    assert ubatch_rows([0, 1, 0, 1], 512, True) == [[0, 2, 1, 3]]  # a lane's rows together
    assert ubatch_rows([0, 0, 0, 1], 512, True) == [[0, 3], [1, 2]]  # equal counts
    assert ubatch_rows([0] * 10, 4, True) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


@given(
    st.lists(st.integers(0, 7), min_size=1, max_size=80),
    st.integers(8, 64),
    st.booleans(),
)
def test_every_row_once_in_lane_order_within_the_micro_batch(
    seqs: list[int], n_ubatch: int, per_lane: bool
) -> None:
    plan = ubatch_rows(seqs, n_ubatch, per_lane)
    assert sorted(i for rows in plan for i in rows) == list(range(len(seqs)))
    for rows in plan:
        assert 0 < len(rows) <= n_ubatch
        if per_lane:
            lanes = [seqs[i] for i in rows]
            distinct = sorted(set(lanes))
            assert distinct == list(range(distinct[0], distinct[0] + len(distinct)))
            per = len(rows) // len(distinct)
            assert lanes == [s for s in distinct for _ in range(per)]
    # a lane's rows are computed in batch order
    for lane in set(seqs):
        mine = [i for rows in plan for i in rows if seqs[i] == lane]
        assert mine == sorted(mine)
