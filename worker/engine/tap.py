"""Reading layer outputs out of a running llama.cpp graph (``cb_eval``).

A pipeline stage that does not hold the model's last layer must hand the
output of its last layer (``l_out-N`` in llama.cpp's graph) to the next
stage. llama.cpp offers no API for that, but its scheduler calls an
evaluation callback for each graph node: asked first whether we want the
node (``ask``), then, once the node is computed, given it to read. We read
the wanted layer with ``ggml_backend_tensor_get`` and, when it is the last
one needed, return False: the scheduler stops computing the graph there, so
the rest (and the 262k-row output head) costs nothing.

The callback fires once per micro-batch, so a prompt longer than
``n_ubatch`` (or, with one KV stream per lane, a batch of several lanes)
yields several captures; the engine puts their rows back in batch order. An exception
inside the callback must not escape into C: it is stored, computing stops,
and ``take`` raises it after ``llama_decode`` returns. The ctypes callback
object is kept on the tap so it outlives every decode.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterable, Sequence
from typing import Any

import llama_cpp as ll
import numpy as np
from llama_cpp import _ggml

_lib = _ggml.libggml
_lib.ggml_get_name.argtypes = [ctypes.c_void_p]
_lib.ggml_get_name.restype = ctypes.c_char_p
_lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
_lib.ggml_nbytes.restype = ctypes.c_size_t
_lib.ggml_backend_tensor_get.argtypes = [
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_size_t,
]
_lib.ggml_backend_tensor_get.restype = None

# struct ggml_tensor starts {enum ggml_type type; ggml_backend_buffer * buffer;
# int64_t ne[4]; ...}: the shape sits at byte 16; type 0 is GGML_TYPE_F32.
_NE_OFFSET = 16
_GGML_TYPE_F32 = 0


class TapError(RuntimeError):
    """The graph did not give us what the tap asked for."""


class LayerTap:
    """Capture ``l_out-{k}`` for the layers asked; optionally stop after them."""

    def __init__(self, layers: Iterable[int], stop: bool) -> None:
        self.names = {f"l_out-{k}".encode(): k for k in layers}
        self.last = max(self.names.values()) if self.names else -1
        self.stop = stop
        self._got: dict[int, list[np.ndarray]] = {}
        # perf_counter() when each wanted layer's output was read (the last
        # micro-batch's): the cost of each layer, for balancing a split
        self.read_at: dict[int, float] = {}
        self._error: BaseException | None = None
        self.callback = ll.ggml_backend_sched_eval_callback(self._on_node)

    def _on_node(self, tensor: Any, ask: bool, user_data: Any) -> bool:
        try:
            name = _lib.ggml_get_name(tensor)
            layer = self.names.get(name)
            if ask:
                return layer is not None
            if layer is None:
                return True
            ptr = ctypes.cast(tensor, ctypes.c_void_p).value or 0
            kind = ctypes.c_int32.from_address(ptr).value
            ne = (ctypes.c_int64 * 4).from_address(ptr + _NE_OFFSET)
            if kind != _GGML_TYPE_F32:
                raise TapError(f"{name.decode()} is not f32 (ggml type {kind})")
            cols, rows = int(ne[0]), int(ne[1])
            out = np.empty((rows, cols), dtype=np.float32)
            if out.nbytes != _lib.ggml_nbytes(tensor):
                raise TapError(f"{name.decode()} is not a contiguous [rows, n_embd] matrix")
            _lib.ggml_backend_tensor_get(tensor, out.ctypes.data, 0, out.nbytes)
            self._got.setdefault(layer, []).append(out)
            self.read_at[layer] = time.perf_counter()
            return not (self.stop and layer == self.last)
        except BaseException as exc:  # never into C
            self._error = exc
            return False

    def reset(self) -> None:
        self._got = {}
        self.read_at = {}
        self._error = None

    def take(self) -> dict[int, list[np.ndarray]]:
        """The captures of the last decode: per layer, one array per micro-batch
        in the order llama.cpp computed them (``ubatch_rows`` maps them
        back to batch order)."""
        error, got = self._error, self._got
        self.reset()
        if error is not None:
            raise TapError(f"layer capture failed: {error}") from error
        return got


def in_batch_order(
    got: dict[int, list[np.ndarray]], plan: list[list[int]], unified: bool
) -> dict[int, np.ndarray]:
    """Each layer's captures as one ``[rows, n_embd]`` array in batch order.

    ``plan`` is the batch rows of each micro-batch as ``ubatch_rows``
    predicts llama.cpp's split. Per-lane KV streams put a lane's rows
    together, so the rows come back permuted; a unified cache keeps batch
    order. Micro-batches of other sizes than predicted mean llama.cpp's split
    changed: refused, never mapped wrongly.
    """
    out: dict[int, np.ndarray] = {}
    if not got:
        return out
    order = np.fromiter((i for rows in plan for i in rows), dtype=np.int64)
    for layer, parts in got.items():
        if [len(p) for p in parts] != [len(rows) for rows in plan]:
            raise TapError(
                f"layer {layer}: llama.cpp computed micro-batches of "
                f"{[len(p) for p in parts]} rows, not the {[len(r) for r in plan]} "
                "the engine mapped; its batch split changed"
            )
        rows = parts[0] if len(parts) == 1 else np.concatenate(parts)
        if not unified:
            placed = np.empty_like(rows)
            placed[order] = rows
            rows = placed
        out[layer] = rows
    return out


def ubatch_rows(seqs: Sequence[int], n_ubatch: int, per_lane_streams: bool) -> list[list[int]]:
    """The batch rows of each micro-batch llama.cpp computes, in its order.

    A unified KV cache splits a batch into runs of ``n_ubatch`` rows in batch
    order. A cache with one stream per lane needs each micro-batch to hold
    the same number of rows of each lane, lanes of consecutive ids, a lane's
    rows together (``llama_batch_allocr::split_equal(n_ubatch, sequential=
    true)``): rows come out of batch order. Logits are mapped back by
    llama.cpp; a layer tap sees graph rows, which ``in_batch_order`` maps
    back with this. It mirrors llama.cpp's code, so ``in_batch_order`` checks
    its result against the captures' sizes (on every ``Engine.take_taps``).
    """
    n = len(seqs)
    if not per_lane_streams or all(s == seqs[0] for s in seqs):
        # one lane's rows (a prompt piece, a stage's single stream) split as a
        # unified cache splits: runs of n_ubatch in batch order
        return [list(range(i, min(i + n_ubatch, n))) for i in range(0, n, n_ubatch)]
    rows_of: dict[int, list[int]] = {}
    for i, s in enumerate(seqs):
        rows_of.setdefault(int(s), []).append(i)
    taken = dict.fromkeys(rows_of, 0)
    used = [False] * n
    left = n
    out: list[list[int]] = []
    while left:
        lanes: list[int] = []
        for i in range(n):
            s = int(seqs[i])
            if used[i] or s in lanes or (lanes and s != lanes[-1] + 1):
                continue
            lanes.append(s)
            if len(lanes) > n_ubatch:
                break
        per: list[list[int]] = [[] for _ in lanes]
        while all(taken[s] < len(rows_of[s]) for s in lanes):
            for k, s in enumerate(lanes):
                i = rows_of[s][taken[s]]
                per[k].append(i)
                used[i] = True
                taken[s] += 1
                left -= 1
            if (len(per[0]) + 1) * len(lanes) > n_ubatch:
                break
        out.append([i for rows in per for i in rows])
    return out
