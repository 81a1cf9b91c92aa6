"""Parked sessions: lanes are a cache over sessions.

A worker with 4 lanes holds 64 named sessions: each new one parks the least
recently used idle session (its KV cells saved to host memory) and each one
named again is restored first. The continuation must equal, to the bit, the
one on a worker with 64 lanes where nothing was ever parked: the first
continued row's logits (max abs diff 0.0), greedy tokens, and seeded
sampling whose sampler state lived through the park.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import start_worker, stop_worker
from protocol import Client, SkiffError
from worker.runtime.lanes import Session
from worker.runtime.park import Park

SESSIONS = 64
# Short prompts: what this test shows is 64 sessions taking turns on 4 lanes
# (every one parked and restored); a session past the 512-token window is
# parked and restored in test_a_session_past_the_sliding_window_parks_and_restores_exactly.
PROMPT_TOKENS = 96
CELLS = 512  # per lane, on both workers
SEEDED = {"temperature": 0.9, "top_k": 40, "seed": 1234}


def _prompt(i: int) -> list[int]:
    """A distinct prompt (token ids drawn per session)."""
    return [int(t) for t in np.random.default_rng(i).integers(1000, 200_000, PROMPT_TOKENS)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(4 lanes with a park, 64 lanes): the same cells per lane."""
    tmp = tmp_path_factory.mktemp("park")
    small = start_worker(tmp, "--lanes", "4", "--ctx", str(4 * CELLS), name="four")
    wide = start_worker(tmp, "--lanes", "64", "--ctx", str(64 * CELLS), name="wide")
    yield small[1], wide[1]
    stop_worker(small[0])
    stop_worker(wide[0])


def _tokens(replies: list[Any]) -> list[int]:
    return [r.header["token"] for r in replies if r.header.get("event") == "token"]


def test_64_sessions_on_4_lanes_continue_as_on_64(pair: tuple[str, str]) -> None:
    small, wide = pair
    with Client(small, timeout_ms=120_000) as four, Client(wide, timeout_ms=120_000) as many:
        for i in range(SESSIONS):
            for client in (four, many):
                assert client.prefill(f"s{i}", _prompt(i)) == PROMPT_TOKENS
        # Seeded sampling on a few sessions now, so a sampler (and its RNG
        # state) is parked with them and must go on where it was.
        seeded = range(0, SESSIONS, 8)
        for i in seeded:
            args = {"tokens": [7], "max_tokens": 3, "ignore_eos": True, "sampling": SEEDED}
            a = _tokens(list(four.generate(args, session=f"s{i}")))
            b = _tokens(list(many.generate(args, session=f"s{i}")))
            assert len(a) == 3 and a == b
        stats = four.stats()
        assert stats["park"]["sessions"] == SESSIONS - 4
        assert sum(1 for s in stats["sessions"] if s.get("parked")) == SESSIONS - 4

        order = random.Random(22).sample(range(SESSIONS), SESSIONS)
        for i in order:
            ra = four.decode(f"s{i}", 5, return_logits=True)
            rb = many.decode(f"s{i}", 5, return_logits=True)
            la, lb = ra.frame.array("logits"), rb.frame.array("logits")
            assert float(np.max(np.abs(la - lb))) == 0.0, f"s{i}: logits differ after a restore"
            assert ra.result == rb.result
        for i in order[:16]:
            sampling = SEEDED if i in seeded else None
            args: dict[str, Any] = {"tokens": [9], "max_tokens": 4, "ignore_eos": True}
            if sampling is not None:
                args["sampling"] = sampling
            a = _tokens(list(four.generate(args, session=f"s{i}")))
            b = _tokens(list(many.generate(args, session=f"s{i}")))
            assert len(a) == 4 and a == b, f"s{i}: the continuation differs after a restore"

        park = four.stats()["park"]
        assert park["parks"] >= SESSIONS - 4 + SESSIONS
        assert park["restores"] >= SESSIONS
        assert park["evictions"] == 0
        assert four.info()["limits"]["park_bytes"] > 0
        for i in range(SESSIONS):
            four.drop(f"s{i}")
            many.drop(f"s{i}")
        after = four.stats()
        assert after["park"]["sessions"] == 0 and after["park"]["bytes"] == 0


