"""A gap between a forward's lanes is closed by moving a session.

With a KV stream per lane llama.cpp runs one micro-batch (one pass over the
weights) per run of consecutive lanes, so streams on lanes 0 and 2 decode
twice as slowly as on 0 and 1. After ``GAP_FORWARDS`` gapped forwards the
runtime moves one session's cells into a free lane (``LanePool.gap_move``,
``park.move_cells``). A move must not change a single bit of what follows:
the logits of every row after it equal those of the same forwards where
nothing moved (max abs diff 0.0), past Gemma 3's 512-token sliding window,
and the moved session can still be trimmed back into its first window.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from worker.engine import Engine, EngineConfig
from worker.runtime import RuntimeState, Step, lanes
from worker.runtime.lanes import LanePool, Session, runs

LANES = 4
HELD = 600  # tokens each stream holds before the gap opens: past the window
DECODES = 6


@pytest.fixture(scope="module")
def engine(model_path: str) -> Iterator[Engine]:
    eng = Engine(EngineConfig(model_path, n_ctx=LANES * 1024, n_seq=LANES, n_threads=2))
    assert not eng.kv_unified  # a KV stream per lane, where a gap costs a micro-batch
    yield eng
    eng.close()


def _prompt(engine: Engine, tag: str) -> list[int]:
    toks = engine.tokenize(f"{tag}: " + " ".join(f"entry {i} of {tag}" for i in range(200)))
    assert len(toks) >= HELD
    return toks[:HELD]


def _fresh(
    engine: Engine, gap_forwards: int, monkeypatch: pytest.MonkeyPatch, prefix_cache: int = 0
) -> RuntimeState:
    """A runtime on cleared lanes, moving after ``gap_forwards`` gapped forwards."""
    for lane in range(LANES):
        engine.seq_clear(lane)
    monkeypatch.setattr(lanes, "GAP_FORWARDS", gap_forwards)
    return RuntimeState(engine, prefix_cache=prefix_cache)


def _hold(rt: RuntimeState, session: Session) -> None:
    """Prefill the session's ``HELD`` tokens (past the window) in pieces of 200."""
    prompt = _prompt(rt.engine, str(session.id))
    for start in range(0, HELD, 200):
        rt.forward([Step(session, prompt[start : start + 200])])


def _run(
    engine: Engine, gap_forwards: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[np.ndarray], RuntimeState]:
    """Streams a, b, c on lanes 0-2, b ends (a gap at lane 1), a and c
    decode greedily; every row's logits, in order."""
    rt = _fresh(engine, gap_forwards, monkeypatch, prefix_cache=1)
    a, b, c = rt.admit(["a", "b", "c"])
    assert (a.lane, b.lane, c.lane) == (0, 1, 2)
    for s in (a, b, c):
        _hold(rt, s)
    rt.drop("b")  # lane 1 keeps b's cells for the prefix cache
    rows: list[np.ndarray] = []
    nxt = {"a": 7, "c": 11}
    for _ in range(DECODES):
        results = rt.forward(
            [
                Step(rt.require(sid), [tok], sample=True, outputs=("logits",))
                for sid, tok in nxt.items()
            ]
        )
        for sid, result in zip(nxt, results, strict=True):
            assert result.logits is not None and result.token is not None
            rows.append(result.logits.copy())
            nxt[sid] = result.token
    return rows, rt


