"""Parked sessions: lanes are a cache over sessions (and a session's cells
moved from one lane to another, ``move_cells``).

A worker has a fixed number of lanes (KV sequences), but a chat service
holds far more open conversations than it decodes at once. When a session
needs a lane and none is free, ``RuntimeState`` parks the least recently
used idle session: its KV cells are saved (``llama_state_seq_get_data``)
into host memory here, with its ``Session`` object as it stands (tokens,
position, pending token, sampler chain, signals), and its lane is reused.
When the session is next named it is restored into a free lane before its
request runs. Both steps are exact: the cells come back byte for byte and
every row is computed as if alone (``engine.kernels``), so the continuation
equals the one that never parked, to the bit.

Memory is bounded by ``limit`` bytes (``--park-bytes``). Past it, the least
recently parked states go to ``directory`` (``--park-dir``) when there is
one, and are otherwise forgotten: such a session is *evicted*, and naming
it again answers ``session_not_active`` saying so (never a wrong
continuation). The evicted ids are remembered (boundedly) for that message.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from faults import EngineFault

from ..engine import Engine
from .lanes import LanePool, Session, SessionId

_EVICTED_MEMORY = 1 << 16  # evicted ids remembered for the error message


@dataclass
class Parked:
    """One parked session: its state in memory (``kv``) or on disk (``path``)."""

    session: Session
    nbytes: int
    kv: np.ndarray | None = None
    path: Path | None = None


class Park:
    """Saved sessions by id, least recently parked first."""

    def __init__(self, limit: int, directory: str | os.PathLike[str] | None = None) -> None:
        self.limit = limit
        self.directory = Path(directory) if directory else None
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        self._entries: OrderedDict[SessionId, Parked] = OrderedDict()
        self._evicted: OrderedDict[SessionId, None] = OrderedDict()
        self.memory_bytes = 0
        self.disk_bytes = 0
        self.parks = 0
        self.restores = 0
        self.evictions = 0
        self.spills = 0  # states moved from memory to disk
        self.restore_s = 0.0  # total time restores took (read + llama.cpp load)
        self.last_restore_ms = 0.0

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, session_id: SessionId) -> Session | None:
        """The parked session (its tokens, position, sampler), without restoring it."""
        entry = self._entries.get(session_id)
        return entry.session if entry is not None else None

    def sessions(self) -> list[Session]:
        return [entry.session for entry in self._entries.values()]

    def was_evicted(self, session_id: SessionId) -> bool:
        return session_id in self._evicted

    def forget_eviction(self, session_id: SessionId) -> bool:
        """Free an evicted session's name (it was dropped); True if it was evicted."""
        if session_id not in self._evicted:
            return False
        del self._evicted[session_id]
        return True

    def fits(self, nbytes: int) -> bool:
        """Whether a state of ``nbytes`` can be parked at all (memory or disk)."""
        return self.directory is not None or nbytes <= self.limit

    def put(
        self, session: Session, kv: np.ndarray, keep: frozenset[SessionId] = frozenset()
    ) -> None:
        """Park ``session`` (its lane already given back) with its cells ``kv``;
        room is made by spilling or evicting others than ``keep`` (the
        sessions being restored right now)."""
        self._evicted.pop(session.id, None)
        entry = Parked(session, int(kv.nbytes), kv=kv)
        self._entries[session.id] = entry
        self.memory_bytes += entry.nbytes
        self.parks += 1
        self._make_room(keep)

    def take(self, session_id: SessionId) -> tuple[Session, np.ndarray]:
        """Remove a parked session and return it with its cells (read back from
        disk if it was spilled). ``KeyError`` when it is not parked."""
        entry = self._entries.pop(session_id)
        if entry.kv is not None:
            self.memory_bytes -= entry.nbytes
            return entry.session, entry.kv
        assert entry.path is not None
        try:
            kv = np.fromfile(entry.path, dtype=np.uint8)
        finally:
            self._unlink(entry)
        return entry.session, kv

    def peek(self, session_id: SessionId) -> tuple[Session, np.ndarray]:
        """A parked session and its cells, left parked (an export reads them)."""
        entry = self._entries[session_id]
        if entry.kv is not None:
            return entry.session, entry.kv
        assert entry.path is not None
        return entry.session, np.fromfile(entry.path, dtype=np.uint8)

    def restored(self, seconds: float) -> None:
        """Count one restore that took ``seconds`` (read and llama.cpp load)."""
        self.restores += 1
        self.restore_s += seconds
        self.last_restore_ms = seconds * 1000.0

    def drop(self, session_id: SessionId) -> Session | None:
        """Forget a parked session (it was dropped or expired); None if not parked."""
        entry = self._entries.pop(session_id, None)
        if entry is None:
            return None
        if entry.kv is not None:
            self.memory_bytes -= entry.nbytes
        else:
            self._unlink(entry)
        return entry.session

    def _make_room(self, keep: frozenset[SessionId]) -> None:
        """Spill (or evict) the least recently parked states until memory fits."""
        for session_id in list(self._entries):
            if self.memory_bytes <= self.limit:
                return
            entry = self._entries[session_id]
            if entry.kv is None or session_id in keep:
                continue  # already on disk, or about to leave
            if self.directory is not None:
                self._spill(entry)
                continue
            del self._entries[session_id]
            self.memory_bytes -= entry.nbytes
            self.evictions += 1
            self._evicted[session_id] = None
            while len(self._evicted) > _EVICTED_MEMORY:
                self._evicted.popitem(last=False)

    def _spill(self, entry: Parked) -> None:
        assert self.directory is not None and entry.kv is not None
        name = hashlib.sha256(repr(entry.session.id).encode()).hexdigest()[:32]
        path = self.directory / f"{name}.kv"
        entry.kv.tofile(path)
        entry.path, entry.kv = path, None
        self.memory_bytes -= entry.nbytes
        self.disk_bytes += entry.nbytes
        self.spills += 1

    def _unlink(self, entry: Parked) -> None:
        if entry.path is not None:
            entry.path.unlink(missing_ok=True)
            self.disk_bytes -= entry.nbytes
            entry.path = None

    def close(self) -> None:
        """Remove every spilled file (the worker is going away)."""
        for entry in self._entries.values():
            self._unlink(entry)
        self._entries.clear()

    def stats(self) -> dict[str, Any]:
        return {
            "sessions": len(self._entries),
            "bytes": self.memory_bytes,
            "disk_bytes": self.disk_bytes,
            "limit_bytes": self.limit,
            "parks": self.parks,
            "restores": self.restores,
            "spills": self.spills,
            "evictions": self.evictions,
            "restore_ms_total": round(self.restore_s * 1000.0, 3),
            "last_restore_ms": round(self.last_restore_ms, 3),
        }


