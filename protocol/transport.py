"""A message's bytes: the header codec, and sending without blocking.

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
from typing import Any

import msgpack
import zmq

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
