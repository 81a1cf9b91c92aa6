"""The generation ops: ``generate`` and ``chat``, header -> typed request.

A reader here does one thing: ``read_generation`` reads the header in one
pass over its op's table (``GENERATION`` / ``CHAT``: every field's kind
checks it and holds it to its limit, the media items and a chat's messages
and tools included) into a frozen ``Generation`` (``requests.py``) and
returns it. The service turns that into the job (``service.generation_job``,
the one builder) and submits it. So a request flows one way, read here and
in ``validate.py``, built by the service, and never comes back up to be
read again; the core never sees a dict from the wire.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from edge import Request
from faults import BadRequest, ShuttingDown, Unsupported
from protocol.transport import Op

from ..core.suspend import Resume
from .app import App
from .media import MediaItems, projector_of
from .messages import Messages, Tools
from .requests import Generation, Speculation
from .sampling import Sampling
from .validate import (
    OUTPUTS,
    Bool,
    Context,
    Field,
    Int,
    PromptText,
    PromptTokens,
    Stops,
    Str,
    Tokens,
    outputs_of,
    read_fields,
)


@dataclass(frozen=True)
class _Speculative(Field):
    """``speculative``: prompt lookup, the worker's draft model, or off;
    None (not given): the worker's ``--speculate``."""

    nil_ok: bool = True

    def read(self, where: str, value: Any, ctx: Context) -> Speculation:
        if not isinstance(value, dict):
            raise BadRequest(f"{where} must be a map")
        mode = value.get("mode")
        if not isinstance(mode, str) or mode not in _SPECULATION:
            raise BadRequest(f"{where}.mode must be 'prompt_lookup', 'draft_model' or 'off'")
        got = read_fields(value, _SPECULATION[mode], ctx, f"{where}.", known="")
        return Speculation(**got)


@dataclass(frozen=True)
class _Utf8Tail(Field):
    """The bytes of a partial UTF-8 character (at most 3)."""

    default: bytes = b""

    def read(self, where: str, value: Any, ctx: Context) -> bytes:
        if not isinstance(value, bytes) or len(value) > 3:
            raise BadRequest(f"{where} must be at most 3 bytes (a partial UTF-8 character)")
        return value


@dataclass(frozen=True)
class _Strings(Field):
    """Non-empty strings (the stops a suspended stream had in force)."""

    default: tuple[str, ...] = ()

    def read(self, where: str, value: Any, ctx: Context) -> tuple[str, ...]:
        if not isinstance(value, list) or len(value) > 256:
            raise BadRequest(f"{where} must be a list of at most 256 strings")
        if not all(isinstance(s, str) and 0 < len(s) <= 4096 for s in value):
            raise BadRequest(f"{where} must hold non-empty strings of at most 4096 characters")
        return tuple(value)


@dataclass(frozen=True)
class _Resume(Field):
    """``resume``: where a stream suspended on another worker stood."""

    nil_ok: bool = True

    def read(self, where: str, value: Any, ctx: Context) -> Resume:
        if not isinstance(value, dict):
            raise BadRequest(f"{where} must be a map (a suspended event's resume)")
        got = read_fields(value, _RESUME, ctx, f"{where}.", known="resume")
        got["stop_tokens"] = tuple(got["stop_tokens"])
        return Resume(**got)


_COUNT = Int(0, lo=0, hi=1 << 31)
_RESUME: Final[dict[str, Field]] = {
    "completion_tokens": _COUNT,
    "prompt_tokens": _COUNT,
    "cached_tokens": _COUNT,
    "held": Str("", max_len=1 << 16),
    "utf8": _Utf8Tail(),
    "drafted": _COUNT,
    "accepted": _COUNT,
    "ephemeral": Bool(False),
    "stop": _Strings(),
    "stop_tokens": Tokens((), max_len=1024, allow_empty=True),
}

_MAX_DRAFT = Int(8, lo=1, hi=64)
_SPECULATION: Final[dict[str, dict[str, Field]]] = {
    "prompt_lookup": {"mode": Str(), "max_draft": _MAX_DRAFT, "ngram": Int(3, lo=1, hi=16)},
    "draft_model": {"mode": Str(), "max_draft": _MAX_DRAFT, "path": Str(default=None)},
    "off": {"mode": Str(), "max_draft": Int(0, lo=0, hi=0)},  # not even the worker's own
}

