"""Prefix reuse: dropped lanes keep their KV, later prompts with that prefix skip it.

``exact`` reuse (the default) must be bit-identical to a cold prefill; ``any``
reuse keeps every shared token. The pool's LRU policy and the sliding-window
guard are checked on their own, without a model.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from conftest import start_worker, stop_worker
from protocol import Client
from worker.runtime import LanePool, RuntimeState
from worker.runtime.lanes import Session
from worker.runtime.prefix import (
    MIN_RAM_TOKENS,
    PrefixStats,
    PromptRam,
    admit_from_ram,
    keep_evicted,
    window_holds,
)

STORY = (
    "The harbor town woke slowly. Fishing boats rocked against the pier while gulls "
    "argued over scraps, and the baker opened his shutters to the smell of rain. "
)


def _prompt(client: Client, tag: str, n: int) -> list[int]:
    """A prompt of exactly ``n`` tokens, unique to ``tag`` (no other test shares it)."""
    tokens: list[int] = client.tokenize(f"[{tag}] " + STORY * 40)
    assert len(tokens) >= n
    return tokens[:n]


def _greedy_with_logits(client: Client, session: str, prompt: list[int], steps: int) -> Any:
    first = client.prefill_sampled(session, prompt)["token"]
    tokens, rows = [first], []
    for _ in range(steps):
        reply = client.decode(session, tokens[-1], return_logits=True)
        tokens.append(reply.result["token"])
        rows.append(np.array(reply.frame.array("logits")[0]))
    return tokens, np.stack(rows)


def _prefix_stats(client: Client) -> dict[str, int]:
    stats: dict[str, int] = client.stats()["prefix_cache"]
    return stats


def test_exact_reuse_past_the_sliding_window_is_bit_identical(client: Client) -> None:
    prompt = _prompt(client, "exact", 600)  # past Gemma 3's 512-token window
    cold_tokens, cold_rows = _greedy_with_logits(client, "cold", prompt, 8)
    client.drop("cold")  # the lane keeps its KV and tokens
    before = _prefix_stats(client)
    warm_tokens, warm_rows = _greedy_with_logits(client, "warm", prompt, 8)
    after = _prefix_stats(client)
    assert after["hits"] == before["hits"] + 1
    # every shared token but the last, and still bit-identical to a cold prefill
    assert after["reused_tokens"] - before["reused_tokens"] == 599
    assert warm_tokens == cold_tokens
    assert float(np.abs(warm_rows - cold_rows).max()) == 0.0


def test_generate_reports_cached_tokens_and_same_output(client: Client) -> None:
    args = {"tokens": _prompt(client, "gen", 300), "max_tokens": 16, "stream": False}
    first = client.call("generate", None, args).result
    second = client.call("generate", None, args).result
    assert first["usage"]["cached_tokens"] == 0
    assert second["usage"]["cached_tokens"] == 299  # all but the last prompt token
    assert second["tokens"] == first["tokens"]


@pytest.fixture(scope="module")
def cold_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A worker without a prefix cache: the reference for cold prefills."""
    tmp = tmp_path_factory.mktemp("cold")
    proc, endpoint, _ = start_worker(tmp, "--lanes", "2", "--ctx", "4096", "--prefix-cache", "0")
    yield endpoint
    stop_worker(proc)


def test_chat_style_turn_reuses_the_earlier_prompt(client: Client, cold_worker: str) -> None:
    """A stateless client resends prompt + reply + follow-up: the earlier prompt's
    tokens are reused (all the lane holds: the reply's last token was shown,
    never fed) and the output equals a cold prefill's."""
    turn1 = _prompt(client, "chat", 280)
    args: dict[str, Any] = {"max_tokens": 12, "stream": False, "ignore_eos": True}
    reply = client.call("generate", None, {**args, "tokens": turn1}).result["tokens"]
    turn2 = turn1 + reply + client.tokenize(" And then?", add_special=False)
    warm = client.call("generate", None, {**args, "tokens": turn2}).result
    assert warm["usage"]["cached_tokens"] == len(turn1) + len(reply) - 1
    with Client(cold_worker) as cold:
        reference = cold.call("generate", None, {**args, "tokens": turn2}).result
        assert reference["usage"]["cached_tokens"] == 0
        assert cold.stats()["prefix_cache"]["lanes_cached"] == 0
    assert warm["tokens"] == reference["tokens"]


@pytest.fixture(scope="module")
def one_cache_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("onecache")
    flags = ("--lanes", "2", "--ctx", "4096", "--prefix-cache", "1", "--prompt-ram-bytes", "0")
    proc, endpoint, _ = start_worker(tmp, *flags)
    yield endpoint
    stop_worker(proc)


