"""Workers that go silent, stop or leave, in front of the gateway loop
in-process (fake workers: ``_gateway_fakes``): streams failed and workers
rejoining, a stopped process cut off by heartbeats, drains that move sessions
and hold their requests (or cannot move them), a worker shutting down, and a
draining gateway.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from _gateway_fakes import DOWN_AFTER_MS, HEALTH_MS, Cluster, started_cluster

from conftest import WAIT_S, wait_until
from gateway.config import GatewayConfig
from gateway.runner import Gateway
from protocol import Client, SkiffError


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    yield from started_cluster(tmp_path)


def test_a_silent_worker_fails_its_streams_and_rejoins(tmp_path: Path) -> None:
    # A hung worker is told only by its silence: 2 s of it here (the other
    # tests allow 10 s, so a slow fake thread is never taken for a hung one).
    cluster = Cluster(tmp_path, stall_after_ms=2_000)
    try:
        cluster.wait_up()
        with cluster.client() as c:
            # two streams, one per worker (the second sees the first one's load)
            rids = [c.send("generate", None, {"prompt": "x", "max_tokens": 200}) for _ in range(2)]
            for rid in rids:
                c.recv(rid)
            assert all(f.ops("generate") for f in cluster.fakes)
            victim, other = cluster.fakes
            c.prefill("doomed", [1])  # the idler worker: the second stream's is busier
            assert "doomed" in victim.sessions
            victim.silent.set()
            outcomes = []
            for rid in rids:
                try:
                    outcomes.append(list(c.follow(rid))[-1].header["finish_reason"])
                except SkiffError as exc:
                    outcomes.append(exc.code)
            assert sorted(outcomes) == ["length", "worker_unavailable"]
            down = {w["endpoint"]: w["up"] for w in cluster.status()["workers"]}
            assert down == {victim.endpoint: False, other.endpoint: True}
            assert c.prefill("after", [1]) == 1 and "after" in other.sessions
            # a session lost with its worker is refused, not silently restarted elsewhere
            with pytest.raises(SkiffError) as err:
                c.prefill("doomed", [2])
            assert err.value.code == "worker_unavailable" and "drop it" in err.value.message
            assert c.drop("doomed") == {}
            assert c.prefill("doomed", [2]) == 1 and "doomed" in other.sessions
            victim.silent.clear()
            cluster.wait_up()
            assert c.prefill("again", [1]) == 1 and "again" in victim.sessions  # the idler one
    finally:
        cluster.close()


def test_drain_moves_sessions_and_holds_their_requests(cluster: Cluster) -> None:
    with cluster.client() as c:
        for i in range(4):  # two on each worker (4 lanes each): room for two more
            c.prefill(f"d{i}", [1, 2, 3])
        src = cluster.fakes[0]
        dst = cluster.fakes[1]
        moving = sorted(s for s in src.sessions)
        assert moving
        src.exports_open.clear()  # the first move stops at its export until we say
        drain_id = c.send("gateway_drain", None, {"worker": src.endpoint})
        (held,) = wait_until(lambda: cluster.status()["held"], what="a session moving")
        follow = {s: c.send("prefill", s, {"tokens": [4]}) for s in moving}
        wait_until(
            lambda: cluster.status()["held"].get(held) == 1, what="its request held in the gateway"
        )
        src.exports_open.set()
        result = c.recv(drain_id).raise_for_error().result
        assert result["failed"] == [], result
        assert sorted(m["session"] for m in result["moved"]) == moving, result
        for rid in follow.values():
            assert c.recv(rid).raise_for_error().result["position"] == 4
        # every follow-up ran once, before its session left or after it landed
        assert all(dst.sessions.get(s) == 4 and s not in src.sessions for s in moving)
        # the held one waited in the gateway: it ran on the new worker, after the import
        order = [(h["op"], h.get("session")) for h in dst.seen]
        assert order.index(("import_state", held)) < order.index(("prefill", held))
        view = {w["endpoint"]: w for w in cluster.status()["workers"]}
        assert view[src.endpoint]["drained"] and view[src.endpoint]["sessions"] == []
        c.drop(moving[0])
        assert c.prefill("new", [1]) == 1 and "new" in dst.sessions  # nothing new on src
        with pytest.raises(SkiffError) as err:
            c.call("gateway_drain", None, {"worker": "tcp://nowhere:1"})
        assert err.value.code == "bad_request"


def test_a_stopped_worker_process_is_cut_off_by_heartbeats(tmp_path: Path) -> None:
    """SIGSTOP freezes the worker's ZeroMQ I/O thread too: the connection's
    heartbeats time out (down-after), not the much longer loop stall limit."""
    endpoint = f"ipc://{tmp_path}/proc.sock"
    code = (
        f"import sys, time; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        f"from _gateway_fakes import FakeWorker; FakeWorker({endpoint!r}).start(); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    cfg = GatewayConfig(
        bind=f"ipc://{tmp_path}/gw.sock",
        workers=(endpoint,),
        health_interval_ms=HEALTH_MS,
        down_after_ms=DOWN_AFTER_MS,
        stall_after_ms=600_000,
    )
    gateway = Gateway(cfg)
    thread = threading.Thread(target=gateway.serve_forever, daemon=True)
    thread.start()
    try:
        with Client(gateway.endpoint, timeout_ms=int(WAIT_S * 1000)) as c:

            def up() -> bool:
                return bool(c.call("gateway_status").result["workers"][0]["up"])

            wait_until(up, what="the fake worker process up")
            rid = c.send("generate", None, {"prompt": "x", "max_tokens": 100_000})
            c.recv(rid)
            os.kill(proc.pid, signal.SIGSTOP)
            with pytest.raises(SkiffError) as err:
                for _ in c.follow(rid):
                    pass
            assert err.value.code == "worker_unavailable"
            assert not up()
            os.kill(proc.pid, signal.SIGCONT)
            wait_until(up, what="the fake worker back up")
    finally:
        proc.kill()
        proc.wait(WAIT_S)
        gateway.stop()
        thread.join(WAIT_S)
        gateway.close()


def test_a_session_that_cannot_move_stays_and_is_served(tmp_path: Path) -> None:
    cl = Cluster(tmp_path, lanes=1)
    try:
        cl.wait_up()
        with cl.client() as c:
            c.prefill("a", [1])
            c.prefill("b", [1])  # both workers full: nowhere to move "a"
            src = cl.holder("a")
            result = c.call("gateway_drain", None, {"worker": src.endpoint}).result
            assert result["moved"] == [] and [f["session"] for f in result["failed"]] == ["a"]
            assert "free lane" in result["failed"][0]["error"]
            assert c.prefill("a", [2]) == 2 and cl.holder("a") is src  # still served there
            c.drop("b")
            with pytest.raises(SkiffError) as err:  # nothing new goes to the drained worker
                c.prefill("c", [1])
                c.prefill("d", [1])
            assert err.value.code == "lanes_busy"
            assert "c" not in src.sessions and "d" not in src.sessions
    finally:
        cl.close()


def test_work_a_shutting_down_worker_refuses_goes_to_another(cluster: Cluster) -> None:
    """``shutting_down`` means nothing ran: the gateway sends the request to
    the other worker, and no new work to the draining one until it restarts."""
    draining, other = cluster.fakes
    draining.shutting_down = True
    with cluster.client() as c:
        for i in range(4):  # whichever worker the policy picks first
            assert c.prefill(f"s{i}", [1, 2]) == 2
            rid = c.send("generate", None, {"max_tokens": 2})
            assert [r.header.get("finish_reason") for r in c.follow(rid)][-1] == "length"
    assert set(other.sessions) == {f"s{i}" for i in range(4)}
    assert draining.sessions == {}
    # Draining, then drained once the gateway has moved what it held (here
    # nothing; its stats say it is draining): no new work either way.
    wait_until(
        lambda: (
            [w["draining"] or w["drained"] for w in cluster.status()["workers"]] == [True, False]
        ),
        what="the refusing worker seen as draining",
    )


def test_a_draining_gateway_refuses_new_work_and_relays_the_rest(tmp_path: Path) -> None:
    cl = Cluster(tmp_path, n=1)
    cl.wait_up()
    try:
        fake = cl.fakes[0]
        with cl.client() as c:
            rid = c.send("generate", None, {"max_tokens": 20})
            c.recv(rid).raise_for_error()
            # the stream stays in flight (the drain waits for it) until we are done
            fake.streams_open.clear()
            cl.gateway.drain(WAIT_S)
            wait_until(lambda: c.call("stats").result["draining"], what="the gateway draining")
            with pytest.raises(SkiffError) as err:
                c.prefill("late", [1])
            assert err.value.code == "shutting_down"
            fake.streams_open.set()
            events = list(c.follow(rid))
            assert events[-1].header["finish_reason"] == "length"
        cl.thread.join(WAIT_S)
        assert not cl.thread.is_alive()  # the loop ended by itself once idle
    finally:
        cl.close()
