"""Gateway configuration: command-line flags, each with a ``SKIFF_*`` twin.

Precedence: flag > environment variable > default, as for every process
(``edge/flags.py``). Repeatable flags (``--worker``, ``--speech``) take
their variable as a comma-separated list; ``--workers-file`` adds one
endpoint per line (``speech <endpoint>`` for a speech worker, ``#``
comments). DNS names are fine: ZeroMQ resolves them when it connects and
again on every reconnect.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from edge import flags
from edge.logs import LOG_FORMATS
from edge.zap import keys_from_flags
from protocol.sockets import DEFAULT_MAX_MESSAGE_BYTES, Curve

POLICIES = ("cache_aware", "least_loaded", "round_robin")
DEFAULT_BIND = "tcp://127.0.0.1:5550"


@dataclass(frozen=True)
class GatewayConfig:
    bind: str = DEFAULT_BIND
    workers: tuple[str, ...] = ()
    speech: tuple[str, ...] = ()
    workers_file: str = ""
    http: str = ""  # HOST:PORT of the HTTP front; "" = off
    metrics_port: int = 0  # 0 = off
    policy: str = "cache_aware"
    health_interval_ms: int = 500
    down_after_ms: int = 1500
    stall_after_ms: int = 15_000
    balance_threshold: float = 6.0  # load-score slack a cache hit (or a prompt's home) may cost
    cache_min_blocks: int = 8  # prefix blocks a worker must share to win on cache
    cache_full_blocks: int = 32  # a match this long may cost the whole balance threshold
    prefix_index_blocks: int = 65_536  # remembered prefix blocks per worker (LRU)
    max_request_bytes: int = 4 * 1024 * 1024
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    drain_timeout_s: float = 30.0  # SIGTERM: in-flight requests get this long
    max_inflight_per_client: int = 256  # requests one client may have in flight; 0 = no limit
    poll_spin_us: int = 250  # wait for the next message awake this long while they come fast
    log_format: str = "auto"
    log_level: str = "info"
    extra_workers: tuple[str, ...] = field(default=(), repr=False)  # from the file
    extra_speech: tuple[str, ...] = field(default=(), repr=False)
    # CURVE (docs/security.md): the gateway's own key pair, used by its front
    # and as its identity toward the workers (``server_key``: their public key).
    curve: Curve | None = field(default=None, repr=False)
    curve_authorized: str = ""  # the front's allow-list: a directory of client .key files

    @property
    def all_workers(self) -> tuple[str, ...]:
        return _unique((*self.workers, *self.extra_workers))

    @property
    def all_speech(self) -> tuple[str, ...]:
        return _unique((*self.speech, *self.extra_speech))

    @property
    def http_address(self) -> tuple[str, int] | None:
        """``(host, port)`` of ``--http``, or None when the HTTP front is off."""
        if not self.http:
            return None
        host, _, port = self.http.rpartition(":")
        return (host.strip("[]") or "0.0.0.0", int(port))


def _unique(items: Sequence[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(i for i in items if i))


# (flag, type, env variable, help). Env names follow docs/protocol's agreed set.
_OPTIONS: list[tuple[str, type, str, str]] = [
    ("bind", str, "SKIFF_GATEWAY_BIND", "ZeroMQ endpoint of the gateway's ROUTER front"),
    ("workers-file", str, "SKIFF_GATEWAY_WORKERS_FILE", "file: one endpoint a line; 'speech EP'"),
    ("http", str, "SKIFF_GATEWAY_HTTP", "HOST:PORT of the OpenAI-compatible HTTP front; '' = off"),
    ("metrics-port", int, "SKIFF_METRICS_PORT", "Prometheus text on this port; 0 = off"),
    ("policy", str, "SKIFF_GATEWAY_POLICY", "routing of new sessions and ephemeral work"),
    ("health-interval-ms", int, "SKIFF_GATEWAY_HEALTH_INTERVAL_MS", "ping and stats period"),
    (
        "down-after-ms",
        int,
        "SKIFF_GATEWAY_DOWN_AFTER_MS",
        "a worker whose connection is silent this long (ZeroMQ heartbeats) is down: its "
        "in-flight requests fail worker_unavailable",
    ),
    (
        "stall-after-ms",
        int,
        "SKIFF_GATEWAY_STALL_AFTER_MS",
        "a worker whose loop answers nothing (not even ping) this long is hung: down",
    ),
    (
        "balance-threshold",
        float,
        "SKIFF_GATEWAY_BALANCE_THRESHOLD",
        "cache_aware: a prefix hit or a prompt's home wins while its load score is within this "
        "of the least loaded",
    ),
    (
        "cache-min-blocks",
        int,
        "SKIFF_GATEWAY_CACHE_MIN_BLOCKS",
        "cache_aware: prefix blocks (16 tokens / 64 chars) a worker must share to win "
        "away from a prompt's home; a prompt's first this many blocks key its home",
    ),
    (
        "cache-full-blocks",
        int,
        "SKIFF_GATEWAY_CACHE_FULL_BLOCKS",
        "cache_aware: a match this long (a home counts as one) may cost the whole "
        "--balance-threshold; shorter, a share",
    ),
    (
        "prefix-index-blocks",
        int,
        "SKIFF_GATEWAY_PREFIX_INDEX_BLOCKS",
        "prefix blocks remembered per worker (LRU)",
    ),
    ("max-request-bytes", int, "SKIFF_MAX_REQUEST_BYTES", "largest request header"),
    ("max-message-bytes", int, "SKIFF_MAX_MESSAGE_BYTES", "largest ZeroMQ frame (MAXMSGSIZE)"),
    (
        "max-inflight-per-client",
        int,
        "SKIFF_GATEWAY_MAX_INFLIGHT_PER_CLIENT",
        "requests (streams included) one client may have in flight; more is limit_exceeded; "
        "0 = no limit",
    ),
    (
        "poll-spin-us",
        int,
        "SKIFF_GATEWAY_POLL_SPIN_US",
        "while messages have come less than 4x this apart, wait for the next one awake "
        "(polling) this long before sleeping: a relay's wake-up costs ~50 us a crossing; "
        "0 = always sleep",
    ),
    (
        "drain-timeout-s",
        float,
        "SKIFF_DRAIN_TIMEOUT_S",
        "on SIGTERM/SIGINT refuse new requests (shutting_down), relay accepted ones this "
        "long, then cancel the rest and exit 0; a second signal cancels at once",
    ),
    ("log-format", str, "SKIFF_LOG_FORMAT", "auto (console on a TTY, else json), json, console"),
    ("log-level", str, "SKIFF_LOG_LEVEL", "debug, info, warning, error"),
    (
        "curve-secret-key",
        str,
        "SKIFF_CURVE_SECRET_KEY",
        "CURVE on: the gateway's secret certificate (skiff-keys); its front encrypts and its "
        "key is its identity toward the workers; '' = plain",
    ),
    (
        "curve-authorized",
        str,
        "SKIFF_CURVE_AUTHORIZED",
        "CURVE: directory of the public certificates (*.key) of the clients allowed in",
    ),
    (
        "curve-server-key",
        str,
        "SKIFF_CURVE_SERVER_KEY",
        "CURVE: the workers' public certificate (NAME.key)",
    ),
]
_LISTS = [
    ("worker", "SKIFF_GATEWAY_WORKERS", "LLM worker (or chain stage-0) endpoint"),
    ("speech", "SKIFF_GATEWAY_SPEECH", "speech worker endpoint"),
]
_CHOICES: dict[str, tuple[str, ...]] = {"log-format": LOG_FORMATS, "policy": POLICIES}
FLAGS = flags.Flags(
    [
        *(
            flags.Flag(
                option,
                kind,
                text,
                # curve-*: paths, not fields of the config
                default=getattr(GatewayConfig(), option.replace("-", "_"), ""),
                env=(env,),
                choices=_CHOICES.get(option),
            )
            for option, kind, env, text in _OPTIONS
        ),
        *(flags.Flag(option, str, text, (), (env,), repeat=True) for option, env, text in _LISTS),
    ]
)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Every ``serve`` flag, its default taken from its variable when set."""
    FLAGS.add_to(parser)


