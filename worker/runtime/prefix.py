"""Prefix-cache policy: the shortest prefix worth reusing, and the counters.

``RuntimeState.admit_prompt`` reuses a cached lane's prefix: every shared
token but the last (the last is computed again for its logits). That is
exact: rows are batch-invariant (``engine.kernels``), so cells computed in
another prompt's pieces equal the ones a cold prefill would compute. Only
the sliding window can refuse a reuse (``window_holds``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine import Engine

# A cached prefix shorter than this is not worth giving up an empty lane for.
MIN_PREFIX_REUSE = 8


@dataclass
class PrefixStats:
    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    evictions: int = 0
    refused_window: int = 0  # partial hits the sliding window no longer covered


def window_holds(engine: Engine, lane: int, common: int) -> bool:
    """Whether the lane still holds what decoding after ``common`` tokens needs.

    A sliding-window cache (without ``swa_full``) forgets cells older than
    the window, and a lane loaded from a saved state holds only the last
    window of them: keeping ``common`` tokens is only sound while the cells
    of the last ``n_swa`` positions before ``common`` are still there
    (llama-server's guard). A lane prefilled here with ``swa_full`` keeps
    every cell (``pos_min`` 0), so the check always passes.
    """
    n_swa = engine.n_swa
    if n_swa <= 0 or common == 0:
        return True
    return engine.pos_min(lane) <= max(0, common - n_swa)
