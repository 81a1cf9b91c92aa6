"""Test images and the test projector, shared by the media tests.

PNGs are built with zlib and struct (PIL may be absent); the projector is
``scripts/make_mmproj.py``'s random-weight Gemma 3 layout (16 tokens per
image), loaded from the script so the tests use exactly what it writes.
"""

from __future__ import annotations

import importlib.util
import struct
import zlib
from pathlib import Path
from types import ModuleType

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TOKENS_PER_IMAGE = 16  # the test projector: (64 / 4 / 4) ** 2


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "make_mmproj", ROOT / "scripts" / "make_mmproj.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


make_mmproj = _load_generator()


def rgb(w: int, h: int, seed: int) -> np.ndarray:
    """Random pixels, ``[h, w, 3]`` uint8."""
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def png(pixels: np.ndarray) -> bytes:
    """A minimal 8-bit RGB PNG (no PIL needed)."""
    h, w, _ = pixels.shape

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    rows = b"".join(b"\x00" + pixels[y].tobytes() for y in range(h))
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )
