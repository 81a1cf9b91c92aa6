"""Worker configuration: command-line flags, each with a ``SKIFF_*`` twin.

Precedence: flag > environment variable > default (``edge/flags.py``, the
same for every process). ``skiff-worker --help`` shows every option with the
variable that also sets it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass

from edge import flags
from edge.host import memory_limit, usable_cpus
from edge.logs import LOG_FORMATS
from edge.zap import keys_from_flags
from protocol.sockets import DEFAULT_MAX_MESSAGE_BYTES, Curve

from .limits import FIELDS as LIMIT_FIELDS
from .limits import HELP as LIMIT_HELP
from .limits import Limits, invalid

_LIMITS = Limits()


@dataclass(frozen=True)
class WorkerConfig:
    bind: str = "tcp://127.0.0.1:5555"
    model: str = "default"
    lanes: int = 4
    ctx: int = 8192
    ctx_per_lane: int = 0  # 0 = ctx // lanes
    batch: int = 512
    ubatch: int = 512
    threads: int = 0  # 0 = one per usable core (--cpus, affinity, CPU quota)
    cpus: str = ""  # cores the process runs on ("0", "2-3", "0,2"); "" = any
    repack: int = 0
    max_batch_tokens: int = 0  # 0 = batch
    prefill_chunk: int = 128
    cadence: float = 2.5  # while streams decode, a turn lasts at most this x a decode turn; 0 = off
    max_queue: int = 64
    prefix_cache: int = -1  # idle lanes keeping their tokens for reuse; -1 = all, 0 = off
    kernels: str = "exact"  # "exact": batch-invariant rows; "upstream": llama.cpp's own paths
    admission_timeout_ms: int = 60_000
    session_idle_s: float = 600.0
    park_bytes: int = -1  # memory for parked sessions; -1 = a quarter of the memory limit, 0 = off
    park_dir: str = ""  # a directory for parked sessions past --park-bytes; "" = evict them
    prompt_ram_bytes: int = -1  # evicted prefix-cache lanes in host memory; -1 = an eighth, 0 = off
    max_request_bytes: int = 4 * 1024 * 1024
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    log_format: str = "auto"
    log_level: str = "info"
    chat_template: str = ""  # "" = the model's own, else the Gemma-turn fallback
    draft_model: str = ""  # "" = no draft model; a GGUF path or "default"
    # generations that ask for no speculation: "auto" = prompt lookup while at
    # most speculate_streams streams decode in a forward; "off" = never
    speculate: str = "auto"
    speculate_streams: int = 2
    layers: str = ""  # "LO:HI": serve only these layers (a pipeline stage); "" = all
    next: str = ""  # the next stage's endpoint (a stage without the last layer)
    frame_dtype: str = "f32"  # hidden rows sent to the next stage: f32 (exact) or f16
    chain_credit: int = 2  # forwards a stage keeps in flight down the chain (1 = no pipelining)
    pipeline_groups: int = 1  # decode groups taking turns down the chain (stages on separate hosts)
    curve_secret_key: str = ""  # CURVE on (docs/security.md): own secret certificate; "" = plain
    curve_authorized: str = ""  # directory of the client public certificates allowed in
    curve_server_key: str = ""  # public certificate of the servers dialled (the next stage)
    metrics_port: int = 0  # Prometheus text on http://metrics_host:PORT/metrics; 0 = off
    metrics_host: str = "0.0.0.0"
    send_hwm: int = 10_000  # messages queued for one peer before it counts as not reading
    drain_timeout_s: float = 30.0  # SIGTERM: accepted work gets this long, then is cancelled
    mmproj: str = ""  # multimodal projector GGUF beside the model (docs/media.md); "" = text only
    max_image_pixels: int = 1 << 24  # width x height of one image, checked from its header

    # Limits on what a peer controls (worker/limits.py: one flag each)
    max_request_tokens: int = _LIMITS.max_request_tokens
    max_new_tokens: int = _LIMITS.max_new_tokens
    max_sessions_per_peer: int = _LIMITS.max_sessions_per_peer
    max_streams_per_peer: int = _LIMITS.max_streams_per_peer
    max_stops: int = _LIMITS.max_stops
    max_stop_chars: int = _LIMITS.max_stop_chars
    max_grammar_bytes: int = _LIMITS.max_grammar_bytes
    max_logit_bias: int = _LIMITS.max_logit_bias
    max_messages: int = _LIMITS.max_messages
    max_frame_parts: int = _LIMITS.max_frame_parts
    max_frame_rank: int = _LIMITS.max_frame_rank

    @property
    def limits(self) -> Limits:
        """The peer limits as flags gave them (0s not yet resolved to a lane's cells)."""
        return Limits(**{name: getattr(self, name) for name in LIMIT_FIELDS})

    @property
    def n_threads(self) -> int:
        """``--threads``, else one per core this process may use: ``--cpus``
        when given, else its affinity capped by a container's CPU quota
        (edge/host.py says why a visible core is not a usable one)."""
        return self.threads or len(parse_cpus(self.cpus)) or usable_cpus()

    @property
    def n_ctx_per_lane(self) -> int:
        return self.ctx_per_lane or self.ctx // self.lanes

    @property
    def budget(self) -> int:
        return min(self.max_batch_tokens or self.batch, self.batch)


_OPTIONS: list[tuple[str, type, str]] = [
    ("bind", str, "ZeroMQ endpoint the ROUTER socket binds (tcp://, ipc://, inproc://)"),
    ("model", str, "GGUF file path, or 'default' for the packaged Gemma 3 270M Q4_K_M"),
    ("lanes", int, "KV-cache lanes = concurrent sessions (llama.cpp n_seq_max)"),
    ("ctx", int, "total KV cells shared by all lanes"),
    ("ctx-per-lane", int, "cells one lane may use; 0 = ctx / lanes (more = unified KV)"),
    ("batch", int, "n_batch: most tokens one llama_decode takes"),
    ("ubatch", int, "n_ubatch: physical micro-batch size"),
    (
        "threads",
        int,
        "compute threads; 0 = one per core this process may use (--cpus, "
        "affinity, a container's CPU quota)",
    ),
    (
        "cpus",
        str,
        "cores this worker runs on, e.g. 0, 2-3 or 0,2 (pinned before llama.cpp starts its "
        "threads: one host can stand in for several); empty = any",
    ),
    ("repack", int, "1 = llama.cpp weight repacking (needs --kernels upstream); 0 = off"),
    ("max-batch-tokens", int, "token budget of one scheduler turn; 0 = batch"),
    ("prefill-chunk", int, "prompt tokens one prefill may add to a turn (1/8 more to finish)"),
    (
        "cadence",
        float,
        "while streams decode, prefill is cut so a turn lasts at most this x a decode-only "
        "turn (learned); 0 = token budget only",
    ),
    ("max-queue", int, "requests that may wait for a lane before queue_full"),
    (
        "prefix-cache",
        int,
        "idle lanes that keep their KV and tokens for prompts sharing a prefix; -1 = all, 0 = off",
    ),
    (
        "kernels",
        str,
        "exact: every row computed as if alone (logits independent of batch, chunking, "
        "threads, migration); upstream: llama.cpp's own paths (slower where measured: "
        "exact prefill ~1.4x upstream's and decode 1.4-1.8x on AVX-512 VNNI; prefill "
        "1.1-1.2x and decode level on AVX2; logits depend on the batch, as in llama-server)",
    ),
    ("admission-timeout-ms", int, "longest wait for a lane before deadline_exceeded"),
    ("session-idle-s", float, "drop named sessions unused this long (frees lanes of gone peers)"),
    (
        "park-bytes",
        int,
        "host memory for parked sessions (idle sessions whose lane a new one needed; restored "
        "exactly when named again); -1 = a quarter of the memory this worker may use (its "
        "cgroup limit, else RAM), 0 = no parking (lanes_busy)",
    ),
    (
        "park-dir",
        str,
        "directory for parked sessions past --park-bytes; without it the least recently parked "
        "are evicted (naming one answers session_not_active)",
    ),
    (
        "prompt-ram-bytes",
        int,
        "host memory for the cells of prompts the prefix cache's lanes had to give up (a prompt "
        "sharing their prefix loads them instead of prefilling); -1 = an eighth of the memory "
        "this worker may use, 0 = off",
    ),
    ("max-request-bytes", int, "largest request header; larger is payload_too_large"),
    (
        "max-message-bytes",
        int,
        "largest ZeroMQ frame a peer may send; larger drops its connection (MAXMSGSIZE)",
    ),
    *((name.replace("_", "-"), int, LIMIT_HELP[name]) for name in LIMIT_FIELDS),
    ("draft-model", str, "GGUF (or 'default') drafting for speculative.mode=draft_model"),
    (
        "speculate",
        str,
        "generations that ask for no speculative decoding: auto = exact prompt-lookup drafts "
        "while few streams decode (--speculate-streams), off = never",
    ),
    (
        "speculate-streams",
        int,
        "--speculate auto drafts while at most this many jobs (a prompt being prefilled "
        "counts) share one forward",
    ),
    (
        "mmproj",
        str,
        "multimodal projector GGUF (the model's mmproj) for prefill_media and media in "
        "generate/chat; empty = text only",
    ),
    (
        "max-image-pixels",
        int,
        "largest image (width x height) a request may send; checked from the PNG/JPEG "
        "header before decoding",
    ),
    ("layers", str, "LO:HI: serve only these layers, as one pipeline stage; empty = all"),
    ("next", str, "endpoint of the next stage (every stage but the last has one)"),
    ("frame-dtype", str, "hidden rows to the next stage: f32 (exact) or f16 (half the bytes)"),
    (
        "chain-credit",
        int,
        "forwards a stage keeps in flight down the chain (pipelining); 1 = wait for each",
    ),
    (
        "pipeline-groups",
        int,
        "stage 0: decode streams split into this many groups that take turns down the "
        "chain, so every stage computes while the others do (set it to the number of "
        "stages when they run on separate hosts or cores); 1 = one batch that waits "
        "for the streams in flight (stages sharing cores)",
    ),
    ("metrics-port", int, "serve Prometheus metrics on this HTTP port (/metrics); 0 = off"),
    ("metrics-host", str, "address the metrics port binds"),
    (
        "send-hwm",
        int,
        "messages queued for one peer before it counts as not reading and its work is "
        "cancelled (a gateway is one peer: keep it high there)",
    ),
    (
        "drain-timeout-s",
        float,
        "on SIGTERM/SIGINT refuse new work (shutting_down) and let accepted work finish "
        "this long, then cancel the rest and exit 0; a second signal cancels at once",
    ),
    (
        "curve-secret-key",
        str,
        "CURVE on: this worker's secret certificate (skiff-keys); it encrypts every "
        "connection and is its identity toward the next stage; empty = plain",
    ),
    (
        "curve-authorized",
        str,
        "CURVE: directory of the public certificates (*.key) of the clients allowed in",
    ),
    (
        "curve-server-key",
        str,
        "CURVE: public certificate of the next stage (pipeline stages with --next)",
    ),
    ("log-format", str, "log rendering: auto (console on a TTY, else json), json, console"),
    ("log-level", str, "debug, info, warning, error"),
    ("chat-template", str, "Jinja chat template file for chat; empty = the model's or Gemma-turn"),
]


_CHOICES: dict[str, tuple[str, ...]] = {
    "log-format": LOG_FORMATS,
    "kernels": ("exact", "upstream"),
    "speculate": ("auto", "off"),
    "frame-dtype": ("f32", "f16"),
}
FLAGS = flags.Flags(
    [
        flags.Flag(
            option,
            kind,
            text,
            default=getattr(WorkerConfig(), option.replace("-", "_")),
            choices=_CHOICES.get(option),
        )
        for option, kind, text in _OPTIONS
    ]
)


def env_name(option: str) -> str:
    return flags.env_name(FLAGS.prefix, option)


def build_parser(prog: str = "skiff-worker") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="skiff LLM worker: one llama.cpp model served over a ZeroMQ ROUTER socket.",
    )
    FLAGS.add_to(parser)
    return parser


