"""Media in requests: ``prefill_media``, and the media of ``generate`` / ``chat``.

Everything about a request's media is checked here, before a job exists, so
a refused request leaves its session untouched: the ``media`` list (one map
per item naming one of the message's extra buffers, an optional ``mime``,
``width`` / ``height`` for raw RGB), the pixel budget
(``--max-image-pixels``, read from the PNG/JPEG header before any pixel is
decoded), the decoding itself, and the marker count (the prompt names each
item's place with the projector's marker, once per item, in order). Chat
messages may carry OpenAI-style content parts: ``text`` parts are joined,
and an ``image_url`` part (a ``data:`` URL: the worker fetches nothing)
becomes the marker at its place.

Without a projector (``--mmproj``) media is ``unsupported``. ``generate.py``
owns ``generate`` and ``chat`` and asks here for their media
(``generate_prompt``, ``chat_media``) only when a request carries some;
``MEDIA_HANDLERS`` holds ``prefill_media``.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Sequence
from typing import Any

from edge import Request
from faults import BadRequest, Unsupported
from protocol.envelope import Op

from ..core.jobs.media import MediaPrefillJob
from ..core.media_feed import MediaPrompt
from ..engine.media import Projector
from ..engine.media_native import Bitmap
from ..engine.media_sniff import MediaError, image_size
from ..limits import Limits, check
from .app import App, Handler
from .sampling import get_sampling
from .tools import message_tool_fields
from .validate import get_bool, get_int, get_outputs, get_session, get_str

# Media items one request may carry (each is at least one position and an encode).
MAX_MEDIA_ITEMS = 64
_ITEM_KEYS = frozenset({"buffer", "mime", "width", "height"})


def get_messages(
    args: dict[str, Any],
    max_chars: int,
    most: int = Limits().max_messages,
    parts: Callable[[list[Any], str], str] | None = None,
) -> list[dict[str, Any]]:
    """Validate ``messages``: a non-empty list of ``{"role", "content"}`` strings
    (with their tool fields, ``tools.py``: a content may be null beside ``tool_calls``),
    at most ``most`` of them (``--max-messages``: ``limit_exceeded``). With
    ``parts``, a content may also be a list of parts, which ``parts(list,
    where)`` turns into the string (media chat: images become the marker)."""
    messages = args.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    check(len(messages), most, "max_messages", "messages has {n} entries")
    out: list[dict[str, str]] = []
    total = 0
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise BadRequest(f"messages[{i}] must be a map")
        role, content = msg.get("role"), msg.get("content")
        if not isinstance(role, str) or not 0 < len(role) <= 64:
            raise BadRequest(f"messages[{i}].role must be a non-empty string")
        extra = message_tool_fields(msg, f"messages[{i}]")
        if content is None and "tool_calls" in extra:
            content = ""  # an assistant turn that only calls tools
        if parts is not None and isinstance(content, list):
            content = parts(content, f"messages[{i}].content")
        if not isinstance(content, str):
            kinds = "a string or a list of parts" if parts is not None else "a string"
            raise BadRequest(f"messages[{i}].content must be {kinds}")
        total += len(content) + sum(len(str(c["function"])) for c in extra.get("tool_calls", ()))
        if total > max_chars:
            raise BadRequest(f"messages are longer than {max_chars} characters")
        out.append({"role": role, "content": content, **extra})
    return out


def projector_of(app: App) -> Projector:
    """The worker's projector, or ``unsupported`` saying how to get one (on a
    chain: stage 0 with ``--mmproj``; later stages refuse it at startup)."""
    if app.projector is None:
        raise Unsupported(
            "this worker has no multimodal projector: start it with --mmproj PATH "
            "(the model's mmproj GGUF) to send images"
        )
    return app.projector


def _decode(
    app: App,
    projector: Projector,
    data: bytes | memoryview,
    mime: str | None,
    width: int | None,
    height: int | None,
    where: str,
) -> Bitmap:
    """One item as a bitmap; its size is checked against ``--max-image-pixels``
    from the header (or the given raw size) before anything is decoded."""
    limit = app.cfg.max_image_pixels
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


def get_media(
    app: App, projector: Projector, args: dict[str, Any], buffers: Sequence[memoryview]
) -> list[Bitmap]:
    """``media``: a non-empty list of ``{"buffer", "mime"?, "width"?, "height"?}``,
    each decoded (``bad_request`` naming the item; nothing leaks on failure)."""
    items = args.get("media")
    if not isinstance(items, list) or not items:
        raise BadRequest("media must be a non-empty list of {buffer, mime?} maps")
    if len(items) > MAX_MEDIA_ITEMS:
        raise BadRequest(f"media has {len(items)} items; at most {MAX_MEDIA_ITEMS} are allowed")
    bitmaps: list[Bitmap] = []
    try:
        for i, item in enumerate(items):
            where = f"media[{i}]"
            if not isinstance(item, dict) or not set(item) <= _ITEM_KEYS:
                raise BadRequest(f"{where} must be a map of buffer, mime?, width?, height?")
            try:
                index = get_int(item, "buffer", lo=0, hi=max(0, len(buffers) - 1))
                mime = get_str(item, "mime", max_len=64) if "mime" in item else None
                width = get_int(item, "width", lo=1) if "width" in item else None
                height = get_int(item, "height", lo=1) if "height" in item else None
            except BadRequest as exc:
                raise BadRequest(f"{where}.{exc.message}") from None
            if index >= len(buffers):
                raise BadRequest(f"{where}.buffer: the request carries no buffers")
            bitmaps.append(_decode(app, projector, buffers[index], mime, width, height, where))
    except BaseException:
        for bitmap in bitmaps:
            bitmap.close()
        raise
    return bitmaps


def check_markers(projector: Projector, text: str, items: int, where: str = "prompt") -> None:
    count = text.count(projector.marker)
    if count != items:
        raise BadRequest(
            f"{where} has {count} media markers ({projector.marker!r}) for {items} media items"
        )


def h_prefill_media(app: App, req: Request) -> dict[str, Any] | None:
    projector = projector_of(app)
    args = req.args
    session = get_session(req.session)
    text = get_str(args, "prompt", max_len=app.rt.ctx_per_lane * 64)
    outputs = get_outputs(args)
    if "logits" in outputs:
        raise BadRequest("prefill_media output may only be ['hidden'] (the sampled token is given)")
    spec = get_sampling(args, grammars=app.grammars, limits=app.limits)
    add_special = args.get("add_special")
    if add_special is not None and not isinstance(add_special, bool):
        raise BadRequest("add_special must be a boolean")
    parse_special = get_bool(args, "parse_special", False)
    bitmaps = get_media(app, projector, args, req.buffers)
    prompt = MediaPrompt(projector, text, bitmaps, add_special, parse_special)
    try:
        check_markers(projector, text, len(bitmaps))
        job = MediaPrefillJob(
            app.ticket(req), session, prompt, app.chunk, spec, outputs, app.prompt_limit
        )
        app.submit(job)
    except BaseException:
        prompt.close()
        raise
    return None


def generate_prompt(app: App, req: Request, text: str) -> MediaPrompt:
    """``generate`` with ``media``: the items decoded and their markers checked
    against the text prompt; the caller closes the prompt if it does not
    hand it to a job."""
    projector = projector_of(app)
    prompt = MediaPrompt(projector, text, get_media(app, projector, req.args, req.buffers))
    try:
        check_markers(projector, text, len(prompt.bitmaps))
    except BaseException:
        prompt.close()
        raise
    return prompt


def chat_media(app: App, req: Request) -> tuple[list[dict[str, Any]], MediaPrompt | None]:
    """``chat``'s messages with string contents (OpenAI-style ``text`` parts
    joined, each ``image_url`` part replaced by the projector's marker), and
    the media prompt when the request carries media (``image_url`` parts, or
    ``media`` with markers in the text); None for a text-only chat. The
    prompt's text is left for the caller to render."""
    args = req.args
    raw = args.get("messages")
    parts = isinstance(raw, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list) for m in raw
    )
    cells = app.rt.ctx_per_lane
    if not parts and "media" not in args:
        return get_messages(args, max_chars=cells * 64, most=app.limits.max_messages), None
    marker = app.projector.marker if app.projector is not None else ""
    messages, images = chat_messages(raw, marker, cells * 64, app.limits.max_messages)
    if not images and "media" not in args:  # content parts, text only
        return messages, None
    projector = projector_of(app)
    if images and "media" in args:
        raise BadRequest("give media with markers in the text, or image_url parts, not both")
    if images:
        bitmaps: list[Bitmap] = []
        try:
            for where, mime, data in images:
                bitmaps.append(_decode(app, projector, data, mime, None, None, where))
        except BaseException:
            for bitmap in bitmaps:
                bitmap.close()
            raise
    else:
        bitmaps = get_media(app, projector, args, req.buffers)
    return messages, MediaPrompt(projector, "", bitmaps, add_special=False, parse_special=True)


