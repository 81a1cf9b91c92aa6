"""What the exactness claims share (test_exactness_session.py and
test_exactness_workers.py; the ``reference`` runs they compare against are a
session memo in conftest.py): the prompt lengths, below, at and past Gemma
3's 512-token sliding window, greedy runs with every step's logits, and the
comparison, max abs difference exactly 0.0.

A step's row ``i`` is the logits after feeding token ``i`` of a run at
position ``n + i`` (token 0 is what ``prefill_sampled`` sampled). The side
under test is fed the reference's tokens, so one differing step does not
cascade into every later one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from protocol import Client, Reply

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
