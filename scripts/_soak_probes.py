"""The bad-input probes of ``scripts/soak_mix.py``: malformed or refused requests.

Why a module of its own: each probe is raw frames and the error code it must
be answered with (a header that is not msgpack, a wrong version, nesting
past the cap, an unknown op, arguments a validator refuses, a frame whose
sizes lie, a prompt past a lane, now and then a header past the size cap).
``send_probe`` is the ``bad_input`` action: one probe, drawn from the actor's
random source, sent on a fresh socket, and its reply's code checked.
"""

from __future__ import annotations

import random
from typing import Any

import msgpack
from _soak_actor import Sockets
from _soak_tally import Tally, Topology


def probes(topo: Topology, rng: random.Random) -> list[tuple[str, list[Any], str]]:
    """(name, frames, the code it provokes) per probe, for this topology."""

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
    out: list[tuple[str, list[Any], str]] = [
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
            req(op("generate", tokens=[topo.n_vocab + 5], max_tokens=2)),
            "bad_request",
        ),
        (
            "context overflow",
            req(op("generate", tokens=[100] * (topo.n_ctx_per_lane + 16), max_tokens=2)),
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
    if rng.random() < 0.1:  # a few MiB each: now and then, not every time
        big = {
            "v": 1,
            "id": 1,
            "op": "tokenize",
            "args": {"text": "x" * (topo.max_request_bytes + 1024)},
        }
        out.append(("oversized header", req(big), "payload_too_large"))
    return out


def send_probe(rng: random.Random, topo: Topology, sockets: Sockets, tally: Tally) -> None:
    """One malformed or refused request on a fresh socket; the reply's
    code must be the one the probe provokes."""
    name, frames_out, want = rng.choice(probes(topo, rng))
    targets = [topo.gateway] * 3 + topo.workers + topo.speech[:1]
    endpoint = rng.choice(targets)
    if endpoint in topo.speech and not name.startswith(("raw", "envelope")):
        endpoint = topo.gateway  # op probes are LLM probes
    with sockets.fresh(endpoint) as c:
        c.send_raw(frames_out)
        reply = c.recv_any()
    code = str((reply.header.get("error") or {}).get("code", "ok"))
    # A prompt past a lane is refused as too long either way: by the
    # per-request token limit (limit_exceeded) or by the lane (context_overflow).
    if code == want or (want == "context_overflow" and code == "limit_exceeded"):
        tally.error("bad_input", code, name, expected=True)
    else:
        tally.error("bad_input", code, f"probe {name} at {endpoint}: wanted {want}", expected=False)
