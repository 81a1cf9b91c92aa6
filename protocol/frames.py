"""Tensor frames, version 1: one format for every tensor that crosses the wire.

Hidden states between pipeline stages, logits, embeddings and saved KV state
all travel the same way, so one validator guards every path and a peer that
speaks one speaks all. A frame is a msgpack map in the message header plus raw
buffers sent as extra ZeroMQ frames::

    {"version": 1, "producer_stage": int, "layer_start": int, "layer_end": int,
     "token_count": int, "sequence_count": int, "positions": [int, ...] (optional),
     "parts": [{"identity": str, "dtype": "f32"|"f16"|"bf16"|"i32"|"u8",
                "dims": [int, ...], "byte_strides": [int, ...], "token_axis": int,
                "buffer": int, "offset": int, "nbytes": int}, ...]}

Parts carry byte strides and an offset rather than assuming C order so that a
slice of a frame (a chunk of tokens) is still a frame over the same memory:
nothing is copied to slice (``protocol/frame_chunks.py``), to send (``attach``
sends memoryview slices) or to receive (``Frame.array`` is a numpy view over
the received frame).

Everything a peer sends is untrusted: ``parse`` checks every field and names
the bad one in ``FrameError.field`` (the errors and the receiver's limits are
in ``protocol/frame_limits.py``). Integers are capped below 2**62 and all
extents are computed with Python ints before numpy sees them, so no header can
make numpy's int64 index arithmetic wrap or reach outside its buffer. Data is
little-endian always. numpy has no bfloat16, so ``bf16`` parts are viewed as
``uint16`` holding the raw bit patterns; widening them is the caller's job.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from .frame_limits import (
    DEFAULT_LIMITS,
    INT_LIMIT,
    MAX_IDENTITY_CHARS,
    MAX_RANK,
    RANK_CEILING,
    FrameError,
    FrameLimitError,
    FrameLimits,
)

VERSION: Final = 1

DTYPES: Final[Mapping[str, np.dtype[Any]]] = MappingProxyType(
    {
        "f32": np.dtype("<f4"),
        "f16": np.dtype("<f2"),
        "bf16": np.dtype("<u2"),  # raw bfloat16 bits; numpy has no bfloat16
        "i32": np.dtype("<i4"),
        "u8": np.dtype("u1"),
    }
)
# numpy -> wire name. uint16 is absent on purpose: it is only ever bf16, and
# only when the sender says so with dtype="bf16".
WIRE_NAMES: Final[Mapping[np.dtype[Any], str]] = MappingProxyType(
    {np.dtype("<f4"): "f32", np.dtype("<f2"): "f16", np.dtype("<i4"): "i32", np.dtype("u1"): "u8"}
)

PartSpec = tuple[str, npt.NDArray[Any], int] | tuple[str, npt.NDArray[Any], int, str]


@dataclass(frozen=True, slots=True)
class Part:
    """One tensor of a frame: where its bytes are and how to walk them."""

    identity: str
    dtype: str
    dims: tuple[int, ...]
    byte_strides: tuple[int, ...]
    token_axis: int
    buffer: int
    offset: int
    nbytes: int

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def span(self) -> int:
        """Bytes from the part's first byte to one past its last (0 when it is empty)."""
        return _reach(self.dims, self.byte_strides, self.itemsize) if self.nbytes else 0


@dataclass(frozen=True)
class Frame:
    """A validated frame: header fields plus the buffers its parts point into."""

    version: int
    producer_stage: int
    layer_start: int
    layer_end: int
    token_count: int
    sequence_count: int
    positions: tuple[int, ...] | None
    parts: tuple[Part, ...]
    buffers: tuple[memoryview, ...] = field(repr=False)

    @property
    def identities(self) -> tuple[str, ...]:
        return tuple(p.identity for p in self.parts)

    def part(self, identity: str) -> Part:
        """The part called ``identity``; a FrameError (not KeyError) so callers answer it."""
        for p in self.parts:
            if p.identity == identity:
                return p
        raise FrameError("parts", f"no part {identity!r}; the frame has {list(self.identities)}")

    def array(self, identity: str) -> npt.NDArray[Any]:
        """A numpy view over the buffer (no copy); read-only when the buffer is."""
        p = self.part(identity)
        mv = self.buffers[p.buffer]
        return np.ndarray(p.dims, DTYPES[p.dtype], mv, p.offset, p.byte_strides)

    def arrays(self) -> dict[str, npt.NDArray[Any]]:
        return {p.identity: self.array(p.identity) for p in self.parts}


