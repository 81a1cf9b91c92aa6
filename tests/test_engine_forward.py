"""One forward of decode rows and a prompt piece, in the engine alone.

A piece ending its prompt beside one-token decode rows is decoded as two
``llama_decode`` calls (``Engine._decode``): its leading tokens first, then
its last token in the decode rows' micro-batch, so the output head runs once.
That is only a speed-up if every row still scores as if alone; this checks
it by logits (max abs diff 0.0) against each row decoded on its own, and
checks the calls actually made, so the test fails if the split silently
stops happening. Both below and past Gemma 3's 512-token sliding window.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from worker.engine import DecodeStatus, Engine, EngineConfig, Segment

LANES = 4
PIECE = 40
# (tokens each decoding stream holds, where the piece starts in its lane)
SPANS = [(20, 0), (600, 520)]


@pytest.fixture(scope="module")
def engine(model_path: str) -> Iterator[Engine]:
    eng = Engine(EngineConfig(model_path, n_ctx=4096, n_seq=LANES, n_threads=2))
    assert not eng.kv_unified  # a KV stream per lane: llama.cpp's equal split
    yield eng
    eng.close()


@pytest.fixture()
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The token count of every ``llama_decode`` the engine makes (each
    ``_decode_once`` is one)."""
    made: list[int] = []
    real = Engine._decode_once

    def counting(self: Engine, segments: Sequence[Segment]) -> DecodeStatus:
        made.append(sum(len(s) for s in segments))
        return real(self, segments)

    monkeypatch.setattr(Engine, "_decode_once", counting)
    return made


def _tokens(engine: Engine, tag: str, n: int) -> list[int]:
    toks = engine.tokenize(f"{tag}: " + " ".join(f"item {i} of the list" for i in range(300)))
    assert len(toks) >= n
    return toks[:n]


def _alone(engine: Engine, seg: Segment) -> np.ndarray:
    """``seg``'s last logits row decoded by itself, then undone."""
    assert engine.decode([seg]).ok
    row = engine.logits_row(engine.output_index(0)).copy()
    engine.seq_rm(seg.seq, seg.pos0, -1)
    return row


def _prefill(engine: Engine, lane: int, toks: list[int]) -> None:
    for at in range(0, len(toks), engine.n_batch):
        assert engine.decode([Segment(lane, toks[at : at + engine.n_batch], at, "none")]).ok


@pytest.mark.parametrize(("held", "start"), SPANS, ids=["short", "past-window"])
def test_a_piece_ending_its_prompt_joins_the_decode_rows_and_scores_as_alone(
    engine: Engine, calls: list[int], held: int, start: int
) -> None:
    for lane in range(LANES):
        engine.seq_clear(lane)
    streams = [_tokens(engine, f"stream {lane}", held + 1) for lane in range(3)]
    for lane, toks in enumerate(streams):
        _prefill(engine, lane, toks[:held])
    steps = [Segment(lane, toks[held:], held) for lane, toks in enumerate(streams)]
    text = _tokens(engine, "the piece", start + PIECE)
    _prefill(engine, 3, text[:start])
    piece = Segment(3, text[start:], start, "last")
    expected = [_alone(engine, seg) for seg in [*steps, piece]]

    calls.clear()
    assert engine.decode([*steps, piece]).ok
    # the piece's first 39 tokens, then its last with the three decode rows
    assert calls == [PIECE - 1, len(steps) + 1]
    got = [engine.logits_row(engine.output_index(i)).copy() for i in range(len(steps) + 1)]
    for want, row in zip(expected, got, strict=True):
        assert float(np.abs(want - row).max()) == 0.0
    assert engine.output_index(3, PIECE - 1) == engine.output_index(3)
    with pytest.raises(IndexError):
        engine.output_index(3, 0)  # decoded without an output row
    assert [engine.pos_max(lane) for lane in range(LANES)] == [held] * 3 + [start + PIECE - 1]

    # switched off, the same forward is one call, with the same logits
    for seg in [*steps, piece]:
        engine.seq_rm(seg.seq, seg.pos0, -1)
    engine.share_head = False
    try:
        calls.clear()
        assert engine.decode([*steps, piece]).ok
    finally:
        engine.share_head = True
    assert calls == [len(steps) + PIECE]
    for i, want in enumerate(expected):
        assert float(np.abs(engine.logits_row(engine.output_index(i)) - want).max()) == 0.0


def test_a_forward_without_one_token_rows_stays_one_call(engine: Engine, calls: list[int]) -> None:
    """Two prompt pieces and no decode rows: splitting would add a
    micro-batch (the tails' own), so the forward is one ``llama_decode``."""
    for lane in range(LANES):
        engine.seq_clear(lane)
    pieces = [Segment(lane, _tokens(engine, f"p{lane}", 24 + lane), 0) for lane in range(2)]
    calls.clear()
    assert engine.decode(pieces).ok
    assert calls == [24 + 25]
    assert engine.output_index(1, 24) == engine.output_index(1)


@pytest.mark.parametrize(("held", "start"), SPANS, ids=["short", "past-window"])
def test_rows_go_into_the_batch_in_lane_order(
    engine: Engine, calls: list[int], held: int, start: int
) -> None:
    """The scheduler hands decode rows first and a new prompt's piece after
    them, whatever its lane. llama.cpp's equal split (a KV stream per lane)
    ends a micro-batch at the first row whose lane is not the previous
    lane + 1, so rows of lanes 0, 2, 3 then 1 would be two passes over the
    weights; the engine lays the rows out in lane order (one pass), and
    every row still scores as if alone."""
    for lane in range(LANES):
        engine.seq_clear(lane)
    decoding = [0, 2, 3]
    streams = {lane: _tokens(engine, f"stream {lane}", held + 1) for lane in decoding}
    for lane, toks in streams.items():
        _prefill(engine, lane, toks[:held])
    steps = [Segment(lane, toks[held:], held) for lane, toks in streams.items()]
    text = _tokens(engine, "the new prompt", start + PIECE)
    _prefill(engine, 1, text[:start])
    piece = Segment(1, text[start:], start, "last")
    expected = [_alone(engine, seg) for seg in [*steps, piece]]

    calls.clear()
    assert engine.decode([*steps, piece]).ok
    assert calls == [PIECE - 1, len(steps) + 1]
    # the second call: the four last rows in one micro-batch, lanes 0..3
    assert engine.micro_batches() == [[0, 1, 2, 3]]
    for i, want in enumerate(expected):
        assert float(np.abs(engine.logits_row(engine.output_index(i)) - want).max()) == 0.0

    # as one call: one micro-batch of a row from each lane, then the piece's rest
    for seg in [*steps, piece]:
        engine.seq_rm(seg.seq, seg.pos0, -1)
    engine.share_head = False
    try:
        assert engine.decode([*steps, piece]).ok
    finally:
        engine.share_head = True
    assert [len(rows) for rows in engine.micro_batches()] == [4, PIECE - 1]
    for i, want in enumerate(expected):
        assert float(np.abs(engine.logits_row(engine.output_index(i)) - want).max()) == 0.0
