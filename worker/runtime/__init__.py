"""The single-threaded runtime: lanes, sessions, positions, forwards.

Failures are raised as the typed errors of ``faults`` (each carries its code;
the runtime itself knows nothing of the wire).
"""

from .chain import Call, Flight
from .draft import DraftRuntime
from .lanes import Ephemeral, LanePool, Session, SessionId, runs
from .state import RuntimeState
from .steps import Origin, Step, StepResult

__all__ = [
    "Call",
    "DraftRuntime",
    "Ephemeral",
    "Flight",
    "LanePool",
    "Origin",
    "RuntimeState",
    "Session",
    "SessionId",
    "Step",
    "StepResult",
    "runs",
]