def test_a_moved_stream_continues_to_the_bit(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    still, rt_still = _run(engine, DECODES + 1, monkeypatch)
    assert rt_still.moves == 0
    moved, rt = _run(engine, 2, monkeypatch)
    # the third gapped forward moved a stream: a and c now in one run
    assert rt.moves == 1
    held = {rt.require("a").lane, rt.require("c").lane}
    assert runs(held) == 1 and held != {0, 2}
    assert rt.prefix.evictions == 0  # an empty lane was taken, not b's cached one
    assert len(moved) == len(still) == 2 * DECODES
    for i, (x, y) in enumerate(zip(moved, still, strict=True)):
        assert float(np.max(np.abs(x - y))) == 0.0, f"row {i}: logits differ after the move"
    # every cell came along: the moved stream trims back inside its first window
    for sid in ("a", "c"):
        session = rt.require(sid)
        assert rt.engine.pos_max(session.lane) + 1 == session.position
        assert rt.trim(sid, 100) == 100


def test_the_move_is_the_one_that_leaves_fewest_runs() -> None:
    pool = LanePool(6, cache_limit=6)
    for sid in ("a", "b", "c", "d"):
        pool.admit([sid])  # lanes 0-3
    pool.sessions["d"].position = 50
    pool.release("b", keep=False)  # lane 1 empty
    pool.sessions["a"].position = 80
    pool.release("c", keep=False)  # lanes 0 and 3: two runs
    choice = pool.closing_move({0, 3})
    assert choice is not None
    session, lane = choice
    # a -> 2 or 4, or d -> 1: one run each; d holds fewer tokens (cheaper copy)
    assert (session.id, lane) == ("d", 1)
    assert pool.move("d", 1) == 3
    assert pool.sessions["d"].lane == 1 and pool.closing_move({0, 1}) is None
    assert 3 in pool._free and 1 not in pool._free


def test_a_cached_lane_is_taken_only_when_it_is_the_only_way() -> None:
    pool = LanePool(3, cache_limit=3)
    for sid in ("a", "b", "c"):
        pool.admit([sid])
    pool.sessions["b"].tokens = list(range(40))
    pool.release("b", keep=True)  # lane 1 cached
    choice = pool.closing_move({0, 2})
    assert choice is not None and choice[1] == 1  # the only lane that closes the gap
    assert pool.move(choice[0].id, 1) in (0, 2)
    assert pool.take_evicted() == [1] and pool.evicted_tokens[1] == list(range(40))


def test_a_gap_is_closed_only_after_it_lasted_and_before_a_piece_only_cheaply() -> None:
    pool = LanePool(4)
    for sid in ("a", "b", "c"):
        pool.admit([sid])
    for sid in ("a", "c"):
        pool.sessions[sid].position = lanes.PIECE_MOVE_CELLS + 1
    pool.release("b")  # a gap at lane 1 between a (0) and c (2)
    for _ in range(lanes.GAP_FORWARDS):
        assert pool.gap_move({0, 2}, piece=False) is None
    # a forward with a piece is as long as streams can wait: no long copy in it
    assert pool.gap_move({0, 2}, piece=True) is None
    pool.sessions["c"].position = lanes.PIECE_MOVE_CELLS  # e.g. the prompt going in
    due = pool.gap_move({0, 2}, piece=True)
    assert due is not None and due[0].id == "c"
    pool.sessions["c"].position = lanes.PIECE_MOVE_CELLS + 1
    pool.gapped = lanes.GAP_FORWARDS
    due = pool.gap_move({0, 2}, piece=False)
    assert due is not None and runs({0, 2} - {due[0].lane} | {due[1]}) == 1
    assert pool.gap_move({0, 2}, piece=False) is None  # the count starts again
    pool.gapped = lanes.GAP_FORWARDS
    assert pool.gap_move({0, 1}, piece=False) is None and pool.gapped == 0  # no gap


def _prefill_beside(
    engine: Engine, gap_forwards: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[np.ndarray], RuntimeState]:
    """Stream a on lane 0 (past the window), a prompt going in pieces on lane
    2 (lane 1 empty between them) beside a's decode rows; every row's logits."""
    rt = _fresh(engine, gap_forwards, monkeypatch)
    a, _, p = rt.admit(["a", "gone", "p"])
    assert (a.lane, p.lane) == (0, 2)
    rt.drop("gone")
    _hold(rt, a)
    piece, text = 60, _prompt(engine, "p")[:300]
    rows: list[np.ndarray] = []
    tok = 7
    for start in range(0, len(text), piece):
        last = start + piece >= len(text)
        outputs: tuple[str, ...] = ("logits",) if last else ()
        stream = Step(rt.require("a"), [tok], sample=True, outputs=("logits",))
        prompt_piece = Step(rt.require("p"), text[start : start + piece], last, outputs=outputs)
        results = rt.forward([stream, prompt_piece])
        assert results[0].logits is not None and results[0].token is not None
        rows.append(results[0].logits.copy())
        tok = results[0].token
        if last:
            assert results[1].logits is not None
            rows.append(results[1].logits.copy())
    return rows, rt


def test_a_prompt_moved_between_its_pieces_continues_to_the_bit(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The move before a forward with a piece: the short session (the prompt
    going in) moves next to the stream, and neither changes a bit."""
    still, rt_still = _prefill_beside(engine, 100, monkeypatch)
    assert rt_still.moves == 0
    moved, rt = _prefill_beside(engine, 1, monkeypatch)
    assert rt.moves == 1
    assert runs({rt.require("a").lane, rt.require("p").lane}) == 1
    assert rt.require("a").lane == 0  # the stream past PIECE_MOVE_CELLS stayed
    assert len(moved) == len(still) == 300 // 60 + 1
    for i, (x, y) in enumerate(zip(moved, still, strict=True)):
        assert float(np.max(np.abs(x - y))) == 0.0, f"row {i}: logits differ after the move"