class ParkHost(Protocol):
    """What parking uses of ``RuntimeState`` (kept apart so this module and
    ``state`` do not import each other)."""

    engine: Engine
    lanes: LanePool
    park: Park | None
    pinned: Callable[[SessionId], bool]

    def check_position(self, session: Session) -> None: ...


def parkable(rt: ParkHost, ids: list[SessionId]) -> list[Session]:
    """Sessions in lanes that could be parked to make room for ``ids``: named
    by a peer (a string: what no peer can name again is not worth keeping;
    ``RuntimeState`` relies on it and looks for no other id here), not
    ephemeral, not among ``ids``, not held by a running job; LRU first."""
    wanted = set(ids)
    idle = [
        s
        for s in rt.lanes.sessions.values()
        if isinstance(s.id, str) and not s.ephemeral and s.id not in wanted and not rt.pinned(s.id)
    ]
    return sorted(idle, key=lambda s: s.last_used)


def make_room(rt: ParkHost, ids: list[SessionId]) -> None:
    """Park least recently used idle sessions until ``ids`` fit the free
    lanes (which count the prefix cache's: those are lost first, being
    cheaper); park nothing when even that would not make them fit."""
    park = rt.park
    assert park is not None
    need = len(rt.lanes.missing(ids)) - rt.lanes.free
    if need <= 0:
        return
    idle = parkable(rt, ids)
    if len(idle) < need:
        return  # lanes.admit refuses: lanes_busy, as without a park
    for session in idle[:need]:
        rt.check_position(session)
        kv = rt.engine.state_get(session.lane)
        if not park.fits(kv.nbytes):
            return  # a state larger than the whole park: lanes_busy
        rt.engine.seq_clear(session.lane)
        rt.lanes.release(session.id)
        session.lane = -1
        park.put(session, kv, keep=frozenset(ids))


def move_cells(engine: Engine, session: Session, src: int) -> bool:
    """Copy a session's cells from lane ``src`` into its new, empty lane,
    all of them (a trim reaches as far back as before) and byte for byte
    (the continuation is the one that stayed, to the bit), then clear
    ``src``. False, with the new lane cleared and ``src`` intact, when
    llama.cpp refuses."""
    if session.position:
        kv = engine.state_get(src, all_cells=True)
        if not engine.state_set(session.lane, kv) or (
            engine.pos_max(session.lane) + 1 != session.position
        ):
            engine.seq_clear(session.lane)
            return False
    engine.seq_clear(src)
    return True


def restore(rt: ParkHost, placeholder: Session) -> Session:
    """Load a parked session's cells into the lane ``placeholder`` took for
    it, and put the session (tokens, sampler and all) back in its place."""
    park = rt.park
    assert park is not None
    started = time.perf_counter()
    lane = placeholder.lane
    session, kv = park.take(placeholder.id)
    session.lane = lane
    rt.lanes.sessions[session.id] = session
    if not rt.engine.state_set(lane, kv) or rt.engine.pos_max(lane) + 1 != session.position:
        rt.engine.seq_clear(lane)
        rt.lanes.release(session.id)
        if session.sampler is not None:
            session.sampler.free()
        raise EngineFault(f"llama.cpp could not restore parked session {str(session.id)!r}", {})
    session.last_used = time.monotonic()
    park.restored(time.perf_counter() - started)
    return session
