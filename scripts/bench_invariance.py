"""What batch invariance costs: the engine under each kernel rule, in one run.

skiff's worker sets the patched ggml's switches (``worker/engine/kernels.py``,
``scripts/llama_patch.py``) so a row's logits do not depend on the batch
around it. This prints, for the same build and model, decode tok/s at
B = 1, 4, 8 lanes (one token each per forward, each lane with ``--context``
tokens of KV) and prefill tok/s (512-token chunks) under each rule: the
worker's (``exact``), upstream's paths (``upstream``), and alternatives
(``strict``: no tinyBLAS either; ``tiled-force``: the tiled K-quant matmul for
every row count; ``tiled-dot``: the exact rule before the rows-at-once
attention (``fa-rows``, scripts/llama_fa_rows.cpp); ``q8-gemm``: that with
the wide Q8_0 matmul (scripts/llama_q8_gemm.cpp); ``tiled-fa``: its
matmuls with upstream's attention, not exact; ``vec-dot``: the exact rule
before the tiled-dot one, every K-quant row through ``vec_dot``). ggml
reads the switches once per process, so each rule runs in its own child;
rounds alternate so drift hits all, and the table gives medians and the
ratio of each rule to the last one named.

    .venv/bin/python scripts/bench_invariance.py [--rounds 3] [--context 300]
        [--rules exact,tiled-dot,strict,tiled-force,tiled-fa,upstream]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _machine import cpu_flags

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# name -> KernelRule fields (worker/engine/kernels.py); "exact" is the worker's default here
RULES: dict[str, dict[str, bool] | None] = {
    "upstream": {"fa_one_row": False, "tiled_mm": True, "llamafile": True},
    "exact": None,
    "strict": {"llamafile": False},
    "tiled-force": {"tiled_mm_force": True, "llamafile": True},
    "tiled-dot": {"llamafile": True, "tiled_dot": True},
    "vec-dot": {"llamafile": True},  # the exact rule before tiled-dot
    "fa-rows": {"llamafile": True, "tiled_dot": True, "fa_rows": True},
    # fa-rows with the wide Q8_0 matmul (scripts/llama_q8_gemm.cpp; AVX-512 VNNI builds)
    "q8-gemm": {"llamafile": True, "tiled_dot": True, "fa_rows": True, "q8_gemm": True},
    # tiled-dot's matmuls with upstream's flash attention (not exact): what
    # the batch-invariant attention costs against upstream's
    "tiled-fa": {"llamafile": True, "tiled_dot": True, "fa_one_row": False},
}


def child(context: int, steps: int, threads: int, rule_name: str) -> dict[str, float]:
    from worker.engine import Engine, EngineConfig, Segment, kernels
    from worker.models import default_model_path

    fields = RULES[rule_name]
    rule = kernels.KernelRule(**fields) if fields is not None else None

    engine = Engine(
        EngineConfig(
            str(default_model_path()),
            n_ctx=8 * 2048,
            n_seq=8,
            n_threads=threads,
            kernel_rule=rule,
        )
    )
    text = (ROOT / "README.md").read_text() * 8
    base = engine.tokenize(text)
    out: dict[str, float] = {}
    # prefill: 2 x 512 tokens on lane 0, timed
    prompt = base[:1024]
    t0 = time.perf_counter()
    for pos in range(0, len(prompt), 512):
        assert engine.decode([Segment(0, prompt[pos : pos + 512], pos, "last")]).ok
    out["prefill tok/s"] = len(prompt) / (time.perf_counter() - t0)
    engine.seq_clear(0)
    for lane in range(8):
        ctx = base[lane * 7 : lane * 7 + context]
        for pos in range(0, len(ctx), 512):
            assert engine.decode([Segment(lane, ctx[pos : pos + 512], pos, "last")]).ok
    for b in (1, 4, 8):
        t0 = time.perf_counter()
        for i in range(steps):
            segs = [Segment(lane, [base[i + lane]], context + i, "last") for lane in range(b)]
            assert engine.decode(segs).ok
        out[f"decode B={b} tok/s"] = b * steps / (time.perf_counter() - t0)
        for lane in range(b):
            engine.seq_rm(lane, context, -1)
    engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context", type=int, default=300, help="KV tokens per lane before decoding")
    ap.add_argument("--steps", type=int, default=32, help="forwards per decode figure")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--rules", default="exact,upstream", help=f"from {sorted(RULES)}")
    ap.add_argument("--child", choices=sorted(RULES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        json.dump(child(args.context, args.steps, args.threads, args.child), sys.stdout)
        return
    names = args.rules.split(",")
    results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            cmd = [sys.executable, __file__, "--child", name, "--context", str(args.context),
                   "--steps", str(args.steps), "--threads", str(args.threads)]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
            results[name].append(json.loads(proc.stdout))
    flags = cpu_flags()
    print(f"cpu flags: {flags}; threads {args.threads}; rounds {args.rounds}")
    last = names[-1]
    print(f"{'figure':<20} " + " ".join(f"{n:>11}" for n in names) + f"   ratios to {last}")
    for key in results[names[0]][0]:
        med = {n: statistics.median(r[key] for r in results[n]) for n in names}
        ratios = " ".join(f"{med[n] / med[last]:>6.3f}" for n in names[:-1])
        print(f"{key:<20} " + " ".join(f"{med[n]:>11.1f}" for n in names) + f"   {ratios}")


if __name__ == "__main__":
    main()
