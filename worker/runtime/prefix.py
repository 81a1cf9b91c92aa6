"""Prefix-cache policy: the reuse modes, the grid rule, the counters.

``RuntimeState.admit_prompt`` reuses a cached lane's prefix; what it may keep
is decided by these pieces: the shortest prefix worth an empty lane, the
reuse modes (``exact`` keeps only whole grid pieces, ``any`` keeps every
shared token), where a prompt's final grid piece starts (``jobs`` prefills
on the same grid), and the hit / miss counters ``stats`` reports. Kept
apart from ``state.py`` so the policy reads on its own and ``jobs`` can use
the grid rule without reaching into the runtime's state module.
"""

from __future__ import annotations

from dataclasses import dataclass

# A cached prefix shorter than this is not worth giving up an empty lane for.
MIN_PREFIX_REUSE = 8
REUSE_MODES = ("exact", "any")


def grid_split(total: int, chunk: int) -> int:
    """Where the final (whole) prefill piece of a ``total``-token prompt starts."""
    return ((total - 1) // chunk) * chunk


@dataclass
class PrefixStats:
    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    evictions: int = 0
    refused_window: int = 0  # partial hits the sliding window no longer covered
