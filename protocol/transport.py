"""The wire in one module: what a message says (the envelope) and its bytes
(the header codec, and sending without blocking).

One module because the two are one contract: every message a skiff process
sends or answers is built, encoded and sent here, so a reader finds the
contract and its bytes together, and one request's trip from the socket and
back enters one protocol module. Everything a peer needs to speak to a
skiff worker lives in this package; it imports nothing from ``worker/`` or
``edge/``, so gateways and clients can depend on it alone.

The envelope: the version, the op names, the header builders (``request``,
``ok_reply``, ``event_reply``, ``error_reply``) and ``fault_of``, the one
reader of an error reply. Error codes and their classes live in ``faults``
(below everything) and are re-exported here; ``error_reply`` writes one into
a reply and ``fault_of`` turns it back into its class.

A message is ``[header, *buffers]``: the header is one msgpack map, buffers
are raw bytes the header refers to by index. Only the header goes through
msgpack (``encode`` / ``decode``, with a size cap and a depth cap against a
hostile peer); buffers pass through untouched, so large tensors are never
copied in Python.

Sending is the one copy every process uses.
The worker's edge (replies to ROUTER peers), the gateway's relay (replies to
its clients) and every ``DealerPeer`` (``protocol/peer.py``: the gateway's
requests to workers, a stage's forwards to the next stage, the HTTP front's
requests) all send the same shape: an optional routing frame, the
encoded header, then buffers passed as they are (``copy=False``: tensors
and audio leave without a copy). None of them may block the loop that
sends, so a peer that cannot take a message is an answer, not a wait:
``send`` returns why (``NOT_RECEIVING`` when its queue is full or, with
``ZMQ_IMMEDIATE``, no connection is up; ``GONE`` when a ROUTER no longer
knows the peer; ``FAILED`` otherwise) and the caller decides what that
means for its peer. A multipart message is atomic in ZeroMQ: once its first
frame is queued the rest are, so a message is never cut in half.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Any

import msgpack
import zmq

from faults import ErrorCode, Fault, from_code

__all__ = [
    "DEFAULT_MAX_HEADER_BYTES",
    "FAILED",
    "GONE",
    "MAX_DEPTH",
    "MAX_SESSION_CHARS",
    "NOT_RECEIVING",
    "VERSION",
    "CodecError",
    "ErrorCode",
    "ForeignFault",
    "HeaderTooLarge",
    "Op",
    "TooDeep",
    "decode",
    "encode",
    "error_reply",
    "event_reply",
    "failed",
    "fault_of",
    "ok_reply",
    "request",
    "send",
    "wire_code",
]

# -- the envelope -----------------------------------------------------------------

VERSION = 1
MAX_SESSION_CHARS = 256  # a session id is a string of 1..256 characters


class Op(StrEnum):
    """Op names of the LLM worker (the speech worker shares the envelope)."""

    PING = "ping"
    INFO = "info"
    STATS = "stats"
    TOKENIZE = "tokenize"
    DETOKENIZE = "detokenize"
    PREFILL = "prefill"
    PREFILL_SAMPLED = "prefill_sampled"
    PREFILL_MEDIA = "prefill_media"
    DECODE = "decode"
    DECODE_BATCH = "decode_batch"
    ITERATION_BATCH = "iteration_batch"
    GENERATE = "generate"
    CHAT = "chat"
    CANCEL = "cancel"
    SUSPEND = "suspend"
    HANDOFF = "handoff"
    VERIFY = "verify"
    SIGNAL = "signal"
    SIGNAL_WINDOW = "signal_window"
    TRIM = "trim"
    ALIGN = "align"
    DROP = "drop"
    EMBED = "embed"
    EXPORT_STATE = "export_state"
    IMPORT_STATE = "import_state"
    ECHO = "echo"
    FORWARD_FRAME = "forward_frame"  # stage to stage
    SYNTHESIZE = "synthesize"  # the speech worker's


def request(
    req_id: int,
    op: str,
    session: str | None = None,
    args: dict[str, Any] | None = None,
    deadline_ms: int | None = None,
) -> dict[str, Any]:
    """Build a request header map."""
    header: dict[str, Any] = {"v": VERSION, "id": req_id, "op": op}
    if session is not None:
        header["session"] = session
    if args:
        header["args"] = args
    if deadline_ms is not None:
        header["deadline_ms"] = deadline_ms
    return header


def ok_reply(req_id: int | None, result: dict[str, Any]) -> dict[str, Any]:
    """A successful single reply."""
    return {"v": VERSION, "id": req_id, "ok": True, "result": result}


def event_reply(req_id: int, event: dict[str, Any]) -> dict[str, Any]:
    """One event of a streaming op; the last one carries ``done: true``."""
    return {"v": VERSION, "id": req_id, "ok": True, **event}


def error_reply(
    req_id: int | None,
    code: str,
    message: str,
    retry_after_ms: int | None = None,
) -> dict[str, Any]:
    """A failed reply. ``retry_after_ms`` hints when to retry (queue_full)."""
    error: dict[str, Any] = {"code": str(code), "message": message}
    if retry_after_ms is not None:
        error["retry_after_ms"] = retry_after_ms
    return {"v": VERSION, "id": req_id, "ok": False, "error": error}


class ForeignFault(Fault):
    """An error reply whose code this build does not know (a newer or foreign
    peer): ``internal`` to the code here, its own code kept in ``wire_code``
    so a client still sees it verbatim."""

    def __init__(self, wire_code: str, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message, retry_after_ms)
        self.wire_code = wire_code


def fault_of(header: dict[str, Any], prefix: str = "") -> Fault:
    """The typed fault an error reply carries: its code's class
    (``faults.from_code``), its message (after ``prefix``) and its retry hint.

    The one reader of an error reply: the clients (``SkiffError``), a stage's
    link to the next stage and the HTTP front's upstream all go through it,
    so a code means the same class everywhere."""
    error = header.get("error")
    if not isinstance(error, dict):
        error = {}
    code = str(error.get("code", ErrorCode.INTERNAL.value))
    message = f"{prefix}{error.get('message', '')}"
    retry = error.get("retry_after_ms")
    retry_ms = retry if type(retry) is int else None
    cls = from_code(code)
    if cls is Fault:
        return ForeignFault(code, message, retry_ms)
    return cls(message, retry_ms)


def wire_code(fault: Fault) -> str:
    """The code ``fault`` travels under: its class's, or a foreign one verbatim."""
    return fault.wire_code if isinstance(fault, ForeignFault) else fault.code.value


