"""SIGTERM and SIGINT start the graceful drain, the same in every process.

The LLM worker, stage workers, the speech worker and the gateway all stop the
same way (``EdgeServer.drain``: refuse new work, finish accepted work up to
the timeout, cancel the rest, return from the loop; a second signal cancels
at once). Only what ``drain`` means differs, so each process hands its own.

Two guards make a stop that hangs explain itself instead of waiting for a
SIGKILL that leaves no trace: SIGUSR1 dumps every thread's stack to stderr
(``faulthandler``: it works even while the main thread is stuck in C code,
so ``kill -USR1 PID`` answers "where is it?"), and ``exit_watchdog`` bounds
the clean-up after the loop: past ``EXIT_WATCHDOG_S`` the stacks are dumped
and the process exits with status 1.
"""

from __future__ import annotations

import faulthandler
import signal
from collections.abc import Callable
from types import FrameType

# Closing sockets, the metrics server, the model and the park's files takes
# well under a second; a clean-up still running after this is stuck.
EXIT_WATCHDOG_S = 20.0


def drain_on_signals(drain: Callable[[float], None], timeout_s: float) -> None:
    """Install the handlers: SIGTERM and SIGINT call ``drain(timeout_s)``;
    SIGUSR1 dumps every thread's stack to stderr.

    The handler only sets a deadline and never logs: Python runs it on the
    main thread between two bytecodes, possibly while that thread holds the
    log stream's lock (structlog's ``PrintLogger`` takes a plain,
    non-reentrant lock per file), and logging from it then waits on itself
    forever. The loop logs ``drain_started`` after its pass instead."""

    def _stop(_signum: int, _frame: FrameType | None) -> None:
        drain(timeout_s)

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def exit_watchdog(seconds: float = EXIT_WATCHDOG_S) -> None:
    """The loop has ended: if clean-up and interpreter exit take longer than
    ``seconds``, dump every thread's stack to stderr and exit with status 1
    (a process told to stop stops, and its log says where it hung)."""
    faulthandler.dump_traceback_later(seconds, exit=True)
