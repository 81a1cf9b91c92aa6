"""``gateway/openai/models.py``: what ``/v1/models`` lists and which real
names requests may use, from a gateway's ``info`` (pure: no processes)."""

from __future__ import annotations

from typing import Any

from gateway.openai.models import aliases, listing


def _info(*workers: tuple[str, str, int]) -> dict[str, Any]:
    """A gateway ``info``: one LLM worker's own, plus every worker's model."""
    first = workers[0]
    return {
        "model": {"name": first[1], "path": "/srv/m.gguf", "n_ctx_train": 32768},
        "n_ctx_per_lane": first[2],
        "gateway": {
            "models": [
                {
                    "worker": ep,
                    "up": True,
                    "name": name,
                    "n_ctx_per_lane": ctx,
                    "n_ctx_train": 32768,
                }
                for ep, name, ctx in workers
            ]
        },
    }


def test_one_model_on_every_worker_is_listed_once_and_requestable() -> None:
    info = _info(("tcp://w1:5555", "Gemma", 2048), ("tcp://w2:5555", "Gemma", 1024))
    served, real = listing(info, "skiff", 1)
    assert served["id"] == "skiff" and served["context_length"] == 1024  # the smallest lane
    assert "path" not in served["skiff"]["model"]
    assert real["id"] == "Gemma" and real["context_length"] == real["max_model_len"] == 1024
    assert [w["worker"] for w in real["skiff"]["workers"]] == ["tcp://w1:5555", "tcp://w2:5555"]
    assert real["skiff"]["requestable"] is True
    assert aliases(info, "skiff") == {"Gemma"}


def test_a_mixed_pool_lists_each_model_and_accepts_only_the_served_name() -> None:
    info = _info(("tcp://w1:5555", "Gemma", 2048), ("tcp://w2:5555", "Qwen", 4096))
    ids = [(e["id"], e["context_length"]) for e in listing(info, "skiff", 1)]
    assert ids == [("skiff", 2048), ("Gemma", 2048), ("Qwen", 4096)]
    assert aliases(info, "skiff") == frozenset()  # no routing by model: one could run on the other


def test_a_worker_straight_behind_the_front() -> None:
    info = {"model": {"name": "Gemma", "n_ctx_train": 32768}, "n_ctx_per_lane": 512}
    assert [e["id"] for e in listing(info, "skiff", 1)] == ["skiff", "Gemma"]
    assert aliases(info, "skiff") == {"Gemma"}
    assert aliases(info, "Gemma") == frozenset()  # served under its own name: nothing to map
