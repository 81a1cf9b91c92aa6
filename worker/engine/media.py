"""Media prefill through llama.cpp's multimodal library (``mtmd``).

A multimodal projector (an ``mmproj`` GGUF) turns an image (or, for some
projectors, audio) into embeddings in the text model's input space. llama.cpp
ships the encoder, the preprocessing and the prompt splicing as ``libmtmd``;
llama-cpp-python exposes it as ``llama_cpp.mtmd_cpp``. ``Projector`` wraps
one mtmd context bound to one ``Engine``:

- ``decode_image`` turns PNG/JPEG bytes or raw RGB into an mtmd bitmap,
  refusing what is not an image or is larger than the pixel budget *before*
  the image is decoded (the size comes from the PNG/JPEG header), so a
  small file claiming huge dimensions never allocates.
- ``tokenize`` splits a prompt at the media marker (once per bitmap) into
  text and media chunks; mtmd adds the model's own wrapping tokens
  (``<start_of_image>`` / ``<end_of_image>`` for Gemma 3).
- ``eval`` writes the chunks into ONE lane (llama.cpp sequence id) through
  ``mtmd_helper_eval_chunks``, which encodes each image, decodes its
  embeddings with non-causal attention when the model wants it (Gemma 3),
  and decodes the text between. Every check (lane, position continuity,
  room in the lane, micro-batch size) runs first; a failure inside llama.cpp
  trims the lane back, so an error leaves the session as it was.

Every native object (context, bitmaps, chunk lists) has an owner with
``close()`` and context-manager support; nothing waits for the garbage
collector. A ``Projector`` must be closed before its ``Engine``: the mtmd
context keeps a pointer to the text model.

The header sniffing (``image_size``, MIME maps, pixel budget, ``MediaError``)
is in ``media_sniff.py`` and the owned native wrappers (``Bitmap``,
``Chunks``, ``ProjectorError``) in ``media_native.py``; callers import each
name from the module that defines it.

The library logs through a global callback; we keep the last few error lines
so a failed load can say why (for example a projector width that does not
match the model's ``n_embd``) instead of llama.cpp printing to stderr.
"""

from __future__ import annotations

import ctypes
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp as ll
import numpy as np
from llama_cpp import mtmd_cpp as mt

from .media_native import Bitmap, Chunks, ProjectorError, _u8_pointer
from .media_sniff import (
    DEFAULT_MAX_PIXELS,
    IMAGE_MIMES,
    RAW_MIMES,
    MediaError,
    MediaOverflow,
    image_size,
)
from .model import Engine

_GGML_LOG_LEVEL_WARN = 3
_log_tail: deque[str] = deque(maxlen=8)


@ll.llama_log_callback  # type: ignore[untyped-decorator]
def _mtmd_log(level: int, text: bytes, user_data: Any) -> None:
    """Keep warnings and errors (for load failures); drop the chatter."""
    if level >= _GGML_LOG_LEVEL_WARN and text:
        _log_tail.append(text.decode("utf-8", "replace").strip())


_log_ready = False


def _ensure_log() -> None:
    global _log_ready
    if not _log_ready:
        mt.mtmd_log_set(_mtmd_log, ctypes.c_void_p(0))
        mt.mtmd_helper_log_set(_mtmd_log, ctypes.c_void_p(0))
        _log_ready = True


@dataclass(frozen=True)
class MediaPrefill:
    """Outcome of ``Projector.eval``: the lane's next position and counts.

    The next-token logits (when asked) are ``engine.logits_row(-1)``: the
    helper decodes with its own batch, so ``engine.output_index`` does not
    apply to them.
    """

    n_past: int
    token_count: int  # text + media tokens written
    media_tokens: int
    text_tokens: int


