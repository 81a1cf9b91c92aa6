"""What a ``chat`` says: its ``messages`` (with their content parts and tool
fields) and the ``tools`` it offers, read as two kinds of its table.

Read here, before anything renders, so a bad message or tool list is one
``bad_request`` naming the field, and the renderer (``core/tools.py``) can
rely on the shapes. A message is ``{"role", "content"}``; a content is a
string or a list of OpenAI-style parts: ``text`` parts are joined, and an
``image_url`` part (a ``data:`` URL: the worker fetches nothing) becomes the
projector's marker at its place and a ``MediaItem`` of the request (decoded
when the job is built). A tool is ``{"type": "function", "function":
{"name", "description"?, "parameters"?}}``; an assistant message's
``tool_calls`` entries are ``{"id"?, "type": "function", "function":
{"name", "arguments"}}`` (``arguments`` a JSON string, as OpenAI sends it,
or a map); a ``tool`` message may name its ``tool_call_id`` and ``name``.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from typing import Any

from faults import BadRequest

from ..limits import Limits, exceeded
from .requests import MediaItem
from .validate import REQUIRED, Context, Field

MAX_TOOLS = 128
MAX_CALLS = 64
# Media items one request may carry (each is at least one position and an encode).
MAX_MEDIA_ITEMS = 64
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")  # OpenAI's function names (plus . and :)


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise BadRequest(f"{where} must be 1-64 letters, digits, _ . : or -")
    return value


@dataclass(frozen=True)
class Tools(Field):
    """``tools``: the functions a chat offers (None when absent or empty)."""

    nil_ok: bool = True

    def read(self, where: str, value: Any, ctx: Context) -> list[dict[str, Any]] | None:
        return read_tools(value)


def read_tools(raw: Any) -> list[dict[str, Any]] | None:
    """``tools``: None when absent or empty, else the validated list."""
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise BadRequest(f"tools must be a list of at most {MAX_TOOLS} function tools")
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise BadRequest(f"{where} must be {{type: function, function: {{...}}}}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise BadRequest(f"{where}.function must be a map")
        name = _name(fn.get("name"), f"{where}.function.name")
        if name in seen:
            raise BadRequest(f"{where}.function.name {name!r} is given twice")
        seen.add(name)
        entry: dict[str, Any] = {"name": name}
        if fn.get("description") is not None:
            if not isinstance(fn["description"], str):
                raise BadRequest(f"{where}.function.description must be a string")
            entry["description"] = fn["description"]
        if fn.get("parameters") is not None:
            if not isinstance(fn["parameters"], dict):
                raise BadRequest(f"{where}.function.parameters must be a JSON schema map")
            entry["parameters"] = fn["parameters"]
        out.append({"type": "function", "function": entry})
    return out


def message_tool_fields(msg: dict[str, Any], where: str) -> dict[str, Any]:
    """The tool fields of one message (``tool_calls``, ``tool_call_id``,
    ``name``), validated; {} when it has none."""
    out: dict[str, Any] = {}
    calls = msg.get("tool_calls")
    if calls is not None and calls != []:
        if msg.get("role") != "assistant":
            raise BadRequest(f"{where}.tool_calls: only assistant messages carry tool calls")
        if not isinstance(calls, list) or len(calls) > MAX_CALLS:
            raise BadRequest(f"{where}.tool_calls must be a list of at most {MAX_CALLS} calls")
        out["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    for key in ("tool_call_id", "name"):
        value = msg.get(key)
        if value is not None:
            if not isinstance(value, str) or len(value) > 256:
                raise BadRequest(f"{where}.{key} must be a string of at most 256 characters")
            out[key] = value
    return out


def _call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict) or call.get("type", "function") != "function":
        raise BadRequest(f"{where} must be {{type: function, function: {{name, arguments}}}}")
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise BadRequest(f"{where}.function must be a map")
    arguments = fn.get("arguments", "{}")
    if not isinstance(arguments, str | dict):
        raise BadRequest(f"{where}.function.arguments must be a JSON string or a map")
    out: dict[str, Any] = {
        "type": "function",
        "function": {
            "name": _name(fn.get("name"), f"{where}.function.name"),
            "arguments": arguments,
        },
    }
    if call.get("id") is not None:
        if not isinstance(call["id"], str) or len(call["id"]) > 256:
            raise BadRequest(f"{where}.id must be a string of at most 256 characters")
        out["id"] = call["id"]
    return out


@dataclass(frozen=True)
class Messages(Field):
    """``messages``: read with the lane's character bound (``cells`` * 64),
    ``--max-messages``, and the projector's marker for image parts, whose
    items are read beside them (they are the chat's media)."""

    default: Any = REQUIRED
    missing: str = "must be a non-empty list"

    def read(
        self, where: str, value: Any, ctx: Context
    ) -> tuple[list[dict[str, Any]], tuple[MediaItem, ...]]:
        images: list[MediaItem] = []
        out = read_messages(value, ctx.cells * 64, ctx.limits.max_messages, ctx.marker, images)
        return out, tuple(images)


def read_messages(
    messages: Any,
    max_chars: int,
    most: int = Limits().max_messages,
    marker: str = "",
    images: list[MediaItem] | None = None,
) -> list[dict[str, Any]]:
    """Validate ``messages``: a non-empty list of ``{"role", "content"}`` maps
    (with their tool fields: a content may be null beside ``tool_calls``), at
    most ``most`` of them (``--max-messages``: ``limit_exceeded``). A content is
    a string, or a list of parts turned into one (each image the ``marker``,
    its item appended to ``images``)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    if len(messages) > most:
        raise exceeded(f"messages has {len(messages)} entries", most, "max_messages")
    found: list[MediaItem] = [] if images is None else images
    out: list[dict[str, Any]] = []
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
        if isinstance(content, list):
            content = _content_parts(content, f"messages[{i}].content", marker, found)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of parts")
        total += len(content) + sum(len(str(c["function"])) for c in extra.get("tool_calls", ()))
        if total > max_chars:
            raise BadRequest(f"messages are longer than {max_chars} characters")
        out.append({"role": role, "content": content, **extra})
    if len(found) > MAX_MEDIA_ITEMS:
        raise BadRequest(f"messages carry {len(found)} images; at most {MAX_MEDIA_ITEMS}")
    return out


def _content_parts(parts: list[Any], where: str, marker: str, images: list[MediaItem]) -> str:
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
            images.append(MediaItem(at, data, mime))
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
