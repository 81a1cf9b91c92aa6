"""``protocol.peer.DealerPeer`` over real loopback TCP: replies routed by id,
a deadline failing its one request, a lost peer failing all of them, and the
one reader of an error reply (``transport.fault_of``).

The peer's owners (a stage's link, the gateway's pool, the HTTP front's
upstream) each rely on these; here a bare ROUTER plays the other side, so
every case is driven and observed directly, no model loaded.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from conftest import WAIT_S, wait_until
from faults import DeadlineExceeded, Fault, QueueFull, StageUnavailable, WorkerUnavailable
from protocol import transport
from protocol.peer import DealerPeer, NotSent
from protocol.sockets import SocketOptions
from protocol.transport import ForeignFault, error_reply, event_reply, fault_of, ok_reply, wire_code

WAIT_MS = int(WAIT_S * 1000)


class Log:
    """What reached one request: its replies' headers and buffers, its fault."""

    def __init__(self) -> None:
        self.replies: list[dict[str, Any]] = []
        self.buffers: list[list[bytes]] = []
        self.faults: list[Fault] = []

    def reply(self, header: dict[str, Any], frames: list[zmq.Frame]) -> None:
        self.replies.append(header)
        self.buffers.append([f.bytes for f in frames])

    def fail(self, fault: Fault) -> None:
        self.faults.append(fault)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _server(ctx: zmq.Context[Any]) -> tuple[zmq.Socket[Any], str]:
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    return router, router.getsockopt_string(zmq.LAST_ENDPOINT)


def _peer(ctx: zmq.Context[Any], endpoint: str, **kw: Any) -> DealerPeer:
    return DealerPeer(
        ctx,
        endpoint,
        SocketOptions(immediate=True),
        gone=lambda op: StageUnavailable(f"gone during {op}"),
        **kw,
    )


def _connected(peer: DealerPeer) -> None:
    wait_until(lambda: (peer.watch(), peer.connected)[1], what="the peer connected")


def _request(router: zmq.Socket[Any]) -> tuple[bytes, dict[str, Any]]:
    """The next request the server got: the peer's route and the header."""
    assert router.poll(WAIT_MS), "no request reached the server"
    route, raw, *_ = router.recv_multipart()
    return route, transport.decode(raw)


def _answer(router: zmq.Socket[Any], route: bytes, header: dict[str, Any], *bufs: bytes) -> None:
    router.send_multipart([route, transport.encode(header), *bufs])


def _until(peer: DealerPeer, cond: Any, what: str) -> None:
    """Pump the peer until ``cond()`` holds (each pump waits for replies itself)."""
    wait_until(lambda: (peer.pump(50), cond())[1], what=what, interval_s=0)


def test_replies_are_routed_to_their_request_by_id(ctx: zmq.Context[Any]) -> None:
    router, endpoint = _server(ctx)
    peer = _peer(ctx, endpoint)
    others: list[dict[str, Any]] = []
    peer.other = lambda header, frames, size: others.append(header)
    try:
        _connected(peer)
        one, two = Log(), Log()
        id1 = peer.request("generate", None, {"n": 1}, on_reply=one.reply, on_fail=one.fail)
        id2 = peer.request("info", on_reply=two.reply, on_fail=two.fail)
        (route, first), (_, second) = _request(router), _request(router)
        assert (first["id"], first["op"], first["args"]) == (id1, "generate", {"n": 1})
        assert (second["id"], second["op"]) == (id2, "info")
        # answered out of order: the single reply first, then a stream of events
        _answer(router, route, ok_reply(id2, {"model": "m"}), b"\x01\x02")
        _answer(router, route, event_reply(id1, {"event": "token", "token": 5}))
        _answer(router, route, ok_reply(999, {}))  # nobody waits for 999
        _until(peer, lambda: two.replies and one.replies and others, "the replies routed")
        assert two.replies == [ok_reply(id2, {"model": "m"})] and two.buffers == [[b"\x01\x02"]]
        assert [r["token"] for r in one.replies] == [5]
        assert [h["id"] for h in others] == [999]
        assert list(peer.pending) == [id1]  # a stream waits for its ``done``
        _answer(router, route, event_reply(id1, {"event": "token", "token": 6, "done": True}))
        _until(peer, lambda: len(one.replies) == 2, "the stream's last event")
        assert peer.pending == {} and one.faults == two.faults == []
    finally:
        peer.close()
        router.close()


