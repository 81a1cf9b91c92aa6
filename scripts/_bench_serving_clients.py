"""The served systems of ``scripts/bench_serving.py``, driven as clients drive them.

Why a module of its own: skiff (``worker.cli`` over ipc://, closed-loop
users from ``loadtest.run_load``, a separate process pinging it every 20 ms,
its per-turn profile from ``stats``) and the HTTP peers (threads streaming
``/v1/completions``) are the workload side of the benchmark: each starts
its server, warms it up, runs every concurrency and stops it.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from _bench_serving_common import (
    LANES,
    PING_INTERVAL_S,
    ROOT,
    STAGGER_S,
    THREADS,
    Procs,
    Row,
    wait_until,
)

from loadtest import percentile, run_load
from protocol import Client, SkiffError

# -- skiff over ZeroMQ ----------------------------------------------------------------

PINGER = r"""
import itertools, json, sys, threading, time
sys.path.insert(0, sys.argv[3])
import zmq
from protocol import transport
ep, interval = sys.argv[1], float(sys.argv[2])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
sock = zmq.Context().socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(ep)
ids = itertools.count(1)
def once():
    rid = next(ids)
    t = time.perf_counter()
    sock.send(transport.encode(transport.request(rid, "ping")))
    while sock.poll(max(0, int(10000 - (time.perf_counter() - t) * 1e3))):
        if transport.decode(sock.recv_multipart()[0]).get("id") == rid:  # skip late replies
            return time.perf_counter() - t
    return None
for _ in range(20):
    once()
print("ready", flush=True)
samples, lost = [], 0
while not stop.is_set():
    t0 = time.perf_counter()
    rtt = once()
    if rtt is None:
        lost += 1
    else:
        samples.append(rtt * 1e3)
    time.sleep(max(0.0, interval - (time.perf_counter() - t0)))
