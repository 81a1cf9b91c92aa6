"""The mixed load of ``scripts/soak.py``: what each client thread does.

Why a mix rather than one op: leaks hide in the paths a benchmark never
takes — a stream cut by ``cancel``, a peer that vanishes mid-stream, a
session moved between workers, a header that fails validation, a frame
output that allocates a buffer. Each ``Actor`` (one thread, its own
sockets) runs every action once (the actors starting at different points,
so every kind runs early in a short soak on a slow machine), then draws
actions by weight; each runs to its end (including the
``drop`` of what it created, so stopping the load never strands a session
on purpose) and records what happened in a shared ``Tally``.

Client side only: ``protocol`` and the standard library; nothing from
``worker/``. Ordinary traffic goes through the gateway; migrations and a
share of the disconnects and bad input talk to the workers directly
(the gateway has no op that moves one session; ``gateway_drain`` would
retire a worker until it restarts).

Errors are split in two. *Expected* codes are part of the load: a bad-input
probe's own code, ``cancelled`` after a ``cancel``, ``lanes_busy`` /
``queue_full`` when the lanes are full. Anything else is *unexpected* and
fails the soak (``internal``, ``worker_unavailable``, a client ``timeout``,
a probe answered with another code than the one it provokes).
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from protocol import Client, Reply, SkiffError, frames

# Codes any load action may meet on a busy cluster without anything being wrong.
LOAD_CODES = frozenset({"lanes_busy", "queue_full"})
UNEXPECTED_KEPT = 200  # first N unexpected errors kept verbatim in the summary

SYSTEM = (
    "You are a careful assistant for a small shipping company. Answer in plain "
    "English, in at most three sentences, and never invent tracking numbers. "
    "The company ships parcels, pallets and letters across the coast, runs two "
    "warehouses and closes on public holidays. Customers often ask about delays, "
    "lost parcels, prices, customs forms and opening hours. "
)
QUESTIONS = (
    "Where is my parcel?",
    "How much does a pallet to the north coast cost?",
    "Are you open on Monday?",
    "What forms do I need for customs?",
    "My letter arrived wet. What can I do?",
    "Can I change the delivery address after shipping?",
    "Tell me a short story about a lighthouse.",
    "List three colours of the sea at dusk.",
)
SPEECH_TEXTS = (
    "Your parcel is on its way.",
    "The warehouse opens at eight.",
    "Thank you for calling.",
)


@dataclass
class Topology:
    """What the load talks to, learned from the gateway (``gateway_status``, ``info``)."""

    gateway: str
    workers: list[str]
    speech: list[str]
    n_vocab: int
    n_embd: int
    n_ctx_per_lane: int
    max_request_bytes: int


@dataclass
class Tally:
    """Everything the actors saw, shared by all of them (one lock)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    actions: Counter[str] = field(default_factory=Counter)  # finished actions
    failed_actions: Counter[str] = field(default_factory=Counter)
    tokens: int = 0  # generated tokens received (streamed or in results)
    errors: Counter[str] = field(default_factory=Counter)  # every error reply, by code
    expected: Counter[str] = field(default_factory=Counter)
    unexpected: Counter[str] = field(default_factory=Counter)
    unexpected_samples: list[dict[str, Any]] = field(default_factory=list)
    checks_failed: Counter[str] = field(default_factory=Counter)  # replies of the wrong shape

    def add_tokens(self, n: int) -> None:
        with self.lock:
            self.tokens += n

    def error(self, action: str, code: str, message: str, expected: bool) -> None:
        with self.lock:
            self.errors[code] += 1
            if expected:
                self.expected[code] += 1
                return
            self.unexpected[code] += 1
            if len(self.unexpected_samples) < UNEXPECTED_KEPT:
                self.unexpected_samples.append(
                    {"t": round(time.time(), 3), "action": action, "code": code, "message": message}
                )

    def check(self, action: str, ok: bool, what: str) -> None:
        """A reply that came back ``ok`` but not as the protocol says: unexpected."""
        if not ok:
            with self.lock:
                self.checks_failed[f"{action}: {what}"] += 1
            self.error(action, "check_failed", what, expected=False)

    def done(self, action: str, ok: bool) -> None:
        with self.lock:
            self.actions[action] += 1
            if not ok:
                self.failed_actions[action] += 1

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                "actions": dict(self.actions),
                "failed_actions": dict(self.failed_actions),
                "tokens": self.tokens,
                "errors_by_code": dict(self.errors),
                "expected_by_code": dict(self.expected),
                "unexpected_by_code": dict(self.unexpected),
                "unexpected_samples": list(self.unexpected_samples),
                "checks_failed": dict(self.checks_failed),
            }


