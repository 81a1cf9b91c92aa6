"""The gateway in front of two real workers, all as processes on loopback.

One cluster for the module (``skiff-gateway`` + 2 workers with 4 lanes of
512 cells: ``_gateway_cluster_procs``); the tests run in order and leave no
named session behind:

- 16 concurrent conversations spread over both workers, every follow-up on
  the worker holding the session (checked in the workers' own ``stats``);
- SIGKILL of a worker mid-stream ends its stream with ``worker_unavailable``
  (the gateway saw the connection drop, not a timeout) while new work
  succeeds on the other; restarted on the same endpoint it takes new
  sessions again;
- SIGTERM of a worker: it says it is leaving, the gateway moves its stream
  and sessions to the other worker (the stream goes on for the client) and
  sends new work there; it exits 0, rejoins;
- SIGTERM of the gateway mid-stream: the stream ends normally, new work is
  ``shutting_down``; a new gateway finds the sessions and continues them;
- ``skiff-gateway drain`` moves live sessions (requests keep coming while
  they move) and their greedy continuations equal a reference run (last:
  the drained worker takes no new work until it restarts).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from _gateway_cluster_procs import WAIT_MS, Cluster

from conftest import WAIT_S, wait_until
from protocol import Client, SkiffError

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("gwc"))
    yield c
    c.close()


def test_concurrent_sessions_spread_and_follow_ups_stay(cluster: Cluster) -> None:
    def conversation(i: int) -> str:
        session = f"conv{i}"
        with cluster.client() as c:
            args = {"prompt": f"Story {i}: the {i}th lighthouse", "max_tokens": 4, "stream": False}
            c.call("generate", session, args)  # waits in a worker's queue while lanes are full
            (holder,) = cluster.holders(session)
            for turn in range(2):
                more = {"prompt": f" Then turn {turn}", "max_tokens": 3, "stream": False}
                assert c.call("generate", session, more).result["finish_reason"]
                assert cluster.holders(session) == [holder]  # continued there, nowhere else
            placed = {s: w["endpoint"] for w in cluster.status()["workers"] for s in w["sessions"]}
            assert placed[session] == holder
            c.drop(session)
        return holder

    with ThreadPoolExecutor(16) as pool:
        holders = list(pool.map(conversation, range(16)))
    assert set(holders) == set(cluster.endpoints), holders
    assert all(cluster.named_sessions(ep) == [] for ep in cluster.endpoints)
    status = cluster.status()
    assert status["sessions"] == 0, [w["sessions"] for w in status["workers"]]
    url = f"http://127.0.0.1:{cluster.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=WAIT_S) as reply:
        text = reply.read()
    lines = text.decode().splitlines()
    assert 'skiff_gateway_workers_up{kind="llm"} 2.0' in lines
    ok = [
        ln
        for ln in lines
        if ln.startswith("skiff_gateway_responses_total{")
        and 'op="generate"' in ln
        and 'code="ok"' in ln
    ]
    assert ok and float(ok[0].split()[-1]) >= 48


def _follow(
    endpoint: str,
    args: dict[str, Any],
    seen: list[dict[str, Any]],
    end: dict[str, Any],
    session: str | None = None,
) -> None:
    """Read one stream to its end: its events into ``seen``, how it ended into ``end``."""
    with Client(endpoint, timeout_ms=WAIT_MS) as c:
        rid = c.send("generate", session, {**args, "stream": True})
        end["id"] = rid
        try:
            for reply in c.follow(rid):
                seen.append(reply.header)
                end["last"] = reply.header
        except SkiffError as exc:
            end["code"] = exc.code


def _ended(t: threading.Thread) -> None:
    t.join(WAIT_S)
    assert not t.is_alive(), "the stream did not end"


def test_killed_worker_ends_its_streams_and_rejoins_after_restart(cluster: Cluster) -> None:
    args = {"prompt": "Count slowly:", "max_tokens": 250, "ignore_eos": True}
    runs: list[tuple[list[dict[str, Any]], dict[str, Any]]] = []
    threads = []
    for _ in range(2):  # one stream per worker: the second sees the first's load
        seen: list[dict[str, Any]] = []
        end: dict[str, Any] = {}
        t = threading.Thread(target=_follow, args=(cluster.gateway_ep, args, seen, end))
        t.start()
        runs.append((seen, end))
        threads.append(t)
        wait_until(lambda seen=seen: len(seen) >= 3, what="stream started")  # type: ignore[misc]
    victim, survivor = cluster.endpoints
    assert [len(cluster.named_sessions(ep)) for ep in cluster.endpoints] == [0, 0]
    for ep in cluster.endpoints:  # each worker runs one of the streams
        with Client(ep) as c:
            sessions = c.stats()["sessions"]
        # seen once in a full suite under load (2026-12-07): say where things were
        where = {w["endpoint"]: w for w in cluster.status()["workers"]}
        assert [s["ephemeral"] for s in sessions] == [True], (ep, sessions, where)
    cluster.workers[victim].kill()
    cluster.workers[victim].wait(WAIT_S)

    # The gateway sees the connection drop, not a timeout (the loop stall limit
    # is 15 s; nothing of that is waited for) ...
    def victim_up() -> bool:
        return any(w["up"] for w in cluster.status()["workers"] if w["endpoint"] == victim)

    wait_until(lambda: not victim_up(), what="the victim marked down")
    downs = [e for e in cluster.gateway_log() if e.get("event") == "worker_down"]
    assert [e["reason"] for e in downs if e["worker"] == victim][-1] == "connection dropped"
    # ... its stream fails, and new work goes to the survivor
    wait_until(lambda: any(e.get("code") for _, e in runs), what="stream error")
    ended = [end for _, end in runs if end.get("code")]
    assert len(ended) == 1 and ended[0]["code"] == "worker_unavailable"
    with cluster.client() as c:
        assert c.call("generate", None, {"prompt": "Hi", "max_tokens": 2, "stream": False}).result
        assert c.prefill("after-kill", c.tokenize("A new session")) > 0
    assert cluster.holders("after-kill") == [survivor]
    down = {w["endpoint"]: w["up"] for w in cluster.status()["workers"]}
    assert down == {victim: False, survivor: True}
    # the survivor's stream runs to its end
    (live,) = [end for _, end in runs if not end.get("code")]
    for t in threads:
        _ended(t)
    assert live["last"]["done"] and live["last"]["finish_reason"] == "length"

    cluster.start_worker(victim)
    cluster.wait_worker(victim)
    cluster.wait_all_up()
    with cluster.client() as c:
        names = [f"fresh{i}" for i in range(4)]
        for name in names:
            c.prefill(name, c.tokenize(f"Session {name} starts here"))
        placed = {name: cluster.holders(name) for name in names}
        assert any(h == [victim] for h in placed.values()), placed  # it takes sessions again
        for name in [*names, "after-kill"]:
            c.drop(name)


def _fill_lanes(endpoint: str, prefix: str) -> list[str]:
    """Named sessions in every lane of ``endpoint`` not taken (sent to it
    directly): a generation sent to it after this waits for a lane until one
    of them is dropped. Work the test ends when it chooses, not when the
    worker is done."""
    with Client(endpoint, timeout_ms=WAIT_MS) as c:
        lanes = c.stats()["lanes"]
        names = [f"{prefix}{i}" for i in range(lanes["total"] - lanes["active"])]
        for name in names:
            c.prefill(name, [2, 3])
    return names


def _queued(endpoints: list[str]) -> int:
    total = 0
    for ep in endpoints:
        with Client(ep, timeout_ms=WAIT_MS) as c:
            total += int(c.stats()["queued"])
    return total


def test_a_sigterm_worker_hands_over_while_the_gateway_serves_on(cluster: Cluster) -> None:
    """A worker restarting (SIGTERM) tells the gateway it is leaving: the
    gateway moves its stream (suspended between two tokens, resumed on the
    other worker for the same client request) and its sessions, sends every
    new request to the other worker, and the worker exits 0 and rejoins when
    started again. The client's stream just goes on."""
    args = {"prompt": "Count slowly:", "max_tokens": 150, "ignore_eos": True}
    seen: list[dict[str, Any]] = []
    end: dict[str, Any] = {}
    t = threading.Thread(target=_follow, args=(cluster.gateway_ep, args, seen, end, "sig0"))
    t.start()
    wait_until(lambda: len(seen) >= 2, what="stream started")
    (victim,) = cluster.holders("sig0")
    (survivor,) = [ep for ep in cluster.endpoints if ep != victim]
    cluster.workers[victim].send_signal(signal.SIGTERM)
    with cluster.client() as c:
        for i in range(4):
            result = c.call(
                "generate", None, {"prompt": f"Hi {i}", "max_tokens": 2, "stream": False}
            )
            assert result.result["usage"]["completion_tokens"] == 2
            if i < 2:  # the survivor's 4 lanes: sig0, these two, and one for the rest
                c.prefill(f"during-drain{i}", c.tokenize(f"A session made while w1 drains, {i}"))
    _ended(t)
    assert "code" not in end, end
    assert end["last"]["finish_reason"] == "length"
    assert sum(1 for e in seen if e.get("event") == "token") == 150
    assert cluster.workers[victim].wait(WAIT_S) == 0
    assert all(cluster.holders(f"during-drain{i}") == [survivor] for i in range(2))
    assert cluster.holders("sig0") == [survivor]
    cluster.start_worker(victim)
    cluster.wait_worker(victim)
    cluster.wait_all_up()
    with cluster.client() as c:
        for i in range(2):
            c.drop(f"during-drain{i}")
        c.drop("sig0")


