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
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from _bench_stages_measure import (  # noqa: E402
    staggered,
    start,
    step_ms,
    throughput,
    wire_bytes_per_token,
)
from _bench_stages_pinned import pinned  # noqa: E402

from protocol import Client  # noqa: E402


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
