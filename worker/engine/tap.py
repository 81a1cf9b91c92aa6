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
from collections.abc import Iterable
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
        in the order llama.cpp computed them (``batch.ubatch_rows`` maps them
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

    ``plan`` is the batch rows of each micro-batch as ``batch.ubatch_rows``
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
