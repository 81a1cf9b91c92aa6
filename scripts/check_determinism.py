"""Do concurrent greedy streams give one answer per prompt, whatever the load?

Starts one worker (8 lanes) and a 2-stage chain (layers 0:9 -> 9:18) on
ipc sockets in a temporary directory, then, on each, runs ``--rounds`` times
8 distinct and 8 identical greedy ``generate`` streams started together,
and each prompt once alone. It prints, per prompt, how many different token
sequences it produced across every run (rounds, alone, worker and chain):
1 everywhere is the promise (a row is computed as if alone at any batch
size). ``--kernels upstream`` runs the same against llama.cpp's own paths
for contrast (there, tokens depend on the batch, as in llama-server).

    .venv/bin/python scripts/check_determinism.py [--rounds 5] [--kernels exact]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from _bench_stages_measure import start  # noqa: E402  (a worker process on an ipc socket)

from protocol import Client  # noqa: E402

PROMPTS = [
    "The history of the lighthouse begins",
    "A recipe for bread needs flour, water and",
    "In 1969 the first people to walk on the Moon",
    "The three laws of thermodynamics state that",
    "def fibonacci(n):\n    ",
    "Dear neighbour, about the fence between our gardens,",
    "The capital of Australia is not Sydney but",
    "Photosynthesis turns sunlight into",
]


def together(endpoint: str, prompts: list[str], max_tokens: int) -> list[tuple[int, ...]]:
    """Greedy generations of ``prompts`` started in the same instant."""
    args: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": True, "stream": False}
    with Client(endpoint, timeout_ms=600_000) as c:
        ids = [c.send("generate", None, {**args, "prompt": p}) for p in prompts]
        return [tuple(c.recv(i).raise_for_error().result["tokens"]) for i in ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--kernels", default="exact", choices=("exact", "upstream"))
    args = ap.parse_args()
    common = ("--lanes", "8", "--ctx", "16384", "--kernels", args.kernels, "--prefix-cache", "0")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        procs = []
        try:
            p, worker = start(tmp, "worker", *common)
            procs.append(p)
            p, s1 = start(tmp, "s1", *common, "--layers", "9:18")
            procs.append(p)
            p, s0 = start(tmp, "s0", *common, "--layers", "0:9", "--next", s1)
            procs.append(p)
            with Client(worker) as c:
                cpu = c.info()["cpu"]
            seen: dict[str, dict[tuple[int, ...], list[str]]] = {p: {} for p in PROMPTS}

            def record(prompt: str, tokens: tuple[int, ...], where: str) -> None:
                seen[prompt].setdefault(tokens, []).append(where)

            for target, endpoint in (("worker", worker), ("chain", s0)):
                for prompt in PROMPTS:
                    (tokens,) = together(endpoint, [prompt], args.max_tokens)
                    record(prompt, tokens, f"{target}:alone")
                for r in range(args.rounds):
                    for prompt, tokens in zip(
                        PROMPTS, together(endpoint, PROMPTS, args.max_tokens), strict=True
                    ):
                        record(prompt, tokens, f"{target}:distinct{r}")
                    same = together(endpoint, [PROMPTS[0]] * 8, args.max_tokens)
                    for i, tokens in enumerate(same):
                        record(PROMPTS[0], tokens, f"{target}:identical{r}.{i}")
        finally:
            for p in procs:
                p.terminate()
                p.wait(30)
    print(f"kernels {args.kernels}: {cpu['level']} ({cpu['variant']}), rule {cpu['rule']}")
    runs = 2 * (1 + args.rounds)
    print(f"{runs} runs per prompt (alone + {args.rounds} rounds of 8 distinct, worker and chain);")
    print(f"prompt 0 also {2 * 8 * args.rounds} times as 8 identical streams together")
    worst = 1
    for i, prompt in enumerate(PROMPTS):
        variants = seen[prompt]
        worst = max(worst, len(variants))
        detail = (
            ""
            if len(variants) == 1
            else "  " + " | ".join(f"{len(w)} runs" for w in variants.values())
        )
        print(f"  prompt {i}: {len(variants)} token sequence(s){detail}")
    print("ONE SET OF TOKENS PER PROMPT" if worst == 1 else f"NOT DETERMINISTIC (up to {worst})")


if __name__ == "__main__":
    main()
