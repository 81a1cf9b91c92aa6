"""Ping round trip over ipc:// against an idle worker, beside a bare echo.

Figures: skiff ``ping`` p50 <= 100 us while idle (issue 2) and <= 1.5 x the
echo's p50 in the same run (issue 8: the shared edge's cost). The baseline in
the same run is a minimal pyzmq ROUTER echo thread in this process (no
msgpack, no dispatch): the floor of what any Python worker can do on this
socket type. Prints p50/p90/p99 for both and the ratio skiff/echo.

    .venv/bin/python scripts/bench_ping.py [--n 5000]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from protocol import Client, transport  # noqa: E402


def percentiles(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return {"p50": pick(0.50) * 1e6, "p90": pick(0.90) * 1e6, "p99": pick(0.99) * 1e6}


def time_pings(endpoint: str, n: int) -> list[float]:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    frame = transport.encode(transport.request(1, "ping"))
    for _ in range(200):  # warm-up
        sock.send(frame)
        sock.recv_multipart()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        sock.send(frame)
        sock.recv_multipart()
        samples.append(time.perf_counter() - t0)
    sock.close(0)
    return samples


def echo_server(endpoint: str, stop: threading.Event) -> None:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(endpoint)
    while not stop.is_set():
        if sock.poll(100):
            sock.send_multipart(sock.recv_multipart())
    sock.close(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=5000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        echo_ep = f"ipc://{tmp}/echo.sock"
        stop = threading.Event()
        thread = threading.Thread(target=echo_server, args=(echo_ep, stop), daemon=True)
        thread.start()
        time.sleep(0.2)
        echo = percentiles(time_pings(echo_ep, args.n))
        stop.set()
        thread.join()

        ep = f"ipc://{tmp}/skiff.sock"
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", "--bind", ep, "--log-level", "warning"], cwd=ROOT
        )
        try:
            with Client(ep) as client:
                client.wait_ready(60, alive=lambda: proc.poll() is None)
            skiff = percentiles(time_pings(ep, args.n))
        finally:
            proc.terminate()
            proc.wait(10)
    print(f"{'system':<12}{'p50 us':>10}{'p90 us':>10}{'p99 us':>10}")
    for name, row in (("echo", echo), ("skiff", skiff)):
        print(f"{name:<12}{row['p50']:>10.1f}{row['p90']:>10.1f}{row['p99']:>10.1f}")
    ratio = skiff["p50"] / echo["p50"]
    verdict = "OK" if ratio <= 1.5 else "MISSED"
    print(f"skiff/echo p50 ratio: {ratio:.2f} (target <= 1.5): {verdict}")
    verdict = "OK" if skiff["p50"] <= 100 else "MISSED"
    print(f"skiff ping p50 = {skiff['p50']:.1f} us (target <= 100 us): {verdict}")


if __name__ == "__main__":
    main()
