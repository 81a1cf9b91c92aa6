#!/usr/bin/env python3
"""A 2-stage chain (layers 0:9 -> 9:18) beside one whole-model worker.

    .venv/bin/python scripts/bench_stages.py [--tokens 64] [--frame-dtype f32|f16]
    .venv/bin/python scripts/bench_stages.py --pinned [--rounds 3] [--cut 9] [--groups 2]

``--pinned`` is the "two hosts vs one host" comparison on one machine: one
worker ``--threads 1 --cpus 0`` against stage 0 ``--cpus 0`` + stage 1
``--cpus 1`` (each ``--threads 1``, stage 0 with ``--pipeline-groups``),
interleaved rounds at c=1, 4, 8 and a staggered load: tok/s, TTFT, ITL p50 /
p99, the ratio chain / one worker, and the logits of both in the same run.

Printed, all from one run:
- aggregate tok/s of ``generate`` at concurrency 1 and 8, chain vs one worker,
  and the chain again with pipelining off (``--chain-credit 1``: stage 0
  waits for each forward to come home) beside the default (credit 2);
- a staggered workload (a new prompt every ``--gap-ms`` while others
  decode), where pipelining lets stage 0 prefill one prompt while stage 1
  decodes the others;
- per-hop latency: the extra time a greedy decode step takes through the
  chain, over the one worker's step (one hop: stage 0 -> stage 1 and back);
- bytes per token on the wire between the stages (hidden rows: 4 x n_embd in
  f32, 2 x n_embd in f16, plus the request header);
- with ``--frame-dtype f16``: the largest logit difference from the one
  worker over a 20-token prompt and 16 greedy steps (f32 is exact: 0.0).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from protocol import Client, frames, transport  # noqa: E402
from worker.slice.balance import best_cuts, measure, report  # noqa: E402

PROMPTS = [
    f"Story {i}: once upon a time in a village by the {w}, there lived"
    for i, w in enumerate(["sea", "hill", "river", "wood", "lake", "road", "bay", "field"])
]


def start(
    tmp: Path, name: str, *args: str, threads: int = 2
) -> tuple[subprocess.Popen[bytes], str]:
    endpoint = f"ipc://{tmp}/{name}.sock"
    log = (tmp / f"{name}.log").open("wb")
    cmd = [
        sys.executable, "-m", "worker.cli", "--bind", endpoint, "--threads", str(threads), *args,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    with Client(endpoint) as c:
        c.wait_ready(300, alive=lambda: proc.poll() is None)
    return proc, endpoint


_CALLS = itertools.count()


def concurrently(one: Callable[[int], None], n: int) -> float:
    """Run ``one(0) .. one(n - 1)`` on threads at once; the wall seconds."""
    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def generations(
    endpoint: str, streams: int, max_tokens: int, gap_ms: int = 0, prompt_repeat: int = 1
) -> float:
    """Aggregate tok/s of ``streams`` concurrent generations, started
    ``gap_ms`` apart (0: all at once)."""
    done = [0] * streams

    def one(i: int) -> None:
        time.sleep(i * gap_ms / 1000)
        with Client(endpoint, timeout_ms=300_000) as c:
            r = c.call(
                "generate",
                None,
                {
                    "prompt": PROMPTS[i % len(PROMPTS)] * prompt_repeat,
                    "max_tokens": max_tokens,
                    "stream": False,
                    "ignore_eos": True,
                },
            )
            done[i] = len(r.result["tokens"])

    return sum(done) / concurrently(one, streams)


def throughput(endpoint: str, concurrency: int, max_tokens: int) -> float:
    return generations(endpoint, concurrency, max_tokens)


def staggered(endpoint: str, streams: int, max_tokens: int, gap_ms: int) -> float:
    """A new (longer) prompt every ``gap_ms`` while the others decode."""
    return generations(endpoint, streams, max_tokens, gap_ms, prompt_repeat=4)


def step_ms(endpoint: str, steps: int = 32) -> tuple[float, list[int], np.ndarray]:
    """Median ms of one greedy decode, its tokens, and each step's logits."""
    with Client(endpoint, timeout_ms=300_000) as c:
        tokens = c.tokenize(PROMPTS[0])[:20]
        token = int(c.prefill_sampled("bench", tokens)["token"])
        times, out, rows = [], [token], []
        for _ in range(steps):
            t0 = time.perf_counter()
            reply = c.decode("bench", out[-1], output=["logits"])
            times.append(time.perf_counter() - t0)
            rows.append(np.array(reply.frame.array("logits")[0]))
            out.append(int(reply.result["token"]))
        c.drop("bench")
    return statistics.median(times) * 1e3, out, np.stack(rows)


