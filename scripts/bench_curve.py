"""What CURVE costs: one plain and one CURVE worker on loopback TCP, same run.

Issue 13 asks for CURVE on every socket; this prints what it costs beside
the plain worker (the baseline) in the same run, as ratios (machines are
noisy): ``ping`` round trip p50, ``echo`` of a 16 MiB buffer (encryption
of large frames), and a greedy 64-token generation (where the model, not
the socket, should dominate).

    .venv/bin/python scripts/bench_curve.py [--pings 2000] [--echo-mib 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from protocol import Client, frames  # noqa: E402
from protocol.keys import create  # noqa: E402
from protocol.sockets import Curve  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "worker.cli",
            "--threads",
            "1",
            "--lanes",
            "2",
            "--ctx",
            "2048",
            "--log-format",
            "json",
            *args,
        ],
        cwd=ROOT,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )


def _measure(client: Client, pings: int, echo_mib: int) -> dict[str, float]:
    for _ in range(50):
        client.ping()
    times = []
    for _ in range(pings):
        t0 = time.perf_counter()
        client.ping()
        times.append(time.perf_counter() - t0)
    rows = (echo_mib << 20) // (1024 * 4)
    payload = np.random.default_rng(0).standard_normal((rows, 1024), dtype=np.float32)
    frame = frames.make_frame([("hidden", payload, 0)])
    echo = []
    for _ in range(5):
        t0 = time.perf_counter()
        back = client.echo(frame).frame.array("hidden")
        echo.append(time.perf_counter() - t0)
        assert back.shape == payload.shape
    t0 = time.perf_counter()
    result = client.call(
        "generate",
        None,
        {"prompt": "The sea", "max_tokens": 64, "ignore_eos": True, "stream": False},
    ).result
    gen_s = time.perf_counter() - t0
    return {
        "ping_p50_us": statistics.median(times) * 1e6,
        "echo_ms": statistics.median(echo) * 1e3,
        "gen_tok_s": result["usage"]["completion_tokens"] / gen_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pings", type=int, default=2000)
    parser.add_argument("--echo-mib", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    ns = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="skiff-curve-"))
    keys, allowed = tmp / "keys", tmp / "allowed"
    allowed.mkdir()
    create(keys, "server")
    pub, _ = create(keys, "client")
    (allowed / pub.name).write_bytes(pub.read_bytes())
    plain_ep, curve_ep = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}"
    procs = [
        _start(["--bind", plain_ep], tmp / "plain.log"),
        _start(
            [
                "--bind",
                curve_ep,
                "--curve-secret-key",
                str(keys / "server.key_secret"),
                "--curve-authorized",
                str(allowed),
            ],
            tmp / "curve.log",
        ),
    ]
    curve = Curve.load(keys / "client.key_secret", keys / "server.key")
    try:
        with (
            Client(plain_ep, timeout_ms=120_000) as plain,
            Client(curve_ep, timeout_ms=120_000, curve=curve) as secure,
        ):
            plain.wait_ready(120)
            secure.wait_ready(120)
            rows: dict[str, list[dict[str, float]]] = {"plain": [], "curve": []}
            for _ in range(ns.rounds):  # interleaved, so drift hits both alike
                rows["plain"].append(_measure(plain, ns.pings, ns.echo_mib))
                rows["curve"].append(_measure(secure, ns.pings, ns.echo_mib))
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in rows.items()}
    print(f"{'metric':<22}{'plain':>12}{'curve':>12}{'curve/plain':>14}")
    for metric in med["plain"]:
        a, b = med["plain"][metric], med["curve"][metric]
        print(f"{metric:<22}{a:>12.1f}{b:>12.1f}{b / a:>14.2f}")
    print(f"(echo of {ns.echo_mib} MiB each way; medians of {ns.rounds} interleaved rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
