"""How ``scripts/bench_stages.py`` starts workers and stages and measures them.

Why a module of its own: starting a worker or a stage on ``ipc://`` and
waiting until it answers, the loads (concurrent or staggered generations,
streamed ones with TTFT and ITL), the greedy decode step with its logits,
the wire bytes of a hidden row, and the per-process profile table are
shared by the default comparison and ``--pinned`` (and ``start`` by
``scripts/check_determinism.py``).
"""

from __future__ import annotations

import itertools
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from protocol import Client, frames, transport

ROOT = Path(__file__).resolve().parent.parent

PROMPTS = [
    f"Story {i}: once upon a time in a village by the {w}, there lived"
    for i, w in enumerate(["sea", "hill", "river", "wood", "lake", "road", "bay", "field"])
]


def start(
    tmp: Path, name: str, *args: str, threads: int = 2
) -> tuple[subprocess.Popen[bytes], str]:
    endpoint = f"ipc://{tmp}/{name}.sock"
    log = (tmp / f"{name}.log").open("wb")
    cmd = [
        sys.executable, "-m", "worker.cli", "--bind", endpoint, "--threads", str(threads), *args,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    with Client(endpoint) as c:
        c.wait_ready(300, alive=lambda: proc.poll() is None)
    return proc, endpoint


_CALLS = itertools.count()


def concurrently(one: Callable[[int], None], n: int) -> float:
    """Run ``one(0) .. one(n - 1)`` on threads at once; the wall seconds."""
    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def generations(
    endpoint: str, streams: int, max_tokens: int, gap_ms: int = 0, prompt_repeat: int = 1
) -> float:
    """Aggregate tok/s of ``streams`` concurrent generations, started
    ``gap_ms`` apart (0: all at once)."""
    done = [0] * streams

    def one(i: int) -> None:
        time.sleep(i * gap_ms / 1000)
        with Client(endpoint, timeout_ms=300_000) as c:
            r = c.call(
                "generate",
                None,
                {
                    "prompt": PROMPTS[i % len(PROMPTS)] * prompt_repeat,
                    "max_tokens": max_tokens,
                    "stream": False,
                    "ignore_eos": True,
                },
            )
            done[i] = len(r.result["tokens"])

    return sum(done) / concurrently(one, streams)


def throughput(endpoint: str, concurrency: int, max_tokens: int) -> float:
    return generations(endpoint, concurrency, max_tokens)


def staggered(endpoint: str, streams: int, max_tokens: int, gap_ms: int) -> float:
    """A new (longer) prompt every ``gap_ms`` while the others decode."""
    return generations(endpoint, streams, max_tokens, gap_ms, prompt_repeat=4)


def step_ms(endpoint: str, steps: int = 32) -> tuple[float, list[int], np.ndarray]:
    """Median ms of one greedy decode, its tokens, and each step's logits."""
    with Client(endpoint, timeout_ms=300_000) as c:
        tokens = c.tokenize(PROMPTS[0])[:20]
        token = int(c.prefill_sampled("bench", tokens)["token"])
        times, out, rows = [], [token], []
        for _ in range(steps):
            t0 = time.perf_counter()
            reply = c.decode("bench", out[-1], output=["logits"])
            times.append(time.perf_counter() - t0)
            rows.append(np.array(reply.frame.array("logits")[0]))
            out.append(int(reply.result["token"]))
        c.drop("bench")
    return statistics.median(times) * 1e3, out, np.stack(rows)


def wire_bytes_per_token(n_embd: int, dtype: str) -> int:
    """Bytes of a one-row forward_frame request (header + buffer)."""
    rows = np.zeros((1, n_embd), dtype=np.float16 if dtype == "f16" else np.float32)
    buffers: list[object] = []
    header = {
        "v": 1,
        "id": 1,
        "op": "forward_frame",
        "args": {
            "input": frames.attach(
                frames.make_frame([("hidden", rows, 0)], positions=[100]), buffers
            ),
            "steps": [
                {
                    "session": "s",
                    "tokens": [1234],
                    "position": 100,
                    "sample": True,
                    "sampling": None,
                    "output": [],
                    "capture_all": False,
                    "top_logprobs": None,
                }
            ],
        },
    }
    return len(transport.encode(header)) + rows.nbytes


def streamed(
    endpoint: str, streams: int, max_tokens: int, gap_ms: int = 0, prompt_repeat: int = 1
) -> dict[str, float]:
    """Streamed generations: aggregate tok/s, TTFT p50, ITL p50 / p99 (ms)."""
    runs: list[tuple[int, float, list[float]]] = [(0, 0.0, [])] * streams

    def one(i: int) -> None:
        time.sleep(i * gap_ms / 1000)
        args = {
            # a new opening each call: no prefix cache (a whole worker has
            # one, a chain does not) turns a repeated prompt into a free prefill
            "prompt": f"Run {next(_CALLS)}. " + PROMPTS[i % len(PROMPTS)] * prompt_repeat,
            "max_tokens": max_tokens,
            "ignore_eos": True,
        }
        n, ttft, itls, last = 0, 0.0, [], 0.0
        with Client(endpoint, timeout_ms=300_000) as c:
            t0 = time.perf_counter()
            for event in c.generate(args):
                now = time.perf_counter()
                if event.header.get("event") != "token":
                    continue
                n += 1
                if n == 1:
                    ttft = now - t0
                else:
                    itls.append(now - last)
                last = now
        runs[i] = (n, ttft, itls)

    wall = concurrently(one, streams)
    itls = sorted(x for r in runs for x in r[2]) or [0.0]
    return {
        "tok_s": sum(r[0] for r in runs) / wall,
        "ttft_ms": statistics.median(r[1] for r in runs) * 1e3,
        "itl_p50_ms": itls[len(itls) // 2] * 1e3,
        "itl_p99_ms": itls[min(len(itls) - 1, int(len(itls) * 0.99))] * 1e3,
    }


def profiles(endpoints: dict[str, str]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, ep in endpoints.items():
        with Client(ep) as c:
            out[name] = c.stats()["profile"]
    return out


def busy_table(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> list[str]:
    """Where each process's time went over one load (stats.profile), % of the wall."""
    lines = []
    for name in after:
        a, b = after[name], before[name]
        wall = a["wall_s"] - b["wall_s"]
        turn = {k: a["turn"][k] - b["turn"].get(k, 0.0) for k in a["turn"]}
        loop = {k: a["loop"][k] - b["loop"].get(k, 0.0) for k in a["loop"]}
        forwards = a["forwards"] - b["forwards"]
        cells = {
            "llama_decode": turn["decode"],
            "waiting: poll": loop["poll"],
            "waiting: chain": turn.get("land_wait", 0.0),
            "receive": loop["receive"],
            "send": loop["send"],
            "python in turns": loop["turn"] - turn["decode"] - turn.get("land_wait", 0.0),
        }
        text = " | ".join(f"{k} {100 * v / wall:4.1f}%" for k, v in cells.items())
        lines.append(f"    {name:<8} {forwards:5d} forwards, {1000 * wall / max(1, forwards):6.1f} "
                     f"ms each: {text}")  # fmt: skip
    return lines
