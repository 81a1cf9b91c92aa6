"""A forward's parts and results: what jobs hand the runtime and get back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from faults import BadRequest

from ..spec import SamplerSpec
from .lanes import Session
from .rows import RowRule


@dataclass(frozen=True)
class Origin:
    """Where a pipeline step's result goes when not back along the chain: the
    head stage's direct connection to the last stage (``peer``), the head's
    request ``request``, and the step's ``index`` among its ``count`` steps.
    Opaque to the runtime; the last stage answers it directly."""

    peer: bytes
    request: int
    index: int
    count: int


@dataclass
class Step:
    """Part of one forward: ``tokens`` appended to ``session``.

    ``sample`` asks for a token sampled after the last one (with ``spec``,
    or greedy when ``spec`` is None). ``outputs`` ("hidden", "logits")
    copies those tensors out for the sampled row, or for every row of the
    step with ``capture_all``. ``embd`` (``[n, n_embd]`` f32) feeds input
    embeddings instead of token ids; ``tokens`` then holds n placeholders.
    """

    session: Session
    tokens: Sequence[int]
    sample: bool = False
    spec: SamplerSpec | None = None
    outputs: tuple[str, ...] = ()
    all_rows: bool = False  # logits for every token (verify, speculation)
    top_logprobs: int | None = None  # logprobs of the sampled token (+ top k)
    capture_all: bool = False  # ``outputs`` for every token of the step
    embd: np.ndarray | None = None
    rule: RowRule | None = None  # ``all_rows``: sample the rows by this rule (``row_tokens``)
    origin: Origin | None = None  # a pipeline step answered directly to the head stage
    # ``embd`` rows decoded with bidirectional attention (an image's tokens):
    # llama.cpp switches that per context, so the step runs in a forward alone.
    non_causal: bool = False

    @property
    def wants_hidden(self) -> bool:
        return "hidden" in self.outputs

    @property
    def group(self) -> tuple[bool, bool, bool]:
        """Steps of one group share a ``llama_decode``: token ids and input
        embeddings cannot share a batch, hidden-state output makes every
        row of its batch an output row (kept away from other steps' batches),
        and non-causal attention applies to the whole batch."""
        return (self.embd is not None, self.wants_hidden, self.non_causal)


@dataclass
class StepResult:
    token: int | None = None
    logits: np.ndarray | None = None  # [rows, n_vocab] copies (``outputs``)
    hidden: np.ndarray | None = None  # [rows, n_embd] copies (``outputs``)
    rows: list[int] | None = None  # batch rows of every token (``all_rows``)
    logprobs: dict[str, Any] | None = None
    error: BadRequest | None = None  # this step's sampling failed
    row_tokens: list[int] | None = None  # ``rule``: the rows' sampled tokens, in order
    row_logprobs: list[dict[str, Any] | None] | None = None  # per row token (top_logprobs)


def group_steps(steps: Sequence[Step]) -> dict[tuple[bool, bool, bool], list[int]]:
    """Step indices by ``Step.group``: the steps that can share a ``llama_decode``."""
    groups: dict[tuple[bool, bool, bool], list[int]] = {}
    for index, step in enumerate(steps):
        groups.setdefault(step.group, []).append(index)
    return groups
