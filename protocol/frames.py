"""Tensor frames: a small descriptor in the header plus one raw buffer frame.

Outgoing arrays leave as memoryviews over their own memory (no copy);
incoming buffers become read-only numpy views over the received frame (no
copy). The descriptor is a msgpack map::

    {"buffer": <index into the message's buffers>, "dtype": "float32",
     "shape": [rows, cols], "nbytes": <int>}

Only C-contiguous little-endian arrays travel; anything else is made
contiguous once on the sending side.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_ALLOWED_DTYPES = {"float32", "float16", "int32", "int16", "uint8", "int8"}


class FrameError(ValueError):
    """A tensor descriptor does not match its buffer."""


def attach(array: np.ndarray, buffers: list[Any]) -> dict[str, Any]:
    """Append ``array``'s bytes to ``buffers`` and return its descriptor."""
    if array.dtype.name not in _ALLOWED_DTYPES:
        raise FrameError(f"dtype {array.dtype.name} cannot travel")
    arr = np.ascontiguousarray(array)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    buffers.append(arr.data.cast("B"))
    return {
        "buffer": len(buffers) - 1,
        "dtype": arr.dtype.name,
        "shape": list(arr.shape),
        "nbytes": int(arr.nbytes),
    }


def view(descriptor: dict[str, Any], buffers: list[Any]) -> np.ndarray:
    """Return a zero-copy numpy view of the buffer a descriptor names."""
    try:
        index = int(descriptor["buffer"])
        dtype = np.dtype(str(descriptor["dtype"]))
        shape = tuple(int(d) for d in descriptor["shape"])
    except (KeyError, TypeError, ValueError) as exc:
        raise FrameError(f"bad tensor descriptor: {exc}") from exc
    if dtype.name not in _ALLOWED_DTYPES:
        raise FrameError(f"dtype {dtype.name} is not allowed")
    if not 0 <= index < len(buffers):
        raise FrameError(f"descriptor names buffer {index} but {len(buffers)} arrived")
    raw = buffers[index]
    mv = raw if isinstance(raw, memoryview) else memoryview(raw)
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if mv.nbytes != expected:
        raise FrameError(f"buffer has {mv.nbytes} bytes, descriptor needs {expected}")
    return np.frombuffer(mv, dtype=dtype).reshape(shape)
