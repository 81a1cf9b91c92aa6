"""What every action of ``scripts/soak_mix.py`` stands on: an actor's sockets and draws.

Why a module of its own: this is the plumbing under the mix, apart from the
loop and the actions. ``Sockets`` is an actor's gateway connection and a
direct one per worker (rebuilt after a client timeout so late replies cannot
pile up, plus fresh ones for a client that goes away or a probe); ``Draws``
is its seeded random source and what it draws from it (prompts, sampling)
besides its session names; ``drop`` and ``stream`` drop a session the load
made and follow a stream. ``soak_mix.Actor`` holds one ``Sockets`` and one
``Draws`` and calls these.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from typing import Any

from _soak_tally import Owned, Tally, Topology

from protocol import Client, Reply, SkiffError

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


_session_ids = itertools.count(1)


class Sockets:
    """One actor's connections: the gateway, and each worker directly."""

    def __init__(self, topo: Topology, timeout_ms: int) -> None:
        self.topo = topo
        self.timeout_ms = timeout_ms
        self.gw = Client(topo.gateway, timeout_ms=timeout_ms)
        self.direct = {ep: Client(ep, timeout_ms=timeout_ms) for ep in topo.workers}

    def fresh(self, endpoint: str) -> Client:
        """A socket of its own to ``endpoint`` (the caller closes it)."""
        return Client(endpoint, timeout_ms=self.timeout_ms)

    def close(self) -> None:
        self.gw.close()
        for c in self.direct.values():
            c.close()

    def reconnect(self) -> None:
        self.close()
        self.gw = Client(self.topo.gateway, timeout_ms=self.timeout_ms)
        self.direct = {ep: Client(ep, timeout_ms=self.timeout_ms) for ep in self.topo.workers}


class Draws:
    """One actor's random source (one seed: the same draws every run) and session names."""

    def __init__(self, index: int, seed: int) -> None:
        self.index = index
        self.rng = random.Random(seed)

    def session(self) -> str:
        return f"soak-{self.index}-{next(_session_ids)}"

    def prompt(self) -> str:
        q = self.rng.choice(QUESTIONS)
        # Half the prompts share a long system prefix: prefix cache and
        # cache-aware routing see hits; the other half are short and cold.
        return SYSTEM + q if self.rng.random() < 0.5 else q

    def sampling(self) -> dict[str, Any] | None:
        r = self.rng.random()
        if r < 0.5:
            return None  # greedy
        if r < 0.8:
            return {"temperature": 0.8, "top_p": 0.95, "seed": self.rng.randrange(1 << 31)}
        return {"temperature": 0.7, "repeat_penalty": 1.1, "top_k": 20}


def drop(client: Client, session: str, tally: Tally, owned: Owned) -> None:
    """Drop a session the load made; unknown to the worker (never admitted) is fine."""
    try:
        client.drop(session)
    except SkiffError as exc:
        if exc.code != "session_not_active":
            raise
        tally.error("drop", exc.code, exc.message, expected=True)
    owned.discard(session)


def stream(client: Client, req_id: int, limit: int | None = None) -> Iterator[Reply]:
    """Events of ``req_id`` until done (or ``limit`` token events)."""
    seen = 0
    for reply in client.follow(req_id):
        yield reply
        if "event" in reply.header and reply.header.get("event") == "token":
            seen += 1
            if limit is not None and seen >= limit:
                return
