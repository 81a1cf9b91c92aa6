"""Exactness is the product: a session's logits do not depend on where or with
whom it ran (docs: DESIGN.md, *Exactness is the product*).

Every claim is checked by logits, not only by tokens: full rows of
``output: ["logits"]``, max abs difference exactly 0.0, at prompt lengths below,
at and past Gemma 3's 512-token sliding window. Real worker processes, real
sockets:

1. migration: ``export_state`` -> ``import_state`` into a worker of the same
   layout and of another (then ``Client.migrate`` on), and from a 2-stage
   chain to another chain (whole <-> chain refused, by design);
2. prefix reuse (a prompt sharing a dropped session's prefix) against a cold
   prefill on a worker without the cache;
3. a 2-stage chain against one worker;
4. ``decode_batch`` of every size 1..8, and 8 concurrent ``generate``
   streams, against each session alone;
5. ``verify`` spans of 1, 7, 8 and 16 drafts (and a rejected one) against
   plain decoding: the predictions, and the logits of the decode after;
6. ``trim`` then re-decode, and the refused trim of an imported session
   below its window floor;
7. a chain whose cache saw churn (a session ahead of it dropped) against
   one worker: a stage lays its KV out as a worker does, one stream per lane.

A step's row ``i`` is the logits after feeding token ``i`` of a run at
position ``n + i`` (token 0 is what ``prefill_sampled`` sampled). The side
under test is fed the reference's tokens, so one differing step does not
cascade into every later one. Costs are shared: each worker starts once per
module (in parallel), each prompt is prefilled once per worker where the
claim allows (the references and the chain's runs are module memos).
"""

from __future__ import annotations

import contextlib
import re
import subprocess
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import start_worker, stop_worker
from protocol import Client, Reply, SkiffError

LENGTHS = [100, 511, 512, 513, 600, 1000, 1500]
IDS = [f"len{n}" for n in LENGTHS]
EXTRA = 40  # the eighth session of the batched claims (8 lanes, 7 lengths)
# 8 concurrent streams, prompts below, at and past the window (each prefilled cold)
STREAM_LENGTHS = [EXTRA, 64, 100, 200, 511, 512, 513, 600]
STEPS = 4  # greedy decode steps compared per claim
WINDOW = 512  # Gemma 3 270M's sliding window
SPANS = (1, 7, 8, 16)  # drafts per verify span
TIMEOUT_MS = 120_000

TEXT = " ".join(f"Note {i}: the tide reached marker {i * 11 % 37} at noon." for i in range(300))

Started = tuple[subprocess.Popen[bytes], str, Path]


def _prompt(client: Client, tag: str, n: int) -> list[int]:
    """``n`` tokens whose first few are unique to ``tag``: no other prompt of
    this module (or another) shares the 8 leading tokens a prefix hit needs."""
    tokens: list[int] = client.tokenize(f"{tag} log. {TEXT}")
    assert len(tokens) >= n
    return tokens[:n]


@dataclass
class Run:
    """A greedy run: ``tokens[0]`` from the prefill, then ``rows[i]`` (the
    logits after feeding ``tokens[i]``) and its greedy ``tokens[i + 1]``."""

    prompt: list[int]
    tokens: list[int]
    rows: np.ndarray
    exported: Reply | None = None  # the session's state right after its prefill


def _row(logits: Any, i: int = 0) -> np.ndarray:
    return np.array(logits[i], dtype=np.float32)


def _greedy(client: Client, session: str, first: int, steps: int) -> tuple[list[int], np.ndarray]:
    tokens, rows = [first], []
    for _ in range(steps):
        reply = client.decode(session, tokens[-1], output=["logits"])
        rows.append(_row(reply.frame.array("logits")))
        tokens.append(int(reply.result["token"]))
    return tokens, np.stack(rows)


