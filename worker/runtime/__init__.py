"""The single-threaded runtime: lanes, sessions, positions, forwards."""

from .errors import (
    Cancelled,
    ContextOverflow,
    DeadlineExceeded,
    EngineFault,
    InternalFault,
    InvalidArgument,
    LanesBusy,
    PositionMismatch,
    QueueFull,
    RuntimeFault,
    SessionNotActive,
    Unsupported,
)
from .lanes import LanePool, Session
from .state import RuntimeState, Step, StepResult

__all__ = [
    "Cancelled",
    "ContextOverflow",
    "DeadlineExceeded",
    "EngineFault",
    "InternalFault",
    "InvalidArgument",
    "LanePool",
    "LanesBusy",
    "PositionMismatch",
    "QueueFull",
    "RuntimeFault",
    "RuntimeState",
    "Session",
    "SessionNotActive",
    "Step",
    "StepResult",
    "Unsupported",
]