# -- the header codec ------------------------------------------------------------

# Default cap on one header frame. Token lists live in the header, so this
# also bounds the largest prompt a peer can send (~800k tokens at 5 B each).
DEFAULT_MAX_HEADER_BYTES = 4 * 1024 * 1024

# Deepest nesting of maps and lists a header may have. Real headers nest 5
# or 6 levels (header > args > sampling > json_schema > ...); a bound keeps
# recursive code anywhere downstream (repr, json, grammar converters) safe.
MAX_DEPTH = 32


class CodecError(ValueError):
    """The header frame is not a msgpack map we can read."""


class HeaderTooLarge(CodecError):
    """The header frame is larger than the receiver allows."""


class TooDeep(CodecError):
    """Maps and lists nest deeper than ``MAX_DEPTH``.

    ``req_id`` is the header's own integer ``id`` when it has one, so the
    refusal can still be matched to its request.
    """

    def __init__(self, message: str, req_id: int | None) -> None:
        super().__init__(message)
        self.req_id = req_id


def encode(header: dict[str, Any]) -> bytes:
    """Pack one header map."""
    packed: bytes = msgpack.packb(header, use_bin_type=True)
    return packed


def decode(
    raw: bytes | memoryview, max_bytes: int = DEFAULT_MAX_HEADER_BYTES, max_depth: int = MAX_DEPTH
) -> dict[str, Any]:
    """Unpack one header map, refusing anything that is not a map.

    Raises ``HeaderTooLarge`` before parsing when the frame is over
    ``max_bytes`` so a hostile peer cannot make us build huge objects, and
    ``TooDeep`` when containers nest deeper than ``max_depth``.
    """
    if len(raw) > max_bytes:
        raise HeaderTooLarge(f"header is {len(raw)} bytes; the limit is {max_bytes}")
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as exc:
        raise CodecError(f"header is not valid msgpack: {exc}") from exc
    except Exception as exc:  # msgpack raises a few odd types on garbage
        raise CodecError(f"header is not valid msgpack: {type(exc).__name__}") from exc
    if not isinstance(obj, dict):
        raise CodecError(f"header must be a map, got {type(obj).__name__}")
    if _deeper_than(obj, max_depth):
        raw_id = obj.get("id")
        req_id = raw_id if type(raw_id) is int else None
        raise TooDeep(f"header nests maps and lists deeper than {max_depth} levels", req_id)
    return obj


def _deeper_than(obj: Any, limit: int) -> bool:
    """True when containers nest past ``limit`` (iterative: no recursion to exhaust).

    Only containers are pushed; a long flat list (a prompt's tokens) costs
    one C-level scan per list.
    """
    stack: list[tuple[Any, int]] = [(obj, 1)]
    containers = (dict, list)
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        nested = [c for c in children if isinstance(c, containers)]
        if nested:
            if depth >= limit:
                return True
            stack.extend((c, depth + 1) for c in nested)
    return False


# -- sending ---------------------------------------------------------------------

NOT_RECEIVING = "peer_not_receiving"
GONE = "peer_gone"
FAILED = "send_failed"

# Plain ints: combining zmq's enum flags per frame costs a microsecond or two.
_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)


def send(
    sock: zmq.Socket[Any], payload: bytes, buffers: Sequence[Any] = (), route: bytes | None = None
) -> str | None:
    """``[route?, payload, *buffers]`` without blocking; None once queued,
    otherwise why it was not (nothing of the message was sent then)."""
    try:
        if route is not None:
            sock.send(route, _MORE)
        if not buffers:
            sock.send(payload, _NOBLOCK)
            return None
        sock.send(payload, _MORE)
        for buf in buffers[:-1]:
            sock.send(buf, _MORE, copy=False)
        sock.send(buffers[-1], _NOBLOCK, copy=False)
        return None
    except zmq.Again:
        return NOT_RECEIVING
    except zmq.ZMQError as exc:
        return GONE if exc.errno == zmq.EHOSTUNREACH else f"{FAILED}: {exc}"


def failed(reason: str | None) -> bool:
    """A reason other than the peer's own state: worth an error log."""
    return reason is not None and reason.startswith(FAILED)
