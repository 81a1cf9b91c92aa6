"""Argument validation at the edge: bad input becomes ``bad_request``.

Each helper names the offending field in its message so a client can fix
its request without reading our source. A well-formed value over one of the
worker's ``Limits`` is ``limit_exceeded`` instead, naming the limit's flag
(``worker/limits.py``), so a client can tell "fix the request" from "this
worker is configured smaller". msgpack gives us plain Python values; note
that ``bool`` is an ``int`` subclass and must be refused where an integer is
expected. A value is checked for its type before anything else touches it
(a peer may send any nesting of maps and lists). ``sampling`` maps are
checked in ``validate_sampling.py``.

This module imports neither the engine nor llama.cpp.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from faults import BadRequest, ContextOverflow, LimitExceeded
from protocol import frame_limits, frames
from protocol.envelope import MAX_SESSION_CHARS

from ..limits import Limits, check, flag

_DEFAULT_LIMITS = Limits()


def shown(value: Any, limit: int = 64) -> str:
    """A peer's value as it may appear in an error message: repr, cut short."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def get_int(
    args: dict[str, Any],
    name: str,
    *,
    default: int | None = None,
    lo: int | None = None,
    hi: int | None = None,
) -> int:
    value = args.get(name, default)
    if value is None:
        raise BadRequest(f"{name} is required")
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer")
    if lo is not None and value < lo:
        raise BadRequest(f"{name} must be >= {lo}")
    if hi is not None and value > hi:
        raise BadRequest(f"{name} must be <= {hi}")
    return value


def get_float(args: dict[str, Any], name: str, *, default: float, lo: float, hi: float) -> float:
    value = args.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"{name} must be a number")
    value = float(value)
    if math.isnan(value) or not lo <= value <= hi:
        raise BadRequest(f"{name} must be within [{lo}, {hi}]")
    return value


def get_bool(args: dict[str, Any], name: str, default: bool) -> bool:
    value = args.get(name, default)
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be a boolean")
    return value


def get_str(args: dict[str, Any], name: str, *, max_len: int = 1 << 20) -> str:
    value = args.get(name)
    if not isinstance(value, str):
        raise BadRequest(f"{name} must be a string")
    if len(value) > max_len:
        raise BadRequest(f"{name} is longer than {max_len} characters")
    return value


def get_session(session: str | None) -> str:
    """The request's session, which this op requires (the edge checked its type)."""
    if session is None:
        raise BadRequest("session is required")
    return session


def check_session(value: Any, where: str = "session") -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_SESSION_CHARS:
        raise BadRequest(
            f"{where} must be a non-empty string of at most {MAX_SESSION_CHARS} characters"
        )
    return value


