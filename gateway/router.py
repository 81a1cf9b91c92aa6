"""Routing policy, pure: which worker gets a new session or an ephemeral request.

Named sessions never come here once placed: the affinity table
(``gateway/affinity.py``) sends them to the worker holding their KV. What is
left is placing *new* work, three ways (``--policy``):

- ``cache_aware`` (default). Each worker's prefix cache keeps the KV of
  prompts it served on idle lanes, so a prompt that shares a long prefix with
  one a worker saw recently prefills mostly for free there. The gateway keeps
  an approximate per-worker index of the prompts it routed (chained BLAKE2b
  hashes of 16-token / 64-character blocks, LRU-bounded, in the spirit of
  SGLang's cache-aware router) and sends a prompt to the worker sharing the
  longest prefix of at least ``--cache-min-blocks`` blocks (default 8: 128
  tokens; a shorter match counts only at the prompt's home, below), but
  only while that worker's load score is within
  ``--balance-threshold`` (default 6: three more running requests and
  three free lanes fewer; docs/gateway.md says why) of the least loaded one,
  scaled down for matches shorter than ``--cache-full-blocks`` (default
  32: 512 tokens; ``Router.slack``).
  A prompt of at least one block also has a *home*: the first worker in
  the rendezvous ranking of its first blocks (up to ``--cache-min-blocks``)
  that holds fewer than its share of the prompts' homes, kept once given
  (``Router.home``: consistent hashing with bounded loads). The home counts
  as a full hit (``--cache-full-blocks`` matched) even before it has seen
  the prompt, and until another worker holds the prompt's start too (then
  real matches decide), so a fresh prompt goes to its home, not to whichever equally
  loaded worker's turn it is, unless the home is more than the threshold
  busier. No hit goes onto a worker with no free lane while another has one
  (the request would queue behind a whole generation there to save a
  prefill: measured, that imbalance cost the gateway 7-15% of throughput
  against round robin); otherwise least loaded wins. A hot prefix thus
  sticks to one worker until it is busier than the rest by more than the
  slack.
- ``least_loaded``: the lowest score ``4 * queued + running - free_lanes``.
  ``4 * waiting + running`` is vLLM's (and the Kubernetes inference
  gateway's) queue score: a waiting request costs more than a running one
  because it has not even started; subtracting free lanes prefers the worker
  with room, which matters for named sessions (they hold a lane until
  ``drop``) and for workers with different lane counts. Ties (same score,
  same free lanes) rotate, so equal workers take turns instead of the
  first by name taking every tie.
- ``round_robin``: the next eligible worker in turn (a baseline).

Everything here works on ``Candidate`` values, so it is unit-tested with
plain data and no sockets.
"""

from __future__ import annotations

import itertools
import struct
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any

TOKEN_BLOCK = 16  # token ids per prefix block
TEXT_BLOCK = 64  # characters per prefix block
MAX_BLOCKS = 1024  # blocks hashed per prompt (longer prompts: their first 1024 blocks)


@dataclass(frozen=True, slots=True)
class Candidate:
    """What routing knows of one eligible worker (estimated, not exact)."""

    name: str
    queued: int = 0
    running: int = 0
    free_lanes: int = 0

    @property
    def score(self) -> int:
        return 4 * self.queued + self.running - self.free_lanes


def prompt_blocks(args: Mapping[str, Any]) -> tuple[int, ...]:
    """Chained block hashes of a request's prompt: ``tokens``, ``prompt`` or
    ``messages``. Block ``i``'s hash covers blocks ``0..i``, so two prompts
    share ``k`` leading hashes exactly when they share their first ``k`` blocks
    (up to hash collisions, which only cost a cache miss). A trailing partial
    block is not hashed: a prompt shorter than one block has no blocks (and
    no home), its reuse on a worker too short to be worth a routing choice.
    The hashes are BLAKE2b, not ``hash()``: the same prompt has the same
    blocks, and so the same home, in every process (``Router.home``)."""
    tokens = args.get("tokens")
    if isinstance(tokens, list) and tokens:
        return _token_chain(tokens)
    prompt = args.get("prompt")
    if isinstance(prompt, str) and prompt:
        return _text_chain(prompt, 2)
    messages = args.get("messages")
    if isinstance(messages, list) and messages:
        text = "".join(
            f"\x1e{m.get('role', '')}\x1f{m.get('content', '')}"
            for m in messages
            if isinstance(m, dict)
        )
        return _text_chain(text, 3)
    return ()


