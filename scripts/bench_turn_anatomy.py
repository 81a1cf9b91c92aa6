"""What a prompt piece adds to a turn of decoding streams, in the engine alone.

Why: two of the serving bars pull against each other. Inter-token p99 within
3x the median step asks for small prompt pieces beside running streams;
first tokens as early as llama-server's and skiff within 3% of the raw
engine ask for few, large ones. This prints the costs that decide the trade,
each beside its baseline from the same run (2 threads, 8 lanes, the default
model, random token ids; medians of ``--reps``):

1. four 128-token prompts in one forward (the raw baseline's prefill) vs the
   same four one forward each (skiff's pieces while streams decode);
2. with ``--streams`` sequences decoding at 200 tokens, the decode-only turn
   (the baseline) vs the same turn carrying a piece of n tokens, with and
   without the logits row a piece that ends its prompt computes;
3. a least-squares fit of 2: ms per extra micro-batch (each prompt is its
   own, llama.cpp's equal split over sequences), per prompt token and per
   logits row, and the tokens a turn may carry at a cadence of 3;
4. the turn carrying a piece that ends its prompt, as the engine runs it
   (the piece's last token decoded with the decode rows, one pass over the
   output head: ``EngineConfig.share_head``) against one ``llama_decode``
   of the whole batch (the baseline, ``share_head`` off).

    .venv/bin/python scripts/bench_turn_anatomy.py [--streams 3] [--reps 5]
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from _bench_serving_common import LANES, N_CTX, THREADS  # noqa: E402
from _machine import cpu_flags  # noqa: E402

from worker.engine import Engine, EngineConfig, Segment  # noqa: E402
from worker.models import default_model_path  # noqa: E402

SIZES = (16, 32, 48, 64, 96, 128)
CONTEXT = 200  # tokens each decoding stream holds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=3, help="sequences decoding (1-7)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    streams = max(1, min(args.streams, LANES - 1))
    cfg = EngineConfig(
        model_path=str(default_model_path()), n_ctx=N_CTX, n_seq=LANES, n_threads=THREADS
    )
    engine = Engine(cfg)
    rnd = random.Random(1)

    def toks(n: int) -> list[int]:
        return [rnd.randrange(1000, 20000) for _ in range(n)]

    def timed(segments: list[Segment]) -> float:
        t = time.perf_counter()
        status = engine.decode(segments)
        if not status.ok:
            raise RuntimeError(status.describe())
        return (time.perf_counter() - t) * 1000

    def clear() -> None:
        for s in range(LANES):
            engine.seq_clear(s)

    def median(fn: Callable[[], float]) -> float:
        return statistics.median(fn() for _ in range(args.reps))

    try:
        timed([Segment(0, toks(32), 0, "last")])  # warm-up
        clear()

        def packed() -> float:
            clear()
            return timed([Segment(s, toks(128), 0, "last") for s in range(4)])

        def apart() -> float:
            clear()
            return sum(timed([Segment(s, toks(128), 0, "last")]) for s in range(4))

        one, four = median(packed), median(apart)
        print(f"CPU flags: {cpu_flags()} | {THREADS} threads, {LANES} lanes")
        print(
            f"4 prompts x 128 tokens: one forward {one:.1f} ms | one forward each {four:.1f} ms "
            f"| ratio {four / one:.3f}"
        )
        clear()
        for s in range(streams):
            timed([Segment(s, toks(CONTEXT), 0, "last")])
        pos = CONTEXT
        piece_lane = LANES - 1

        def turn(n: int, row: bool) -> float:
            nonlocal pos
            engine.seq_clear(piece_lane)
            segs = [Segment(s, toks(1), pos, "last") for s in range(streams)]
            if n:
                segs.append(Segment(piece_lane, toks(n), 0, "last" if row else "none"))
            pos += 1
            return timed(segs)

        base = median(lambda: turn(0, False))
        print(f"{streams} streams decoding: decode-only turn {base:.1f} ms (the baseline)")
        rows: list[tuple[int, int, int, float]] = []
        for n in SIZES:
            for row in (False, True):
                ms = median(functools.partial(turn, n, row))
                rows.append((1, n, int(row), ms - base))
                print(
                    f"  + piece of {n:3d} tokens{' + logits row' if row else '             '}: "
                    f"{ms:6.1f} ms = {ms / base:4.2f} x the decode turn (adds {ms - base:5.1f} ms)"
                )
        x = np.array([r[:3] for r in rows], dtype=np.float64)
        y = np.array([r[3] for r in rows], dtype=np.float64)
        fit = np.linalg.lstsq(x, y, rcond=None)[0]
        piece, per_token, row_ms = (float(v) for v in fit)
        print(
            f"fit: {piece:.1f} ms per extra micro-batch + {per_token:.2f} ms per prompt token "
            f"+ {row_ms:.1f} ms per logits row"
        )
        for n in (32, 128):
            engine.share_head = False
            whole = median(functools.partial(turn, n, True))
            engine.share_head = True
            shared = median(functools.partial(turn, n, True))
            print(
                f"piece of {n:3d} tokens ending its prompt: one llama_decode {whole:6.1f} ms | "
                f"last token with the decode rows {shared:6.1f} ms | ratio {shared / whole:.3f}"
            )
        for cadence in (2.5, 3.0):
            room = (cadence - 1) * base - piece
            print(
                f"cadence {cadence}: a turn may add {room / per_token:.0f} prompt tokens "
                f"({(room - row_ms) / per_token:.0f} in a piece ending its prompt); "
                f"a 128-token prompt then takes "
                f"{-(-(128 + row_ms / per_token) // (room / per_token)):.0f} turns"
            )
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
