"""Prometheus metrics of real processes: the LLM worker's counters, gauges and
vLLM aliases, its park, and the speech worker's endpoint. The workers start
with ``--metrics-port``, run a few requests and are scraped over HTTP
(``_metrics_scrape``), asserting that each counter moved by exactly what the
requests did.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _metrics_scrape import free_port, scrape, value

from conftest import ROOT, WAIT_S, start_worker, stop_worker
from protocol import Client, SkiffError

# -- a real LLM worker -------------------------------------------------------------

# Over one 128-token prefill piece, so a second run can reuse the first piece.
LONG_PROMPT = " ".join(f"Item {n} is a small round pebble from the shore." for n in range(12))


@pytest.fixture(scope="module")
def metered_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    port = free_port()
    tmp = tmp_path_factory.mktemp("metrics_worker")
    proc, endpoint, _log = start_worker(
        tmp,
        "--lanes",
        "2",
        "--ctx",
        "2048",
        "--metrics-port",
        str(port),
        "--metrics-host",
        "127.0.0.1",
    )
    yield endpoint, port
    stop_worker(proc)


def test_worker_metrics_move_with_requests(metered_worker: tuple[str, int]) -> None:
    endpoint, port = metered_worker
    before = scrape(port)
    with Client(endpoint, timeout_ms=60_000) as c:
        prompt = c.tokenize("The capital of France is")
        c.prefill_sampled("m1", prompt)
        token = 2
        for _ in range(3):
            token = c.decode("m1", token)["token"]
        with pytest.raises(SkiffError) as info:
            c.decode("m1", -1)
        assert info.value.code == "bad_request"
        held = scrape(port)  # m1 holds one of the two lanes
        c.drop("m1")

        args = {"prompt": LONG_PROMPT, "max_tokens": 4, "ignore_eos": True}
        replies = list(c.generate(args))
        tokens = [r for r in replies if r.header.get("event") == "token"]
        done = replies[-1].header
        assert done["done"] and len(tokens) == 4
        # The same prompt again, not streamed: its prefix comes from the cache.
        again = c.call("generate", args={**args, "stream": False}).header["result"]
    after = scrape(port)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("skiff_requests_total", op="prefill_sampled") == 1
    assert delta("skiff_requests_total", op="decode") == 4
    assert delta("skiff_requests_total", op="generate") == 2
    assert delta("skiff_responses_total", op="decode", code="ok") == 3
    assert delta("skiff_request_errors_total", op="decode", code="bad_request") == 1
    assert delta("skiff_request_duration_seconds_count", op="decode") == 4
    assert delta("skiff_request_duration_seconds_count", op="generate") == 2
    assert delta("skiff_time_to_first_event_seconds_count", op="generate") == 1
    assert delta("skiff_inter_event_seconds_count", op="generate") == len(tokens) - 1
    usage = [done["usage"], again["usage"]]
    assert delta("skiff_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
    completion = sum(u["completion_tokens"] for u in usage)
    assert delta("skiff_generation_tokens_total") == completion == 8
    assert again["usage"]["cached_tokens"] > 0
    assert delta("skiff_prefix_cache_hits_total") >= 1
    assert delta("skiff_prefix_cache_reused_tokens_total") == again["usage"]["cached_tokens"]
    # Forward metrics: every forward observed once, every token counted once.
    forwards = delta("skiff_forward_seconds_count")
    assert forwards > 0
    assert delta("skiff_batch_tokens_count") == forwards == delta("skiff_batch_sequences_count")
    assert delta("skiff_batch_tokens_sum") == delta("skiff_tokens_evaluated_total")
    assert delta("skiff_scheduler_admitted_total") >= 3
    # Scrape-time gauges and the vLLM aliases, while m1 held a lane and after.
    names = {k[0] for k in held}
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting"} <= names
    alias_labels = {dict(k[1]).get("model_name", "") for k in held if k[0].startswith("vllm:")}
    assert len(alias_labels) == 1 and "" not in alias_labels  # one model_name, never empty
    model = {"model_name": alias_labels.pop()}
    assert value(held, "skiff_lanes_total") == 2
    assert value(held, "skiff_lanes_busy") == 1
    assert value(held, "skiff_lanes_free") == 1
    assert value(held, "skiff_kv_cells_used") == len(prompt) + 3
    assert value(held, "skiff_kv_cells_total") == 2048
    assert value(held, "vllm:kv_cache_usage_perc", **model) == 0.5
    for snapshot in (held, after):
        assert value(snapshot, "vllm:num_requests_running", **model) == 0
        assert value(snapshot, "vllm:num_requests_waiting", **model) == 0
        assert value(snapshot, "skiff_queue_depth") == 0
        assert value(snapshot, "skiff_requests_in_flight") == 0
    assert value(after, "skiff_lanes_busy") == 0
    assert value(after, "vllm:kv_cache_usage_perc", **model) == 0.0


def test_worker_metrics_show_the_park_as_stats_does(metered_worker: tuple[str, int]) -> None:
    """Two lanes, three sessions: the third parks the first, naming the
    first again restores it (parking the second). ``/metrics`` counts the
    same parks, restores, parked sessions and bytes as ``stats.park``."""
    endpoint, port = metered_worker
    before = scrape(port)
    with Client(endpoint, timeout_ms=60_000) as c:
        for i in range(3):
            c.prefill(f"park{i}", list(range(1000 + i, 1040 + i)))
        c.decode("park0", 5)  # restored; park1 goes to the park
        park = c.stats()["park"]
        held = scrape(port)
        for i in range(3):
            c.drop(f"park{i}")

    def delta(name: str) -> float:
        return value(held, name) - value(before, name)

    assert delta("skiff_parks_total") == 2
    assert delta("skiff_park_restores_total") == 1
    assert delta("skiff_park_restore_seconds_total") > 0
    assert value(held, "skiff_parked_sessions") == park["sessions"] == 1
    assert value(held, "skiff_park_bytes") == park["bytes"] > 0
    assert value(held, "skiff_park_disk_bytes") == park["disk_bytes"] == 0
    assert value(held, "skiff_parks_total") == park["parks"]
    assert value(held, "skiff_park_restores_total") == park["restores"]
    assert value(scrape(port), "skiff_parked_sessions") == 0  # dropped, parked or not


def test_worker_metrics_show_host_memory_as_stats_does(metered_worker: tuple[str, int]) -> None:
    """Two lanes, three 100-token prompts: the third takes the first's cached
    lane and its cells go to host memory; the first again loads them back.
    ``/metrics`` counts the same keeps, hits and bytes as ``stats.prefix_cache``."""
    endpoint, port = metered_worker
    prompts = [list(range(3000 + 200 * k, 3100 + 200 * k)) for k in range(3)]
    with Client(endpoint, timeout_ms=60_000) as c:
        before, cache0 = scrape(port), c.stats()["prefix_cache"]
        for tokens in [*prompts, prompts[0]]:
            c.call("generate", args={"tokens": tokens, "max_tokens": 1, "stream": False})
        after, cache1 = scrape(port), c.stats()["prefix_cache"]

    def delta(name: str) -> float:
        return value(after, name) - value(before, name)

    assert cache1["ram_kept"] - cache0["ram_kept"] >= 1  # the first prompt's cells, at least
    assert cache1["ram_hits"] - cache0["ram_hits"] == 1  # ... loaded back for its return
    assert delta("skiff_prefix_cache_ram_kept_total") == cache1["ram_kept"] - cache0["ram_kept"]
    assert delta("skiff_prefix_cache_ram_hits_total") == 1
    assert value(after, "skiff_prompt_ram_bytes") == cache1["ram_bytes"] > 0


def test_worker_metrics_port_off_by_default() -> None:
    from worker import config

    assert config.parse([]).metrics_port == 0
    with pytest.raises(SystemExit):
        config.parse(["--metrics-port", "70000"])


# -- the speech worker ------------------------------------------------------------


def test_speech_worker_serves_metrics(tmp_path: Path) -> None:
    pytest.importorskip("piper")
    port = free_port()
    endpoint = f"ipc://{tmp_path}/speech.sock"
    log_path = tmp_path / "speech.log"
    env = {**os.environ, "SKIFF_METRICS_PORT": str(port), "SKIFF_METRICS_HOST": "127.0.0.1"}
    cmd = [sys.executable, "-m", "speech.cli", "--bind", endpoint, "--threads", "1"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        with Client(endpoint, timeout_ms=60_000) as c:
            c.wait_ready(2 * WAIT_S, alive=lambda: proc.poll() is None)
            reply = c.call("synthesize", args={"text": "Hello there.", "format": "pcm_s16le"})
            seconds = reply.result["sample_count"] / reply.result["sample_rate"]
        s = scrape(port)
    finally:
        proc.terminate()
        proc.wait(WAIT_S)
    assert value(s, "skiff_requests_total", op="synthesize") == 1
    assert value(s, "skiff_responses_total", op="synthesize", code="ok") == 1
    assert value(s, "skiff_request_duration_seconds_count", op="synthesize") == 1
    assert value(s, "skiff_speech_audio_seconds_total") == pytest.approx(seconds, rel=1e-6)
    assert value(s, "skiff_speech_synthesis_seconds_total") > 0
    assert value(s, "skiff_speech_completed_total") == 1
    assert value(s, "skiff_speech_queue_depth") == 0
