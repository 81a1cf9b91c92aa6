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

Beside it: ``_soak_actor.py`` (an actor's ``Sockets`` and ``Draws``, which
``Actor`` holds, and dropping a session or following a stream),
``_soak_probes.py`` (the bad-input probes and the action that sends one) and
``_soak_tally.py`` (what the actors and ``scripts/soak.py`` share:
``Topology``, ``Tally``, ``Owned``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _soak_actor import QUESTIONS, SPEECH_TEXTS, SYSTEM, Draws, Sockets, drop, stream
from _soak_probes import send_probe
from _soak_tally import LOAD_CODES, Owned, Tally, Topology

from protocol import SkiffError, frames

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


class Actor:
    """One load thread, the mix: every action once, then actions drawn by weight until
    told to stop. Its sockets and its random draws are the ``Sockets`` and ``Draws`` it holds."""

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
        self.draws = Draws(index, seed)
        self.rng = self.draws.rng
        self.sockets = Sockets(topo, timeout_ms)
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
            self.sockets.close()

    def run_action(self, name: str) -> None:
        ok = True
        try:
            self.actions[name]()
        except SkiffError as exc:
            ok = exc.code in LOAD_CODES
            self.tally.error(name, exc.code, exc.message, expected=ok)
            if exc.code == "timeout":
                self.sockets.reconnect()  # late replies must not pile up in a stash
                time.sleep(0.5)
            elif exc.code == "queue_full":
                time.sleep((exc.retry_after_ms or 200) / 1000)
        except Exception as exc:  # a bug in the soak or a malformed reply
            ok = False
            self.tally.error(name, "client_exception", repr(exc), expected=False)
        self.tally.done(name, ok)

    # -- actions --------------------------------------------------------------

    def generate(self) -> None:
        """A streamed generation through the gateway, ephemeral or on a session."""
        args: dict[str, Any] = {
            "prompt": self.draws.prompt(),
            "max_tokens": self.rng.randint(8, 40),
        }
        sampling = self.draws.sampling()
        if sampling is not None:
            args["sampling"] = sampling
        session = self.draws.session() if self.rng.random() < 0.3 else None
        if session is not None:
            self.owned.add(session, "gateway")
        try:
            tokens: list[int] = []
            final: dict[str, Any] = {}
            for reply in self.sockets.gw.generate(args, session=session):
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
                drop(self.sockets.gw, session, self.tally, self.owned)

    def chat(self) -> None:
        """Two turns of a named chat then drop, or a one-shot streamed chat."""
        first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello!"}]
        if self.rng.random() < 0.3:
            args = {"messages": first, "max_tokens": 16, "stream": True}
            n = sum(
                1
                for r in self.sockets.gw.stream("chat", None, args)
                if r.header.get("event") == "token"
            )
            self.tally.add_tokens(n)
            return
        session = self.draws.session()
        self.owned.add(session, "gateway")
        try:
            for messages in (first, [{"role": "user", "content": self.rng.choice(QUESTIONS)}]):
                result = self.sockets.gw.chat(messages, session=session, max_tokens=16)
                self.tally.add_tokens(int(result.get("usage", {}).get("completion_tokens", 0)))
                self.tally.check("chat", isinstance(result.get("text"), str), "chat result text")
        finally:
            drop(self.sockets.gw, session, self.tally, self.owned)

    def verify(self) -> None:
        """``prefill_sampled`` then ``verify`` of a draft (a greedy
        continuation seen earlier, so some drafts are accepted), then drop."""
        prompt = self.draws.prompt()
        session = self.draws.session()
        self.owned.add(session, "gateway")
        try:
            tokens = self.sockets.gw.tokenize(prompt)
            t0 = int(self.sockets.gw.prefill_sampled(session, tokens)["token"])
            seen = self.continuations.get(prompt)
            drafts = seen[1:9] if seen and seen[0] == t0 else [self.rng.randrange(1000, 5000)] * 4
            result = self.sockets.gw.call("verify", session, {"tokens": [t0, *drafts]}).result
            accepted = int(result["accepted"])
            self.tally.check(
                "verify",
                0 <= accepted <= len(drafts) and len(result["predicted"]) >= accepted + 1,
                "verify accepted/predicted",
            )
        finally:
            drop(self.sockets.gw, session, self.tally, self.owned)

    def frames(self) -> None:
        """Tensor outputs: hidden rows of a prefill, logits of a decode, an
        embedding, hidden rows per streamed token, or an echoed frame."""
        kind = self.rng.choice(("prefill_decode", "embed", "generate", "echo"))
        t = self.topo
        if kind == "embed":
            reply = self.sockets.gw.embed(text=self.rng.choice(QUESTIONS), pooling="mean")
            shape = list(reply.frame.array("embedding").shape)
            self.tally.check("frames", shape == [t.n_embd], "embed shape")
        elif kind == "echo":
            data = np.arange(self.rng.randint(1, 4096), dtype=np.float32)
            back = self.sockets.gw.echo(frames.make_frame([("hidden", data.reshape(-1, 1), 0)]))
            got = back.frame.array("hidden").reshape(-1)
            self.tally.check("frames", bool(np.array_equal(got, data)), "echo round trip")
        elif kind == "generate":
            args = {"prompt": self.rng.choice(QUESTIONS), "max_tokens": 4, "output": ["hidden"]}
            n = 0
            for reply in self.sockets.gw.generate(args):
                if reply.header.get("event") == "token":
                    n += 1
                    shape = list(reply.frame.array("hidden").shape)
                    self.tally.check("frames", shape == [1, t.n_embd], "hidden row per token")
            self.tally.add_tokens(n)
        else:
            session = self.draws.session()
            self.owned.add(session, "gateway")
            try:
                tokens = self.sockets.gw.tokenize(self.rng.choice(QUESTIONS))
                reply = self.sockets.gw.prefill(session, tokens, output=["hidden"])
                shape = list(reply.frame.array("hidden").shape)
                self.tally.check("frames", shape == [len(tokens), t.n_embd], "prefill hidden")
                out = self.sockets.gw.decode(session, tokens[-1], output=["logits"])
                shape = list(out.frame.array("logits").shape)
                self.tally.check("frames", shape == [1, t.n_vocab], "decode logits")
                self.tally.add_tokens(1)
            finally:
                drop(self.sockets.gw, session, self.tally, self.owned)

    def migrate(self) -> None:
        """A session generated on one worker, moved to another
        (``export_state`` -> ``import_state`` -> ``drop``, straight to the
        workers), generated on there, dropped."""
        a_ep, b_ep = self.rng.sample(self.topo.workers, 2)
        a, b = self.sockets.direct[a_ep], self.sockets.direct[b_ep]
        session = self.draws.session()
        self.owned.add(session, a_ep)
        where = a
        try:
            args = {"prompt": self.draws.prompt(), "max_tokens": 8, "stream": False}
            sampling = self.draws.sampling()
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
            drop(where, session, self.tally, self.owned)

    def cancel(self) -> None:
        """A long stream cancelled after a few tokens: ends ``cancelled``."""
        session = self.draws.session() if self.rng.random() < 0.3 else None
        if session is not None:
            self.owned.add(session, "gateway")
        try:
            args = {
                "prompt": self.draws.prompt(),
                "max_tokens": 200,
                "ignore_eos": True,
                "stream": True,
            }
            req_id = self.sockets.gw.send("generate", session, args)
            n = 0
            final: dict[str, Any] = {}
            for reply in stream(self.sockets.gw, req_id, limit=self.rng.randint(1, 6)):
                n += reply.header.get("event") == "token"
                final = reply.header if reply.done else {}
            if not final:  # (200 tokens take seconds: the stream is still running)
                self.sockets.gw.cancel(req_id)
                for reply in stream(self.sockets.gw, req_id):
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
                drop(self.sockets.gw, session, self.tally, self.owned)

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
        session = self.draws.session() if limit and self.rng.random() < 0.3 else None
        owner = self.sockets.direct[endpoint] if direct else self.sockets.gw
        if session is not None:
            self.owned.add(session, endpoint if direct else "gateway")
        gone = self.sockets.fresh(endpoint)
        try:
            args = {
                "prompt": self.draws.prompt(),
                "max_tokens": 200,
                "ignore_eos": True,
                "stream": True,
            }
            req_id = gone.send("generate", session, args)
            if limit:
                n = sum(1 for _ in stream(gone, req_id, limit=limit))
                self.tally.add_tokens(n)
        finally:
            gone.close()
        if session is not None:
            # Ordered after the stream on the worker (which the gateway or the
            # worker cancels when its next event finds the peer gone).
            drop(owner, session, self.tally, self.owned)

    def bad_input(self) -> None:
        """One malformed or refused request (``_soak_probes.send_probe``)."""
        send_probe(self.rng, self.topo, self.sockets, self.tally)

    def speech(self) -> None:
        """A short synthesis through the gateway; now and then a streamed one cancelled."""
        text = self.rng.choice(SPEECH_TEXTS)
        if self.rng.random() < 0.25:
            req_id = self.sockets.gw.send(
                "synthesize", None, {"text": text + " " + text, "stream": True}
            )
            if next(iter(self.sockets.gw.follow(req_id))).done:
                return  # (two sentences are two chunks: not expected)
            self.sockets.gw.cancel(req_id)
            try:
                for _ in self.sockets.gw.follow(req_id):
                    pass
            except SkiffError as exc:
                if exc.code != "cancelled":
                    raise
                self.tally.error("speech", exc.code, exc.message, expected=True)
            return
        reply = self.sockets.gw.call("synthesize", None, {"text": text})
        self.tally.check(
            "speech", len(reply.buffers) == 1 and reply.result.get("bytes", 0) > 0, "wav"
        )