# What ``generate`` and ``chat`` may ask beside their prompt, in the order
# the fields are checked (the first wrong one is the error).
GENERATION: Final[dict[str, Field]] = {
    "prompt": PromptText(),
    "tokens": PromptTokens(),
    **OUTPUTS,
    "speculative": _Speculative(),
    "stop": Stops(),
    "max_tokens": Int(256, lo=1, most="max_new_tokens"),
    "stop_tokens": Tokens((), max_len=256, allow_empty=True),
    "sampling": Sampling(),
    "ignore_eos": Bool(False),
    "stream": Bool(True),
    "logprobs": Bool(False),
    "top_logprobs": Int(0, lo=0, hi=20),
    "resume": _Resume(),
    "media": MediaItems(),
}
# ``chat``: its tools and messages instead of a prompt, read in the same pass,
# and its ``media`` after them (a chat's image parts are read with its messages).
_PROMPTS = ("prompt", "tokens", "media")
CHAT: Final[dict[str, Field]] = {
    **{name: rule for name, rule in GENERATION.items() if name not in _PROMPTS},
    "tools": Tools(),
    "messages": Messages(),
    "media": MediaItems(),
}


def read_generation(app: App, req: Request) -> Generation:
    """What a ``generate`` or ``chat`` asks, read from the header in one pass
    over its op's table; first which prompt it gives, after the pass the
    rules that tie two fields together."""
    args = req.args
    chat = req.op == Op.CHAT
    has_prompt, has_tokens = "prompt" in args, "tokens" in args
    if chat:
        if has_prompt or has_tokens:
            raise BadRequest("chat takes messages, not prompt or tokens")
    elif "resume" in args:  # the session's pending tokens are the prompt
        if has_prompt or has_tokens or "media" in args or req.session is None:
            raise BadRequest("a generate with resume names its session and takes no prompt")
    elif "media" in args:
        projector_of(app)  # no projector: unsupported, whatever else is wrong
        if not has_prompt or has_tokens:
            raise BadRequest("generate with media takes a text prompt (with markers), not tokens")
    elif has_prompt == has_tokens:
        raise BadRequest("give exactly one of prompt or tokens")
    marker = app.projector.marker if app.projector is not None else ""
    got = read_fields(args, CHAT if chat else GENERATION, app.context.carrying(req.buffers, marker))
    outputs = outputs_of(args, got)
    if outputs and got["speculative"] is not None and got["speculative"].mode != "off":
        raise Unsupported("output with speculative decoding is not supported; ask one or the other")
    if not got["logprobs"] and "top_logprobs" in args:
        raise BadRequest("top_logprobs needs logprobs: true")
    messages, images = got["messages"] if chat else (None, ())
    if images and got["media"] is not None:
        raise BadRequest("give media with markers in the text, or image_url parts, not both")
    return Generation(
        session=req.session,
        max_tokens=got["max_tokens"],
        spec=got["sampling"],
        stop=got["stop"],
        stop_tokens=frozenset(got["stop_tokens"]),
        ignore_eos=got["ignore_eos"],
        stream=got["stream"],
        speculation=got["speculative"],
        top_logprobs=got["top_logprobs"] if got["logprobs"] else None,
        outputs=outputs,
        prompt=None if chat else (got["prompt"] if got["prompt"] is not None else got["tokens"]),
        resume=got["resume"],
        media=got["media"] or images,
        messages=messages,
        tools=got["tools"] if chat else None,
    )


def read_generate(app: App, req: Request) -> Generation:
    """``generate``: a text prompt or tokens; with ``media``, a text prompt
    holding one marker per item; with ``resume``, a stream moved here."""
    if app.draining and "resume" not in req.args:  # a moved stream may come back here
        raise ShuttingDown(
            "this process is shutting down and takes no new work; retry elsewhere or later",
            retry_after_ms=1000,
        )
    return read_generation(app, req)


def read_chat(app: App, req: Request) -> Generation:
    """``chat``: messages rendered by the chat template (with ``tools``: the
    template's tool support or a preamble, ``core/tools.py``); media as
    ``image_url`` parts, or as ``media`` with markers in the text."""
    return read_generation(app, req)


Reader = Callable[[App, Request], Generation]

# The ops whose header becomes a ``Generation``: the service builds their job.
GENERATIONS: dict[str, Reader] = {
    Op.GENERATE: read_generate,
    Op.CHAT: read_chat,
}
