"""Tools in a chat prompt: the template's own tool support, or a preamble.

The ``chat`` op may carry OpenAI-style ``tools`` and messages that hold
tool calls (an assistant message's ``tool_calls``) and their results (a
``tool`` message with ``tool_call_id``). The worker renders them here, next
to the chat template, because only the worker has the template: keeping one
renderer means the prompt a tool request gets is exactly what the template
makes of it, whoever the client is (the HTTP front, or a ZeroMQ client).

Two cases, chosen once per template:

- The template uses ``tools`` (HF templates with tool support: Qwen 2.5/3,
  Llama 3.1+, Mistral...): ``tools`` goes into the Jinja context and the
  messages go as they are, except that each call's ``arguments`` (OpenAI
  sends a JSON string) is given as the parsed object, which is what HF
  templates expect (they write ``tool_call.arguments | tojson``).
- It does not (Gemma 3's, the Gemma-turn fallback): a system message is
  put first listing the functions as JSON and the call format (``PREAMBLE``,
  documented in docs/protocol.md); assistant calls are written in that
  format and tool results as a user turn inside ``<tool_response>`` tags, so
  a template that only knows user / assistant / system still renders them.

The call format is Hermes' (``<tool_call>{"name", "arguments"}</tool_call>``),
which is also what Qwen's templates ask of their models, so one parser (the
gateway's) reads both.
"""

from __future__ import annotations

import json
from typing import Any

import jinja2
import jinja2.meta

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"

PREAMBLE = (
    "You can call functions. The available functions, as JSON:\n"
    "{functions}\n"
    "To call a function, answer with only this, one block per call:\n"
    f'{CALL_OPEN}\n{{{{"name": "<function name>", "arguments": <arguments as a JSON object>}}}}\n'
    f"{CALL_CLOSE}\n"
    f"Function results come back to you inside {RESULT_OPEN}{RESULT_CLOSE}."
)


def uses_tools(env: jinja2.Environment, source: str) -> bool:
    """Whether a template reads ``tools`` (so it renders them itself)."""
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
    except jinja2.TemplateError:
        return False


def has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def _arguments(raw: Any) -> Any:
    """A call's arguments as an object when they are JSON text (HF's convention)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template with tool support: arguments as objects."""
    out: list[dict[str, Any]] = []
    for msg in messages:
        calls = msg.get("tool_calls")
        if calls:
            msg = dict(msg)
            msg["tool_calls"] = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": _arguments(c["function"].get("arguments")),
                    },
                }
                for c in calls
            ]
        out.append(msg)
    return out


def preamble(tools: list[dict[str, Any]]) -> str:
    """The system text listing ``tools`` (OpenAI ``{"type": "function",
    "function": {...}}`` entries) and the call format."""
    functions = [t["function"] for t in tools]
    return PREAMBLE.format(functions=json.dumps(functions, ensure_ascii=False))


def call_text(name: str, arguments: Any) -> str:
    """One call in the preamble's format (also how a past call is rendered)."""
    body = json.dumps({"name": name, "arguments": _arguments(arguments)}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def as_text(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """Messages for a template without tool support: the preamble first
    (merged into a leading system message), calls and results as text, and
    consecutive results joined into one user turn (templates that insist on
    alternating roles accept it)."""
    out: list[dict[str, Any]] = []
    results_open = False  # the last turn out is tool results (the next one joins it)
    for msg in messages:
        role, content = msg["role"], msg.get("content") or ""
        if role == "tool":
            text = f"{RESULT_OPEN}\n{content}\n{RESULT_CLOSE}"
            if results_open:
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text})
            results_open = True
            continue
        results_open = False
        calls = msg.get("tool_calls")
        if calls:
            blocks = [
                call_text(c["function"]["name"], c["function"].get("arguments")) for c in calls
            ]
            content = "\n".join([content, *blocks] if content else blocks)
        out.append({"role": role, "content": content})
    if tools:
        head = preamble(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{head}\n\n{out[0]['content']}"}
        else:
            out.insert(0, {"role": "system", "content": head})
    return out
