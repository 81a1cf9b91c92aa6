"""The runtime's part of ``stats``, read from ``RuntimeState`` (a view only)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from .lanes import Ephemeral
from .state import RuntimeState


def runtime_stats(rt: RuntimeState) -> dict[str, Any]:
    """The runtime's part of ``stats``: lanes, sessions (parked ones too), the
    prefix cache and the park."""
    return {
        "lanes": {
            "total": rt.lanes.n_lanes,
            "active": rt.lanes.active,
            "idle": rt.lanes.free,
            # lanes a new session could get: idle, or an idle session's (parked)
            "room": rt.lanes_for([])[1],
            "moves": rt.moves,  # sessions moved to close a gap between a forward's lanes
        },
        "sessions": [
            {"lane": s.lane, "session": str(s.id), "position": s.position}
            | ({"ephemeral": True} if isinstance(s.id, Ephemeral) or s.ephemeral else {})
            for s in sorted(rt.lanes.sessions.values(), key=lambda s: s.lane)
        ]
        + [
            {"lane": None, "session": str(s.id), "position": s.position, "parked": True}
            for s in (rt.park.sessions() if rt.park is not None else ())
        ],
        "prefix_cache": {
            "lanes_cached": rt.lanes.cached,
            "limit": rt.lanes.cache_limit,
            **dataclasses.asdict(rt.prefix),
            "ram_bytes": rt.prompt_ram.nbytes if rt.prompt_ram is not None else 0,
            "ram_limit": rt.prompt_ram.limit if rt.prompt_ram is not None else 0,
            "ram_prompts": len(rt.prompt_ram.entries) if rt.prompt_ram is not None else 0,
        },
        "park": rt.park.stats() if rt.park is not None else None,
        "tokens_evaluated": rt.tokens_evaluated,
        "uptime_s": round(time.monotonic() - rt.started, 3),
    }
