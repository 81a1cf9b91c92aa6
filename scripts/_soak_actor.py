"""What every action of ``scripts/soak_mix.py`` stands on: an actor's sockets and draws.

Why a module of its own: ``ActorBase`` is the plumbing under the mix (the
actor's gateway connection and a direct one per worker, rebuilt after a
client timeout so late replies cannot pile up; its random source; session
names, prompts and sampling drawn from it; dropping a session it made;
following a stream), so ``soak_mix.Actor`` holds only the loop and the
actions.
"""

from __future__ import annotations

import itertools
import random
import threading
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


class ActorBase:
    """One load thread's connections, random draws and session bookkeeping."""

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
        self.actors = actors  # how many run side by side (for the opening: soak_mix)
        self.topo = topo
        self.tally = tally
        self.owned = owned
        self.stop = stop
        self.rng = random.Random(seed)
        self.timeout_ms = timeout_ms
        self.gw = Client(topo.gateway, timeout_ms=timeout_ms)
        self.direct = {ep: Client(ep, timeout_ms=timeout_ms) for ep in topo.workers}
        self.continuations: dict[str, list[int]] = {}  # prompt -> greedy tokens seen

    def close(self) -> None:
        self.gw.close()
        for c in self.direct.values():
            c.close()

    def _reconnect(self) -> None:
        self.close()
        self.gw = Client(self.topo.gateway, timeout_ms=self.timeout_ms)
        self.direct = {ep: Client(ep, timeout_ms=self.timeout_ms) for ep in self.topo.workers}

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
