"""The rest of the model, when this process holds only its first layers.

A pipeline stage that does not hold the model's last layer runs its own
layers, then hands the hidden rows to a ``Tail`` (the next stage, reached
over the wire by ``worker.chain.link``) and gets back what the last stage
sampled. The runtime only sees this protocol; it knows nothing of sockets.

Everything is asynchronous: ``send`` (a forward) and the session ops,
queries, state moves and ``info`` each return a ticket at once, and
``poll`` hands back whatever has come home, so a stage runs its next
forward while the next stage computes the last one (pipelining, bounded by
the scheduler's in-flight credit) and never waits inside a turn for an
answer from down the chain (``ping`` and other sessions' work go on).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from faults import Fault

from .steps import Origin, RowRule


@dataclass
class TailStep:
    """One step of a forward, as the next stage needs it."""

    session: str
    tokens: list[int]  # the step's token ids (-1 where fed as embeddings)
    position: int  # of the first row
    sample: bool
    sampling: dict[str, Any] | None  # the wire form of the step's SamplerSpec
    outputs: tuple[str, ...] = ()
    capture_all: bool = False
    top_logprobs: int | None = None
    all_rows: bool = False  # every row scored (verify, speculation) ...
    rule: RowRule | None = None  # ... and sampled by this rule where the logits are
    origin: Origin | None = None  # answered directly to the head stage (3+ stages)
    non_causal: bool = False  # an image's rows: bidirectional attention on every stage


@dataclass
class TailResult:
    token: int | None = None
    logprobs: dict[str, Any] | None = None
    row_tokens: list[int] | None = None  # an ``all_rows`` step's, by its rule
    row_logprobs: list[dict[str, Any] | None] | None = None
    error: str | None = None  # this step's sampling failed (bad_request)
    parts: dict[str, np.ndarray] = field(default_factory=dict)  # captured rows


# What a forward came home as: the steps' results, or why the chain failed it.
Landed = list[TailResult] | Fault


@dataclass
class Answer:
    """What a request down the chain other than a forward came home with."""

    result: dict[str, Any] = field(default_factory=dict)  # a query's or ``info``'s result
    states: list[dict[str, Any]] = field(default_factory=list)  # export_state: each stage below
    kvs: list[np.ndarray] = field(default_factory=list)  # ... and its KV bytes, in order


class Tail(Protocol):
    """What the runtime asks of the next stage. Every request returns a
    ticket at once; its outcome comes home through ``poll``."""

    def send(self, steps: list[TailStep], hidden: np.ndarray) -> int:
        """Start the rest of the model over ``hidden`` (rows of ``steps`` in
        order); returns a ticket. Raises ``StageUnavailable`` when the next
        stage is not connected (nothing was sent)."""
        ...

    def poll(self, timeout_ms: int) -> dict[int, Landed | Answer]:
        """What came home, by ticket (a forward's results, another request's
        ``Answer``, or a ``Fault``); waits up to ``timeout_ms`` for the first
        one when none has. A dropped link lands every outstanding request as
        ``StageUnavailable``."""
        ...

    def session_op(self, op: str, session: str, token_count: int = 0) -> int:
        """Repeat a trim / drop downstream so every stage's cells agree."""
        ...

    def session_query(self, op: str, session: str, window_tokens: int = 0) -> int:
        """Ask ``signal`` / ``signal_window`` of the stage that samples
        (``Answer.result``)."""
        ...

    def export_state(self, session: str) -> int:
        """The session's state on every stage below: ``Answer.states`` and
        ``Answer.kvs``, in order."""
        ...

    def import_state(self, session: str, metas: list[dict[str, Any]], kvs: list[np.ndarray]) -> int:
        """Make the session on every stage below from ``export_state``'s parts."""
        ...

    def info(self) -> int:
        """The next stage's ``info`` (``Answer.result``: its ``chain``, recursively)."""
        ...
