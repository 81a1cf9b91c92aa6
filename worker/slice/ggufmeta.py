"""Reading a few GGUF metadata keys without parsing the rest of the file.

``gguf.GGUFReader`` builds a numpy view for every element of every metadata
array before it returns. The packaged Gemma 3 carries a 262,144-entry
vocabulary (tokens, scores, token types), so opening it costs ~13 s of CPU
on a small machine — and a pipeline stage opened it at every start just to
learn the architecture and the layer count.

This module walks the key/value section itself (layout: ggml's
``docs/gguf.md``, versions 2 and 3, either byte order) over an ``mmap``: scalars and
strings are decoded, arrays are stepped over by size — fixed-size items by
``count * size``, strings by their length prefixes, nested arrays
recursively — without decoding their contents, and a caller that stops
iterating stops the walk, so keys ahead of the vocabulary cost microseconds
and only the pages they sit on are read.

``read_tensor_infos`` walks on past the metadata to the tensor entries (name,
dims, type, file offset): where a stage slice's stand-ins sit, for the tests
and benchmarks that check they are never read, without a 13 s parse.

Writing GGUF files (``skiff-slice``) still uses ``gguf``.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Collection, Generator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)

# GGUF value types (gguf.GGUFValueType; kept here so reading needs no gguf import)
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL = range(8)
STRING, ARRAY, UINT64, INT64, FLOAT64 = range(8, 13)

_SCALAR_FORMAT = {
    UINT8: "B",
    INT8: "b",
    UINT16: "H",
    INT16: "h",
    UINT32: "I",
    INT32: "i",
    FLOAT32: "f",
    BOOL: "?",
    UINT64: "Q",
    INT64: "q",
    FLOAT64: "d",
}
_SCALAR_SIZE = {vtype: struct.calcsize(fmt) for vtype, fmt in _SCALAR_FORMAT.items()}
# The least bytes one array item can take: bounds a corrupt count before a
# per-item loop over it (a string is its u64 length; an array its u32 type
# and u64 count).
_MIN_ITEM_SIZE = {**_SCALAR_SIZE, STRING: 8, ARRAY: 12}


class GGUFMetaError(ValueError):
    """The file is not a GGUF this reader understands, or is cut short."""


@dataclass(frozen=True)
class GGUFArray:
    """An array value, stepped over rather than decoded.

    ``item_type`` is the GGUF type of its items (``ARRAY`` for nested arrays,
    whose own item types may differ per item); ``count`` their number.
    """

    item_type: int
    count: int


Value = int | float | bool | str | GGUFArray


class _Walker:
    """A cursor over the mapped file in the file's byte order."""

    def __init__(self, buf: mmap.mmap, order: str, offset: int) -> None:
        self.buf = buf
        self.order = order
        self.offset = offset
        self._u32 = struct.Struct(order + "I")
        self._u64 = struct.Struct(order + "Q")

    def _advance(self, size: int) -> int:
        """Claim ``size`` bytes at the cursor; their start."""
        start = self.offset
        end = start + size
        if end > len(self.buf):
            raise GGUFMetaError(f"truncated: needs byte {end}, the file has {len(self.buf)}")
        self.offset = end
        return start

    def u32(self) -> int:
        value: int = self._u32.unpack_from(self.buf, self._advance(4))[0]
        return value

    def u64(self) -> int:
        value: int = self._u64.unpack_from(self.buf, self._advance(8))[0]
        return value

    def string(self) -> str:
        size = self.u64()
        start = self._advance(size)
        try:
            return self.buf[start : start + size].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFMetaError(f"a string at byte {start} is not UTF-8: {exc}") from None

    def value(self, vtype: int) -> Value:
        fmt = _SCALAR_FORMAT.get(vtype)
        if fmt is not None:
            start = self._advance(_SCALAR_SIZE[vtype])
            scalar: int | float | bool = struct.unpack_from(self.order + fmt, self.buf, start)[0]
            return scalar
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            item_type, count = self.u32(), self.u64()
            self.skip_items(item_type, count)
            return GGUFArray(item_type, count)
        raise GGUFMetaError(f"unknown value type {vtype} before byte {self.offset}")

    def skip_items(self, item_type: int, count: int) -> None:
        """Step over ``count`` items of ``item_type`` without decoding them."""
        least = _MIN_ITEM_SIZE.get(item_type)
        if least is None:
            raise GGUFMetaError(f"unknown array item type {item_type} before byte {self.offset}")
        if count * least > len(self.buf) - self.offset:
            raise GGUFMetaError(f"truncated: an array of {count} items at byte {self.offset}")
        size = _SCALAR_SIZE.get(item_type)
        if size is not None:
            self._advance(count * size)
        elif item_type == STRING:
            # Only the length prefixes are read: one unpack per string.
            u64, buf, offset = self._u64, self.buf, self.offset
            try:
                for _ in range(count):
                    offset += 8 + u64.unpack_from(buf, offset)[0]
            except struct.error:  # a length prefix past the end
                offset = len(buf) + 1
            if offset > len(buf):
                raise GGUFMetaError(f"truncated: a string array runs past byte {len(buf)}")
            self.offset = offset
        else:  # nested arrays: each item carries its own type and count
            for _ in range(count):
                inner_type, inner_count = self.u32(), self.u64()
                self.skip_items(inner_type, inner_count)