# The wire keys are the dataclass fields, so the two cannot drift apart.
_PART_KEYS: Final = tuple(f.name for f in fields(Part))
_HEADER_KEYS: Final = tuple(f.name for f in fields(Frame) if f.name not in ("positions", "buffers"))


def make_frame(
    parts: Sequence[PartSpec],
    *,
    producer_stage: int = 0,
    layer_start: int = 0,
    layer_end: int = 0,
    positions: Sequence[int] | None = None,
    sequence_count: int = 1,
    token_count: int | None = None,
) -> Frame:
    """Build a frame over ``(identity, array, token_axis[, dtype_name])`` parts.

    C-contiguous little-endian arrays are used in place; anything else is made
    so with exactly one copy. The result goes through ``parse`` so a frame we
    build is held to the same rules as one we receive.
    """
    buffers: list[memoryview] = []
    drafts: list[Part] = []
    first_tokens: int | None = None
    for i, spec in enumerate(parts):
        where = f"parts[{i}]"
        if not isinstance(spec, tuple) or len(spec) not in (3, 4):
            raise FrameError(where, "must be (identity, array, token_axis[, dtype])")
        identity, token_axis = spec[0], _plain(spec[2])
        arr, name = _wire_array(spec[1], spec[3] if len(spec) == 4 else None, where)
        if first_tokens is None and isinstance(token_axis, int) and 0 <= token_axis < arr.ndim:
            first_tokens = int(arr.shape[token_axis])
        dims = tuple(int(d) for d in arr.shape)
        strides = _c_strides(dims, arr.itemsize)
        drafts.append(Part(identity, name, dims, strides, token_axis, len(buffers), 0, arr.nbytes))
        buffers.append(arr.reshape(-1).view(np.uint8).data)
    if token_count is None:
        token_count = 0 if first_tokens is None else first_tokens
    p = _plain
    head = (p(producer_stage), p(layer_start), p(layer_end), p(token_count), p(sequence_count))
    listed = None if positions is None else tuple(p(v) for v in positions)
    return recheck(Frame(VERSION, *head, listed, tuple(drafts), tuple(buffers)))


def attach(frame: Frame, buffers: list[Any]) -> dict[str, Any]:
    """Append the frame's bytes to an outgoing buffer list; return its header map.

    Each part gets a memoryview slice of exactly the bytes it spans, so a
    sliced frame sends only its slice and nothing is copied.
    """
    parts = []
    for p in frame.parts:
        buffers.append(frame.buffers[p.buffer][p.offset : p.offset + p.span])
        parts.append(replace(p, buffer=len(buffers) - 1, offset=0))
    return _frame_map(frame, parts)


def parse(
    header: object,
    buffers: Sequence[memoryview | bytes | bytearray],
    limits: FrameLimits = DEFAULT_LIMITS,
) -> Frame:
    """Validate a received frame header against its buffers and return the Frame.

    Checks every field before any numpy array exists; raises FrameError
    naming the first bad field, or FrameLimitError when the frame has more
    parts, or a part more dims, than ``limits`` allow.
    """
    if not isinstance(header, dict):
        raise FrameError("header", f"must be a map, got {type(header).__name__}")
    _exact_keys(header, _HEADER_KEYS, ("positions",), "")
    if _int(header["version"], "version") != VERSION:
        raise FrameError("version", f"{header['version']} is not supported; only {VERSION}")
    producer_stage = _int(header["producer_stage"], "producer_stage")
    layer_start = _int(header["layer_start"], "layer_start")
    layer_end = _int(header["layer_end"], "layer_end", low=layer_start)
    token_count = _int(header["token_count"], "token_count")
    sequence_count = _int(header["sequence_count"], "sequence_count", low=1)
    positions = None
    if "positions" in header:
        raw = header["positions"]
        if not isinstance(raw, list) or len(raw) != token_count:
            raise FrameError("positions", f"must be a list of token_count={token_count} ints")
        positions = tuple(_int(v, "positions", what=f"positions[{j}]") for j, v in enumerate(raw))
    views = tuple(_byte_view(b, i) for i, b in enumerate(buffers))
    raw_parts = header["parts"]
    if not isinstance(raw_parts, list) or not raw_parts:
        raise FrameError("parts", "must be a non-empty list of part maps")
    if len(raw_parts) > limits.parts:
        why = f"has {len(raw_parts)} parts; the limit is {limits.parts}"
        raise FrameLimitError("parts", why, "parts")
    parts: list[Part] = []
    for i, raw_part in enumerate(raw_parts):
        part = _parse_part(raw_part, f"parts[{i}]", token_count, views, limits.rank)
        if any(p.identity == part.identity for p in parts):
            raise FrameError(f"parts[{i}].identity", f"{part.identity!r} appears twice")
        parts.append(part)
    ints = (producer_stage, layer_start, layer_end, token_count, sequence_count)
    return Frame(VERSION, *ints, positions, tuple(parts), views)


