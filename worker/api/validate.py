"""Argument validation at the edge: bad input becomes ``bad_request``.

Each rule names the offending field in its message, so a client can fix its
request without reading our source. A well-formed value over one of the
worker's ``Limits`` is ``limit_exceeded`` instead, naming the limit's flag,
so a client can tell "fix the request" from "this worker is configured
smaller"; a kind compares a value with its limit in the same pass
(``worker/limits.py`` is entered only to word the error). msgpack gives
plain Python values, and ``bool`` is an ``int`` subclass that must be
refused where an integer is expected; a value's type is checked before
anything else touches it (a peer may send any nesting of maps and lists).
Fields are declared as kinds (``Int``, ``Str``, ``Tokens``, ...) in a table
that ``read_fields`` reads in one pass; ``sampling`` maps have theirs in
``sampling.py``. This module imports neither the engine nor llama.cpp.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

from faults import BadRequest, ContextOverflow, LimitExceeded
from protocol import frame_limits, frames
from protocol.transport import MAX_SESSION_CHARS

from ..limits import Limits, exceeded, flag
from ..spec import GrammarChecker

_DEFAULT_LIMITS = Limits()


def shown(value: Any, limit: int = 64) -> str:
    """A peer's value as it may appear in an error message: repr, cut short."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Field:
    """One field's rule in a request's table: its type, range and limit.

    ``read_fields`` walks a table once: an absent field (or a ``nil`` one,
    where ``nil_ok``) takes ``default`` (``REQUIRED``: ``bad_request``, as
    ``missing`` words it); a present one is ``read(where, value, ctx)``,
    where ``where`` names it as the client wrote it (``sampling.top_k``) and
    ``ctx`` carries what a rule needs of the worker (its limits, vocabulary,
    grammar checker) and of the request (its buffers).
    """

    default: Any = None
    nil_ok: bool = False
    missing: str = "is required"  # what an absent ``REQUIRED`` field is told

    def read(self, where: str, value: Any, ctx: Context) -> Any:
        raise NotImplementedError


REQUIRED: Any = object()


@dataclass(frozen=True)
class Context:
    """What the rules of a table need of the worker, and of the request
    beyond its header: the buffers a media item names by index, and the
    projector's marker an image part of a chat message becomes."""

    limits: Limits = _DEFAULT_LIMITS
    n_vocab: int = 1 << 31
    grammars: GrammarChecker | None = None
    cells: int = 1 << 31  # of one lane: what a session can hold
    buffers: Sequence[memoryview] = ()  # the request's extra buffers
    marker: str = ""  # the projector's media marker ("": no projector)

    def carrying(self, buffers: Sequence[memoryview], marker: str) -> Context:
        """This context for one request: its buffers and the projector's marker
        (itself when the request brings neither and the marker is unchanged)."""
        if not buffers and marker == self.marker:
            return self
        return dataclasses.replace(self, buffers=buffers, marker=marker)


NO_CONTEXT = Context()


@dataclass(frozen=True)
class Int(Field):
    """An integer (never a bool) in ``[lo, hi]``; ``most``: the ``Limits``
    field it is held to (over it is ``limit_exceeded``)."""

    default: int | None = REQUIRED
    lo: int | None = None
    hi: int | None = None
    most: str | None = None

    def read(self, where: str, value: Any, ctx: Context) -> int:
        if value is None:
            raise BadRequest(f"{where} is required")
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadRequest(f"{where} must be an integer")
        if self.lo is not None and value < self.lo:
            raise BadRequest(f"{where} must be >= {self.lo}")
        if self.hi is not None and value > self.hi:
            raise BadRequest(f"{where} must be <= {self.hi}")
        if self.most is not None and value > (most := getattr(ctx.limits, self.most)):
            raise exceeded(f"{where} is {value}", most, self.most)
        return value


@dataclass(frozen=True)
class Num(Field):
    """A finite number in ``[lo, hi]``, as a float."""

    default: float = 0.0
    lo: float = -math.inf
    hi: float = math.inf

    def read(self, where: str, value: Any, ctx: Context) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise BadRequest(f"{where} must be a number")
        number = float(value)
        if math.isnan(number) or not self.lo <= number <= self.hi:
            raise BadRequest(f"{where} must be within [{self.lo}, {self.hi}]")
        return number


