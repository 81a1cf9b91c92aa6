"""Streaming generation, continuous batching, admission, cancellation (real sockets)."""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq

from conftest import WAIT_S, start_worker, stop_worker, wait_until
from protocol import Client, SkiffError, transport

PROMPT = "The history of the Roman Empire"
WAIT_MS = int(WAIT_S * 1000)
# Generations that outlast any test step (a lane holds 2048 cells): a test
# cancels them when it is done, so they cost nothing, and nothing depends on
# a test step being quicker than the worker's decoding.
ENDLESS = 1800


def _events(
    client: Client, args: dict[str, Any], session: str | None = None
) -> list[dict[str, Any]]:
    return [r.header for r in client.generate(args, session=session)]


def test_stream_matches_non_stream_and_detokenize(client: Client) -> None:
    events = _events(client, {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True})
    tokens = [e["token"] for e in events if e.get("event") == "token"]
    done = events[-1]
    assert done["done"] and done["finish_reason"] == "length"
    usage = done["usage"]
    assert usage["prompt_tokens"] == len(client.tokenize(PROMPT))
    assert usage["completion_tokens"] == 12
    assert set(done["timings"]) == {"queue_ms", "prefill_ms", "ttft_ms", "decode_ms"}
    text = "".join(e["text"] for e in events if "text" in e)
    assert text == client.detokenize(tokens)
    single = client.call(
        "generate", args={"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "stream": False}
    )
    assert single.header["done"] and single.result["tokens"] == tokens
    assert single.result["text"] == text
    positions = [e["position"] for e in events if e.get("event") == "token"]
    assert positions == list(range(positions[0], positions[0] + 12))
    assert client.stats()["lanes"]["active"] == 0  # the ephemeral session is gone


def test_named_session_continues_across_turns(client: Client) -> None:
    first = client.call(
        "generate",
        session="chat",
        args={"prompt": "One, two, three,", "max_tokens": 4, "stream": False},
    )
    p1 = first.result["usage"]["prompt_tokens"]
    second = client.call(
        "generate", session="chat", args={"prompt": " ten", "max_tokens": 3, "stream": False}
    )
    # The last shown token of turn 1 is fed at the start of turn 2.
    assert second.result["usage"]["prompt_tokens"] == 1 + len(client.tokenize(" ten", False))
    position = client.stats()["sessions"][0]["position"]
    # KV holds: prompt 1, the 4 shown tokens, " ten", and 3 shown tokens but the last.
    assert position == p1 + 4 + (second.result["usage"]["prompt_tokens"] - 1) + 3 - 1


def test_stop_strings_and_stop_tokens(client: Client) -> None:
    base = client.call(
        "generate", args={"prompt": "1, 2, 3, 4,", "max_tokens": 12, "stream": False}
    ).result
    assert " 7" in base["text"]
    cut = client.call(
        "generate",
        args={"prompt": "1, 2, 3, 4,", "max_tokens": 12, "stream": False, "stop": [" 7"]},
    ).result
    assert (
        cut["finish_reason"] == "stop" and cut["text"] == base["text"][: base["text"].index(" 7")]
    )
    tok = client.call(
        "generate",
        args={
            "prompt": "1, 2, 3, 4,",
            "max_tokens": 12,
            "stream": False,
            "stop_tokens": [base["tokens"][2]],
        },
    ).result
    assert tok["tokens"] == base["tokens"][:2] and tok["finish_reason"] == "stop"


def test_cancel_ends_stream_within_a_turn_and_frees_the_lane(client: Client) -> None:
    args = {"prompt": PROMPT, "max_tokens": ENDLESS, "ignore_eos": True, "stream": True}
    rid = client.send("generate", args=args)
    seen = 0
    for reply in client.follow(rid):
        if reply.header.get("event") == "token":
            seen += 1
        if seen == 3:
            break
    # Replies on one connection arrive in the order the worker sent them: the
    # stream's events after the cancel's own reply were made after the cancel
    # was handled (however many the client had not read yet when it sent it).
    cid = client.send("cancel", None, {"id": rid})
    cancelled: bool | None = None
    after: list[dict[str, Any]] = []
    while not (after and after[-1].get("done")):
        header = client.recv_any().header
        if header["id"] == cid:
            cancelled = header["result"]["cancelled"]
        elif cancelled is not None:
            after.append(header)
    assert cancelled is True
    assert after[-1]["finish_reason"] == "cancelled"
    assert sum(e.get("event") == "token" for e in after) <= 1  # at most one more turn
    assert client.stats()["lanes"]["active"] == 0
    assert client.cancel(rid) is False


def test_cancel_leaves_named_session_consistent(client: Client) -> None:
    args = {"prompt": PROMPT, "max_tokens": ENDLESS, "ignore_eos": True}
    rid = client.send("generate", "kept", args)
    next(client.follow(rid))
    client.cancel(rid)
    done = list(client.follow(rid))[-1].header
    assert done["finish_reason"] == "cancelled"
    more = client.call(
        "generate", session="kept", args={"prompt": " and", "max_tokens": 2, "stream": False}
    )
    assert more.result["usage"]["completion_tokens"] == 2  # positions still line up


def test_concurrent_decodes_from_two_peers_share_a_forward(worker: tuple[str, Path]) -> None:
    """Decodes of two peers waiting in the same turn go out in one forward.

    They are made to wait together, not by guessing when they arrive: each
    session is busy with a generation of a third peer, whose decodes run on
    until that peer goes away and the worker cancels all its work at once;
    the two queued decodes then start in the same turn."""
    ctx = zmq.Context.instance()
    busy = ctx.socket(zmq.DEALER)
    busy.setsockopt(zmq.LINGER, 0)
    busy.connect(worker[0])
    with Client(worker[0], timeout_ms=WAIT_MS) as a, Client(worker[0], timeout_ms=WAIT_MS) as b:
        try:
            a.prefill("ca", [2, 10])
            b.prefill("cb", [2, 11])
            gen = {"prompt": " and", "max_tokens": ENDLESS, "ignore_eos": True}
            for rid, session in ((1, "ca"), (2, "cb")):
                busy.send(transport.encode(transport.request(rid, "generate", session, gen)))
            streaming: set[int] = set()

            def read_busy() -> set[int]:  # the busy peer keeps reading its events
                while busy.poll(0):
                    header = transport.decode(busy.recv())
                    assert header["ok"], header
                    streaming.add(header["id"])
                return streaming

            wait_until(lambda: read_busy() == {1, 2}, what="both generations running")
            before = a.stats()
            ra = a.send("decode", "ca", {"token": 12})
            rb = b.send("decode", "cb", {"token": 13})
            wait_until(
                lambda: read_busy() and a.stats()["queued"] == 2,
                what="both decodes waiting for their sessions",
            )
            busy.close()  # gone: both generations end in the same turn
            a.recv(ra).raise_for_error()
            b.recv(rb).raise_for_error()
            after = a.stats()
            # Every decode step since ``before`` shared its forward (the busy
            # peer's two streams went together, and so did the two decodes).
            alone = after["decode_steps"] - after["coalesced_decode_steps"]
            assert alone == before["decode_steps"] - before["coalesced_decode_steps"]
        finally:
            busy.close()
            for s in ("ca", "cb"):
                with contextlib.suppress(SkiffError):
                    a.drop(s)


def test_iteration_batch_mixes_prefill_and_decode(client: Client, unparked_client: Client) -> None:
    client.prefill("it_a", [2, 10, 11])
    samples = client.iteration_batch(
        [
            {"session": "it_a", "tokens": [12], "phase": "decode", "positions": [3]},
            {"session": "it_b", "tokens": [2, 20, 21, 22], "phase": "prefill", "sample_last": True},
            {"session": "it_c", "tokens": [2, 30], "phase": "prefill"},
        ]
    )
    assert [s["request_index"] for s in samples] == [0, 1]
    positions = {s["session"]: s["position"] for s in client.stats()["sessions"]}
    assert positions == {"it_a": 4, "it_b": 4, "it_c": 2}
    with pytest.raises(SkiffError) as bad:
        client.iteration_batch([{"session": "it_a", "tokens": [5], "positions": [9]}])
    assert bad.value.code == "bad_request"
    for i in range(4):  # no park there: every lane taken is a hard limit
        unparked_client.prefill(f"fill{i}", [2])
    with pytest.raises(SkiffError) as busy:
        unparked_client.iteration_batch([{"session": f"n{i}", "tokens": [2]} for i in range(2)])
    assert busy.value.code == "lanes_busy"
    assert "iteration requires 2 new sessions but only 0 execution lanes" in busy.value.message


def test_long_prompt_does_not_starve_running_streams(worker: tuple[str, Path]) -> None:
    """While a 2000-token prompt is prefilled piece by piece, the running
    streams get tokens between its pieces. Counted in the order replies
    arrive on one connection (the order the worker sent them), not by clock:
    stream tokens after the prompt was sent and before its first token."""
    with Client(worker[0], timeout_ms=WAIT_MS) as c:
        streams = [
            c.send(
                "generate",
                None,
                {"prompt": f"Story {i}:", "max_tokens": ENDLESS, "ignore_eos": True},
            )
            for i in range(4)
        ]
        tokens = dict.fromkeys(streams, 0)
        while min(tokens.values()) < 2:
            header = c.recv_any().header
            assert header["ok"], header
            tokens[header["id"]] += header.get("event") == "token"
        prompt = {"tokens": [2] + [1000] * 1999, "max_tokens": 1, "ignore_eos": True}
        long = c.send("generate", None, prompt)
        during = dict.fromkeys(streams, 0)
        while (header := c.recv_any().header)["id"] != long:
            assert header["ok"] and not header.get("done"), header
            during[header["id"]] += header.get("event") == "token"
        assert header["ok"] and header["event"] == "token", header
        for rid in streams:
            assert c.cancel(rid) is True
        for rid in [*streams, long]:
            assert list(c.follow(rid))[-1].header["done"]
    assert all(n >= 4 for n in during.values()), during  # 2000 tokens = 8 chunks of 256


# -- a small worker for admission limits ---------------------------------------------


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    tmp = tmp_path_factory.mktemp("small")
    proc, endpoint, _ = start_worker(
        tmp,
        "--lanes",
        "2",
        "--ctx",
        "2048",
        "--max-queue",
        "3",
        "--admission-timeout-ms",
        "1500",
        name="small",
    )
    yield endpoint, proc.pid
    stop_worker(proc)


def test_queue_full_and_admission_timeout(small: tuple[str, int]) -> None:
    with Client(small[0], timeout_ms=WAIT_MS) as c:
        # Two generations hold both lanes until they are cancelled below, so
        # what comes after them can only wait for a lane (1.5 s at most) or be
        # refused, however slowly this test runs beside them.
        long = {"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True}  # a lane is 1024
        running = [c.send("generate", args=long) for _ in range(2)]
        queued = [c.send("generate", args={**long, "max_tokens": 2}) for _ in range(3)]
        extra = c.send("generate", args=long)
        err = c.recv(extra).header
        assert err["ok"] is False and err["error"]["code"] == "queue_full"
        assert err["error"]["retry_after_ms"] > 0
        late = c.send("generate", args={**long, "max_tokens": 1}, deadline_ms=200)
        assert c.recv(late).header["error"]["code"] in {"deadline_exceeded", "queue_full"}
        for rid in queued:
            last = list(_follow_any(c, rid))[-1]
            assert last["error"]["code"] == "deadline_exceeded", last
            assert "not started within 1500 ms" in last["error"]["message"]
        for rid in running:
            assert c.cancel(rid) is True
            assert list(_follow_any(c, rid))[-1]["finish_reason"] == "cancelled"
        stats = c.stats()
        assert stats["rejected"] >= 1 and stats["running"] == 0 and stats["queued"] == 0


def _follow_any(c: Client, rid: int) -> Iterator[dict[str, Any]]:
    while True:
        header = c.recv(rid).header
        yield header
        if not header["ok"] or header.get("done"):
            return


def test_vanished_peer_frees_its_lane(small: tuple[str, int]) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(small[0])
    header = transport.request(
        1, "generate", None, {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True}
    )
    sock.send(transport.encode(header))
    assert sock.poll(WAIT_MS)
    sock.close(linger=0)  # gone mid-stream
    with Client(small[0], timeout_ms=WAIT_MS) as c:
        wait_until(lambda: not c.stats()["running"], what="the vanished peer's work ended")
        stats = c.stats()
        assert stats["running"] == 0 and stats["lanes"]["active"] == 0


def test_flood_of_1000_clients_keeps_memory_flat(small: tuple[str, int]) -> None:
    proc = psutil.Process(small[1])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 4096)
    frame = transport.encode(
        transport.request(1, "generate", None, {"prompt": "Hi", "max_tokens": 1})
    )

    def flood() -> None:
        socks = []
        for _ in range(1000):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(small[0])
            s.send(frame)
            socks.append(s)
        got = sum(1 for s in socks if s.poll(WAIT_MS))
        assert got == 1000  # every client got an answer (result or queue_full)
        for s in socks:
            s.close(0)

    # Connection buffers and the allocator settle over the first floods
    # (measured: +10, +9, +7, +5, +2, +2 MB per 1000 clients), so warm up
    # twice, then require the next 3000 clients to cost < 16 KB each.
    flood()
    flood()
    base = proc.memory_info().rss
    for _ in range(3):
        flood()
    grown = proc.memory_info().rss - base
    assert grown < 48 * 1024 * 1024, grown
    with Client(small[0]) as c:
        assert c.ping() == {"pong": True}
        assert c.stats()["queued"] == 0
    ctx.term()


def test_stats_split_forwards_with_and_without_prompt_pieces(client: Client) -> None:
    """``forward_mix`` counts every forward once, as decode-only or carrying
    prompt pieces, and the prompt tokens those pieces computed."""
    before = client.stats()
    prompt = list(range(5200, 5260))  # ids no other test sends: nothing cached
    result = client.call(
        "generate",
        args={"tokens": prompt, "max_tokens": 6, "ignore_eos": True, "stream": False},
    ).header["result"]
    after = client.stats()
    mix = {
        kind: {k: after["forward_mix"][kind][k] - before["forward_mix"][kind][k] for k in part}
        for kind, part in after["forward_mix"].items()
    }
    usage = result["usage"]
    assert usage["completion_tokens"] == 6
    assert mix["with_prompt"]["forwards"] >= 1
    assert mix["with_prompt"]["prompt_tokens"] == usage["prompt_tokens"] - usage["cached_tokens"]
    assert mix["decode_only"]["forwards"] >= 1  # the later tokens (or drafted spans)
    assert mix["decode_only"]["prompt_tokens"] == 0
    forwards = after["forwards"] - before["forwards"]
    assert mix["with_prompt"]["forwards"] + mix["decode_only"]["forwards"] == forwards
    assert mix["with_prompt"]["seconds"] > 0 and mix["decode_only"]["seconds"] > 0
