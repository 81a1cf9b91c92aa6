"""Owned native objects of llama.cpp's multimodal library (``mtmd``).

``Bitmap`` (a decoded image or PCM audio) and ``Chunks`` (a tokenized media
prompt, with its ``Chunk`` parts) each own one ``mtmd`` allocation and free
it in ``close()``; ``ProjectorError`` is what a native failure raises. Kept
apart from ``media.py`` (the ``Projector``: load, decode, tokenize, eval) so
the ownership wrappers, which hold no model or context, read on their own.
"""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from llama_cpp import mtmd_cpp as mt

ChunkKind = Literal["text", "image", "audio"]

_KINDS: dict[int, ChunkKind] = {
    mt.MTMD_INPUT_CHUNK_TYPE_TEXT: "text",
    mt.MTMD_INPUT_CHUNK_TYPE_IMAGE: "image",
    mt.MTMD_INPUT_CHUNK_TYPE_AUDIO: "audio",
}


class ProjectorError(RuntimeError):
    """llama.cpp's multimodal library failed (load, encode, decode), or the
    caller broke an invariant (wrong lane, wrong position)."""


def _u8_pointer(data: bytes | bytearray | memoryview) -> tuple[np.ndarray, Any]:
    """A ``uint8*`` into ``data`` without copying; keep the array alive."""
    arr = np.frombuffer(data, dtype=np.uint8)
    return arr, arr.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))


class Bitmap:
    """An owned ``mtmd_bitmap`` (RGB image or PCM audio)."""

    def __init__(self, ptr: Any, kind: ChunkKind) -> None:
        self._ptr = ptr
        self.kind = kind
        self.nx = int(mt.mtmd_bitmap_get_nx(ptr))
        self.ny = int(mt.mtmd_bitmap_get_ny(ptr))

    @property
    def handle(self) -> Any:
        if not self._ptr:
            raise ProjectorError("bitmap already freed")
        return self._ptr

    def close(self) -> None:
        if self._ptr:
            mt.mtmd_bitmap_free(self._ptr)
            self._ptr = None

    def __enter__(self) -> Bitmap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # a safety net only; owners call close()
        with contextlib.suppress(Exception):
            self.close()


@dataclass(frozen=True)
class Chunk:
    """One piece of a tokenized media prompt.

    ``tokens`` are the text token ids (None for media); ``n_pos`` is how many
    positions the chunk takes (equal to ``n_tokens`` except for M-RoPE models).
    """

    kind: ChunkKind
    n_tokens: int
    n_pos: int
    tokens: tuple[int, ...] | None


class Chunks:
    """An owned ``mtmd_input_chunks`` and what it holds."""

    def __init__(self, ptr: Any) -> None:
        self._ptr = ptr
        parts: list[Chunk] = []
        for i in range(int(mt.mtmd_input_chunks_size(ptr))):
            c = mt.mtmd_input_chunks_get(ptr, i)
            kind = _KINDS.get(int(mt.mtmd_input_chunk_get_type(c)))
            if kind is None:
                raise ProjectorError(f"unknown mtmd chunk type in chunk {i}")
            tokens: tuple[int, ...] | None = None
            if kind == "text":
                n = ctypes.c_size_t(0)
                tp = mt.mtmd_input_chunk_get_tokens_text(c, ctypes.byref(n))
                tokens = tuple(int(tp[k]) for k in range(n.value)) if n.value else ()
            parts.append(
                Chunk(
                    kind,
                    int(mt.mtmd_input_chunk_get_n_tokens(c)),
                    int(mt.mtmd_input_chunk_get_n_pos(c)),
                    tokens,
                )
            )
        self.parts: tuple[Chunk, ...] = tuple(parts)
        self.n_tokens = int(mt.mtmd_helper_get_n_tokens(ptr))
        self.n_pos = int(mt.mtmd_helper_get_n_pos(ptr))
        self.media_tokens = sum(p.n_tokens for p in parts if p.kind != "text")
        self.text_tokens = self.n_tokens - self.media_tokens

    @property
    def handle(self) -> Any:
        if not self._ptr:
            raise ProjectorError("chunks already freed")
        return self._ptr

    def chunk_handle(self, index: int) -> Any:
        return mt.mtmd_input_chunks_get(self.handle, index)

    def close(self) -> None:
        if self._ptr:
            mt.mtmd_input_chunks_free(self._ptr)
            self._ptr = None

    def __enter__(self) -> Chunks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # a safety net only; owners call close()
        with contextlib.suppress(Exception):
            self.close()
