"""Typed runtime errors. The server maps each class to a stable wire code.

The runtime knows nothing about msgpack or sockets; raising one of these is
how it says "this request fails, and here is why". Anything else escaping
the runtime is a bug and becomes ``internal``.
"""

from __future__ import annotations


class RuntimeFault(Exception):
    """Base class: a request-level failure with a human message."""


class InvalidArgument(RuntimeFault):
    """The request is well-formed but asks for something impossible."""


class LanesBusy(RuntimeFault):
    """No free lane for a session that needs one; nothing was admitted."""


class QueueFull(RuntimeFault):
    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class SessionNotActive(RuntimeFault):
    """The op needs an admitted session and this one is not."""


class ContextOverflow(RuntimeFault):
    """The tokens would not fit in the session's share of the KV cache."""


class Unsupported(RuntimeFault):
    """A valid request for something this worker is not set up to do."""


class Cancelled(RuntimeFault):
    pass


class DeadlineExceeded(RuntimeFault):
    pass


class InternalFault(RuntimeFault):
    """An invariant broke (bug) or the engine failed; the session may be reset."""


class PositionMismatch(InternalFault):
    """Tracked position and engine position disagree: surfaced, never patched."""


class EngineFault(InternalFault):
    """``llama_decode`` failed; ``advanced`` names sessions whose KV moved."""

    def __init__(self, message: str, advanced: dict[str, int]) -> None:
        super().__init__(message)
        self.advanced = advanced