@dataclass(frozen=True)
class Bool(Field):
    default: bool | None = False
    nil_ok: bool = False  # True: nil takes the default (``add_special``: None = BOS when fresh)

    def read(self, where: str, value: Any, ctx: Context) -> bool:
        if not isinstance(value, bool):
            raise BadRequest(f"{where} must be a boolean")
        return value


@dataclass(frozen=True)
class Str(Field):
    default: str | None = REQUIRED
    max_len: int = 1 << 20

    def read(self, where: str, value: Any, ctx: Context) -> str:
        if not isinstance(value, str):
            raise BadRequest(f"{where} must be a string")
        if len(value) > self.max_len:
            raise BadRequest(f"{where} is longer than {self.max_len} characters")
        return value


@dataclass(frozen=True)
class Tokens(Field):
    """A list of token ids of the model's vocabulary."""

    default: tuple[int, ...] | None = REQUIRED
    max_len: int = 1 << 20
    allow_empty: bool = False

    def read(self, where: str, value: Any, ctx: Context) -> list[int]:
        if not isinstance(value, list):
            raise BadRequest(f"{where} must be a list of token ids")
        if not value and not self.allow_empty:
            raise BadRequest(f"{where} must not be empty")
        if len(value) > self.max_len:
            raise BadRequest(f"{where} has {len(value)} tokens; at most {self.max_len} are allowed")
        return [check_token(t, ctx.n_vocab, f"{where}[{i}]") for i, t in enumerate(value)]


@dataclass(frozen=True)
class Stops(Field):
    """``stop``: non-empty strings, at most ``max_stops`` of at most
    ``max_stop_chars`` characters (each is matched against every text delta)."""

    default: tuple[str, ...] = ()

    def read(self, where: str, value: Any, ctx: Context) -> tuple[str, ...]:
        if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
            raise BadRequest(f"{where} must be a list of non-empty strings")
        limits = ctx.limits
        if len(value) > limits.max_stops:
            raise exceeded(f"{where} has {len(value)} strings", limits.max_stops, "max_stops")
        for i, s in enumerate(value):
            if len(s) > limits.max_stop_chars:
                what = f"{where}[{i}] has {len(s)} characters"
                raise exceeded(what, limits.max_stop_chars, "max_stop_chars")
        return tuple(value)


@dataclass(frozen=True)
class PromptText(Field):
    """A text prompt. One so long that no tokenization could fit a lane is
    ``context_overflow`` (its tokens are held to ``--max-request-tokens``
    when its job tokenizes it)."""

    default: str | None = None

    def read(self, where: str, value: Any, ctx: Context) -> str:
        if not isinstance(value, str):
            raise BadRequest(f"{where} must be a string")
        if len(value) > ctx.cells * 64:
            raise ContextOverflow(
                f"{where} has {len(value)} characters; no tokenization of that fits "
                f"{ctx.cells} cells"
            )
        return value


@dataclass(frozen=True)
class PromptTokens(Field):
    """Tokens bound for a session's KV cache: over ``--max-request-tokens``
    (when the tighter bound) is ``limit_exceeded``, over a lane's cells
    ``context_overflow``."""

    default: list[int] | None = None

    def read(self, where: str, value: Any, ctx: Context) -> list[int]:
        if isinstance(value, list):
            check_request_tokens(len(value), where, ctx.cells, ctx.limits.max_request_tokens)
        tokens: list[int] = Tokens(max_len=ctx.cells).read(where, value, ctx)
        return tokens


OUTPUT_NAMES = ("hidden", "logits")


@dataclass(frozen=True)
class Outputs(Field):
    """``output``: which tensors a step returns, distinct names of ``OUTPUT_NAMES``."""

    default: tuple[str, ...] | None = None
    nil_ok: bool = True

    def read(self, where: str, value: Any, ctx: Context) -> tuple[str, ...]:
        if (
            not isinstance(value, list)
            or not all(isinstance(v, str) for v in value)
            or len(set(value)) != len(value)
            or not set(value) <= set(OUTPUT_NAMES)
        ):
            raise BadRequest(f"{where} must be a list of distinct names from {list(OUTPUT_NAMES)}")
        return tuple(v for v in OUTPUT_NAMES if v in value)


