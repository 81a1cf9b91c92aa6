"""Tensor frames v1 round trips (``_frames_common``): every dtype and random
frames through the wire byte for byte, the dtype tables, and zero copy (a
received array is a read-only view of the frame; attach sends the array's
own memory, a slice only its bytes).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from _frames_common import assert_same_frame, random_array, round_trip, same_bytes, send

from protocol.frame_chunks import slice_frame
from protocol.frames import DTYPES, VERSION, WIRE_NAMES, attach, make_frame, parse

# --- round trips and zero copy ------------------------------------------------------


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_round_trip_every_dtype(name: str) -> None:
    rng = np.random.default_rng(1)
    hidden = random_array(rng, name, [5, 3])
    state = random_array(rng, name, [2, 2, 2])
    frame = make_frame(
        [("hidden", hidden, 0, name), ("kv_state", state, -1, name)],
        producer_stage=2,
        layer_start=4,
        layer_end=8,
        positions=[10, 11, 12, 13, 14],
    )
    got = round_trip(frame)
    assert_same_frame(got, frame)
    assert got.token_count == 5 and got.positions == (10, 11, 12, 13, 14)
    assert got.part("hidden").dtype == name
    assert same_bytes(got.array("hidden"), hidden) and same_bytes(got.array("kv_state"), state)
    if name == "bf16":
        assert got.array("hidden").dtype == np.uint16


def test_dtype_tables() -> None:
    assert {WIRE_NAMES[np.dtype(t)] for t in ("float32", "float16", "int32", "uint8")} == {
        "f32",
        "f16",
        "i32",
        "u8",
    }
    assert DTYPES["bf16"] == np.uint16 and np.dtype(np.uint16) not in WIRE_NAMES
    assert VERSION == 1


def test_default_dtype_names_and_token_count() -> None:
    embd, ids = np.zeros(4, np.float32), np.arange(7, dtype="i4")
    frame = make_frame([("embd", embd, -1), ("ids", ids, 0)])
    assert [p.dtype for p in frame.parts] == ["f32", "i32"]
    assert frame.token_count == 7 and frame.positions is None
    assert "positions" not in attach(frame, [])


def test_received_array_is_a_read_only_view_of_the_frame() -> None:
    logits = np.arange(12, dtype=np.float32).reshape(3, 4)
    header, buffers = send(make_frame([("logits", logits, 0)]))
    arr = parse(header, buffers).array("logits")
    assert np.shares_memory(arr, np.frombuffer(buffers[0], np.uint8))
    assert not arr.flags.writeable
    writable = [memoryview(bytearray(b)) for b in buffers]
    assert parse(header, writable).array("logits").flags.writeable


def test_attach_sends_the_arrays_own_memory() -> None:
    hidden = np.arange(24, dtype=np.float32).reshape(6, 4)
    frame = make_frame([("hidden", hidden, 0)])
    assert np.shares_memory(frame.array("hidden"), hidden)
    out: list[Any] = []
    attach(frame, out)
    assert isinstance(out[0], memoryview)
    assert np.shares_memory(np.frombuffer(out[0], np.uint8), hidden)


def test_sliced_frame_sends_only_its_slice_without_copying() -> None:
    hidden = np.arange(40, dtype=np.float32).reshape(10, 4)
    cols = np.arange(30, dtype=np.int32).reshape(3, 10)
    part = slice_frame(make_frame([("hidden", hidden, 0), ("cols", cols, 1)]), 2, 5)
    assert np.shares_memory(part.array("hidden"), hidden)
    out: list[Any] = []
    header = attach(part, out)
    assert out[0].nbytes == 3 * 4 * 4  # three rows, not the whole buffer
    assert out[1].nbytes == (2 * 10 + 2) * 4 + 4  # first to last byte the strided part touches
    assert np.shares_memory(np.frombuffer(out[0], np.uint8), hidden)
    got = parse(header, [memoryview(bytes(b)) for b in out])
    assert same_bytes(got.array("hidden"), hidden[2:5])
    assert np.array_equal(got.array("cols"), cols[:, 2:5])


def test_big_endian_and_strided_inputs_are_normalised_once() -> None:
    src = np.arange(12, dtype=">f4").reshape(3, 4)
    frame = round_trip(make_frame([("hidden", src, 0), ("t", src.astype("<f4").T, 1)]))
    assert frame.array("hidden").dtype == np.dtype("<f4")
    assert np.array_equal(frame.array("hidden"), src) and np.array_equal(frame.array("t"), src.T)


def test_hand_written_fortran_layout_is_accepted() -> None:
    data = np.arange(6, dtype=np.float32)
    header = {
        "version": 1,
        "producer_stage": 0,
        "layer_start": 0,
        "layer_end": 0,
        "token_count": 2,
        "sequence_count": 1,
        "parts": [
            {
                "identity": "hidden",
                "dtype": "f32",
                "dims": [2, 3],
                "byte_strides": [4, 8],
                "token_axis": 0,
                "buffer": 0,
                "offset": 0,
                "nbytes": 24,
            }
        ],
    }
    frame = parse(header, [data.tobytes()])
    assert np.array_equal(frame.array("hidden"), data.reshape(3, 2).T)
