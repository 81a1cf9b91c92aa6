"""Tool calls read out of generated text, as it streams.

The model answers a tool request in text; this module finds the calls in it.
Two forms are read (docs/gateway.md, *Tools*):

- ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks:
  the format of the worker's tool preamble (templates without tool support)
  and of Hermes-style templates (Qwen 2.5/3). Several blocks, several calls;
  text before them is content.
- an output that *is* such an object, ``{"name": ..., "arguments": {...}}``
  (``"parameters"`` also accepted, Llama 3.1's spelling): what the grammar of
  a forced call (``tool_choice`` ``required`` or a named function) produces.

``name`` must come first and name one of the request's functions; otherwise
the text is content, unchanged. One scanner serves streamed and whole
answers alike (a whole answer is one ``feed`` and ``finish``), so both give
the same calls: a call is committed once its header (up to the opening
``{`` of its arguments) is read, and its arguments are then passed on as
they arrive, up to the brace that closes them (tracked through JSON strings
and escapes). Arguments cut short (``max_tokens``) stay cut, as OpenAI's
would; text that could still begin a call is held back, never dropped.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_NAME_CHARS = 256  # a quoted key or name longer than this is not a call header
_WS = " \t\r\n"
_TEXT, _HEADER, _ARGS, _TAIL = range(4)
_MORE, _FAIL = -1, -2


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArgs:
    index: int
    text: str


Event = Content | CallStart | CallArgs


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _string(text: str, i: int) -> tuple[int, str | None]:
    """A JSON string at ``i``: (index after it, its value), or (_MORE | _FAIL, None)."""
    if i >= len(text):
        return _MORE, None
    if text[i] != '"':
        return _FAIL, None
    j, escaped = i + 1, False
    while j < len(text):
        c = text[j]
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == '"':
            try:
                value = json.loads(text[i : j + 1])
            except ValueError:
                return _FAIL, None
            return j + 1, value
        j += 1
    return (_MORE if j - i <= MAX_NAME_CHARS else _FAIL), None


def header(text: str) -> tuple[int, str | None]:
    """``{"name": "<name>", "arguments": {`` at the start of ``text`` (JSON
    whitespace anywhere between): (index just after the arguments' ``{``,
    the name), or (_MORE, None) while the text may still become one, or
    (_FAIL, None) when it cannot."""
    i, name = 0, None
    for step in ("{", "key:name", ":", "name", ",", "key:arguments", ":", "{"):
        while i < len(text) and text[i] in _WS:
            i += 1
        if i >= len(text):
            return _MORE, None
        if step.startswith("key") or step == "name":
            i, value = _string(text, i)
            if i < 0:
                return i, None
            if step == "name":
                name = value
            elif value not in (("name",) if step == "key:name" else ("arguments", "parameters")):
                return _FAIL, None
        elif text[i] == step:
            i += 1
        else:
            return _FAIL, None
    return i, name


@dataclass
class CallScanner:
    """Generated text in, ``Content`` / ``CallStart`` / ``CallArgs`` out."""

    names: frozenset[str]
    calls: int = 0
    _buf: str = ""
    _mode: int = _TEXT
    _started: bool = False  # the output's first non-space character was seen
    _block: bool = False  # the current call is inside <tool_call> tags
    _raw: str = ""  # what opened the current header (given back if it fails)
    _lead: str = ""  # space before a first <tool_call> (dropped if it is a call)
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _out: list[Event] = field(default_factory=list)

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        while self._step():
            pass
        out, self._out = self._out, []
        return out

    def finish(self) -> list[Event]:
        """The end of the output: what was held back, as content."""
        if self._mode == _HEADER:
            self._content(self._raw + self._buf)
        elif self._mode == _TEXT and not (self.calls and not self._buf.strip(_WS)):
            self._content(self._buf)
        self._buf, self._raw, self._mode = "", "", _TEXT
        out, self._out = self._out, []
        return out

    def _content(self, text: str) -> None:
        if text:
            self._out.append(Content(text))

    def _step(self) -> bool:
        """One move on the buffer; False when it needs more text."""
        buf = self._buf
        if self._mode == _TEXT:
            if not self._started:
                rest = buf.lstrip(_WS)
                if CALL_OPEN.startswith(rest):  # nothing yet, or maybe a call's tag
                    return False
                self._started = True
                if rest.startswith(CALL_OPEN):  # space before a first call is not content
                    self._lead, self._buf = buf[: len(buf) - len(rest)], rest
                    buf = rest
                elif rest[0] == "{" and self.calls == 0:
                    self._mode, self._block, self._raw = _HEADER, False, ""
                    return True
            if self.calls and not buf.strip(_WS):
                return False  # space between or after calls is not content
            at = buf.find(CALL_OPEN)
            if at >= 0:
                if not (self.calls and not buf[:at].strip(_WS)):
                    self._content(buf[:at])
                self._buf = buf[at + len(CALL_OPEN) :]
                self._mode, self._block, self._raw = _HEADER, True, self._lead + CALL_OPEN
                self._lead = ""
                return True
            keep = next(
                (
                    k
                    for k in range(min(len(buf), len(CALL_OPEN) - 1), 0, -1)
                    if CALL_OPEN.startswith(buf[-k:])
                ),
                0,
            )
            self._content(buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep :]
            return False
        if self._mode == _HEADER:
            end, name = header(buf)
            if end == _MORE:
                return False
            if end == _FAIL or name not in self.names:
                self._content(self._raw)  # not a call: text, as it came
                self._mode, self._raw = _TEXT, ""
                return True
            assert name is not None
            self._out.append(CallStart(self.calls, call_id(), name))
            self._buf = buf[end:]
            self._mode, self._depth, self._in_string, self._escaped = _ARGS, 1, False, False
            self._out.append(CallArgs(self.calls, "{"))
            return True
        if self._mode == _ARGS:
            return self._arguments(buf)
        return self._tail(buf)

    def _arguments(self, buf: str) -> bool:
        """Pass the arguments on up to the brace that closes them."""
        for i, c in enumerate(buf):
            if self._escaped:
                self._escaped = False
            elif self._in_string:
                self._escaped = c == "\\"
                self._in_string = c != '"'
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._out.append(CallArgs(self.calls, buf[: i + 1]))
                    self._buf = buf[i + 1 :]
                    self.calls += 1
                    self._mode = _TAIL
                    return True
        if buf:
            self._out.append(CallArgs(self.calls, buf))
        self._buf = ""
        return False

    def _tail(self, buf: str) -> bool:
        """After the arguments: the call object's ``}`` and, in a block, the
        closing tag; dropped. Anything else goes back to being text."""
        if not self._block:
            rest = buf.lstrip(_WS)
            if not rest:
                self._buf = ""
                return False
            self._buf = rest[1:] if rest[0] == "}" else rest
            self._mode = _TEXT
            return True
        close, reopen = buf.find(CALL_CLOSE), buf.find(CALL_OPEN)
        if close >= 0 and (reopen < 0 or close < reopen):
            self._buf, self._mode = buf[close + len(CALL_CLOSE) :], _TEXT
            return True
        if reopen >= 0:
            self._buf, self._mode = buf[reopen:], _TEXT
            return True
        self._buf = buf[-(len(CALL_CLOSE) - 1) :]
        return False


def collect(events: list[Event]) -> tuple[str, list[dict[str, Any]]]:
    """A whole answer's content text and its calls in OpenAI's message shape."""
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, Content):
            text.append(event.text)
        elif isinstance(event, CallStart):
            fn = {"name": event.name, "arguments": ""}
            calls.append({"id": event.id, "type": "function", "function": fn})
        else:
            calls[event.index]["function"]["arguments"] += event.text
    return "".join(text), calls
