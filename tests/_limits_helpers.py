"""What the limits tests share (test_limits_units, test_limits_socket): the
environment put back after a ``SKIFF_*`` twin was set, and a tensor frame of
given arrays with its buffers.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from protocol import frames


def _restore(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _frame(*arrays: np.ndarray) -> tuple[dict[str, Any], list[Any]]:
    buffers: list[Any] = []
    parts = [(f"p{i}", a, -1) for i, a in enumerate(arrays)]
    return frames.attach(frames.make_frame(parts), buffers), buffers
