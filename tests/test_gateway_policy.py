"""The gateway's policy without sockets: the router (least loaded, cache-aware
on shared prompt prefixes, round robin) and its prefix index, the affinity
table, the load estimate of a worker, and the configuration.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway.affinity import AffinityTable
from gateway.config import GatewayConfig, add_serve_arguments, from_namespace
from gateway.pool import WorkerConn
from gateway.router import (
    MAX_BLOCKS,
    TOKEN_BLOCK,
    Candidate,
    PrefixIndex,
    Routed,
    Router,
    least_loaded,
    prompt_blocks,
)
from gateway.runner import connectable

ROOT = Path(__file__).resolve().parent.parent

# -- router ---------------------------------------------------------------------------


def test_least_loaded_uses_the_queue_score_and_free_lanes() -> None:
    a = Candidate("a", queued=1, running=0, free_lanes=0)  # 4
    b = Candidate("b", queued=0, running=3, free_lanes=1)  # 2
    assert (a.score, b.score) == (4, 2)
    assert least_loaded([a, b]) == "b"
    # same running, the one with room wins; a full tie goes by name
    c = Candidate("c", running=2, free_lanes=6)
    d = Candidate("d", running=2, free_lanes=0)
    assert least_loaded([d, c]) == "c"
    assert least_loaded([Candidate("y"), Candidate("x")]) == "x"
    # full ties rotate with the turn; a lower score is never rotated away
    tied = [Candidate("y"), Candidate("x"), Candidate("z", running=1)]
    assert [least_loaded(tied, t) for t in range(4)] == ["x", "y", "x", "y"]
    router = Router("least_loaded")
    assert {router.choose(tied) for _ in range(4)} == {"x", "y"}


def test_prompt_blocks_chain_on_shared_prefixes() -> None:
    base = list(range(64))
    one = prompt_blocks({"tokens": base})
    two = prompt_blocks({"tokens": [*base[:32], 999, *base[33:]]})
    assert len(one) == 4 and one[:2] == two[:2] and one[2] != two[2] and one[3] != two[3]
    assert prompt_blocks({"tokens": base[:15]}) == ()  # no whole block
    text = "x" * 64 + "y" * 64
    assert prompt_blocks({"prompt": text})[0] == prompt_blocks({"prompt": "x" * 64 + "z" * 70})[0]
    msgs = [{"role": "system", "content": "s" * 100}, {"role": "user", "content": "hi"}]
    other = [{"role": "system", "content": "s" * 100}, {"role": "user", "content": "yo"}]
    assert prompt_blocks({"messages": msgs})[0] == prompt_blocks({"messages": other})[0]
    assert prompt_blocks({"prompt": text}) != prompt_blocks({"tokens": base})  # kinds differ
    assert prompt_blocks({}) == ()


_CHILD_BLOCKS = """
import json, sys
from gateway.router import prompt_blocks
json.dump([prompt_blocks(p) for p in json.load(sys.stdin)], sys.stdout)
"""


def test_prompt_blocks_are_the_same_in_every_process() -> None:
    """BLAKE2b, not ``hash()``: Python salts ``str`` hashes per process, and
    a prompt's blocks place it (its home), in tests as in a restarted gateway."""
    prompts: list[dict[str, Any]] = [
        {"tokens": list(range(7, 400))},
        {"prompt": "You are a helpful assistant. " * 40},
        {"prompt": "Réponds en français. " * 30},
        {"messages": [{"role": "system", "content": "Be brief. " * 80}]},
    ]
    here = [list(prompt_blocks(p)) for p in prompts]
    assert all(len(b) >= 8 for b in here)
    for seed in ("0", "4242"):
        out = subprocess.run(
            [sys.executable, "-c", _CHILD_BLOCKS],
            input=json.dumps(prompts),
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
            check=True,
            timeout=60,
        )
        assert json.loads(out.stdout) == here


