#!/usr/bin/env python3
"""The gateway's cost: two workers driven directly vs through skiff-gateway.

    .venv/bin/python scripts/bench_gateway.py [--concurrency 8] [--requests 32]

One run, same machine:
- aggregate output tok/s of ``skiff-loadtest`` (closed loop, greedy,
  ``ignore_eos``) against the two workers directly (requests round-robin),
  through the gateway's ZeroMQ front and through its HTTP front (OpenAI
  ``/v1/completions``, streamed), ``--rounds`` times with the order rotating
  each round. Every measured load starts on fresh processes (two workers,
  and the gateway for its fronts): the workers' prefix caches are cold at
  the start of each, so no front inherits another's warm caches (with the
  same workers throughout, which front ran before decided more of a ratio
  than the front did). The ratio is taken against the mean of the direct
  runs (the bar: >= 0.97), beside the gateway process's CPU per load and
  the tokens the workers' forwards computed (the same requests and new
  tokens on every front: more computed is prompt prefixes missed in the
  caches) with the workers' prefix-cache counters (hits, misses, tokens
  reused, cached lanes evicted) that say where they were missed;
- the gateway's overhead per streamed message: round trips of a forwarded
  op (``tokenize`` of one word; the gateway answers ``ping`` itself)
  through the gateway minus direct ones, p50 over many, on an idle system;
  a round trip crosses the gateway twice, so a streamed token, which
  crosses it once, costs about half (the bar: <= 100 us p50), beside the
  same through a gateway that never spins before sleeping
  (``--poll-spin-us 0``, alternating sets); and the inter-token p50 of the
  loaded runs side by side.

Each worker gets one compute thread so the two do not fight over the two
cores; the gateway takes what is left, as it would on a real host.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _machine import cpu_flags  # noqa: E402

from loadtest import run_load  # noqa: E402
from protocol import Client  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def wait_ping(endpoint: str, proc: subprocess.Popen[bytes]) -> None:
    with Client(endpoint) as c:
        c.wait_ready(300, alive=lambda: proc.poll() is None)


def wait_http(url: str, timeout_s: float = 60) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url}/health never answered 200")


def round_trip_us(endpoint: str, n: int) -> list[float]:
    """Round trips of a cheap op every worker answers at once (``tokenize``)."""
    with Client(endpoint) as c:
        for _ in range(50):
            c.tokenize("hello")
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            c.tokenize("hello")
            out.append((time.perf_counter() - t0) * 1e6)
    return out


def bare_echo_us(tmp: Path, n: int) -> list[float]:
    """The floor: a pyzmq DEALER -> ROUTER echo between two processes, no skiff
    code (what one crossing of any Python ZeroMQ hop costs on this machine)."""
    endpoint = f"ipc://{tmp}/echo.sock"
    code = (
        "import zmq\n"
        f"s = zmq.Context().socket(zmq.ROUTER); s.bind({endpoint!r})\n"
        "while True:\n"
        "    s.send_multipart(s.recv_multipart(copy=False), copy=False)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        import zmq

        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(endpoint)
        for _ in range(100):
            sock.send(b"x")
            sock.recv()
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            sock.send(b"x")
            sock.recv()
            out.append((time.perf_counter() - t0) * 1e6)
        sock.close(linger=0)
        return out
    finally:
        proc.terminate()
        proc.wait(10)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker_counts(endpoints: list[str]) -> list[tuple[int, int]]:
    """Each worker's (requests served, tokens its forwards computed): with the
    same requests and new tokens on every front, a front whose workers compute
    more tokens lost prompt prefixes to cache misses."""
    out = []
    for ep in endpoints:
        with Client(ep) as c:
            stats = c.stats()
            out.append((int(stats["requests"]), int(stats["tokens_evaluated"])))
    return out


PREFIX_FIGURES = ("hits", "misses", "reused_tokens", "evictions")


def prefix_counts(endpoints: list[str]) -> dict[str, int]:
    """The workers' prefix-cache counters, summed: where the extra tokens a
    front computes come from (fewer hits, more evictions of cached lanes)."""
    total = dict.fromkeys(PREFIX_FIGURES, 0)
    for ep in endpoints:
        with Client(ep) as c:
            cache = c.stats().get("prefix_cache") or {}
        for key in PREFIX_FIGURES:
            total[key] += int(cache.get(key, 0))
    return total


def wait_routed(endpoint: str, timeout_s: float = 60) -> None:
    """Until the gateway forwards work (its own ``ping`` answers before any worker is up)."""
    deadline = time.monotonic() + timeout_s
    with Client(endpoint, timeout_ms=2_000) as c:
        while time.monotonic() < deadline:
            try:
                c.tokenize("hello")
                return
            except Exception:
                time.sleep(0.2)
    raise RuntimeError("the gateway never forwarded a request")


class Deployment:
    """Two fresh workers and a fresh gateway in front of them, stopped on exit.

    The gateway runs for every front (idle for the direct one), so each
    measured load sees the same processes on the machine."""

    def __init__(self, tmp: Path, args: argparse.Namespace) -> None:
        tmp.mkdir(parents=True)
        self.tmp, self.args = tmp, args
        self.procs: list[subprocess.Popen[bytes]] = []
        self.workers = [f"ipc://{tmp}/w{i}.sock" for i in range(2)]
        self.gateway = f"ipc://{tmp}/gw.sock"
        self.http = f"http://127.0.0.1:{free_port()}"

    def __enter__(self) -> Deployment:
        py, args, tmp = sys.executable, self.args, self.tmp
        try:
            for i, ep in enumerate(self.workers):
                cmd = [py, "-m", "worker.cli", "--bind", ep, "--threads", "1"]
                cmd += ["--lanes", "8", "--ctx", "8192", *shlex.split(args.worker_args)]
                self.procs.append(start(cmd, tmp / f"w{i}.log"))
            for ep, proc in zip(self.workers, self.procs, strict=True):
                wait_ping(ep, proc)
            http = ["--http", self.http[len("http://") :]]
            self._gateway = self.add_gateway(self.gateway, http)
            wait_http(self.http)
        except BaseException:
            self.__exit__()
            raise
        return self

    def add_gateway(self, endpoint: str, extra: list[str]) -> subprocess.Popen[bytes]:
        """A gateway in front of the two workers at ``endpoint`` (with the
        run's ``--gateway-args``, then ``extra``), once it forwards work."""
        cmd = [sys.executable, "-m", "gateway.cli", "--bind", endpoint]
        cmd += ["--policy", self.args.policy, "--log-level", "warning"]
        cmd += [*shlex.split(self.args.gateway_args), *extra]
        for ep in self.workers:
            cmd += ["--worker", ep]
        proc = start(cmd, self.tmp / f"gateway{len(self.procs)}.log")
        self.procs.append(proc)
        wait_ping(endpoint, proc)
        wait_routed(endpoint)
        return proc

    @property
    def gateway_pid(self) -> int:
        return self._gateway.pid

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


def load(endpoints: list[str], args: argparse.Namespace) -> dict[str, Any]:
    return run_load(
        endpoints=endpoints,
        concurrency=args.concurrency,
        requests=args.requests,
        max_tokens=args.max_tokens,
        ignore_eos=True,
        timeout_ms=300_000,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--pings", type=int, default=2000, help="round trips timed")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; the fronts' order rotates")
    ap.add_argument(
        "--policy",
        default="cache_aware",
        choices=("cache_aware", "least_loaded", "round_robin"),
        help="the gateway's routing policy (default: the gateway's own default)",
    )
    ap.add_argument("--gateway-args", default="", help="extra skiff-gateway flags")
    ap.add_argument("--worker-args", default="", help="extra skiff-worker flags")
    args = ap.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {}
    splits: dict[str, list[int]] = {}
    computed: dict[str, list[int]] = {}
    gw_cpu: dict[str, list[float]] = {}
    cache: dict[str, list[dict[str, int]]] = {}
    fronts = ["direct", "gateway (ZeroMQ)", "gateway (HTTP)"]
    with tempfile.TemporaryDirectory(prefix="skiff-gw-bench-") as tmp_s:
        tmp = Path(tmp_s)
        with Deployment(tmp / "rt", args) as d:  # the idle round trips, once
            # beside it a gateway that always sleeps (--poll-spin-us 0), in
            # alternating sets: what spinning before sleeping saves, same run
            sleeper = f"ipc://{tmp}/gw-sleep.sock"
            d.add_gateway(sleeper, ["--poll-spin-us", "0"])
            direct_rt, gw_rt, sleep_rt = [], [], []
            for _ in range(3):
                direct_rt += round_trip_us(d.workers[0], args.pings // 3)
                gw_rt += round_trip_us(d.gateway, args.pings // 3)
                sleep_rt += round_trip_us(sleeper, args.pings // 3)
        echo_rt = bare_echo_us(tmp, args.pings)
        for r in range(args.rounds):
            # the order rotates each round: drift on a noisy machine hits every front alike
            for name in fronts[r % 3 :] + fronts[: r % 3]:
                with Deployment(tmp / f"r{r}-{fronts.index(name)}", args) as d:
                    eps = {"direct": d.workers, "gateway (ZeroMQ)": [d.gateway]}
                    before = worker_counts(d.workers)
                    cache0 = prefix_counts(d.workers)
                    cpu0 = cpu_seconds(d.gateway_pid)
                    runs.setdefault(name, []).append(load(eps.get(name, [d.http]), args))
                    gw_cpu.setdefault(name, []).append(cpu_seconds(d.gateway_pid) - cpu0)
                    after = worker_counts(d.workers)
                    cache1 = prefix_counts(d.workers)
                cache.setdefault(name, []).append({k: cache1[k] - cache0[k] for k in cache1})
                split = [b[0] - a[0] for a, b in zip(before, after, strict=True)]
                tokens = sum(b[1] - a[1] for a, b in zip(before, after, strict=True))
                computed.setdefault(name, []).append(tokens)
                splits[name] = [x + y for x, y in zip(splits.get(name, [0, 0]), split, strict=True)]

    def tok_s(name: str) -> float:
        return statistics.mean(r["throughput"]["output_tok_s"] for r in runs[name])

    base = tok_s("direct")
    print(
        f"2 workers (1 thread each), closed loop c={args.concurrency}, "
        f"{args.requests} requests x {args.max_tokens} tokens, {args.rounds} alternating rounds, "
        "fresh processes (cold caches) for every load"
    )
    print(f"  CPU flags: {cpu_flags()}")
    for name, rs in runs.items():
        each = " / ".join(f"{r['throughput']['output_tok_s']:.1f}" for r in rs)
        itl = statistics.mean(r["itl_ms"]["p50"] for r in rs)
        errors = sum(r["requests"]["errors"] for r in rs)
        extra = f" | requests per worker {splits[name]}" if name in splits else ""
        wall = statistics.mean(r["duration_s"] for r in rs)
        cpu = statistics.mean(gw_cpu[name])
        extra += f" | gateway CPU {cpu:.1f} s ({cpu / wall:.0%} of a core)"
        extra += f" | tokens computed {statistics.mean(computed[name]):.0f} a run"
        per = {k: statistics.mean(c[k] for c in cache[name]) for k in PREFIX_FIGURES}
        extra += (
            f" | prefix cache a run: hits {per['hits']:.0f}, misses {per['misses']:.0f}, "
            f"reused {per['reused_tokens']:.0f} tokens, evictions {per['evictions']:.0f}"
        )
        print(
            f"  {name:17s} {tok_s(name):6.1f} tok/s ({each}) | ratio to direct "
            f"{tok_s(name) / base:.3f} | ITL p50 {itl:.1f} ms | errors {errors}{extra}"
        )
    d50, g50 = statistics.median(direct_rt), statistics.median(gw_rt)
    print(
        f"  tokenize round trip p50: direct {d50:.0f} us | through the gateway {g50:.0f} us | "
        f"extra {g50 - d50:.0f} us per round trip = ~{(g50 - d50) / 2:.0f} us per message "
        f"(a streamed token crosses once; bar <= 100 us)"
    )
    s50 = statistics.median(sleep_rt)
    print(
        f"  the same through a gateway that never spins (--poll-spin-us 0): {s50:.0f} us, "
        f"~{(s50 - d50) / 2:.0f} us per message"
    )
    e50 = statistics.median(echo_rt)
    print(
        f"  floor, same run: bare pyzmq echo between two processes p50 {e50:.0f} us "
        f"(~{e50 / 2:.0f} us per crossing); gateway extra per message = "
        f"{(g50 - d50) / 2 / (e50 / 2):.2f} x one bare crossing"
    )


if __name__ == "__main__":
    main()