class Owned:
    """Named sessions the soak created and has not dropped yet, with where
    they live (the gateway, or a worker's endpoint for direct ones)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[str, str] = {}

    def add(self, session: str, where: str) -> None:
        with self._lock:
            self._sessions[session] = where

    def discard(self, session: str) -> None:
        with self._lock:
            self._sessions.pop(session, None)

    def items(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self._sessions.items())

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)


class Expect(Exception):
    """Raised inside an action to say the error it ended on was expected."""


WEIGHTS: dict[str, int] = {
    "generate": 24,
    "chat": 12,
    "verify": 8,
    "frames": 10,
    "migrate": 8,
    "cancel": 10,
    "disconnect": 10,
    "bad_input": 12,
    "speech": 6,
}

_session_ids = itertools.count(1)


class Actor:
    """One load thread: its own gateway connection and direct worker connections."""

    def __init__(
        self,
        index: int,
        topo: Topology,
        tally: Tally,
        owned: Owned,
        stop: threading.Event,
        seed: int,
        timeout_ms: int = 60_000,
        actors: int = 1,
    ) -> None:
        self.index = index
        self.actors = actors  # how many run side by side (for the opening, see run)
        self.topo = topo
        self.tally = tally
        self.owned = owned
        self.stop = stop
        self.rng = random.Random(seed)
        self.timeout_ms = timeout_ms
        self.gw = Client(topo.gateway, timeout_ms=timeout_ms)
        self.direct = {ep: Client(ep, timeout_ms=timeout_ms) for ep in topo.workers}
        self.continuations: dict[str, list[int]] = {}  # prompt -> greedy tokens seen
        names = [a for a in WEIGHTS if a != "speech" or topo.speech]
        if len(topo.workers) < 2:
            names.remove("migrate")
        self.names = names
        self.weights = [WEIGHTS[a] for a in names]
        self.actions: dict[str, Callable[[], None]] = {
            "generate": self.generate,
            "chat": self.chat,
            "verify": self.verify,
            "frames": self.frames,
            "migrate": self.migrate,
            "cancel": self.cancel,
            "disconnect": self.disconnect,
            "bad_input": self.bad_input,
            "speech": self.speech,
        }

    # -- the loop -------------------------------------------------------------

    def opening(self) -> list[str]:
        """Every action once, starting at this actor's share of the list: the
        actors together run each kind within their first few actions, however
        few a slow machine gets through in a short soak."""
        share = -(-len(self.names) // max(1, self.actors))
        start = (self.index * share) % len(self.names)
        return self.names[start:] + self.names[:start]

    def run(self) -> None:
        try:
            for name in self.opening():
                if self.stop.is_set():
                    return
                self.run_action(name)
            while not self.stop.is_set():
                name = self.rng.choices(self.names, self.weights)[0]
                self.run_action(name)
        finally:
            self.close()

    def run_action(self, name: str) -> None:
        ok = True
        try:
            self.actions[name]()
        except SkiffError as exc:
            ok = exc.code in LOAD_CODES
            self.tally.error(name, exc.code, exc.message, expected=ok)
            if exc.code == "timeout":
                self._reconnect()  # late replies must not pile up in a stash
                time.sleep(0.5)
            elif exc.code == "queue_full":
                time.sleep((exc.retry_after_ms or 200) / 1000)
        except Exception as exc:  # a bug in the soak or a malformed reply
            ok = False
            self.tally.error(name, "client_exception", repr(exc), expected=False)
        self.tally.done(name, ok)

    def close(self) -> None:
        self.gw.close()
        for c in self.direct.values():
            c.close()

    def _reconnect(self) -> None:
        self.close()
        self.gw = Client(self.topo.gateway, timeout_ms=self.timeout_ms)
        self.direct = {ep: Client(ep, timeout_ms=self.timeout_ms) for ep in self.topo.workers}

    # -- helpers --------------------------------------------------------------

    def _session(self) -> str:
        return f"soak-{self.index}-{next(_session_ids)}"

    def _prompt(self) -> str:
        q = self.rng.choice(QUESTIONS)
        # Half the prompts share a long system prefix: prefix cache and
        # cache-aware routing see hits; the other half are short and cold.
        return SYSTEM + q if self.rng.random() < 0.5 else q

    def _sampling(self) -> dict[str, Any] | None:
        r = self.rng.random()
        if r < 0.5:
            return None  # greedy
        if r < 0.8:
            return {"temperature": 0.8, "top_p": 0.95, "seed": self.rng.randrange(1 << 31)}
        return {"temperature": 0.7, "repeat_penalty": 1.1, "top_k": 20}

    def _drop(self, client: Client, session: str) -> None:
        """Drop a session we made; unknown to the worker (never admitted) is fine."""
        try:
            client.drop(session)
        except SkiffError as exc:
            if exc.code != "session_not_active":
                raise
            self.tally.error("drop", exc.code, exc.message, expected=True)
        self.owned.discard(session)

    def _stream(self, client: Client, req_id: int, limit: int | None = None) -> Iterator[Reply]:
        """Events of ``req_id`` until done (or ``limit`` token events)."""
        seen = 0
        for reply in client.follow(req_id):
            yield reply
            if "event" in reply.header and reply.header.get("event") == "token":
                seen += 1
                if limit is not None and seen >= limit:
                    return

    # -- actions --------------------------------------------------------------

    def generate(self) -> None:
        """A streamed generation through the gateway, ephemeral or on a session."""
        args: dict[str, Any] = {"prompt": self._prompt(), "max_tokens": self.rng.randint(8, 40)}
        sampling = self._sampling()
        if sampling is not None:
            args["sampling"] = sampling
        session = self._session() if self.rng.random() < 0.3 else None
        if session is not None:
            self.owned.add(session, "gateway")
        try:
            tokens: list[int] = []
            final: dict[str, Any] = {}
            for reply in self.gw.generate(args, session=session):
                if reply.header.get("event") == "token":
                    tokens.append(int(reply.header["token"]))
                elif reply.done:
                    final = reply.header
            self.tally.add_tokens(len(tokens))
            self.tally.check(
                "generate",
                final.get("finish_reason") in ("stop", "length")
                and final.get("usage", {}).get("completion_tokens") == len(tokens),
                "done event: finish_reason and usage.completion_tokens",
            )
            if sampling is None and tokens:
                self.continuations[args["prompt"]] = tokens
        finally:
            if session is not None:
                self._drop(self.gw, session)

    def chat(self) -> None:
        """Two turns of a named chat then drop, or a one-shot streamed chat."""
        first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello!"}]
        if self.rng.random() < 0.3:
            args = {"messages": first, "max_tokens": 16, "stream": True}
            n = sum(
                1 for r in self.gw.stream("chat", None, args) if r.header.get("event") == "token"
            )
            self.tally.add_tokens(n)
            return
        session = self._session()
        self.owned.add(session, "gateway")
        try:
            for messages in (first, [{"role": "user", "content": self.rng.choice(QUESTIONS)}]):
                result = self.gw.chat(messages, session=session, max_tokens=16)
                self.tally.add_tokens(int(result.get("usage", {}).get("completion_tokens", 0)))
                self.tally.check("chat", isinstance(result.get("text"), str), "chat result text")
        finally:
            self._drop(self.gw, session)

    def verify(self) -> None:
        """``prefill_sampled`` then ``verify`` of a draft (a greedy
        continuation seen earlier, so some drafts are accepted), then drop."""
        prompt = self._prompt()
        session = self._session()
        self.owned.add(session, "gateway")
        try:
            tokens = self.gw.tokenize(prompt)
            t0 = int(self.gw.prefill_sampled(session, tokens)["token"])
            seen = self.continuations.get(prompt)
            drafts = seen[1:9] if seen and seen[0] == t0 else [self.rng.randrange(1000, 5000)] * 4
            result = self.gw.call("verify", session, {"tokens": [t0, *drafts]}).result
            accepted = int(result["accepted"])
            self.tally.check(
                "verify",
                0 <= accepted <= len(drafts) and len(result["predicted"]) >= accepted + 1,
                "verify accepted/predicted",
            )
        finally:
            self._drop(self.gw, session)

    def frames(self) -> None:
        """Tensor outputs: hidden rows of a prefill, logits of a decode, an
        embedding, hidden rows per streamed token, or an echoed frame."""
        kind = self.rng.choice(("prefill_decode", "embed", "generate", "echo"))
        t = self.topo
        if kind == "embed":
            reply = self.gw.embed(text=self.rng.choice(QUESTIONS), pooling="mean")
            shape = list(reply.frame.array("embedding").shape)
            self.tally.check("frames", shape == [t.n_embd], "embed shape")
        elif kind == "echo":
            data = np.arange(self.rng.randint(1, 4096), dtype=np.float32)
            back = self.gw.echo(frames.make_frame([("hidden", data.reshape(-1, 1), 0)]))
            got = back.frame.array("hidden").reshape(-1)
            self.tally.check("frames", bool(np.array_equal(got, data)), "echo round trip")
        elif kind == "generate":
            args = {"prompt": self.rng.choice(QUESTIONS), "max_tokens": 4, "output": ["hidden"]}
            n = 0
            for reply in self.gw.generate(args):
                if reply.header.get("event") == "token":
                    n += 1
                    shape = list(reply.frame.array("hidden").shape)
                    self.tally.check("frames", shape == [1, t.n_embd], "hidden row per token")
            self.tally.add_tokens(n)
        else:
            session = self._session()
            self.owned.add(session, "gateway")
            try:
                tokens = self.gw.tokenize(self.rng.choice(QUESTIONS))
                reply = self.gw.prefill(session, tokens, output=["hidden"])
                shape = list(reply.frame.array("hidden").shape)
                self.tally.check("frames", shape == [len(tokens), t.n_embd], "prefill hidden")
                out = self.gw.decode(session, tokens[-1], output=["logits"])
                shape = list(out.frame.array("logits").shape)
                self.tally.check("frames", shape == [1, t.n_vocab], "decode logits")
                self.tally.add_tokens(1)
            finally:
                self._drop(self.gw, session)

    def migrate(self) -> None:
        """A session generated on one worker, moved to another
        (``export_state`` -> ``import_state`` -> ``drop``, straight to the
        workers), generated on there, dropped."""
        a_ep, b_ep = self.rng.sample(self.topo.workers, 2)
        a, b = self.direct[a_ep], self.direct[b_ep]
        session = self._session()
        self.owned.add(session, a_ep)
        where = a
        try:
            args = {"prompt": self._prompt(), "max_tokens": 8, "stream": False}
            sampling = self._sampling()
            if sampling is not None:
                args["sampling"] = sampling
            first = a.call("generate", session, args).result
            self.tally.add_tokens(int(first["usage"]["completion_tokens"]))
            try:
                position = a.migrate(session, to=b)
            except SkiffError as exc:
                if exc.code not in LOAD_CODES:
                    raise
                # The import was refused (no free lane there): the session stays on a.
                self.tally.error("migrate", exc.code, exc.message, expected=True)
                return
            where = b
            self.owned.add(session, b_ep)
            self.tally.check("migrate", position > 0, "imported position")
            # The next turn: the token shown last is fed first, then the new text.
            turn = {"prompt": " Tell me more.", "max_tokens": 8, "stream": False}
            more = b.call("generate", session, turn).result
            self.tally.add_tokens(int(more["usage"]["completion_tokens"]))
        finally:
            self._drop(where, session)

    def cancel(self) -> None:
        """A long stream cancelled after a few tokens: ends ``cancelled``."""
        session = self._session() if self.rng.random() < 0.3 else None
        if session is not None:
            self.owned.add(session, "gateway")
        try:
            args = {"prompt": self._prompt(), "max_tokens": 200, "ignore_eos": True, "stream": True}
            req_id = self.gw.send("generate", session, args)
            n = 0
            final: dict[str, Any] = {}
            for reply in self._stream(self.gw, req_id, limit=self.rng.randint(1, 6)):
                n += reply.header.get("event") == "token"
                final = reply.header if reply.done else {}
            if not final:  # (200 tokens take seconds: the stream is still running)
                self.gw.cancel(req_id)
                for reply in self._stream(self.gw, req_id):
                    n += reply.header.get("event") == "token"
                    final = reply.header
            self.tally.add_tokens(n)
            self.tally.check(
                "cancel",
                final.get("finish_reason") == "cancelled",
                "a cancelled stream ends with finish_reason cancelled",
            )
        finally:
            if session is not None:
                self._drop(self.gw, session)

    def disconnect(self) -> None:
        """A client that goes away mid-stream (or before its first token):
        its socket is closed; the gateway / worker must cancel its work and
        free the lane. A named session is then dropped from another socket."""
        direct = self.rng.random() < 0.25
        endpoint = self.rng.choice(self.topo.workers) if direct else self.topo.gateway
        limit = self.rng.randint(0, 5)  # token events read before going away
        # A named session only once its stream has started: a request closed
        # unsent (limit 0, LINGER 0) could otherwise reach the gateway after
        # the drop sent on another socket and leave the session behind.
        session = self._session() if limit and self.rng.random() < 0.3 else None
        owner = self.direct[endpoint] if direct else self.gw
        if session is not None:
            self.owned.add(session, endpoint if direct else "gateway")
        gone = Client(endpoint, timeout_ms=self.timeout_ms)
        try:
            args = {"prompt": self._prompt(), "max_tokens": 200, "ignore_eos": True, "stream": True}
            req_id = gone.send("generate", session, args)
            if limit:
                n = sum(1 for _ in self._stream(gone, req_id, limit=limit))
                self.tally.add_tokens(n)
        finally:
            gone.close()
        if session is not None:
            # Ordered after the stream on the worker (which the gateway or the
            # worker cancels when its next event finds the peer gone).
            self._drop(owner, session)

    def bad_input(self) -> None:
        """One malformed or refused request on a fresh socket; the reply's
        code must be the one the probe provokes."""
        name, frames_out, want = self.rng.choice(self._probes())
        targets = [self.topo.gateway] * 3 + self.topo.workers + self.topo.speech[:1]
        endpoint = self.rng.choice(targets)
        if endpoint in self.topo.speech and not name.startswith(("raw", "envelope")):
            endpoint = self.topo.gateway  # op probes are LLM probes
        with Client(endpoint, timeout_ms=self.timeout_ms) as c:
            c.send_raw(frames_out)
            reply = c.recv_any()
        code = str((reply.header.get("error") or {}).get("code", "ok"))
        # A prompt past a lane is refused as too long either way: by the
        # per-request token limit (limit_exceeded) or by the lane (context_overflow).
        if code == want or (want == "context_overflow" and code == "limit_exceeded"):
            self.tally.error("bad_input", code, name, expected=True)
        else:
            self.tally.error(
                "bad_input", code, f"probe {name} at {endpoint}: wanted {want}", expected=False
            )

    def _probes(self) -> list[tuple[str, list[Any], str]]:
        t = self.topo

        def req(header: dict[str, Any], *buffers: bytes) -> list[Any]:
            return [msgpack.packb(header, use_bin_type=True), *buffers]

        def op(name: str, session: str | None = None, **args: Any) -> dict[str, Any]:
            h: dict[str, Any] = {"v": 1, "id": 7, "op": name, "args": args}
            if session is not None:
                h["session"] = session
            return h

        nested: Any = 1
        for _ in range(40):
            nested = [nested]
        bad_frame = {  # a 1x4 f32 part whose nbytes lies
            "version": 1,
            "producer_stage": 0,
            "layer_start": 0,
            "layer_end": 1,
            "token_count": 1,
            "sequence_count": 1,
            "parts": [
                {
                    "identity": "hidden",
                    "dtype": "f32",
                    "dims": [1, 4],
                    "byte_strides": [16, 4],
                    "token_axis": 0,
                    "buffer": 0,
                    "offset": 0,
                    "nbytes": 999,
                }
            ],
        }
        probes: list[tuple[str, list[Any], str]] = [
            ("raw not msgpack", [b"\xc1\xc1 not msgpack"], "bad_request"),
            ("raw not a map", req([1, 2, 3]), "bad_request"),  # type: ignore[arg-type]
            ("envelope no v", req({"id": 1, "op": "ping"}), "unsupported_version"),
            ("envelope v=2", req({"v": 2, "id": 1, "op": "ping"}), "unsupported_version"),
            ("envelope id str", req({"v": 1, "id": "x", "op": "ping"}), "bad_request"),
            (
                "envelope args list",
                req({"v": 1, "id": 1, "op": "stats", "args": []}),
                "bad_request",
            ),
            (
                "envelope deep",
                req({"v": 1, "id": 1, "op": "ping", "args": {"x": nested}}),
                "bad_request",
            ),
            ("unknown op", req(op("frobnicate")), "unknown_op"),
            ("long session", req(op("drop", "s" * 300)), "bad_request"),
            (
                "bad sampling",
                req(op("generate", prompt="hi", sampling={"top_q": 1})),
                "bad_request",
            ),
            (
                "token range",
                req(op("generate", tokens=[t.n_vocab + 5], max_tokens=2)),
                "bad_request",
            ),
            (
                "context overflow",
                req(op("generate", tokens=[100] * (t.n_ctx_per_lane + 16), max_tokens=2)),
                "context_overflow",
            ),
            (
                "export unknown session",  # (a decode would admit it: a new session)
                req(op("export_state", "soak-ghost")),
                "session_not_active",
            ),
            ("verify empty", req(op("verify", "soak-ghost-v", tokens=[])), "bad_request"),
            ("bad frame", req(op("echo", frame=bad_frame), b"\0" * 16), "bad_request"),
        ]
        if self.rng.random() < 0.1:  # a few MiB each: now and then, not every time
            big = {
                "v": 1,
                "id": 1,
                "op": "tokenize",
                "args": {"text": "x" * (t.max_request_bytes + 1024)},
            }
            probes.append(("oversized header", req(big), "payload_too_large"))
        return probes

    def speech(self) -> None:
        """A short synthesis through the gateway; now and then a streamed one cancelled."""
        text = self.rng.choice(SPEECH_TEXTS)
        if self.rng.random() < 0.25:
            req_id = self.gw.send("synthesize", None, {"text": text + " " + text, "stream": True})
            if next(iter(self.gw.follow(req_id))).done:
                return  # (two sentences are two chunks: not expected)
            self.gw.cancel(req_id)
            try:
                for _ in self.gw.follow(req_id):
                    pass
            except SkiffError as exc:
                if exc.code != "cancelled":
                    raise
                self.tally.error("speech", exc.code, exc.message, expected=True)
            return
        reply = self.gw.call("synthesize", None, {"text": text})
        self.tally.check(
            "speech", len(reply.buffers) == 1 and reply.result.get("bytes", 0) > 0, "wav"
        )