class Projector:
    """One mtmd context (a loaded projector) bound to one ``Engine``."""

    def __init__(self, ctx: Any, engine: Engine, path: str) -> None:
        self._ctx = ctx
        self.engine = engine
        self.path = path
        self.marker = (mt.mtmd_get_marker(ctx) or b"").decode("utf-8")
        self.image = bool(mt.mtmd_support_vision(ctx))
        self.audio = bool(mt.mtmd_support_audio(ctx))
        self.audio_sample_rate = int(mt.mtmd_get_audio_sample_rate(ctx)) if self.audio else 0
        self.non_causal = bool(mt.mtmd_decode_use_non_causal(ctx, None))
        self.mrope = bool(mt.mtmd_decode_use_mrope(ctx))

    @classmethod
    def load(
        cls,
        path: str | Path,
        engine: Engine,
        n_threads: int | None = None,
        marker: str | None = None,
        warmup: bool = True,
    ) -> Projector:
        """Load ``path`` beside ``engine``'s model.

        mtmd checks that the projector's output width is the model's
        ``n_embd``. ``warmup`` runs one encode at load so the compute
        buffers are sized (and a broken projector fails) now, not on the
        first request.
        """
        _ensure_log()
        params = mt.mtmd_context_params_default()
        params.use_gpu = False
        params.print_timings = False
        params.n_threads = n_threads or engine.cfg.n_threads
        params.warmup = warmup
        marker_bytes = marker.encode("utf-8") if marker else None
        if marker_bytes:
            params.media_marker = marker_bytes
        _log_tail.clear()
        ctx = mt.mtmd_init_from_file(str(path).encode(), engine.model_handle, params)
        if not ctx:
            why = "; ".join(_log_tail) or "see llama.cpp's log"
            raise ProjectorError(f"cannot load projector {path}: {why}")
        return cls(ctx, engine, str(path))

    def info(self) -> dict[str, Any]:
        """What the worker's ``info`` reports under ``media``."""
        return {
            "marker": self.marker,
            "projector": self.path,
            "image": self.image,
            "audio": self.audio,
        }

    @property
    def handle(self) -> Any:
        if not self._ctx:
            raise ProjectorError("projector closed")
        return self._ctx

    def close(self) -> None:
        if self._ctx:
            mt.mtmd_free(self._ctx)
            self._ctx = None

    def __enter__(self) -> Projector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- media ---------------------------------------------------------------

    def decode_image(
        self,
        data: bytes | bytearray | memoryview,
        mime: str | None = None,
        width: int | None = None,
        height: int | None = None,
        max_pixels: int = DEFAULT_MAX_PIXELS,
    ) -> Bitmap:
        """An RGB bitmap from PNG/JPEG bytes, or from raw RGB (``width`` and
        ``height`` given, ``width * height * 3`` bytes). ``max_pixels`` caps
        ``width * height`` (the worker's ``--max-image-pixels``); it is checked
        on the header, before any pixel is decoded. Raises ``MediaError``."""
        if not self.image:
            raise MediaError("this projector takes no images")
        raw = width is not None or height is not None
        if raw:
            if mime is not None and mime not in RAW_MIMES:
                raise MediaError(f"width/height are for raw RGB, not {mime}")
            if width is None or height is None or width <= 0 or height <= 0:
                raise MediaError("raw RGB needs positive width and height")
            self._check_pixels(width, height, max_pixels)
            if len(data) != width * height * 3:
                raise MediaError(
                    f"raw RGB {width}x{height} needs {width * height * 3} bytes, got {len(data)}"
                )
            arr, ptr = _u8_pointer(data)
            bmp = mt.mtmd_bitmap_init(width, height, ptr)  # copies the pixels
            del arr
            if not bmp:
                raise ProjectorError("mtmd could not make a bitmap")
            return Bitmap(bmp, "image")
        fmt, w, h = image_size(data)
        if mime is not None and IMAGE_MIMES.get(mime) != fmt:
            raise MediaError(f"the bytes are {fmt}, not {mime}")
        if w <= 0 or h <= 0:
            raise MediaError(f"{fmt} header says {w}x{h}")
        self._check_pixels(w, h, max_pixels)
        bmp = self._from_buf(data)
        if not bmp:
            raise MediaError(f"cannot decode the {fmt} image")
        out = Bitmap(bmp, "image")
        if mt.mtmd_bitmap_is_audio(bmp) or (out.nx, out.ny) != (w, h):
            out.close()
            raise MediaError(f"the {fmt} image did not decode as its header says")
        return out

    def decode_audio(self, data: bytes | bytearray | memoryview) -> Bitmap:
        """PCM bitmap from WAV / MP3 / FLAC bytes (projectors with an audio
        encoder only; mtmd resamples to the encoder's rate)."""
        if not self.audio:
            raise MediaError("this projector takes no audio")
        head = bytes(data[:12])
        if not (
            (head[:4] == b"RIFF" and head[8:12] == b"WAVE")
            or head[:4] == b"fLaC"
            or head[:3] == b"ID3"
            or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0)
        ):
            raise MediaError("not WAV, MP3 or FLAC audio")
        bmp = self._from_buf(data)
        if not bmp:
            raise MediaError("cannot decode the audio")
        out = Bitmap(bmp, "audio")
        if not mt.mtmd_bitmap_is_audio(bmp):
            out.close()
            raise MediaError("the bytes did not decode as audio")
        return out

    def _from_buf(self, data: bytes | bytearray | memoryview) -> Any:
        """The helper's decoder (stb_image / miniaudio). The helper may also
        open a video context; we never want one (the bytes were sniffed as
        an image or audio), so one that appears is freed and refused."""
        arr, ptr = _u8_pointer(data)
        opt = mt.mtmd_helper_init_opt_default()
        wrap = mt.mtmd_helper_bitmap_init_from_buf_wrapper(self.handle, ptr, arr.size, False, opt)
        if wrap.video_ctx:
            mt.mtmd_helper_video_free(wrap.video_ctx)
            if wrap.bitmap:
                mt.mtmd_bitmap_free(wrap.bitmap)
            raise MediaError("video is not supported")
        return wrap.bitmap

    def image_tokens(self, width: int, height: int) -> int:
        """How many tokens an image of this size becomes, without pixels
        (an mtmd placeholder bitmap). Gemma 3 resizes every image to its
        fixed input size, so the answer does not depend on the size there;
        a worker can check at start that one image fits its micro-batch."""
        bmp = mt.mtmd_bitmap_init(width, height, None)
        if not bmp:
            raise ProjectorError("mtmd could not make a placeholder bitmap")
        with Bitmap(bmp, "image") as placeholder, self.tokenize(self.marker, [placeholder]) as ch:
            return ch.media_tokens

    @staticmethod
    def _check_pixels(w: int, h: int, max_pixels: int) -> None:
        if w * h > max_pixels:
            raise MediaError(f"image {w}x{h} has more than {max_pixels} pixels")

    # -- prompt --------------------------------------------------------------

    def tokenize(
        self,
        prompt: str,
        bitmaps: Sequence[Bitmap],
        add_special: bool = False,
        parse_special: bool = False,
    ) -> Chunks:
        """Split ``prompt`` at the marker into text and media chunks.

        The marker must appear exactly once per bitmap (checked here first:
        mtmd would only say "mismatch"). ``add_special`` adds BOS (a fresh
        session); ``parse_special`` reads control tokens in the text.
        """
        n_markers = prompt.count(self.marker) if self.marker else 0
        if n_markers != len(bitmaps):
            raise MediaError(
                f"prompt has {n_markers} media markers ({self.marker!r}) for {len(bitmaps)} items"
            )
        raw = prompt.encode("utf-8")
        text = mt.mtmd_input_text(raw, len(raw), add_special, parse_special)
        ptrs = (ctypes.c_void_p * max(1, len(bitmaps)))(*[b.handle for b in bitmaps])
        chunks = mt.mtmd_input_chunks_init()
        if not chunks:
            raise ProjectorError("mtmd could not allocate chunks")
        rc = int(mt.mtmd_tokenize(self.handle, chunks, ctypes.byref(text), ptrs, len(bitmaps)))
        if rc != 0:
            mt.mtmd_input_chunks_free(chunks)
            if rc == 1:
                raise MediaError("media markers do not match the media items")
            raise MediaError(f"mtmd could not preprocess the media (code {rc})")
        return Chunks(chunks)

    # -- forward -------------------------------------------------------------

    def eval(self, chunks: Chunks, seq: int, n_past: int, logits_last: bool = True) -> MediaPrefill:
        """Encode and decode ``chunks`` into lane ``seq`` from ``n_past``.

        ``n_past`` must be the lane's next position (``pos_max + 1``); the
        chunks must fit in the lane. With non-causal media (Gemma 3) an
        image must fit in one micro-batch: split across two, its first
        tokens could not see its last ones and the result would silently
        differ. On a llama.cpp failure the lane is trimmed back to
        ``n_past`` and ``ProjectorError`` raised.
        """
        eng = self.engine
        if not 0 <= seq < eng.n_seq:
            raise ProjectorError(f"lane {seq} out of range (0..{eng.n_seq - 1})")
        if eng.pos_max(seq) + 1 != n_past:
            raise ProjectorError(
                f"lane {seq} holds positions up to {eng.pos_max(seq)}, not {n_past - 1}"
            )
        room = eng.n_ctx_per_seq - n_past
        if chunks.n_pos > room:
            raise MediaOverflow(chunks.n_pos, room)
        ctx = eng.ctx_handle
        # The helper decides per chunk whether to decode it non-causally.
        non_causal = [
            p.n_tokens
            for i, p in enumerate(chunks.parts)
            if p.kind != "text"
            and mt.mtmd_decode_use_non_causal(self.handle, chunks.chunk_handle(i))
        ]
        n_ubatch = int(ll.llama_n_ubatch(ctx))
        if non_causal and max(non_causal) > n_ubatch:
            raise MediaError(
                f"a media item of {max(non_causal)} tokens does not fit one micro-batch "
                f"({n_ubatch}) and must be decoded in one"
            )
        new_n_past = ll.llama_pos(n_past)
        rc = int(
            mt.mtmd_helper_eval_chunks(
                self.handle,
                ctx,
                chunks.handle,
                n_past,
                seq,
                eng.n_batch,
                logits_last,
                ctypes.byref(new_n_past),
            )
        )
        if non_causal:  # restore causal attention even if the helper stopped part-way
            ll.llama_set_causal_attn(ctx, True)
        if rc != 0:
            eng.seq_rm(seq, n_past, -1)
            raise ProjectorError(f"mtmd could not evaluate the media prompt (code {rc})")
        if new_n_past.value != n_past + chunks.n_pos:
            raise ProjectorError(
                f"mtmd advanced lane {seq} to {new_n_past.value}, not {n_past + chunks.n_pos}"
            )
        return MediaPrefill(
            n_past=int(new_n_past.value),
            token_count=chunks.n_tokens,
            media_tokens=chunks.media_tokens,
            text_tokens=chunks.text_tokens,
        )

    def non_causal_chunk(self, chunks: Chunks, index: int) -> bool:
        """Whether media chunk ``index`` is decoded with non-causal attention
        (Gemma 3's images): then it must be one batch, alone in its decode."""
        return bool(mt.mtmd_decode_use_non_causal(self.handle, chunks.chunk_handle(index)))

    def encode(self, chunks: Chunks, index: int) -> np.ndarray:
        """The embeddings of media chunk ``index`` (``[n_tokens, n_embd]``
        f32, a copy): what the helper feeds the language model. Lets a later
        path decode media through the engine's own batches (with non-causal
        attention switched on for them) or hand the embeddings out."""
        part = chunks.parts[index]
        if part.kind == "text":
            raise ProjectorError(f"chunk {index} is text")
        if int(mt.mtmd_encode_chunk(self.handle, chunks.chunk_handle(index))) != 0:
            raise ProjectorError(f"mtmd could not encode chunk {index}")
        ptr = mt.mtmd_get_output_embd(self.handle)
        if not ptr:
            raise ProjectorError("mtmd gave no embeddings")
        n_embd = int(ll.llama_model_n_embd_inp(self.engine.model_handle))
        return np.ctypeslib.as_array(ptr, shape=(part.n_tokens, n_embd)).copy()