def _decode(client: Client, session: str, feed: Sequence[int]) -> tuple[list[int], np.ndarray]:
    """Feed ``feed`` one decode at a time: what each step sampled, and its row."""
    sampled, rows = [], []
    for token in feed:
        reply = client.decode(session, token, output=["logits"])
        rows.append(_row(reply.frame.array("logits")))
        sampled.append(int(reply.result["token"]))
    return sampled, np.stack(rows)


def _run(
    client: Client,
    session: str,
    prompt: list[int],
    steps: int = STEPS,
    export: bool = False,
    drop: bool = True,
) -> Run:
    first = int(client.prefill_sampled(session, prompt)["token"])
    exported = client.export_state(session) if export else None
    tokens, rows = _greedy(client, session, first, steps)
    if drop:
        client.drop(session)
    return Run(prompt, tokens, rows, exported)


def _diffs(got: np.ndarray, want: np.ndarray) -> list[float]:
    assert got.shape == want.shape, f"logits shapes {got.shape} != {want.shape}"
    return [float(np.max(np.abs(g - w))) for g, w in zip(got, want, strict=True)]


def _same(
    what: str,
    got_tokens: Sequence[int],
    got_rows: np.ndarray,
    want_tokens: Sequence[int],
    want_rows: np.ndarray,
) -> None:
    """Rows equal to the bit (first, the more telling), then the tokens."""
    diffs = _diffs(got_rows, want_rows)
    assert max(diffs) == 0.0, f"{what}: max |logit difference| per step {diffs}"
    assert list(got_tokens) == list(want_tokens), f"{what}: tokens {got_tokens} != {want_tokens}"


def _replay(client: Client, session: str, run: Run, start: int, what: str) -> None:
    """``session`` holds ``run``'s first ``start`` positions (after a trim or
    an import): feed the rest of the run and compare every row it has."""
    n = len(run.prompt)
    if start < n:
        first = int(client.prefill_sampled(session, run.prompt[start:])["token"])
        assert first == run.tokens[0], f"{what}: prefill from {start} sampled {first}"
    skip = max(0, start - n)
    assert skip < len(run.rows), f"{what}: nothing left to compare from {start}"
    sampled, rows = _decode(client, session, run.tokens[skip:-1])
    _same(what, sampled, rows, run.tokens[skip + 1 :], run.rows[skip:])


def _session_names(client: Client) -> list[str]:
    return [s["session"] for s in client.stats()["sessions"]]


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
def reference(worker: tuple[str, Path]) -> Iterator[Callable[[int], Run]]:
    """The run of the ``n``-token prompt on the shared worker, a session that
    never moves, exported right after its prefill. Its prompt is unique, so
    it is a cold prefill; its lane stays cached there afterwards."""
    runs: dict[int, Run] = {}
    with Client(worker[0], timeout_ms=TIMEOUT_MS) as c:

        def get(n: int) -> Run:
            if n not in runs:
                tag = f"ref-{n}"
                hits = c.stats()["prefix_cache"]["hits"]
                runs[n] = _run(c, tag, _prompt(c, tag, n), export=True)
                assert c.stats()["prefix_cache"]["hits"] == hits, f"reference {n} was not cold"
            return runs[n]

        yield get


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


# -- 4. batched against alone ----------------------------------------------------------


@dataclass
class Bank:
    client: Client
    lengths: list[int]
    names: list[str]
    alone: list[Run]  # each session's own run, decoded alone; sessions trimmed back after


@pytest.fixture(scope="class")  # torn down after the class: it holds all 8 lanes
def bank(worker: tuple[str, Path], reference: Callable[[int], Run]) -> Iterator[Bank]:
    c = Client(worker[0], timeout_ms=TIMEOUT_MS)
    bank = Bank(c, [*LENGTHS, EXTRA], [], [])
    prompts = [reference(n).prompt for n in LENGTHS]  # (a lane each, before the bank's 8)
    prompts.append(_prompt(c, f"batch-{EXTRA}", EXTRA))
    try:
        for n, prompt in zip(bank.lengths, prompts, strict=True):
            name = f"batch-{n}"
            bank.names.append(name)
            bank.alone.append(_run(c, name, prompt, drop=False))
            assert c.trim(name, n) == n
        yield bank
    finally:
        for name in bank.names:
            with contextlib.suppress(SkiffError):  # a setup that failed part-way
                c.drop(name)
        c.close()


