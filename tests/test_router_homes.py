"""A prompt's home in the gateway's ``cache_aware`` policy (pure policy, no
sockets).

A prompt of at least one block has a home worker, chosen by rendezvous
hashing of its first blocks (up to ``cache_min_blocks``) among the workers holding less than
their share of the homes (bounded loads), which counts as a full prefix hit:
at equal load the prompt goes home (so the workers' prefix caches hold their
own share of the prompts instead of evicting each other's), and load still
bounds it. The hashes are BLAKE2b, so the home is the same in every process: an
earlier version ranked by Python's per-process ``hash()`` and its tests
failed one run in two.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from gateway.router import TOKEN_BLOCK, Candidate, Router, prompt_blocks

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ["tcp://w-1:5555", "tcp://w-2:5555", "tcp://w-3:5555"]
PROMPTS: list[dict[str, Any]] = [
    {"tokens": list(range(7, 400))},
    {"prompt": "You are a helpful assistant. " * 40},
    {"prompt": "Réponds en français, s'il te plaît. " * 30},
    {
        "messages": [
            {"role": "system", "content": "Be brief. " * 80},
            {"role": "user", "content": "hi"},
        ]
    },
]

_CHILD = """
import json, sys
from gateway.router import Router, prompt_blocks
prompts, workers = json.load(sys.stdin)
router = Router()
json.dump([router.home(workers, prompt_blocks(p)) for p in prompts], sys.stdout)
"""


def _homes_in_child(seed: str) -> list[str | None]:
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=json.dumps([PROMPTS, WORKERS]),
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=True,
        timeout=60,
    )
    homes: list[str | None] = json.loads(out.stdout)
    return homes


def _idle(*names: str) -> list[Candidate]:
    return [Candidate(n, free_lanes=4) for n in names]


def _home_and_other(router: Router, blocks: tuple[int, ...]) -> tuple[str, str]:
    home = router.home(["a", "b"], blocks)
    assert home is not None
    return home, "b" if home == "a" else "a"


def test_the_home_is_the_same_in_every_process() -> None:
    router = Router()
    blocks = [prompt_blocks(p) for p in PROMPTS]
    assert all(len(b) >= router.cache_min_blocks for b in blocks)
    homes = [router.home(WORKERS, b) for b in blocks]
    assert len(set(homes)) > 1
    for seed in ("0", "4242"):  # str hashes differ between these processes
        assert _homes_in_child(seed) == homes


def test_equally_loaded_workers_send_a_fresh_prompt_home() -> None:
    blocks = prompt_blocks({"tokens": list(range(300))})
    home = Router().home(["a", "b"], blocks)
    assert home is not None
    for order in (["a", "b"], ["b", "a"]):
        router = Router()
        # whatever the turn (other prompts in between rotate least_loaded), home
        picks = []
        for _ in range(6):
            router.choose(_idle(*order))  # no prompt: rotates
            picks.append(router.choose(_idle(*order), blocks, remember=False))
        assert picks == [home] * 6
    assert Router().choose(_idle("a", "b"), blocks) == home  # and in a new router


def test_a_home_more_than_the_threshold_busier_loses_to_the_least_loaded() -> None:
    router = Router(balance_threshold=4)  # two more running requests, two fewer free lanes
    blocks = prompt_blocks({"prompt": "Summarise the following report. " * 30})
    home, other = _home_and_other(router, blocks)
    least = Candidate(other, running=1, free_lanes=3)  # score -2
    within = Candidate(home, running=3, free_lanes=1)  # score 2: 4 busier
    beyond = Candidate(home, running=4, free_lanes=1)  # score 3: 5 busier
    assert router.choose([least, within], blocks, remember=False) == home
    assert router.choose([least, beyond], blocks, remember=False) == other
    assert Router(balance_threshold=5).choose([least, beyond], blocks, remember=False) == home


def test_a_home_with_no_free_lane_loses_while_another_has_one() -> None:
    router = Router()
    blocks = prompt_blocks({"tokens": list(range(5000, 5300))})
    home, other = _home_and_other(router, blocks)
    full_home = Candidate(home, running=4, free_lanes=0)  # score 4
    room = Candidate(other, running=4, free_lanes=1)  # score 3: within the threshold
    assert router.choose([full_home, room], blocks, remember=False) == other
    # nobody has a free lane: the home may still take it
    both_full = [full_home, Candidate(other, running=4, free_lanes=0)]
    assert router.choose(both_full, blocks, remember=False) == home


def test_a_prompt_shorter_than_cache_min_blocks_is_kept_by_its_home() -> None:
    """A 50-token prompt sent again reuses its lane on the worker that
    served it (the worker reuses 8 tokens and more), so it has a home too:
    keyed by all its blocks, it goes there at equal load, while a prompt
    under one block rotates by least loaded."""
    router = Router()  # homes keyed by the first 8 blocks = 128 tokens
    short = prompt_blocks({"tokens": list(range(50))})
    assert len(short) == 3
    home, other = _home_and_other(router, short)
    picks = [router.choose(_idle("b", "a"), short) for _ in range(4)]
    assert picks == [home] * 4
    # its home within the threshold still takes it (a full hit, as a long prompt's)
    busier = [Candidate(home, running=1, free_lanes=3), Candidate(other, free_lanes=4)]
    assert router.choose(busier, short) == home
    # another prompt sharing only its first block has a home of its own key
    longer = prompt_blocks({"tokens": [*range(16), *range(900, 950)]})
    assert router._home_key(longer) != router._home_key(short)
    tiny = prompt_blocks({"tokens": list(range(TOKEN_BLOCK - 1))})
    assert tiny == () and router.home(["a", "b"], tiny) is None
    assert [router.choose(_idle("b", "a"), tiny) for _ in range(4)] == ["a", "b", "a", "b"]


def test_different_prompts_spread_over_the_workers() -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(32_000) for _ in range(rng.randrange(128, 600))] for _ in range(200)]
    router = Router()
    homes = Counter(
        router.choose(_idle("a", "b"), prompt_blocks({"tokens": p}), remember=False)
        for p in prompts
    )
    assert set(homes) == {"a", "b"} and all(60 <= n <= 140 for n in homes.values())


def test_a_prompt_start_shares_a_home_and_a_leaving_worker_moves_only_its_own() -> None:
    router = Router(cache_min_blocks=8)
    start = list(range(8 * TOKEN_BLOCK))
    one = prompt_blocks({"tokens": [*start, *range(500, 600)]})
    two = prompt_blocks({"tokens": [*start, *range(900, 1000)]})
    assert router.home(WORKERS, one) == router.home(WORKERS, two)  # e.g. one chat's turns
    rng = random.Random(3)
    prompts = [prompt_blocks({"tokens": rng.sample(range(32_000), 200)}) for _ in range(60)]
    before = [router.home(WORKERS, b) for b in prompts]
    after = [router.home(WORKERS[:2], b) for b in prompts]
    assert set(before) == set(WORKERS)
    assert all(a == b for a, b in zip(after, before, strict=True) if b != WORKERS[2])


def test_homes_are_shared_out_evenly_and_kept() -> None:
    """Eight prompts on two workers: hashed freely they split 4-4 only 27% of
    the time; bounded by their share, every split is 4-4, and a prompt seen
    again goes to the home it was given."""
    rng = random.Random(11)
    for _ in range(20):
        router = Router()
        prompts = [prompt_blocks({"tokens": rng.sample(range(32_000), 300)}) for _ in range(8)]
        routed = [router.choose(_idle("a", "b"), b) for b in prompts]
        assert Counter(routed) == {"a": 4, "b": 4}
        assert [router.choose(_idle("a", "b"), b) for b in prompts] == routed
        assert [router.home(["a", "b"], b) for b in prompts] == routed


def test_a_worker_that_leaves_gives_up_its_homes() -> None:
    router = Router()
    rng = random.Random(5)
    prompts = [prompt_blocks({"tokens": rng.sample(range(32_000), 300)}) for _ in range(6)]
    routed = [router.choose(_idle(*WORKERS), b) for b in prompts]
    assert Counter(routed) == {w: 2 for w in WORKERS}
    router.forget(WORKERS[2])
    again = [router.choose(_idle(*WORKERS[:2]), b) for b in prompts]
    assert all(a == r for a, r in zip(again, routed, strict=True) if r != WORKERS[2])
    assert Counter(again) == {WORKERS[0]: 3, WORKERS[1]: 3}