def _header(buf: mmap.mmap, path: Path | str) -> tuple[_Walker, int, int]:
    """A cursor past the header; the tensor count and the key/value count."""
    if buf[:4] != GGUF_MAGIC:
        raise GGUFMetaError(f"{path}: no GGUF magic")
    # The version is small: read little-endian, a big-endian file's
    # shows up with its low 16 bits zero (as gguf.GGUFReader decides).
    order = "<"
    if len(buf) >= 8 and struct.unpack_from("<I", buf, 4)[0] & 0xFFFF == 0:
        order = ">"
    walk = _Walker(buf, order, 4)
    version = walk.u32()
    if version not in SUPPORTED_VERSIONS:
        raise GGUFMetaError(f"{path}: GGUF version {version} is not supported")
    n_tensors = walk.u64()  # the tensor infos follow the metadata
    return walk, n_tensors, walk.u64()


def _mapped(fh: BinaryIO, path: Path | str) -> mmap.mmap:
    try:
        return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except ValueError:  # an empty file cannot be mapped
        raise GGUFMetaError(f"{path}: empty file, not a GGUF") from None


def iter_metadata(path: Path | str) -> Generator[tuple[str, Value], None, None]:
    """Yield a GGUF's metadata ``(key, value)`` pairs in file order.

    Arrays come as ``GGUFArray`` (their contents are not read). Stop
    iterating once you have what you need: nothing past that is read.
    """
    with Path(path).open("rb") as fh, _mapped(fh, path) as buf:
        walk, _, kv_count = _header(buf, path)
        for _ in range(kv_count):
            key = walk.string()
            yield key, walk.value(walk.u32())


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry: ``dims`` in GGML order (``ne[0]`` first), its GGML
    type number, and where its data starts in the file."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int  # from the start of the file


def read_tensor_infos(path: Path | str) -> list[TensorInfo]:
    """Every tensor's entry, stepping over the metadata (a stage slice's
    stand-ins are found by these offsets in tests and benchmarks)."""
    alignment = 32  # GGUF's default; general.alignment overrides it
    infos: list[tuple[str, tuple[int, ...], int, int]] = []
    with Path(path).open("rb") as fh, _mapped(fh, path) as buf:
        walk, n_tensors, kv_count = _header(buf, path)
        for _ in range(kv_count):
            key = walk.string()
            value = walk.value(walk.u32())
            if key == "general.alignment" and isinstance(value, int) and value > 0:
                alignment = value
        for _ in range(n_tensors):
            name = walk.string()
            n_dims = walk.u32()
            if n_dims > 8:
                raise GGUFMetaError(f"{path}: tensor {name!r} has {n_dims} dimensions")
            dims = tuple(walk.u64() for _ in range(n_dims))
            infos.append((name, dims, walk.u32(), walk.u64()))
        start = -(-walk.offset // alignment) * alignment  # the data section, aligned
    return [TensorInfo(name, dims, kind, start + off) for name, dims, kind, off in infos]


def read_metadata(path: Path | str, keys: Collection[str]) -> dict[str, Value]:
    """The values of ``keys`` found in the GGUF (absent keys are left out);
    the walk stops at the last of them."""
    wanted = set(keys)
    found: dict[str, Value] = {}
    if not wanted:
        return found
    with closing(iter_metadata(path)) as items:  # unmap now, not when collected
        for key, value in items:
            if key in wanted:
                found[key] = value
                if len(found) == len(wanted):
                    break
    return found


def tied_head(source: Path | str) -> bool | None:
    """Whether the model's head is its token embedding (no ``output.weight``:
    llama.cpp then computes the head with ``token_embd``). Ask the source
    model, not a stage's slice, which leaves ``output.weight`` out of every
    stage but the last whatever the model (slice/slicer.py). None: a file
    llama.cpp loaded but this reader cannot walk (unknown, not fatal)."""
    try:
        names = {t.name for t in read_tensor_infos(source)}
    except GGUFMetaError:
        return None
    return "output.weight" not in names
