"""Media in requests: the ``media`` items read, and every item decoded.

A request's media are read with its other fields, in the same pass: the
``media`` list (one map per item naming one of the message's extra buffers,
an optional ``mime``, ``width`` / ``height`` for raw RGB) is the kind
``MediaItems``, and a chat's ``image_url`` parts are read with its messages
(``messages.py``); either way they become ``MediaItem``s of the typed
request, not decoded yet. The job's builder then asks ``media_prompt`` for
the prompt: the marker count checked against the text (the prompt names
each item's place with the projector's marker, once per item, in order),
the pixel budget (``--max-image-pixels``, read from the PNG/JPEG header
before any pixel is decoded), and the decoding itself. So every check that
can fail runs before a job exists, and a refused request leaves its session
untouched. Without a projector (``--mmproj``) media is ``unsupported``.

Reading flows down into decoding, never back: this module reads with
``validate.py``'s kinds and calls nothing above it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from faults import BadRequest, Unsupported

from ..core.media_feed import MediaPrompt
from ..engine.media import Projector
from ..engine.media_native import Bitmap
from ..engine.media_sniff import MediaError, image_size
from .app import App
from .messages import MAX_MEDIA_ITEMS
from .requests import MediaItem
from .validate import REQUIRED, Context, Field, Int, Str, read_fields

_ITEM: Final[dict[str, Field]] = {
    "mime": Str(None, max_len=64),
    "width": Int(None, lo=1),
    "height": Int(None, lo=1),
}


@dataclass(frozen=True)
class MediaItems(Field):
    """``media``: a non-empty list of ``{"buffer", "mime"?, "width"?, "height"?}``,
    each naming one of the request's buffers (``Context.buffers``)."""

    def read(self, where: str, value: Any, ctx: Context) -> tuple[MediaItem, ...]:
        if not isinstance(value, list) or not value:
            raise BadRequest(f"{where} must be a non-empty list of {{buffer, mime?}} maps")
        if len(value) > MAX_MEDIA_ITEMS:
            raise BadRequest(
                f"{where} has {len(value)} items; at most {MAX_MEDIA_ITEMS} are allowed"
            )
        buffers = ctx.buffers
        table = {"buffer": Int(REQUIRED, lo=0, hi=max(0, len(buffers) - 1)), **_ITEM}
        items: list[MediaItem] = []
        for i, item in enumerate(value):
            at = f"{where}[{i}]"
            if not isinstance(item, dict) or not set(item) <= table.keys():
                raise BadRequest(f"{at} must be a map of buffer, mime?, width?, height?")
            got = read_fields(item, table, ctx, f"{at}.")
            if got["buffer"] >= len(buffers):
                raise BadRequest(f"{at}.buffer: the request carries no buffers")
            data = buffers[got.pop("buffer")]
            items.append(MediaItem(at, data, **got))
        return tuple(items)


def projector_of(app: App) -> Projector:
    """The worker's projector, or ``unsupported`` saying how to get one (on a
    chain: stage 0 with ``--mmproj``; later stages refuse it at startup)."""
    if app.projector is None:
        raise Unsupported(
            "this worker has no multimodal projector: start it with --mmproj PATH "
            "(the model's mmproj GGUF) to send images"
        )
    return app.projector


def media_prompt(
    app: App,
    text: str,
    items: Sequence[MediaItem],
    where: str = "prompt",
    add_special: bool | None = None,
    parse_special: bool = False,
) -> MediaPrompt:
    """``text`` with its items decoded: the markers are counted first (nothing
    is decoded for a prompt that names too few or too many), then each item
    (``bad_request`` naming it; nothing leaks on failure). The caller owns the
    prompt: a job that takes it frees it, else the caller closes it."""
    projector = projector_of(app)
    count = text.count(projector.marker)
    if count != len(items):
        raise BadRequest(
            f"{where} has {count} media markers ({projector.marker!r}) for {len(items)} media items"
        )
    bitmaps: list[Bitmap] = []
    try:
        for item in items:
            bitmaps.append(_decode(app.cfg.max_image_pixels, projector, item))
    except BaseException:
        for bitmap in bitmaps:
            bitmap.close()
        raise
    return MediaPrompt(projector, text, bitmaps, add_special, parse_special)


def _decode(limit: int, projector: Projector, item: MediaItem) -> Bitmap:
    """One item as a bitmap; its size is checked against ``--max-image-pixels``
    from the header (or the given raw size) before anything is decoded."""
    where, data, mime, width, height = item.where, item.data, item.mime, item.width, item.height
    try:
        if mime is not None and mime.startswith("audio/"):
            if not projector.audio:
                raise Unsupported(f"{where}: this worker's projector takes no audio")
            return projector.decode_audio(data)
        if width is None and height is None:
            kind, width_, height_ = image_size(data)
        else:
            kind, width_, height_ = "raw RGB", width or 0, height or 0
        if width_ * height_ > limit:
            raise BadRequest(
                f"{where}: {kind} image {width_}x{height_} has {width_ * height_} pixels; "
                f"the limit is {limit} (--max-image-pixels)"
            )
        return projector.decode_image(data, mime, width, height, limit)
    except MediaError as exc:
        raise BadRequest(f"{where}: {exc}") from None
