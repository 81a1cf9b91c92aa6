"""edge/signals.py: a stop that hangs explains itself and still ends."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT, WAIT_S

# A process whose clean-up hangs after the loop: the watchdog must end it.
_HANGS_AFTER_THE_LOOP = """
import time
from edge.signals import exit_watchdog
def closing_forever():
    time.sleep(600)
exit_watchdog(0.5)
closing_forever()
"""


def _python(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter at the repository root."""
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S
    )


def test_exit_watchdog_ends_a_stuck_clean_up_with_its_stack() -> None:
    out = _python(_HANGS_AFTER_THE_LOOP)
    assert out.returncode == 1, out
    assert "closing_forever" in out.stderr  # where it hung


def test_sigusr1_dumps_stacks_and_the_process_goes_on() -> None:
    code = """
import os, signal
from edge.signals import drain_on_signals
drained = []
drain_on_signals(drained.append, 1.0)
os.kill(os.getpid(), signal.SIGUSR1)   # a dump, not a drain, not an exit
os.kill(os.getpid(), signal.SIGTERM)   # the drain, with the configured timeout
print("alive", drained)
"""
    out = _python(code)
    assert out.returncode == 0, out
    assert "alive [1.0]" in out.stdout
    assert "Current thread" in out.stderr or "Thread 0x" in out.stderr, out.stderr


# SIGTERM arriving while the main thread is inside a log write (it holds the
# stream's lock): a handler that logged would wait on that lock forever.
_SIGNAL_DURING_A_LOG_WRITE = """
import os, signal, sys
import structlog
from structlog._output import _get_lock_for_file  # the lock PrintLogger.msg holds
from edge import logs
from edge.signals import drain_on_signals
logs.configure()
drained = []
drain_on_signals(drained.append, 2.5)
with _get_lock_for_file(sys.stderr):  # as if in the middle of a log line
    os.kill(os.getpid(), signal.SIGTERM)
    sum(range(1000))  # the handler runs here, between two bytecodes
structlog.get_logger().info("after")
print("drained", drained)
"""


def test_a_signal_during_a_log_write_does_not_deadlock() -> None:
    out = _python(_SIGNAL_DURING_A_LOG_WRITE)
    assert out.returncode == 0, out
    assert "drained [2.5]" in out.stdout
