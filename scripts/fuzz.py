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
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from _fuzz_ops import Target  # noqa: E402
from fuzzcases import Case, Generator  # noqa: E402

from faults import ErrorCode  # noqa: E402
from protocol import sockets, transport  # noqa: E402

CODES = {c.value for c in ErrorCode}
CONTROL_IDS = 1 << 50  # the fuzzer's own ping / stats / drop: far from every case id
# What a stage that is not the head serves (and so what its fuzz cases use).
TAIL_OPS: tuple[str, ...] = ("ping", "info", "stats", "forward_frame", "trim", "align", "drop")
TAIL_OPS += ("signal", "signal_window", "export_state", "import_state", "cancel", "tokenize")
TAIL_OPS += ("detokenize",)


@dataclass
class Pending:
    remaining: int
    deadline: float
    what: str
    control: dict[str, Any] | None = None  # for the fuzzer's own calls: the reply lands here
    sent: float = field(default_factory=time.monotonic)


@dataclass
class Tally:
    """What one target's run saw."""

    cases: int = 0
    messages: int = 0
    replies: int = 0
    events: int = 0
    null_replies: int = 0
    batches: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    kinds: Counter[str] = field(default_factory=Counter)
    crashes: list[str] = field(default_factory=list)
    unanswered: list[str] = field(default_factory=list)
    bad_replies: list[str] = field(default_factory=list)
    strays: list[str] = field(default_factory=list)
    undocumented: list[str] = field(default_factory=list)
    internal: list[str] = field(default_factory=list)
    pings_failed: list[str] = field(default_factory=list)
    log_crashes: list[str] = field(default_factory=list)  # exceptions the process logged
    slow: list[str] = field(default_factory=list)  # answered, but after over 2 s (not a failure)
    late: list[str] = field(default_factory=list)  # answered after --timeout (unanswered too)
    control_timeouts: list[str] = field(default_factory=list)  # the fuzzer's stats / drop
    op_seconds: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    ok_ops: Counter[str] = field(default_factory=Counter)  # ops answered ok: how deep cases got
    seconds: float = 0.0

    def failures(self, allow_internal: bool) -> int:
        lists = [self.crashes, self.unanswered, self.bad_replies, self.strays, self.undocumented]
        lists += [self.pings_failed, self.control_timeouts, self.log_crashes]
        if not allow_internal:
            lists.append(self.internal)
        return sum(len(x) for x in lists)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: v for k, v in self.__dict__.items() if not isinstance(v, list)}
        out["codes"], out["kinds"] = dict(self.codes.most_common()), dict(self.kinds.most_common())
        out["ok_ops"] = dict(sorted(self.ok_ops.items()))
        slowest = sorted(self.op_seconds.items(), key=lambda kv: -kv[1])[:8]
        out["op_seconds"] = {k: round(v, 1) for k, v in slowest}  # where the time goes
        for k, v in self.__dict__.items():
            if isinstance(v, list):
                out[k] = len(v)
                if v:
                    out[f"{k}_examples"] = v[:5]
        out["seconds"] = round(self.seconds, 1)
        return out


class Died(Exception):
    """A process under test exited."""


