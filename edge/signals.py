"""SIGTERM and SIGINT start the graceful drain, the same in every process.

The LLM worker, stage workers, the speech worker and the gateway all stop the
same way (``EdgeServer.drain``: refuse new work, finish accepted work up to
the timeout, cancel the rest, return from the loop; a second signal cancels
at once). Only what ``drain`` means differs, so each process hands its own.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType
from typing import Any


def drain_on_signals(drain: Callable[[float], None], timeout_s: float, log: Any) -> None:
    """Install the handlers: each signal is logged, then ``drain(timeout_s)``."""

    def _stop(signum: int, _frame: FrameType | None) -> None:
        log.info("signal", signal=signal.Signals(signum).name)
        drain(timeout_s)

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