def test_prompt_blocks_are_bounded_and_only_of_token_ids() -> None:
    many = list(range((MAX_BLOCKS + 5) * TOKEN_BLOCK))
    assert len(prompt_blocks({"tokens": many})) == MAX_BLOCKS
    assert prompt_blocks({"tokens": [1.5] * 32}) == ()  # not token ids: routed by load
    assert prompt_blocks({"tokens": [2**70] * 32}) == ()
    # text is hashed as UTF-8 per 64 characters, lone surrogates included
    assert len(prompt_blocks({"prompt": "é" * 130})) == 2
    assert len(prompt_blocks({"prompt": "\ud800" * 64})) == 1
    mixed = prompt_blocks({"prompt": "x" * 64 + "é" * 64})
    assert mixed[0] == prompt_blocks({"prompt": "x" * 64 + "y" * 64})[0]


def test_cache_aware_prefers_the_prefix_holder_until_it_is_too_busy() -> None:
    router = Router("cache_aware", balance_threshold=2, cache_min_blocks=1, cache_full_blocks=1)
    system = list(range(100, 164))
    first = prompt_blocks({"tokens": [*system, 1, 2, 3]})
    home = router.home(["a", "b"], first)
    assert home is not None
    other = "b" if home == "a" else "a"
    idle = [Candidate("a", free_lanes=4), Candidate("b", free_lanes=4)]
    assert router.choose(idle, first) == home  # a tie: the prompt's home; remembered
    assert router.cache_routed == 0  # the home had not seen it: not a prefix hit
    again = prompt_blocks({"tokens": [*system, 7, 8]})
    assert router.home(["a", "b"], again) == home  # the same first block
    # the other is idler, but the home holds the prefix and is within the threshold
    busy_home = [Candidate(home, running=1, free_lanes=3), Candidate(other, free_lanes=4)]
    assert router.choose(busy_home, again) == home
    assert router.cache_routed == 1
    # the home is past the threshold: least loaded wins (and now holds the prefix too)
    too_busy = [Candidate(home, running=3, free_lanes=1), Candidate(other, free_lanes=4)]
    assert router.choose(too_busy, again) == other
    # a longer real match wins over the home's, then the lower load
    longer = prompt_blocks({"tokens": [*system, 1, 2, 3, *range(20)]})
    both = [Candidate("a", free_lanes=4), Candidate("b", free_lanes=4)]
    router.index.insert(other, longer)
    assert router.index.match(home, longer) == 4 and router.index.match(other, longer) == 5
    assert router.choose(both, longer) == other
    # within the threshold but with no free lane, while the other has one: no queueing
    full_home = [
        Candidate(home, running=4, free_lanes=0),
        Candidate(other, running=3, free_lanes=1),
    ]
    assert full_home[0].score <= full_home[1].score + 2
    assert router.choose(full_home, first) == other
    # when no worker has a free lane, the prefix holder may still take it
    all_full = [Candidate(other, running=4), Candidate(home, running=4)]
    assert router.index.match(other, first) == router.index.match(home, first) == 4
    assert router.choose(all_full, first) == home  # the same match and load: the home
    # by default a match shorter than 8 blocks does not count away from the
    # prompt's home: with the home too busy, the holder of 4 blocks and an
    # equally idle worker take turns (least loaded), the holder no more often
    strict = Router("cache_aware")
    s_home = strict.home(["a", "b", "c"], first)
    s_holder, s_third = sorted({"a", "b", "c"} - {s_home})
    strict.index.insert(s_holder, first)
    away = [
        Candidate(s_home, running=3, free_lanes=1),
        Candidate(s_holder, free_lanes=4),
        Candidate(s_third, free_lanes=4),
    ]
    picks = [strict.choose(away, first, remember=False) for _ in range(4)]
    assert picks.count(s_holder) == picks.count(s_third) == 2
    # a long real match beats the home's (a full hit: 32 blocks)
    long_prompt = prompt_blocks({"tokens": list(range(1000, 1600))})  # 37 blocks
    holder = "b" if strict.home(["a", "b"], long_prompt) == "a" else "a"
    strict.index.insert(holder, long_prompt)
    level = [Candidate("a", running=1, free_lanes=3), Candidate("b", running=1, free_lanes=3)]
    assert strict.choose(level, long_prompt, remember=False) == holder


