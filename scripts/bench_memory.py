#!/usr/bin/env python3
"""Resident memory per stage: one worker, a 2-stage and a 3-stage chain.

    .venv/bin/python scripts/bench_memory.py [--tokens 1000] [--lanes 4 --ctx 8192]

Why: a chain only pays for itself in memory if each stage holds its share of
the model (issue 23). Each configuration runs as worker processes on ipc
sockets in a temp dir (as ``scripts/bench_stages.py`` starts them), one
configuration at a time so they do not share the two cores; each stage's
resident set is read after load, after ``--tokens`` tokens were prefilled
into one session through stage 0, and after one ``decode`` step of that
session (its first sampled token: the output head is computed only then,
so a plain prefill leaves the last stage's head unread).

Printed per stage: RSS (``/proc/PID/status`` VmRSS, the figure ``stats``
reports as ``process.rss_bytes``), and of it the pages of the model file
mapped in (llama.cpp mmaps the GGUF: a weight never read costs no resident
memory) and anonymous memory (KV cache, compute buffers, Python, vocab).
Then the sum over a chain's stages / one worker and the middle stage of
the 3-way split / one worker (the issue's targets: <= 1.1 and <= 0.45), at
each of the three points.
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from protocol import Client  # noqa: E402

MIB = 1 << 20
TEXT = " ".join(f"Note {i}: the tide reached marker {i * 11 % 37} at noon." for i in range(400))


def configs(n_layer: int) -> dict[str, list[str]]:
    """One worker, halves, thirds (Gemma 3 270M's 18 layers: 0:9|9:18, 0:6|6:12|12:18)."""

    def split(parts: int) -> list[str]:
        cuts = [round(i * n_layer / parts) for i in range(parts + 1)]
        return [f"{lo}:{hi}" for lo, hi in itertools.pairwise(cuts)]

    return {"one worker": split(1), "2 stages": split(2), "3 stages": split(3)}


def layer_count(model: str) -> int:
    from worker.models import resolve_model
    from worker.slice.ggufmeta import read_metadata

    path = resolve_model(model)
    arch = str(read_metadata(path, ["general.architecture"])["general.architecture"])
    return int(str(read_metadata(path, [f"{arch}.block_count"])[f"{arch}.block_count"]))


@dataclass
class Memory:
    rss: int  # bytes resident
    model: int  # of which pages of a .gguf mapping
    anon: int  # of which anonymous


def memory(pid: int) -> Memory:
    """RSS of ``pid`` split by /proc/PID/smaps: .gguf mappings, anonymous."""
    rss = model = anon = 0
    path = ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if not head.endswith(":"):  # a mapping's header line: range perms ... path
                parts = line.split(maxsplit=5)
                path = parts[5].strip() if len(parts) > 5 else ""
            elif head == "Rss:":
                kb = int(line.split()[1]) * 1024
                rss += kb
                if path.endswith(".gguf"):
                    model += kb
            elif head == "Anonymous:":
                anon += int(line.split()[1]) * 1024
    return Memory(rss, model, anon)


def start(tmp: Path, name: str, args: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    endpoint = f"ipc://{tmp}/{name}.sock"
    log = (tmp / f"{name}.log").open("wb")
    cmd = [sys.executable, "-m", "worker.cli", "--bind", endpoint, "--threads", "2", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    with Client(endpoint) as c:
        c.wait_ready(300, alive=lambda: proc.poll() is None)
    return proc, endpoint


POINTS = ("load", "prefill", "sampled")


def run_config(
    tmp: Path, label: str, ranges: list[str], common: list[str], n_tokens: int
) -> list[tuple[str, list[Memory]]]:
    """Start the stages (last first: each names the next), measure, stop."""
    procs: list[tuple[str, subprocess.Popen[bytes], str]] = []
    try:
        next_ep = ""
        for i, layers in reversed(list(enumerate(ranges))):
            args = list(common)
            if len(ranges) > 1:
                args += ["--layers", layers] + (["--next", next_ep] if next_ep else [])
            proc, next_ep = start(tmp, f"{label.replace(' ', '_')}-{i}", args)
            procs.insert(0, (layers, proc, next_ep))
        seen = [[memory(p.pid)] for _, p, _ in procs]
        with Client(procs[0][2], timeout_ms=600_000) as head:
            tokens = head.tokenize(TEXT)[: n_tokens + 1]
            if len(tokens) <= n_tokens:
                raise SystemExit(f"the text has only {len(tokens)} tokens")
            head.prefill("bench-memory", tokens[:n_tokens])
            for mine, (_, p, _) in zip(seen, procs, strict=True):
                mine.append(memory(p.pid))
            head.decode("bench-memory", tokens[n_tokens])
            for mine, (_, p, _) in zip(seen, procs, strict=True):
                mine.append(memory(p.pid))
            head.drop("bench-memory")
        return [(layers, mine) for (layers, _, _), mine in zip(procs, seen, strict=True)]
    finally:
        for _, p, _ in procs:
            p.terminate()
        for _, p, _ in procs:
            p.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1000, help="tokens prefilled per chain")
    ap.add_argument("--lanes", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--model", default="default")
    args = ap.parse_args()
    common = ["--lanes", str(args.lanes), "--ctx", str(args.ctx), "--model", args.model]
    results: dict[str, list[tuple[str, list[Memory]]]] = {}
    with tempfile.TemporaryDirectory(prefix="skiff-memory-") as tmp_s:
        for label, ranges in configs(layer_count(args.model)).items():
            results[label] = run_config(Path(tmp_s), label, ranges, common, args.tokens)
    one = results["one worker"][0][1]
    print(
        f"{args.model}: RSS in MiB per stage (model = .gguf pages mapped in, "
        "anon = anonymous memory); "
        f"--lanes {args.lanes} --ctx {args.ctx}; at load, after a {args.tokens}-token "
        "prefill, after its first sampled token"
    )
    head = " ".join(f"{p + ' rss':>12} {'model':>5} {'anon':>5}" for p in POINTS)
    print(f"{'config':<11} {'layers':<6} {head} {'x one':>6}")
    for label, rows in results.items():
        for layers, mine in rows:
            cells = " ".join(
                f"{m.rss / MIB:12.0f} {m.model / MIB:5.0f} {m.anon / MIB:5.0f}" for m in mine
            )
            print(f"{label:<11} {layers:<6} {cells} {mine[-1].rss / one[-1].rss:6.2f}")
    for label in ("2 stages", "3 stages"):
        ratios = [
            sum(mine[i].rss for _, mine in results[label]) / one[i].rss for i in range(len(POINTS))
        ]
        text = ", ".join(f"{r:.2f} {p}" for r, p in zip(ratios, POINTS, strict=True))
        print(f"{label}: sum over stages / one worker: {text} (target <= 1.1)")
    layers, mid = results["3 stages"][1]
    text = ", ".join(f"{m.rss / o.rss:.2f} {p}" for m, o, p in zip(mid, one, POINTS, strict=True))
    print(f"3 stages: middle stage ({layers}) / one worker: {text} (target <= 0.45)")


if __name__ == "__main__":
    main()
