"""What a received tensor frame may hold, and what ``parse`` raises otherwise.

Two errors, two codes: ``FrameError`` is a malformed frame (``bad_request``);
``FrameLimitError`` is a well-formed one larger than this receiver takes
(``limit_exceeded``). Both name the offending field (``parts[1].dims``), so
a client is told exactly what to fix. ``FrameLimits`` is the receiver's
setting (the worker's ``--max-frame-parts`` / ``--max-frame-rank``); the
constants under it bound every field whatever the setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from faults import BadRequest, LimitExceeded

MAX_PARTS: Final = 64  # default limits of a received frame (``FrameLimits``)
MAX_RANK: Final = 8
RANK_CEILING: Final = 32  # numpy's smallest NPY_MAXDIMS: no limit may go past it
MAX_IDENTITY_CHARS: Final = 64
# Every wire integer stays below this, so offset + index * stride (what numpy
# computes in int64) cannot overflow even for a hostile header.
INT_LIMIT: Final = 1 << 62


class FrameError(BadRequest):
    """A frame is malformed; ``field`` names the offending field (e.g. ``parts[1].dims``).

    A subclass of ``BadRequest`` so the worker answers ``bad_request`` without
    special handling, while tests and logs can still see exactly what was wrong.
    """

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"frame.{field}: {why}")
        self.field = field


class FrameLimitError(LimitExceeded):
    """A well-formed frame holds more than the receiver's ``FrameLimits`` allow.

    ``limit_exceeded`` rather than ``bad_request``: the frame is valid, this
    receiver is configured not to take one that large. ``field`` names the
    field as ``FrameError`` does; ``limit`` names the ``FrameLimits`` field
    (``parts`` or ``rank``) so a server can name the setting behind it.
    """

    def __init__(self, field: str, why: str, limit: str) -> None:
        super().__init__(f"frame.{field}: {why}")
        self.field = field
        self.limit = limit


@dataclass(frozen=True)
class FrameLimits:
    """How much one received frame may hold, besides its bytes.

    Bytes are bounded by the message size (ZeroMQ's MAXMSGSIZE); these bound
    the header's lists, so what ``parse`` walks and builds per frame stays
    small whatever a peer sends. ``rank`` is at most ``RANK_CEILING``.
    """

    parts: int = MAX_PARTS
    rank: int = MAX_RANK


DEFAULT_LIMITS: Final = FrameLimits()