def from_namespace(ns: argparse.Namespace) -> GatewayConfig:
    """A checked config from parsed ``serve`` arguments (flags over variables)."""
    FLAGS.finish(ns)  # --worker / --speech not given: their variables' lists
    lists = {option: _unique(getattr(ns, option) or ()) for option, _, _ in _LISTS}
    extra_llm, extra_speech = read_workers_file(ns.workers_file) if ns.workers_file else ((), ())
    cfg = GatewayConfig(
        bind=ns.bind,
        workers=lists["worker"],
        speech=lists["speech"],
        workers_file=ns.workers_file,
        http=ns.http,
        metrics_port=ns.metrics_port,
        policy=ns.policy,
        health_interval_ms=ns.health_interval_ms,
        down_after_ms=ns.down_after_ms,
        stall_after_ms=ns.stall_after_ms,
        balance_threshold=ns.balance_threshold,
        cache_min_blocks=ns.cache_min_blocks,
        cache_full_blocks=ns.cache_full_blocks,
        prefix_index_blocks=ns.prefix_index_blocks,
        max_request_bytes=ns.max_request_bytes,
        max_message_bytes=ns.max_message_bytes,
        drain_timeout_s=ns.drain_timeout_s,
        max_inflight_per_client=ns.max_inflight_per_client,
        poll_spin_us=ns.poll_spin_us,
        log_format=ns.log_format,
        log_level=ns.log_level,
        extra_workers=extra_llm,
        extra_speech=extra_speech,
        curve=keys_from_flags(
            "skiff-gateway",
            ns.curve_secret_key,
            ns.curve_authorized,
            ns.curve_server_key,
            dials="its workers",
        ),
        curve_authorized=ns.curve_authorized,
    )
    check(cfg)
    return cfg