class Conn:
    """One DEALER to one process: sends cases, matches replies by id, counts."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        endpoint: str,
        tally: Tally,
        timeout_s: float,
        watch: Sequence[Proc] = (),
    ):
        self.sock = sockets.dealer(ctx, endpoint)
        self.watch = watch  # processes whose exit ends the run at once (no waiting out timeouts)
        self.checked = time.monotonic()
        self.tally = tally
        self.timeout_s = timeout_s
        self.pending: dict[int, Pending] = {}
        self.expired: dict[int, tuple[str, float]] = {}  # id -> (what, sent) of timed-out cases
        self.null_expected = 0
        self.control_ids = CONTROL_IDS

    def close(self) -> None:
        self.sock.close(linger=0)

    def send(self, frames: list[bytes], rid: int | None, what: str) -> None:
        while rid is not None and rid in self.pending:  # a reused id: let the first finish
            self.pump(50)
            self.expire()
        if rid is None:
            self.null_expected += 1
        elif rid in self.pending:
            self.pending[rid].remaining += 1
        else:
            self.pending[rid] = Pending(1, time.monotonic() + self.timeout_s, what)
        self.sock.send_multipart(frames, copy=len(frames) > 1)
        self.tally.messages += 1

    def pump(self, timeout_ms: int) -> None:
        """Read every reply that arrives within ``timeout_ms`` (then whatever is queued)."""
        if not self.sock.poll(timeout_ms):
            return
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.take(frames)

    def take(self, frames: list[zmq.Frame]) -> None:
        t = self.tally
        try:
            header = transport.decode(frames[0].buffer, max_bytes=1 << 30)
        except transport.CodecError as exc:
            t.bad_replies.append(f"undecodable reply: {exc}")
            return
        rid, ok = header.get("id"), header.get("ok")
        final = ok is False or bool(header.get("done", "event" not in header))
        if (
            header.get("v") != 1
            or type(ok) is not bool
            or (rid is not None and type(rid) is not int)
        ):
            t.bad_replies.append(f"malformed reply header: {_short(header)}")
            return
        pending = self.pending.get(rid) if rid is not None else None
        if rid is not None and pending is not None and pending.control is not None:
            if final:
                pending.control.update(header=header, buffers=[f.bytes for f in frames[1:]])
                del self.pending[rid]
            return
        what = pending.what if pending else f"id {rid}"
        error = header.get("error")
        error = error if isinstance(error, dict) else {}
        code = error.get("code") if not ok else "ok"
        if not ok:
            if not isinstance(error.get("message"), str):
                t.bad_replies.append(f"{what}: malformed error {_short(header)}")
            t.codes[str(code)] += 1
            if code not in CODES:
                t.undocumented.append(f"{what}: {_short(header)}")
            elif code == ErrorCode.INTERNAL:
                t.internal.append(f"{what}: {str(error.get('message'))[:300]}")
        elif final:
            t.codes["ok"] += 1
        if rid is None:
            t.null_replies += 1
            if ok:
                t.bad_replies.append(f"ok reply without an id: {_short(header)}")
            return
        if pending is None:
            if rid in self.expired:  # answered, but after --timeout: it counted as unanswered
                late_what, sent = self.expired[rid]
                t.late.append(f"{late_what}: final reply after {time.monotonic() - sent:.1f} s")
            else:
                t.strays.append(f"reply to an id never sent or already answered: {_short(header)}")
            return
        if not final:
            t.events += 1
            return
        t.replies += 1
        took = time.monotonic() - pending.sent
        op = pending.what.rpartition(" ")[2].rstrip(")")
        t.op_seconds[op] += took
        if ok:
            t.ok_ops[op] += 1
        if took > 2.0:
            t.slow.append(f"{pending.what}: {took:.1f} s, {code}")
        pending.remaining -= 1
        if pending.remaining == 0:
            del self.pending[rid]

    def expire(self) -> None:
        now = time.monotonic()
        for rid, p in list(self.pending.items()):
            if p.deadline < now:
                del self.pending[rid]
                self.expired[rid] = (p.what, p.sent)
                if p.control is None:
                    self.tally.unanswered.extend([p.what] * p.remaining)
                    continue
                p.control["timeout"] = True

    def settle(self, inflight: int) -> None:
        """Wait until at most ``inflight`` requests are open (expiring the overdue)."""
        while len(self.pending) > inflight:
            self.pump(20)
            self.expire()
            self.alive()

    def alive(self) -> None:
        """Raise ``Died`` when a watched process has exited (checked twice a second)."""
        if time.monotonic() - self.checked < 0.5:
            return
        self.checked = time.monotonic()
        for p in self.watch:
            if not p.alive():
                raise Died(f"{p.name} exited {p.popen.returncode}")

    def call(
        self,
        op: str,
        session: str | None = None,
        args: dict[str, Any] | None = None,
        timeout_s: float = 30.0,
    ) -> dict[str, Any]:
        """The fuzzer's own request; {"header", "buffers"} or {"timeout": True}."""
        self.control_ids += 1
        rid = self.control_ids
        header: dict[str, Any] = {"v": 1, "id": rid, "op": op}
        if session is not None:
            header["session"] = session
        if args:
            header["args"] = args
        slot: dict[str, Any] = {}
        self.pending[rid] = Pending(1, time.monotonic() + timeout_s, op, slot)
        self.sock.send(transport.encode(header))
        while rid in self.pending:
            self.pump(20)
            self.expire()
            self.alive()
        return slot