def test_a_callback_may_keep_its_request_waiting(ctx: zmq.Context[Any]) -> None:
    """A stage's forward is acknowledged by the next stage and answered later
    (by the last one): the acknowledgement must not end the request."""
    router, endpoint = _server(ctx)
    peer = _peer(ctx, endpoint)
    seen: list[dict[str, Any]] = []

    def on_reply(header: dict[str, Any], frames: list[zmq.Frame]) -> bool:
        seen.append(header)
        return header["result"].get("ack") is True

    try:
        _connected(peer)
        rid = peer.request("forward_frame", on_reply=on_reply, on_fail=Log().fail)
        route, _ = _request(router)
        _answer(router, route, ok_reply(rid, {"ack": True}))
        _until(peer, lambda: seen, "the acknowledgement")
        assert rid in peer.pending
        _answer(router, route, ok_reply(rid, {"results": []}))
        _until(peer, lambda: len(seen) == 2, "the answer")
        assert peer.pending == {}
    finally:
        peer.close()
        router.close()


def test_a_deadline_fails_only_its_own_request(ctx: zmq.Context[Any]) -> None:
    router, endpoint = _server(ctx)
    peer = _peer(ctx, endpoint, late=lambda op: StageUnavailable(f"{op} not answered"))
    try:
        _connected(peer)
        short, patient = Log(), Log()
        id1 = peer.request("trim", on_reply=short.reply, on_fail=short.fail, timeout_s=0.2)
        id2 = peer.request("info", on_reply=patient.reply, on_fail=patient.fail, timeout_s=WAIT_S)
        _until(peer, lambda: short.faults, "the short deadline passed")
        assert [(type(f), f.message) for f in short.faults] == [
            (StageUnavailable, "trim not answered")
        ]
        assert list(peer.pending) == [id2] and patient.faults == []
        route, _ = _request(router)
        _request(router)
        _answer(router, route, ok_reply(id1, {}))  # late: dropped, not delivered twice
        _answer(router, route, ok_reply(id2, {}))
        _until(peer, lambda: patient.replies, "the patient request answered")
        assert short.replies == [] and peer.pending == {}
    finally:
        peer.close()
        router.close()


def test_the_default_deadline_fault_is_deadline_exceeded(ctx: zmq.Context[Any]) -> None:
    router, endpoint = _server(ctx)
    peer = _peer(ctx, endpoint)
    try:
        _connected(peer)
        log = Log()
        peer.request("ping", on_reply=log.reply, on_fail=log.fail, timeout_s=0.05)
        _until(peer, lambda: log.faults, "the deadline passed")
        assert isinstance(log.faults[0], DeadlineExceeded)
    finally:
        peer.close()
        router.close()


def test_a_lost_peer_fails_every_pending_request(ctx: zmq.Context[Any]) -> None:
    router, endpoint = _server(ctx)
    peer = _peer(ctx, endpoint)
    order: list[str] = []
    peer.on_dropped = lambda: order.append("dropped")
    try:
        _connected(peer)
        logs = [Log() for _ in range(3)]
        for i, log in enumerate(logs):

            def fail(fault: Fault, log: Log = log) -> None:
                order.append("failed")
                log.fail(fault)

            peer.request(f"op{i}", on_reply=log.reply, on_fail=fail)
        for _ in logs:
            _request(router)
        router.close()  # the peer's process goes away with the requests unanswered
        _until(peer, lambda: not peer.connected, "the drop seen")
        assert [[f.message for f in log.faults] for log in logs] == [
            ["gone during op0"],
            ["gone during op1"],
            ["gone during op2"],
        ]
        assert order == ["dropped", "failed", "failed", "failed"]  # the owner's hook first
        assert peer.pending == {}
        # IMMEDIATE: with no connection a request is refused, not queued. The
        # monitor's event can come a moment before zmq drops the pipe, so the
        # first tries may still be taken: each one taken is forgotten again.
        reasons: list[str] = []

        def refused() -> bool:
            try:
                rid = peer.request("ping", on_reply=Log().reply, on_fail=Log().fail)
            except NotSent as exc:
                reasons.append(exc.reason)
                return True
            peer.forget(rid)
            return False

        wait_until(refused, what="a request refused once the pipe is gone")
        assert reasons == [transport.NOT_RECEIVING] and peer.pending == {}
    finally:
        peer.close()