def test_a_short_shared_prefix_elsewhere_wins_only_among_equally_loaded_workers() -> None:
    """Away from a prompt's home, the slack a hit may cost grows with its
    length: a repeated 200-token prompt does not pile onto the busier worker,
    a long conversation does. At equal load the holder wins: the home's
    credit (a full hit) ends once another worker holds the prompt's start."""
    router = Router("cache_aware", balance_threshold=4)  # hits from 8 blocks, whole slack from 32
    assert router.slack(8) == 1.0 and router.slack(16) == 2.0 and router.slack(64) == 4.0
    for blocks in (
        prompt_blocks({"tokens": list(range(200))}),  # 12 blocks: slack 1.5
        prompt_blocks({"tokens": list(range(1000, 1600))}),  # 37 blocks: slack 4
    ):
        home = router.home(["a", "b"], blocks)
        assert home is not None
        holder = "b" if home == "a" else "a"
        router.index.insert(holder, blocks)  # seen only away from home
        busier = [
            Candidate(holder, running=4, free_lanes=4),
            Candidate(home, running=3, free_lanes=5),
        ]
        assert busier[0].score - busier[1].score == 2
        expected = holder if len(blocks) > router.cache_full_blocks else home
        assert router.choose(busier, blocks, remember=False) == expected
        level = [Candidate("a", running=4, free_lanes=4), Candidate("b", running=4, free_lanes=4)]
        assert router.choose(level, blocks, remember=False) == holder


def test_a_shared_system_prompt_spreads_once_both_workers_hold_it() -> None:
    """Conversations sharing a system prompt share its home. While only the
    home holds that start it takes them up to the threshold; once the other
    worker holds it too (one conversation sent there), new conversations go
    by load, and a conversation's later turns stay with their longer prefix
    (within its slack)."""
    router = Router("cache_aware")
    system = list(range(10_000, 10_000 + 16 * 10))  # 10 blocks
    convo = [system + list(range(k * 1000, k * 1000 + 48)) for k in range(1, 4)]
    home = router.home(["a", "b"], prompt_blocks({"tokens": convo[0]}))
    other = "b" if home == "a" else "a"
    busier = [Candidate(home, running=3, free_lanes=5), Candidate(other, running=1, free_lanes=7)]
    assert busier[0].score - busier[1].score <= router.balance_threshold
    assert router.choose(busier, prompt_blocks({"tokens": convo[0]})) == home  # credit: only home
    router.index.insert(other, prompt_blocks({"tokens": convo[1]}))  # one conversation went there
    assert router.choose(busier, prompt_blocks({"tokens": convo[2]})) == other  # now by load
    turn2 = prompt_blocks({"tokens": convo[0] + list(range(50_000, 50_064))})
    near = [Candidate(home, running=2, free_lanes=6), Candidate(other, running=1, free_lanes=7)]
    assert router.slack(13) >= near[0].score - near[1].score
    assert router.choose(near, turn2, remember=False) == home  # its 13 blocks are there
    assert router.choose(near, prompt_blocks({"tokens": convo[2]}), remember=False) == other


def test_least_loaded_and_round_robin_ignore_prefixes() -> None:
    blocks = prompt_blocks({"tokens": list(range(64))})
    ll = Router("least_loaded")
    ll.index.insert("a", blocks)
    cands = [Candidate("a", running=1), Candidate("b")]
    assert ll.choose(cands, blocks) == "b"
    rr = Router("round_robin")
    picks = [rr.choose([Candidate("b"), Candidate("a")], blocks) for _ in range(4)]
    assert picks == ["a", "b", "a", "b"]
    assert Router().choose([], blocks) is None
    with pytest.raises(ValueError):
        Router("random")


def test_prefix_index_is_bounded_and_forgets_a_worker() -> None:
    index = PrefixIndex(capacity=3)
    index.insert("a", [1, 2, 3, 4])  # 1 evicted (oldest)
    assert index.size("a") == 3
    assert index.match("a", [1, 2]) == 0 and index.match("a", [2, 3, 9]) == 2
    index.insert("a", [2])  # touched: now newest
    index.insert("a", [5])  # evicts 3
    assert index.match("a", [2]) == 1 and index.match("a", [3]) == 0
    index.forget("a")
    assert index.size("a") == 0 and index.match("a", [2]) == 0


