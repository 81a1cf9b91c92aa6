"""A worker that gets SIGTERM tells whoever named its sessions that it is
leaving, and waits for a peer that claims them (``handoff``) to take them."""

from __future__ import annotations

import signal
from pathlib import Path

from conftest import start_worker, stop_worker, wait_until
from protocol import Client
from worker.handoff import Handoff


def test_sigterm_announces_leaving_and_waits_for_the_handoff(tmp_path: Path) -> None:
    proc, endpoint, _ = start_worker(tmp_path, "--lanes", "2", "--ctx", "512", name="leaving")
    try:
        with Client(endpoint, timeout_ms=60_000) as client:
            client.prefill("kept", list(range(1000, 1020)))
            proc.send_signal(signal.SIGTERM)
            notice = client.recv_any().header
            assert notice.get("event") == "leaving" and "id" not in notice
            assert notice["sessions"] == ["kept"]
            assert client.call("handoff").result == {"sessions": ["kept"]}
            # Claimed: the worker stays (it refuses new work, serves the hand-over).
            assert client.stats()["draining"] is True
            exported = client.export_state("kept")
            assert exported.result["frame"]
            client.drop("kept")  # the last one gone: the worker is done
        wait_until(lambda: proc.poll() is not None, what="the worker to exit after the hand-over")
        assert proc.returncode == 0
    finally:
        stop_worker(proc)


def test_a_worker_nobody_claims_from_still_exits(tmp_path: Path) -> None:
    proc, endpoint, _ = start_worker(tmp_path, "--lanes", "1", "--ctx", "256", name="unclaimed")
    try:
        with Client(endpoint, timeout_ms=60_000) as client:
            client.prefill("left", [1000, 1001])
            proc.send_signal(signal.SIGTERM)
            assert client.recv_any().header.get("event") == "leaving"
        wait_until(lambda: proc.poll() is not None, what="the worker to exit unclaimed")
        assert proc.returncode == 0
    finally:
        stop_worker(proc)


def test_a_claimer_that_gives_up_lets_the_worker_go(tmp_path: Path) -> None:
    """``handoff done`` with sessions left (nowhere to put them): the worker
    exits without sitting out its drain timeout."""
    proc, endpoint, _ = start_worker(
        tmp_path, "--lanes", "1", "--ctx", "256", "--drain-timeout-s", "600", name="given_up"
    )
    try:
        with Client(endpoint, timeout_ms=60_000) as client:
            client.prefill("stuck", [1000, 1001])
            proc.send_signal(signal.SIGTERM)
            assert client.recv_any().header.get("event") == "leaving"
            client.call("handoff")
            assert client.call("handoff", args={"done": True}).result == {"sessions": ["stuck"]}
        wait_until(lambda: proc.poll() is not None, what="the worker to exit once released")
        assert proc.returncode == 0
    finally:
        stop_worker(proc)


def test_a_claim_without_a_notice_holds_the_worker_while_it_holds_sessions() -> None:
    """A worker with only sessionless streams tells nobody ``leaving``; a
    gateway that saw it draining (``stats``) claims all the same, and the
    worker must wait while a suspended stream's session is still here (it
    is being exported), not exit under the move."""
    held = ["~moved-1"]
    hand = Handoff(lambda: list(held))
    assert hand.leaving() == (0, 0)  # nobody named it: no notice
    assert not hand.waiting()
    hand.claim(done=False)
    assert hand.waiting()
    held.clear()  # moved away and dropped
    assert not hand.waiting()
    held.append("~moved-2")
    assert hand.waiting()
    hand.claim(done=True)  # the claimer took what it could
    assert not hand.waiting()
    hand.claim(done=False)
    hand.give_up()  # the drain timeout
    assert not hand.waiting()