def chat_messages(
    raw: Any, marker: str, max_chars: int, most: int
) -> tuple[list[dict[str, Any]], list[tuple[str, str, bytes]]]:
    """Messages with string contents, and the images of their ``image_url``
    parts as ``(where, mime, bytes)`` (each replaced by ``marker``)."""
    images: list[tuple[str, str, bytes]] = []

    def parts(content: list[Any], where: str) -> str:
        return _content_parts(content, where, marker, images)

    out = get_messages({"messages": raw}, max_chars, most, parts)
    if len(images) > MAX_MEDIA_ITEMS:
        raise BadRequest(f"messages carry {len(images)} images; at most {MAX_MEDIA_ITEMS}")
    return out, images


def _content_parts(
    parts: list[Any], where: str, marker: str, images: list[tuple[str, str, bytes]]
) -> str:
    """OpenAI-style parts as one string: text joined, each image the marker."""
    text: list[str] = []
    for k, part in enumerate(parts):
        at = f"{where}[{k}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise BadRequest(f"{at}.image_url must be {{'url': <data: URL>}}")
            mime, data = data_url(url, f"{at}.image_url.url")
            images.append((at, mime, data))
            text.append(marker)
        else:
            raise BadRequest(f"{at} must be a {{type: text, text}} or {{type: image_url}} part")
    return "".join(text)


def data_url(url: str, where: str) -> tuple[str, bytes]:
    """``data:<mime>;base64,<bytes>`` -> (mime, bytes); nothing else is fetched."""
    head, sep, payload = url.partition(",")
    if not url.startswith("data:") or not sep or not head.endswith(";base64"):
        raise BadRequest(f"{where} must be a data:<mime>;base64,... URL (the worker fetches none)")
    mime = head[5:-7].split(";")[0].strip().lower()
    if not mime.startswith("image/"):
        raise BadRequest(f"{where}: {mime or 'no mime'} is not an image type")
    try:
        return mime, base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{where}: the base64 payload does not decode") from None


MEDIA_HANDLERS: dict[str, Handler] = {
    Op.PREFILL_MEDIA: h_prefill_media,
}
