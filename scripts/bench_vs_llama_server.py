"""skiff against llama.cpp's own llama-server, scenario by scenario, same run.

Both systems serve the packaged model with 2 threads and 8 lanes / slots
(``--parallel 8``, 8192 cells), greedy, EOS ignored, 128 new tokens per
request, streamed. All systems are up at once, one runs at a time (2 noisy
cores), and each workload runs on every system back to back, the order
alternating, so a cell's ratio compares runs seconds apart. Every user is a
thread sending its requests one after another (closed loop):

  distinct   every prompt is new (nothing a cache could reuse)
  repeated   each user sends its first prompt again on its 3rd request
  chat       each request = the previous prompt + its reply + a follow-up,
             sent whole, as a chat client of a stateless API does

Arrivals: ``burst`` (all users start together) and ``staggered`` (0.5 s
apart). Prompts are ~128 tokens, token ids sent to both systems. Printed per
scenario, arrival and concurrency: aggregate tok/s (completion tokens / wall
time), TTFT p50, inter-token latency p50 / p99, the median step (the time
between two arrivals of tokens) with ITL p99 over it (bar: <= 3), and the
skiff / llama-server ratios. ``--cold-prefix`` adds the TTFT of a 1,000-token prompt cold vs with
the prefix cached.

    .venv/bin/python scripts/build_llama_server.py     # once, ~10 min
    .venv/bin/python scripts/bench_vs_llama_server.py [--concurrency 1,4,8]
        [--scenarios distinct,repeated,chat] [--arrivals burst,staggered]
        [--skiff-args "--kernels upstream"] [--json out.json]
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from _machine import cpu_flags  # noqa: E402
from build_llama_server import built  # noqa: E402

from loadtest.prompts import prompt_of_tokens  # noqa: E402
from protocol import Client  # noqa: E402
from worker.models import default_model_path  # noqa: E402

THREADS, LANES, N_CTX, NEW_TOKENS, REQUESTS = 2, 8, 8192, 128, 4
FOLLOW_UP = " Tell me more about that, please."
STEP_S = 0.001  # gaps shorter than this are tokens of one arrival (see Result.row)


@dataclass
class Record:
    ttft: float
    gaps: list[float]
    tokens: list[int]


@dataclass
class Result:
    wall: float
    records: list[Record] = field(default_factory=list)

    def row(self) -> dict[str, float]:
        tokens = sum(len(r.tokens) for r in self.records)
        gaps = sorted(g for r in self.records for g in r.gaps)
        ttfts = sorted(r.ttft for r in self.records)

        def pct(xs: list[float], q: float) -> float:
            return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")

        # A step is one arrival of tokens: the tokens of one speculative span
        # (skiff) or one SSE chunk arrive microseconds apart, so gaps under
        # STEP_S are inside a step, not between steps.
        steps = [g for g in gaps if g >= STEP_S]
        return {
            "tok_s": tokens / self.wall,
            "ttft_p50": pct(ttfts, 0.5),
            "itl_p50": pct(gaps, 0.5),
            "itl_p99": pct(gaps, 0.99),
            "step_p50": pct(steps, 0.5),
        }


# -- the two systems, one method each -------------------------------------------------


class Skiff:
    def __init__(self, model: str, extra: list[str], name: str = "skiff") -> None:
        self.name = name
        self.tmp = tempfile.mkdtemp()
        self.endpoint = f"ipc://{self.tmp}/w.sock"
        cmd = [sys.executable, "-m", "worker.cli", "--bind", self.endpoint, "--model", model,
               "--lanes", str(LANES), "--ctx", str(N_CTX), "--threads", str(THREADS),
               "--log-level", "warning", *extra]  # fmt: skip
        self.proc = subprocess.Popen(cmd, cwd=ROOT)
        with Client(self.endpoint) as c:
            c.wait_ready(120, alive=lambda: self.proc.poll() is None)

    def complete(self, tokens: list[int]) -> Record:
        args = {"tokens": tokens, "max_tokens": NEW_TOKENS, "ignore_eos": True}
        out: list[int] = []
        stamps: list[float] = []
        t0 = time.perf_counter()
        with Client(self.endpoint, timeout_ms=600_000) as c:
            for ev in c.generate(args):
                if ev.header.get("event") == "token":
                    stamps.append(time.perf_counter())
                    out.append(ev.header["token"])
        return Record(stamps[0] - t0, [b - a for a, b in itertools.pairwise(stamps)], out)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


class LlamaServer:
    def __init__(
        self, binary: str, model: str, extra: tuple[str, ...] = (), name: str = "llama-server"
    ) -> None:
        self.name = name
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [binary, "-m", model, "--threads", str(THREADS), "--threads-batch", str(THREADS),
               "--parallel", str(LANES), "--ctx-size", str(N_CTX),
               "--host", "127.0.0.1", "--port", str(self.port), *extra]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError("llama-server did not become healthy")

    def complete(self, tokens: list[int]) -> Record:
        body = {
            "prompt": tokens,
            "n_predict": NEW_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "temperature": 0.0,
            "top_k": 1,
            "cache_prompt": True,
            "return_tokens": True,
        }
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        t0 = time.perf_counter()
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        out: list[int] = []
        stamps: list[float] = []
        while line := resp.readline():
            if not line.startswith(b"data:"):
                continue
            data = json.loads(line[5:])
            got = data.get("tokens") or []
            if got:
                now = time.perf_counter()
                stamps.extend([now] * len(got))
                out.extend(got)
            if data.get("stop"):
                break
        conn.close()
        return Record(stamps[0] - t0, [b - a for a, b in itertools.pairwise(stamps)], out)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


# -- workloads -----------------------------------------------------------------------


def run(system: Any, scenario: str, c: int, stagger: float, prompts: list[list[int]],
        follow: list[int]) -> Result:  # fmt: skip
    """One workload. ``prompts`` are this run's own (no other run saw them), so
    only what the scenario repeats can come from a cache."""
    records: list[Record] = []
    lock = threading.Lock()

    def user(u: int) -> None:
        time.sleep(u * stagger)
        prompt = prompts[u * REQUESTS]
        for r in range(REQUESTS):
            if scenario == "distinct":
                prompt = prompts[u * REQUESTS + r]
            elif scenario == "repeated":
                prompt = prompts[u * REQUESTS + (0 if r == 2 else r)]
            rec = system.complete(prompt)
            with lock:
                records.append(rec)
            if scenario == "chat":
                prompt = prompt + rec.tokens + follow

    threads = [threading.Thread(target=user, args=(u,)) for u in range(c)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return Result(time.perf_counter() - t0, records)


def cold_vs_cached(system: Any, prefix: list[int], tail: list[list[int]]) -> tuple[float, float]:
    """TTFT of a 1,000-token prompt cold, then of prompts sharing its prefix."""
    cold = system.complete(prefix + tail[0]).ttft
    warm = statistics.median(system.complete(prefix + t).ttft for t in tail[1:])
    return cold, warm


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--scenarios", default="distinct,repeated,chat")
    parser.add_argument("--arrivals", default="burst,staggered")
    parser.add_argument("--llama-server", help="llama-server binary (default: the cached build)")
    parser.add_argument("--skiff-args", default="", help="extra skiff-worker flags")
    parser.add_argument(
        "--systems",
        default="skiff,skiff-upstream,llama-server",
        help="skiff (default flags), skiff-upstream (--kernels upstream), "
        "skiff-nospec (--speculate off), llama-server",
    )
    parser.add_argument("--cold-prefix", action="store_true", help="also the 1,000-token TTFT")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    binary = args.llama_server or (str(built()) if built() else None)
    if binary is None:
        sys.exit("no llama-server: run scripts/build_llama_server.py or pass --llama-server")
    model = str(default_model_path())
    levels = [int(x) for x in args.concurrency.split(",")]
    scenarios = [s for s in args.scenarios.split(",") if s and s != "none"]
    arrivals = {"burst": 0.0, "staggered": 0.5}
    chosen = [a for a in args.arrivals.split(",") if a in arrivals]

    runs = [(s, a, c) for s in scenarios for a in chosen for c in levels]
    prompts, follow, prefix, tails = _token_ids(model, len(runs) * max(levels) * REQUESTS + 1)
    results: dict[str, dict[str, dict[str, float]]] = {}
    makers: dict[str, Callable[[], Any]] = {
        "skiff": lambda: Skiff(model, shlex.split(args.skiff_args)),
        "skiff-upstream": lambda: Skiff(
            model, ["--kernels", "upstream", *shlex.split(args.skiff_args)], "skiff-upstream"
        ),
        "skiff-nospec": lambda: Skiff(
            model, ["--speculate", "off", *shlex.split(args.skiff_args)], "skiff-nospec"
        ),
        "llama-server": lambda: LlamaServer(binary, model),
    }
    # Every system is up at once and each workload runs on all of them back to
    # back (the order alternating from one workload to the next), so the ratio
    # of a cell compares runs seconds apart: on a shared host the speed of the
    # machine drifts by 20% over the minutes a whole pass takes.
    systems: list[Any] = []
    try:
        for name in args.systems.split(","):
            systems.append(makers[name]())
            systems[-1].complete(prompts[-1])  # warm-up
        per_run = max(levels) * REQUESTS
        for i, (scenario, arrival, c) in enumerate(runs):
            own = prompts[i * per_run : (i + 1) * per_run]
            key = f"{scenario} {arrival} c={c}"
            for system in systems if i % 2 == 0 else systems[::-1]:
                out = results.setdefault(system.name, {})
                out[key] = run(system, scenario, c, arrivals[arrival], own, follow).row()
                print(f"  {system.name:<13} {key:<24} {out[key]['tok_s']:6.1f} tok/s "
                      f"TTFT p50 {out[key]['ttft_p50']:7.1f} ms  ITL p50/p99 "
                      f"{out[key]['itl_p50']:6.1f}/{out[key]['itl_p99']:7.1f} ms",
                      file=sys.stderr, flush=True)  # fmt: skip
        if args.cold_prefix:
            for system in systems:
                cold, warm = cold_vs_cached(system, prefix, tails)
                results.setdefault(system.name, {})["cached 1000-token prefix"] = {
                    "cold_ttft": cold * 1000,
                    "warm_ttft": warm * 1000,
                }
    finally:
        for system in systems:
            system.close()
    report(results)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2))
    return 0


def _token_ids(
    model: str, count: int
) -> tuple[list[list[int]], list[int], list[int], list[list[int]]]:
    """Prompts as token ids (both systems get the same ids), tokenized in-process."""
    from worker.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model_path=model, n_ctx=512, n_seq=1, n_threads=THREADS))
    try:
        tok = engine.tokenize
        # A run number in front makes every prompt unique even where the
        # generated prose repeats.
        prompts = [tok(f"[{seed}] " + prompt_of_tokens(128, seed)) for seed in range(count)]
        follow = tok(FOLLOW_UP, add_special=False)
        prefix = tok(prompt_of_tokens(1000, 999))[:1000]
        tails = [tok(f" Question {i}: what happened next?", add_special=False) for i in range(4)]
        return prompts, follow, prefix, tails
    finally:
        engine.close()


def report(results: dict[str, dict[str, dict[str, float]]]) -> None:
    peer = results.get("llama-server", {})
    for name in ("skiff", "skiff-upstream", "skiff-nospec"):
        if name in results:
            _table(name, results[name], peer)
    for name, rows in results.items():
        cached = rows.get("cached 1000-token prefix")
        if cached:
            ratio = cached["warm_ttft"] / cached["cold_ttft"]
            print(f"{name}: 1,000-token prefix TTFT cold {cached['cold_ttft']:.0f} ms, cached "
                  f"{cached['warm_ttft']:.0f} ms, ratio {ratio:.2f} (target <= 0.2)")  # fmt: skip


Rows = dict[str, dict[str, float]]


def _table(name: str, skiff: Rows, peer: Rows) -> None:
    print(f"\n{name} / llama-server (CPU flags: {cpu_flags()})")
    # ITL p99 / step: the bar is <= 3 (a token's worst gap against the median
    # step, the time between two arrivals; ITL p50 is 0 when several tokens
    # of a speculative span arrive at once, so p99 / p50 says nothing then)
    print(f"{'workload':<26}{'tok/s s/l':>16}{'ratio':>7}{'TTFT p50 s/l ms':>20}"
          f"{'ITL p99 s/l ms':>18}{'step p50 s/l':>15}{'p99/step s/l':>15}")  # fmt: skip
    for key, s in skiff.items():
        p = peer.get(key)
        if p is None or "tok_s" not in s:
            continue
        tok = f"{s['tok_s']:>7.1f}/{p['tok_s']:<8.1f}{s['tok_s'] / p['tok_s']:>7.2f}"
        ttft = f"{s['ttft_p50']:>10.0f}/{p['ttft_p50']:<9.0f}"
        itl = f"{s['itl_p99']:>9.0f}/{p['itl_p99']:<8.0f}"
        step = f"{s['step_p50']:>8.0f}/{p['step_p50']:<6.0f}"
        per = f"{s['itl_p99'] / s['step_p50']:>8.1f}/{p['itl_p99'] / p['step_p50']:<6.1f}"
        print(f"{key:<26}{tok}{ttft}{itl}{step}{per}")


if __name__ == "__main__":
    sys.exit(main())