def _token_chain(tokens: list[Any]) -> tuple[int, ...]:
    """Blocks of ``TOKEN_BLOCK`` ids, hashed as their little-endian int64s."""
    n = min(len(tokens) // TOKEN_BLOCK, MAX_BLOCKS) * TOKEN_BLOCK
    try:
        raw = struct.pack(f"<{n}q", *tokens[:n])
    except struct.error:
        return ()  # not token ids: the worker refuses it; routed by load
    return _chain(raw, TOKEN_BLOCK * 8, 1)


def _text_chain(text: str, salt: int) -> tuple[int, ...]:
    """Blocks of ``TEXT_BLOCK`` characters, hashed as UTF-8 (lone surrogates,
    which JSON can carry, passed through rather than refused)."""
    text = text[: min(len(text) // TEXT_BLOCK, MAX_BLOCKS) * TEXT_BLOCK]
    if text.isascii():  # one byte a character: cut the encoded text
        return _chain(text.encode("ascii"), TEXT_BLOCK, salt)
    blocks = [text[i : i + TEXT_BLOCK] for i in range(0, len(text), TEXT_BLOCK)]
    return _chain([b.encode("utf-8", "surrogatepass") for b in blocks], 0, salt)


def _chain(data: bytes | list[bytes], size: int, salt: int) -> tuple[int, ...]:
    """Per block (``size`` bytes of ``data``, or each item of a list), a
    64-bit hash over the previous block's digest and its bytes; the first
    over ``salt`` (one per kind, so tokens and text never share a hash)."""
    if isinstance(data, bytes):
        data = [data[i : i + size] for i in range(0, len(data), size)]
    digests: list[bytes] = []
    digest = salt.to_bytes(8, "little")
    for block in data:
        digest = blake2b(digest + block, digest_size=8).digest()
        digests.append(digest)
    return tuple(int.from_bytes(d, "little") for d in digests)


class PrefixIndex:
    """Per worker, the prompt blocks the gateway routed there, LRU-bounded.

    Approximate on purpose: it does not see the worker's evictions, only what
    was sent; a wrong guess costs one cold prefill, never a wrong answer."""

    def __init__(self, capacity: int = 65_536) -> None:
        self.capacity = max(1, capacity)
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def insert(self, worker: str, blocks: Sequence[int]) -> None:
        if not blocks:
            return
        lru = self._blocks.setdefault(worker, OrderedDict())
        for h in blocks:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def match(self, worker: str, blocks: Sequence[int]) -> int:
        """How many leading blocks of ``blocks`` ``worker`` has seen."""
        lru = self._blocks.get(worker)
        if not lru:
            return 0
        n = 0
        for h in blocks:
            if h not in lru:
                break
            n += 1
        return n

    def forget(self, worker: str) -> None:
        """The worker's cache is gone (it went down or restarted)."""
        self._blocks.pop(worker, None)

    def size(self, worker: str) -> int:
        return len(self._blocks.get(worker, ()))


@dataclass(frozen=True, slots=True)
class Routed:
    """Why the last choice went where it did (logged at debug by the placer:
    which repeats missed their cache, and why, is otherwise invisible).
    ``reason``: ``hit`` (a prefix the worker was sent), ``home`` (the
    prompt's home), ``load`` (no hit or home within its slack), or the
    policy's name."""

    worker: str
    reason: str
    home: str | None = None
    matched: int = 0  # blocks the chosen worker was sent before


class Router:
    """Chooses a worker among candidates by the configured policy."""

    def __init__(
        self,
        policy: str = "cache_aware",
        *,
        balance_threshold: float = 6.0,
        cache_min_blocks: int = 8,
        cache_full_blocks: int = 32,
        index: PrefixIndex | None = None,
    ) -> None:
        if policy not in ("cache_aware", "least_loaded", "round_robin"):
            raise ValueError(f"unknown routing policy {policy!r}")
        self.policy = policy
        self.balance_threshold = balance_threshold
        self.cache_min_blocks = max(1, cache_min_blocks)
        # a match this long may cost the whole threshold; shorter, a share
        self.cache_full_blocks = max(self.cache_min_blocks, cache_full_blocks)
        self.index = index or PrefixIndex()
        self.homes = HomeTable()
        self._turn = itertools.count()
        self.cache_routed = 0  # decisions that went to a prefix hit (for stats)
        self.last: Routed | None = None

    def choose(
        self, candidates: Sequence[Candidate], blocks: Sequence[int] = (), *, remember: bool = True
    ) -> str | None:
        """The worker for new work with prompt ``blocks``; None with no candidate.

        With ``remember`` the prompt's blocks are recorded for the chosen
        worker (it will hold that prefix once it has served the prompt)."""
        if not candidates:
            return None
        if self.policy == "round_robin":
            ordered = sorted(candidates, key=lambda c: c.name)
            chosen = ordered[next(self._turn) % len(ordered)].name
            self.last = Routed(chosen, self.policy)
        elif self.policy == "least_loaded" or not blocks:
            chosen = least_loaded(candidates, next(self._turn))
            self.last = Routed(chosen, "least_loaded")
        else:
            self.last = self._cache_aware(candidates, blocks, remember)
            chosen = self.last.worker
        if remember and self.policy == "cache_aware":
            self.index.insert(chosen, blocks)
        return chosen

    def _cache_aware(
        self, candidates: Sequence[Candidate], blocks: Sequence[int], remember: bool = True
    ) -> Routed:
        """The candidate sharing the longest prefix within its load slack,
        counting the prompt's home (``home``) as a full hit while no other
        candidate holds the prompt's start; else least loaded.

        Why the home: routed by prefix alone, a fresh prompt at equal load
        went to either worker by turn, so both workers' prefix caches held,
        and evicted each other's, the same prompts: measured, the workers
        behind the gateway recomputed ~11k prompt tokens per bench_gateway
        run against ~6.9k when the client routed directly. As a full hit the
        home takes its prompts until it is more than ``balance_threshold``
        busier than the least loaded worker (consistent hashing with a
        bounded load). The figures, before and after, are in docs/gateway.md.

        Why the credit ends once another worker holds the start: prompts
        sharing a start share a home, so with a shared system prompt every
        new conversation would go to one worker up to the whole threshold;
        once the system prompt is cached on both, the conversations spread
        by load, each staying where its own longer prefix is."""
        best_load = min(c.score for c in candidates)
        room_elsewhere = any(c.free_lanes > 0 for c in candidates)
        names = [c.name for c in candidates]
        home = self.home(names, blocks)
        if home is not None and remember:
            self.homes.settle(self._home_key(blocks), home)
        seen_by = {c.name: self.index.match(c.name, blocks) for c in candidates}
        held_elsewhere = any(
            n >= min(len(blocks), self.cache_min_blocks)
            for name, n in seen_by.items()
            if name != home
        )
        best: Candidate | None = None
        best_key = (0, 0, False)
        hit = False
        for c in candidates:
            seen = seen_by[c.name]
            credit = c.name == home and not held_elsewhere
            matched = max(seen, self.cache_full_blocks) if credit else seen
            if matched < self.cache_min_blocks or c.score > best_load + self.slack(matched):
                continue
            if room_elsewhere and c.free_lanes == 0:
                continue  # it would queue here while a lane waits elsewhere
            key = (matched, -c.score, c.name == home)
            if best is None or key > best_key:
                best, best_key, hit = c, key, seen >= self.cache_min_blocks
        if best is None:
            chosen = least_loaded(candidates, next(self._turn))
            return Routed(chosen, "load", home, seen_by[chosen])
        if hit:
            self.cache_routed += 1
        return Routed(best.name, "hit" if hit else "home", home, seen_by[best.name])

    def home(self, names: Sequence[str], blocks: Sequence[int]) -> str | None:
        """The prompt's home among ``names``; None for a prompt shorter than
        one block. Its key is its first ``cache_min_blocks`` blocks (all of
        them, if fewer): prompts sharing that start (a system prompt, one
        conversation's turns) share a home.

        Why short prompts too: the worker reuses any cached prefix of 8
        tokens or more, so a 50-token prompt sent again is a hit where it was
        served before. Routed by load alone, such prompts landed on both
        workers, and each worker's lanes then cached more prompts than they
        could hold, evicting each other's (bench_gateway: ~0.4-1k prompt
        tokens a run recomputed against direct round robin; docs/gateway.md).

        A key seen before keeps the home it was given (``HomeTable``). A new
        one goes to the first of the rendezvous (highest random weight)
        ranking of ``names`` that holds fewer than its share of the keys,
        ``ceil((keys + 1) / workers)``: consistent hashing with bounded loads.
        Why bounded: a few prompts hashed freely split unevenly (8 prompts on
        2 workers: 4-4 only 27% of the time, 6-2 or worse 29%), and the
        worker holding more homes than its idle lanes can cache evicts them
        from each other while the other worker's lanes stay empty. A worker
        that leaves moves only its own keys; with no key recorded the home
        is the rendezvous first, the same in every process."""
        if not blocks or not names:
            return None
        key = self._home_key(blocks)
        kept = self.homes.get(key)
        if kept in names:
            return kept
        share = -(-(self.homes.count(names) + 1) // len(names))
        ranked = sorted(names, key=lambda name: (_rank(key, name), name), reverse=True)
        return next((n for n in ranked if self.homes.held(n) < share), ranked[0])

    def _home_key(self, blocks: Sequence[int]) -> bytes:
        last = min(len(blocks), self.cache_min_blocks) - 1  # chained: covers blocks 0..last
        return (blocks[last] & _U64).to_bytes(8, "little")

    def slack(self, matched: int) -> float:
        """The load a prefix of ``matched`` blocks may cost over the least
        loaded worker: the whole ``balance_threshold`` from
        ``cache_full_blocks`` on, a share below. A hit saves prefill in
        proportion to its length, while the extra stream on the busier worker
        slows all its streams for the whole generation: a short shared prefix
        (a repeated 200-token prompt) pays only among equally loaded workers,
        a long one (a chat's growing conversation) pays even on a busier one."""
        return self.balance_threshold * min(1.0, matched / self.cache_full_blocks)

    def forget(self, worker: str) -> None:
        self.index.forget(worker)
        self.homes.forget(worker)


class HomeTable:
    """The home each prompt key was given, LRU-bounded, with a count per worker.

    What it remembers is only a placement: a key forgotten (aged out, or its
    worker gone) is placed again, which at worst costs one cold prefill."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = max(1, capacity)
        self._home: OrderedDict[bytes, str] = OrderedDict()
        self._held: dict[str, int] = {}

    def get(self, key: bytes) -> str | None:
        return self._home.get(key)

    def held(self, worker: str) -> int:
        return self._held.get(worker, 0)

    def count(self, workers: Sequence[str]) -> int:
        return sum(self.held(w) for w in workers)

    def settle(self, key: bytes, worker: str) -> None:
        """``key``'s home is ``worker`` (again: most recently used)."""
        old = self._home.pop(key, None)
        if old is not None:
            self._held[old] -= 1
        self._home[key] = worker
        self._held[worker] = self.held(worker) + 1
        while len(self._home) > self.capacity:
            _, gone = self._home.popitem(last=False)
            self._held[gone] -= 1

    def forget(self, worker: str) -> None:
        """The worker is gone: its keys are placed again when next seen."""
        for key in [k for k, w in self._home.items() if w == worker]:
            del self._home[key]
        self._held.pop(worker, None)


def least_loaded(candidates: Sequence[Candidate], turn: int = 0) -> str:
    """Lowest score, then more free lanes; among full ties (in name order)
    the ``turn``-th, so successive calls with a rising ``turn`` rotate."""
    key = min((c.score, -c.free_lanes) for c in candidates)
    tied = sorted(c.name for c in candidates if (c.score, -c.free_lanes) == key)
    return tied[turn % len(tied)]


_U64 = (1 << 64) - 1


def _rank(key: bytes, worker: str) -> int:
    """``worker``'s weight for a prompt's home key: the same in every process."""
    digest = blake2b(key + worker.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little")
