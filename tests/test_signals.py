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


def test_exit_watchdog_ends_a_stuck_clean_up_with_its_stack() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _HANGS_AFTER_THE_LOOP],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert out.returncode == 1, out
    assert "closing_forever" in out.stderr  # where it hung


def test_sigusr1_dumps_stacks_and_the_process_goes_on() -> None:
    code = """
import os, signal, structlog
from edge.signals import drain_on_signals
drained = []
drain_on_signals(drained.append, 1.0, structlog.get_logger())
os.kill(os.getpid(), signal.SIGUSR1)   # a dump, not a drain, not an exit
os.kill(os.getpid(), signal.SIGTERM)   # the drain, with the configured timeout
print("alive", drained)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S
    )
    assert out.returncode == 0, out
    assert "alive [1.0]" in out.stdout
    assert "Current thread" in out.stderr or "Thread 0x" in out.stderr, out.stderr