def test_an_evicted_session_says_so(tmp_path: Path) -> None:
    """A park that holds one short session: parking a second evicts the
    first, and naming it is ``session_not_active`` saying it was evicted."""
    proc, endpoint, _ = start_worker(
        tmp_path, "--lanes", "1", "--ctx", "256", "--park-bytes", "400000", name="tiny"
    )
    try:
        with Client(endpoint) as client:
            for name in ("a", "b", "c"):  # b parks a; c parks b, which evicts a
                client.prefill(name, list(range(1000, 1016)))
            park = client.stats()["park"]
            assert park["evictions"] == 1 and park["sessions"] == 1
            assert client.decode("b", 5)["position"] == 17  # still parked: restored
            with pytest.raises(SkiffError) as err:
                client.decode("a", 5)
            assert err.value.code == "session_not_active"
            assert "evicted" in err.value.message
            with pytest.raises(SkiffError, match="evicted"):  # still, until it is dropped
                client.prefill("a", [1000])
            client.drop("a")
            assert client.prefill("a", [1000]) == 1  # a new session under the old name
    finally:
        stop_worker(proc)


# -- the park itself, without an engine --------------------------------------------


def _kv(n: int) -> np.ndarray:
    return np.full(n, 7, dtype=np.uint8)


def test_park_keeps_memory_under_its_limit_and_evicts_the_oldest() -> None:
    park = Park(limit=250)
    for name in ("a", "b", "c"):
        park.put(Session(name, -1, position=3), _kv(100))
    assert park.memory_bytes == 200 and len(park) == 2
    assert park.was_evicted("a") and "a" not in park
    session, kv = park.take("b")
    assert session.position == 3 and kv.nbytes == 100 and park.memory_bytes == 100
    park.put(session, kv)  # parked again: no longer remembered as evicted either way
    assert park.drop("c") is not None and park.memory_bytes == 100
    assert park.stats()["evictions"] == 1


def test_park_spills_to_its_directory_and_reads_back(tmp_path: Path) -> None:
    park = Park(limit=150, directory=tmp_path / "park")
    data = [np.arange(100, dtype=np.uint8) + i for i in range(3)]
    for i, kv in enumerate(data):
        park.put(Session(f"s{i}", -1), kv)
    assert park.memory_bytes <= 150 and park.disk_bytes == 200 and park.spills == 2
    assert not any(park.was_evicted(f"s{i}") for i in range(3))
    for i, kv in enumerate(data):
        _, back = park.take(f"s{i}")
        assert np.array_equal(back, kv)
    assert park.disk_bytes == 0 and not list((tmp_path / "park").iterdir())


def test_parking_never_evicts_a_session_being_restored() -> None:
    """Making room for a restore parks another session; the park must then
    evict someone else (or run over its limit for a moment), never the
    session about to come back."""
    park = Park(limit=150)
    park.put(Session("back", -1, position=5), _kv(100))
    park.put(Session("other", -1), _kv(100), keep=frozenset({"back"}))
    assert "back" in park and not park.was_evicted("back")
    session, _ = park.take("back")
    assert session.position == 5


def test_a_session_past_the_sliding_window_parks_and_restores_exactly(client: Client) -> None:
    """llama.cpp's sequence state has had bugs on sliding-window caches past
    the window: a 700-token session (window 512) is parked and restored, and
    its next row's logits equal an unparked twin's (max abs diff 0.0)."""
    prompt = [int(t) for t in np.random.default_rng(700).integers(1000, 200_000, 700)]
    assert client.prefill("long-ref", prompt) == 700
    ref = client.decode("long-ref", 5, return_logits=True)
    assert client.prefill("long", prompt) == 700
    lanes = client.stats()["lanes"]["total"]
    for i in range(lanes):  # every lane taken by a newer session: "long" is parked
        client.prefill(f"filler{i}", [1000 + i, 1001])
    parked = {s["session"] for s in client.stats()["sessions"] if s.get("parked")}
    assert "long" in parked
    restores = client.stats()["park"]["restores"]
    got = client.decode("long", 5, return_logits=True)
    assert client.stats()["park"]["restores"] > restores
    diff = np.max(np.abs(got.frame.array("logits") - ref.frame.array("logits")))
    assert float(diff) == 0.0 and got.result == ref.result