def parse(argv: Sequence[str] | None = None) -> WorkerConfig:
    ns = build_parser().parse_args(argv)
    cfg = WorkerConfig(**{k: v for k, v in vars(ns).items()})
    why = invalid(cfg.limits)
    if why is not None:
        raise SystemExit(f"skiff-worker: {why}")
    if (
        cfg.lanes < 1
        or cfg.ctx < cfg.lanes
        or cfg.batch < 1
        or cfg.prefill_chunk < 1
        or cfg.chain_credit < 1
        or cfg.pipeline_groups < 1
    ):
        raise SystemExit(
            "skiff-worker: lanes, ctx, batch, prefill-chunk, chain-credit and pipeline-groups "
            "must be positive"
        )
    try:
        parse_cpus(cfg.cpus)
    except ValueError as exc:
        raise SystemExit(f"skiff-worker: --cpus {cfg.cpus!r}: {exc}") from None
    if cfg.park_bytes < -1:
        raise SystemExit("skiff-worker: --park-bytes must be >= 0, or -1 for the default")
    if cfg.prompt_ram_bytes < -1:
        raise SystemExit("skiff-worker: --prompt-ram-bytes must be >= 0, or -1 for the default")
    if cfg.send_hwm < 1:
        raise SystemExit("skiff-worker: --send-hwm must be positive")
    if cfg.repack and cfg.kernels == "exact":
        raise SystemExit(
            "skiff-worker: --repack 1 switches kernels with the batch size; it needs --kernels "
            "upstream (exact rows are the default)"
        )
    if cfg.drain_timeout_s < 0:
        raise SystemExit("skiff-worker: --drain-timeout-s must be >= 0")
    if not 0 <= cfg.metrics_port <= 65535:
        raise SystemExit("skiff-worker: --metrics-port must be in 0..65535 (0 = off)")
    curve_keys(cfg)  # every CURVE mistake ends startup here, naming the flag
    if cfg.mmproj and not os.path.isfile(cfg.mmproj):
        raise SystemExit(f"skiff-worker: --mmproj {cfg.mmproj}: no such file")
    if cfg.max_image_pixels < 1:
        raise SystemExit("skiff-worker: --max-image-pixels must be positive")
    if cfg.chat_template and not os.path.isfile(cfg.chat_template):
        raise SystemExit(f"skiff-worker: --chat-template {cfg.chat_template}: no such file")
    return cfg


