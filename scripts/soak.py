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

Beside it: ``_soak_watch.py`` (the processes found, sampled and checked
after the load) and ``_soak_figures.py`` (growth after warm-up, the plot,
the printed report).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import cluster  # noqa: E402  (scripts/cluster.py: the same processes as `scripts/cluster up`)
from _cluster_procs import ClusterError, Proc, load_state  # noqa: E402
from _soak_figures import analyse, plot, report  # noqa: E402
from _soak_tally import Owned, Tally, Topology  # noqa: E402
from _soak_watch import (  # noqa: E402
    Sampler,
    Watched,
    attach_local_pids,
    attach_state,
    drop_leftovers,
    log_levels,
    server_errors,
    stuck_lanes,
    topology,
    wait_idle,
)
from soak_mix import Actor  # noqa: E402

from protocol import SkiffError  # noqa: E402

RSS_BAR_PCT = 5.0


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


if __name__ == "__main__":
    sys.exit(main())
