"""The cluster as ``scripts/soak.py`` watches it: found, sampled, checked at the end.

Why a module of its own: finding the processes (the gateway's
``gateway_status``, the cluster's state file, a local pid), sampling each
one's RSS from outside and its ``stats`` from inside every few seconds, and
after the load dropping leftover sessions, waiting for idle and reading
stuck lanes, server-side error counts and log levels are what the soak
observes; ``soak.py`` runs the load and judges it.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import psutil
from _cluster_procs import Proc, start_time
from _soak_tally import Owned, Tally, Topology

from protocol import Client, SkiffError

STATS_TIMEOUT_MS = 15_000  # a loop busy with one long forward still answers well within this


@dataclass
class Watched:
    """One process of the cluster: how to ask it for ``stats`` and how to see its RSS."""

    name: str
    role: str  # "gateway", "worker", "speech"
    endpoint: str
    pid: int | None = None  # None: not on this host (RSS from its stats only)
    metrics_port: int | None = None
    start_time: int | None = None  # /proc start time when we know it (pid reuse guard)
    log: str | None = None  # its log file (JSON lines), when the cluster's state says

    def alive(self) -> bool | None:
        if self.pid is None:
            return None
        if self.start_time is not None:
            return start_time(self.pid) == self.start_time
        try:
            return bool(psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE)
        except psutil.NoSuchProcess:
            return False

    def rss(self) -> int | None:
        if self.pid is None:
            return None
        try:
            return int(psutil.Process(self.pid).memory_info().rss)
        except psutil.Error:
            return None


# -- finding the cluster ------------------------------------------------------


def topology(gateway: str) -> tuple[Topology, list[Watched]]:
    """Workers and speech workers as the gateway lists them, and the model's sizes."""
    with Client(gateway, timeout_ms=30_000) as c:
        c.wait_ready(60)
        status = c.call("gateway_status").result
        info = c.info()
    workers = [w["endpoint"] for w in status["workers"] if w["kind"] == "llm"]
    speech = [w["endpoint"] for w in status["workers"] if w["kind"] == "speech"]
    model = info["model"]
    topo = Topology(
        gateway=gateway,
        workers=workers,
        speech=speech,
        n_vocab=int(model["n_vocab"]),
        n_embd=int(model["n_embd"]),
        n_ctx_per_lane=int(info["n_ctx_per_lane"]),
        max_request_bytes=int(info.get("limits", {}).get("max_request_bytes", 4 << 20)),
    )
    watched = [Watched("gateway", "gateway", gateway)]
    watched += [Watched(f"worker-{i + 1}", "worker", ep) for i, ep in enumerate(workers)]
    watched += [
        Watched(f"speech-{i + 1}" if i else "speech", "speech", ep) for i, ep in enumerate(speech)
    ]
    return topo, watched


def attach_state(watched: list[Watched], procs: list[Proc]) -> None:
    """Pids, start times and metrics ports from the cluster's own state."""
    by_endpoint = {p.endpoint: p for p in procs}
    for w in watched:
        p = by_endpoint.get(w.endpoint)
        if p is not None:
            w.name, w.pid, w.start_time = p.name, p.pid, p.start_time
            w.metrics_port, w.log = p.metrics_port, p.log


def attach_local_pids(watched: list[Watched]) -> None:
    """For ``--endpoint``: a process whose ``stats`` names a local pid whose
    command line binds that endpoint is watched from outside too."""
    for w in watched:
        if w.pid is not None:
            continue
        with contextlib.suppress(SkiffError, KeyError, TypeError, psutil.Error):
            with Client(w.endpoint, timeout_ms=STATS_TIMEOUT_MS) as c:
                pid = int(c.stats()["process"]["pid"])
            if w.endpoint in " ".join(psutil.Process(pid).cmdline()):
                w.pid = pid


# -- sampling -------------------------------------------------------------------


@dataclass
class Sampler:
    """Every ``interval`` s: RSS from outside, ``stats`` from inside, throughput."""

    watched: list[Watched]
    tally: Tally
    interval: float
    t0: float = field(default_factory=time.monotonic)
    samples: list[dict[str, Any]] = field(default_factory=list)
    phase: str = "load"
    _stop: threading.Event = field(default_factory=threading.Event)
    _clients: dict[str, Client] = field(default_factory=dict)

    def client(self, w: Watched) -> Client:
        c = self._clients.get(w.name)
        if c is None:
            c = self._clients[w.name] = Client(w.endpoint, timeout_ms=STATS_TIMEOUT_MS)
        return c

    def stats(self, w: Watched) -> dict[str, Any] | None:
        try:
            result: dict[str, Any] = self.client(w).stats()
            return result
        except SkiffError as exc:
            self.tally.error("stats", exc.code, f"{w.name}: {exc.message}", expected=False)
            self._clients.pop(w.name).close()  # a late reply must not match a later ask
            return None

    def sample(self) -> dict[str, Any]:
        now = time.monotonic()
        tokens = self.tally.snapshot()["tokens"]
        row: dict[str, Any] = {"t": round(now - self.t0, 2), "phase": self.phase, "tokens": tokens}
        procs: dict[str, Any] = {}
        for w in self.watched:
            s = self.stats(w) or {}
            proc = s.get("process") or {}
            entry: dict[str, Any] = {
                "rss": w.rss() if w.pid is not None else proc.get("rss_bytes"),
                "rss_stats": proc.get("rss_bytes"),
                "objects": proc.get("objects"),
                "alive": w.alive(),
            }
            if w.role == "worker":
                lanes = s.get("lanes") or {}
                entry.update(
                    lanes_active=lanes.get("active"),
                    tokens_evaluated=s.get("tokens_evaluated"),
                    running=s.get("running"),
                    queued=s.get("queued"),
                )
            elif w.role == "gateway":
                entry.update(in_flight=s.get("in_flight"), held=s.get("held"))
            if "object_types" in proc:
                entry["object_types"] = proc["object_types"]
            procs[w.name] = entry
        row["procs"] = procs
        prev = self.samples[-1] if self.samples else None
        if prev is not None:
            dt = max(1e-3, row["t"] - prev["t"])
            row["tok_s"] = round((tokens - prev["tokens"]) / dt, 2)
            evaluated = [
                (e.get("tokens_evaluated"), prev["procs"].get(n, {}).get("tokens_evaluated"))
                for n, e in procs.items()
            ]
            row["engine_tok_s"] = round(
                sum(a - b for a, b in evaluated if a is not None and b is not None) / dt, 2
            )
        self.samples.append(row)
        return row

    def run(self) -> None:
        while not self._stop.wait(
            max(0.0, self.interval - (time.monotonic() - self.t0) % self.interval)
        ):
            self.sample()

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        for c in self._clients.values():
            c.close()