# -- affinity ---------------------------------------------------------------------------


def test_affinity_assign_confirm_drop_and_rebuild() -> None:
    clock = [1.0]
    table = AffinityTable(clock=lambda: clock[0])
    table.assign("s1", "a", now=1.0)
    table.assign("s2", "a", now=1.0, confirmed=True)
    table.assign("s3", "b", now=1.0)
    assert table.worker_of("s1") == "a" and not table.get("s1").confirmed  # type: ignore[union-attr]
    table.confirm("s1")
    assert table.get("s1").confirmed  # type: ignore[union-attr]
    table.assign("s1", "b", now=2.0)  # moved
    assert table.sessions_of("a") == ["s2"] and table.sessions_of("b") == ["s1", "s3"]
    # b lists s3 and a session the table lacks; s1 (made after the ask) stays
    added, removed = table.rebuild("b", ["s3", "s9"], asked_at=1.5, busy=lambda s: False)
    assert (added, removed) == (["s9"], []) and table.worker_of("s9") == "b"
    # a no longer lists s2: gone unless something is in flight for it
    assert table.rebuild("a", [], asked_at=5.0, busy=lambda s: s == "s2") == ([], [])
    assert table.rebuild("a", [], asked_at=5.0, busy=lambda s: False) == ([], ["s2"])
    # a session another worker already holds is not taken over by a listing
    assert table.rebuild("a", ["s1"], asked_at=6.0, busy=lambda s: False) == ([], [])
    assert table.worker_of("s1") == "b"
    # a drop that overtook the stats answer does not bring the session back
    clock[0] = 7.0
    table.remove("s9")
    listed = ["s1", "s3", "s9"]
    assert table.rebuild("b", listed, asked_at=6.5, busy=lambda s: False) == ([], [])
    assert table.rebuild("b", listed, asked_at=7.5, busy=lambda s: False) == (["s9"], [])
    # a drop is pending until its reply: a worker answers stats before running it
    table.drop_started("s9")
    clock[0] = 8.0
    assert table.rebuild("b", listed, asked_at=7.9, busy=lambda s: False) == ([], [])
    clock[0] = 8.5
    table.drop_finished("s9")
    assert table.rebuild("b", listed, asked_at=8.2, busy=lambda s: False) == ([], [])
    assert table.rebuild("b", listed, asked_at=8.6, busy=lambda s: False) == (["s9"], [])
    table.assign("s4", "b", now=8.0)  # unconfirmed: never existed as far as we know
    assert table.drop_worker("b") == ["s1", "s3", "s4", "s9"]
    assert len(table) == 0 and table.remove("nope") is None
    # confirmed sessions of a worker that went down are remembered as lost
    assert table.lost_on("s9") == "b"  # listed by b: confirmed
    assert table.lost_on("s3") is None and table.lost_on("s4") is None  # never confirmed
    assert table.forget_lost("s9") and table.lost_on("s9") is None
    table.assign("s2", "b", now=9.0, confirmed=True)
    table.drop_worker("b")
    table.assign("s2", "a", now=10.0)  # e.g. a worker came back listing it
    assert table.lost_on("s2") is None


# -- load estimate -----------------------------------------------------------------------


def test_candidate_adds_gateway_traffic_to_the_last_stats() -> None:
    w = WorkerConn("w", "llm", peer=None)  # type: ignore[arg-type]
    asked = w.mark_stats_sent(0.0)
    w.sent_work = 2  # sent after the stats request: not in the snapshot
    w.apply_stats({"lanes": {"total": 4, "active": 1, "idle": 3}, "running": 1, "queued": 0}, asked)
    w.done_work = 0
    assert w.candidate() == Candidate("w", queued=0, running=3, free_lanes=3)
    w.sent_work += 3  # 6 outstanding on 4 lanes
    w.lanes_taken += 2
    assert w.candidate() == Candidate("w", queued=2, running=4, free_lanes=1)
    w.done_work += 6
    w.lanes_freed += 2
    assert w.candidate() == Candidate("w", queued=0, running=0, free_lanes=3)


