"""Runtime invariants on a real engine, in-process (no sockets).

The engine here uses a unified KV cache and 8-token micro-batches so one
forward of two 8-token steps runs as two ubatches, one per session. An
abort callback stops llama.cpp during the second ubatch: a real part-way
failure, after which exactly the first session has advanced.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from faults import ContextOverflow, EngineFault, PositionMismatch
from worker.engine import Engine, EngineConfig
from worker.runtime import RuntimeState, Step


@pytest.fixture(scope="module")
def engine(model_path: str) -> Iterator[Engine]:
    eng = Engine(
        EngineConfig(
            model_path, n_ctx=1024, n_seq=2, n_ctx_per_seq=1024, n_batch=64, n_ubatch=8, n_threads=2
        )
    )
    yield eng
    eng.close()


@pytest.fixture()
def rt(engine: Engine) -> RuntimeState:
    for lane in range(engine.n_seq):
        engine.seq_clear(lane)
    engine.set_abort(None)
    return RuntimeState(engine)


def _tokens(engine: Engine, n: int) -> list[int]:
    toks = engine.tokenize("one two three four five six seven eight nine ten eleven twelve")
    assert len(toks) >= n
    return toks[:n]


def test_forward_advances_positions_and_matches_engine(rt: RuntimeState) -> None:
    a, b = rt.admit(["a", "b"])
    toks = _tokens(rt.engine, 8)
    results = rt.forward([Step(a, toks, sample=True), Step(b, toks[:3], sample=False)])
    assert (a.position, b.position) == (8, 3)
    assert results[0].token is not None and results[1].token is None
    assert rt.engine.pos_max(a.lane) == 7 and rt.engine.pos_max(b.lane) == 2


def test_failed_forward_moves_exactly_the_sessions_that_advanced(rt: RuntimeState) -> None:
    engine = rt.engine
    a, b = rt.admit(["a", "b"])
    toks = _tokens(engine, 8)
    # Calibrate: how many abort polls one 8-token ubatch makes.
    polls = [0]

    def count() -> bool:
        polls[0] += 1
        return False

    engine.set_abort(count)
    rt.forward([Step(a, toks)])
    per_ubatch = polls[0]
    rt.trim("a", 0)

    # Abort on the first poll of the second ubatch (session b's tokens).
    polls[0] = 0

    def abort_in_second_ubatch() -> bool:
        polls[0] += 1
        return polls[0] > per_ubatch

    engine.set_abort(abort_in_second_ubatch)
    with pytest.raises(EngineFault) as info:
        rt.forward([Step(a, toks, sample=True), Step(b, toks, sample=True)])
    engine.set_abort(None)
    assert info.value.advanced == {"a": 8}
    assert (a.position, b.position) == (8, 0)
    assert a.tokens == toks and b.tokens == []
    rt.check_position(a)
    rt.check_position(b)
    # Both sessions carry on from where the engine really is.
    rt.forward([Step(a, toks[:1], sample=True), Step(b, toks, sample=True)])
    assert (a.position, b.position) == (9, 8)


def test_position_mismatch_is_raised_with_both_figures(rt: RuntimeState) -> None:
    (a,) = rt.admit(["a"])
    rt.forward([Step(a, _tokens(rt.engine, 4))])
    rt.engine.seq_rm(a.lane, 2, -1)  # change the engine behind the runtime's back
    with pytest.raises(PositionMismatch, match="tracked position 4 != engine position 2"):
        rt.check_position(a)
    with pytest.raises(PositionMismatch):
        rt.forward([Step(a, [5], sample=True)])


def test_context_overflow_is_refused_before_anything_runs(rt: RuntimeState) -> None:
    (a,) = rt.admit(["a"])
    with pytest.raises(ContextOverflow):
        rt.forward([Step(a, [5] * (rt.ctx_per_lane + 1))])
    assert a.position == 0 and rt.engine.pos_max(a.lane) == -1


def test_trim_drops_kv_and_align_only_trims_when_ahead(rt: RuntimeState) -> None:
    (a,) = rt.admit(["a"])
    rt.forward([Step(a, _tokens(rt.engine, 8))])
    assert rt.align("a", 10) == (None, None)
    assert rt.align("a", 5) == (8, 5)
    assert rt.engine.pos_max(a.lane) == 4
    rt.drop("a")
    assert rt.lanes.free == 2 and rt.engine.pos_max(a.lane) == -1