def test_reuse_keeps_all_but_the_last_token_and_evicts_lru(one_cache_worker: str) -> None:
    with Client(one_cache_worker) as c:
        a = _prompt(c, "any-a", 100)
        b = _prompt(c, "any-b", 100)
        args: dict[str, Any] = {"max_tokens": 4, "stream": False}
        c.call("generate", None, {**args, "tokens": a})
        again = c.call("generate", None, {**args, "tokens": a}).result
        assert again["usage"]["cached_tokens"] == 99
        c.call("generate", None, {**args, "tokens": b})  # b's lane replaces a's (limit 1)
        stats = c.stats()["prefix_cache"]
        assert stats["lanes_cached"] == 1 and stats["limit"] == 1
        assert stats["evictions"] >= 1
        assert c.call("generate", None, {**args, "tokens": a}).result["usage"]["cached_tokens"] == 0
        # ... and a's run took the only cached lane (b's) and is now the one cached.
        assert c.call("generate", None, {**args, "tokens": b}).result["usage"]["cached_tokens"] == 0


@pytest.fixture(scope="module")
def ram_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One cached lane, and host memory for what it has to give up."""
    tmp = tmp_path_factory.mktemp("ram")
    flags = ("--lanes", "2", "--ctx", "4096", "--prefix-cache", "1")
    proc, endpoint, _ = start_worker(tmp, *flags, "--prompt-ram-bytes", str(64 << 20))
    yield endpoint
    stop_worker(proc)


def test_an_evicted_prompt_comes_back_from_host_memory_bit_identical(ram_worker: str) -> None:
    """A 600-token prompt (past the sliding window) loses its cached lane to
    another prompt; sent again, its cells are loaded from host memory and
    trimmed, and its continuation's logits equal the cold run's to the bit."""
    with Client(ram_worker) as c:
        a, b = _prompt(c, "ram-a", 600), _prompt(c, "ram-b", 100)
        cold_tokens, cold_rows = _greedy_with_logits(c, "a1", a, 8)
        c.drop("a1")  # a's lane is the cached one
        c.call("generate", None, {"tokens": b, "max_tokens": 4, "stream": False})
        before = _prefix_stats(c)  # b's lane is cached now; a's cells went to host memory
        assert before["lanes_cached"] == 1 and before["ram_kept"] == 1
        assert before["ram_prompts"] == 1 and 0 < before["ram_bytes"] <= 64 << 20
        warm_tokens, warm_rows = _greedy_with_logits(c, "a2", a, 8)
        after = _prefix_stats(c)
        assert after["ram_hits"] == before["ram_hits"] + 1
        assert after["reused_tokens"] - before["reused_tokens"] == 599
        assert after["ram_prompts"] == 0  # taken out: the lane holds it now
        assert warm_tokens == cold_tokens
        assert float(np.abs(warm_rows - cold_rows).max()) == 0.0


# -- the pool, without a model ---------------------------------------------------------


def test_pool_takes_empty_lanes_first_then_the_least_recently_cached() -> None:
    pool = LanePool(3, cache_limit=-1)
    for sid in ("a", "b", "c"):
        (s,) = pool.admit([sid])
        s.tokens, s.position = [1, 2, 3, ord(sid)], 4
    pool.release("b", keep=True)
    pool.release("a", keep=True)
    assert pool.free == 2 and pool.cached == 2
    assert pool.best_prefix([1, 2, 3, ord("a"), 9], 4) == (0, 4)
    (d,) = pool.admit(["d"])  # no empty lane: the LRU cached lane (b's, lane 1) goes
    assert d.lane == 1 and pool.take_evicted() == [1]
    pool.release("c", keep=False)
    (e,) = pool.admit(["e"])  # an empty lane is preferred over a cached one
    assert e.lane == 2 and pool.take_evicted() == []
    assert pool.cached == 1


def test_pool_honours_its_cache_limit() -> None:
    pool = LanePool(3, cache_limit=1)
    for sid in ("a", "b"):
        (s,) = pool.admit([sid])
        s.tokens, s.position = [5, 6], 2
    pool.release("a", keep=True)
    pool.release("b", keep=True)
    assert pool.cached == 1 and pool.take_evicted() == [0]
    assert pool.free == 3


def test_sliding_window_guard_refuses_a_prefix_the_window_lost() -> None:
    engine = SimpleNamespace(
        n_seq=2, n_ctx_per_seq=4096, n_swa=512, n_layer=18, pos_min=lambda lane: 300
    )
    rt = RuntimeState(engine, prefix_cache=-1)  # type: ignore[arg-type]
    assert window_holds(rt.engine, 0, 812)  # cells 300..811 still cover the last 512 positions
    assert not window_holds(rt.engine, 0, 700)  # position 188.. would be needed, 300 is the oldest
    assert window_holds(rt.engine, 0, 0)  # nothing kept: nothing needed
    engine.pos_min = lambda lane: 0  # a lane prefilled here with swa_full keeps every cell
    assert window_holds(rt.engine, 0, 10)
    engine.n_swa = 0  # a model without sliding-window layers
    engine.pos_min = lambda lane: 300
    assert window_holds(rt.engine, 0, 10)


def test_prompt_ram_finds_the_longest_shared_prefix_and_stays_within_its_limit() -> None:
    ram = PromptRam(limit=300)
    assert ram.keep([1, 2, 3, 4], np.zeros(100, np.uint8))
    assert ram.keep([1, 2, 9], np.zeros(100, np.uint8))
    assert ram.best([1, 2, 3, 4, 5], longest=4) == (0, 4)
    assert ram.best([1, 2, 9, 9], longest=3) == (1, 3)
    assert ram.best([1, 2, 3, 4, 5], longest=2) == (0, 2)  # at most ``longest``
    assert ram.best([7, 8], longest=1) is None
    # An entry a newer one extends serves nothing the newer one cannot: it goes.
    assert ram.keep([1, 2, 9, 9, 9], np.zeros(100, np.uint8))
    assert [t.tolist() for t, _ in ram.entries.values()] == [[1, 2, 3, 4], [1, 2, 9, 9, 9]]
    # Past the limit the least recently kept go; what alone exceeds it is refused.
    assert ram.keep([5, 6], np.zeros(150, np.uint8))
    assert [t.tolist() for t, _ in ram.entries.values()] == [[1, 2, 9, 9, 9], [5, 6]]
    assert ram.nbytes == 250
    assert not ram.keep([8], np.zeros(301, np.uint8)) and ram.nbytes == 250
    tokens, kv = ram.take(next(iter(ram.entries)))
    assert tokens.tolist() == [1, 2, 9, 9, 9] and kv.nbytes == 100 and ram.nbytes == 150


def test_only_lanes_worth_a_load_go_to_host_memory() -> None:
    """A lane shorter than ``MIN_RAM_TOKENS`` is cheaper to prefill again than
    to keep; a longer one is saved with every cell (``all_cells``)."""
    asked: list[tuple[int, bool]] = []

    def state_get(lane: int, all_cells: bool = False) -> np.ndarray:
        asked.append((lane, all_cells))
        return np.zeros(10, np.uint8)

    rt = SimpleNamespace(
        engine=SimpleNamespace(state_get=state_get),
        prompt_ram=PromptRam(1000),
        prefix=PrefixStats(),
    )
    keep_evicted(rt, 3, list(range(MIN_RAM_TOKENS - 1)))  # type: ignore[arg-type]
    assert asked == [] and rt.prefix.ram_kept == 0
    keep_evicted(rt, 3, list(range(MIN_RAM_TOKENS)))  # type: ignore[arg-type]
    assert asked == [(3, True)] and rt.prefix.ram_kept == 1 and len(rt.prompt_ram.entries) == 1


def test_cells_llama_cpp_refuses_are_prefilled_cold() -> None:
    """``llama_state_seq_set_data`` answers 0 instead of raising: a refused
    load clears the lane and the prompt is prefilled from its start (a miss,
    not a hit), and the entry is gone from host memory either way."""
    cleared: list[int] = []
    session = Session("s", lane=2)
    rt = SimpleNamespace(
        engine=SimpleNamespace(state_set=lambda lane, kv: False, seq_clear=cleared.append),
        prompt_ram=PromptRam(1000),
        prefix=PrefixStats(),
        admit=lambda ids, ephemeral=False: [session],
        check_position=lambda s: None,
    )
    prompt = list(range(100))
    rt.prompt_ram.keep(prompt[:80], np.zeros(10, np.uint8))
    kept = rt.prompt_ram.best(prompt, len(prompt) - 1)
    assert kept == (0, 80)
    got, reused_tokens = admit_from_ram(rt, "s", prompt, False, kept)  # type: ignore[arg-type]
    assert got is session and reused_tokens == 0 and session.position == 0
    assert cleared == [2] and rt.prefix.misses == 1
    assert rt.prefix.hits == rt.prefix.ram_hits == 0 and not rt.prompt_ram.entries
