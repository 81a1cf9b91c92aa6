#!/usr/bin/env python3
"""Two workers sharing one host, against one worker alone (issue 25, part 5).

    .venv/bin/python scripts/bench_colocated.py [--seconds 20] [--streams 4] [--tokens 32]

Every row loads its worker(s) with ``--streams`` closed-loop generate streams
each (``--tokens`` new tokens a request, greedy, ignore_eos) for
``--seconds``, and prints each worker's tok/s over the same window:

- ``alone``: one worker with skiff's defaults (threads from what the
  process may use, OpenMP spin capped) — the baseline;
- ``alone, spin``: the same with libgomp's default spinning
  (``GOMP_SPINCOUNT=300000``): what a lone worker gives up for the cap;
- ``pair, old``: two workers as compose used to start them on a 2-core host
  (``--threads 2`` each, libgomp spinning): the 0.7 tok/s case;
- ``pair, 2 threads``: two workers with 2 threads each and the spin cap
  (what happens when an operator sets no CPU limit);
- ``pair, quota``: two workers as compose starts them now (``cpus: 1``
  each): the thread count comes from the cgroup quota. No container
  runtime here, so each worker reads a stand-in cgroup tree
  (``SKIFF_CGROUP_ROOT`` with ``cpu.max`` = one core) through the same code
  path; the kernel does not throttle them, which a 1-thread worker does not
  need.

The targets: a pair delivers together >= 0.9x one worker alone, and
neither worker falls below 0.4x of it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from _machine import cpu_flags  # noqa: E402

from protocol import Client  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper and the sea. Once upon a time"


@dataclass(frozen=True)
class Setup:
    name: str
    workers: int
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    quota_cores: int = 0  # > 0: a stand-in cgroup tree with this CPU quota


def setups() -> list[Setup]:
    spin = (("GOMP_SPINCOUNT", "300000"),)
    return [
        Setup("alone", 1),
        Setup("alone, spin", 1, env=spin),
        Setup("pair, old", 2, ("--threads", "2"), spin),
        Setup("pair, 2 threads", 2, ("--threads", "2")),
        Setup("pair, quota", 2, quota_cores=1),
    ]


def fake_cgroup(tmp: Path, cores: int) -> Path:
    root = tmp / f"cgroup-{cores}"
    root.mkdir(exist_ok=True)
    (root / "cpu.max").write_text(f"{cores * 100000} 100000\n")
    return root


def start(tmp: Path, name: str, setup: Setup) -> tuple[subprocess.Popen[bytes], str]:
    endpoint = f"ipc://{tmp}/{name}.sock"
    env: dict[str, str] = {**os.environ, **dict(setup.env)}
    if setup.quota_cores:
        env["SKIFF_CGROUP_ROOT"] = str(fake_cgroup(tmp, setup.quota_cores))
    cmd = [sys.executable, "-m", "worker.cli", "--bind", endpoint, "--lanes", "8", *setup.args]
    log = (tmp / f"{name}.log").open("wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    with Client(endpoint) as c:
        c.wait_ready(300, alive=lambda: proc.poll() is None)
    return proc, endpoint


def threads_of(endpoint: str) -> object:
    with Client(endpoint) as c:
        info = c.info()
    return info.get("threads", "?")


def load(endpoints: list[str], streams: int, tokens: int, seconds: float) -> list[float]:
    """Closed-loop generate streams on every endpoint at once; tok/s each."""
    counts = [0] * len(endpoints)
    lock = threading.Lock()
    start_at = time.perf_counter() + 0.5
    stop_at = start_at + seconds

    def stream(k: int, endpoint: str) -> None:
        with Client(endpoint, timeout_ms=300_000) as c:
            while time.perf_counter() < start_at:
                time.sleep(0.01)
            while time.perf_counter() < stop_at:
                r = c.call(
                    "generate",
                    None,
                    {"prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True, "stream": False},
                )
                if time.perf_counter() <= stop_at:
                    with lock:
                        counts[k] += len(r.result["tokens"])

    workers = [
        threading.Thread(target=stream, args=(k, ep))
        for k, ep in enumerate(endpoints)
        for _ in range(streams)
    ]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return [n / seconds for n in counts]


def run(setup: Setup, tmp: Path, args: argparse.Namespace) -> tuple[list[float], list[object]]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        endpoints = []
        for i in range(setup.workers):
            proc, ep = start(tmp, f"w{i}", setup)
            procs.append(proc)
            endpoints.append(ep)
        threads = [threads_of(ep) for ep in endpoints]
        load(endpoints, args.streams, args.tokens, 2.0)  # warm-up
        return load(endpoints, args.streams, args.tokens, args.seconds), threads
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--streams", type=int, default=4, help="streams per worker")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per request")
    args = ap.parse_args()
    print(f"cpu: {cpu_flags()}; cores usable: {len(os.sched_getaffinity(0))}")
    print(
        f"{args.streams} streams per worker, {args.tokens} tokens a request, {args.seconds:.0f} s\n"
    )
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        results = {s.name: run(s, tmp, args) for s in setups()}
    alone = results["alone"][0][0]
    print(f"{'setup':<18} {'threads':>8} {'tok/s each':>20} {'sum/alone':>10} {'min/alone':>10}")
    for name, (rates, threads) in results.items():
        each = " + ".join(f"{r:.1f}" for r in rates)
        th = ",".join(str(t) for t in threads)
        print(
            f"{name:<18} {th:>8} {each:>20} {sum(rates) / alone:>10.2f} {min(rates) / alone:>10.2f}"
        )
    print("\ntargets: a pair's sum >= 0.90x alone, each worker >= 0.40x alone")


if __name__ == "__main__":
    main()
