"""The one schema of a stage hop (``forward_frame``), both directions.

A stage hands the rest of the model its rows as ``forward_frame``: a frame
of hidden rows and, per step, the fields below; the stage that answers
returns one entry per step, the rows it captured concatenated in a frame.
Both ends read and write these maps here, so the schema has one home:

- request step (``step_out`` / ``STEP_FIELDS``): ``session``, ``tokens``,
  ``position``, ``sample``, ``sampling``, ``output``, ``capture_all``,
  ``top_logprobs``; ``all_rows`` and ``rule`` for a scored span; ``origin``
  when the last stage answers the head directly; ``non_causal`` for an
  image's rows (stage 0 with ``--mmproj``: every stage attends both ways);
- reply entry (``result_out`` / ``result_in``): ``token``, ``rows`` (how many
  rows of the reply's frame are this step's), and when present
  ``logprobs``, ``error``, ``row_tokens`` / ``row_logprobs``, or
  ``direct`` (answered to the head stage instead).

The receiving stage still checks every field of a request step against its
own limits (``api/tensors.py``: a peer is never trusted); the frames
themselves are ``protocol.frames``' business, at the edge. It lives with the
runtime because both sides of the line use it: the link sends and reads,
the stage's job (below the line) answers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .steps import Origin, RowRule, StepResult
from .tail import TailResult, TailStep

STEP_FIELDS = frozenset(
    {
        "session",
        "tokens",
        "position",
        "sample",
        "sampling",
        "output",
        "capture_all",
        "top_logprobs",
        "all_rows",
        "rule",
        "origin",
        "non_causal",
    }
)


def step_out(step: TailStep) -> dict[str, Any]:
    """One step of a ``forward_frame`` request."""
    out: dict[str, Any] = {
        "session": step.session,
        "tokens": step.tokens,
        "position": step.position,
        "sample": step.sample,
        "sampling": step.sampling,
        "output": list(step.outputs),
        "capture_all": step.capture_all,
        "top_logprobs": step.top_logprobs,
    }
    if step.all_rows:
        out["all_rows"] = True
    if step.rule is not None:
        out["rule"] = rule_out(step.rule)
    if step.origin is not None:
        out["origin"] = origin_out(step.origin)
    if step.non_causal:
        out["non_causal"] = True
    return out


def origin_out(origin: Origin) -> list[Any]:
    """``[head peer id (hex), request id, index, count]``."""
    return [origin.peer.hex(), origin.request, origin.index, origin.count]


def rule_out(rule: RowRule) -> dict[str, Any]:
    """A scored span's ``RowRule``; ``api/tensors.py`` reads it back."""
    return {
        "checks": list(rule.checks),
        "until_mismatch": rule.until_mismatch,
        "stop_tokens": list(rule.stop_tokens),
        "stop_eog": rule.stop_eog,
    }


def rule_fields() -> frozenset[str]:
    """The keys of a step's ``rule`` (``rule_out``)."""
    return frozenset(rule_out(RowRule(())))


def result_out(result: StepResult, parts: dict[str, list[np.ndarray]]) -> dict[str, Any]:
    """One step's entry of a ``forward_frame`` reply; its captured rows are
    appended to ``parts`` (the reply's frame, by tensor name)."""
    item: dict[str, Any] = {"token": result.token, "rows": 0}
    if result.logprobs is not None:
        item["logprobs"] = result.logprobs
    if result.error is not None:
        item["error"] = result.error.message
    if result.row_tokens is not None:
        item["row_tokens"] = result.row_tokens
        item["row_logprobs"] = result.row_logprobs
    for name in ("hidden", "logits"):
        array = getattr(result, name)
        if array is not None:
            parts.setdefault(name, []).append(array)
            item["rows"] = int(array.shape[0])
    return item


DIRECT: dict[str, Any] = {"token": None, "rows": 0, "direct": True}


def is_direct(items: Any) -> bool:
    """A reply whose every entry was answered to the head stage directly."""
    return (
        isinstance(items, list)
        and bool(items)
        and all(isinstance(i, dict) and i.get("direct") for i in items)
    )


def results_in(
    result: dict[str, Any], arrays: dict[str, np.ndarray], steps: int
) -> list[TailResult]:
    """A reply's per-step results, each step's rows cut from ``arrays``."""
    items = result.get("results")
    if not isinstance(items, list) or len(items) != steps:
        raise ValueError(f"{steps} steps sent, results for {len(items or [])}")
    out: list[TailResult] = []
    row = 0
    for item in items:
        n = int(item.get("rows", 0))
        mine = {k: v[row : row + n] for k, v in arrays.items()}
        row += n
        out.append(
            TailResult(
                token=item.get("token"),
                logprobs=item.get("logprobs"),
                error=item.get("error"),
                parts=mine,
                row_tokens=item.get("row_tokens"),
                row_logprobs=item.get("row_logprobs"),
            )
        )
    return out
