"""What every handler module shares: the ``App`` protocol and its readers.

``App`` is what a handler uses of the worker (``service.LlmService``
provides it), ``Handler`` the type of one op's handler, and ``_sampling`` /
``_tokens`` read the ``sampling`` map and a session-bound token list with
the worker's limits. Kept apart from ``handlers.py`` so the handler modules
(``handlers``, ``generate``, ``jobs``, ``media``, ``tensors``) share them without
importing each other in a circle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from edge import Request

from ..config import WorkerConfig
from ..core.chat import ChatTemplate
from ..core.jobs.base import Job, Ticket
from ..core.scheduler import Scheduler
from ..engine import Engine
from ..engine.media import Projector
from ..limits import Limits
from ..runtime import RuntimeState
from ..runtime.draft import DraftModel
from ..spec import GrammarChecker, SamplerSpec
from .sampling import get_sampling
from .validate import Context, get_prompt_tokens


class App(Protocol):
    """What handlers use of the worker (``service.LlmService`` provides it)."""

    cfg: WorkerConfig
    engine: Engine
    n_vocab: int
    grammars: GrammarChecker | None
    rt: RuntimeState
    sched: Scheduler
    chat: ChatTemplate
    draft: DraftModel | None
    chunk: int
    limits: Limits  # resolved: per-lane limits are numbers of cells
    context: Context  # limits, vocabulary and grammar checker, for field rules
    # Most tokens a text prompt may become (``--max-request-tokens``), held
    # when its job tokenizes it; 0: only the lane's cells bound it.
    prompt_limit: int
    draining: bool  # SIGTERM: only work that finishes or moves accepted work is served
    projector: Projector | None  # --mmproj (api/media.py); None: text only
    # --speculate auto: generations that ask for no speculation draft while
    # at most this many streams decode; None: --speculate off
    speculate_streams: int | None
    # most rows of one speculative span: half of --send-hwm at most, so the
    # token events of accepted drafts never fill a reading peer's queue
    span_rows: int

    def ticket(self, req: Request) -> Ticket: ...

    def submit(self, job: Job) -> None: ...

    def info(self) -> dict[str, Any]: ...

    def stats(self) -> dict[str, Any]: ...

    def handoff(self, done: bool) -> list[str]: ...


Handler = Callable[[App, Request], dict[str, Any] | None]


def _sampling(app: App, args: dict[str, Any]) -> SamplerSpec | None:
    return get_sampling(args, grammars=app.grammars, limits=app.limits)


def _tokens(app: App, args: dict[str, Any], name: str = "tokens") -> list[int]:
    """Tokens bound for a session: ``--max-request-tokens``, then the lane's cells."""
    return get_prompt_tokens(
        args, name, app.n_vocab, app.rt.ctx_per_lane, app.limits.max_request_tokens
    )
