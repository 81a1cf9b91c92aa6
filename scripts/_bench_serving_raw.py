"""The raw-engine baseline of ``scripts/bench_serving.py``: the ceiling, no sockets.

Why a module of its own: it is the one system measured in process (N
sequences prefilled, then one ``llama_decode`` per step carrying a token of
each), and the engine it loads also builds the prompts every system is
sent (the model's own tokenizer) and the list of EOG tokens the HTTP peers
are told to suppress.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence

from _bench_serving_common import LANES, N_CTX, N_PROMPTS, PROMPT_TOKENS, THREADS, Row

from loadtest.prompts import make_text


def build_prompts(tokenize: Callable[[str], list[int]]) -> list[str]:
    """``N_PROMPTS`` distinct prose prompts of exactly (or just under) 128 tokens.

    Counted with the model's tokenizer including BOS, as skiff and
    llama-cpp-python both tokenize a fresh prompt.
    """
    out = []
    for seed in range(N_PROMPTS):
        lo, hi = 1, PROMPT_TOKENS  # words; ~1.15 tokens a word
        while lo < hi:  # largest word count whose text fits
            mid = (lo + hi + 1) // 2
            if len(tokenize(make_text(mid, seed=500 + seed))) <= PROMPT_TOKENS:
                lo = mid
            else:
                hi = mid - 1
        out.append(make_text(lo, seed=500 + seed))
    return out


# -- (a) the raw engine ----------------------------------------------------------------


def bench_raw(
    model: str,
    concurrencies: Sequence[int],
    k: int,
    n_new: int,
    prompts_out: list[str],
    eog_out: list[int],
    lengths_out: list[int],
    measure: bool = True,
) -> dict[int, Row]:
    from worker.engine import Engine, EngineConfig, Segment

    engine = Engine(EngineConfig(model_path=model, n_ctx=N_CTX, n_seq=LANES, n_threads=THREADS))
    try:
        prompts_out.extend(build_prompts(engine.tokenize))
        eog_out.extend(t for t in range(engine.n_vocab) if engine.is_eog(t))
        token_lists = [engine.tokenize(p) for p in prompts_out]
        lengths_out.extend(len(t) for t in token_lists)

        prefill_s: list[float] = []  # each prompt forward's seconds
        prompt_tokens = [0]  # of those forwards

        def round_(seqs: list[int], prompts: list[list[int]], steps: int) -> list[float]:
            """Prefill each sequence's prompt, then decode ``steps-1`` batched steps."""
            for s in seqs:
                engine.seq_clear(s)
            last: dict[int, int] = {}
            pos: dict[int, int] = {}
            pending = list(zip(seqs, prompts, strict=True))
            while pending:  # pack prompts into batches of at most n_batch tokens
                batch: list[tuple[int, list[int]]] = []
                used = 0
                while pending and used + len(pending[0][1]) <= engine.n_batch:
                    batch.append(pending.pop(0))
                    used += len(batch[-1][1])
                t = time.perf_counter()
                status = engine.decode([Segment(s, toks, 0, "last") for s, toks in batch])
                if not status.ok:
                    raise RuntimeError(f"raw prefill failed: {status.describe()}")
                for i, (s, toks) in enumerate(batch):
                    last[s] = engine.greedy(engine.output_index(i))
                    pos[s] = len(toks)
                prefill_s.append(time.perf_counter() - t)
                prompt_tokens[0] += used
            step_s: list[float] = []
            for _ in range(steps - 1):
                t = time.perf_counter()
                status = engine.decode([Segment(s, [last[s]], pos[s], "last") for s in seqs])
                if not status.ok:
                    raise RuntimeError(f"raw decode failed: {status.describe()}")
                for i, s in enumerate(seqs):
                    last[s] = engine.greedy(engine.output_index(i))
                    pos[s] += 1
                step_s.append(time.perf_counter() - t)
            return step_s

        rows: dict[int, Row] = {}
        if not measure:
            return rows
        round_([0], [token_lists[0]], 8)  # warm-up
        for c in concurrencies:
            t0 = time.perf_counter()
            steps: list[float] = []
            prefill_s.clear()
            prompt_tokens[0] = 0
            for r in range(k):
                chosen = [token_lists[(r * c + i) % len(token_lists)] for i in range(c)]
                steps += round_(list(range(c)), chosen, n_new)
            wall = time.perf_counter() - t0
            tokens = c * k * n_new
            rows[c] = Row(
                tokens / wall,
                tokens,
                wall,
                c * k,
                extra={
                    "decode_step_ms": 1e3 * statistics.fmean(steps),
                    "forward_mix": {
                        "decode_only": {"forwards": len(steps), "seconds": sum(steps)},
                        "with_prompt": {
                            "forwards": len(prefill_s),
                            "seconds": sum(prefill_s),
                            "prompt_tokens": prompt_tokens[0],
                        },
                    },
                },
            )
            print(f"  raw c={c}: {rows[c].tok_s:.1f} tok/s", file=sys.stderr)
        return rows
    finally:
        engine.close()
