"""Runs a snippet under one kernel rule in a child process (test_tiled_dot.py,
test_fa_rows.py): ggml reads its switches once per process, so comparing
two rules takes a process each. The snippet gets the rule as JSON in
``sys.argv[1]`` and prints one JSON line last; ``{root}`` and ``{readme}``
in it are filled in (other braces doubled, as for ``str.format``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from worker.engine import kernels

ROOT = Path(__file__).resolve().parent.parent


def run(snippet: str, rule: kernels.KernelRule) -> dict[str, Any]:
    """The snippet's last printed line, parsed; the child must succeed."""
    code = snippet.format(root=str(ROOT), readme=str(ROOT / "README.md"))
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(asdict(rule))],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out
