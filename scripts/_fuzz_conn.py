"""One socket of ``scripts/fuzz.py``: sending cases, matching replies, counting.

Why a module of its own: ``Conn`` is the part of the fuzzer that judges
every reply (well-formed, a documented error code, within ``--timeout``,
matched to its request by id, ``internal`` noted) and ``Tally`` is what one
target's run found; the runner in ``fuzz.py`` only decides what to send
and when.
"""

from __future__ import annotations

import subprocess
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq

from faults import ErrorCode
from protocol import sockets, transport


class Watched(Protocol):
    """What a connection needs of a process it watches (``_fuzz_procs.Proc``);
    a protocol, so the socket side does not import the process side back."""

    name: str
    popen: subprocess.Popen[bytes]

    def alive(self) -> bool: ...

    def tail(self) -> str: ...


CODES = {c.value for c in ErrorCode}
CONTROL_IDS = 1 << 50  # the fuzzer's own ping / stats / drop: far from every case id


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
        watch: Sequence[Watched] = (),
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
            t.bad_replies.append(f"malformed reply header: {short(header)}")
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
                t.bad_replies.append(f"{what}: malformed error {short(header)}")
            t.codes[str(code)] += 1
            if code not in CODES:
                t.undocumented.append(f"{what}: {short(header)}")
            elif code == ErrorCode.INTERNAL:
                t.internal.append(f"{what}: {str(error.get('message'))[:300]}")
        elif final:
            t.codes["ok"] += 1
        if rid is None:
            t.null_replies += 1
            if ok:
                t.bad_replies.append(f"ok reply without an id: {short(header)}")
            return
        if pending is None:
            if rid in self.expired:  # answered, but after --timeout: it counted as unanswered
                late_what, sent = self.expired[rid]
                t.late.append(f"{late_what}: final reply after {time.monotonic() - sent:.1f} s")
            else:
                t.strays.append(f"reply to an id never sent or already answered: {short(header)}")
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


def short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 300 else text[:297] + "..."
