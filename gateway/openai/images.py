"""``image_url`` content parts of a chat request, checked at the door.

Workers have no network, so only ``data:`` URLs are taken (base64 PNG or
JPEG); an ``http(s)`` URL is a 400 saying so, not a fetch. Each image is
decoded once here to check its base64 and its size, then passed on as the
part it was: the worker splices it into the prompt where it stands
(docs/media.md). The cap keeps a request's header (where the images
travel, as base64) under the skiff request limit (``--max-request-bytes``,
4 MiB by default).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from .errors import bad

MAX_IMAGE_BYTES = 2 << 20  # all images of one request, decoded
MAX_IMAGES = 16  # images in one request (a worker takes up to 64)
MIMES = ("image/png", "image/jpeg", "image/jpg")


def _bytes(url: str, where: str) -> int:
    """The decoded size of a ``data:image/...;base64,`` URL; 400 otherwise."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise bad(
            f"{where}: http(s) image URLs are not fetched (the workers have no network); "
            "send the image inline as a data:image/png;base64,... or data:image/jpeg URL",
            "messages",
        )
    head, sep, payload = url.partition(",")
    if scheme != "data" or not sep or not head.lower().endswith(";base64"):
        raise bad(f"{where} must be a data:image/png;base64,... (or image/jpeg) URL", "messages")
    mime = head[5:-7].split(";")[0].strip().lower()
    if mime not in MIMES:
        raise bad(f"{where}: {mime or 'no type'} is not served; send PNG or JPEG", "messages")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise bad(
            f"{where}: the image is larger than the {MAX_IMAGE_BYTES} bytes allowed", "messages"
        )
    try:
        return len(base64.b64decode(payload, validate=True))
    except (binascii.Error, ValueError):
        raise bad(f"{where}: the base64 payload does not decode", "messages") from None


def image_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    """One ``{"type": "image_url", "image_url": {"url", "detail"?}}`` part, checked."""
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str):
        raise bad(f"{where}.image_url must be {{'url': <data: URL>}}", "messages")
    size = _bytes(url, f"{where}.image_url.url")
    return {"type": "image_url", "image_url": {"url": url}, "_bytes": size}


def check_images(messages: list[dict[str, Any]]) -> None:
    """The request's images together: at most ``MAX_IMAGES`` and ``MAX_IMAGE_BYTES``."""
    parts = [
        p
        for m in messages
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if p.get("type") == "image_url"
    ]
    total = sum(int(p.pop("_bytes")) for p in parts)
    if len(parts) > MAX_IMAGES:
        raise bad(f"the messages carry {len(parts)} images; at most {MAX_IMAGES}", "messages")
    if total > MAX_IMAGE_BYTES:
        raise bad(
            f"the images add up to {total} bytes, larger than the {MAX_IMAGE_BYTES} allowed",
            "messages",
        )
