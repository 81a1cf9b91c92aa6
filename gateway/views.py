"""What the gateway answers itself: ``info``, ``stats``, ``gateway_status``.

``info`` and ``stats`` keep the shapes a worker gives, so a client written
for one worker (the load test, the HTTP front) works through the gateway
unchanged: ``info`` is an LLM worker's own (cached when it came up) plus a
``gateway`` section; ``stats`` sums the workers' lanes, running and queued
and lists every worker's sessions with a ``worker`` key. Both are answered
from what the health loop last saw, without a round trip.
"""

from __future__ import annotations

import time
from typing import Any

from edge import process as process_stats
from faults import WorkerUnavailable

from .host import Host
from .ops import sees
from .pool import LLM, SPEECH, WorkerConn

GATEWAY_OPS = ("gateway_status", "gateway_drain")


def gateway_info(svc: Host) -> dict[str, Any]:
    llm = svc.pool.of_kind(LLM)
    source = next((w for w in llm if w.up and w.info), None) or next(
        (w for w in llm if w.info), None
    )
    if source is None or source.info is None:
        raise WorkerUnavailable("no LLM worker has answered yet")
    out = dict(source.info)
    ops = set(out.get("ops") or ()) | set(GATEWAY_OPS)
    speech = svc.pool.of_kind(SPEECH)
    if speech:
        ops.add("synthesize")
    out["ops"] = sorted(ops)
    out["gateway"] = {
        "policy": svc.router.policy,
        "workers": [w.name for w in llm],
        "workers_up": sum(w.up for w in llm),
        "speech": [w.name for w in speech],
        "speech_up": sum(w.up for w in speech),
        "models": [_model_of(w) for w in llm if w.info],
    }
    return out


def _model_of(w: WorkerConn) -> dict[str, Any]:
    """What each LLM worker serves (its ``info`` when it came up), for ``/v1/models``."""
    info = w.info or {}
    model = info.get("model") if isinstance(info.get("model"), dict) else {}
    assert isinstance(model, dict)
    return {
        "worker": w.name,
        "up": w.up,
        "name": model.get("name"),
        "n_ctx_per_lane": info.get("n_ctx_per_lane"),
        "n_ctx_train": model.get("n_ctx_train"),
    }


def gateway_stats(svc: Host) -> dict[str, Any]:
    """The LLM workers' ``stats`` (as last polled) summed, plus the gateway's own."""
    lanes = {"total": 0, "active": 0, "idle": 0}
    sessions: list[dict[str, Any]] = []
    running = queued = 0
    for w in svc.pool.of_kind(LLM):
        if not w.up:
            continue
        s = w.stats
        got = s.get("lanes")
        if isinstance(got, dict):
            for key in lanes:
                lanes[key] += int(got.get(key, 0) or 0)
        for entry in s.get("sessions") or ():
            if isinstance(entry, dict):
                sessions.append({**entry, "worker": w.name})
        running += int(s.get("running", 0) or 0)
        queued += int(s.get("queued", 0) or 0)
    return {
        "gateway": True,
        "lanes": lanes,
        "sessions": sessions,
        "running": running,
        "queued": queued,
        "in_flight": len(svc.ledger),
        "forwarded": svc.forwarded,
        "streams_moved": svc.streams_moved,
        "held": sum(len(v) for v in svc.held.values()),
        "draining": svc.draining,
        "uptime_s": round(time.monotonic() - svc.started, 3),
        "workers": {
            "total": len(svc.pool.of_kind(LLM)),
            "up": sum(w.up for w in svc.pool.of_kind(LLM)),
        },
        "routing": {"policy": svc.router.policy, "cache_routed": svc.router.cache_routed},
        "process": process_stats.snapshot(),  # the gateway's own RSS and Python objects
    }


def worker_view(svc: Host, w: WorkerConn) -> dict[str, Any]:
    load = w.candidate()
    return {
        "endpoint": w.name,
        "kind": w.kind,
        "up": w.up,
        "sees": sees(w.info),  # takes images (--mmproj); null until its info came
        "draining": w.draining,
        "drained": w.drained,
        "in_flight": svc.client_work(w),
        "load": {
            "queued": load.queued,
            "running": load.running,
            "free_lanes": load.free_lanes,
            "score": load.score,
        },
        "lanes": w.stats.get("lanes"),
        "sessions": svc.affinity.sessions_of(w.name),
        "downs": w.downs,
        "prefix_blocks": svc.router.index.size(w.name),
        "uptime_s": w.stats.get("uptime_s"),
    }


def gateway_status(svc: Host) -> dict[str, Any]:
    return {
        "policy": svc.router.policy,
        "uptime_s": round(time.monotonic() - svc.started, 3),
        "in_flight": len(svc.ledger),
        "sessions": len(svc.affinity),
        "held": {s: len(v) for s, v in svc.held.items()},
        "drains": svc.drains(),
        "streams_moved": svc.streams_moved,
        "workers": [worker_view(svc, w) for w in svc.pool.workers.values()],
    }
