"""The gateway's tie rule for prompts (pure policy, no sockets).

Among equally loaded workers a prompt goes to its home (rendezvous hashing
on its first blocks), so every worker's prefix cache holds its own share of
the prompts. Load still comes first: a home never outweighs a lighter
worker, and a prompt with no blocks (or the ``least_loaded`` policy) still
rotates among ties.
"""

from __future__ import annotations

from collections import Counter

from gateway.router import Candidate, Router, least_loaded, prompt_blocks


def _level(*names: str) -> list[Candidate]:
    return [Candidate(n, running=2, free_lanes=2) for n in names]


def test_a_prompt_goes_home_whenever_loads_tie() -> None:
    router = Router("cache_aware")
    workers = _level("a", "b", "c")
    prompts = [prompt_blocks({"tokens": list(range(s, s + 200))}) for s in range(0, 12000, 200)]
    for w in workers:  # as after a warm-up that sent every prompt everywhere
        for blocks in prompts:
            router.index.insert(w.name, blocks)
    homes = [router.choose(workers, blocks) for blocks in prompts]
    # a hit everywhere: every later visit of a prompt goes to the same worker
    for _ in range(3):
        assert [router.choose(workers, blocks) for blocks in prompts] == homes
    # and the 60 prompts spread over the three workers, not onto one
    spread = Counter(homes)
    assert len(spread) == 3 and max(spread.values()) <= 40


def test_a_home_never_outweighs_load() -> None:
    router = Router("cache_aware")
    blocks = prompt_blocks({"tokens": list(range(300))})
    home = router.choose(_level("a", "b"), blocks)  # and it holds the prompt now
    other = "b" if home == "a" else "a"
    # 18 blocks may cost 1.125 of load (``slack``); the home is 2 busier
    busier_home = [
        Candidate(home, running=3, free_lanes=1),
        Candidate(other, running=2, free_lanes=2),
    ]
    assert router.choose(busier_home, blocks, remember=False) == other
    level = [Candidate(home, running=3, free_lanes=1), Candidate(other, running=3, free_lanes=1)]
    assert router.choose(level, blocks, remember=False) == home


def test_the_home_of_a_prompt_is_its_start() -> None:
    """Prompts that share their first ``cache_min_blocks`` blocks share a home
    (a system prompt, a growing conversation), whatever follows."""
    router = Router("cache_aware", cache_min_blocks=8)
    start = list(range(8 * 16))
    one = prompt_blocks({"tokens": [*start, *range(500, 600)]})
    two = prompt_blocks({"tokens": [*start, *range(900, 1000)]})
    assert router.home_key(one) == router.home_key(two)
    assert router.home_key(one) != router.home_key(prompt_blocks({"tokens": list(range(1, 300))}))


def test_without_a_home_ties_rotate() -> None:
    workers = _level("a", "b")
    assert [least_loaded(workers, turn) for turn in range(4)] == ["a", "b", "a", "b"]
    router = Router("least_loaded")
    blocks = prompt_blocks({"tokens": list(range(300))})
    assert {router.choose(workers, blocks) for _ in range(4)} == {"a", "b"}
