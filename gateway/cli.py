"""``skiff-gateway``: serve, drain a worker, or show status.

::

    skiff-gateway [serve] --bind EP --worker EP [--worker EP ...] [--speech EP]
                  [--http HOST:PORT] [--metrics-port N] [--policy cache_aware]
    skiff-gateway drain WORKER_EP [--gateway EP] [--timeout-s 600]
    skiff-gateway status [--gateway EP]

``drain`` and ``status`` are clients of a running gateway's own ROUTER
(``gateway_drain`` / ``gateway_status``) and print its JSON answer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from edge import logs
from edge.memory import freeze_startup_objects
from edge.signals import drain_on_signals, exit_watchdog
from protocol import Client, SkiffError
from protocol.sockets import Curve, CurveKeyError

from . import config
from .runner import Gateway, connectable

_DESCRIPTION = "skiff gateway: one ZeroMQ (and HTTP) front over many skiff workers."


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("drain", "status"):
        return control(args)
    if args and args[0] == "serve":
        args = args[1:]
    return serve(args)


def serve(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="skiff-gateway",
        description=_DESCRIPTION + " Subcommands: serve (default), drain, status.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    config.add_serve_arguments(parser)
    cfg = config.from_namespace(parser.parse_args(argv))
    logs.configure(cfg.log_format, cfg.log_level)
    log = logs.get_logger("skiff.gateway.cli")
    exporter: Any = None
    front: Any = None
    try:
        metrics = None
        if cfg.metrics_port:
            from edge.metrics import new_registry
            from edge.metrics import start as start_metrics

            from .metrics import GatewayMetrics

            metrics = GatewayMetrics(new_registry())
            exporter = start_metrics(metrics.registry, cfg.metrics_port)
        gateway = Gateway(cfg, metrics=metrics)
        address = cfg.http_address
        if address is not None:
            from .openai.http import HttpFront  # the HTTP side is only loaded when asked for

            # With CURVE the front dials the gateway as the gateway itself (its own
            # key is always allowed in, edge/zap.py).
            curve = cfg.curve.toward(cfg.curve.public_key) if cfg.curve else None
            front = HttpFront(
                upstream=gateway.local_endpoint,
                speech_upstream=None,
                ready=gateway.ready,
                curve=curve,
                routing_id=gateway.service.trust_peer(),
            )
            front.start(*address)
    except Exception as exc:
        log.error("startup_failed", error=f"{type(exc).__name__}: {exc}")
        if exporter is not None:
            exporter.close()
        return 1

    drain_on_signals(gateway.drain, cfg.drain_timeout_s)
    freeze_startup_objects()  # a full collection never walks them between messages
    log.info(
        "gateway_ready",
        endpoint=gateway.endpoint,
        workers=list(cfg.all_workers),
        speech=list(cfg.all_speech),
        policy=cfg.policy,
        http=cfg.http or None,
        metrics_port=cfg.metrics_port or None,
    )
    try:
        gateway.serve_forever()
    finally:
        exit_watchdog()
        if front is not None:
            front.stop()
        gateway.close()
        if exporter is not None:
            exporter.close()
    log.info("gateway_stopped", requests=gateway.edge.requests)
    return 0


def control(argv: Sequence[str]) -> int:
    """``drain`` / ``status``: one request to a running gateway, JSON out."""
    parser = argparse.ArgumentParser(prog="skiff-gateway", description=_DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    default_gateway = connectable(os.environ.get("SKIFF_GATEWAY_BIND", config.DEFAULT_BIND))
    drain = sub.add_parser("drain", help="move a worker's sessions away, then stop routing to it")
    drain.add_argument("worker", help="the worker's endpoint, as the gateway lists it")
    status = sub.add_parser("status", help="workers, health, load and sessions")
    for p in (drain, status):
        p.add_argument("--gateway", default=default_gateway, help="the gateway's ZeroMQ endpoint")
        p.add_argument("--timeout-s", type=float, default=600.0, help="longest wait for the answer")
        p.add_argument(
            "--curve-key",
            default=os.environ.get("SKIFF_CURVE_SECRET_KEY", ""),
            help="CURVE: this client's secret certificate, e.g. the gateway's own "
            "[env SKIFF_CURVE_SECRET_KEY]",
        )
        p.add_argument(
            "--curve-server-key",
            default="",
            help="CURVE: the gateway's public certificate [default: the public half of "
            "--curve-key, i.e. the gateway's own key]",
        )
    ns = parser.parse_args(argv)
    curve: Curve | None = None
    try:
        if ns.curve_key:
            curve = Curve.load(ns.curve_key, ns.curve_server_key or None)
            curve = curve if ns.curve_server_key else curve.toward(curve.public_key)
    except CurveKeyError as exc:
        sys.stderr.write(f"skiff-gateway {ns.command}: {exc}\n")
        return 2
    op, args = (
        ("gateway_drain", {"worker": ns.worker})
        if ns.command == "drain"
        else ("gateway_status", {})
    )
    try:
        with Client(ns.gateway, timeout_ms=int(ns.timeout_s * 1000), curve=curve) as client:
            result = client.call(op, None, args).result
    except SkiffError as exc:
        sys.stderr.write(f"skiff-gateway {ns.command}: {exc.code}: {exc.message}\n")
        return 1
    sys.stdout.write(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return 1 if result.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
