"""One sequence's saved KV state: saving, loading, and moving it between
contexts of different lane counts.

``llama_state_seq_get_data`` writes an 8-byte header (a magic and a
version), then for each KV cache of the model (Gemma 3 has two: global and
sliding-window layers) a section

    u32 n_stream; then per stream: u32 cell_count, and when it is not 0,
    cell_count x (i32 pos, u32 n_seq_id, n_seq_id x i32 seq)     -- meta
    u32 v_trans, u32 n_layer, n_layer x (i32 type, u64 row, cell_count*row bytes)   -- K
    n_layer x (i32 type, u64 row, cell_count*row)            (v_trans = 0) -- V
    or n_layer x (i32 type, u32 el, u32 n_embd_v, n_embd_v*cell_count*el)   (v_trans = 1)

and ``llama_state_seq_set_data`` refuses a state whose ``n_stream`` differs
from its own — with a KV stream per lane, that is any worker with another
lane count, though a single sequence's state fills exactly one stream and
lands in the target lane's stream whatever its index. ``restream`` rewrites
the stream count (moving the one non-empty stream first) so the state loads
into a context with ``n_stream`` streams. The walk is bounds-checked: a
state it cannot parse raises ``ValueError`` and is never handed to llama.cpp.
This follows the vendored llama.cpp (llama-cpp-python 0.3.36); the engine's
identity names the format so a state from another layout is refused first.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import struct
import threading
from typing import Any

import llama_cpp as ll
import numpy as np

from .load import EngineError

FORMAT = "llama.cpp-seq-state-v1"
_U32 = struct.Struct("<I")
_MAGIC = 0xAF143CD8  # the header llama_state_seq_get_data starts with (magic, version)
_HEADER = 8
_I32U64 = struct.Struct("<iQ")
_I32U32U32 = struct.Struct("<iII")
# LLAMA_STATE_SEQ_FLAGS_ALL_CELLS, defined by skiff's patch (scripts/llama_patch.py)
_STATE_ALL_CELLS = 4


def save(ctx: Any, seq: int, all_cells: bool = False) -> np.ndarray:
    """One sequence's KV state, written by llama.cpp straight into a new
    uint8 array (the array is what travels; no further copy). Upstream
    leaves out the cells a sliding window masks (enough to go on from the
    end); ``all_cells`` keeps them (skiff's patch), so the state can be
    loaded and trimmed back to any shorter prefix."""
    flags = _STATE_ALL_CELLS if all_cells else 0
    size = int(ll.llama_state_seq_get_size_ext(ctx, seq, flags))
    out = _small_pages(size)
    ptr = out.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    n = int(ll.llama_state_seq_get_data_ext(ctx, ptr, size, seq, flags))
    if n <= 0:
        raise EngineError(f"llama.cpp could not save lane {seq}")
    return out[:n]


def _small_pages(size: int) -> np.ndarray:
    """A new uint8 array of ``size`` bytes in memory of ordinary 4 KiB pages.

    Why not ``np.empty``: the worker runs with glibc's ``hugetlb`` tunable
    (``edge/memory.py``) and NumPy itself advises huge pages from 4 MiB, and
    a fresh transparent huge page is slow to fault in on a virtual machine.
    A Gemma 3 lane of 256 tokens saves ~4.7 MB: measured 5-16 ms that way
    against ~2 ms here, and an evicted prefix-cache lane is saved while a
    new prompt is admitted, between two turns of every running stream."""
    buf = mmap.mmap(-1, max(size, 1))
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype=np.uint8, count=size)


def load(ctx: Any, seq: int, data: np.ndarray, n_stream: int) -> bool:
    """Load a sequence's KV state from ``data``; False when llama.cpp
    refuses it (it returns 0 instead of raising).

    Read in place when it was saved by a context with ``n_stream`` KV
    streams; otherwise re-laid once (``restream``). A state that does not
    parse raises ``EngineError`` before llama.cpp sees it."""
    try:
        arr = restream(np.ascontiguousarray(data, dtype=np.uint8).reshape(-1), n_stream)
    except ValueError as exc:
        raise EngineError(str(exc)) from None
    ptr = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    return int(ll.llama_state_seq_set_data(ctx, ptr, arr.nbytes, seq)) > 0


class _Reader:
    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.at = 0

    def take(self, n: int) -> int:
        start = self.at
        if n < 0 or start + n > len(self.data):
            raise ValueError(f"the KV state ends early (needs {n} bytes at {start})")
        self.at += n
        return start

    def u32(self) -> int:
        value: int = _U32.unpack_from(self.data, self.take(4))[0]
        return value


def _stream_end(r: _Reader, cell_count: int) -> None:
    """Skip one non-empty stream's meta and data (reader is after cell_count)."""
    for _ in range(cell_count):
        r.take(4)  # pos
        n_seq = r.u32()
        r.take(4 * n_seq)
    v_trans = r.u32()
    n_layer = r.u32()
    if v_trans > 1 or n_layer > 4096:
        raise ValueError("the KV state's layer header is not one llama.cpp writes")
    for _ in range(n_layer):  # K
        _, row = _I32U64.unpack_from(r.data, r.take(_I32U64.size))
        r.take(row * cell_count)
    for _ in range(n_layer):  # V
        if v_trans:
            _, el, n_embd = _I32U32U32.unpack_from(r.data, r.take(_I32U32U32.size))
            r.take(el * n_embd * cell_count)
        else:
            _, row = _I32U64.unpack_from(r.data, r.take(_I32U64.size))
            r.take(row * cell_count)


def sections(state: np.ndarray) -> list[tuple[int, list[tuple[int, int]]]]:
    """Per KV cache: (n_stream, [(start, end) byte span of each non-empty stream])."""
    r = _Reader(np.ascontiguousarray(state, dtype=np.uint8).data.cast("B"))
    if r.u32() != _MAGIC:
        raise ValueError("the KV state does not start with llama.cpp's sequence-state magic")
    r.u32()  # format version, checked by llama.cpp itself
    out: list[tuple[int, list[tuple[int, int]]]] = []
    while r.at < len(r.data):
        n_stream = r.u32()
        if not 0 < n_stream <= 4096:
            raise ValueError(f"the KV state names {n_stream} streams")
        spans: list[tuple[int, int]] = []
        for _ in range(n_stream):
            start = r.at
            cell_count = r.u32()
            if cell_count:
                _stream_end(r, cell_count)
                spans.append((start, r.at))
        out.append((n_stream, spans))
    return out


def streams_of(state: np.ndarray) -> int:
    """The stream count a state was saved with (its first cache's)."""
    return sections(state)[0][0]


def restream(state: np.ndarray, n_stream: int) -> np.ndarray:
    """The same sequence state laid out for a context with ``n_stream`` streams.

    Returns ``state`` itself when every cache already has ``n_stream``
    streams (no copy); otherwise one new array.
    """
    parsed = sections(state)
    if all(n == n_stream for n, _ in parsed):
        return state
    raw = np.ascontiguousarray(state, dtype=np.uint8)
    pieces: list[bytes | np.ndarray] = [raw[:_HEADER]]
    for _, spans in parsed:
        if len(spans) > 1:
            raise ValueError("the KV state holds more than one sequence")
        pieces.append(_U32.pack(n_stream))
        pieces.extend(raw[start:end] for start, end in spans)
        pieces.append(_U32.pack(0) * (n_stream - len(spans)))
    return np.concatenate(
        [np.frombuffer(p, np.uint8) if isinstance(p, bytes) else p for p in pieces]
    )


class FileDigest:
    """A file's sha256, computed once: by ``prepare`` in a background thread
    (hashlib drops the GIL while it hashes), or by the first ``hexdigest``.

    A saved KV state names the model file it belongs to; hashing the 253 MB
    default model takes ~0.2 s, which the first export or import would
    otherwise spend inside a turn, in the middle of moving a live stream.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._value: str | None = None

    def prepare(self) -> None:
        """Hash now, off the caller's thread."""
        threading.Thread(target=self.hexdigest, name="model-sha256", daemon=True).start()

    def hexdigest(self) -> str:
        with self._lock:  # a second caller waits for the first one's result
            if self._value is None:
                digest = hashlib.sha256()
                with open(self.path, "rb") as fh:
                    while chunk := fh.read(1 << 22):
                        digest.update(chunk)
                self._value = digest.hexdigest()
            return self._value
