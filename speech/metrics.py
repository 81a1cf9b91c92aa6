"""The speech worker's Prometheus metrics (``--metrics-port``).

Requests, errors, end-to-end time and time to first audio come from the
shared edge (``edge/metrics.py``, op ``synthesize``). This collector adds
what only the speech service knows, read at scrape time on the exporter's
thread: the service's counters are plain ints and floats and its queue a
deque whose ``len`` is one step under the GIL, so nothing here locks or
calls into the engine.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from edge.metrics import EdgeMetrics

from .server import SpeechService


class SpeechCollector(Collector):
    """Audio produced, synthesis time, queue, from ``SpeechService`` counters."""

    def __init__(self, service: SpeechService) -> None:
        self._service = service

    def collect(self) -> Iterator[Metric]:
        svc = self._service
        c = svc.counters
        counters: list[tuple[str, str, float]] = [
            ("skiff_speech_audio_seconds", "Seconds of audio synthesized.", c.audio_seconds),
            (
                "skiff_speech_synthesis_seconds",
                "Seconds spent synthesizing (engine time).",
                c.synth_seconds,
            ),
            ("skiff_speech_completed", "Synthesize requests completed.", c.completed),
            ("skiff_speech_cancelled", "Synthesize requests cancelled.", c.cancelled),
            ("skiff_speech_rejected", "Synthesize requests refused with queue_full.", c.rejected),
            ("skiff_speech_dropped", "Jobs dropped because their peer went away.", c.dropped),
            ("skiff_speech_chunks", "Text chunks synthesized (clauses, sentences).", c.chunks),
        ]
        for name, text, value in counters:
            yield CounterMetricFamily(name, text, value=value)
        yield GaugeMetricFamily(
            "skiff_speech_queue_depth", "Synthesize requests waiting.", value=len(svc.queue)
        )
        yield GaugeMetricFamily(
            "skiff_speech_running",
            "Synthesize requests being synthesized (0 or 1).",
            value=0 if svc.current is None else 1,
        )


def speech_metrics(registry: CollectorRegistry, service: SpeechService) -> EdgeMetrics:
    """Register the speech collector; the edge metrics to hand the ``EdgeServer``."""
    registry.register(SpeechCollector(service))
    return EdgeMetrics(registry, service.handlers)


__all__ = ["SpeechCollector", "speech_metrics"]
