"""``scripts/cluster up|status|down``: the compose topology as local processes.

Why: the gateway, the multi-worker tests and the load test need gateway + two
LLM workers + a speech worker, and this machine has no container engine. The
processes are the ones compose.yaml runs (``worker.cli``, ``speech.cli``,
``gateway.cli``), bound to free loopback TCP ports (or ``ipc://`` sockets in
the run directory), started detached so they outlive ``up``.

``up`` writes ``RUN_DIR/state.json`` (pids, endpoints, logs), waits until every
worker answers ``ping`` and the gateway answers ``ping`` and ``GET /health``
with 200, and prints the endpoints as JSON. ``status`` prints each process up
or down and whether it answers. ``down`` sends SIGTERM to each process group
(the gateway first, so it stops routing before its workers go), SIGKILL after
``--grace`` seconds, and removes the state. Logs stay in ``RUN_DIR/logs``.

``up --chain 0:9,9:18`` adds a pipeline of stages (``chain-s0`` ...) beside
the workers; the gateway lists its stage 0 as one more worker (a chain
answers every op a worker does), the later stages only as stage 0's next.

``up --curve DIR`` turns CURVE on everywhere (docs/security.md): it makes the
key pairs it lacks in DIR (``servers`` for every worker, ``gateway``,
``client``), lists ``client`` and ``gateway`` in ``DIR/authorized``, and
gives each process its flags; ``status`` and the health checks dial as
``client``.

A pid in the state counts as ours only while ``/proc/PID/stat`` shows the
start time recorded at launch, so a reused pid is never signalled.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cluster_procs import (
    ClusterError,
    Proc,
    alive,
    clear_state,
    http_health,
    launch,
    load_state,
    pings,
    save_state,
    stop,
    wait_healthy,
)

from edge import logs
from protocol.keys import create as create_keys

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RUN_DIR = ROOT / ".cluster"
IPC_PATH_MAX = 100  # sun_path is 108 bytes on Linux; keep a margin

log = logs.get_logger("skiff.cluster")


def curve_dir(keys: Path) -> dict[str, list[str]]:
    """Make the key pairs ``keys`` lacks and its ``authorized`` directory;
    the CURVE flags of each role."""
    for name in ("servers", "gateway", "client"):
        if not (keys / f"{name}.key_secret").exists():
            create_keys(keys, name)
    allowed = keys / "authorized"
    allowed.mkdir(exist_ok=True)
    for name in ("client", "gateway"):  # the gateway dials the workers
        (allowed / f"{name}.key").write_bytes((keys / f"{name}.key").read_bytes())
    server = ["--curve-authorized", str(allowed)]
    return {
        "worker": ["--curve-secret-key", str(keys / "servers.key_secret"), *server],
        "gateway": [
            "--curve-secret-key",
            str(keys / "gateway.key_secret"),
            "--curve-server-key",
            str(keys / "servers.key"),
            *server,
        ],
    }


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (all held open until all are chosen)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def plan(args: argparse.Namespace, run_dir: Path) -> list[Proc]:
    """Every process with its argv and endpoints, nothing started yet."""
    names = [f"worker-{i + 1}" for i in range(args.workers)]
    # A chain behind the gateway: its last stage first (it loads while the
    # earlier ones start), stage 0 the one the gateway routes to.
    ranges = [r for r in args.chain.split(",") if r] if args.chain else []
    stages = [f"chain-s{i}" for i in range(len(ranges))]
    names += stages[::-1]
    if args.speech:
        names.append("speech")
    if args.gateway:
        names.append("gateway")
    ports = iter(free_ports(2 * len(names) + 1))

    def endpoint(name: str) -> str:
        if args.transport == "tcp":
            return f"tcp://127.0.0.1:{next(ports)}"
        path = run_dir / f"{name}.sock"
        if len(str(path)) > IPC_PATH_MAX:
            raise ClusterError(f"ipc path too long for a unix socket: {path}; use --run-dir")
        return f"ipc://{path}"

    py = sys.executable
    procs: list[Proc] = []
    keys: Path | None = args.curve.resolve() if args.curve else None
    flags = curve_dir(keys) if keys else {"worker": [], "gateway": []}
    chain_eps = {name: endpoint(name) for name in stages}
    for name in names:
        ep = chain_eps.get(name) or endpoint(name)
        metrics, log_path = next(ports), str(run_dir / "logs" / f"{name}.log")
        if name == "speech":
            argv = [py, "-m", "speech.cli", "--bind", ep, "--threads", "1"]
            argv += ["--log-format", "json", *flags["worker"]]
            procs.append(Proc(name, "speech", argv, ep, metrics, log_path))
        elif name == "gateway":
            http = f"127.0.0.1:{next(ports)}"
            argv = [py, "-m", "gateway.cli", "--bind", ep, "--http", http]
            for p in procs:
                if p.role != "stage":  # a chain is reached through its stage 0
                    argv += ["--speech" if p.role == "speech" else "--worker", p.endpoint]
            argv += ["--metrics-port", str(metrics), "--log-format", "json", *flags["gateway"]]
            argv += args.gateway_arg
            procs.append(Proc(name, "gateway", argv, ep, metrics, log_path, http=f"http://{http}"))
        else:
            llm = args.workers + len(stages)
            threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, llm))
            argv = [py, "-m", "worker.cli", "--bind", ep, "--model", args.model]
            argv += ["--lanes", str(args.lanes), "--ctx", str(args.ctx)]
            argv += ["--threads", str(threads), "--log-format", "json", *flags["worker"]]
            argv += args.worker_arg
            role = "worker"
            if name in chain_eps:
                i = stages.index(name)
                argv += ["--layers", ranges[i]]
                if i + 1 < len(stages):
                    argv += ["--next", chain_eps[stages[i + 1]]]
                role = "worker" if i == 0 else "stage"
            procs.append(Proc(name, role, argv, ep, metrics, log_path))
    if keys is not None:
        for p in procs:
            p.server_key = str(keys / ("gateway.key" if p.role == "gateway" else "servers.key"))
    return procs


def describe(run_dir: Path, procs: Sequence[Proc]) -> dict[str, Any]:
    """The endpoints a client needs, then every process in detail."""
    gateway = next((p for p in procs if p.role == "gateway"), None)
    keys = next((Path(p.server_key).parent for p in procs if p.server_key), None)
    return {
        "run_dir": str(run_dir),
        **({"curve_client_key": str(keys / "client.key_secret")} if keys else {}),
        "gateway": gateway.endpoint if gateway else None,
        "http": gateway.http if gateway else None,
        "workers": [p.endpoint for p in procs if p.role == "worker"],
        "speech": [p.endpoint for p in procs if p.role == "speech"],
        "processes": {
            p.name: {
                "role": p.role,
                "pid": p.pid,
                "endpoint": p.endpoint,
                "metrics_port": p.metrics_port,
                "log": p.log,
                **({"http": p.http} if p.http else {}),
                **({"curve_server_key": p.server_key} if p.server_key else {}),
            }
            for p in procs
        },
    }


def cmd_up(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    old = load_state(run_dir)
    if any(alive(p) for p in old):
        raise ClusterError(f"a cluster is already up in {run_dir}; run `scripts/cluster down`")
    clear_state(run_dir, old)  # stale: every recorded process is gone
    procs = plan(args, run_dir)
    started: list[tuple[Proc, subprocess.Popen[bytes]]] = []
    try:
        # Workers first: they load while the gateway starts, and the gateway
        # finds them answering when it first pings.
        for proc in procs:
            started.append((proc, launch(proc)))
            log.info("started", process=proc.name, pid=proc.pid, endpoint=proc.endpoint)
        save_state(run_dir, procs)  # `down` can clean up even if `up` is killed now
        deadline = time.monotonic() + args.timeout
        for proc, popen in started:
            wait_healthy(proc, popen, deadline)
            log.info("healthy", process=proc.name)
    except BaseException:
        stop([p for p, _ in reversed(started)], grace=5.0)
        clear_state(run_dir, procs)
        raise
    return describe(run_dir, procs)


def cmd_status(run_dir: Path) -> tuple[dict[str, Any], bool]:
    procs = load_state(run_dir)
    out = describe(run_dir, procs)
    healthy = bool(procs)
    for p in procs:
        entry = out["processes"][p.name]
        entry["up"] = alive(p)
        entry["answering"] = entry["up"] and pings(p)
        if p.http:
            entry["health"] = http_health(p.http) if entry["up"] else None
        healthy = healthy and entry["answering"]
    out["running"] = any(alive(p) for p in procs)
    return out, healthy


def cmd_down(run_dir: Path, grace: float) -> dict[str, Any]:
    procs = load_state(run_dir)
    gateways = [p for p in procs if p.role == "gateway"]
    outcome = stop(gateways, grace)
    outcome.update(stop([p for p in procs if p.role != "gateway"], grace))
    clear_state(run_dir, procs)
    return {"run_dir": str(run_dir), "stopped": outcome}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scripts/cluster",
        description="gateway + LLM workers + speech worker as local processes on loopback",
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=Path(os.environ.get("SKIFF_CLUSTER_DIR", DEFAULT_RUN_DIR)),
        help="state, logs and ipc sockets (env SKIFF_CLUSTER_DIR; default %(default)s)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start detached, wait for health, print endpoints (JSON)")
    up.add_argument("--workers", type=int, default=2, help="LLM workers (default 2)")
    up.add_argument(
        "--chain",
        default="",
        metavar="LO:HI,LO:HI,...",
        help="also a pipeline of stages with these layer ranges; the gateway routes to its stage 0",
    )
    up.add_argument("--no-speech", dest="speech", action="store_false", help="no speech worker")
    up.add_argument("--no-gateway", dest="gateway", action="store_false", help="no gateway")
    up.add_argument("--transport", choices=("tcp", "ipc"), default="tcp")
    up.add_argument("--model", default="default", help="GGUF path or 'default'")
    up.add_argument("--lanes", type=int, default=4)
    up.add_argument("--ctx", type=int, default=8192)
    up.add_argument("--threads", type=int, default=0, help="per worker; 0 = cores / workers")
    for role in ("worker", "gateway"):
        up.add_argument(
            f"--{role}-arg",
            action="append",
            default=[],
            metavar="ARG",
            help=f"extra skiff-{role} argument, repeatable (--{role}-arg=--flag=value)",
        )
    up.add_argument("--timeout", type=float, default=180.0, help="seconds to reach health")
    up.add_argument(
        "--curve",
        type=Path,
        metavar="DIR",
        help="CURVE on every socket: key pairs made (or reused) in DIR; clients dial with "
        "DIR/client.key_secret and the process's curve_server_key",
    )
    sub.add_parser("status", help="each process up/down and answering (JSON); exit 1 unless all")
    down = sub.add_parser("down", help="SIGTERM, SIGKILL after --grace, remove the state")
    down.add_argument("--grace", type=float, default=10.0, help="seconds before SIGKILL")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.run_dir = args.run_dir.resolve()  # the state's log paths work from any directory
    logs.configure("auto", os.environ.get("SKIFF_LOG_LEVEL", "info"))
    if getattr(args, "workers", 1) < 1:
        raise SystemExit("scripts/cluster: --workers must be at least 1")
    try:
        if args.command == "up":
            result, ok = cmd_up(args, args.run_dir), True
        elif args.command == "status":
            result, ok = cmd_status(args.run_dir)
        else:
            result, ok = cmd_down(args.run_dir, args.grace), True
    except ClusterError as exc:
        log.error("cluster", command=args.command, error=str(exc))
        return 1
    sys.stdout.write(json.dumps(result, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
