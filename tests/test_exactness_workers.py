"""Exactness is the product: a session's logits do not depend on where or with
whom it ran (docs: DESIGN.md, *Exactness is the product*). Here: across
worker processes and chains.

Every claim is checked by logits, not only by tokens: full rows of
``output: ["logits"]``, max abs difference exactly 0.0, at prompt lengths below,
at and past Gemma 3's 512-token sliding window (``_exactness``). Real worker
processes, real sockets:

1. migration: ``export_state`` -> ``import_state`` into a worker of the same
   layout and of another (then ``Client.migrate`` on), and from a 2-stage
   chain to another chain (whole <-> chain refused, by design);
2. prefix reuse (a prompt sharing a dropped session's prefix) against a cold
   prefill on a worker without the cache;
3. a 2-stage chain against one worker;
4. 8 concurrent ``generate`` streams against each session alone;
7. a chain whose cache saw churn (a session ahead of it dropped) against
   one worker: a stage lays its KV out as a worker does, one stream per lane.

(4 to 6 on the shared worker alone: test_exactness_session.py.) Costs are
shared: each worker starts once per module (in parallel), each prompt is
prefilled once per worker where the claim allows (the references are a
session memo, ``reference`` in conftest.py; the chain's runs a module memo).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _exactness import (
    IDS,
    LENGTHS,
    STEPS,
    STREAM_LENGTHS,
    TIMEOUT_MS,
    Run,
    _decode,
    _diffs,
    _prompt,
    _row,
    _run,
    _same,
    _session_names,
)

from conftest import start_worker, stop_worker
from protocol import Client, SkiffError
from worker.core.jobs.base import MIN_CUT

Started = tuple[subprocess.Popen[bytes], str, Path]


# -- workers ---------------------------------------------------------------------------


def _in_parallel(*starts: Callable[[], list[Started]]) -> list[list[Started]]:
    """Run each start (one worker, or a chain's stages in order) on its own
    thread: loading models overlaps. If one fails, every started one stops."""
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
    groups: list[list[Started]] = []
    error: BaseException | None = None
    for future in futures:
        exc = future.exception()
        if exc is None:
            groups.append(future.result())
        else:
            error = error or exc
    if error is not None:
        for group in groups:
            for proc, _, _ in group:
                stop_worker(proc)
        raise error
    return groups


def _one(tmp: Path, name: str, *args: str) -> Callable[[], list[Started]]:
    return lambda: [start_worker(tmp, *args, name=name)]


def _chain(tmp: Path, name: str, *args: str) -> Callable[[], list[Started]]:
    """Layers 0:9 -> 9:18; the head (stage 0) first in the list."""

    def start() -> list[Started]:
        tail = start_worker(tmp, *args, "--layers", "9:18", name=f"{name}1")
        try:
            head = start_worker(tmp, *args, "--layers", "0:9", "--next", tail[1], name=f"{name}0")
        except BaseException:
            stop_worker(tail[0])
            raise
        return [head, tail]

    return start


@dataclass
class Workers:
    same: str  # the shared worker's layout (8 lanes x 2048 cells), no prefix cache
    other: str  # another layout: 2 lanes x 2048 cells, 2 KV streams


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    tmp = tmp_path_factory.mktemp("exact")
    groups = _in_parallel(
        _one(tmp, "same", "--lanes", "8", "--ctx", "16384", "--prefix-cache", "0"),
        _one(tmp, "other", "--lanes", "2", "--ctx", "4096", "--prefix-cache", "0"),
    )
    yield Workers(groups[0][0][1], groups[1][0][1])
    for group in groups:
        for proc, _, _ in group:
            stop_worker(proc)


@dataclass
class Chains:
    big: str  # head of a chain of the shared worker's layout
    small: str  # head of a chain of 2 lanes x 2048 cells


@pytest.fixture(scope="module")
def chains(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chains]:
    tmp = tmp_path_factory.mktemp("exact_chains")
    groups = _in_parallel(
        _chain(tmp, "big", "--lanes", "8", "--ctx", "16384"),
        _chain(tmp, "small", "--lanes", "2", "--ctx", "4096"),
    )
    yield Chains(groups[0][0][1], groups[1][0][1])
    for group in groups:
        for proc, _, _ in group:  # head first: it stops sending before its next goes
            stop_worker(proc)


# -- memos: one prefill per prompt and worker ------------------------------------------


@pytest.fixture(scope="module")
def chain_run(chains: Chains, reference: Callable[[int], Run]) -> Iterator[Callable[[int], Run]]:
    """The reference prompt run through the big chain, exported after its prefill."""
    runs: dict[int, Run] = {}
    with Client(chains.big, timeout_ms=TIMEOUT_MS) as head:

        def get(n: int) -> Run:
            if n not in runs:
                runs[n] = _run(head, f"chain-{n}", reference(n).prompt, export=True)
            return runs[n]

        yield get


# -- 1. migration ----------------------------------------------------------------------


@pytest.mark.parametrize("n", LENGTHS, ids=IDS)
def test_a_migrated_session_continues_to_the_bit(
    reference: Callable[[int], Run], workers: Workers, n: int
) -> None:
    """Imported into a worker of the same layout, and into one of another
    layout, which after two steps migrates it on (an imported session, holding
    only the window's cells, moves again): every step's logits equal the
    session that never moved."""
    ref = reference(n)
    assert ref.exported is not None
    name = f"mig-{n}"
    with (
        Client(workers.same, timeout_ms=TIMEOUT_MS) as same,
        Client(workers.other, timeout_ms=TIMEOUT_MS) as other,
    ):
        assert same.import_state(name, ref.exported) == n
        sampled, rows = _decode(same, name, ref.tokens[:-1])
        same.drop(name)
        _same(f"{n} tokens, same layout", sampled, rows, ref.tokens[1:], ref.rows)

        assert other.import_state(name, ref.exported) == n
        sampled, rows = _decode(other, name, ref.tokens[:2])
        assert other.migrate(name, to=same) == n + 2
        assert name not in _session_names(other)
        more, more_rows = _decode(same, name, ref.tokens[2:-1])
        same.drop(name)
        _same(
            f"{n} tokens, another layout then moved back",
            sampled + more,
            np.concatenate([rows, more_rows]),
            ref.tokens[1:],
            ref.rows,
        )


@pytest.mark.parametrize("n", LENGTHS, ids=IDS)
def test_a_session_moves_between_chains_to_the_bit(
    reference: Callable[[int], Run],
    chain_run: Callable[[int], Run],
    chains: Chains,
    workers: Workers,
    n: int,
) -> None:
    """export_state on a chain gathers every stage's cells; imported into a
    chain of another layout the session continues as on the chain it left
    and as on one worker. Whole worker <-> chain is refused by design."""
    ref, src = reference(n), chain_run(n)
    assert src.exported is not None and ref.exported is not None
    assert src.exported.frame.identities == ("kv_state", "kv_state.1")
    name = f"chain-mig-{n}"
    with Client(chains.small, timeout_ms=TIMEOUT_MS) as dst:
        assert dst.import_state(name, src.exported) == n
        sampled, rows = _decode(dst, name, src.tokens[:-1])
        dst.drop(name)
        _same(f"{n} tokens, chain to chain", sampled, rows, src.tokens[1:], src.rows)
        _same(f"{n} tokens, moved chain vs one worker", sampled, rows, ref.tokens[1:], ref.rows)

        with pytest.raises(SkiffError) as err:
            dst.import_state(f"whole-{n}", ref.exported)
        assert err.value.code == "bad_request", err.value
        assert "session_state" in err.value.message, err.value.message
        assert dst.stats()["lanes"]["active"] == 0
    with Client(workers.other, timeout_ms=TIMEOUT_MS) as whole:
        with pytest.raises(SkiffError) as err:
            whole.import_state(f"staged-{n}", src.exported)
        assert err.value.code == "bad_request", err.value
        assert "session_state" in err.value.message, err.value.message
        assert f"staged-{n}" not in _session_names(whole)


# -- 2. prefix reuse -------------------------------------------------------------------


@pytest.mark.parametrize("n", LENGTHS, ids=IDS)
def test_prefix_reuse_equals_a_cold_prefill(
    client: Client, reference: Callable[[int], Run], workers: Workers, n: int
) -> None:
    """A dropped session's lane keeps its KV on the shared worker (prefix
    cache on by default); a new prompt sharing its first ``n`` tokens takes
    it (a hit, all ``n`` shared tokens reused in ``stats``), and its logits
    equal a cold prefill on a worker of the same layout without the cache."""
    prompt = reference(n).prompt
    seed = prompt + client.tokenize(" The bell rang twice and the boats came home.", False)
    asked = prompt + client.tokenize(" Suddenly a gull landed on the rail.", False)
    assert seed[n] != asked[n]
    client.prefill(f"seed-{n}", seed)
    client.drop(f"seed-{n}")  # its lane stays cached with ``seed``
    before = client.stats()["prefix_cache"]
    warm = _run(client, f"warm-{n}", asked)
    after = client.stats()["prefix_cache"]
    with Client(workers.same, timeout_ms=TIMEOUT_MS) as c:
        cold = _run(c, f"cold-{n}", asked)
        assert c.stats()["prefix_cache"]["hits"] == 0
    reused = after["reused_tokens"] - before["reused_tokens"]
    assert after["hits"] == before["hits"] + 1, (
        f"{n} shared tokens: no prefix hit ({before} -> {after})"
    )
    # every shared token is kept (the cached lanes share exactly ``n`` with it)
    assert n <= reused < len(asked), f"{n} shared tokens: reused {reused}"
    assert warm.tokens[0] == cold.tokens[0]
    _same(
        f"{n} shared tokens, {reused} reused vs cold",
        warm.tokens[1:],
        warm.rows,
        cold.tokens[1:],
        cold.rows,
    )


# -- 3. stages -------------------------------------------------------------------------


@pytest.mark.parametrize("n", LENGTHS, ids=IDS)
def test_two_stages_equal_one_worker_to_the_bit(
    reference: Callable[[int], Run], chain_run: Callable[[int], Run], n: int
) -> None:
    want, got = reference(n), chain_run(n)
    assert got.tokens[0] == want.tokens[0]
    _same(f"{n} tokens, chain vs one worker", got.tokens[1:], got.rows, want.tokens[1:], want.rows)


# -- 4b. concurrent streams (last: its extra references take lanes of the shared worker)


def test_eight_concurrent_generate_streams_equal_each_session_alone(
    reference: Callable[[int], Run], workers: Workers
) -> None:
    """Eight greedy streams with logits, prompts below, at and past the window
    at once (their prompt pieces and decodes share forwards in changing mixes
    as prompts finish) on a worker without a prefix cache, against each
    reference run alone on the shared worker. A stream's first row is its
    prompt's last (only its token is compared); the next ones are the
    reference's rows. Each stream goes on past the rows compared for as many
    turns as the longest prompt can take (a turn carries a piece of at least
    ``MIN_CUT`` tokens however the turn clock paces it), so two streams
    decode at once on a slow machine too (the clock's pieces shrink there)."""
    runs = [reference(n) for n in STREAM_LENGTHS]
    new = STEPS + 1 + -(-max(STREAM_LENGTHS) // MIN_CUT)
    args: dict[str, Any] = {"max_tokens": new, "ignore_eos": True, "output": ["logits"]}
    with Client(workers.same, timeout_ms=TIMEOUT_MS) as c:
        before = c.stats()["coalesced_decode_steps"]
        ids = [c.send("generate", None, {**args, "tokens": r.prompt}) for r in runs]
        streams = [[e for e in c.follow(i) if e.header.get("event") == "token"] for i in ids]
        assert c.stats()["coalesced_decode_steps"] > before  # they did share forwards
    assert all(len(events) == new for events in streams)
    streams = [events[: STEPS + 1] for events in streams]
    failures = []
    for run, events in zip(runs, streams, strict=True):
        n = len(run.prompt)
        tokens = [int(e.header["token"]) for e in events]
        assert [e.frame.positions for e in events] == [(n - 1 + i,) for i in range(STEPS + 1)]
        rows = np.stack([_row(e.frame.array("logits")) for e in events[1:]])
        diffs = _diffs(rows, run.rows)
        if max(diffs) != 0.0 or tokens != run.tokens:
            failures.append(f"{n} tokens: per step {diffs}, tokens {tokens} vs {run.tokens}")
    assert not failures, "; ".join(failures)


# -- 7. churn on a chain ------------------------------------------------------------------


def test_a_chain_under_churn_equals_one_worker(
    reference: Callable[[int], Run], chains: Chains
) -> None:
    """A session prefilled behind another that is then dropped: in a unified
    cache its next tokens would land in the freed cells, ahead of its own,
    and the attention sums would change order. Its rows must equal one
    worker's."""
    ref = reference(600)
    with Client(chains.small, timeout_ms=TIMEOUT_MS) as head:
        head.prefill("churn-ahead", _prompt(head, "churn-ahead", 300))
        first = int(head.prefill_sampled("churn", ref.prompt)["token"])
        head.drop("churn-ahead")
        sampled, rows = _decode(head, "churn", ref.tokens[:-1])
        head.drop("churn")
    assert first == ref.tokens[0]
    _same("600 tokens, chain after churn vs one worker", sampled, rows, ref.tokens[1:], ref.rows)