def parse_cpus(text: str) -> set[int]:
    """``--cpus``: core numbers and ranges, comma-separated ("0", "2-3",
    "0,2-3"); empty is no pinning. Every core must be one this process may use."""
    if not text.strip():
        return set()
    cores: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError("give core numbers and ranges, e.g. 0 or 2-3 or 0,2")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"the range {part.strip()} runs backwards")
        cores.update(range(first, last + 1))
    allowed = os.sched_getaffinity(0)
    if not cores <= allowed:
        raise ValueError(
            f"cores {sorted(cores - allowed)} are not available here ({sorted(allowed)})"
        )
    return cores


def park_bytes(cfg: WorkerConfig) -> int:
    """``--park-bytes`` resolved: -1 is a quarter of the memory this process
    may use (a container's cgroup limit, else the machine's RAM): a worker
    under a 2 GiB limit must not plan on a quarter of the host."""
    if cfg.park_bytes >= 0:
        return cfg.park_bytes
    return memory_limit() // 4


def prompt_ram_bytes(cfg: WorkerConfig) -> int:
    """``--prompt-ram-bytes`` resolved: -1 is an eighth of the memory this
    process may use (as ``park_bytes``, half its share: a lost prompt costs
    a prefill, a lost parked session its whole conversation)."""
    return cfg.prompt_ram_bytes if cfg.prompt_ram_bytes >= 0 else memory_limit() // 8


def curve_keys(cfg: WorkerConfig) -> Curve | None:
    """The worker's CURVE keys (own pair; with ``--next`` the next stage's
    public key as ``server_key``), or None when CURVE is off."""
    return keys_from_flags(
        "skiff-worker",
        cfg.curve_secret_key,
        cfg.curve_authorized,
        cfg.curve_server_key,
        dials="the next stage (--next)" if cfg.next else "",
    )
