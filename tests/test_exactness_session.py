"""Exactness on the shared worker alone: a session's logits do not depend on
whom it ran with or how its tokens were fed (docs: DESIGN.md, *Exactness is
the product*).

By logits, max abs difference exactly 0.0, at prompt lengths below, at and
past Gemma 3's 512-token sliding window (``_exactness``), against the
``reference`` runs (a session memo in conftest.py):

4. ``decode_batch`` of every size 1..8 against each session alone;
5. ``verify`` spans of 1, 7, 8 and 16 drafts (and a rejected one) against
   plain decoding: the predictions, and the logits of the decode after;
6. ``trim`` then re-decode, and the refused trim of an imported session
   below its window floor.

(1 to 3, the concurrent streams and 7, across workers and chains:
test_exactness_workers.py.)
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from _exactness import (
    EXTRA,
    IDS,
    LENGTHS,
    SPANS,
    STEPS,
    TIMEOUT_MS,
    WINDOW,
    Run,
    _decode,
    _diffs,
    _prompt,
    _replay,
    _row,
    _run,
    _same,
)

from protocol import Client, SkiffError

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
