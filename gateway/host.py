"""What the gateway's parts see of the service that runs them.

``drain``, ``views`` and ``metrics`` work on the service's state; this
protocol names that state so they depend on it, not on ``server`` (which
imports them): the import graph stays a tree.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Protocol

from edge import Request

from .affinity import AffinityTable
from .ledger import Ledger
from .pool import Pool, WorkerConn
from .router import Router


class Host(Protocol):
    pool: Pool
    router: Router
    affinity: AffinityTable
    ledger: Ledger
    held: dict[str, list[Request]]  # sessions being moved -> requests waiting for them
    streams_moved: int  # streams a drain suspended on one worker and resumed on another
    started: float
    draining: bool  # SIGTERM: relaying accepted work, refusing new

    @property
    def forwarded(self) -> int:
        """Client requests sent on to a worker (``gateway/forward.py``)."""
        ...

    def busy(self, session: str) -> bool:
        """A request naming ``session`` is in flight."""
        ...

    def client_work(self, w: WorkerConn, ignore: Collection[str] = ()) -> int:
        """Client requests in flight on ``w``, leaving out those naming only
        sessions in ``ignore``."""
        ...

    def hold(self, session: str) -> None:
        """Keep new requests for ``session`` in the gateway."""
        ...

    def release(self, session: str) -> None:
        """Send ``session``'s held requests on, in order."""
        ...

    def migrated(self, result: str) -> None:
        """A drain moved a session (``ok``) or could not (``failed``)."""
        ...

    def drains(self) -> list[dict[str, Any]]:
        """The drains running now."""
        ...

    def dispatch(self, req: Request, w: WorkerConn, sessions: tuple[str, ...]) -> bool:
        """Send ``req`` to ``w`` under a new gateway id, for the same client
        request; False (and the client has its error) when it cannot."""
        ...
