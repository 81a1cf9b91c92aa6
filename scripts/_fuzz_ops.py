"""Plausible arguments per op for ``scripts/fuzzcases.py`` (the ``args`` cases).

Why a module of its own: one maker per op of a worker, a stage and the
speech worker, each drawing arguments a real client might send (sessions,
tokens, sampling, frames, generation extras), which ``Generator`` then
mostly mutates. A maker is a plain function of the ``Run`` that
``Generator`` holds (``_fuzz_draws.py``); ``MAKERS`` names them by op.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from typing import Any

from _fuzz_draws import Run, outputs, sampling, session, token, tokens
from _fuzz_frames import frame
from _fuzz_values import hostile_map, long_text, mutate, text

from protocol import frames

Made = tuple[str | None, dict[str, Any], list[bytes]]  # (session or None, args, buffers)


def args_ping(run: Run) -> Made:
    return None, ({} if run.rng.random() < 0.8 else hostile_map(run.rng, run.ids)), []


def args_tokenize(run: Run) -> Made:
    rng = run.rng
    said = text(rng, rng.randrange(80)) if rng.random() < 0.95 else long_text(rng)
    return (
        None,
        {"text": said, "add_special": rng.random() < 0.5, "parse_special": rng.random() < 0.5},
        [],
    )


def args_detokenize(run: Run) -> Made:
    return None, {"tokens": tokens(run, 0, 20)}, []


def args_prefill(run: Run, sampled: bool = False) -> Made:
    rng = run.rng
    args: dict[str, Any] = {}
    buffers: list[bytes] = []
    if rng.random() < 0.3:
        rows = rng.choice((1, 2, 5))
        args["input"], buffers = frame(rng, "embd", [rows, run.target.n_embd])
        if rng.random() < 0.3:
            args["input"]["positions"] = list(range(rows))
    else:
        args["tokens"] = tokens(run)
    if sampled and (s := sampling(run)) is not None:
        args["sampling"] = s
    outputs(run, args, 12)
    return session(run), args, buffers


def args_prefill_sampled(run: Run) -> Made:
    return args_prefill(run, sampled=True)


def args_decode(run: Run) -> Made:
    args: dict[str, Any] = {"token": token(run)}
    if (s := sampling(run)) is not None:
        args["sampling"] = s
    outputs(run, args, 1)
    return session(run), args, []


def args_decode_batch(run: Run) -> Made:
    names = run.rng.sample(run.sessions, run.rng.randint(1, len(run.sessions)))
    reqs = [{"session": n, "token": token(run)} for n in names]
    if (s := sampling(run)) is not None:
        reqs[0]["sampling"] = s
    return None, {"requests": reqs}, []


def args_iteration_batch(run: Run) -> Made:
    rng = run.rng
    reqs = []
    for n in rng.sample(run.sessions, rng.randint(1, len(run.sessions))):
        toks = tokens(run, 1, 6)
        entry: dict[str, Any] = {"session": n, "tokens": toks}
        if rng.random() < 0.5:
            entry["phase"] = "decode" if len(toks) == 1 else "prefill"
            entry["sample_last"] = rng.random() < 0.5
        if rng.random() < 0.2:
            entry["positions"] = list(range(len(toks)))
        reqs.append(entry)
    return None, {"requests": reqs}, []


def _generation(run: Run, args: dict[str, Any]) -> dict[str, Any]:
    rng = run.rng
    args["max_tokens"] = rng.choice((1, 2, 3, 4))
    if rng.random() < 0.5:
        args["stream"] = rng.random() < 0.5
    for key, make in GENERATE_EXTRAS.items():
        if rng.random() < 0.12:
            args[key] = make(rng, run)
    if (s := sampling(run)) is not None:
        args["sampling"] = s
    return args


def args_generate(run: Run) -> Made:
    rng = run.rng
    args: dict[str, Any] = {}
    if rng.random() < 0.6:
        args["prompt"] = text(rng, rng.randrange(1, 60))
    else:
        args["tokens"] = tokens(run)
    name = session(run) if rng.random() < 0.4 else None
    return name, _generation(run, args), []


def args_chat(run: Run) -> Made:
    rng = run.rng
    roles = ["system", "user", "assistant", "user"][rng.choice((0, 1)) :]
    n = rng.randint(1, 3)
    msgs = [{"role": r, "content": text(rng, rng.randrange(30))} for r in roles[:n]]
    name = session(run) if rng.random() < 0.3 else None
    return name, _generation(run, {"messages": msgs}), []


def args_verify(run: Run) -> Made:
    args: dict[str, Any] = {"tokens": tokens(run, 1, 9), "trim": run.rng.random() < 0.7}
    if (s := sampling(run)) is not None:
        args["sampling"] = s
    return session(run), args, []


def args_trim(run: Run) -> Made:
    return session(run), {"token_count": run.rng.choice((0, 1, 3, 10, 2000))}, []


def args_drop(run: Run) -> Made:
    return session(run), {}, []


def args_signal_window(run: Run) -> Made:
    return session(run), {"window_tokens": run.rng.choice((1, 4, 4096))}, []


def args_cancel(run: Run) -> Made:
    ids = run.ids.recent or [0]
    return None, {"id": run.rng.choice(ids)}, []


def args_embed(run: Run) -> Made:
    rng = run.rng
    args: dict[str, Any] = {"pooling": rng.choice(("mean", "last", "none"))}
    if rng.random() < 0.5:
        args["text"] = text(rng, rng.randrange(1, 40))
    else:
        args["tokens"] = tokens(run)
    return None, args, []


def args_echo(run: Run) -> Made:
    rng = run.rng
    dtype = rng.choice(list(frames.DTYPES))
    dims = rng.choice(([3], [2, 3], [4, 1, 2], [0, 5], [1]))
    positions = list(range(dims[0])) if rng.random() < 0.3 else None
    header, buffers = frame(rng, "hidden", dims, dtype, positions=positions)
    return None, {"frame": header}, buffers


def args_import_state(run: Run) -> Made:
    state = run.target.state
    if state is None:
        return session(run), {"session_state": {}, "frame": {}}, []
    meta = copy.deepcopy(state["session_state"])
    if run.rng.random() < 0.5:  # an edit deep inside the state itself
        meta = mutate(run.rng, run.ids, meta, 1)
    header = copy.deepcopy(state["frame"])
    name = run.rng.choice((*run.sessions, "fz-new"))
    return name, {"session_state": meta, "frame": header}, list(state["buffers"])


def args_forward_frame(run: Run) -> Made:
    rng = run.rng
    names = rng.sample(run.sessions, rng.randint(1, len(run.sessions)))
    steps, rows = [], 0
    for n in names:
        k = rng.choice((1, 1, 2, 4))
        step: dict[str, Any] = {
            "session": n,
            "tokens": [token(run) if rng.random() < 0.8 else -1 for _ in range(k)],
            "position": run.positions.get(n, 0) if rng.random() < 0.85 else rng.choice((0, 4)),
            "sample": rng.random() < 0.7,
            "sampling": sampling(run),
            "output": rng.choice((None, [], ["hidden"], ["logits"])),
            "capture_all": rng.random() < 0.2,
            "top_logprobs": rng.choice((None, 0, 3)),
        }
        if rng.random() < 0.2:
            step["all_rows"] = True
            step["rule"] = {
                "checks": [token(run) for _ in range(k)],
                "until_mismatch": True,
                "stop_tokens": [1],
                "stop_eog": True,
            }
        if rng.random() < 0.05:  # a direct return to a head that is not there
            step["origin"] = ["ff" + rng.randbytes(4).hex(), run.ids.fresh(), 0, 1]
        steps.append(step)
        run.positions[n] = step["position"] + k  # if it passes: the next one follows on
        rows += k
    dtype = rng.choice(("f32", "f32", "f16"))
    header, buffers = frame(
        rng, "hidden", [rows, run.target.n_embd], dtype, positions=list(range(rows))
    )
    return None, {"input": header, "steps": steps}, buffers


def args_synthesize(run: Run) -> Made:
    rng = run.rng
    args: dict[str, Any] = {
        "text": rng.choice(("Hi.", "Ok", "Yes. No.", text(rng, rng.randrange(1, 12))))
    }
    if rng.random() < 0.3:
        args["voice"] = rng.choice((*run.target.voices, "nobody"))
    if rng.random() < 0.3:
        args["format"] = rng.choice(("wav", "pcm_s16le", "mp3"))
    if rng.random() < 0.3:
        args["speed"] = rng.choice((0.25, 1.0, 4.0, 4.01, 0.2))
    if rng.random() < 0.4:
        args["stream"] = rng.random() < 0.5
    if rng.random() < 0.3:
        args["max_seconds"] = rng.choice((0.05, 0.5, 2.0))
    return None, args, []


# The maker of each op's arguments (``Generator`` keeps those of its target's ops).
MAKERS: dict[str, Callable[[Run], Made]] = {
    "ping": args_ping,
    "info": args_ping,
    "stats": args_ping,
    "tokenize": args_tokenize,
    "detokenize": args_detokenize,
    "prefill": args_prefill,
    "prefill_sampled": args_prefill_sampled,
    "decode": args_decode,
    "decode_batch": args_decode_batch,
    "iteration_batch": args_iteration_batch,
    "generate": args_generate,
    "chat": args_chat,
    "verify": args_verify,
    "trim": args_trim,
    "align": args_trim,
    "drop": args_drop,
    "signal": args_drop,
    "signal_window": args_signal_window,
    "export_state": args_drop,
    "import_state": args_import_state,
    "cancel": args_cancel,
    "embed": args_embed,
    "echo": args_echo,
    "forward_frame": args_forward_frame,
    "synthesize": args_synthesize,
}


Rng = random.Random
GENERATE_EXTRAS: dict[str, Callable[[Rng, Run], Any]] = {
    "stop": lambda r, g: r.choice((["\n"], ["a"] * 16, [""], ["x" * 256])),
    "stop_tokens": lambda r, g: [token(g) for _ in range(r.randrange(3))],
    "ignore_eos": lambda r, g: r.random() < 0.5,
    "logprobs": lambda r, g: True,
    "top_logprobs": lambda r, g: r.choice((0, 5, 20)),
    "speculative": lambda r, g: r.choice(
        (
            {"mode": "prompt_lookup", "max_draft": 8, "ngram": 2},
            {"mode": "draft_model"},
            {"mode": "x"},
        )
    ),
}
