"""The rest of the model, when this process holds only its first layers.

A pipeline stage that does not hold the model's last layer runs its own
layers, then hands the hidden rows to a ``Tail`` (the next stage, reached
over the wire by ``worker.chain.link``) and gets back what the last stage
sampled. The runtime only sees this protocol; it knows nothing of sockets.

Forwards are asynchronous: ``send`` returns a ticket at once and ``poll``
hands back whatever has come home, so a stage can run its next forward
while the next stage computes the last one (pipelining, bounded by the
scheduler's in-flight credit). ``wait`` is the blocking form.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from faults import Fault

from .rows import RowRule
from .steps import Origin


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


class Tail(Protocol):
    """What the runtime asks of the next stage."""

    def send(self, steps: list[TailStep], hidden: np.ndarray) -> int:
        """Start the rest of the model over ``hidden`` (rows of ``steps`` in
        order); returns a ticket. Raises ``StageUnavailable`` when the next
        stage is not connected (nothing was sent)."""
        ...

    def poll(self, timeout_ms: int) -> dict[int, Landed]:
        """Forwards that came home, by ticket; waits up to ``timeout_ms`` for
        the first one when none has. A dropped link lands every outstanding
        forward as ``StageUnavailable``."""
        ...

    def session_op(self, op: str, session: str, token_count: int = 0) -> None:
        """Repeat a trim / drop downstream so every stage's cells agree."""
        ...

    def export_state(self, session: str) -> tuple[list[dict[str, Any]], list[np.ndarray]]:
        """The session's state on every stage below: metadata and KV bytes, in order."""
        ...

    def import_state(
        self, session: str, metas: list[dict[str, Any]], kvs: list[np.ndarray]
    ) -> None:
        """Make the session on every stage below from ``export_state``'s parts."""
        ...

    def session_query(self, op: str, session: str, window_tokens: int = 0) -> dict[str, Any]:
        """Ask ``signal`` / ``signal_window`` of the stage that samples."""
        ...
