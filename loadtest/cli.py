"""``skiff-loadtest``: drive ``generate`` load at workers and report latencies.

    skiff-loadtest --endpoint ipc:///tmp/w.sock --concurrency 4 --requests 40
    skiff-loadtest --endpoint tcp://127.0.0.1:5555 --rate 2 --duration 30 --json out.json
    skiff-loadtest --endpoint http://127.0.0.1:8000 --concurrency 8 --requests 64

Closed loop (``--concurrency N``) or open loop (``--rate R``, Poisson
arrivals); bounded by ``--requests`` and/or ``--duration`` (100 requests when
neither is given). Prints TTFT, inter-token latency, time per output token and
end-to-end latency percentiles, output tokens/s and errors by code.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from protocol.sockets import Curve

from .prompts import load_prompts
from .report import format_table, write_json, write_plot
from .runner import LoadConfig, run_load

DEFAULT_REQUESTS = 100


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="skiff-loadtest",
        description="Closed- or open-loop generate load against skiff workers.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--endpoint",
        action="append",
        default=None,
        help="worker or gateway endpoint (ZeroMQ), or http://HOST:PORT for an "
        "OpenAI-compatible front; repeat for several (requests go round-robin) "
        "[default tcp://127.0.0.1:5555]",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, help="closed loop: this many concurrent users")
    mode.add_argument("--rate", type=float, help="open loop: Poisson arrivals, requests/s")
    p.add_argument("--requests", type=int, help=f"stop after this many [{DEFAULT_REQUESTS}]")
    p.add_argument("--duration", type=float, help="start no request after this many seconds")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each request")
    p.add_argument(
        "--ignore-eos", action="store_true", help="generate exactly max_tokens tokens each"
    )
    p.add_argument(
        "--timeout-ms",
        type=int,
        default=60_000,
        help="deadline of each request (sent as deadline_ms); 0 = none",
    )
    p.add_argument("--prompts", help="file: one prompt per line, or JSONL with 'prompt'")
    p.add_argument("--temperature", type=float, help="sample at this temperature (default greedy)")
    p.add_argument("--seed", type=int, default=0, help="seed of arrivals and sampling")
    p.add_argument(
        "--stagger-s", type=float, default=0.0, help="closed loop: start user u at u * this"
    )
    p.add_argument("--json", dest="json_path", help="write every figure to this JSON file")
    p.add_argument("--plot", dest="plot_path", help="write latency CDF + throughput PNG here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--curve-server-key",
        help="CURVE: the server's public certificate (NAME.key); with --curve-key",
    )
    p.add_argument(
        "--curve-key",
        help="CURVE: this client's secret certificate (NAME.key_secret, on the server's list)",
    )
    return p


def curve_from_args(ns: argparse.Namespace) -> Curve | None:
    """The client's CURVE keys, or None (plain) when neither flag is given."""
    if not ns.curve_key and not ns.curve_server_key:
        return None
    if not (ns.curve_key and ns.curve_server_key):
        raise ValueError("--curve-key and --curve-server-key go together")
    return Curve.load(ns.curve_key, ns.curve_server_key)


def config_from_args(ns: argparse.Namespace) -> LoadConfig:
    concurrency = ns.concurrency
    if concurrency is None and ns.rate is None:
        concurrency = 1
    requests = ns.requests
    if requests is None and ns.duration is None:
        requests = DEFAULT_REQUESTS
    sampling = None
    if ns.temperature is not None and ns.temperature > 0:
        sampling = {"temperature": ns.temperature, "seed": ns.seed}
    return LoadConfig(
        endpoints=ns.endpoint or ["tcp://127.0.0.1:5555"],
        concurrency=concurrency,
        rate=ns.rate,
        requests=requests,
        duration_s=ns.duration,
        max_tokens=ns.max_tokens,
        ignore_eos=ns.ignore_eos,
        timeout_ms=ns.timeout_ms,
        prompts=load_prompts(ns.prompts) if ns.prompts else None,
        sampling=sampling,
        seed=ns.seed,
        progress=not ns.no_progress,
        stagger_s=ns.stagger_s,
        curve=curve_from_args(ns),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        cfg = config_from_args(ns)
        cfg.validate()
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    try:
        summary = run_load(cfg)
    except KeyboardInterrupt:
        print("skiff-loadtest: interrupted", file=sys.stderr)
        return 130
    print(format_table(summary))
    if ns.json_path:
        write_json(summary, ns.json_path)
    if ns.plot_path:
        write_plot(summary, ns.plot_path)
    return 0 if summary["requests"]["ok"] > 0 or summary["requests"]["sent"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
