"""The LLM worker's Prometheus metrics (``--metrics-port``).

Three sources, each read where it is safe to read:

- the edge (``edge/metrics.py``): requests, errors, end-to-end time, TTFT,
  inter-token time, all at this worker's socket;
- the scheduler's forward hook (``SchedulerStats.observer``): forward time
  and batch shape histograms, observed on the worker thread after each
  forward; and the edge's done hook: prompt and generated tokens from the
  ``usage`` of every finished ``generate`` / ``chat``;
- ``WorkerCollector``, called on the exporter's thread at each scrape: queue
  depth, running requests, lanes, KV cells, prefix-cache and scheduler
  counters. The runtime runs on one thread and may change any of it mid
  scrape, so the collector reads only ints and ``len`` of containers (one
  step each under the GIL), copies the session table in one C call, and
  never calls into the scheduler, the runtime or the engine.

It also exports the names Kubernetes LLM routers already read from vLLM
(``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``) as aliases; see docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from edge.metrics import EdgeMetrics

if TYPE_CHECKING:
    from .service import LlmService

FORWARD_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
    0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip
BATCH_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
BATCH_STEP_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)

# Ops whose final reply carries ``usage`` (docs/protocol.md, generate / chat).
USAGE_OPS = frozenset({"generate", "chat"})


@dataclass(frozen=True)
class WorkerSnapshot:
    """What one scrape reads from the live worker: plain numbers only."""

    queued: int
    running: int
    lanes_total: int
    lanes_busy: int
    lanes_free: int
    lanes_cached: int
    kv_cells_used: int
    kv_cells_total: int
    prefix_hits: int
    prefix_misses: int
    prefix_reused_tokens: int
    prefix_evictions: int
    prefix_ram_kept: int
    prefix_ram_hits: int
    admitted: int
    rejected: int
    cancelled: int
    expired: int
    tokens_evaluated: int
    parked_sessions: int = 0
    park_bytes: int = 0  # in memory
    park_disk_bytes: int = 0
    parks: int = 0
    restores: int = 0
    park_evictions: int = 0
    restore_seconds: float = 0.0
    prompt_ram_bytes: int = 0


def read_snapshot(service: LlmService, kv_cells_total: int) -> WorkerSnapshot:
    """Read the worker's counters from another thread without locking.

    Every read is an int attribute or ``len`` of a container, atomic under
    the GIL; the session table is copied by one ``list()`` (a C loop that
    runs no Python code) before its positions are summed. The values of one
    snapshot may straddle a turn; each is exact on its own.
    """
    sched = service.sched
    lanes = service.rt.lanes
    prefix = service.rt.prefix
    stats = sched.stats
    sessions = list(lanes.sessions.values())
    busy = len(sessions)
    park = service.rt.park
    ram = service.rt.prompt_ram
    return WorkerSnapshot(
        prompt_ram_bytes=ram.nbytes if ram is not None else 0,
        parked_sessions=len(park) if park is not None else 0,
        park_bytes=park.memory_bytes if park is not None else 0,
        park_disk_bytes=park.disk_bytes if park is not None else 0,
        parks=park.parks if park is not None else 0,
        restores=park.restores if park is not None else 0,
        park_evictions=park.evictions if park is not None else 0,
        restore_seconds=park.restore_s if park is not None else 0.0,
        queued=len(sched.pending),
        running=len(sched.active),
        lanes_total=lanes.n_lanes,
        lanes_busy=busy,
        lanes_free=lanes.n_lanes - busy,
        lanes_cached=lanes.cached,
        kv_cells_used=sum(s.position for s in sessions),
        kv_cells_total=kv_cells_total,
        prefix_hits=prefix.hits,
        prefix_misses=prefix.misses,
        prefix_reused_tokens=prefix.reused_tokens,
        prefix_evictions=prefix.evictions,
        prefix_ram_kept=prefix.ram_kept,
        prefix_ram_hits=prefix.ram_hits,
        admitted=stats.admitted,
        rejected=stats.rejected,
        cancelled=stats.cancelled,
        expired=stats.expired,
        tokens_evaluated=service.rt.tokens_evaluated,
    )


class WorkerCollector(Collector):
    """Gauges and counters read from the worker at scrape time."""

    def __init__(self, service: LlmService, model_name: str) -> None:
        self._service = service
        self._model = model_name
        self._kv_total = int(service.engine.n_ctx)  # read once, on the worker thread

    def collect(self) -> Iterator[Metric]:
        s = read_snapshot(self._service, self._kv_total)
        gauges: list[tuple[str, str, float]] = [
            ("skiff_queue_depth", "Requests waiting for admission (a lane).", s.queued),
            ("skiff_requests_running", "Requests admitted and running.", s.running),
            ("skiff_lanes_total", "KV lanes (llama.cpp sequences).", s.lanes_total),
            ("skiff_lanes_busy", "Lanes holding a session.", s.lanes_busy),
            ("skiff_lanes_free", "Lanes without a session (empty or prefix-cached).", s.lanes_free),
            ("skiff_lanes_cached", "Free lanes keeping KV for the prefix cache.", s.lanes_cached),
            (
                "skiff_kv_cells_used",
                "KV cells held by sessions (sum of their tracked positions).",
                s.kv_cells_used,
            ),
            ("skiff_kv_cells_total", "KV cells of the context (n_ctx).", s.kv_cells_total),
            ("skiff_parked_sessions", "Idle sessions parked off their lanes.", s.parked_sessions),
            ("skiff_park_bytes", "Host memory holding parked sessions.", s.park_bytes),
            ("skiff_park_disk_bytes", "Parked sessions spilled to --park-dir.", s.park_disk_bytes),
            (
                "skiff_prompt_ram_bytes",
                "Host memory holding evicted cached lanes' prompts (--prompt-ram-bytes).",
                s.prompt_ram_bytes,
            ),
        ]
        for name, text, value in gauges:
            yield GaugeMetricFamily(name, text, value=value)
        counters: list[tuple[str, str, float]] = [
            ("skiff_prefix_cache_hits", "Prompts that reused a cached prefix.", s.prefix_hits),
            ("skiff_prefix_cache_misses", "Prompts that found no shared prefix.", s.prefix_misses),
            (
                "skiff_prefix_cache_reused_tokens",
                "Prompt tokens not recomputed thanks to the prefix cache.",
                s.prefix_reused_tokens,
            ),
            ("skiff_prefix_cache_evictions", "Cached lanes evicted (LRU).", s.prefix_evictions),
            (
                "skiff_prefix_cache_ram_kept",
                "Evicted cached lanes whose cells went to host memory.",
                s.prefix_ram_kept,
            ),
            (
                "skiff_prefix_cache_ram_hits",
                "Prompts whose prefix came back from host memory (also in hits).",
                s.prefix_ram_hits,
            ),
            ("skiff_parks", "Sessions parked to free a lane.", s.parks),
            ("skiff_park_restores", "Parked sessions restored into a lane.", s.restores),
            (
                "skiff_park_evictions",
                "Parked sessions evicted past --park-bytes.",
                s.park_evictions,
            ),
            (
                "skiff_park_restore_seconds",
                "Time spent restoring parked sessions (read + llama.cpp load).",
                s.restore_seconds,
            ),
            ("skiff_scheduler_admitted", "Jobs admitted by the scheduler.", s.admitted),
            ("skiff_scheduler_rejected", "Jobs refused (queue_full, lanes_busy).", s.rejected),
            ("skiff_scheduler_cancelled", "Jobs cancelled (cancel op, lost peer).", s.cancelled),
            ("skiff_scheduler_expired", "Jobs past their deadline.", s.expired),
            (
                "skiff_tokens_evaluated",
                "Tokens run through the model by all forwards.",
                s.tokens_evaluated,
            ),
        ]
        for name, text, value in counters:
            yield CounterMetricFamily(name, text, value=value)
        labels = ["model_name"]
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "Alias of skiff_requests_running.", labels=labels
        )
        running.add_metric([self._model], s.running)
        yield running
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Alias of skiff_queue_depth.", labels=labels
        )
        waiting.add_metric([self._model], s.queued)
        yield waiting
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc",
            "Fraction (0..1) of lanes holding a session: skiff_lanes_busy / skiff_lanes_total.",
            labels=labels,
        )
        usage.add_metric([self._model], s.lanes_busy / max(1, s.lanes_total))
        yield usage


class WorkerMetrics:
    """Everything the LLM worker exports, on one registry."""

    def __init__(self, registry: CollectorRegistry, service: LlmService) -> None:
        self.registry = registry
        self.model_name = model_name(service)
        self.forward = Histogram(
            "skiff_forward_seconds",
            "Time of one forward (llama_decode calls and sampling of one turn).",
            buckets=FORWARD_BUCKETS,
            registry=registry,
        )
        self.batch_tokens = Histogram(
            "skiff_batch_tokens",
            "Tokens in one forward.",
            buckets=BATCH_TOKEN_BUCKETS,
            registry=registry,
        )
        self.batch_steps = Histogram(
            "skiff_batch_sequences",
            "Sessions advanced by one forward.",
            buckets=BATCH_STEP_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "skiff_prompt_tokens",
            "Prompt tokens of finished generate/chat requests (prefix-cached ones included).",
            registry=registry,
        )
        self.generation_tokens = Counter(
            "skiff_generation_tokens",
            "Tokens generated by finished generate/chat requests.",
            registry=registry,
        )
        self.edge = EdgeMetrics(registry, service.handlers, on_done=self.on_done)
        registry.register(WorkerCollector(service, self.model_name))
        service.sched.stats.observer = self.on_forward

    def on_forward(self, steps: int, tokens: int, seconds: float) -> None:
        """SchedulerStats' observer: one forward done (worker thread)."""
        self.forward.observe(seconds)
        self.batch_tokens.observe(tokens)
        self.batch_steps.observe(steps)

    def on_done(self, op: str, header: Mapping[str, Any]) -> None:
        """The edge's done hook: count a finished generation's ``usage``."""
        if op not in USAGE_OPS:
            return
        usage = header.get("usage")
        if usage is None:  # a non-streamed reply keeps it in its result
            result = header.get("result")
            usage = result.get("usage") if isinstance(result, Mapping) else None
        if not isinstance(usage, Mapping):
            return
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        if type(prompt) is int and prompt > 0:
            self.prompt_tokens.inc(prompt)
        if type(completion) is int and completion > 0:
            self.generation_tokens.inc(completion)


def model_name(service: LlmService) -> str:
    """The ``model_name`` label of the vLLM aliases: the GGUF's file name, no suffix."""
    return Path(service.engine.cfg.model_path).stem


__all__ = [
    "USAGE_OPS",
    "WorkerCollector",
    "WorkerMetrics",
    "WorkerSnapshot",
    "model_name",
    "read_snapshot",
]
