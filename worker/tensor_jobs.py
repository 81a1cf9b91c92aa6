"""Jobs whose answers are tensors: ``embed``, ``export_state``, ``import_state``.

``embed`` is a prefill of a throwaway (ephemeral) session with hidden-state
output on every row, pooled here. The state jobs are session ops: ordered
with the session's other work, and instant (no forward): they move a
session's KV cells out of or into llama.cpp (``runtime.portable``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .jobs import Job, PrefillJob
from .runtime import RuntimeState, SessionId, StepResult
from .runtime.portable import export_session, import_session
from .spec import SamplerSpec
from .ticket import Tensors, Ticket

POOLINGS = ("none", "mean", "last")


class EmbedJob(PrefillJob):
    """Final hidden states of a prompt, per token or pooled to one vector."""

    ephemeral = True
    waits_for_lane = True

    def __init__(
        self, ticket: Ticket, session: SessionId, tokens: list[int], chunk: int, pooling: str
    ) -> None:
        super().__init__(ticket, session, tokens, chunk, False, None, outputs=("hidden",))
        self.pooling = pooling

    def advance(self, rt: RuntimeState, results: list[StepResult]) -> bool:
        self.done += self.inflight
        self.captured.append(results[0])
        if self.done < len(self.tokens):
            return False
        rows = [r.hidden for r in self.captured if r.hidden is not None]
        hidden = rows[0] if len(rows) == 1 else np.concatenate(rows)
        n_layer = rt.engine.n_layer
        result: dict[str, Any] = {"tokens": len(self.tokens), "pooling": self.pooling}
        if self.pooling == "none":
            positions = list(range(len(self.tokens)))
            tensors = Tensors({"hidden": hidden}, positions, 1, 0, n_layer)
        else:
            vector = hidden.mean(axis=0, dtype=np.float32) if self.pooling == "mean" else hidden[-1]
            tensors = Tensors(
                {"embedding": np.ascontiguousarray(vector, dtype=np.float32)},
                None,
                1,
                0,
                n_layer,
                axes={"embedding": -1},
                token_count=len(self.tokens),
            )
        self.ticket.reply(result, tensors)
        return True


class ExportStateJob(Job):
    """The session's KV cells and what it needs to continue (it stays here)."""

    def start(self, rt: RuntimeState) -> bool:
        meta, kv = export_session(rt, self.sessions[0])
        tensors = Tensors(
            {"kv_state": kv},
            None,
            1,
            0,
            rt.engine.n_layer,
            axes={"kv_state": -1},
            token_count=int(meta["position"]),
        )
        self.ticket.reply({"session_state": meta}, tensors)
        return True


class ImportStateJob(Job):
    """A new session made from a saved state (``export_state`` elsewhere)."""

    def __init__(
        self,
        ticket: Ticket,
        session: SessionId,
        meta: dict[str, Any],
        kv: np.ndarray,
        sampler_spec: SamplerSpec | None,
    ) -> None:
        super().__init__(ticket, [session])
        self.meta = meta
        self.kv = kv
        self.sampler_spec = sampler_spec

    def start(self, rt: RuntimeState) -> bool:
        session = import_session(rt, self.sessions[0], self.meta, self.kv, self.sampler_spec)
        self.kv = np.empty(0, dtype=np.uint8)  # release the request's buffer
        self.ticket.reply({"position": session.position})
        return True
