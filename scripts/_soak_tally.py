"""What ``scripts/soak.py`` and its load threads (``soak_mix.py``) share.

Why a module of its own: the topology the load talks to, the ``Tally`` every
actor records into (errors split into expected and unexpected, see
``soak_mix``) and the soak reads while sampling and at the end, and the
sessions the soak still owns (dropped when the load stops) are read by both
sides; the actors' own code is not.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# Codes any load action may meet on a busy cluster without anything being wrong.
LOAD_CODES = frozenset({"lanes_busy", "queue_full"})
UNEXPECTED_KEPT = 200  # first N unexpected errors kept verbatim in the summary


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
