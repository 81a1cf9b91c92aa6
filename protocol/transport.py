"""Sending one message without blocking: the one copy every process uses.

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

import zmq

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
