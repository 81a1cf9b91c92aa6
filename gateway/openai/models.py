"""``/v1/models``: the name every request may use, then each worker's real model.

The HTTP front serves one name (``model_name``, ``skiff`` by default) that
any request may send: its upstream picks the worker (the gateway routes to
any of its LLM workers). The listing gives that entry first, then one entry
per model the workers serve, under its real name (the worker's
``info.model.name``, the GGUF's ``general.name``), each with its context
length: ``context_length`` (and vLLM's ``max_model_len``) is the smallest
``n_ctx_per_lane`` of the workers serving it — the most tokens, prompt and
completion together, one request can hold there; ``n_ctx_train`` and the
workers are under ``skiff``. Through the gateway, each worker's model comes
from its ``info`` (``gateway.models``); straight to a worker, from that
worker's own.

A real name is accepted in requests as well when every LLM worker serves
that model: it then means exactly what the served name means. The gateway
does not route by model, so in a pool of different models only the served
name is accepted (a request for one model could otherwise run on another).
"""

from __future__ import annotations

from typing import Any


def worker_models(info: dict[str, Any]) -> list[dict[str, Any]]:
    """``{"worker", "up", "name", "n_ctx_per_lane", "n_ctx_train"}`` per LLM worker."""
    gateway = info.get("gateway")
    if isinstance(gateway, dict) and isinstance(gateway.get("models"), list):
        return [m for m in gateway["models"] if isinstance(m, dict)]
    model = info.get("model") if isinstance(info.get("model"), dict) else {}
    assert isinstance(model, dict)
    return [
        {
            "worker": None,  # the upstream itself
            "up": True,
            "name": model.get("name"),
            "n_ctx_per_lane": info.get("n_ctx_per_lane"),
            "n_ctx_train": model.get("n_ctx_train"),
        }
    ]


def aliases(info: dict[str, Any], served: str) -> frozenset[str]:
    """Real model names a request may use for ``served``: the one every worker serves."""
    names = {m.get("name") for m in worker_models(info)}
    if len(names) == 1:
        (name,) = names
        if isinstance(name, str) and name and name != served:
            return frozenset([name])
    return frozenset()


def _ctx(workers: list[dict[str, Any]], key: str) -> int | None:
    values = [int(w[key]) for w in workers if isinstance(w.get(key), int)]
    return min(values) if values else None


def listing(info: dict[str, Any], served: str, created: int) -> list[dict[str, Any]]:
    """The ``data`` of ``GET /v1/models`` for the upstream's ``info``."""
    model = info.get("model") if isinstance(info.get("model"), dict) else {}
    assert isinstance(model, dict)
    public = {k: v for k, v in model.items() if k != "path"}  # no server paths
    skiff = {k: info.get(k) for k in ("lanes", "n_ctx", "n_ctx_per_lane", "chat_template")}
    workers = worker_models(info)
    first = {
        "id": served,
        "object": "model",
        "created": created,
        "owned_by": "skiff",
        "root": model.get("name"),
        "context_length": _ctx(workers, "n_ctx_per_lane"),
        "max_model_len": _ctx(workers, "n_ctx_per_lane"),
        "skiff": {"model": public, **skiff},
    }
    by_name: dict[str, list[dict[str, Any]]] = {}
    for w in workers:
        name = w.get("name")
        if isinstance(name, str) and name and name != served:
            by_name.setdefault(name, []).append(w)
    entries = [first]
    for name, group in by_name.items():
        context = _ctx(group, "n_ctx_per_lane")
        entries.append(
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "skiff",
                "root": name,
                "context_length": context,
                "max_model_len": context,
                "skiff": {
                    "n_ctx_train": _ctx(group, "n_ctx_train"),
                    "workers": [
                        {"worker": w.get("worker"), "up": w.get("up")}
                        for w in group
                        if w.get("worker") is not None
                    ],
                    "requestable": name in aliases(info, served),
                },
            }
        )
    return entries
