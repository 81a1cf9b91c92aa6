#!/usr/bin/env python3
"""Fuzz live skiff processes over their socket: every case answered, none fatal.

    .venv/bin/python scripts/fuzz.py --cases N --seed S [--target worker|speech|stage|all]
                                     [--endpoint ENDPOINT] [--batch 100] [--timeout 60]

Without ``--endpoint`` it starts what the target needs on ``ipc://`` in a
temp dir (an LLM worker; the speech worker; a two-stage chain, fuzzed at
both its head and its tail, where ``forward_frame`` comes in) and stops it
at the end. Cases come from ``scripts/fuzzcases.py`` (deterministic per
seed): random bytes, random msgpack, valid headers with mutated arguments
for every op, corrupted tensor frames, deep nesting, oversized headers,
duplicated messages.

Checked, for every message: a well-formed final reply (``ok: true`` with
``done`` or no ``event``, or ``ok: false`` with a code from
``faults.ErrorCode``) arrives within ``--timeout`` s; an undecodable header
is answered with ``id: null``. After every batch: the process is alive,
``ping`` answers, and the sessions the batch made are dropped (so lanes
do not fill). At the end: the processes' logs hold no caught crash. An
``internal`` error counts as a failure (bad input must be a client error).
A process exiting ends its run at once (what was in flight: unanswered).
Prints a summary (and one ``FUZZ-SUMMARY {json}`` line for tests) and exits
1 on any failure. ``--workdir`` keeps the sockets and logs for a post-mortem.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from _fuzz_conn import Conn, Died, Tally, short  # noqa: E402
from _fuzz_draws import Target  # noqa: E402
from _fuzz_procs import Proc, spawn  # noqa: E402
from fuzzcases import Case, Generator  # noqa: E402

# What a stage that is not the head serves (and so what its fuzz cases use).
TAIL_OPS: tuple[str, ...] = ("ping", "info", "stats", "forward_frame", "trim", "align", "drop")
TAIL_OPS += ("signal", "signal_window", "export_state", "import_state", "cancel", "tokenize")
TAIL_OPS += ("detokenize",)


# -- one target ------------------------------------------------------------------


def describe(conn: Conn, name: str) -> Target:
    """The target's shape, from ``info`` (and a real exported state to mutate)."""
    info = conn.call("info").get("header", {}).get("result", {})
    if name == "speech":
        limit = 64 * 1024 + 4 * int(info.get("max_chars", 5000))
        speech_ops = ("ping", "info", "stats", "cancel", "synthesize")
        return Target(name, speech_ops, limit, voices=tuple(info.get("voices", ())))
    model = info["model"]
    ops = TAIL_OPS if name == "stage1" else tuple(o for o in info["ops"] if o != "forward_frame")
    state = None
    if name != "stage1":
        conn.call("prefill", "fz-state", {"tokens": [2, 105, 2364, 107, 9259]})
        got = conn.call("export_state", "fz-state")
        conn.call("drop", "fz-state")
        result = got["header"]["result"]
        state = {"session_state": result["session_state"], "frame": result["frame"]}
        state["buffers"] = got["buffers"]
    return Target(
        name,
        ops,
        int(info["limits"]["max_request_bytes"]),
        int(model["n_vocab"]),
        int(model["n_embd"]),
        int(info["n_ctx_per_lane"]),
        int(info["lanes"]),
        state=state,
    )


def clean(conn: Conn, tally: Tally) -> None:
    """Drop every named session the batch left (lanes stay free for the next)."""
    got = conn.call("stats")
    stats = got.get("header", {}).get("result", {})
    for entry in stats.get("sessions", []) if isinstance(stats, dict) else []:
        if not entry.get("ephemeral") and isinstance(entry.get("session"), str):
            dropped = conn.call("drop", entry["session"])
            if dropped.get("timeout"):
                tally.control_timeouts.append(f"drop {entry['session']!r}")
    if got.get("timeout"):
        tally.control_timeouts.append("stats")


def run_target(name: str, conn: Conn, cases: int, seed: int, args: argparse.Namespace) -> Tally:
    """Fuzz one process; a process that exits ends the run (a crash, and what
    was in flight unanswered)."""
    tally = conn.tally
    gen = Generator(describe(conn, name), seed, args.batch)
    t0 = time.monotonic()
    try:
        fuzz_batches(name, conn, gen, cases, args)
    except Died as exc:
        tally.crashes.append(f"{exc} by case {tally.cases - 1}")
        tally.unanswered.extend(p.what for p in conn.pending.values() if p.control is None)
        for p in conn.watch:
            print(f"--- {p.name} log (last lines but refusals):\n{p.tail()}", file=sys.stderr)
    tally.seconds = time.monotonic() - t0
    return tally


