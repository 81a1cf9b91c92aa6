"""Serving throughput: skiff over ZeroMQ against the raw engine and HTTP peers.

One run, one system after another (never concurrently: 2 noisy cores), at
concurrency 1, 4 and 8, each request 128 new tokens (EOS suppressed) after
one of a fixed set of 128-token prompts, 2 compute threads everywhere:

  raw              the engine in-process: N sequences prefilled, then one
                   ``llama_decode`` per step carrying one token of each
                   sequence, greedy via ``Engine.greedy``; no sockets (the ceiling)
  skiff            ``python -m worker.cli --lanes 8 --threads 2`` over ipc://,
                   driven closed-loop by ``loadtest.run_load`` (N users,
                   N*k requests)
  llama_cpp.server llama-cpp-python's OpenAI server, N threads streaming
                   ``/v1/completions`` (EOG tokens suppressed by ``logit_bias``)
  llama-server     llama.cpp's C++ server, only with ``--llama-server PATH``
                   (``--parallel 8``, ``ignore_eos``)

Aggregate tok/s = all completion tokens / wall time of the whole batch of
requests (prefills included). Also: skiff TTFT p50 at c=1 and c=8, and the
``ping`` round trip of a separate DEALER pinging every 20 ms during the c=8
skiff run, beside skiff's mean scheduler turn (``mean_forward_ms`` over that
run). Figures to reach are printed at the end.

    .venv/bin/python scripts/bench_serving.py [--quick] [--k 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loadtest import percentile, run_load  # noqa: E402
from loadtest.prompts import make_text  # noqa: E402
from protocol import Client, SkiffError  # noqa: E402
from worker.models import default_model_path  # noqa: E402

THREADS = 2
LANES = 8
N_CTX = 8192  # the worker's default --ctx: 1024 cells per lane at 8 lanes
PROMPT_TOKENS = 128
N_PROMPTS = 16
PING_INTERVAL_S = 0.020


@dataclass
class Row:
    """One system at one concurrency."""

    tok_s: float
    tokens: int
    wall_s: float
    requests: int
    errors: int = 0
    ttft_p50_ms: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# -- processes -----------------------------------------------------------------------


class Procs:
    """Every subprocess this run starts; all are ended on exit, even on error."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen[bytes]] = []

    def start(self, cmd: Sequence[str], log: Path, **kw: Any) -> subprocess.Popen[bytes]:
        with log.open("wb") as out:
            proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, **kw)
        self._procs.append(proc)
        return proc

    def track(self, proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        self._procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if proc in self._procs:
            self._procs.remove(proc)

    def stop_all(self) -> None:
        for proc in list(self._procs):
            self.stop(proc)


def cpu_busy(seconds: float = 1.0) -> float | None:
    """Fraction of all CPUs busy over ``seconds`` (from /proc/stat), None if unknown."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return idle, sum(fields)

    try:
        idle0, total0 = sample()
        time.sleep(seconds)
        idle1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    total = total1 - total0
    return None if total <= 0 else 1.0 - (idle1 - idle0) / total


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(
    check: Callable[[], bool],
    proc: subprocess.Popen[bytes],
    what: str,
    log: Path,
    timeout_s: float = 180.0,
) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise RuntimeError(f"{what} did not become ready:\n{tail}")
        time.sleep(0.25)


# -- prompts -------------------------------------------------------------------------


def build_prompts(tokenize: Callable[[str], list[int]]) -> list[str]:
    """``N_PROMPTS`` distinct prose prompts of exactly (or just under) 128 tokens.

    Counted with the model's tokenizer including BOS, as skiff and
    llama-cpp-python both tokenize a fresh prompt.
    """
    out = []
    for seed in range(N_PROMPTS):
        lo, hi = 1, PROMPT_TOKENS  # words; ~1.15 tokens a word
        while lo < hi:  # largest word count whose text fits
            mid = (lo + hi + 1) // 2
            if len(tokenize(make_text(mid, seed=500 + seed))) <= PROMPT_TOKENS:
                lo = mid
            else:
                hi = mid - 1
        out.append(make_text(lo, seed=500 + seed))
    return out


# -- (a) the raw engine ----------------------------------------------------------------


def bench_raw(
    model: str,
    concurrencies: Sequence[int],
    k: int,
    n_new: int,
    prompts_out: list[str],
    eog_out: list[int],
    lengths_out: list[int],
    measure: bool = True,
) -> dict[int, Row]:
    from worker.engine import Engine, EngineConfig, Segment

    engine = Engine(EngineConfig(model_path=model, n_ctx=N_CTX, n_seq=LANES, n_threads=THREADS))
    try:
        prompts_out.extend(build_prompts(engine.tokenize))
        eog_out.extend(t for t in range(engine.n_vocab) if engine.is_eog(t))
        token_lists = [engine.tokenize(p) for p in prompts_out]
        lengths_out.extend(len(t) for t in token_lists)

        def round_(seqs: list[int], prompts: list[list[int]], steps: int) -> list[float]:
            """Prefill each sequence's prompt, then decode ``steps-1`` batched steps."""
            for s in seqs:
                engine.seq_clear(s)
            last: dict[int, int] = {}
            pos: dict[int, int] = {}
            pending = list(zip(seqs, prompts, strict=True))
            while pending:  # pack prompts into batches of at most n_batch tokens
                batch: list[tuple[int, list[int]]] = []
                used = 0
                while pending and used + len(pending[0][1]) <= engine.n_batch:
                    batch.append(pending.pop(0))
                    used += len(batch[-1][1])
                status = engine.decode([Segment(s, toks, 0, "last") for s, toks in batch])
                if not status.ok:
                    raise RuntimeError(f"raw prefill failed: {status.describe()}")
                for i, (s, toks) in enumerate(batch):
                    last[s] = engine.greedy(engine.output_index(i))
                    pos[s] = len(toks)
            step_s: list[float] = []
            for _ in range(steps - 1):
                t = time.perf_counter()
                status = engine.decode([Segment(s, [last[s]], pos[s], "last") for s in seqs])
                if not status.ok:
                    raise RuntimeError(f"raw decode failed: {status.describe()}")
                for i, s in enumerate(seqs):
                    last[s] = engine.greedy(engine.output_index(i))
                    pos[s] += 1
                step_s.append(time.perf_counter() - t)
            return step_s

        rows: dict[int, Row] = {}
        if not measure:
            return rows
        round_([0], [token_lists[0]], 8)  # warm-up
        for c in concurrencies:
            t0 = time.perf_counter()
            steps: list[float] = []
            for r in range(k):
                chosen = [token_lists[(r * c + i) % len(token_lists)] for i in range(c)]
                steps += round_(list(range(c)), chosen, n_new)
            wall = time.perf_counter() - t0
            tokens = c * k * n_new
            rows[c] = Row(
                tokens / wall,
                tokens,
                wall,
                c * k,
                extra={"decode_step_ms": 1e3 * statistics.fmean(steps)},
            )
            print(f"  raw c={c}: {rows[c].tok_s:.1f} tok/s", file=sys.stderr)
        return rows
    finally:
        engine.close()


# -- (b) skiff over ZeroMQ ----------------------------------------------------------------

PINGER = r"""
import itertools, json, sys, threading, time
sys.path.insert(0, sys.argv[3])
import zmq
from protocol import transport, envelope
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
    sock.send(transport.encode(envelope.request(rid, "ping")))
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


STAGGER_S = 0.5


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
            if c == max(concurrencies):
                with pinger(procs, endpoint) as ping_result:
                    summary = run_load(concurrency=c, requests=c * k, **common)
                ping = dict(ping_result)
            else:
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
                },
            )
            if c == max(concurrencies):
                ping["mean_turn_ms"] = turn_ms
                ping["turn_p99_ms"] = after["forward_ms"]["p99"]
                ping["turn_max_ms"] = after["forward_ms"]["max"]
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


# -- (c)/(d) HTTP servers -------------------------------------------------------------------


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


# -- report --------------------------------------------------------------------------------------


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def report(
    systems: dict[str, dict[int, Row]],
    ping: dict[str, Any],
    cs: Sequence[int],
    n_new: int,
    k: int,
    prompts_tokens: tuple[int, int],
) -> list[str]:
    lines = [
        f"aggregate output tok/s: {n_new} new tokens/request (EOS suppressed), "
        f"{k} requests per concurrent user, prompts of {prompts_tokens[0]}-{prompts_tokens[1]} "
        f"tokens, {THREADS} threads",
        f"{'system':<20}" + "".join(f"{'c=' + str(c):>10}" for c in cs),
    ]
    for name, rows in systems.items():
        lines.append(
            f"{name:<20}" + "".join(f"{fmt(rows[c].tok_s) if c in rows else '-':>10}" for c in cs)
        )
    skiff = systems.get("skiff", {})
    lines.append("")
    for name, rows in systems.items():
        if name == "skiff":
            continue
        cells = [
            fmt(
                ratio(skiff[c].tok_s if c in skiff else None, rows[c].tok_s if c in rows else None),
                ".2f",
            )
            for c in cs
        ]
        lines.append(f"{'skiff / ' + name:<20}" + "".join(f"{x:>10}" for x in cells))
    lines.append("")
    lines.append(f"{'TTFT p50 ms':<20}" + "".join(f"{'c=' + str(c):>10}" for c in cs))
    for name, rows in systems.items():
        if any(rows[c].ttft_p50_ms is not None for c in cs if c in rows):
            lines.append(
                f"{name:<20}"
                + "".join(f"{fmt(rows[c].ttft_p50_ms if c in rows else None):>10}" for c in cs)
            )
    errs = {n: sum(r.errors for r in rows.values()) for n, rows in systems.items()}
    if any(errs.values()):
        lines.append("errors: " + ", ".join(f"{n}={e}" for n, e in errs.items() if e))
    for name, rows in systems.items():
        short = {c: r.tokens for c, r in rows.items() if r.tokens != r.requests * n_new}
        if short:
            lines.append(f"WARNING {name}: fewer tokens than requested at c={sorted(short)}")
    raw = systems.get("raw", {})
    if raw:
        lines.append(
            f"{'raw decode step ms':<20}"
            + "".join(
                f"{fmt(raw[c].extra.get('decode_step_ms') if c in raw else None, '.2f'):>10}"
                for c in cs
            )
        )
    if skiff:
        lines.append(
            f"{'skiff mean turn ms':<20}"
            + "".join(
                f"{fmt(skiff[c].extra.get('mean_turn_ms') if c in skiff else None, '.2f'):>10}"
                for c in cs
            )
        )

    c_lo, c_hi = min(cs), max(cs)
    prof = skiff[c_hi].extra.get("profile_ms_per_forward") if c_hi in skiff else None
    if prof:
        lines.append("")
        lines.append(f"skiff c={c_hi}: where a turn's time goes, ms per forward (stats.profile)")
        for part, ms in prof.items():
            lines.append(f"  {part:<24}{ms:8.3f}  {100 * ms / prof['wall']:5.1f}%")
    ttft_lo = skiff[c_lo].extra.get("ttft_staggered_p50_ms") if c_lo in skiff else None
    ttft_hi = skiff[c_hi].extra.get("ttft_staggered_p50_ms") if c_hi in skiff else None
    lines.append("")
    lines.append(
        f"skiff TTFT p50 (users started {STAGGER_S} s apart): "
        f"c={c_lo} {fmt(ttft_lo)} ms, c={c_hi} {fmt(ttft_hi)} ms, "
        f"ratio {fmt(ratio(ttft_hi, ttft_lo), '.2f')}"
    )
    samples = ping.get("samples_ms") or []
    p50 = percentile(samples, 50) if samples else None
    p99 = percentile(samples, 99) if samples else None
    turn = ping.get("mean_turn_ms")
    turn_p99 = ping.get("turn_p99_ms")
    lines.append(
        f"ping during {c_hi} skiff streams: n={len(samples)} lost={ping.get('lost', '-')} "
        f"p50 {fmt(p50, '.2f')} ms, p99 {fmt(p99, '.2f')} ms; "
        f"skiff scheduler turn mean {fmt(turn, '.2f')} ms, p99 {fmt(turn_p99, '.2f')} ms, "
        f"max {fmt(ping.get('turn_max_ms'), '.2f')} ms"
    )

    def target(label: str, value: float | None, goal: float, le: bool = False) -> str:
        if value is None:
            return f"  {label}: - (not measured)"
        met = value <= goal if le else value >= goal
        return f"  {label}: {value:.2f} {'OK' if met else 'MISSED'}"

    lines.append("")
    lines.append("figures to reach:")
    r_raw = ratio(
        skiff[c_hi].tok_s if c_hi in skiff else None, raw[c_hi].tok_s if c_hi in raw else None
    )
    lines.append(target(f"skiff c{c_hi} / raw c{c_hi} >= 0.97", r_raw, 0.97))
    peer = systems.get("llama_cpp.server", {})
    r_peer = ratio(
        skiff[c_hi].tok_s if c_hi in skiff else None, peer[c_hi].tok_s if c_hi in peer else None
    )
    lines.append(target(f"skiff c{c_hi} / llama_cpp.server c{c_hi} >= 3", r_peer, 3.0))
    lines.append(
        target(f"TTFT p50 c{c_hi} / TTFT p50 c{c_lo} <= 2", ratio(ttft_hi, ttft_lo), 2.0, le=True)
    )
    # A ping waits for at most the forward in progress. Pings land in long
    # (prefill) turns more often than short ones, so the bound is the longest turn.
    lines.append(
        target("ping p99 / longest turn <= 1", ratio(p99, ping.get("turn_max_ms")), 1.0, le=True)
    )
    return lines


# -- main ------------------------------------------------------------------------------------------


def py_server_cmd(model: str, port: int) -> list[str]:
    return [sys.executable, "-m", "llama_cpp.server", "--model", model,
            "--n_threads", str(THREADS), "--n_threads_batch", str(THREADS),
            "--host", "127.0.0.1", "--port", str(port),
            # Default True: a new request interrupts the one streaming; we want them queued.
            "--interrupt_requests", "False"]  # fmt: skip


def cpp_server_cmd(binary: str, model: str, port: int) -> list[str]:
    return [binary, "-m", model, "--threads", str(THREADS), "--threads-batch", str(THREADS),
            "--parallel", str(LANES), "--ctx-size", str(N_CTX),
            "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: k=1, 32 new tokens")
    parser.add_argument("--k", type=int, default=None, help="requests per concurrent user [4]")
    parser.add_argument("--tokens", type=int, default=None, help="new tokens/request [128]")
    parser.add_argument("--concurrency", default="1,4,8", help="comma-separated levels")
    parser.add_argument("--llama-server", help="path of llama.cpp's llama-server binary")
    parser.add_argument(
        "--skip", action="append", default=[], help="skip a system: raw, skiff, llama_cpp.server"
    )
    parser.add_argument("--json", dest="json_path", help="write all figures here")
    args = parser.parse_args()
    k = args.k or (1 if args.quick else 4)
    n_new = args.tokens or (32 if args.quick else 128)
    cs = sorted({int(x) for x in args.concurrency.split(",")})
    if max(cs) > LANES or min(cs) < 1:
        parser.error(f"concurrency levels must be within 1..{LANES} (the lanes)")

    # SIGTERM/SIGHUP end the run like Ctrl-C, so the finally below stops the servers.
    def _term(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGHUP, _term)

    model = str(default_model_path())
    procs = Procs()
    systems: dict[str, dict[int, Row]] = {}
    ping: dict[str, Any] = {}
    prompts: list[str] = []
    eog: list[int] = []
    lengths: list[int] = []
    failed: list[str] = []
    t_start = time.perf_counter()

    background: dict[str, float | None] = {}

    def guarded(name: str, fn: Callable[[], dict[int, Row]]) -> None:
        """Run one system; a failure is reported and the others still run."""
        background[name] = cpu_busy()
        try:
            rows = fn()
        except Exception as exc:
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
            print(f"  {name} FAILED: {exc}", file=sys.stderr)
            return
        if rows:
            systems[name] = rows

    print(f"model {model}; concurrency {cs}; k={k}; {n_new} new tokens", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="skiff-bench-") as tmp_name:
        tmp = Path(tmp_name)
        try:
            # The engine also builds the prompts and the EOG list, so it always loads.
            measure_raw = "raw" not in args.skip
            guarded(
                "raw", lambda: bench_raw(model, cs, k, n_new, prompts, eog, lengths, measure_raw)
            )
            if not prompts:
                raise SystemExit("bench_serving: could not build prompts with the engine")
            if "skiff" not in args.skip:

                def skiff() -> dict[int, Row]:
                    rows, ping_result = bench_skiff(procs, tmp, cs, k, n_new, prompts)
                    ping.update(ping_result)
                    return rows

                guarded("skiff", skiff)
            if "llama_cpp.server" not in args.skip:
                bias = {str(t): -1e9 for t in eog}  # llama-cpp-python stops on any EOG token
                port = free_port()

                def body_py(prompt: str) -> dict[str, Any]:
                    return {"prompt": prompt, "max_tokens": n_new, "temperature": 0.0,
                            "stream": True, "logit_bias": bias}  # fmt: skip

                guarded("llama_cpp.server", lambda: bench_http(
                    procs, "llama_cpp.server", py_server_cmd(model, port), port, "/v1/models",
                    tmp / "llama_cpp_server.log", body_py, cs, k, n_new, prompts))  # fmt: skip
            if args.llama_server:
                cport = free_port()

                def body_cpp(prompt: str) -> dict[str, Any]:
                    return {"prompt": prompt, "max_tokens": n_new, "temperature": 0.0,
                            "stream": True, "ignore_eos": True}  # fmt: skip

                guarded("llama-server", lambda: bench_http(
                    procs, "llama-server", cpp_server_cmd(args.llama_server, model, cport),
                    cport, "/health", tmp / "llama_server.log", body_cpp, cs, k, n_new,
                    prompts))  # fmt: skip
        finally:
            procs.stop_all()

    prompt_range = (min(lengths), max(lengths))
    print()
    for line in report(systems, ping, cs, n_new, k, prompt_range):
        print(line)
    for line in failed:
        print(f"FAILED {line}")
    print(
        "CPU busy (other processes) in the second before each system: "
        + ", ".join(
            f"{n} {fmt(None if b is None else 100 * b, '.0f')}%" for n, b in background.items()
        )
    )
    print(f"\n(total bench time {time.perf_counter() - t_start:.0f} s)")
    if args.json_path:
        out = {
            "config": {
                "concurrency": cs,
                "k": k,
                "new_tokens": n_new,
                "threads": THREADS,
                "lanes": LANES,
                "prompt_tokens": prompt_range,
                "model": model,
            },
            "systems": {
                n: {str(c): vars(r) for c, r in rows.items()} for n, rows in systems.items()
            },
            "ping": ping,
            "failed": failed,
            "cpu_busy_before": background,
        }
        Path(args.json_path).write_text(json.dumps(out, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
