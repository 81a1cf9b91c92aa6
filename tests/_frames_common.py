"""What the tensor-frame tests share (test_frames_*): a frame as a peer
receives it (the header through msgpack, buffers as read-only frames),
byte-exact comparison of frames, and a hypothesis strategy of random valid
frames (1-4 parts of rank 1-3, random dtypes and token axes).
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt
from hypothesis import settings
from hypothesis import strategies as st

from protocol.frames import DTYPES, Frame, PartSpec, attach, make_frame, parse

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
