"""The worker's one op table: every op to exactly one handler.

The handlers live by op family (``handlers.py`` the model-level ops,
``generate.py`` the generations, ``tensors.py`` the tensor and state
ops); this joins them and refuses an op defined twice, so no family can
silently shadow another's handler.
"""

from __future__ import annotations

from collections.abc import Mapping

from .app import Handler
from .generate import GENERATE_HANDLERS
from .handlers import HANDLERS
from .tensors import TENSOR_HANDLERS


def join(*tables: Mapping[str, Handler]) -> dict[str, Handler]:
    """One table out of several; an op in two of them is a programming error."""
    out: dict[str, Handler] = {}
    for table in tables:
        twice = sorted(set(out) & set(table))
        if twice:
            raise ValueError(f"ops defined twice: {twice}")
        out.update(table)
    return out


OPS: dict[str, Handler] = join(HANDLERS, GENERATE_HANDLERS, TENSOR_HANDLERS)
