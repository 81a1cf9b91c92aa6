"""Op classes as the gateway routes them, and its op table.

Which ops go to speech workers, which name sessions in their arguments,
which carry a prompt worth indexing for the cache-aware policy, which count
as work in a worker's ``running`` / ``queued``, which take a lane while they
run without a session. Everything not the gateway's own is forwarded.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from edge import Handler, Request

SPEECH_OPS = frozenset({"synthesize"})  # the speech worker's (docs/speech.md)
BATCH_OPS = frozenset({"decode_batch", "iteration_batch"})  # sessions in args.requests
PROMPT_OPS = frozenset({"generate", "chat", "prefill", "prefill_sampled"})
UNPLACED_OPS = frozenset({"drop"})  # never place a session
# Ops whose work a worker's scheduler counts in running / queued.
WORK_OPS = frozenset(
    {
        "generate",
        "chat",
        "prefill",
        "prefill_sampled",
        "prefill_media",
        "decode",
        "decode_batch",
        "iteration_batch",
        "verify",
        "embed",
        "export_state",
        "import_state",
        "synthesize",
    }
)
EPHEMERAL_LANE_OPS = frozenset({"generate", "chat", "embed"})  # sessionless: a lane while running


class OpTable(Mapping[str, Handler]):
    """The gateway's own ops; every other op is forwarded (a worker answers
    ``unknown_op`` for what it does not serve)."""

    def __init__(self, local: dict[str, Handler], forward: Handler) -> None:
        self._local = local
        self._forward = forward

    def __getitem__(self, op: str) -> Handler:
        return self._local.get(op, self._forward)

    def __iter__(self) -> Iterator[str]:
        return iter(self._local)

    def __len__(self) -> int:
        return len(self._local)


def sessions_of(req: Request) -> tuple[str, ...]:
    """Every session a request names (batches name theirs in ``args.requests``)."""
    if req.op in BATCH_OPS:
        entries = req.args.get("requests")
        if isinstance(entries, list):
            names = [e.get("session") for e in entries if isinstance(e, dict)]
            return tuple(dict.fromkeys(n for n in names if isinstance(n, str) and n))
        return ()
    return (req.session,) if req.session is not None else ()


def carries_media(req: Request) -> bool:
    """Whether ``req`` needs a worker that can see: ``prefill_media``, a
    ``media`` list, or a chat message with an ``image_url`` part."""
    if req.op == "prefill_media" or req.args.get("media"):
        return True
    if req.op != "chat" or not isinstance(req.args.get("messages"), list):
        return False
    return any(_has_image(m.get("content")) for m in req.args["messages"] if isinstance(m, dict))


def _has_image(content: Any) -> bool:
    return isinstance(content, list) and any(
        isinstance(p, dict) and p.get("type") == "image_url" for p in content
    )


def sees(info: Mapping[str, Any] | None) -> bool | None:
    """A worker's ``info`` says it takes images (``--mmproj``); None: not known yet."""
    if info is None:
        return None
    media = info.get("media")
    return isinstance(media, dict) and media.get("image") is True
