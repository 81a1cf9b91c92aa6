"""The gateway loop in-process in front of fake workers (``_gateway_fakes``):
id remapping and pass-through buffers, what the gateway answers itself,
sessions sticking to their worker and affinity rebuilt from ``stats``,
cancel, and the limit on a client's requests in flight.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from _gateway_fakes import (
    DOWN_AFTER_MS,
    HEALTH_MS,
    STALL_AFTER_MS,
    Cluster,
    FakeWorker,
    started_cluster,
)

from conftest import WAIT_S, wait_until
from gateway.config import GatewayConfig
from gateway.runner import Gateway
from protocol import Client, SkiffError
from protocol.sockets import SocketOptions


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    yield from started_cluster(tmp_path)


def test_no_worker_up_is_worker_unavailable(tmp_path: Path) -> None:
    cfg = GatewayConfig(bind=f"ipc://{tmp_path}/gw.sock", workers=(f"ipc://{tmp_path}/none.sock",))
    gateway = Gateway(cfg)
    thread = threading.Thread(target=gateway.serve_forever, daemon=True)
    thread.start()
    try:
        with Client(gateway.endpoint, timeout_ms=int(WAIT_S * 1000)) as c:
            assert c.ping() == {"pong": True}  # the gateway itself answers
            for op in ("tokenize", "info"):
                with pytest.raises(SkiffError) as err:
                    c.call(op, None, {"text": "hi"})
                assert err.value.code == "worker_unavailable"
    finally:
        gateway.stop()
        thread.join(WAIT_S)
        gateway.close()


def test_ids_are_remapped_and_buffers_pass_through(cluster: Cluster) -> None:
    payload = os.urandom(1 << 20)
    with cluster.client() as one, cluster.client() as two:
        # both clients count ids from 1: the same ids are in flight at once
        sent = [
            (c, c.send("echo", None, {"frame": {"n": i}}, [payload[i:], b"tail%d" % i]))
            for i, c in enumerate((one, two, one, two))
        ]
        assert sent[0][1] == sent[1][1]
        for i, (c, rid) in enumerate(sent):
            reply = c.recv(rid).raise_for_error()
            assert reply.header["id"] == rid and reply.result == {"frame": {"n": i}}
            assert [bytes(b) for b in reply.buffers] == [payload[i:], b"tail%d" % i]
    echoes = [h for f in cluster.fakes for h in f.ops("echo")]
    assert len(echoes) == 4 and len({h["id"] for h in echoes}) == 4


def test_ping_info_stats_are_answered_by_the_gateway(cluster: Cluster) -> None:
    with cluster.client() as c:
        before = [len(f.ops("info")) for f in cluster.fakes]
        info = c.info()
        stats = c.stats()
        assert c.ping() == {"pong": True}
    assert info["model"]["name"] == "fake" and "gateway_drain" in info["ops"]
    assert info["gateway"]["workers_up"] == 2
    models = info["gateway"]["models"]  # each worker's own model, for /v1/models
    assert [(m["worker"], m["name"], m["up"]) for m in models] == [
        (f.endpoint, "fake", True) for f in cluster.fakes
    ]
    assert stats["gateway"] is True and stats["lanes"]["total"] == 8
    assert [len(f.ops("info")) for f in cluster.fakes] == before  # from the cache


def test_unknown_ops_reach_a_worker(cluster: Cluster) -> None:
    with cluster.client() as c, pytest.raises(SkiffError) as err:
        c.call("frobnicate")
    assert err.value.code == "unknown_op" and "fake" in err.value.message


def test_sessions_stick_to_their_worker_and_drop_clears_affinity(cluster: Cluster) -> None:
    names = [f"s{i}" for i in range(6)]
    with cluster.client() as c:
        for s in names:
            assert c.prefill(s, [1, 2]) == 2
        holders = {s: cluster.holder(s) for s in names}
        assert {id(h) for h in holders.values()} == {id(f) for f in cluster.fakes}  # spread
        for s in names:
            assert c.prefill(s, [3]) == 3  # landed where its first two tokens are
        status = cluster.status()
        placed = {s: w["endpoint"] for w in status["workers"] for s in w["sessions"]}
        assert placed == {s: h.endpoint for s, h in holders.items()}
        c.drop("s0")
        assert "s0" not in {s for w in cluster.status()["workers"] for s in w["sessions"]}
        assert all("s0" not in f.sessions for f in cluster.fakes)
        # a batch over sessions of two workers cannot be served by one
        a = next(s for s in names[1:] if holders[s] is cluster.fakes[0])
        b = next(s for s in names[1:] if holders[s] is cluster.fakes[1])
        with pytest.raises(SkiffError) as err:
            c.decode_batch([{"session": a, "token": 1}, {"session": b, "token": 1}])
        assert err.value.code == "bad_request"


def test_a_refused_first_request_does_not_pin_the_session(tmp_path: Path) -> None:
    cl = Cluster(tmp_path, lanes=1)
    try:
        cl.wait_up()
        with cl.client() as c:
            assert c.prefill("a", [1]) == 1 and c.prefill("b", [1]) == 1  # one on each
            with pytest.raises(SkiffError) as err:
                c.prefill("c", [1])
            assert err.value.code == "lanes_busy"
            assert "c" not in {s for w in cl.status()["workers"] for s in w["sessions"]}
            c.drop("a")
            assert c.prefill("c", [1]) == 1  # placed afresh, on the worker with room
    finally:
        cl.close()


def test_cancel_reaches_the_worker_running_the_request(cluster: Cluster) -> None:
    with cluster.client() as c:
        rid = c.send("generate", None, {"prompt": "x", "max_tokens": 100_000})
        assert c.recv(rid).header["event"] == "token"
        assert c.cancel(rid) is True
        last = list(c.follow(rid))[-1]
        assert last.header["finish_reason"] == "cancelled"
        assert c.cancel(12345) is False  # nothing of ours by that id
    (gen,) = [h for f in cluster.fakes for h in f.ops("generate")]
    (cancel,) = [h for f in cluster.fakes for h in f.ops("cancel")]
    assert cancel["args"] == {"id": gen["id"]} and gen["id"] != rid


def test_affinity_is_rebuilt_from_workers_stats(tmp_path: Path) -> None:
    # listed by the second worker before the gateway's first stats (a session
    # added later would show only after a later stats: a race with the check)
    cl = Cluster(tmp_path, sessions_on=({}, {"kept": 5}))
    try:
        cl.wait_up()  # up only after its stats are applied
        with cl.client() as c:
            placed = {s: w["endpoint"] for w in cl.status()["workers"] for s in w["sessions"]}
            assert placed == {"kept": cl.fakes[1].endpoint}
            assert c.prefill("kept", [1]) == 6
    finally:
        cl.close()


def test_requests_in_flight_per_client_are_limited(tmp_path: Path) -> None:
    fake = FakeWorker(f"ipc://{tmp_path}/fake.sock")
    fake.start()
    cfg = GatewayConfig(
        bind=f"ipc://{tmp_path}/gw.sock",
        workers=(fake.endpoint,),
        health_interval_ms=HEALTH_MS,
        down_after_ms=DOWN_AFTER_MS,
        stall_after_ms=STALL_AFTER_MS,
        max_inflight_per_client=2,
    )
    gateway = Gateway(cfg)
    trusted = gateway.service.trust_peer()
    thread = threading.Thread(target=gateway.serve_forever, daemon=True)
    thread.start()
    try:
        wait_ms = int(WAIT_S * 1000)
        with (
            Client(gateway.endpoint, timeout_ms=wait_ms) as a,
            Client(gateway.endpoint, timeout_ms=wait_ms) as b,
        ):
            wait_until(
                lambda: a.call("gateway_status").result["workers"][0]["up"], what="worker up"
            )
            fake.streams_open.clear()  # a's two streams stay in flight until we say
            first = [a.send("generate", None, {"max_tokens": 10}) for _ in range(2)]
            with pytest.raises(SkiffError) as err:
                a.call("generate", None, {"max_tokens": 1})
            assert err.value.code == "limit_exceeded" and "--max-inflight-per-client" in str(
                err.value
            )
            other = b.send("generate", None, {"max_tokens": 1})  # others go on
            wait_until(lambda: len(fake.ops("generate")) == 3, what="b's request forwarded")
            fake.streams_open.set()
            assert list(b.follow(other))[-1].header["finish_reason"] == "length"
            for rid in first:
                assert list(a.follow(rid))[-1].header["finish_reason"] == "length"
            assert list(a.follow(a.send("generate", None, {"max_tokens": 1})))  # room again
        opts = SocketOptions(max_message_bytes=-1, routing_id=trusted)
        with Client(gateway.endpoint, timeout_ms=wait_ms, options=opts) as front:
            fake.streams_open.clear()  # all four in flight at once
            ids = [front.send("generate", None, {"max_tokens": 3}) for _ in range(4)]
            wait_until(lambda: len(fake.ops("generate")) == 8, what="the front's 4 forwarded")
            fake.streams_open.set()
            for rid in ids:  # the in-process HTTP front carries many clients: not limited
                assert list(front.follow(rid))[-1].header["finish_reason"] == "length"
    finally:
        gateway.stop()
        thread.join(WAIT_S)
        gateway.close()
        fake.stop()
