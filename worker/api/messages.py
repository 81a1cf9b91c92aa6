"""``chat``'s tools at the edge: the ``tools`` list and the tool fields of messages.

Validated here, before anything renders, so a bad tool list is one
``bad_request`` naming the field, and the renderer (``core/tools.py``) can
rely on the shapes: a tool is ``{"type": "function", "function": {"name",
"description"?, "parameters"?}}``; an assistant message's ``tool_calls``
entries are ``{"id"?, "type": "function", "function": {"name",
"arguments"}}`` (``arguments`` a JSON string, as OpenAI sends it, or a
map); a ``tool`` message may name its ``tool_call_id`` and ``name``.
"""

from __future__ import annotations

import re
from typing import Any

from faults import BadRequest

MAX_TOOLS = 128
MAX_CALLS = 64
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")  # OpenAI's function names (plus . and :)


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise BadRequest(f"{where} must be 1-64 letters, digits, _ . : or -")
    return value


def read_tools(args: dict[str, Any]) -> list[dict[str, Any]] | None:
    """``tools``: None when absent or empty, else the validated list."""
    raw = args.get("tools")
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