def test_fail_all_uses_the_owners_fault(ctx: zmq.Context[Any]) -> None:
    router, endpoint = _server(ctx)
    peer = _peer(ctx, endpoint)
    try:
        _connected(peer)
        log = Log()
        peer.request("stats", on_reply=log.reply, on_fail=log.fail)
        assert peer.fail_all(lambda op: WorkerUnavailable(f"down: {op}")) == 1
        assert [(f.code, f.message) for f in log.faults] == [("worker_unavailable", "down: stats")]
    finally:
        peer.close()
        router.close()


def test_an_undecodable_reply_is_reported_and_skipped(ctx: zmq.Context[Any]) -> None:
    router, endpoint = _server(ctx)
    peer = _peer(ctx, endpoint)
    garbage: list[str] = []
    peer.on_garbage = garbage.append
    try:
        _connected(peer)
        log = Log()
        rid = peer.request("ping", on_reply=log.reply, on_fail=log.fail)
        route, _ = _request(router)
        router.send_multipart([route, b"\xc1"])  # never valid msgpack
        _answer(router, route, ok_reply(rid, {"pong": True}))
        _until(peer, lambda: log.replies, "the good reply after the bad one")
        assert len(garbage) == 1
    finally:
        peer.close()
        router.close()


def test_an_attached_peer_is_served_by_the_event_loop(ctx: zmq.Context[Any]) -> None:
    router, endpoint = _server(ctx)

    def echo() -> None:
        route, header = _request(router)
        _answer(router, route, event_reply(header["id"], {"event": "token", "token": 1}))
        _answer(router, route, ok_reply(header["id"], {"echo": header["args"]}))

    async def main() -> list[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        peer = DealerPeer(ctx, endpoint, gone=lambda op: StageUnavailable("gone"))
        peer.attach(loop)
        done: asyncio.Future[None] = loop.create_future()
        got: list[dict[str, Any]] = []

        def on_reply(header: dict[str, Any], frames: list[zmq.Frame]) -> None:
            got.append(header)
            if "result" in header:
                done.set_result(None)

        try:
            peer.request("echo", None, {"x": 1}, on_reply=on_reply, on_fail=done.set_exception)
            await asyncio.wait_for(done, WAIT_S)
            return got
        finally:
            peer.close()

    server = threading.Thread(target=echo)
    server.start()
    try:
        got = asyncio.run(main())
    finally:
        server.join(WAIT_S)
        router.close()
    assert [h.get("token") for h in got] == [1, None] and got[1]["result"] == {"echo": {"x": 1}}


# -- the one reader of an error reply --------------------------------------------------------


def test_an_error_reply_becomes_its_codes_fault_class() -> None:
    fault = fault_of(error_reply(1, "queue_full", "full", retry_after_ms=50))
    assert type(fault) is QueueFull and fault.message == "full" and fault.retry_after_ms == 50
    assert wire_code(fault) == "queue_full"
    prefixed = fault_of(error_reply(2, "stage_unavailable", "down"), "next stage: ")
    assert type(prefixed) is StageUnavailable and prefixed.message == "next stage: down"


def test_an_unknown_code_is_kept_verbatim() -> None:
    fault = fault_of(error_reply(1, "from_the_future", "new"))
    assert isinstance(fault, ForeignFault) and fault.code == "internal"
    assert wire_code(fault) == "from_the_future"
    broken = fault_of({"v": 1, "id": 1, "ok": False, "error": "not a map"})
    assert wire_code(broken) == "internal" and broken.message == ""
