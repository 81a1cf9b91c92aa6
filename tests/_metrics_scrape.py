"""Reading Prometheus metrics, for the test_metrics_* modules: every sample of
a text page keyed by (name, labels), a scrape of ``/metrics`` over HTTP, one
sample's value, and a free port for an exporter.
"""

from __future__ import annotations

import socket
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from conftest import WAIT_S

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of a Prometheus text page, keyed by (name, labels)."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=WAIT_S) as resp:
        assert resp.status == 200
        return parse(resp.read().decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value; 0 when absent (a labelled child not created yet)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
