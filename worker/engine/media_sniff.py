"""Image header sniffing for media prefill: formats, MIME types, pixel budget.

What a PNG or JPEG claims to be (format, width, height) is read from its
header alone, so ``Projector.decode_image`` can refuse an image over the
pixel budget before anything is decoded, and the media handlers can check
an item's size before it reaches the engine. Pure Python (no llama.cpp):
kept apart from ``media.py`` so the byte-level parsing can be read, and
tested, without the native multimodal library. ``MediaError`` and
``MediaOverflow`` (the caller-facing ``bad_request`` errors) live here
because the sniffing raises them.
"""

from __future__ import annotations

import struct

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
JPEG_MAGIC = b"\xff\xd8\xff"
IMAGE_MIMES = {"image/png": "png", "image/jpeg": "jpeg", "image/jpg": "jpeg"}
RAW_MIMES = frozenset({"image/x-raw-rgb", "image/rgb", "application/octet-stream"})
# JPEG start-of-frame markers (they carry the size); C4, C8 and CC are not frames.
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# Pixel budget when the caller gives none: 4096 x 4096 (48 MiB of RGB).
DEFAULT_MAX_PIXELS = 1 << 24


class MediaError(ValueError):
    """The request's media or prompt is unusable: the caller answers
    ``bad_request``. Raised before anything touched the KV cache."""


class MediaOverflow(MediaError):
    """The prompt with its media does not fit in the lane's free cells."""

    def __init__(self, needed: int, available: int) -> None:
        super().__init__(f"media prompt needs {needed} positions, the lane has {available} free")
        self.needed = needed
        self.available = available


def image_size(data: bytes | bytearray | memoryview) -> tuple[str, int, int]:
    """``(format, width, height)`` from a PNG or JPEG header, without decoding.

    Raises ``MediaError`` for anything else (other formats, truncated
    headers): only PNG and JPEG are accepted, and only once their size is
    known to be within budget are they handed to the decoder.
    """
    head = bytes(data[:32])
    if head.startswith(PNG_MAGIC):
        if len(head) < 24 or head[12:16] != b"IHDR":
            raise MediaError("truncated PNG header")
        w, h = struct.unpack(">II", head[16:24])
        return "png", int(w), int(h)
    if head.startswith(JPEG_MAGIC):
        view = memoryview(data)
        i, n = 2, len(view)
        while i + 4 <= n:
            if view[i] != 0xFF:
                raise MediaError("malformed JPEG segment")
            marker = view[i + 1]
            if marker == 0xFF:  # fill byte
                i += 1
                continue
            if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
                i += 2
                continue
            (seg_len,) = struct.unpack(">H", view[i + 2 : i + 4])
            if marker in _JPEG_SOF:
                if i + 9 > n:
                    break
                h, w = struct.unpack(">HH", view[i + 5 : i + 9])
                return "jpeg", int(w), int(h)
            if marker == 0xDA:  # start of scan before any frame header
                break
            i += 2 + seg_len
        raise MediaError("JPEG without a frame header")
    raise MediaError("not a PNG or JPEG image")
