"""The sequence-state walker that lets a KV state load across lane counts."""

from __future__ import annotations

import contextlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.engine.seqstate import restream, sections, streams_of

MAGIC = 0xAF143CD8


def _stream(cells: int, n_layer: int = 2, row: int = 8, fill: int = 1) -> bytes:
    """One non-empty stream as llama.cpp writes it (v not transposed)."""
    out = struct.pack("<I", cells)
    for pos in range(cells):
        out += struct.pack("<iIi", pos, 1, 0)
    out += struct.pack("<II", 0, n_layer)
    for _ in range(2 * n_layer):  # K then V
        out += struct.pack("<iQ", 1, row) + bytes([fill]) * (row * cells)
    return out


def _state(n_stream: int, lane: int, cells: int, caches: int = 2) -> np.ndarray:
    blob = struct.pack("<II", MAGIC, 0)
    for c in range(caches):
        blob += struct.pack("<I", n_stream)
        for s in range(n_stream):
            blob += _stream(cells, fill=c + 1) if s == lane else struct.pack("<I", 0)
    return np.frombuffer(blob, dtype=np.uint8)


def test_restream_moves_the_one_stream_and_keeps_its_bytes() -> None:
    state = _state(8, 3, 5)
    assert streams_of(state) == 8
    assert restream(state, 8) is state  # same layout: no copy
    two = restream(state, 2)
    assert [n for n, _ in sections(two)] == [2, 2]
    one = restream(two, 1)
    assert [n for n, _ in sections(one)] == [1, 1]
    # every cache's stream bytes are carried unchanged
    spans8 = [bytes(state[a:b]) for _, sp in sections(state) for a, b in sp]
    spans1 = [bytes(one[a:b]) for _, sp in sections(one) for a, b in sp]
    assert spans8 == spans1
    assert restream(one, 8).nbytes == state.nbytes


def test_a_state_that_does_not_parse_is_refused() -> None:
    with pytest.raises(ValueError, match="magic"):
        restream(np.zeros(16, np.uint8), 2)
    two_seqs = bytearray(struct.pack("<II", MAGIC, 0) + struct.pack("<I", 2) + _stream(2) * 2)
    with pytest.raises(ValueError, match="more than one sequence"):
        restream(np.frombuffer(bytes(two_seqs), np.uint8), 4)


@settings(max_examples=200, deadline=None)
@given(cut=st.integers(min_value=0, max_value=10_000), flip=st.integers(0, 255))
def test_truncated_or_corrupt_states_raise_value_error_only(cut: int, flip: int) -> None:
    state = bytearray(_state(4, 1, 3).tobytes())
    state = state[: cut % (len(state) + 1)]
    if state:
        state[cut % len(state)] ^= flip
    with contextlib.suppress(ValueError):
        restream(np.frombuffer(bytes(state), np.uint8), 2)