def check_token(value: Any, n_vocab: int, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{where} must be an integer token id")
    if not 0 <= value < n_vocab:
        raise BadRequest(f"{where} = {value} is outside the vocabulary [0, {n_vocab})")
    return value


def get_tokens(
    args: dict[str, Any], name: str, n_vocab: int, *, max_len: int, allow_empty: bool = False
) -> list[int]:
    value = args.get(name)
    if not isinstance(value, list):
        raise BadRequest(f"{name} must be a list of token ids")
    if not value and not allow_empty:
        raise BadRequest(f"{name} must not be empty")
    if len(value) > max_len:
        raise BadRequest(f"{name} has {len(value)} tokens; at most {max_len} are allowed")
    return [check_token(t, n_vocab, f"{name}[{i}]") for i, t in enumerate(value)]


def check_request_tokens(count: int, name: str, cells: int, most: int) -> None:
    """Tokens one request brings: over ``most`` (``--max-request-tokens``, when
    it is the tighter bound) is ``limit_exceeded``, over a lane's ``cells``
    ``context_overflow``."""
    if most < cells:
        check(count, most, "max_request_tokens", f"{name} has {{n}} tokens")
    if count > cells:
        raise ContextOverflow(
            f"{name} has {count} tokens; a session holds at most {cells} (context_overflow)"
        )


def get_prompt_tokens(
    args: dict[str, Any], name: str, n_vocab: int, cells: int, most: int | None = None
) -> list[int]:
    """Tokens bound for a session's KV cache, held to ``check_request_tokens``
    (``most`` defaults to ``cells``)."""
    value = args.get(name)
    if isinstance(value, list):
        check_request_tokens(len(value), name, cells, cells if most is None else most)
    return get_tokens(args, name, n_vocab, max_len=cells)


def get_stops(args: dict[str, Any], limits: Limits) -> list[str]:
    """``stop``: a list of non-empty strings, at most ``max_stops`` of at most
    ``max_stop_chars`` characters (each stop is matched against every text delta)."""
    stop = args.get("stop", [])
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a list of non-empty strings")
    check(len(stop), limits.max_stops, "max_stops", "stop has {n} strings")
    for i, s in enumerate(stop):
        check(len(s), limits.max_stop_chars, "max_stop_chars", f"stop[{i}] has {{n}} characters")
    return stop


def get_messages(
    args: dict[str, Any],
    max_chars: int,
    most: int = _DEFAULT_LIMITS.max_messages,
    parts: Callable[[list[Any], str], str] | None = None,
) -> list[dict[str, str]]:
    """Validate ``messages``: a non-empty list of ``{"role", "content"}`` strings,
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
        if parts is not None and isinstance(content, list):
            content = parts(content, f"messages[{i}].content")
        if not isinstance(content, str):
            kinds = "a string or a list of parts" if parts is not None else "a string"
            raise BadRequest(f"messages[{i}].content must be {kinds}")
        total += len(content)
        if total > max_chars:
            raise BadRequest(f"messages are longer than {max_chars} characters")
        out.append({"role": role, "content": content})
    return out


OUTPUT_NAMES = ("hidden", "logits")
# Rows of logits one reply may carry (each is n_vocab floats: 1 MiB here).
MAX_LOGIT_ROWS = 64


def get_outputs(args: dict[str, Any]) -> tuple[str, ...]:
    """``output``: which tensors a step returns (``return_logits`` = ["logits"])."""
    value = args.get("output")
    if value is None:
        return ("logits",) if get_bool(args, "return_logits", False) else ()
    if "return_logits" in args:
        raise BadRequest("give output or return_logits, not both")
    if (
        not isinstance(value, list)
        or not all(isinstance(v, str) for v in value)
        or len(set(value)) != len(value)
        or not set(value) <= set(OUTPUT_NAMES)
    ):
        raise BadRequest(f"output must be a list of distinct names from {list(OUTPUT_NAMES)}")
    return tuple(v for v in OUTPUT_NAMES if v in value)


def check_logit_rows(outputs: tuple[str, ...], rows: int) -> None:
    if "logits" in outputs and rows > MAX_LOGIT_ROWS:
        raise BadRequest(
            f"output logits for {rows} rows exceeds {MAX_LOGIT_ROWS} per reply "
            "(ask for hidden, or send fewer tokens)"
        )


_FRAME_FLAGS = {"parts": "max_frame_parts", "rank": "max_frame_rank"}


def get_frame(
    args: dict[str, Any], name: str, buffers: Sequence[Any], limits: Limits = _DEFAULT_LIMITS
) -> frames.Frame:
    """A tensor frame the request carries under ``name`` (fully validated),
    with at most ``max_frame_parts`` parts of at most ``max_frame_rank`` dims."""
    if name not in args:
        raise BadRequest(f"{name} is required (a tensor frame)")
    most = frame_limits.FrameLimits(parts=limits.max_frame_parts, rank=limits.max_frame_rank)
    try:
        return frames.parse(args[name], buffers, most)
    except frame_limits.FrameError as exc:
        # the message names the field as frame.<field>; name it where it was
        raise BadRequest(exc.message.replace("frame.", f"{name}.", 1)) from None
    except frame_limits.FrameLimitError as exc:
        # "input.parts: has 3 parts; the limit is 1 (--max-frame-parts)"
        where = exc.message.replace("frame.", f"{name}.", 1)
        raise LimitExceeded(f"{where} ({flag(_FRAME_FLAGS[exc.limit])})") from None
