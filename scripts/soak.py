#!/usr/bin/env python3
"""Soak: a mixed load against a gateway + workers for M minutes, watching memory.

    .venv/bin/python scripts/soak.py --minutes 10            # starts its own cluster
    .venv/bin/python scripts/soak.py --minutes 1 --out DIR   # CI's short version
    .venv/bin/python scripts/soak.py --minutes 30 --run-dir .cluster   # a running cluster
    .venv/bin/python scripts/soak.py --minutes 30 --endpoint tcp://GW  # just a gateway

Why: the failures a soak finds come slowly — a lane that a cancelled or
abandoned stream never gives back, a per-peer table in the gateway that
grows by one entry per disconnect, a buffer kept per frame output. A few
client threads (``scripts/soak_mix.py``) run generate, chat, verify, frame
outputs, migrations, cancels, disconnects and bad input; a sampler records
every few seconds each process's RSS (psutil, from outside), its ``stats``
(``process.objects``: gc-tracked Python objects; lanes; tokens evaluated)
and the load's throughput.

At the end the load stops, leftovers are dropped, the cluster must go
idle, and the figure is judged:

- **RSS growth after warm-up**, per process: warm-up is the first
  max(1 min, 20 %) of the run (at most half of it); growth is the median
  RSS of the last window against the median of the first window after
  warm-up (windows: 10 % of the run, at least 3 samples). The bar, < 5 %,
  is judged from ``--judge-minutes`` (5) on: a 1-minute run has no settled
  baseline, so its growth is reported, not judged.
- **Object growth**, the same way over ``stats.process.objects``: flat
  objects with growing RSS is the allocator or C code settling; both
  growing is a Python-level leak. Reported, not judged.
- **Stuck lanes** (bar 0): lanes the workers still hold for the soak's
  sessions (``soak-*``) or ephemeral ones once the soak owns nothing and
  every worker is idle. **Stuck requests** (bar 0): work still running or
  queued on a worker, or in flight / held in the gateway, after idle.
- **Unexpected errors** (bar 0): any error code the load does not provoke
  (see ``soak_mix``), a malformed reply, a ``stats`` that timed out.
- Every process is still alive.

Outputs in ``--out`` (default a fresh temp dir, printed): ``summary.json``
(figures, errors by code client- and server-side, every sample) and
``soak.png`` (RSS, objects and throughput over time). Exit 0 when every bar
is met (or with ``--report-only``), 1 when one is missed, 2 when the soak
could not run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import cluster  # noqa: E402  (scripts/cluster.py: the same processes as `scripts/cluster up`)
import psutil  # noqa: E402
from _cluster_procs import ClusterError, Proc, load_state, start_time  # noqa: E402
from _soak_tally import Owned, Tally, Topology  # noqa: E402
from soak_mix import Actor  # noqa: E402

from protocol import Client, SkiffError  # noqa: E402

RSS_BAR_PCT = 5.0
STATS_TIMEOUT_MS = 15_000  # a loop busy with one long forward still answers well within this
MiB = 1 << 20


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


# -- the end: cleanup, idle, figures -------------------------------------------------


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


def windows(run_s: float, interval: float) -> tuple[float, float]:
    """(warm-up, window) in seconds for a run of ``run_s``."""
    warmup = min(max(60.0, 0.2 * run_s), 0.5 * run_s)
    window = max(0.1 * run_s, 3 * interval)
    return warmup, min(window, max(interval, (run_s - warmup) / 2))


def growth(
    points: list[tuple[float, float]], run_s: float, warmup_s: float, window_s: float
) -> dict[str, float] | None:
    """Median of the last window against the first window after warm-up."""
    base = [v for t, v in points if warmup_s <= t < warmup_s + window_s]
    last = [v for t, v in points if t >= run_s - window_s]
    if not base or not last:
        return None
    b, end = statistics.median(base), statistics.median(last)
    if b <= 0:
        return None
    return {"base": b, "last": end, "growth_pct": round(100 * (end - b) / b, 2)}


def series(samples: list[dict[str, Any]], name: str, key: str) -> list[tuple[float, float]]:
    return [
        (float(s["t"]), float(v))
        for s in samples
        if s["phase"] == "load" and (v := s["procs"].get(name, {}).get(key)) is not None
    ]


def analyse(
    samples: list[dict[str, Any]], watched: list[Watched], run_s: float, interval: float
) -> dict[str, Any]:
    warmup, window = windows(run_s, interval)
    rss: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    for w in watched:
        g = growth(series(samples, w.name, "rss"), run_s, warmup, window)
        if g is not None:
            g = {**g, "base_mib": round(g["base"] / MiB, 1), "last_mib": round(g["last"] / MiB, 1)}
        rss[w.name] = g
        objects[w.name] = growth(series(samples, w.name, "objects"), run_s, warmup, window)
    load = [s for s in samples if s["phase"] == "load" and "tok_s" in s]
    after = [s for s in load if s["t"] >= warmup]
    return {
        "warmup_s": round(warmup, 1),
        "window_s": round(window, 1),
        "rss": rss,
        "objects": objects,
        "rss_growth_max_pct": max(
            (g["growth_pct"] for g in rss.values() if g is not None), default=None
        ),
        "throughput": {
            "mean_tok_s": round(statistics.fmean(s["tok_s"] for s in load), 2) if load else None,
            "after_warmup_tok_s": round(statistics.fmean(s["tok_s"] for s in after), 2)
            if after
            else None,
            "mean_engine_tok_s": round(statistics.fmean(s["engine_tok_s"] for s in load), 2)
            if load
            else None,
        },
    }


def plot(
    samples: list[dict[str, Any]], watched: list[Watched], figures: dict[str, Any], path: Path
) -> None:
    """RSS per process, RSS and objects relative to the post-warm-up
    baseline (where growth shows), and throughput; warm-up shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(11, 10), sharex=True)
    warmup, window = figures["warmup_s"], figures["window_s"]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, w in enumerate(watched):
        color = colors[i % len(colors)]
        rss = [(s["t"], v) for s in samples if (v := s["procs"].get(w.name, {}).get("rss"))]
        top.plot([t for t, _ in rss], [v / MiB for _, v in rss], color=color, label=w.name)
        for key, style, what in (("rss", "-", "RSS"), ("objects", "--", "objects")):
            g = figures[key].get(w.name)
            if not g:
                continue
            pts = [(s["t"], v) for s in samples if (v := s["procs"].get(w.name, {}).get(key))]
            mid.plot(
                [t for t, _ in pts],
                [100 * (v - g["base"]) / g["base"] for _, v in pts],
                style,
                color=color,
                label=f"{w.name} {what} {g['growth_pct']:+.2f}%",
            )
    run_s = max((s["t"] for s in samples if s["phase"] == "load"), default=0.0)
    for ax in (top, mid, low):
        ax.axvspan(0, warmup, color="gray", alpha=0.12, lw=0)
        ax.axvline(run_s, color="black", lw=0.8, ls=":")
        ax.grid(alpha=0.3)
    mid.axvspan(warmup, warmup + window, color="tab:blue", alpha=0.08, lw=0)
    mid.axvspan(run_s - window, run_s, color="tab:red", alpha=0.08, lw=0)
    mid.axhline(0, color="black", lw=0.6)
    top.set_ylabel("RSS (MiB)")
    top.set_yscale("log")
    top.yaxis.set_major_formatter(ScalarFormatter())
    top.yaxis.set_minor_formatter(ScalarFormatter())
    top.tick_params(axis="y", which="minor", labelsize=7)
    top.legend(loc="center left", fontsize=8)
    top.set_title("RSS per process (psutil)", fontsize=9)
    mid.set_ylabel("change vs baseline (%)")
    mid.set_title(
        "RSS (solid) and gc-tracked objects (dashed) against the median of the blue window; "
        f"growth = red window median; worst RSS {figures['rss_growth_max_pct']}%",
        fontsize=9,
    )
    mid.legend(loc="upper left", fontsize=7, ncol=2)
    loaded = [s for s in samples if "tok_s" in s]
    xs = [s["t"] for s in loaded]
    low.plot(xs, [s["tok_s"] for s in loaded], label="generated tokens/s (clients)")
    low.plot(
        xs,
        [s["engine_tok_s"] for s in loaded],
        label="tokens evaluated/s (workers: prompts + decode)",
        alpha=0.7,
    )
    low.set_ylabel("tokens/s")
    low.set_xlabel("seconds since the load started (gray: warm-up; dotted: load stopped)")
    low.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- main ------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/soak.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, required=True, help="minutes of load")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--endpoint", help="a running gateway (default: start a cluster)")
    where.add_argument("--run-dir", type=Path, help="a running `scripts/cluster up` run directory")
    p.add_argument("--out", type=Path, help="output directory (default: a new temp dir)")
    p.add_argument("--concurrency", type=int, default=4, help="client threads (default 4)")
    p.add_argument(
        "--sample-s", type=float, default=0.0, help="sample period (default: 5 s, 2 s under 5 min)"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--report-only", action="store_true", help="exit 0 whatever the figures")
    p.add_argument(
        "--rss-bar", type=float, default=RSS_BAR_PCT, help="max RSS growth, %% (default 5)"
    )
    p.add_argument(
        "--judge-minutes", type=float, default=5.0, help="judge RSS growth from this run length on"
    )
    p.add_argument(
        "--idle-timeout", type=float, default=60.0, help="seconds to wait for idle after the load"
    )
    cl = p.add_argument_group(
        "the cluster started without --endpoint/--run-dir (scripts/cluster up)"
    )
    cl.add_argument("--workers", type=int, default=2)
    cl.add_argument("--lanes", type=int, default=4)
    cl.add_argument("--ctx", type=int, default=4096)
    cl.add_argument("--threads", type=int, default=0, help="per worker; 0 = cores / workers")
    cl.add_argument("--no-speech", dest="speech", action="store_false")
    cl.add_argument("--keep", action="store_true", help="leave the cluster running")
    return p


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # the same clean-up path as Ctrl-C


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out: Path = args.out or Path(tempfile.mkdtemp(prefix="skiff-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"soak: output in {out}", flush=True)
    signal.signal(signal.SIGTERM, _terminate)
    run_dir: Path | None = None
    started = False
    try:
        if args.endpoint:
            gateway = args.endpoint
            procs: list[Proc] = []
        else:
            run_dir = (args.run_dir or out / "cluster").resolve()
            if args.run_dir is None:
                up = ["--run-dir", str(run_dir), "up", "--workers", str(args.workers)]
                up += [
                    "--lanes",
                    str(args.lanes),
                    "--ctx",
                    str(args.ctx),
                    "--threads",
                    str(args.threads),
                ]
                up += [] if args.speech else ["--no-speech"]
                up_args = cluster.build_parser().parse_args(up)
                print("soak: starting the cluster ...", flush=True)
                started = True
                desc = cluster.cmd_up(up_args, run_dir)
            else:
                desc = cluster.describe(run_dir, load_state(run_dir))
            gateway = desc["gateway"]
            if not gateway:
                raise ClusterError(f"no gateway in {run_dir}")
            procs = load_state(run_dir)
        topo, watched = topology(gateway)
        attach_state(watched, procs)
        attach_local_pids(watched)
        return soak(args, out, topo, watched)
    except (ClusterError, SkiffError) as exc:
        print(f"soak: could not run: {exc}", file=sys.stderr)
        return 2
    finally:
        if started and run_dir is not None and not args.keep:
            with contextlib.suppress(ClusterError):
                cluster.cmd_down(run_dir, grace=10.0)


def soak(args: argparse.Namespace, out: Path, topo: Topology, watched: list[Watched]) -> int:
    run_s = args.minutes * 60
    interval = args.sample_s or (5.0 if args.minutes >= 5 else 2.0)
    tally, owned, stop = Tally(), Owned(), threading.Event()
    sampler = Sampler(watched, tally, interval)
    print(
        f"soak: {args.minutes:g} min, {args.concurrency} clients, {len(topo.workers)} workers, "
        f"{len(topo.speech)} speech; sampling every {interval:g} s",
        flush=True,
    )
    sampler.sample()
    sampler_thread = threading.Thread(target=sampler.run, name="sampler", daemon=True)
    sampler_thread.start()
    actors = [
        Actor(i, topo, tally, owned, stop, seed=args.seed * 1000 + i, actors=args.concurrency)
        for i in range(args.concurrency)
    ]
    threads = [threading.Thread(target=a.run, name=f"actor-{a.index}", daemon=True) for a in actors]
    for t in threads:
        t.start()
    interrupted = False
    try:
        end = sampler.t0 + run_s
        while time.monotonic() < end:
            time.sleep(min(5.0, end - time.monotonic()) if end > time.monotonic() else 0)
            if any(w.alive() is False for w in watched):
                print("soak: a process died; stopping the load", file=sys.stderr)
                break
    except KeyboardInterrupt:
        interrupted = True
        print("soak: interrupted; stopping the load and reporting", file=sys.stderr)
    stop.set()
    sampler.stop()
    sampler_thread.join()
    load_s = time.monotonic() - sampler.t0
    sampler.sample()  # the last load sample
    for t in threads:
        t.join(timeout=120)
    sampler.phase = "settle"
    leftovers = drop_leftovers(owned, topo)
    busy_left = wait_idle(watched, sampler, args.idle_timeout)
    lanes = stuck_lanes(watched, sampler)
    sampler.sample()
    sampler.close()
    alive = {w.name: w.alive() for w in watched}
    figures = analyse(
        sampler.samples, watched, min(load_s, run_s) if not interrupted else load_s, interval
    )
    counts = tally.snapshot()
    stuck = sum(v["stuck"] for v in lanes.values())
    unexpected = sum(counts["unexpected_by_code"].values())
    judged = args.minutes >= args.judge_minutes and not interrupted
    rss_max = figures["rss_growth_max_pct"]
    misses: list[str] = []
    if judged and (rss_max is None or rss_max >= args.rss_bar):
        misses.append(f"RSS growth {rss_max}% >= {args.rss_bar}%")
    if stuck:
        misses.append(f"{stuck} stuck lanes")
    if busy_left:
        misses.append(f"not idle after the load: {busy_left}")
    if not all(v["lanes_consistent"] for v in lanes.values()):
        misses.append("lane counts inconsistent")
    if unexpected:
        misses.append(f"{unexpected} unexpected errors")
    if any(a is False for a in alive.values()):
        misses.append(f"processes died: {[n for n, a in alive.items() if a is False]}")
    if interrupted:
        misses.append("interrupted")
    summary = {
        "config": {
            "minutes": args.minutes,
            "concurrency": args.concurrency,
            "sample_s": interval,
            "seed": args.seed,
            "gateway": topo.gateway,
            "workers": topo.workers,
            "speech": topo.speech,
            "rss_bar_pct": args.rss_bar,
            "rss_judged": judged,
        },
        "load_s": round(load_s, 1),
        "figures": figures,
        "stuck_lanes": stuck,
        "lanes": lanes,
        "not_idle": busy_left,
        "leftover_sessions": leftovers,
        "alive": alive,
        "processes": {
            w.name: {"role": w.role, "endpoint": w.endpoint, "pid": w.pid} for w in watched
        },
        "load": counts,
        "server_errors_by_code": server_errors(watched),
        "log_levels": log_levels(watched),
        "passed": not misses,
        "misses": misses,
        "samples": sampler.samples,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(sampler.samples, watched, figures, out / "soak.png")
    report(summary)
    print(f"soak: wrote {out / 'summary.json'} and {out / 'soak.png'}", flush=True)
    return 0 if (not misses or args.report_only) else 1


def _pct(g: dict[str, Any] | None) -> str:
    return "n/a" if g is None else f"{g['growth_pct']:+.2f}%"


def report(summary: dict[str, Any]) -> None:
    f = summary["figures"]
    cfg = summary["config"]
    load = summary["load"]
    for name, g in f["rss"].items():
        mib = "" if g is None else f" ({g['base_mib']} -> {g['last_mib']} MiB)"
        print(f"  {name:10s} RSS {_pct(g)}{mib}, objects {_pct(f['objects'].get(name))}")
    tp = f["throughput"]
    print(
        f"  throughput: {tp['mean_tok_s']} generated tok/s, "
        f"{tp['mean_engine_tok_s']} evaluated tok/s"
    )
    print(f"  actions: {load['actions']}")
    print(f"  errors by code: {load['errors_by_code']} (unexpected: {load['unexpected_by_code']})")
    print(f"  log lines by level: {summary['log_levels']}")
    judged = "" if cfg["rss_judged"] else f", not judged under {summary['config']['minutes']:g} min"
    rss = f["rss_growth_max_pct"]
    rss_text = (
        "n/a" if rss is None or (isinstance(rss, float) and math.isnan(rss)) else f"{rss:.2f}%"
    )
    print(
        f"RSS growth after warm-up: {rss_text} (bar < {cfg['rss_bar_pct']:g}%{judged}), "
        f"stuck lanes: {summary['stuck_lanes']} (bar 0)"
    )
    print("PASS" if summary["passed"] else f"FAIL: {'; '.join(summary['misses'])}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
