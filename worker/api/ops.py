"""The worker's op tables: every op to exactly one handler, and which ops a
process serves.

The handlers live by op family (``handlers.py`` the model-level ops,
``tensors.py`` the tensor and state ops) and answer or submit their own
jobs; the generations (``generate.py``) are readers that return a typed
``Generation``, which the service builds into a job. ``join`` refuses an op
defined twice, across both kinds, so no family can silently shadow another.

Which ops a process serves depends on where it sits in a chain: a stage past
the first serves the head's requests down the chain, the head everything
but ``forward_frame``; a draining worker only what moves or releases the
sessions it holds (``DRAIN_OPS``). ``allowed`` / ``refuse`` say so, and the
service binds a refusal in place of a handler it must not run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from edge import Request
from faults import Unsupported

from ..chain.setup import StagePlan
from .app import Handler
from .generate import GENERATIONS
from .handlers import HANDLERS
from .tensors import TENSOR_HANDLERS


def join(*tables: Mapping[str, Any]) -> dict[str, Any]:
    """One table out of several; an op in two of them is a programming error."""
    out: dict[str, Any] = {}
    for table in tables:
        twice = sorted(set(out) & set(table))
        if twice:
            raise ValueError(f"ops defined twice: {twice}")
        out.update(table)
    return out


OPS: dict[str, Handler] = join(HANDLERS, TENSOR_HANDLERS)
join(OPS, GENERATIONS)  # a generation op is no other family's too

# Ops a draining worker still serves (besides ping/info/stats/cancel): they
# move or release sessions it holds, so a gateway can take them elsewhere.
# ``generate`` only with ``resume`` (a stream whose move failed goes on here):
# its reader refuses the rest with ``shutting_down``.
DRAIN_OPS = frozenset({"export_state", "drop", "suspend", "handoff", "generate"})

# Ops a stage that is not the first serves (its peer is the previous stage).
DOWNSTREAM_OPS = frozenset(
    {
        "export_state",
        "import_state",
        "signal",
        "signal_window",
        "ping",
        "info",
        "stats",
        "forward_frame",
        "trim",
        "align",
        "drop",
        "cancel",
        "tokenize",
        "detokenize",
    }
)


def allowed(op: str, stage: StagePlan | None) -> bool:
    """Whether a whole-model worker or this stage serves ``op``.

    The head of a chain serves every op a whole model does: signal and
    signal_window are asked of the last stage (where the logits are), verify
    and speculative rows are sampled there (``runtime.steps.RowRule``),
    export_state / import_state gather every stage's cells.
    """
    if stage is None or stage.first:
        return op != "forward_frame"
    return op in DOWNSTREAM_OPS


def refuse(op: str, stage: StagePlan | None) -> Handler:
    """The handler bound for an op this process must not serve: ``unsupported``
    saying where to send it."""

    def handler(app: Any, req: Request) -> dict[str, Any] | None:
        if stage is None or stage.first:
            where = "a whole-model worker" if stage is None else "the head of a pipeline"
            raise Unsupported(f"{op} is not served by {where}")
        raise Unsupported(
            f"{op} is not served by a pipeline stage holding layers "
            f"{stage.layers[0]}:{stage.layers[1]}; send it to stage 0"
        )

    return handler
