"""The malloc tunable every skiff process restarts itself with (edge/memory.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from edge.memory import TUNABLE

CODE = (
    "from edge.memory import reexec_with_tunables; "
    "reexec_with_tunables({'SKIFF_TEST_EXTRA': 'x'}); "
    "import os; print(os.environ.get('GLIBC_TUNABLES', ''), os.environ.get('SKIFF_TEST_EXTRA'))"
)


def _run(env: dict[str, str]) -> str:
    out = subprocess.run(
        [sys.executable, "-c", CODE], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


@pytest.mark.skipif(sys.platform != "linux", reason="glibc tunables are Linux-only")
def test_process_restarts_once_with_the_tunable() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "SKIFF_NO_REEXEC")}
    assert _run(env) == f"{TUNABLE} x"
    # an operator's own tunables and settings are kept
    assert _run({**env, "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == (
        f"glibc.malloc.arena_max=2:{TUNABLE} x"
    )
    assert _run({**env, "SKIFF_TEST_EXTRA": "mine"}) == f"{TUNABLE} mine"
    # and the opt-out is honoured
    assert _run({**env, "SKIFF_NO_REEXEC": "1"}) == "None"  # (stdout is stripped)