def recheck(frame: Frame) -> Frame:
    """Run a frame built here (``make_frame``, ``frame_chunks``) through ``parse``:
    one checker for sent and received frames."""
    return parse(_frame_map(frame, frame.parts), frame.buffers)


def _parse_part(
    raw: object, where: str, token_count: int, views: Sequence[memoryview], rank: int
) -> Part:
    if not isinstance(raw, dict):
        raise FrameError(where, f"must be a map, got {type(raw).__name__}")
    _exact_keys(raw, _PART_KEYS, (), f"{where}.")
    identity = raw["identity"]
    if not isinstance(identity, str) or not 1 <= len(identity) <= MAX_IDENTITY_CHARS:
        raise FrameError(f"{where}.identity", f"must be a str of 1..{MAX_IDENTITY_CHARS} chars")
    dtype = raw["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise FrameError(f"{where}.dtype", f"{_show(dtype)} is not one of {sorted(DTYPES)}")
    itemsize = DTYPES[dtype].itemsize
    raw_dims = raw["dims"]
    if isinstance(raw_dims, list) and len(raw_dims) > min(rank, RANK_CEILING):
        why = f"has {len(raw_dims)} dims; the limit is {min(rank, RANK_CEILING)}"
        raise FrameLimitError(f"{where}.dims", why, "rank")
    dims = _int_list(raw_dims, f"{where}.dims", None, RANK_CEILING)
    strides = _int_list(raw["byte_strides"], f"{where}.byte_strides", len(dims))
    token_axis = _int(raw["token_axis"], f"{where}.token_axis", low=-1, high=len(dims))
    if token_axis >= 0 and dims[token_axis] != token_count:
        raise FrameError(f"{where}.dims", f"token axis has {dims[token_axis]}, not {token_count}")
    buffer = _int(raw["buffer"], f"{where}.buffer", high=len(views))
    offset = _int(raw["offset"], f"{where}.offset")
    nbytes = _int(raw["nbytes"], f"{where}.nbytes")
    if nbytes != math.prod(dims) * itemsize:
        raise FrameError(f"{where}.nbytes", f"{nbytes} != prod({dims}) * {itemsize}")
    # numpy also sizes empty arrays by their non-zero axes and refuses overflow with
    # a ValueError; keep that a FrameError.
    if math.prod(max(d, 1) for d in dims) * itemsize >= INT_LIMIT:
        raise FrameError(f"{where}.dims", f"{_show(list(dims))} is too many elements")
    _refuse_aliasing(dims, strides, itemsize, f"{where}.byte_strides")
    size = views[buffer].nbytes
    if offset + (itemsize if nbytes else 0) > size:
        raise FrameError(f"{where}.offset", f"{offset} is past the end of buffer {buffer}")
    # An empty part touches no bytes, but its strides still must not overflow int64.
    end = offset + _reach(dims, strides, itemsize)
    if (nbytes and end > size) or end >= INT_LIMIT:
        raise FrameError(f"{where}.byte_strides", f"reach byte {end} of a {size}-byte buffer")
    return Part(identity, dtype, dims, strides, token_axis, buffer, offset, nbytes)


def _refuse_aliasing(dims: Sequence[int], strides: Sequence[int], itemsize: int, at: str) -> None:
    """Refuse strides under which two elements could share bytes.

    Sufficient test: walking axes from the smallest stride up, each stride must
    clear the whole block spanned by the axes below it. C order, Fortran order,
    transposes and token slices all pass; a zero stride on a dim > 1 does not.
    """
    need = itemsize
    for stride, dim in sorted((s, d) for d, s in zip(dims, strides, strict=True) if d > 1):
        if stride < need:
            raise FrameError(at, f"{_show(list(strides))} make elements overlap")
        need = stride * dim


def _reach(dims: Sequence[int], strides: Sequence[int], itemsize: int) -> int:
    """One past the last byte, relative to the offset, treating empty axes as length 1."""
    return sum((max(d, 1) - 1) * s for d, s in zip(dims, strides, strict=True)) + itemsize


def _c_strides(dims: Sequence[int], itemsize: int) -> tuple[int, ...]:
    """C-order strides from the shape, not numpy's, which may be anything on length-1 axes."""
    return tuple(itemsize * math.prod(max(d, 1) for d in dims[k + 1 :]) for k in range(len(dims)))


def _wire_array(array: object, dtype_name: object, where: str) -> tuple[npt.NDArray[Any], str]:
    if not isinstance(array, np.ndarray):
        raise FrameError(where, f"must be a numpy array, got {type(array).__name__}")
    if not 1 <= array.ndim <= MAX_RANK:
        raise FrameError(f"{where}.dims", f"rank {array.ndim} is not in 1..{MAX_RANK}")
    little = array.dtype.newbyteorder("<")
    if dtype_name is None:
        name = WIRE_NAMES.get(little)
        if name is None:
            raise FrameError(f"{where}.dtype", f"{array.dtype} cannot travel (bf16: pass 'bf16')")
    elif isinstance(dtype_name, str) and DTYPES.get(dtype_name) == little:
        name = dtype_name
    else:
        raise FrameError(f"{where}.dtype", f"{_show(dtype_name)} does not fit {array.dtype}")
    # No copy when already C-contiguous little-endian; otherwise exactly one.
    return np.ascontiguousarray(array, dtype=little), name


def _byte_view(buf: memoryview | bytes | bytearray, index: int) -> memoryview:
    try:
        mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    except TypeError as exc:
        raise FrameError(f"buffers[{index}]", "is not a bytes-like object") from exc
    if not mv.c_contiguous:
        raise FrameError(f"buffers[{index}]", "is not contiguous")
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _frame_map(frame: Frame, parts: Sequence[Part]) -> dict[str, Any]:
    """The header map, in plain ints, strs and lists so msgpack can encode it."""
    header = {k: getattr(frame, k) for k in _HEADER_KEYS}
    header["parts"] = [_part_map(p) for p in parts]
    if frame.positions is not None:
        header["positions"] = list(frame.positions)
    return header


def _part_map(p: Part) -> dict[str, Any]:
    part = {k: getattr(p, k) for k in _PART_KEYS}
    return part | {"dims": list(p.dims), "byte_strides": list(p.byte_strides)}


def _exact_keys(m: dict[Any, Any], keys: Sequence[str], extra: Sequence[str], at: str) -> None:
    for key in m:
        if key not in keys and key not in extra:
            raise FrameError(at + (key if isinstance(key, str) else repr(key))[:64], "is unknown")
    for key in keys:
        if key not in m:
            raise FrameError(at + key, "is missing")


def _int(value: object, at: str, *, low: int = 0, high: int = INT_LIMIT, what: str = "") -> int:
    """A wire int in ``[low, high)``; bools are refused although Python calls them ints."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise FrameError(at, f"{what or 'value'} must be an int, got {type(value).__name__}")
    if not low <= value < high:
        raise FrameError(at, f"{what or 'value'} {_show(value)} is not in [{low}, {high})")
    return int(value)


def _int_list(value: object, at: str, length: int | None, most: int = MAX_RANK) -> tuple[int, ...]:
    lengths = range(1, most + 1) if length is None else (length,)
    if not isinstance(value, list) or len(value) not in lengths:
        raise FrameError(at, f"must be a list of {length or f'1..{most}'} ints")
    return tuple(_int(v, at, what=f"[{j}]") for j, v in enumerate(value))


def _plain(value: object) -> Any:
    """numpy ints become Python ints so a header built from numpy values passes."""
    return int(value) if isinstance(value, np.integer) else value


def _show(value: object) -> str:
    """A short repr for messages; a huge int is not rendered (slow, and may raise)."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"<{value.bit_length()}-bit int>"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
