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
``ping`` round trip of a separate DEALER pinging every 20 ms during a second
c=8 skiff run (of its own: the throughput set against the raw engine carries
no probe), beside skiff's mean scheduler turn (``mean_forward_ms`` over that
run). Figures to reach are printed at the end.

    .venv/bin/python scripts/bench_serving.py [--quick] [--k 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from _bench_serving_clients import bench_http, bench_skiff  # noqa: E402
from _bench_serving_common import LANES, N_CTX, THREADS, Procs, Row, cpu_busy, free_port  # noqa: E402
from _bench_serving_raw import bench_raw  # noqa: E402
from _bench_serving_report import fmt, report  # noqa: E402
from _machine import cpu_flags  # noqa: E402

from worker.models import default_model_path  # noqa: E402

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
    print(f"CPU flags: {cpu_flags()}")
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
