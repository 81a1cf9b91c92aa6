#!/usr/bin/env python3
"""Keep CPU cores busy, alone or around a command.

Why: the test suite must not depend on an idle machine. A test that sleeps a
guessed time and then asserts, or gives a reply 2 s, passes on a quiet
laptop and fails on a CI runner shared with other jobs. Tests wait for a
condition instead (``tests/conftest.py``, ``wait_until``), with bounds that
only a hang reaches. This script makes the busy machine on demand, so that
claim can be checked rather than hoped for: one child process per core
spins in a busy loop (pure-Python arithmetic, or numpy matrix products with
``--work numpy``) at normal priority, so every test process competes for
the CPU with them.

    scripts/burn_cpu.py                              # every core, for an hour or until killed
    scripts/burn_cpu.py --cores 1 --seconds 60       # one core for a minute
    scripts/burn_cpu.py -- scripts/test tests/test_gateway_failover.py -x
                                                     # a command with the burners alive;
                                                     # exits with the command's code

Burners always end: after ``--seconds``, when this process goes away (they
watch its pid), or when it is stopped (SIGTERM / Ctrl-C). Around a command
they are stopped as soon as the command ends; SIGTERM is passed on to it.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from types import FrameType

WORK_KINDS = ("python", "numpy")
STOP_GRACE_S = 5.0  # a burner stops within one work unit (milliseconds); then SIGKILL


def _python_work() -> Callable[[], None]:
    def unit() -> None:
        x = 0
        for i in range(100_000):  # a few milliseconds of interpreter work
            x = (x * 31 + i) % 1_000_003

    return unit


def _numpy_work() -> Callable[[], None]:
    # One BLAS thread per burner: the burners are the parallelism.
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((192, 192))
    b = rng.standard_normal((192, 192))

    def unit() -> None:
        for _ in range(8):  # a few milliseconds of matrix products
            np.matmul(a, b)

    return unit


def _burn(work: str, until: float, parent: int, core: int | None) -> None:
    """A burner's life: busy work units until the deadline or the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if core is not None:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {core})
    unit = _numpy_work() if work == "numpy" else _python_work()
    while time.monotonic() < until and os.getppid() == parent:
        unit()


def start_burners(n: int, work: str, seconds: float) -> list[BaseProcess]:
    """``n`` burner processes, each pinned to one of the cores we may use."""
    cores = sorted(os.sched_getaffinity(0))
    until = time.monotonic() + seconds  # CLOCK_MONOTONIC: the same clock in the children
    ctx = multiprocessing.get_context("fork")
    burners: list[BaseProcess] = []
    for i in range(n):
        core = cores[i % len(cores)] if n <= len(cores) else None
        p = ctx.Process(
            target=_burn, args=(work, until, os.getpid(), core), name=f"burn-{i}", daemon=True
        )
        p.start()
        burners.append(p)
    return burners


def stop_burners(burners: Sequence[BaseProcess]) -> None:
    for p in burners:
        if p.is_alive():
            p.terminate()
    for p in burners:
        p.join(STOP_GRACE_S)
        if p.is_alive():
            p.kill()
            p.join()


def _exit_code(returncode: int) -> int:
    """A command killed by signal N exits 128 + N, as a shell reports it."""
    return returncode if returncode >= 0 else 128 - returncode


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    args = list(argv)
    command: list[str] = []
    if "--" in args:
        cut = args.index("--")
        args, command = args[:cut], args[cut + 1 :]
    p = argparse.ArgumentParser(
        description="Keep CPU cores busy (alone, or around a command given after --).",
        usage="%(prog)s [--cores N] [--seconds S] [--work python|numpy] [-- COMMAND ...]",
    )
    every = len(os.sched_getaffinity(0))
    p.add_argument(
        "--cores", type=int, default=every, help=f"burner processes (default: {every}, all)"
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=3600.0,
        help="burners stop by themselves after this long (default 3600)",
    )
    p.add_argument("--work", choices=WORK_KINDS, default="python", help="busy loop kind")
    ns = p.parse_args(args)
    if ns.cores < 1:
        p.error("--cores must be at least 1")
    if ns.seconds <= 0:
        p.error("--seconds must be positive")
    if "--" in argv and not command:
        p.error("no command after --")
    return ns, command


def main(argv: Sequence[str] | None = None) -> int:
    ns, command = parse(sys.argv[1:] if argv is None else argv)
    burners = start_burners(ns.cores, ns.work, ns.seconds)
    print(
        f"burn_cpu: {ns.cores} {ns.work} burner(s) for at most {ns.seconds:g} s",
        file=sys.stderr,
        flush=True,
    )
    child: subprocess.Popen[bytes] | None = None

    def on_term(signum: int, _frame: FrameType | None) -> None:
        if child is not None and child.poll() is None:
            child.send_signal(signum)  # the command decides; we stop when it ends
            return
        raise SystemExit(0)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        if not command:
            for p in burners:  # each ends at the deadline (or on SIGTERM / Ctrl-C)
                p.join()
            return 0
        try:
            child = subprocess.Popen(command)
        except OSError as exc:
            print(f"burn_cpu: cannot run {command[0]!r}: {exc}", file=sys.stderr)
            return 127
        while True:
            try:
                return _exit_code(child.wait())
            except KeyboardInterrupt:  # Ctrl-C reached the command too: wait for its end
                continue
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop_burners(burners)


if __name__ == "__main__":
    sys.exit(main())
