#!/usr/bin/env python3
"""Tensors on the wire: a 64 MiB frame echoed, and a session migrated.

    .venv/bin/python scripts/bench_frames.py [--mib 64] [--rounds 8] [--tokens 2000]

1. **Echo.** A ``[rows, 1024]`` f32 frame of ``--mib`` MiB goes to a worker's
   ``echo`` op and back. Printed: round-trip payload throughput (MiB sent one
   way / round-trip time, so both directions are inside the time) beside a
   ``memcpy`` (``np.copyto``) of the same size in this process, and the
   client's ``tracemalloc`` peak during a round trip (numpy and Python
   allocations are traced; a Python-level copy of the payload would show as
   ``--mib``). The worker's RSS growth over the rounds is printed too.
2. **Migration.** A ``--tokens`` session on worker A moves to worker B
   (``Client.migrate``: export, import, drop); time from export start to the
   first token decoded on B, beside re-prefilling the same tokens into a
   fresh session on B and decoding its first token. Greedy tokens after
   either path must agree.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PLAIN = "--plain-malloc" in sys.argv
sys.path.insert(0, str(ROOT))

from edge.memory import reexec_with_tunables  # noqa: E402
from protocol import Client, frames  # noqa: E402


def start_worker(tmp: Path, name: str, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    endpoint = f"ipc://{tmp}/{name}.sock"
    log = (tmp / f"{name}.log").open("wb")
    cmd = [sys.executable, "-m", "worker.cli", "--bind", endpoint, "--threads", "2", *args]
    env = dict(os.environ)
    if PLAIN:
        env["SKIFF_NO_REEXEC"] = "1"
        env.pop("GLIBC_TUNABLES", None)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    with Client(endpoint) as c:
        c.wait_ready(120, alive=lambda: proc.poll() is None)
    return proc, endpoint


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def bench_echo(endpoint: str, pid: int, mib: int, rounds: int) -> dict[str, float]:
    rows = mib * (1 << 20) // (1024 * 4)
    payload = np.random.default_rng(0).standard_normal((rows, 1024), dtype=np.float32)
    frame = frames.make_frame([("hidden", payload, 0)])
    nbytes = payload.nbytes
    with Client(endpoint, timeout_ms=120_000) as c:
        back = c.echo(frame).frame.array("hidden")  # warm up, and check
        if not np.array_equal(back, payload):
            raise SystemExit("echo returned different bytes")
        del back
        rss0 = rss_mib(pid)
        times = []
        peaks = []
        for _ in range(rounds):
            tracemalloc.start()
            t0 = time.perf_counter()
            reply = c.echo(frame)
            view = reply.frame.array("hidden")
            times.append(time.perf_counter() - t0)
            peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()
            assert view.shape == payload.shape
            del reply, view
        rss1 = rss_mib(pid)
    dst = np.empty_like(payload)
    copies = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        np.copyto(dst, payload)
        copies.append(time.perf_counter() - t0)
    rt = float(np.median(times))
    cp = float(np.median(copies))
    return {
        "mib": nbytes / (1 << 20),
        "rt_ms": rt * 1e3,
        "rt_gbs": nbytes / rt / 1e9,
        "memcpy_ms": cp * 1e3,
        "memcpy_gbs": nbytes / cp / 1e9,
        "peak_mib": max(peaks) / (1 << 20),
        "worker_rss_growth_mib": rss1 - rss0,
    }


def long_tokens(c: Client, n: int) -> list[int]:
    words = ["harbour", "lantern", "compass", "anchor", "gull", "tide", "reef", "mast"]
    text = " ".join(f"Log {i}: the {words[i % 8]} at mile {i * 13 % 97}." for i in range(n))
    tokens: list[int] = c.tokenize(text)
    return tokens[:n]


def decode_n(c: Client, session: str, token: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        token = int(c.decode(session, token)["token"])
        out.append(token)
    return out


def bench_migration(a_ep: str, b_ep: str, n_tokens: int, repeats: int) -> dict[str, Any]:
    mig, cold = [], []
    same = True
    with Client(a_ep, timeout_ms=300_000) as a, Client(b_ep, timeout_ms=300_000) as b:
        tokens = long_tokens(a, n_tokens)
        for r in range(repeats):
            s = f"m{r}"
            first = int(a.prefill_sampled(s, tokens)["token"])
            t0 = time.perf_counter()
            exported = a.export_state(s)
            b.import_state(s, exported)
            a.drop(s)
            tok_mig = int(b.decode(s, first)["token"])
            mig.append(time.perf_counter() - t0)
            state_mib = exported.buffers[0].nbytes / (1 << 20)
            del exported
            t0 = time.perf_counter()
            first_b = int(b.prefill_sampled(f"c{r}", tokens)["token"])
            tok_cold = int(b.decode(f"c{r}", first_b)["token"])
            cold.append(time.perf_counter() - t0)
            same &= first_b == first and tok_cold == tok_mig
            same &= decode_n(b, s, tok_mig, 4) == decode_n(b, f"c{r}", tok_cold, 4)
            b.drop(s)
            b.drop(f"c{r}")
    return {
        "tokens": len(tokens),
        "state_mib": state_mib,
        "migrate_ms": float(np.median(mig)) * 1e3,
        "reprefill_ms": float(np.median(cold)) * 1e3,
        "same_tokens": same,
    }


def main() -> None:
    # This client receives 64 MiB messages too: the same malloc tunable as
    # the workers (edge/memory.py), unless --plain-malloc asks to compare.
    if "--plain-malloc" not in sys.argv:
        reexec_with_tunables()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plain-malloc", action="store_true", help="workers and client without it")
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="skiff-frames-") as tmp_s:
        tmp = Path(tmp_s)
        # no prefix cache: every re-prefill below must be a cold one
        a, a_ep = start_worker(tmp, "a", "--lanes", "2", "--ctx", "8192", "--prefix-cache", "0")
        b, b_ep = start_worker(tmp, "b", "--lanes", "2", "--ctx", "8192", "--prefix-cache", "0")
        try:
            echo = bench_echo(a_ep, a.pid, args.mib, args.rounds)
            tunables = os.environ.get("GLIBC_TUNABLES", "") or "none"
            print(
                f"echo {echo['mib']:.0f} MiB frame, median of {args.rounds} round trips "
                f"(GLIBC_TUNABLES={tunables})"
            )
            print(
                f"  round trip {echo['rt_ms']:.1f} ms = {echo['rt_gbs']:.2f} GB/s "
                f"| memcpy {echo['memcpy_ms']:.1f} ms = {echo['memcpy_gbs']:.2f} GB/s "
                f"| round trip / memcpy time {echo['rt_ms'] / echo['memcpy_ms']:.1f}x"
            )
            print(
                f"  client tracemalloc peak {echo['peak_mib']:.2f} MiB (bar < 8) "
                f"| worker RSS growth {echo['worker_rss_growth_mib']:+.1f} MiB"
            )
            m = bench_migration(a_ep, b_ep, args.tokens, args.repeats)
            print(
                f"migration of a {m['tokens']}-token session ({m['state_mib']:.1f} MiB of KV), "
                f"median of {args.repeats}"
            )
            print(
                f"  export->import->first token on B {m['migrate_ms']:.0f} ms "
                f"| re-prefill on B + first token {m['reprefill_ms']:.0f} ms "
                f"| migrate / re-prefill {m['migrate_ms'] / m['reprefill_ms']:.3f} "
                f"| same tokens: {m['same_tokens']}"
            )
        finally:
            for p in (a, b):
                p.terminate()
                p.wait(10)


if __name__ == "__main__":
    main()