# -- the end: cleanup, idle, what the processes counted ------------------------------


def drop_leftovers(owned: Owned, topo: Topology) -> dict[str, str]:
    """Drop every session the soak still owns (an action cut short by an
    error); returns what each drop answered."""
    out: dict[str, str] = {}
    for session, where in owned.items():
        endpoint = topo.gateway if where == "gateway" else where
        with Client(endpoint, timeout_ms=30_000) as c:
            try:
                c.drop(session)
                out[session] = "dropped"
            except SkiffError as exc:
                out[session] = exc.code
        owned.discard(session)
    return out


def busy(watched: list[Watched], client_for: Sampler) -> list[str]:
    """What is still working: worker ``running``/``queued``, gateway
    ``in_flight``/``held``, speech ``running``/``queued``."""
    left: list[str] = []
    for w in watched:
        s = client_for.stats(w)
        if s is None:
            left.append(f"{w.name}: no stats")
            continue
        if w.role == "gateway":
            if s.get("in_flight") or s.get("held"):
                left.append(f"{w.name}: in_flight={s.get('in_flight')} held={s.get('held')}")
        elif s.get("running") or s.get("queued"):
            left.append(f"{w.name}: running={s.get('running')} queued={s.get('queued')}")
    return left


def wait_idle(watched: list[Watched], sampler: Sampler, timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        left = busy(watched, sampler)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def stuck_lanes(watched: list[Watched], sampler: Sampler) -> dict[str, Any]:
    """Per worker: lanes held once the soak owns nothing and all is idle.
    Sessions of other clients (names not ``soak-*``, not ephemeral) are
    listed as foreign and not counted."""
    out: dict[str, Any] = {}
    for w in watched:
        if w.role != "worker":
            continue
        s = sampler.stats(w) or {}
        lanes = s.get("lanes") or {}
        sessions = [x for x in s.get("sessions") or () if isinstance(x, dict)]
        ours = [
            x["session"]
            for x in sessions
            if x.get("ephemeral") or str(x.get("session", "")).startswith("soak-")
        ]
        foreign = [x["session"] for x in sessions if x["session"] not in ours]
        out[w.name] = {
            "lanes": lanes,
            "stuck": len(ours),
            "stuck_sessions": ours,
            "foreign_sessions": foreign,
            "lanes_consistent": lanes.get("active", 0) + lanes.get("idle", 0) == lanes.get("total")
            and lanes.get("active") == len(sessions),
        }
    return out


_ERRORS_LINE = re.compile(r"^\w*request_errors_total\{([^}]*)\}\s+([0-9.e+]+)$")


def server_errors(watched: list[Watched]) -> dict[str, dict[str, int]]:
    """Each process's own count of error replies by code (Prometheus
    ``*_request_errors_total``), when its metrics port is known."""
    out: dict[str, dict[str, int]] = {}
    for w in watched:
        if not w.metrics_port:
            continue
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{w.metrics_port}/metrics", timeout=5
            ) as r:
                text = r.read().decode()
        except OSError:
            continue
        codes: Counter[str] = Counter()
        for line in text.splitlines():
            m = _ERRORS_LINE.match(line)
            if m:
                code = re.search(r'code="([^"]*)"', m.group(1))
                codes[code.group(1) if code else "?"] += int(float(m.group(2)))
        out[w.name] = dict(codes)
    return out


def log_levels(watched: list[Watched]) -> dict[str, dict[str, int]]:
    """Log lines by level per process (reported: ``warning`` is routine —
    every gone peer and failed request logs one — but ``error`` deserves a look)."""
    out: dict[str, dict[str, int]] = {}
    for w in watched:
        if not w.log:
            continue
        levels: Counter[str] = Counter()
        with contextlib.suppress(OSError), open(w.log, errors="replace") as f:
            for line in f:
                if line.startswith("{"):
                    with contextlib.suppress(ValueError, AttributeError):
                        levels[str(json.loads(line).get("level", "?"))] += 1
        out[w.name] = dict(levels)
    return out