def read_fields(
    raw: dict[str, Any],
    table: Mapping[str, Field],
    ctx: Context = NO_CONTEXT,
    prefix: str = "",
    known: str | None = None,
) -> dict[str, Any]:
    """Every field of ``table`` read from ``raw`` in one pass, by name.

    With ``known`` (a noun: "sampling"), a key the table lacks is
    ``bad_request`` ("sampling.x is not a known sampling field"), checked
    before any value; without it, other keys are left to the caller.
    """
    if known is not None:
        unknown = sorted(str(k) for k in raw if k not in table)
        if unknown:
            noun = f"{known} " if known else ""
            raise BadRequest(f"{prefix}{unknown[0][:64]} is not a known {noun}field")
    out: dict[str, Any] = {}
    for name, rule in table.items():
        value = raw.get(name)
        if value is None and (rule.nil_ok or name not in raw):
            if rule.default is REQUIRED:
                raise BadRequest(f"{prefix}{name} {rule.missing}")
            out[name] = rule.default
        else:
            out[name] = rule.read(prefix + name, value, ctx)
    return out


def _one(args: dict[str, Any], name: str, rule: Field) -> Any:
    return read_fields(args, {name: rule})[name]


def get_int(
    args: dict[str, Any],
    name: str,
    *,
    default: int | None = REQUIRED,
    lo: int | None = None,
    hi: int | None = None,
) -> int:
    """One integer field (a table of one ``Int``)."""
    return cast(int, _one(args, name, Int(default, lo, hi)))


def get_bool(args: dict[str, Any], name: str, default: bool) -> bool:
    return cast(bool, _one(args, name, Bool(default)))


def get_str(args: dict[str, Any], name: str, *, max_len: int = 1 << 20) -> str:
    return cast(str, _one(args, name, Str(max_len=max_len)))


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


def check_request_tokens(count: int, name: str, cells: int, most: int) -> None:
    """Tokens one request brings: over ``most`` (``--max-request-tokens``, when
    it is the tighter bound) is ``limit_exceeded``, over a lane's ``cells``
    ``context_overflow``."""
    if most < cells and count > most:
        raise exceeded(f"{name} has {count} tokens", most, "max_request_tokens")
    if count > cells:
        raise ContextOverflow(
            f"{name} has {count} tokens; a session holds at most {cells} (context_overflow)"
        )


def get_prompt_tokens(
    args: dict[str, Any], name: str, n_vocab: int, cells: int, most: int | None = None
) -> list[int]:
    """``args[name]`` read as ``PromptTokens`` (``most`` defaults to ``cells``)."""
    limits = dataclasses.replace(
        _DEFAULT_LIMITS, max_request_tokens=cells if most is None else most
    )
    ctx = Context(limits=limits, n_vocab=n_vocab, cells=cells)
    return cast(list[int], read_fields(args, {name: PromptTokens(REQUIRED)}, ctx)[name])


# Rows of logits one reply may carry (each is n_vocab floats: 1 MiB here).
MAX_LOGIT_ROWS = 64


def get_tokens(
    args: dict[str, Any], name: str, n_vocab: int, *, max_len: int, allow_empty: bool = False
) -> list[int]:
    rule = Tokens(max_len=max_len, allow_empty=allow_empty)
    return cast(list[int], read_fields(args, {name: rule}, Context(n_vocab=n_vocab))[name])


def get_outputs(args: dict[str, Any]) -> tuple[str, ...]:
    """``output``: which tensors a step returns (``return_logits`` = ["logits"])."""
    return outputs_of(args, read_fields(args, OUTPUTS))


OUTPUTS: Final[Mapping[str, Field]] = {"output": Outputs(), "return_logits": Bool(False)}


def outputs_of(args: dict[str, Any], read: dict[str, Any]) -> tuple[str, ...]:
    """The outputs a request asks, from its read ``output`` and ``return_logits``."""
    if read["output"] is None:
        return ("logits",) if read["return_logits"] else ()
    if "return_logits" in args:
        raise BadRequest("give output or return_logits, not both")
    return cast(tuple[str, ...], read["output"])


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