def _short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 300 else text[:297] + "..."


# -- processes -----------------------------------------------------------------


# Log events that mean an exception got past the code meant to turn it into a fault.
CRASH_EVENTS = {"unexpected_error", "render_failed", "reply_unencodable", "send_failed"}
# Address space per started process: a request that makes a worker allocate
# without bound must fail there, not make the kernel's OOM killer pick
# processes on a shared machine (one such request asked for 24 GB).
MEMORY_LIMIT = 8 << 30


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


class Proc:
    """A process under test, on ``ipc://`` in the work directory, logging there."""

    def __init__(self, name: str, cmd: list[str], tmp: Path) -> None:
        self.name = name
        self.endpoint = f"ipc://{tmp}/{name}.sock"
        self.log = tmp / f"{name}.log"
        full = [sys.executable, "-m", *cmd, "--bind", self.endpoint, "--log-format", "json"]
        with self.log.open("wb") as out:
            self.popen = subprocess.Popen(
                full, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_limit_memory
            )

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_ready(self, ctx: zmq.Context[Any], timeout_s: float = 300) -> None:
        end = time.monotonic() + timeout_s
        probe = Conn(ctx, self.endpoint, Tally(), 1.0)
        try:
            while time.monotonic() < end and self.alive():
                if "header" in probe.call("ping", timeout_s=1.0):
                    return
        finally:
            probe.close()
        self.stop()
        raise SystemExit(f"{self.name} did not start:\n{self.tail()}")

    def crashes_logged(self) -> list[str]:
        """Exceptions the process caught and logged (a turn, a handler, a job
        that crashed): answered or not, each is a bug the replies may hide."""
        found = []
        if self.log.exists():
            with self.log.open(errors="replace") as lines:
                for line in lines:
                    if '"error"' not in line:
                        continue
                    try:
                        entry = json.loads(line)
                    except ValueError:
                        continue  # llama.cpp's own stderr lines
                    event = str(entry.get("event"))
                    if event.endswith("_crashed") or event in CRASH_EVENTS:
                        found.append(f"{self.name}: {event}: {str(entry.get('exception'))[-300:]}")
        return found

    def tail(self) -> str:
        """The log's last lines, refusals left out (they are the fuzzer's doing)."""
        if not self.log.exists():
            return ""
        lines = self.log.read_text(errors="replace").splitlines()
        return "\n".join([x for x in lines if '"request_failed"' not in x][-20:])[-4000:]

    def stop(self) -> None:
        if self.alive():
            self.popen.terminate()
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


# One compute thread: on a shared 2-core box two OpenMP threads spin against
# the fuzzer and each other (measured: a 4-token generate 0.36 s vs 5 s under
# load). A short admission timeout: a generation waiting for a lane is answered
# ``deadline_exceeded`` soon instead of holding the window.
WORKER = ["worker.cli", "--lanes", "4", "--ctx", "4096", "--threads", "1"]
WORKER += ["--admission-timeout-ms", "1000"]


def spawn(target: str, tmp: Path) -> list[Proc]:
    """Start what a target needs (not waiting); the one(s) to fuzz first.

    Every target's processes start at once, so model loads overlap: a stage
    head does not need its next stage until a forward (it connects lazily).
    """
    if target == "worker":
        return [Proc("worker", WORKER, tmp)]
    if target == "speech":
        return [Proc("speech", ["speech.cli", "--threads", "1"], tmp)]
    tail = Proc("stage1", [*WORKER, "--layers", "9:18"], tmp)
    return [Proc("stage0", [*WORKER, "--layers", "0:9", "--next", tail.endpoint], tmp), tail]


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
            tally.pings_failed.append(f"after case {i}: {_short(pong)}")
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
