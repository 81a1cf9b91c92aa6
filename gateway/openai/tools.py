"""``tools`` / ``tool_choice`` of a chat request -> what the worker is asked.

The worker renders the tools into the prompt (its template's own tool
support, or its preamble: ``worker/core/tools.py``); the gateway decides
what to ask and how to read the answer:

- ``none``: no tools reach the prompt and the answer is plain content
  (earlier tool turns in ``messages`` are still rendered).
- ``auto`` (the default with tools): tools in the prompt, free generation,
  then calls are read from the text (``toolcalls.py``).
- ``required`` / ``{"type": "function", "function": {"name"}}``: the output
  is constrained to ``{"name": <a function>, "arguments": <its parameters>}``
  by a JSON schema the worker turns into a grammar (llama.cpp's converter,
  ``worker/engine/grammar.py``), so the call always parses and its
  arguments follow the function's schema as far as the converter enforces it.

Tools are checked here with 400s naming ``tools`` / ``tool_choice``, so a
client sees OpenAI's error for OpenAI's field; the worker checks them again
(it takes ZeroMQ clients too).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .errors import bad

MAX_TOOLS = 128  # the worker's limit too (worker/api/messages.py)
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses tools."""

    tools: list[dict[str, Any]]  # as the worker takes them
    names: frozenset[str]  # what the answer may call
    schema: dict[str, Any] | None  # the forced call's JSON schema; None: free


def _tools(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw or len(raw) > MAX_TOOLS:
        raise bad(f"tools must be a non-empty list of at most {MAX_TOOLS} tools", "tools")
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad(f"{where}.type must be 'function' (the only tool type served)", "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad(f"{where}.function must be an object", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad(f"{where}.function.name must be 1-64 of a-z, A-Z, 0-9, _ and -", "tools")
        if name in seen:
            raise bad(f"{where}.function.name '{name}' is given twice", "tools")
        seen.add(name)
        entry: dict[str, Any] = {"name": name}
        description = fn.get("description")
        if description is not None:
            if not isinstance(description, str):
                raise bad(f"{where}.function.description must be a string", "tools")
            entry["description"] = description
        parameters = fn.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                raise bad(f"{where}.function.parameters must be a JSON schema object", "tools")
            entry["parameters"] = parameters
        out.append({"type": "function", "function": entry})
    return out


def _call_schema(fn: dict[str, Any]) -> dict[str, Any]:
    """The schema of one call: name first (the reader expects it first)."""
    return {
        "type": "object",
        "properties": {
            "name": {"const": fn["name"]},
            "arguments": fn.get("parameters") or {"type": "object"},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def plan_tools(body: dict[str, Any]) -> ToolPlan | None:
    """The request's tool plan; None when it uses no tools."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise bad(f"{legacy} is deprecated and not served: use tools and tool_choice", legacy)
    raw, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if raw is None:
        if choice is not None and choice != "none":
            raise bad("tool_choice needs tools", "tool_choice")
        return None
    tools = _tools(raw)
    choice = "auto" if choice is None else choice
    if choice == "none":
        return None
    if choice == "auto":
        return ToolPlan(tools, frozenset(t["function"]["name"] for t in tools), None)
    functions = [t["function"] for t in tools]
    if choice == "required":
        chosen = functions
    else:
        named = choice.get("function") if isinstance(choice, dict) else None
        name = named.get("name") if isinstance(named, dict) else None
        if not isinstance(choice, dict) or choice.get("type") != "function" or name is None:
            raise bad(
                "tool_choice must be 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        chosen = [f for f in functions if f["name"] == name]
        if not chosen:
            raise bad(f"tool_choice names '{str(name)[:64]}', which is not in tools", "tool_choice")
    schemas = [_call_schema(f) for f in chosen]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return ToolPlan(tools, frozenset(f["name"] for f in chosen), schema)


def past_calls(raw: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's earlier ``tool_calls``, as the worker takes them
    (``arguments`` stays the JSON string OpenAI sends; the worker parses it)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(raw, list):
        raise bad(f"{where} must be a list", "messages")
    out: list[dict[str, Any]] = []
    for j, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function":
            raise bad(f"{where}[{j}] must be {{type: function, function: {{...}}}}", "messages")
        name, arguments = fn.get("name"), fn.get("arguments", "{}")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad(f"{where}[{j}].function.name must be a function name", "messages")
        if not isinstance(arguments, str):
            raise bad(f"{where}[{j}].function.arguments must be a JSON string", "messages")
        entry: dict[str, Any] = {
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out