class TestBatchedEqualsAlone:
    """Eight sessions (the seven lengths and a short one) on the shared
    worker, each first decoded alone, then in ``decode_batch`` rounds of
    every size 1..8 (members rotate, so each length sits in several sizes and
    rows), trimmed back to its prompt after each."""

    @pytest.mark.parametrize("size", range(1, 9), ids=[f"batch{b}" for b in range(1, 9)])
    def test_decode_batch_rows_equal_each_session_alone(self, bank: Bank, size: int) -> None:
        members = [(size + j) % len(bank.names) for j in range(size)]
        rows: dict[int, list[np.ndarray]] = {m: [] for m in members}
        sampled: dict[int, list[int]] = {m: [] for m in members}
        try:
            for step in range(STEPS):
                reply = bank.client.decode_batch(
                    [
                        {"session": bank.names[m], "token": bank.alone[m].tokens[step]}
                        for m in members
                    ],
                    output=["logits"],
                )
                logits = reply.frame.array("logits")
                assert logits.shape[0] == size
                for j, m in enumerate(members):
                    rows[m].append(_row(logits, j))
                    sampled[m].append(int(reply.result["tokens"][j]))
        finally:
            for m in members:
                bank.client.trim(bank.names[m], bank.lengths[m])
        failures = []
        for j, m in enumerate(members):
            alone = bank.alone[m]
            diffs = _diffs(np.stack(rows[m]), alone.rows)
            if max(diffs) != 0.0 or sampled[m] != alone.tokens[1:]:
                failures.append(f"{bank.lengths[m]} tokens (row {j}): per step {diffs}")
        assert not failures, f"batch of {size}: " + "; ".join(failures)


# -- 5. speculation --------------------------------------------------------------------


@pytest.mark.parametrize("n", LENGTHS, ids=IDS)
def test_verify_spans_score_as_plain_decoding(
    client: Client, reference: Callable[[int], Run], n: int
) -> None:
    """``verify`` returns no logits: its predictions must be plain decoding's
    greedy tokens, and the decode after it (from the accepted position) must
    give plain decoding's row there to the bit. Spans of 1, 7, 8 and 16
    drafts, all right, then 8 with the fifth wrong; plain decoding is the
    same session's, trimmed back to its prompt before each span."""
    s = f"spec-{n}"
    plain = _run(client, s, reference(n).prompt, steps=max(SPANS) + 2, drop=False)
    p = plain.tokens
    failures: list[str] = []

    def span(drafts: list[int], accepted: int) -> None:
        assert client.trim(s, n) == n
        got = client.call("verify", s, {"tokens": [p[0], *drafts]}).result
        k = len(drafts)
        what = f"{k} drafts, {accepted} right"
        if (
            got["predicted"][: accepted + 1] != p[1 : accepted + 2]
            or len(got["predicted"]) != k + 1
        ):
            failures.append(f"{what}: predicted {got['predicted']} vs plain {p[1 : k + 2]}")
            return
        if got["accepted"] != accepted or got["position"] != n + 1 + accepted:
            failures.append(f"{what}: accepted {got['accepted']} at {got['position']}")
            return
        after = client.decode(s, got["predicted"][accepted], output=["logits"])
        diff = _diffs(
            _row(after.frame.array("logits"))[None], plain.rows[accepted + 1 : accepted + 2]
        )
        if diff[0] != 0.0 or after.result["token"] != p[accepted + 2]:
            failures.append(f"{what}: the decode after differs by {diff[0]}")

    for k in SPANS:
        span(p[1 : k + 1], k)
    wrong = p[1:9]
    wrong[4] = (wrong[4] + 1) % 262144
    span(wrong, 4)
    assert not failures, f"{n} tokens: " + "; ".join(failures)


