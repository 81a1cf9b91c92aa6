"""``scripts/bench_stages.py --pinned``: one core per stage against one core.

Why a module of its own: the "two hosts vs one host" comparison on one
machine (a worker on core 0 against a 2-stage chain on cores 0 and 1,
interleaved rounds at c=1, 4, 8 and a staggered load, where each process's
time went) and its ceiling (two independent pinned workers) are a
benchmark of their own beside the default chain comparison.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

import numpy as np
from _bench_stages_measure import (
    busy_table,
    concurrently,
    profiles,
    start,
    step_ms,
    streamed,
    wire_bytes_per_token,
)

from protocol import Client
from worker.slice.balance import best_cuts, measure, report

Runs = dict[str, list[dict[str, float]]]  # who ("one", "chain") -> each round's figures


def pinned(args: argparse.Namespace) -> None:
    """One worker on core 0 vs a 2-stage chain on cores 0 and 1."""
    common = ("--lanes", "8", "--ctx", "8192", "--model", args.model)
    with tempfile.TemporaryDirectory(prefix="skiff-stages-") as tmp_s:
        tmp = Path(tmp_s)
        procs: list[subprocess.Popen[bytes]] = []
        try:
            full, full_ep = start(tmp, "full", *common, "--cpus", "0", threads=1)
            procs.append(full)
            with Client(full_ep) as c:
                model = c.info()["model"]
            n_embd, n_layer = int(model["n_embd"]), int(model["n_layer"])
            if args.cut:
                cut = str(args.cut)
            else:  # from measured costs: the head may outweigh every layer (skiff-slice --balance)
                costs = measure(str(model["path"]), rows=max(1, 8 // args.groups), threads=1)
                print(report(costs, 2))
                cut = str(best_cuts(costs, 2, costs.loadable).cuts[1])
            s1, s1_ep = start(
                tmp, "s1", *common, "--layers", f"{cut}:{n_layer}", "--cpus", "1", threads=1
            )
            procs.append(s1)
            s0, s0_ep = start(
                tmp, "s0", *common, "--layers", f"0:{cut}", "--next", s1_ep, "--cpus", "0",
                "--pipeline-groups", str(args.groups), threads=1,
            )  # fmt: skip
            procs.append(s0)
            ms_full, tok_full, log_full = step_ms(full_ep)
            ms_chain, tok_chain, log_chain = step_ms(s0_ep)
            diff = float(np.max(np.abs(log_full - log_chain))) if tok_full == tok_chain else None
            print(
                f"pinned, model {Path(model['path']).name} ({n_layer} layers): one worker "
                f"(--threads 1 --cpus 0) vs 2-stage chain 0:{cut} (cpu 0) -> {cut}:{n_layer} "
                f"(cpu 1), --pipeline-groups {args.groups}, {args.tokens} new tokens, "
                f"{args.rounds} interleaved rounds"
            )
            print(
                f"  decode step c=1: chain {ms_chain:.1f} ms | one worker {ms_full:.1f} ms | "
                f"per-hop latency {ms_chain - ms_full:.2f} ms "
                f"({(ms_chain - ms_full) / ms_full:.1%} of a step)"
            )
            print(
                f"  greedy tokens identical: {tok_full == tok_chain} | max |logit diff| {diff} "
                f"over {len(log_full)} steps | wire bytes per token "
                f"{wire_bytes_per_token(n_embd, 'f32')}"
            )
            loads = [(f"c={c}", c, 0, 1) for c in (1, 4, 8)]
            loads.append((f"staggered 8 x {args.gap_ms} ms", 8, args.gap_ms, 4))
            seen: dict[str, Runs] = {}
            eps = {"one": full_ep, "stage 0": s0_ep, "stage 1": s1_ep}
            busy: dict[str, list[str]] = {}
            for r in range(args.rounds):
                for name, conc, gap, rep in loads:
                    order = [("one", full_ep), ("chain", s0_ep)]
                    for who, ep in order if r % 2 == 0 else order[::-1]:
                        before = profiles(eps)
                        got = streamed(ep, conc, args.tokens, gap, rep)
                        seen.setdefault(name, {}).setdefault(who, []).append(got)
                        after = profiles(eps)
                        mine = ["one"] if who == "one" else ["stage 0", "stage 1"]
                        busy[f"{name} {who}"] = busy_table(
                            {k: before[k] for k in mine}, {k: after[k] for k in mine}
                        )
            print(
                f"  {'load':<24}{'one tok/s':>10}{'chain':>9}{'ratio':>7}{'TTFT one':>10}"
                f"{'chain':>8}{'ITL p50 one':>12}{'chain':>7}{'p99 one':>9}{'chain':>7}"
            )
            for name, runs in seen.items():

                def med(
                    who: str, key: str, runs: dict[str, list[dict[str, float]]] = runs
                ) -> float:
                    return statistics.median(x[key] for x in runs[who])

                pairs = zip(runs["one"], runs["chain"], strict=True)
                ratios = [c["tok_s"] / o["tok_s"] for o, c in pairs]
                print(
                    f"  {name:<24}{med('one', 'tok_s'):>10.1f}{med('chain', 'tok_s'):>9.1f}"
                    f"{statistics.median(ratios):>7.2f}{med('one', 'ttft_ms'):>10.0f}"
                    f"{med('chain', 'ttft_ms'):>8.0f}{med('one', 'itl_p50_ms'):>12.1f}"
                    f"{med('chain', 'itl_p50_ms'):>7.1f}{med('one', 'itl_p99_ms'):>9.1f}"
                    f"{med('chain', 'itl_p99_ms'):>7.1f}"
                    f"   (ratios per round: {', '.join(f'{x:.2f}' for x in ratios)})"
                )
            ceiling(tmp, common, full_ep, args, procs)
            print("  where each process's time went (last round; stats.profile):")
            for key, lines in busy.items():
                print(f"  {key}")
                for line in lines:
                    print(line)
        finally:
            for p in procs:
                p.terminate()
                p.wait(10)


def ceiling(
    tmp: Path,
    common: tuple[str, ...],
    full_ep: str,
    args: argparse.Namespace,
    procs: list[subprocess.Popen[bytes]],
) -> None:
    """What two pinned cores give at best: ``c`` streams split over two
    independent workers (no hop, nothing shared but the machine: caches,
    memory, the host's cores) against the ``c`` streams on one worker alone.
    A 2-stage chain splits the same streams' work over the same two cores
    and keeps them busy at most as well, so this ratio bounds what any split
    can reach here."""
    other, other_ep = start(tmp, "other", *common, "--cpus", "1", threads=1)
    procs.append(other)
    for conc in (4, 8):
        alone: list[float] = []
        both: list[float] = []
        for _ in range(args.rounds):
            alone.append(streamed(full_ep, conc, args.tokens)["tok_s"])
            got: dict[str, float] = {}

            def load(i: int, conc: int = conc, got: dict[str, float] = got) -> None:
                got[str(i)] = streamed([full_ep, other_ep][i], conc // 2, args.tokens)["tok_s"]

            concurrently(load, 2)
            both.append(got["0"] + got["1"])
        ratios = [b / a for a, b in zip(alone, both, strict=True)]
        print(
            f"  ceiling c={conc}: one pinned worker alone {statistics.median(alone):.1f} tok/s; "
            f"two independent pinned workers, c={conc // 2} each, at once "
            f"{statistics.median(both):.1f} tok/s together = "
            f"{statistics.median(ratios):.2f}x one alone (the most a 2-stage chain could give "
            f"on these two cores; per round: {', '.join(f'{x:.2f}' for x in ratios)})"
        )
