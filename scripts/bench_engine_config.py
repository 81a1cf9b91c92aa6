"""Engine configurations side by side: decode step at 8 lanes, prefill, exactness.

Each configuration is loaded in-process in turn (same model, 2 threads,
8 sequences x 1024 cells) and measured the same way:

- decode: 8 sequences prefilled with 128-token prompts, then 64 batched
  decode steps (one token per sequence per ``llama_decode``): tok/s;
- prefill: one 512-token prompt in one ``llama_decode``: tok/s;
- exact: the max |logit difference| between decoding 4 sessions in one batch
  and one at a time (skiff promises 0.0 for up to 7 rows), and between
  trimming a session back 8 tokens and re-decoding them (promised 0.0).

Printed beside skiff's configuration (split KV per lane, ``swa_full``, no
repacking), with ratios; llama.cpp's defaults are unified KV, small sliding
window cache and repacking on.

    .venv/bin/python scripts/bench_engine_config.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from worker.engine import Engine, EngineConfig, Segment  # noqa: E402
from worker.models import default_model_path  # noqa: E402

CONFIGS = {
    "skiff (split, swa_full, no repack)": {"kv_unified": False, "swa_full": True, "repack": False},
    "unified, swa_full, no repack": {"kv_unified": True, "swa_full": True, "repack": False},
    "split, small window, no repack": {"kv_unified": False, "swa_full": False, "repack": False},
    "unified, small window, no repack": {"kv_unified": True, "swa_full": False, "repack": False},
    "llama.cpp defaults (unified, small window, repack)": {
        "kv_unified": True,
        "swa_full": False,
        "repack": True,
    },
}


def measure(path: str, knobs: dict[str, bool]) -> dict[str, float]:
    e = Engine(EngineConfig(model_path=path, n_ctx=8192, n_seq=8, n_threads=2, **knobs))
    try:
        text = "The harbor town woke slowly while the boats rocked against the pier. " * 60
        base = e.tokenize(text)
        prompts = [base[i : i + 128] for i in range(8)]
        for s, p in enumerate(prompts):
            assert e.decode([Segment(s, p, 0, "last")]).ok
        last = {s: e.greedy(e.output_index(0)) for s in range(8)}
        pos = dict.fromkeys(range(8), 128)
        t0 = time.perf_counter()
        for _ in range(64):
            assert e.decode([Segment(s, [last[s]], pos[s], "last") for s in range(8)]).ok
            for i, s in enumerate(range(8)):
                last[s] = e.greedy(e.output_index(i))
                pos[s] += 1
        decode = 64 * 8 / (time.perf_counter() - t0)
        e.seq_clear(0)
        t0 = time.perf_counter()
        assert e.decode([Segment(0, base[:512], 0, "last")]).ok
        prefill = 512 / (time.perf_counter() - t0)
        # exactness: 4 sessions batched vs alone, at their current positions
        toks = [last[s] for s in range(1, 5)]
        assert e.decode([Segment(s, [toks[s - 1]], pos[s], "last") for s in range(1, 5)]).ok
        batched = [e.logits_row(e.output_index(i)).copy() for i in range(4)]
        alone = []
        for s in range(1, 5):
            e.seq_rm(s, pos[s], -1)
            assert e.decode([Segment(s, [toks[s - 1]], pos[s], "last")]).ok
            alone.append(e.logits_row(e.output_index(0)).copy())
        batch_diff = max(float(np.abs(a - b).max()) for a, b in zip(alone, batched, strict=True))
        # trim 8 back and re-decode
        s = 5
        seq = [last[s]]
        for _ in range(8):
            assert e.decode([Segment(s, [seq[-1]], pos[s], "last")]).ok
            seq.append(e.greedy(e.output_index(0)))
            pos[s] += 1
        first = e.logits_row(e.output_index(0)).copy()
        e.seq_rm(s, pos[s] - 8, -1)
        p0 = pos[s] - 8
        for k in range(8):
            assert e.decode([Segment(s, [seq[k]], p0 + k, "last")]).ok
        trim_diff = float(np.abs(e.logits_row(e.output_index(0)) - first).max())
        return {"decode": decode, "prefill": prefill, "batch": batch_diff, "trim": trim_diff}
    finally:
        e.close()


def main() -> None:
    path = str(default_model_path())
    rows = {name: measure(path, knobs) for name, knobs in CONFIGS.items()}
    ref = next(iter(rows.values()))
    print(f"{'configuration':<52}{'decode B=8':>11}{'ratio':>7}{'prefill':>9}{'ratio':>7}"
          f"{'batch diff':>12}{'trim diff':>11}")  # fmt: skip
    for name, r in rows.items():
        print(f"{name:<52}{r['decode']:>11.1f}{r['decode'] / ref['decode']:>7.2f}"
              f"{r['prefill']:>9.1f}{r['prefill'] / ref['prefill']:>7.2f}"
              f"{r['batch']:>12.4f}{r['trim']:>11.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
