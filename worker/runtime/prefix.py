"""Prefix-cache policy: the shortest prefix worth reusing, the counters,
and the host-memory tier behind the lanes.

``RuntimeState.admit_prompt`` reuses a cached lane's prefix: every shared
token but the last (the last is computed again for its logits). That is
exact: rows are batch-invariant (``engine.kernels``), so cells computed in
another prompt's pieces equal the ones a cold prefill would compute. Only
the sliding window can refuse a reuse (``window_holds``).

Idle lanes are few (a lane per running stream is not idle), so a prompt
that comes back after other prompts took its lane used to be prefilled
again. ``PromptRam`` keeps the cells of an evicted cached lane in host
memory instead (``llama_state_seq_get_data_ext`` with skiff's
``LLAMA_STATE_SEQ_FLAGS_ALL_CELLS``: every cell, those the sliding window
masks too, so the cells can be trimmed to any shorter prefix; ~18 KiB a
token for Gemma 3 270M), bounded by ``--prompt-ram-bytes``, least recently kept dropped first,
as llama-server's ``--cache-ram`` does for its slots. A prompt whose longest
shared prefix is there (and longer than any lane's) gets the cells loaded
into its new lane, then trimmed to the shared part: the cells come back byte
for byte, so the reuse is as exact as a lane's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from structlog import get_logger

from ..engine import Engine, EngineError
from .lanes import Session, SessionId

_log = get_logger("skiff.runtime")

# A cached prefix shorter than this is not worth giving up an empty lane for.
MIN_PREFIX_REUSE = 8
# A lane holding fewer tokens than this is not worth saving to host memory:
# loading its cells costs about what prefilling them would.
MIN_RAM_TOKENS = 64


@dataclass
class PrefixStats:
    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    evictions: int = 0
    refused_window: int = 0  # partial hits the sliding window no longer covered
    ram_kept: int = 0  # evicted lanes whose cells went to host memory
    ram_hits: int = 0  # prompts whose prefix came back from host memory (also in hits)


def _shared(held: np.ndarray, tokens: np.ndarray) -> int:
    """How many leading tokens two id arrays share."""
    n = min(len(held), len(tokens))
    differ = np.flatnonzero(held[:n] != tokens[:n])
    return int(differ[0]) if differ.size else n


class PromptRam:
    """Evicted prefix-cache lanes' cells in host memory, by their tokens.

    Token ids are kept as arrays: every prompt admitted compares its ids with
    every entry's (a few microseconds each, where a Python loop over a shared
    system prompt took milliseconds)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.entries: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()  # LRU first
        self.nbytes = 0
        self._next = 0

    def keep(self, tokens: Sequence[int] | np.ndarray, kv: np.ndarray) -> bool:
        """Keep ``kv`` (the cells of ``tokens``); entries it extends go, and the
        least recently kept past the limit. False when it alone is too large."""
        if kv.nbytes > self.limit:
            return False
        ids = np.asarray(tokens, dtype=np.int64)
        for key, (held, _) in list(self.entries.items()):
            if len(held) <= len(ids) and _shared(held, ids) == len(held):
                self._drop(key)  # a prefix of this one: nothing it could serve more of
        self.entries[self._next] = (ids, kv)
        self._next += 1
        self.nbytes += kv.nbytes
        while self.nbytes > self.limit:
            self._drop(next(iter(self.entries)))
        return True

    def best(self, tokens: Sequence[int], longest: int) -> tuple[int, int] | None:
        """(key, shared tokens) of the entry sharing the longest prefix with
        ``tokens`` (at most ``longest``); None when none shares any."""
        ids = np.asarray(tokens[:longest], dtype=np.int64)
        found: tuple[int, int] | None = None
        for key, (held, _) in self.entries.items():
            common = _shared(held, ids)
            if common and (found is None or common > found[1]):
                found = (key, common)
        return found

    def take(self, key: int) -> tuple[np.ndarray, np.ndarray]:
        """Entry ``key``'s token ids and cells, out of host memory."""
        ids, kv = self.entries.pop(key)
        self.nbytes -= kv.nbytes
        return ids, kv

    def _drop(self, key: int) -> None:
        self.take(key)


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


class RamHost(Protocol):
    """What the host-memory tier uses of ``RuntimeState`` (kept apart so this
    module and ``state`` do not import each other)."""

    engine: Engine
    prompt_ram: PromptRam | None
    prefix: PrefixStats

    def admit(self, session_ids: Sequence[SessionId], ephemeral: bool = False) -> list[Session]: ...

    def check_position(self, session: Session) -> None: ...


def keep_evicted(rt: RamHost, lane: int, held: list[int]) -> None:
    """An evicted cached lane's cells to host memory (before it is cleared)."""
    assert rt.prompt_ram is not None
    if len(held) < MIN_RAM_TOKENS:
        return
    try:
        rt.prefix.ram_kept += rt.prompt_ram.keep(held, rt.engine.state_get(lane, all_cells=True))
    except EngineError as exc:  # not kept: a later prompt prefills it again
        _log.warning("prompt_ram_save_failed", lane=lane, error=str(exc))


def admit_from_ram(
    rt: RamHost,
    session_id: SessionId,
    prompt: Sequence[int],
    ephemeral: bool,
    kept: tuple[int, int],
) -> tuple[Session, int]:
    """``admit_prompt`` with a prefix kept in host memory: a new lane, the
    cells loaded into it and trimmed to the shared part; (session, reused
    tokens), 0 when llama.cpp refused the cells (prefilled cold then). The
    entry is taken out first: the admission may itself send an evicted lane
    to host memory, which could push this entry out."""
    assert rt.prompt_ram is not None
    key, common = kept
    held, kv = rt.prompt_ram.take(key)
    try:
        (session,) = rt.admit([session_id], ephemeral)
    except BaseException:
        rt.prompt_ram.keep(held, kv)
        raise
    lane, engine = session.lane, rt.engine
    loaded = engine.state_set(lane, kv) and engine.pos_max(lane) + 1 == len(held)
    if not loaded:  # llama.cpp refused the cells (it returns 0, it does not raise)
        _log.warning("prompt_ram_load_failed", lane=lane, tokens=len(held))
    ok = loaded and window_holds(engine, lane, common) and engine.seq_rm(lane, common, -1)
    rt.prefix.ram_hits += ok
    return reused(rt, session, prompt, common, ok)


def reused(
    rt: RamHost, session: Session, prompt: Sequence[int], common: int, ok: bool
) -> tuple[Session, int]:
    """The end of a prefix reuse: with ``ok`` (the lane's cells trimmed to
    ``common``) the session goes on from there; else its lane is cleared and
    the prompt prefilled cold. (session, reused tokens)."""
    if not ok:
        rt.engine.seq_clear(session.lane)
        rt.prefix.misses += 1
        rt.check_position(session)
        return session, 0
    session.position = common
    session.tokens = list(prompt[:common])
    rt.check_position(session)
    rt.prefix.hits += 1
    rt.prefix.reused_tokens += common
    return session, common
