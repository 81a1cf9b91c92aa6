"""Slicing and combining tensor frames (``_frames_common``): two slices combine
back into the frame, slices survive the wire, and what is out of range or
does not match is refused by field.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from _frames_common import FAST, assert_same_frame, frames, round_trip
from hypothesis import given
from hypothesis import strategies as st

from protocol.frame_chunks import combine_frames, slice_frame
from protocol.frame_limits import FrameError
from protocol.frames import Frame, PartSpec, make_frame

# --- slicing and combining -----------------------------------------------------------


@FAST
@given(frames())
def test_round_trip_random_frames(frame: Frame) -> None:
    assert_same_frame(round_trip(frame), frame)


@FAST
@given(frames())
def test_combining_two_slices_gives_back_the_frame(frame: Frame) -> None:
    n = frame.token_count
    for k in range(n + 1):
        combined = combine_frames([slice_frame(frame, 0, k), slice_frame(frame, k, n)])
        assert_same_frame(combined, frame)


@FAST
@given(frames(), st.data())
def test_slices_survive_the_wire(frame: Frame, data: st.DataObject) -> None:
    n = frame.token_count
    start = data.draw(st.integers(0, n))
    end = data.draw(st.integers(start, n))
    piece = slice_frame(frame, start, end)
    received = round_trip(piece)
    assert_same_frame(received, piece)
    lo = data.draw(st.integers(0, end - start))
    hi = data.draw(st.integers(lo, end - start))
    assert_same_frame(slice_frame(received, lo, hi), slice_frame(frame, start + lo, start + hi))
    assert_same_frame(combine_frames([piece]), piece)


@pytest.mark.parametrize("bounds", [(-1, 2), (3, 2), (0, 5), (True, 2), (0, 2.0)])
def test_slice_out_of_range_is_refused(bounds: tuple[Any, Any]) -> None:
    frame = make_frame([("hidden", np.zeros((4, 2), np.float32), 0)])
    with pytest.raises(FrameError) as info:
        slice_frame(frame, *bounds)
    assert info.value.field == "token_range"


def _pair(**changes: Any) -> list[Frame]:
    """A base frame and one that differs as ``changes`` say (keys of make_frame or parts)."""

    def build(tokens: int, **kw: Any) -> Frame:
        hidden = kw.pop("hidden", np.ones((tokens, 4), np.float32))
        state = kw.pop("state", np.zeros(3, np.uint8))
        names = kw.pop("names", ("hidden", "kv_state"))
        axis = kw.pop("axis", 0)
        specs: list[PartSpec] = [(names[0], hidden, axis), (names[1], state, -1)]
        return make_frame(specs, **{"layer_end": 4, **kw})

    return [build(2), build(3, **changes)]


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"layer_start": 1}, "layer_start"),
        ({"layer_end": 5}, "layer_end"),
        ({"producer_stage": 1}, "producer_stage"),
        ({"sequence_count": 2}, "sequence_count"),
        ({"hidden": np.ones((3, 4), np.float16)}, "parts[0].dtype"),
        ({"hidden": np.ones((3, 5), np.float32)}, "parts[0].dims"),
        ({"hidden": np.ones((3, 4, 1), np.float32)}, "parts[0].dims"),
        ({"hidden": np.ones((4, 3), np.float32), "axis": 1}, "parts[0].token_axis"),
        ({"state": np.ones(3, np.uint8)}, "parts[1]"),
        ({"names": ("hidden", "embd")}, "parts"),
        ({"names": ("kv_state", "hidden")}, "parts"),
        ({"positions": [0, 1, 2]}, "positions"),
    ],
)
def test_combine_refuses_mismatched_frames(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(FrameError) as info:
        combine_frames(_pair(**changes))
    assert info.value.field == field


def test_combine_refuses_nothing_and_keeps_positions() -> None:
    with pytest.raises(FrameError) as info:
        combine_frames([])
    assert info.value.field == "frames"
    a = make_frame([("h", np.zeros((2, 1), np.float32), 0)], positions=[0, 1])
    b = make_frame([("h", np.ones((1, 1), np.float32), 0)], positions=[2])
    both = combine_frames([a, b])
    assert both.positions == (0, 1, 2) and both.token_count == 3
    assert np.array_equal(both.array("h")[:, 0], [0, 0, 1])