# -- 6. trim ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", LENGTHS, ids=IDS)
def test_trim_then_decode_again_is_exact(
    client: Client, reference: Callable[[int], Run], n: int
) -> None:
    """Decode, trim back (into the decoded tokens, to the prompt's end, into
    the prompt, and for the longest prompt more than a window into it),
    decode the same tokens again: the same rows to the bit as the first time."""
    s = f"trim-{n}"
    run = _run(client, s, reference(n).prompt, drop=False)
    starts = [n + 2, n, n - 37]
    if n == LENGTHS[-1]:
        starts.append(n - WINDOW - 37)
    for start in starts:
        assert client.trim(s, start) == start
        _replay(client, s, run, start, f"{n} tokens, trimmed to {start}")


@pytest.mark.parametrize("n", LENGTHS, ids=IDS)
def test_trim_of_an_imported_session_below_its_window_is_refused(
    client: Client, reference: Callable[[int], Run], n: int
) -> None:
    """An imported session holds only the last window of sliding-window cells
    (llama.cpp exports no masked cell). Past the window, a trim below its
    floor is refused with ``bad_request`` naming the floor, the session
    untouched; a trim to the floor re-decodes exactly. Within the window the
    state carried every cell, and any trim re-decodes exactly."""
    ref = reference(n)
    assert ref.exported is not None
    s = f"imp-{n}"
    assert client.import_state(s, ref.exported) == n
    sampled, rows = _decode(client, s, ref.tokens[:-1])
    _same(f"{n} tokens, imported", sampled, rows, ref.tokens[1:], ref.rows)
    target = n - 37
    if n <= WINDOW:
        assert client.trim(s, target) == target
        _replay(client, s, ref, target, f"{n} tokens, imported, trimmed to {target}")
        return
    with pytest.raises(SkiffError) as err:
        client.trim(s, target)
    assert err.value.code == "bad_request", err.value
    assert "sliding-window" in err.value.message, err.value.message
    found = re.search(r"at least (\d+)", err.value.message)
    assert found, err.value.message
    floor = int(found.group(1))
    assert target < floor < n + STEPS, err.value.message
    with pytest.raises(SkiffError) as err:
        client.trim(s, floor - 1)
    assert err.value.code == "bad_request", err.value
    positions = {e["session"]: e["position"] for e in client.stats()["sessions"]}
    assert positions[s] == n + STEPS  # refused trims changed nothing
    assert client.trim(s, floor) == floor
    _replay(client, s, ref, floor, f"{n} tokens, imported, trimmed to its floor {floor}")


# -- 4b. concurrent streams (last: its extra references take lanes of the shared worker)


def test_eight_concurrent_generate_streams_equal_each_session_alone(
    reference: Callable[[int], Run], workers: Workers
) -> None:
    """Eight greedy streams with logits, prompts below, at and past the window
    at once (their prompt pieces and decodes share forwards in changing mixes
    as prompts finish) on a worker without a prefix cache, against each
    reference run alone on the shared worker. A stream's first row is its
    prompt's last (only its token is compared); the next ones are the
    reference's rows."""
    runs = [reference(n) for n in STREAM_LENGTHS]
    args: dict[str, Any] = {"max_tokens": STEPS + 1, "ignore_eos": True, "output": ["logits"]}
    with Client(workers.same, timeout_ms=TIMEOUT_MS) as c:
        before = c.stats()["coalesced_decode_steps"]
        ids = [c.send("generate", None, {**args, "tokens": r.prompt}) for r in runs]
        streams = [[e for e in c.follow(i) if e.header.get("event") == "token"] for i in ids]
        assert c.stats()["coalesced_decode_steps"] > before  # they did share forwards
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