def test_a_gateway_restart_keeps_the_workers_sessions(cluster: Cluster) -> None:
    """SIGTERM the gateway mid-stream: the stream ends normally, new work is
    refused with ``shutting_down``, the gateway exits 0; a new gateway finds
    the session on its worker (from ``stats``) and the greedy continuation
    equals an uninterrupted run.

    The draining gateway must outlive the checks: a generation it relays
    waits for a lane (named sessions hold every lane of both workers) until
    the test drops one on each worker."""
    with cluster.client() as c:
        prompt = c.tokenize(PROMPTS[0])
        first = int(c.prefill_sampled("survivor", prompt)["token"])
        got = [first, *_greedy(c, "survivor", first, BEFORE)]
        ref_first = int(c.prefill_sampled("ref", prompt)["token"])
        expected = [ref_first, *_greedy(c, "ref", ref_first, BEFORE + AFTER)]
        c.drop("ref")
    seen: list[dict[str, Any]] = []
    end: dict[str, Any] = {}
    args = {"prompt": "Count slowly:", "max_tokens": 40, "ignore_eos": True}
    stream = threading.Thread(
        target=_follow, args=(cluster.gateway_ep, args, seen, end, "streamed")
    )
    stream.start()
    wait_until(lambda: len(seen) >= 2, what="stream started")
    holds = {ep: _fill_lanes(ep, "gw-hold") for ep in cluster.endpoints}
    with cluster.client() as keeping:
        keeper = keeping.send(
            "generate", None, {"prompt": "kept", "max_tokens": 2, "ignore_eos": True}
        )
        wait_until(lambda: _queued(cluster.endpoints) == 1, what="the keeper queued for a lane")
        cluster.gateway.send_signal(signal.SIGTERM)
        with cluster.client() as c:
            wait_until(lambda: c.stats()["draining"], what="gateway draining")
            with pytest.raises(SkiffError) as err:
                c.decode("survivor", got[-1])
            assert err.value.code == "shutting_down"
        for ep, names in holds.items():  # a lane free on each worker: the keeper runs
            with Client(ep, timeout_ms=WAIT_MS) as direct:
                assert direct.drop(names.pop(0)) == {}
        assert list(keeping.follow(keeper))[-1].header["finish_reason"] == "length"
    _ended(stream)
    assert "code" not in end and end["last"]["finish_reason"] == "length", end
    assert cluster.gateway.wait(WAIT_S) == 0
    for ep, names in holds.items():
        with Client(ep, timeout_ms=WAIT_MS) as direct:
            for name in names:
                direct.drop(name)
    cluster.start_gateway()
    with cluster.client() as c:
        got += _greedy(c, "survivor", got[-1], AFTER)
        assert got == expected
        c.drop("survivor")
        c.drop("streamed")


