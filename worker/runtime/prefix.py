"""Prefix-cache policy: the shortest prefix worth reusing, and the counters.

``RuntimeState.admit_prompt`` reuses a cached lane's prefix: every shared
token but the last (the last is computed again for its logits). That is
exact: rows are batch-invariant (``engine.kernels``), so cells computed in
another prompt's pieces equal the ones a cold prefill would compute. Only
the sliding window can refuse a reuse (``RuntimeState.window_holds``).
"""

from __future__ import annotations

from dataclasses import dataclass

# A cached prefix shorter than this is not worth giving up an empty lane for.
MIN_PREFIX_REUSE = 8


@dataclass
class PrefixStats:
    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    evictions: int = 0
    refused_window: int = 0  # partial hits the sliding window no longer covered