print(json.dumps({"samples_ms": samples, "lost": lost}), flush=True)
"""


@contextlib.contextmanager
def pinger(procs: Procs, endpoint: str) -> Iterator[dict[str, Any]]:
    """Ping ``endpoint`` every 20 ms from another process; yields the result dict."""
    proc = procs.track(
        subprocess.Popen(
            [sys.executable, "-c", PINGER, endpoint, str(PING_INTERVAL_S), str(ROOT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
    )
    assert proc.stdin is not None and proc.stdout is not None
    result: dict[str, Any] = {}
    try:
        if proc.stdout.readline().strip() != b"ready":
            raise RuntimeError("pinger did not start")
        yield result
        proc.stdin.close()
        result.update(json.loads(proc.stdout.readline()))
        proc.wait(10)
    finally:
        procs.stop(proc)


def ping_run(
    procs: Procs, endpoint: str, client: Client, c: int, k: int, common: dict[str, Any]
) -> dict[str, Any]:
    """The same load again with a pinger beside it: its round trips and the
    turns they waited behind. A run of its own, so its 50 pings a second (and
    the pinger's process on the same cores) are not in the throughput figure
    set against the raw engine, which has no such probe."""
    before = client.stats()
    with pinger(procs, endpoint) as ping_result:
        run_load(concurrency=c, requests=c * k, **common)
    after = client.stats()
    forwards = after["forwards"] - before["forwards"]
    ping = dict(ping_result)
    spent = (
        after["mean_forward_ms"] * after["forwards"]
        - before["mean_forward_ms"] * before["forwards"]
    )
    ping["mean_turn_ms"] = spent / forwards if forwards else None
    # the last 1,024 forwards: this run's and the end of the one before, the same load
    ping["turn_p99_ms"] = after["forward_ms"]["p99"]
    ping["turn_max_ms"] = after["forward_ms"]["max"]
    return ping


def forward_mix(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The run's forwards without and with prompt pieces (``stats.forward_mix``)."""
    a, b = after["forward_mix"], before["forward_mix"]
    return {kind: {k: a[kind][k] - b[kind][k] for k in a[kind]} for kind in a}


def turn_profile(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """ms per forward in each part of the worker's loop and turns over a run
    (two ``stats["profile"]`` snapshots; worker/profile.py names the parts)."""
    forwards = max(1, after["forwards"] - before["forwards"])

    def per(section: str) -> dict[str, float]:
        a, b = after[section], before[section]
        return {k: 1000 * (a[k] - b.get(k, 0.0)) / forwards for k in a}

    loop, turn = per("loop"), per("turn")
    inside = sum(v for k, v in turn.items() if k not in ("launch", "land_wait"))
    wall = 1000 * (after["wall_s"] - before["wall_s"]) / forwards
    return {
        "wall": wall,
        **{f"loop.{k}": v for k, v in loop.items()},
        **{f"turn.{k}": v for k, v in turn.items() if v > 0},
        "turn.other": loop["turn"] - inside,
        "outside llama_decode": wall - turn["decode"] - loop["poll"],
    }


def bench_skiff(
    procs: Procs, tmp: Path, concurrencies: Sequence[int], k: int, n_new: int, prompts: list[str]
) -> tuple[dict[int, Row], dict[str, Any]]:
    endpoint = f"ipc://{tmp}/skiff.sock"
    log = tmp / "skiff.log"
    cmd = [
        sys.executable,
        "-m",
        "worker.cli",
        "--bind",
        endpoint,
        "--lanes",
        str(LANES),
        "--threads",
        str(THREADS),
        "--log-level",
        "warning",
    ]
    proc = procs.start(cmd, log, cwd=ROOT)
    client = Client(endpoint, timeout_ms=500)

    def up() -> bool:
        try:
            client.ping()
            return True
        except SkiffError:
            return False

    rows: dict[int, Row] = {}
    ping: dict[str, Any] = {}
    try:
        wait_until(up, proc, "skiff worker", log)
        client.timeout_ms = 30_000
        if "generate" not in client.info()["ops"]:
            raise RuntimeError("this worker has no generate op")
        common: dict[str, Any] = {
            "endpoints": [endpoint],
            "max_tokens": n_new,
            "ignore_eos": True,
            "prompts": prompts,
            "timeout_ms": 600_000,
        }
        run_load(concurrency=1, requests=2, **{**common, "max_tokens": 8})  # warm-up
        for c in concurrencies:
            before = client.stats()
            profile_before = client.stats()["profile"]
            summary = run_load(concurrency=c, requests=c * k, **common)
            after = client.stats()
            profile = turn_profile(profile_before, after["profile"])
            forwards = after["forwards"] - before["forwards"]
            turn_ms = (
                (
                    after["mean_forward_ms"] * after["forwards"]
                    - before["mean_forward_ms"] * before["forwards"]
                )
                / forwards
                if forwards
                else None
            )
            req = summary["requests"]
            rows[c] = Row(
                summary["throughput"]["output_tok_s"],
                summary["tokens"]["output"],
                summary["duration_s"],
                req["sent"],
                errors=req["errors"],
                ttft_p50_ms=summary["ttft_steady_ms"]["p50"] or summary["ttft_ms"]["p50"],
                extra={
                    "mean_turn_ms": turn_ms,
                    "forwards": forwards,
                    "error_codes": req["error_codes"],
                    "ttft_p90_ms": summary["ttft_ms"]["p90"],
                    "ttft_first_wave_included_p50_ms": summary["ttft_ms"]["p50"],
                    "forward_ms": after["forward_ms"],
                    "itl_p50_ms": summary["itl_ms"]["p50"],
                    "itl_p99_ms": summary["itl_ms"]["p99"],
                    "profile_ms_per_forward": profile,
                    "forward_mix": forward_mix(before, after),
                },
            )
            if c == max(concurrencies):
                ping = ping_run(procs, endpoint, client, c, k, common)
            if c in (min(concurrencies), max(concurrencies)):
                # TTFT with users started STAGGER_S apart: closed-loop users with
                # equal lengths otherwise arrive in lockstep bursts of c prompts.
                staggered = run_load(concurrency=c, requests=2 * c, stagger_s=STAGGER_S, **common)
                rows[c].extra["ttft_staggered_p50_ms"] = staggered["ttft_ms"]["p50"]
            print(f"  skiff c={c}: {rows[c].tok_s:.1f} tok/s", file=sys.stderr)
    finally:
        client.close()
        procs.stop(proc)
    return rows, ping


# -- HTTP servers -------------------------------------------------------------------


def stream_completion(port: int, body: dict[str, Any], n_new: int) -> tuple[int, float | None, str]:
    """POST a streaming /v1/completions; (completion tokens, TTFT s, finish reason)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    t0 = time.perf_counter()
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        chunks, ttft, finish = 0, None, "none"
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue  # blank separators, ': ping' comments
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            choice = (json.loads(data).get("choices") or [{}])[0]
            if choice.get("text"):
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
            if choice.get("finish_reason"):
                finish = str(choice["finish_reason"])
        # "length" means max_tokens tokens were produced, whatever the chunking.
        return (n_new if finish == "length" else chunks), ttft, finish
    finally:
        conn.close()


def drive_http(
    port: int,
    body_for: Callable[[str], dict[str, Any]],
    prompts: list[str],
    c: int,
    k: int,
    n_new: int,
) -> Row:
    """c threads, each sending k streaming requests one after another."""
    results: list[tuple[int, float | None, str]] = []
    errors: list[str] = []
    lock = threading.Lock()

    def user(u: int) -> None:
        for r in range(k):
            prompt = prompts[(r * c + u) % len(prompts)]
            try:
                out = stream_completion(port, body_for(prompt), n_new)
                with lock:
                    results.append(out)
            except Exception as exc:
                with lock:
                    errors.append(type(exc).__name__)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=user, args=(u,)) for u in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(r[0] for r in results)
    ttfts = [r[1] * 1e3 for r in results if r[1] is not None]
    finishes: dict[str, int] = {}
    for r in results:
        finishes[r[2]] = finishes.get(r[2], 0) + 1
    return Row(
        tokens / wall,
        tokens,
        wall,
        c * k,
        errors=len(errors),
        ttft_p50_ms=percentile(ttfts, 50) if ttfts else None,
        extra={"finish_reasons": finishes, "errors": errors},
    )


def http_ready(port: int, path: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", path)
            ok = conn.getresponse().status == 200
            conn.close()
            return ok
        except OSError:
            return False

    return check


def bench_http(
    procs: Procs,
    name: str,
    cmd: list[str],
    port: int,
    ready_path: str,
    log: Path,
    body_for: Callable[[str], dict[str, Any]],
    concurrencies: Sequence[int],
    k: int,
    n_new: int,
    prompts: list[str],
) -> dict[int, Row]:
    proc = procs.start(cmd, log, cwd=ROOT)
    rows: dict[int, Row] = {}
    try:
        wait_until(http_ready(port, ready_path), proc, name, log)
        warm = {**body_for(prompts[0]), "max_tokens": 8}
        stream_completion(port, warm, 8)  # warm-up
        for c in concurrencies:
            rows[c] = drive_http(port, body_for, prompts, c, k, n_new)
            print(f"  {name} c={c}: {rows[c].tok_s:.1f} tok/s", file=sys.stderr)
    finally:
        procs.stop(proc)
    return rows
