#!/usr/bin/env python3
"""What moving and parking sessions cost, in one run (issue 22's figures).

    .venv/bin/python scripts/bench_moves.py [--rounds 3]

1. **Moving a running stream**: two workers behind ``skiff-gateway``; a
   stream on a session holding 500 (then 2,000) prompt tokens is moved by
   ``gateway_drain`` of its worker after 16 tokens. The figure is the gap in
   the stream's inter-token latency at the move (the largest gap, minus the
   median one), beside the median inter-token latency of the same stream.
2. **Restoring a parked session** of 2,000 tokens (one lane: naming it parks
   the other session, then restores it) beside re-prefilling the same 2,000
   tokens on a fresh session (the target: restore <= 0.1 x re-prefill).
3. **Sessions held per GiB of park**: the parked state's bytes of a 300-
   and a 2,000-token session (Gemma 3 270M, f16 KV, every cell kept).

The CPU flags are printed first: every figure depends on them.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _machine import cpu_flags  # noqa: E402

from protocol import Client  # noqa: E402


def start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", *args], cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT
    )


def wait_ready(endpoint: str, proc: subprocess.Popen[bytes]) -> None:
    with Client(endpoint) as c:
        c.wait_ready(300, alive=lambda: proc.poll() is None)


def prompt(n: int, seed: int) -> list[int]:
    import numpy as np

    return [int(t) for t in np.random.default_rng(seed).integers(1000, 200_000, n)]


def move_gap(tmp: Path, tokens: int, seed: int) -> tuple[float, float]:
    """(gap at the move, median inter-token gap), ms, for one moved stream."""
    eps = [f"ipc://{tmp}/m{seed}-{i}.sock" for i in (1, 2)]
    ctx = str(2 * 4096)
    workers = [
        start(["worker.cli", "--bind", ep, "--lanes", "2", "--ctx", ctx, "--threads", "1"],
              tmp / f"w{seed}-{i}.log")
        for i, ep in enumerate(eps)
    ]  # fmt: skip
    for ep, proc in zip(eps, workers, strict=True):
        wait_ready(ep, proc)
    gw_ep = f"ipc://{tmp}/gw{seed}.sock"
    flags = [f for e in eps for f in ("--worker", e)]
    gateway = start(["gateway.cli", "--bind", gw_ep, *flags], tmp / f"gw{seed}.log")
    try:
        with Client(gw_ep) as c:
            c.wait_ready(60)
            while not all(w["up"] for w in c.call("gateway_status").result["workers"]):
                time.sleep(0.05)
            session = f"mv{seed}"
            c.prefill(session, prompt(tokens, seed))
            holder = next(
                w["endpoint"]
                for w in c.call("gateway_status").result["workers"]
                if session in w["sessions"]
            )
            stamps: list[float] = []
            rid = c.send("generate", session, {"tokens": [7], "max_tokens": 64,
                                               "ignore_eos": True, "stream": True})  # fmt: skip
            drained = threading.Event()

            def drain() -> None:
                with Client(gw_ep, timeout_ms=120_000) as d:
                    d.call("gateway_drain", args={"worker": holder})
                drained.set()

            for reply in c.follow(rid):
                if reply.header.get("event") == "token":
                    stamps.append(time.perf_counter())
                    if len(stamps) == 16:
                        threading.Thread(target=drain, daemon=True).start()
            assert drained.wait(120), "the drain did not end"
            # A gap is only the move's if the stream did move (not end first).
            moved = c.call("gateway_status").result["streams_moved"]
            assert moved == 1 and len(stamps) == 64, f"moved {moved}, {len(stamps)} tokens"
            gaps = [(b - a) * 1000 for a, b in itertools.pairwise(stamps)]
            median = statistics.median(gaps)
            return max(gaps[14:]) - median, median
    finally:
        for p in (gateway, *workers):
            p.terminate()
        for p in (gateway, *workers):
            p.wait(60)


def park_figures(tmp: Path, rounds: int) -> dict[str, Any]:
    ep = f"ipc://{tmp}/park.sock"
    proc = start(["worker.cli", "--bind", ep, "--lanes", "1", "--ctx", "4096"], tmp / "park.log")
    wait_ready(ep, proc)
    out: dict[str, Any] = {"restore_ms": [], "prefill_ms": [], "bytes": {}}
    try:
        with Client(ep, timeout_ms=300_000) as c:
            for n in (300, 2000):
                c.prefill(f"size{n}", prompt(n, n))
                c.prefill("other", [1000, 1001])  # parks size{n}
                out["bytes"][n] = c.stats()["park"]["bytes"]
                c.drop(f"size{n}")
                c.drop("other")
            for r in range(rounds):
                t0 = time.perf_counter()
                c.prefill(f"a{r}", prompt(2000, 10 + r))
                out["prefill_ms"].append((time.perf_counter() - t0) * 1000)
                c.prefill(f"b{r}", [1000, 1001])  # parks a{r}
                c.decode(f"a{r}", 5)  # restores it (parks b{r})
                out["restore_ms"].append(c.stats()["park"]["last_restore_ms"])
                c.drop(f"a{r}")
                c.drop(f"b{r}")
    finally:
        proc.terminate()
        proc.wait(60)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    opts = ap.parse_args()
    print(f"cpu flags: {cpu_flags()}")
    with tempfile.TemporaryDirectory(prefix="skiff-moves-") as d:
        tmp = Path(d)
        park = park_figures(tmp, opts.rounds)
        restore = statistics.median(park["restore_ms"])
        prefill = statistics.median(park["prefill_ms"])
        print(f"restore a parked 2,000-token session: {restore:.1f} ms (median of {opts.rounds})")
        print(f"re-prefill the same 2,000 tokens:     {prefill:.1f} ms")
        print(f"restore / re-prefill: {restore / prefill:.4f}  (target <= 0.1)")
        for n, size in park["bytes"].items():
            print(f"a parked {n}-token session: {size / 2**20:.2f} MiB -> "
                  f"{2**30 / size:.0f} sessions per GiB of park")  # fmt: skip
        for tokens in (500, 2000):
            runs = [move_gap(tmp, tokens, seed=tokens + r) for r in range(opts.rounds)]
            gap = statistics.median(g for g, _ in runs)
            itl = statistics.median(m for _, m in runs)
            print(f"moving a running stream of a {tokens}-token session: gap {gap:.1f} ms "
                  f"beside a median inter-token {itl:.1f} ms (gap / itl {gap / itl:.1f}; "
                  f"median of {opts.rounds})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
