"""Tensor frames v1 refusals. Frames come from untrusted peers, so most of this
file corrupts valid headers (``_frames_common``'s random frames) one field
at a time and checks the refusal names exactly that field; ``make_frame``
applies the same checks to what it is given.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from _frames_common import FAST, HEADER_INTS, PART_INTS, frames, send
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from faults import BadRequest
from protocol.frame_limits import FrameError, FrameLimitError
from protocol.frames import Frame, make_frame, parse


def expect_refusal(header: object, buffers: list[memoryview], field: str) -> None:
    """Refused naming ``field``: ``bad_request``, or ``limit_exceeded`` for a frame
    over the default ``FrameLimits`` (too many parts, or dims)."""
    with pytest.raises((FrameError, FrameLimitError)) as info:
        parse(header, buffers)
    err = info.value
    assert err.field == field, str(err)
    if isinstance(err, FrameLimitError):
        assert err.code == "limit_exceeded" and err.limit in ("parts", "rank")
    else:
        assert isinstance(err, BadRequest) and err.code == "bad_request"
    assert str(err).startswith(f"frame.{field}: ")


# --- refusals ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "kwargs", "field"),
    [
        (("x", np.zeros(2, np.float64), 0), {}, "parts[0].dtype"),
        (("x", np.zeros(2, np.uint16), 0), {}, "parts[0].dtype"),
        (("x", np.zeros(2, np.float32), 0, "bf16"), {}, "parts[0].dtype"),
        (("x", np.zeros(2, np.float32), 0, "f64"), {}, "parts[0].dtype"),
        (("x", np.float32(1.0), -1), {}, "parts[0]"),
        (("x", np.zeros((), np.float32), -1), {}, "parts[0].dims"),
        (("x", np.zeros(2, np.float32), 0), {"token_count": 3}, "parts[0].dims"),
        (("x", np.zeros(2, np.float32), 2), {}, "parts[0].token_axis"),
        (("x", np.zeros(2, np.float32), 0), {"positions": [1]}, "positions"),
        (("x", np.zeros(2, np.float32), 0), {"layer_start": 2, "layer_end": 1}, "layer_end"),
        (("x", np.zeros(2, np.float32), 0), {"sequence_count": 0}, "sequence_count"),
        (("x", np.zeros(2, np.float32), 0), {"producer_stage": True}, "producer_stage"),
        (("", np.zeros(2, np.float32), 0), {}, "parts[0].identity"),
    ],
)
def test_make_frame_applies_the_receive_checks(
    spec: Any, kwargs: dict[str, Any], field: str
) -> None:
    with pytest.raises(FrameError) as info:
        make_frame([spec], **kwargs)
    assert info.value.field == field


def test_unknown_identity_is_a_frame_error() -> None:
    frame = make_frame([("hidden", np.zeros(1, np.float32), 0)])
    with pytest.raises(FrameError) as info:
        frame.array("logits")
    assert info.value.field == "parts"


BAD_INTS: list[Any] = ["7", 1.0, None, True, False, -1, 2**63, [1]]

Corruption = Callable[[dict[str, Any], list[memoryview], st.DataObject], str]


def _part_of(header: dict[str, Any], data: st.DataObject) -> tuple[int, dict[str, Any]]:
    i = data.draw(st.integers(0, len(header["parts"]) - 1))
    return i, header["parts"][i]


def bad_header_int(header: dict[str, Any], buffers: list[memoryview], data: st.DataObject) -> str:
    key = data.draw(st.sampled_from(("version", *HEADER_INTS)))
    value = data.draw(st.sampled_from(BAD_INTS))
    assume(not (key == "sequence_count" and value is False))  # False is refused anyway
    header[key] = value
    return key


def bad_part_int(header: dict[str, Any], buffers: list[memoryview], data: st.DataObject) -> str:
    i, part = _part_of(header, data)
    key = data.draw(st.sampled_from(PART_INTS))
    part[key] = data.draw(st.sampled_from([*BAD_INTS, -2] if key == "token_axis" else BAD_INTS))
    assume(part[key] != -1 or key != "token_axis" or isinstance(part[key], bool))
    return f"parts[{i}].{key}"


def bad_list_entry(header: dict[str, Any], buffers: list[memoryview], data: st.DataObject) -> str:
    i, part = _part_of(header, data)
    key = data.draw(st.sampled_from(("dims", "byte_strides")))
    j = data.draw(st.integers(0, len(part[key]) - 1))
    part[key][j] = data.draw(st.sampled_from(BAD_INTS))
    return f"parts[{i}].{key}"


def bad_list_shape(header: dict[str, Any], buffers: list[memoryview], data: st.DataObject) -> str:
    i, part = _part_of(header, data)
    key = data.draw(st.sampled_from(("dims", "byte_strides")))
    longer = part[key] + [4]
    part[key] = data.draw(st.sampled_from([[], [1] * 9, longer, tuple(part[key]), "dims", None]))
    if key == "dims" and part[key] is longer and len(longer) <= 8:
        return f"parts[{i}].byte_strides"  # dims alone is fine; strides no longer match it
    return f"parts[{i}].{key}"


def unknown_key(header: dict[str, Any], buffers: list[memoryview], data: st.DataObject) -> str:
    if data.draw(st.booleans()):
        header["extra"] = 1
        return "extra"
    i, part = _part_of(header, data)
    part["scale"] = 1.0
    return f"parts[{i}].scale"


def missing_key(header: dict[str, Any], buffers: list[memoryview], data: st.DataObject) -> str:
    if data.draw(st.booleans()):
        key = data.draw(st.sampled_from(("version", "parts", *HEADER_INTS)))
        del header[key]
        return key
    i, part = _part_of(header, data)
    key = data.draw(st.sampled_from(sorted(part)))
    del part[key]
    return f"parts[{i}].{key}"


def buffer_out_of_range(header: dict[str, Any], buffers: list[memoryview], _: Any) -> str:
    header["parts"][-1]["buffer"] = len(buffers)
    return f"parts[{len(header['parts']) - 1}].buffer"


def offset_past_end(header: dict[str, Any], buffers: list[memoryview], data: st.DataObject) -> str:
    i, part = _part_of(header, data)
    part["offset"] = buffers[part["buffer"]].nbytes + data.draw(st.integers(1, 2**40))
    return f"parts[{i}].offset"


def nbytes_mismatch(header: dict[str, Any], buffers: list[memoryview], data: st.DataObject) -> str:
    i, part = _part_of(header, data)
    part["nbytes"] += data.draw(st.sampled_from([1, -1, 4096]))
    assume(part["nbytes"] >= 0)
    return f"parts[{i}].nbytes"


def strides_past_buffer(header: dict[str, Any], buffers: list[memoryview], data: Any) -> str:
    parts = enumerate(header["parts"])  # an empty part touches no bytes, so only non-empty ones
    wide = [(i, j) for i, p in parts if p["nbytes"] for j, d in enumerate(p["dims"]) if d > 1]
    assume(wide)
    i, j = data.draw(st.sampled_from(wide))
    part = header["parts"][i]
    part["byte_strides"][j] = buffers[part["buffer"]].nbytes + 1
    return f"parts[{i}].byte_strides"


def aliasing_strides(header: dict[str, Any], buffers: list[memoryview], data: Any) -> str:
    wide = [(i, j) for i, p in enumerate(header["parts"]) for j, d in enumerate(p["dims"]) if d > 1]
    assume(wide)
    i, j = data.draw(st.sampled_from(wide))
    header["parts"][i]["byte_strides"][j] = 0
    return f"parts[{i}].byte_strides"


def token_axis_out_of_range(header: dict[str, Any], buffers: list[memoryview], data: Any) -> str:
    i, part = _part_of(header, data)
    part["token_axis"] = data.draw(st.sampled_from([len(part["dims"]), 9, -2, -(2**63)]))
    return f"parts[{i}].token_axis"


def token_dim_mismatch(header: dict[str, Any], buffers: list[memoryview], data: Any) -> str:
    with_axis = [i for i, p in enumerate(header["parts"]) if p["token_axis"] >= 0]
    assume(with_axis)
    i = data.draw(st.sampled_from(with_axis))
    part = header["parts"][i]
    part["dims"][part["token_axis"]] += 1
    return f"parts[{i}].dims"


def duplicate_identity(header: dict[str, Any], buffers: list[memoryview], data: Any) -> str:
    parts = header["parts"]
    assume(len(parts) > 1)
    j = data.draw(st.integers(1, len(parts) - 1))
    parts[j]["identity"] = parts[data.draw(st.integers(0, j - 1))]["identity"]
    return f"parts[{j}].identity"


def bad_identity_or_dtype(header: dict[str, Any], buffers: list[memoryview], data: Any) -> str:
    i, part = _part_of(header, data)
    if data.draw(st.booleans()):
        part["identity"] = data.draw(st.sampled_from(["", "x" * 65, 7, None, b"hidden"]))
        return f"parts[{i}].identity"
    part["dtype"] = data.draw(st.sampled_from(["f64", "F32", "", 4, None, ["f32"]]))
    return f"parts[{i}].dtype"


def bad_positions(header: dict[str, Any], buffers: list[memoryview], data: Any) -> str:
    n = header["token_count"]
    choice = data.draw(st.sampled_from(["long", "short", "bool", "negative", "type"]))
    if choice != "long":
        assume(n > 0)
    positions: list[object] = list(range(n))
    if choice == "long":
        positions.append(n)
    elif choice == "short":
        positions.pop()
    else:
        positions[-1] = {"bool": True, "negative": -1}.get(choice, "0")
    header["positions"] = positions
    return "positions"


def bad_containers(header: dict[str, Any], buffers: list[memoryview], data: Any) -> str:
    choice = data.draw(st.sampled_from(["empty", "too_many", "not_list", "part_not_map"]))
    if choice == "part_not_map":
        header["parts"][0] = ["identity", "hidden"]
        return "parts[0]"
    one = header["parts"][0]
    header["parts"] = {"empty": [], "too_many": [one] * 65, "not_list": one}[choice]
    return "parts"


def layers_reversed(header: dict[str, Any], buffers: list[memoryview], _: Any) -> str:
    header["layer_start"] = header["layer_end"] + 1
    return "layer_end"


CORRUPTIONS: list[Corruption] = [
    bad_header_int,
    bad_part_int,
    bad_list_entry,
    bad_list_shape,
    unknown_key,
    missing_key,
    buffer_out_of_range,
    offset_past_end,
    nbytes_mismatch,
    strides_past_buffer,
    aliasing_strides,
    token_axis_out_of_range,
    token_dim_mismatch,
    duplicate_identity,
    bad_identity_or_dtype,
    bad_positions,
    bad_containers,
    layers_reversed,
]


@settings(FAST, max_examples=400)
@given(frames(max_tokens=3), st.sampled_from(CORRUPTIONS), st.data())
def test_each_malformed_field_is_refused_by_name(
    frame: Frame, corrupt: Corruption, data: st.DataObject
) -> None:
    header, buffers = send(frame)
    parse(copy.deepcopy(header), buffers)  # the uncorrupted header is fine
    field = corrupt(header, buffers, data)
    expect_refusal(header, buffers, field)


@pytest.mark.parametrize("header", [None, [], "frame", 1])
def test_header_must_be_a_map(header: object) -> None:
    expect_refusal(header, [], "header")
