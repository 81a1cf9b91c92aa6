"""Tensor frames v1: round trips, zero-copy, slicing/combining, and refusals.

Frames come from untrusted peers, so most of this file corrupts valid headers
one field at a time and checks the refusal names exactly that field.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from faults import BadRequest
from protocol.frame_chunks import combine_frames, slice_frame
from protocol.frame_limits import FrameError, FrameLimitError
from protocol.frames import (
    DTYPES,
    VERSION,
    WIRE_NAMES,
    Frame,
    PartSpec,
    attach,
    make_frame,
    parse,
)

# No example database: the suite leaves nothing behind in the tree.
FAST = settings(max_examples=60, deadline=None, database=None)
HEADER_INTS = ("producer_stage", "layer_start", "layer_end", "token_count", "sequence_count")
PART_INTS = ("token_axis", "buffer", "offset", "nbytes")


def send(frame: Frame) -> tuple[dict[str, Any], list[memoryview]]:
    """What a peer receives: the header through msgpack, buffers as read-only frames."""
    out: list[Any] = []
    header = attach(frame, out)
    wire = msgpack.unpackb(msgpack.packb(header, use_bin_type=True), raw=False)
    return wire, [memoryview(bytes(b)) for b in out]


def round_trip(frame: Frame) -> Frame:
    return parse(*send(frame))


def same_bytes(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> bool:
    """Byte equality (NaN-safe), plus dtype and shape."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def assert_same_frame(a: Frame, b: Frame) -> None:
    for name in ("version", "positions", *HEADER_INTS):
        assert getattr(a, name) == getattr(b, name), name
    assert a.identities == b.identities
    for pa, pb in zip(a.parts, b.parts, strict=True):
        assert (pa.dtype, pa.dims, pa.token_axis, pa.nbytes) == (
            pb.dtype,
            pb.dims,
            pb.token_axis,
            pb.nbytes,
        )
        assert same_bytes(a.array(pa.identity), b.array(pb.identity))


def random_array(rng: np.random.Generator, name: str, dims: list[int]) -> npt.NDArray[Any]:
    dtype = DTYPES[name]
    raw = rng.integers(0, 256, size=int(np.prod(dims)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(dims)


@st.composite
def frames(draw: st.DrawFn, max_tokens: int = 6) -> Frame:
    """Random valid frames: 1-4 parts of rank 1-3, random dtypes and token axes."""
    n = draw(st.integers(0, max_tokens))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    specs: list[PartSpec] = []
    for i in range(draw(st.integers(1, 4))):
        rank = draw(st.integers(1, 3))
        axis = draw(st.integers(-1, rank - 1))
        dims = [draw(st.integers(0, 4)) for _ in range(rank)]
        if axis >= 0:
            dims[axis] = n
        name = draw(st.sampled_from(sorted(DTYPES)))
        arr = random_array(rng, name, dims)
        if draw(st.booleans()):  # a non-contiguous source: make_frame copies it once
            arr = np.ascontiguousarray(arr.T).T
        specs.append((f"p{i}", arr, axis, name))
    positions = draw(st.none() | st.lists(st.integers(0, 2**40), min_size=n, max_size=n))
    layer_start = draw(st.integers(0, 40))
    return make_frame(
        specs,
        producer_stage=draw(st.integers(0, 8)),
        layer_start=layer_start,
        layer_end=layer_start + draw(st.integers(0, 40)),
        positions=positions,
        sequence_count=draw(st.integers(1, 4)),
        token_count=n,
    )


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