def test_a_slow_stats_reply_counts_what_was_sent_after_its_own_request() -> None:
    """A ``stats`` reply slower than ``down_after`` is overtaken by a second
    request; the first reply still counts the stream sent between the two
    (with the second request's counters, the busy worker looked idle and a
    second stream went to it: seen once in a full suite under load)."""
    w = WorkerConn("w", "llm", peer=None)  # type: ignore[arg-type]
    first = w.mark_stats_sent(0.0)
    w.sent_work += 1  # a stream goes to it
    w.lanes_taken += 1
    second = w.mark_stats_sent(1.6)  # the first reply is late: asked again
    idle = {"lanes": {"total": 4, "active": 0, "idle": 4}, "running": 0, "queued": 0}
    w.apply_stats(idle, first)  # answered before the stream arrived
    assert w.candidate() == Candidate("w", queued=0, running=1, free_lanes=3)
    busy = {"lanes": {"total": 4, "active": 1, "idle": 3}, "running": 1, "queued": 0}
    w.apply_stats(busy, second)
    assert w.candidate() == Candidate("w", queued=0, running=1, free_lanes=3)


# -- config ---------------------------------------------------------------------------------


def _parse(argv: list[str]) -> GatewayConfig:
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return from_namespace(parser.parse_args(argv))


def test_config_flags_env_twins_and_workers_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    listing = tmp_path / "workers"
    listing.write_text("# pool\ntcp://w-1:5555\n\nspeech tcp://tts:5556  # voice\ntcp://w-2:5555\n")
    monkeypatch.setenv("SKIFF_GATEWAY_WORKERS", "tcp://a:1, tcp://b:2")
    monkeypatch.setenv("SKIFF_GATEWAY_POLICY", "least_loaded")
    monkeypatch.setenv("SKIFF_METRICS_PORT", "9100")
    cfg = _parse(["--workers-file", str(listing), "--http", "0.0.0.0:8080"])
    assert cfg.all_workers == ("tcp://a:1", "tcp://b:2", "tcp://w-1:5555", "tcp://w-2:5555")
    assert cfg.all_speech == ("tcp://tts:5556",)
    assert (cfg.policy, cfg.metrics_port, cfg.http_address) == (
        "least_loaded",
        9100,
        ("0.0.0.0", 8080),
    )
    # a flag wins over its variable
    cfg = _parse(["--worker", "tcp://c:3", "--policy", "round_robin"])
    assert cfg.all_workers == ("tcp://c:3",) and cfg.policy == "round_robin"
    monkeypatch.delenv("SKIFF_GATEWAY_WORKERS")
    with pytest.raises(SystemExit):
        _parse([])  # no worker at all
    with pytest.raises(SystemExit):
        _parse(["--worker", "tcp://c:3", "--health-interval-ms", "1500"])  # >= down-after
    assert connectable("tcp://0.0.0.0:5550") == "tcp://127.0.0.1:5550"
    assert connectable("tcp://*:5550") == "tcp://127.0.0.1:5550"
    assert connectable("ipc:///tmp/g.sock") == "ipc:///tmp/g.sock"


def test_the_router_says_why_it_chose() -> None:
    """``Router.last`` (logged at debug as ``routed``) names the reason: a
    fresh prompt goes home, its repeat is a hit there, a prompt with no
    blocks goes by load, and a home past its slack loses to the least loaded."""
    router = Router("cache_aware")
    blocks = prompt_blocks({"tokens": list(range(16 * 12))})
    home = router.home(["a", "b"], blocks)
    assert home is not None
    other = "b" if home == "a" else "a"
    level = [Candidate("a", free_lanes=8), Candidate("b", free_lanes=8)]
    assert router.choose(level, blocks) == home
    assert router.last == Routed(home, "home", home, 0)
    router.choose(level, blocks)
    assert router.last == Routed(home, "hit", home, 12)
    router.choose(level, ())
    assert router.last is not None and router.last.reason == "least_loaded"
    busy = [Candidate(home, running=6, free_lanes=2), Candidate(other, running=1, free_lanes=7)]
    assert router.choose(busy, blocks) == other
    assert router.last == Routed(other, "load", home, 0)
