"""The tree stays ruff- and mypy-clean (the project's code rules)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def test_ruff_clean() -> None:
    out = _run(
        "ruff",
        "check",
        "faults",
        "protocol",
        "edge",
        "worker",
        "speech",
        "loadtest",
        "gateway",
        "tests",
        "scripts",
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_clean() -> None:
    out = _run("mypy")
    assert out.returncode == 0, out.stdout + out.stderr


def test_llama_cpp_is_imported_only_by_the_engine() -> None:
    offenders = [
        str(p.relative_to(ROOT))
        for folder in ("faults", "protocol", "edge", "worker", "loadtest", "gateway")
        for p in (ROOT / folder).rglob("*.py")
        if "engine" not in p.relative_to(ROOT).parts[:2]
        and any(
            line.lstrip().startswith(("import llama_cpp", "from llama_cpp"))
            for line in p.read_text().splitlines()
        )
    ]
    assert offenders == []