def wire_bytes_per_token(n_embd: int, dtype: str) -> int:
    """Bytes of a one-row forward_frame request (header + buffer)."""
    rows = np.zeros((1, n_embd), dtype=np.float16 if dtype == "f16" else np.float32)
    buffers: list[object] = []
    header = {
        "v": 1,
        "id": 1,
        "op": "forward_frame",
        "args": {
            "input": frames.attach(
                frames.make_frame([("hidden", rows, 0)], positions=[100]), buffers
            ),
            "steps": [
                {
                    "session": "s",
                    "tokens": [1234],
                    "position": 100,
                    "sample": True,
                    "sampling": None,
                    "output": [],
                    "capture_all": False,
                    "top_logprobs": None,
                }
            ],
        },
    }
    return len(transport.encode(header)) + rows.nbytes


def streamed(
    endpoint: str, streams: int, max_tokens: int, gap_ms: int = 0, prompt_repeat: int = 1
) -> dict[str, float]:
    """Streamed generations: aggregate tok/s, TTFT p50, ITL p50 / p99 (ms)."""
    runs: list[tuple[int, float, list[float]]] = [(0, 0.0, [])] * streams

    def one(i: int) -> None:
        time.sleep(i * gap_ms / 1000)
        args = {
            # a new opening each call: no prefix cache (a whole worker has
            # one, a chain does not) turns a repeated prompt into a free prefill
            "prompt": f"Run {next(_CALLS)}. " + PROMPTS[i % len(PROMPTS)] * prompt_repeat,
            "max_tokens": max_tokens,
            "ignore_eos": True,
        }
        n, ttft, itls, last = 0, 0.0, [], 0.0
        with Client(endpoint, timeout_ms=300_000) as c:
            t0 = time.perf_counter()
            for event in c.generate(args):
                now = time.perf_counter()
                if event.header.get("event") != "token":
                    continue
                n += 1
                if n == 1:
                    ttft = now - t0
                else:
                    itls.append(now - last)
                last = now
        runs[i] = (n, ttft, itls)

    wall = concurrently(one, streams)
    itls = sorted(x for r in runs for x in r[2]) or [0.0]
    return {
        "tok_s": sum(r[0] for r in runs) / wall,
        "ttft_ms": statistics.median(r[1] for r in runs) * 1e3,
        "itl_p50_ms": itls[len(itls) // 2] * 1e3,
        "itl_p99_ms": itls[min(len(itls) - 1, int(len(itls) * 0.99))] * 1e3,
    }


Runs = dict[str, list[dict[str, float]]]  # who ("one", "chain") -> each round's figures


def profiles(endpoints: dict[str, str]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, ep in endpoints.items():
        with Client(ep) as c:
            out[name] = c.stats()["profile"]
    return out


def busy_table(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> list[str]:
    """Where each process's time went over one load (stats.profile), % of the wall."""
    lines = []
    for name in after:
        a, b = after[name], before[name]
        wall = a["wall_s"] - b["wall_s"]
        turn = {k: a["turn"][k] - b["turn"].get(k, 0.0) for k in a["turn"]}
        loop = {k: a["loop"][k] - b["loop"].get(k, 0.0) for k in a["loop"]}
        forwards = a["forwards"] - b["forwards"]
        cells = {
            "llama_decode": turn["decode"],
            "waiting: poll": loop["poll"],
            "waiting: chain": turn.get("land_wait", 0.0),
            "receive": loop["receive"],
            "send": loop["send"],
            "python in turns": loop["turn"] - turn["decode"] - turn.get("land_wait", 0.0),
        }
        text = " | ".join(f"{k} {100 * v / wall:4.1f}%" for k, v in cells.items())
        lines.append(f"    {name:<8} {forwards:5d} forwards, {1000 * wall / max(1, forwards):6.1f} "
                     f"ms each: {text}")  # fmt: skip
    return lines


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per generate")
    ap.add_argument("--frame-dtype", choices=("f32", "f16"), default="f32")
    ap.add_argument("--gap-ms", type=int, default=150, help="staggered workload: arrival gap")
    ap.add_argument("--pinned", action="store_true", help="one core per stage vs one core")
    ap.add_argument("--rounds", type=int, default=3, help="--pinned: interleaved rounds")
    ap.add_argument(
        "--cut",
        type=int,
        default=0,
        help="--pinned: stage 1's first layer; 0 = measured",
    )
    ap.add_argument("--model", default="default", help="--pinned: GGUF path (make_models.py)")
    ap.add_argument("--groups", type=int, default=2, help="--pinned: stage 0's --pipeline-groups")
    args = ap.parse_args()
    if args.pinned:
        pinned(args)
        return
    common = ("--lanes", "8", "--ctx", "16384")
    with tempfile.TemporaryDirectory(prefix="skiff-stages-") as tmp_s:
        tmp = Path(tmp_s)
        procs = []
        try:
            full, full_ep = start(tmp, "full", *common)
            procs.append(full)
            s1, s1_ep = start(tmp, "s1", *common, "--layers", "9:18")
            procs.append(s1)
            s0, s0_ep = start(
                tmp,
                "s0",
                *common,
                "--layers",
                "0:9",
                "--next",
                s1_ep,
                "--frame-dtype",
                args.frame_dtype,
            )
            procs.append(s0)
            # the same chain with pipelining off, for the same-run comparison
            t1, t1_ep = start(tmp, "t1", *common, "--layers", "9:18")
            procs.append(t1)
            t0, t0_ep = start(
                tmp,
                "t0",
                *common,
                "--layers",
                "0:9",
                "--next",
                t1_ep,
                "--chain-credit",
                "1",
                "--frame-dtype",
                args.frame_dtype,
            )
            procs.append(t0)
            with Client(full_ep) as c:
                n_embd = c.info()["model"]["n_embd"]
            ms_full, tok_full, log_full = step_ms(full_ep)
            ms_chain, tok_chain, log_chain = step_ms(s0_ep)
            # compare logits only while both saw the same tokens (row i scores
            # the step after out[: i + 1]); after a divergence they score
            # different text and the difference means nothing
            same = 0
            while same < len(log_full) and tok_full[: same + 1] == tok_chain[: same + 1]:
                same += 1
            diff = float(np.max(np.abs(log_full[:same] - log_chain[:same]))) if same else 0.0
            print(f"2-stage chain (0:9 -> 9:18, frames {args.frame_dtype}) vs one worker")
            print(
                f"  decode step c=1: chain {ms_chain:.1f} ms | one worker {ms_full:.1f} ms | "
                f"per-hop latency {ms_chain - ms_full:.2f} ms"
            )
            print(
                f"  greedy tokens identical: {tok_full == tok_chain} | max |logit diff| "
                f"{diff:.6g} over the {same} steps both saw the same tokens"
            )
            width = 4 if args.frame_dtype == "f32" else 2
            wire = wire_bytes_per_token(n_embd, args.frame_dtype)
            print(
                f"  wire bytes per token stage 0 -> 1: {wire} "
                f"(hidden row {width} x n_embd = {width * n_embd})"
            )
            for conc in (1, 8):
                a = throughput(full_ep, conc, args.tokens)
                b = throughput(s0_ep, conc, args.tokens)
                c1 = throughput(t0_ep, conc, args.tokens)
                print(
                    f"  generate c={conc}: chain {b:.1f} tok/s | one worker {a:.1f} tok/s | "
                    f"ratio {b / a:.2f} | chain without pipelining {c1:.1f} tok/s "
                    f"(ratio {c1 / a:.2f})"
                )
            a = staggered(full_ep, 8, args.tokens, args.gap_ms)
            b = staggered(s0_ep, 8, args.tokens, args.gap_ms)
            c1 = staggered(t0_ep, 8, args.tokens, args.gap_ms)
            print(
                f"  staggered 8 x {args.tokens} tokens, {args.gap_ms} ms apart: chain {b:.1f} "
                f"tok/s | one worker {a:.1f} | ratio {b / a:.2f} | without pipelining "
                f"{c1:.1f} (ratio {c1 / a:.2f})"
            )
        finally:
            for p in procs:
                p.terminate()
                p.wait(10)


if __name__ == "__main__":
    main()