def fuzz_batches(
    name: str, conn: Conn, gen: Generator, cases: int, args: argparse.Namespace
) -> None:
    tally, i = conn.tally, 0
    t0 = time.monotonic()
    sessions = name != "speech"
    for start_at in range(0, cases, args.batch):
        for i in range(start_at, min(cases, start_at + args.batch)):
            case: Case = gen.case(i)
            tally.cases += 1
            tally.kinds[case.kind] += 1
            for msg in case.messages:
                conn.settle(args.inflight - 1)
                conn.send(msg.frames, msg.reply_id, f"case {i} ({case.kind} {case.op})")
        conn.settle(0)
        pong = conn.call("ping", timeout_s=args.timeout)
        if pong.get("header", {}).get("result") != {"pong": True}:
            tally.pings_failed.append(f"after case {i}: {short(pong)}")
        missing = conn.null_expected - tally.null_replies
        if missing > 0:  # id-less replies are sent at once, so all came before the pong
            tally.unanswered.extend([f"an id-less reply before case {i}"] * missing)
            conn.null_expected -= missing
        tally.batches += 1
        conn.checked = 0.0
        conn.alive()
        if sessions:
            clean(conn, tally)
        if args.progress and tally.batches % args.progress == 0:
            rate = tally.cases / (time.monotonic() - t0)
            print(f"  {name}: {tally.cases} cases ({rate:.0f}/s)", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cases", type=int, default=1000, help="cases per target")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", choices=("worker", "speech", "stage", "all"), default="worker")
    ap.add_argument("--endpoint", help="fuzz this running process (worker or speech; one target)")
    ap.add_argument("--speech-cases", type=int, help="cases for speech (default: --cases)")
    ap.add_argument("--stage-cases", type=int, help="cases for the chain, half to each stage")
    ap.add_argument("--batch", type=int, default=100, help="cases between pings and clean-ups")
    ap.add_argument("--inflight", type=int, default=8, help="requests open at once")
    # Generous: the speech worker synthesizes one request at a time, so 8 in flight on a
    # loaded 2-core machine took up to 32 s (answered late, not lost).
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per case")
    ap.add_argument("--allow-internal", action="store_true", help="internal is not a failure")
    ap.add_argument("--progress", type=int, default=0, help="print progress every N batches")
    ap.add_argument("--show", type=int, default=5, help="examples printed per kind of finding")
    ap.add_argument("--workdir", help="sockets and process logs here (kept); default: a temp dir")
    args = ap.parse_args(argv)
    targets = ["worker", "speech", "stage"] if args.target == "all" else [args.target]
    if args.endpoint and len(targets) > 1:
        ap.error("--endpoint takes one --target")
    ctx: zmq.Context[Any] = zmq.Context()
    results: dict[str, Tally] = {}
    with tempfile.TemporaryDirectory(prefix="skiff-fuzz-") as scratch:
        tmp = args.workdir or scratch
        Path(tmp).mkdir(parents=True, exist_ok=True)
        procs = {t: [] if args.endpoint else spawn(t, Path(tmp)) for t in targets}
        try:
            for target in targets:
                fuzz_target(target, procs[target], results, ctx, args)
        finally:
            for group in procs.values():
                for p in group:
                    p.stop()
    ctx.term()
    failed = report(results, args)
    return 1 if failed else 0


def fuzz_target(
    target: str,
    procs: list[Proc],
    results: dict[str, Tally],
    ctx: zmq.Context[Any],
    args: argparse.Namespace,
) -> None:
    """Fuzz one target (a chain: its head, then its tail) once its processes answer."""
    count = {"speech": args.speech_cases, "stage": args.stage_cases}.get(target)
    count = args.cases if count is None else count
    for p in reversed(procs):  # a chain's tail first
        p.wait_ready(ctx)
    endpoints = [p.endpoint for p in procs] or [args.endpoint]
    names = [f"stage{i}" for i in range(len(endpoints))] if target == "stage" else [target]
    shares = [count - count // 2, count // 2] if len(names) == 2 else [count]
    for i, (name, share) in enumerate(zip(names, shares, strict=True)):
        conn = Conn(ctx, endpoints[i], Tally(), args.timeout, procs)
        try:
            results[name] = run_target(name, conn, share, args.seed, args)
        finally:
            conn.close()
        if results[name].crashes:
            break
    for p in procs:  # what the processes caught and logged counts too
        if p.name in results:
            results[p.name].log_crashes.extend(p.crashes_logged())


def report(results: dict[str, Tally], args: argparse.Namespace) -> int:
    failed = 0
    for name, t in results.items():
        bad = t.failures(args.allow_internal)
        failed += bad
        print(
            f"{name}: {t.cases} cases, {t.messages} messages in {t.seconds:.1f} s "
            f"({t.cases / max(t.seconds, 1e-9):.0f}/s); {t.replies} replies + "
            f"{t.null_replies} id-less, {t.events} stream events, {t.batches} pings"
        )
        print(
            f"  crashes {len(t.crashes)}, unanswered {len(t.unanswered)}, "
            f"bad replies {len(t.bad_replies)}, stray {len(t.strays)}, "
            f"undocumented codes {len(t.undocumented)}, internal {len(t.internal)}, "
            f"pings failed {len(t.pings_failed)}, crashes logged {len(t.log_crashes)}"
            f"  -> {'FAIL' if bad else 'ok'}"
        )
        print(f"  codes: {dict(t.codes.most_common())}")
        print(f"  seconds by op: {t.summary()['op_seconds']}")
        print(f"  answered ok, by op: {dict(sorted(t.ok_ops.items()))}")
        for label in (
            "crashes",
            "unanswered",
            "late",
            "control_timeouts",
            "bad_replies",
            "strays",
            "undocumented",
            "internal",
            "log_crashes",
            "slow",
        ):
            for line in getattr(t, label)[: args.show]:
                print(f"  {label}: {line}")
    summary = {"seed": args.seed, "targets": {k: v.summary() for k, v in results.items()}}
    print("FUZZ-SUMMARY " + json.dumps(summary, sort_keys=True))
    return failed


if __name__ == "__main__":
    sys.exit(main())