PROMPTS = [
    "The lighthouse keeper climbed the stairs every evening, and",
    "In the village library, a curious student found",
    "The morning train crossed the bridge over the canal while",
]
BEFORE, AFTER = 6, 12  # greedy decode steps before and after the move


def _greedy(client: Client, session: str, token: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        token = int(client.decode(session, token)["token"])
        out.append(token)
    return out


def test_drain_moves_live_sessions_and_continuations_are_exact(cluster: Cluster) -> None:
    names = [f"mv{i}" for i in range(len(PROMPTS))]
    got: dict[str, list[int]] = {}
    with cluster.client() as c:
        prompts = {n: c.tokenize(p) for n, p in zip(names, PROMPTS, strict=True)}
        for n in names:
            got[n] = [int(c.prefill_sampled(n, prompts[n])["token"])]
            got[n] += _greedy(c, n, got[n][-1], BEFORE)
    where = {n: cluster.holders(n) for n in names}
    assert all(len(h) == 1 for h in where.values()), where
    counts = {ep: sum(h == [ep] for h in where.values()) for ep in cluster.endpoints}
    source = max(counts, key=lambda ep: counts[ep])
    target = next(ep for ep in cluster.endpoints if ep != source)
    moving = [n for n in names if where[n] == [source]]

    # decode every session while the drain runs: requests for a moving session wait for it
    def keep_decoding() -> None:
        with cluster.client() as c:
            for _ in range(AFTER):
                for n in names:
                    got[n] += _greedy(c, n, got[n][-1], 1)

    worker = threading.Thread(target=keep_decoding)
    worker.start()
    # requests in flight before the drain starts (how many does not matter)
    wait_until(lambda: len(got[names[-1]]) > 1 + BEFORE, what="decoding under way")
    drain = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "drain", source, "--gateway", cluster.gateway_ep],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=2 * WAIT_S,
        check=False,
    )
    worker.join(2 * WAIT_S)
    assert not worker.is_alive()
    assert drain.returncode == 0, drain.stdout + drain.stderr
    result = json.loads(drain.stdout)
    assert sorted(m["session"] for m in result["moved"]) == sorted(moving)
    assert all(m["to"] == target for m in result["moved"]) and result["failed"] == []
    assert cluster.named_sessions(source) == []
    assert sorted(cluster.named_sessions(target)) == sorted(names)
    view = {w["endpoint"]: w for w in cluster.status()["workers"]}
    assert view[source]["drained"] and sorted(view[target]["sessions"]) == sorted(names)

    # reference: the same prompts, greedy, one session at a time, on the drained worker
    with Client(source, timeout_ms=WAIT_MS) as ref:
        for n in names:
            first = int(ref.prefill_sampled("ref", prompts[n])["token"])
            expected = [first, *_greedy(ref, "ref", first, BEFORE + AFTER)]
            ref.drop("ref")
            assert got[n] == expected, n
    with cluster.client() as c:
        for n in names:
            c.drop(n)