def check(cfg: GatewayConfig) -> None:
    if not cfg.all_workers and not cfg.all_speech:
        raise SystemExit("skiff-gateway: give at least one --worker or --speech endpoint")
    if cfg.health_interval_ms < 10 or cfg.down_after_ms <= cfg.health_interval_ms:
        raise SystemExit(
            "skiff-gateway: --health-interval-ms must be >= 10 and below --down-after-ms"
        )
    if cfg.drain_timeout_s < 0:
        raise SystemExit("skiff-gateway: --drain-timeout-s must be >= 0")
    if not 0 <= cfg.poll_spin_us <= 10_000:
        raise SystemExit("skiff-gateway: --poll-spin-us must be 0-10000")
    if cfg.max_inflight_per_client < 0:
        raise SystemExit("skiff-gateway: --max-inflight-per-client must be >= 0 (0 = no limit)")
    if cfg.stall_after_ms < cfg.down_after_ms:
        raise SystemExit("skiff-gateway: --stall-after-ms must be at least --down-after-ms")
    if cfg.http:
        try:
            cfg.http_address  # noqa: B018 - parse for the error
        except ValueError:
            raise SystemExit(f"skiff-gateway: --http {cfg.http!r} is not HOST:PORT") from None


def read_workers_file(path: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(LLM endpoints, speech endpoints) listed in ``path``."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SystemExit(f"skiff-gateway: --workers-file {path}: {exc.strerror}") from None
    llm: list[str] = []
    speech: list[str] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        kind, _, rest = line.partition(" ")
        if kind == "speech" and rest.strip():
            speech.append(rest.strip())
        else:
            llm.append(line)
    return tuple(llm), tuple(speech)
