"""Limits on everything a peer controls: one frozen value, a flag each, one error.

A peer chooses sizes (tokens in a prompt, ``max_tokens``, stop strings, a
grammar, logit-bias entries, chat messages, a frame's parts and dims) and
grows counts by sending more (sessions it holds, generations it runs). Each
has a limit here with its default; ``worker/config.py`` turns every field
into a ``--flag`` with a ``SKIFF_*`` twin, so an operator exposing a worker to
untrusted peers can lower them and one behind a single trusted gateway can
raise them. Going over a limit is ``limit_exceeded`` and the message names the
field, the limit and the flag (``stop has 40 strings; the limit is 16
(--max-stops)``), so a client knows what to shrink and an operator which knob
it meets. Malformed input stays ``bad_request``; bytes stay
``payload_too_large`` (the edge's caps).

Per-peer counts are kept by the scheduler (it sees every job and its owner);
this module is pure data and imports nothing of the wire.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Final

from faults import LimitExceeded

# Fields whose 0 means "a lane's cells" (resolved once the lane size is known).
PER_LANE: Final = ("max_request_tokens", "max_new_tokens")
RANK_CEILING: Final = 32  # protocol.frame_limits.RANK_CEILING (numpy's smallest max rank)


@dataclass(frozen=True)
class Limits:
    """Every peer-controlled limit of an LLM worker, with its default.

    Per-peer defaults are generous on purpose: a gateway is ONE peer to a
    worker, so they must not cap a gateway in practice; they stop a single
    client from holding everything when clients connect directly.
    """

    max_request_tokens: int = 0  # tokens one prompt / prefill / verify / embed carries
    max_new_tokens: int = 0  # the largest ``max_tokens`` of a generation
    max_sessions_per_peer: int = 1024  # named sessions one peer holds (admitted or queued)
    max_streams_per_peer: int = 256  # generations (generate/chat) one peer has in flight
    max_stops: int = 16  # ``stop`` strings of a generation
    max_stop_chars: int = 256  # characters of one stop string
    max_grammar_bytes: int = 1 << 18  # UTF-8 bytes of a grammar or a serialized json_schema
    max_logit_bias: int = 256  # ``logit_bias`` entries of a sampling map
    max_messages: int = 4096  # ``messages`` of one chat request
    max_frame_parts: int = 64  # parts of one received tensor frame
    max_frame_rank: int = 8  # dims of one part of a received tensor frame

    def resolved(self, cells: int) -> Limits:
        """These limits with every 0 of ``PER_LANE`` replaced by a lane's ``cells``."""
        return dataclasses.replace(
            self, **{name: getattr(self, name) or cells for name in PER_LANE}
        )

    def as_dict(self) -> dict[str, int]:
        """Every limit by field name (``info`` reports them)."""
        return dataclasses.asdict(self)


FIELDS: Final = tuple(f.name for f in dataclasses.fields(Limits))

# The help text of each flag (``worker/config.py`` adds them to its options).
HELP: Final[dict[str, str]] = {
    "max_request_tokens": "tokens one prompt, prefill, verify or embed may carry "
    "(limit_exceeded); 0 = a lane's cells (beyond those: context_overflow)",
    "max_new_tokens": "largest max_tokens of a generate or chat; 0 = a lane's cells",
    "max_sessions_per_peer": "named sessions one peer may hold, admitted or queued "
    "(a gateway is one peer)",
    "max_streams_per_peer": "generate/chat requests one peer may have queued or running",
    "max_stops": "stop strings one generation may give",
    "max_stop_chars": "characters of one stop string",
    "max_grammar_bytes": "UTF-8 bytes of a sampling grammar or serialized json_schema",
    "max_logit_bias": "logit_bias entries of one sampling map",
    "max_messages": "messages of one chat request",
    "max_frame_parts": "parts of one received tensor frame",
    "max_frame_rank": f"dims of one part of a received tensor frame (at most {RANK_CEILING})",
}


def flag(name: str) -> str:
    """The command-line flag of a ``Limits`` field."""
    return "--" + name.replace("_", "-")


def exceeded(what: str, limit: int, name: str, retry_after_ms: int | None = None) -> LimitExceeded:
    """The error for going over ``Limits.<name>``: ``<what>; the limit is N (--flag)``.
    A quota that frees up by itself (per-peer counts) says when to retry."""
    return LimitExceeded(f"{what}; the limit is {limit} ({flag(name)})", retry_after_ms)


def check(count: int, limit: int, name: str, what: str) -> None:
    """Raise ``exceeded`` when ``count`` is over ``limit``; ``what`` is the
    message's start with ``{n}`` for the count (``stop has {n} strings``)."""
    if count > limit:
        raise exceeded(what.format(n=count), limit, name)


def invalid(limits: Limits) -> str | None:
    """Why a set of limits cannot be used (a startup error), or None."""
    for name in FIELDS:
        value = getattr(limits, name)
        if value < (0 if name in PER_LANE else 1):
            return f"{flag(name)} must be {'>= 0' if name in PER_LANE else 'positive'}"
    if limits.max_frame_rank > RANK_CEILING:
        return f"--max-frame-rank must be at most {RANK_CEILING}"
    return None


__all__ = ["FIELDS", "HELP", "PER_LANE", "Limits", "check", "exceeded", "flag", "invalid"]
