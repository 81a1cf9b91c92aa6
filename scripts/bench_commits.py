"""Two commits of skiff, paired: does a change (say, a restructuring) keep speed?

Checks both commits out as git worktrees under a temporary directory and runs,
round by round and alternating which goes first, each commit's own
``scripts/bench_serving.py`` (skiff and the raw engine at one concurrency,
aggregate tok/s) and ``scripts/bench_ping.py`` (ipc ping p50 beside a bare
echo). Each commit's scripts import that commit's code (its worktree is first
on the path and the working directory of every process it starts). Prints,
per round and as medians, skiff tok/s, skiff/raw, ping p50 and skiff/echo for
both, and new/old for each: the same ratios within noise means no cost.
Run it on an otherwise idle machine.

    .venv/bin/python scripts/bench_commits.py OLD NEW [--rounds 3] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _machine import cpu_flags

ROOT = Path(__file__).resolve().parent.parent


def _run(tree: Path, args: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True, timeout=3600
    )
    if out.returncode != 0:
        raise RuntimeError(
            f"{args[0]} in {tree.name} failed: {out.stdout[-400:]}{out.stderr[-800:]}"
        )
    return out.stdout


def serving(tree: Path, concurrency: int, k: int) -> dict[str, float]:
    path = tree / "serving.json"
    _run(
        tree,
        [
            "scripts/bench_serving.py",
            "--concurrency",
            str(concurrency),
            "--k",
            str(k),
            "--skip",
            "llama_cpp.server",
            "--json",
            str(path),
        ],
    )
    systems = json.loads(path.read_text())["systems"]
    skiff = systems["skiff"][str(concurrency)]["tok_s"]
    raw = systems["raw"][str(concurrency)]["tok_s"]
    return {"skiff_tok_s": skiff, "skiff/raw": skiff / raw}


def ping(tree: Path, n: int) -> dict[str, float]:
    text = _run(tree, ["scripts/bench_ping.py", "--n", str(n)])
    rows = dict(re.findall(r"^(echo|skiff)\s+([0-9.]+)", text, re.M))
    skiff, echo = float(rows["skiff"]), float(rows["echo"])
    return {"ping_p50_us": skiff, "skiff/echo": skiff / echo}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--k", type=int, default=4, help="requests per concurrent user")
    ap.add_argument("--pings", type=int, default=5000)
    args = ap.parse_args()
    flags = cpu_flags()
    print(f"cpu flags: {flags}")
    with tempfile.TemporaryDirectory() as tmp:
        trees: dict[str, Path] = {}
        for label, rev in (("old", args.old), ("new", args.new)):
            tree = Path(tmp) / label
            subprocess.run(
                ["git", "worktree", "add", "--detach", "-q", str(tree), rev], cwd=ROOT, check=True
            )
            trees[label] = tree
        results: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
        try:
            for r in range(args.rounds):
                order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
                for label in order:
                    row = {
                        **serving(trees[label], args.concurrency, args.k),
                        **ping(trees[label], args.pings),
                    }
                    results[label].append(row)
                    shown = "  ".join(f"{k} {v:.3g}" for k, v in row.items())
                    print(f"round {r + 1} {label}: {shown}", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)
    print(f"\nmedians over {args.rounds} rounds (old = {args.old}, new = {args.new}):")
    keys = list(results["old"][0])
    print(f"{'figure':<14}{'old':>10}{'new':>10}{'new/old':>10}")
    summary: dict[str, Any] = {}
    for key in keys:
        old = statistics.median(r[key] for r in results["old"])
        new = statistics.median(r[key] for r in results["new"])
        summary[key] = {"old": old, "new": new, "new/old": new / old}
        print(f"{key:<14}{old:>10.3g}{new:>10.3g}{new / old:>10.3f}")


if __name__ == "__main__":
    main()
