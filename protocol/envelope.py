"""The wire contract: version, op names, error codes and header shapes.

Everything a peer needs to speak to a skiff worker lives in this package; it
imports nothing from ``worker/`` so gateways can depend on it alone. Error
codes and their classes live in ``faults`` (below everything) and are
re-exported here; ``error_reply`` writes one into a reply and ``fault_of``,
the one reader of an error reply, turns it back into its class.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from faults import ErrorCode, Fault, from_code

VERSION = 1
MAX_SESSION_CHARS = 256  # a session id is a string of 1..256 characters


class Op(StrEnum):
    """Op names of the LLM worker (the speech worker shares the envelope)."""

    PING = "ping"
    INFO = "info"
    STATS = "stats"
    TOKENIZE = "tokenize"
    DETOKENIZE = "detokenize"
    PREFILL = "prefill"
    PREFILL_SAMPLED = "prefill_sampled"
    PREFILL_MEDIA = "prefill_media"
    DECODE = "decode"
    DECODE_BATCH = "decode_batch"
    ITERATION_BATCH = "iteration_batch"
    GENERATE = "generate"
    CHAT = "chat"
    CANCEL = "cancel"
    SUSPEND = "suspend"
    HANDOFF = "handoff"
    VERIFY = "verify"
    SIGNAL = "signal"
    SIGNAL_WINDOW = "signal_window"
    TRIM = "trim"
    ALIGN = "align"
    DROP = "drop"
    EMBED = "embed"
    EXPORT_STATE = "export_state"
    IMPORT_STATE = "import_state"
    ECHO = "echo"
    FORWARD_FRAME = "forward_frame"  # stage to stage
    SYNTHESIZE = "synthesize"  # the speech worker's


__all__ = [
    "MAX_SESSION_CHARS",
    "VERSION",
    "ErrorCode",
    "ForeignFault",
    "Op",
    "error_reply",
    "event_reply",
    "fault_of",
    "ok_reply",
    "request",
    "wire_code",
]


def request(
    req_id: int,
    op: str,
    session: str | None = None,
    args: dict[str, Any] | None = None,
    deadline_ms: int | None = None,
) -> dict[str, Any]:
    """Build a request header map."""
    header: dict[str, Any] = {"v": VERSION, "id": req_id, "op": op}
    if session is not None:
        header["session"] = session
    if args:
        header["args"] = args
    if deadline_ms is not None:
        header["deadline_ms"] = deadline_ms
    return header


def ok_reply(req_id: int | None, result: dict[str, Any]) -> dict[str, Any]:
    """A successful single reply."""
    return {"v": VERSION, "id": req_id, "ok": True, "result": result}


def event_reply(req_id: int, event: dict[str, Any]) -> dict[str, Any]:
    """One event of a streaming op; the last one carries ``done: true``."""
    return {"v": VERSION, "id": req_id, "ok": True, **event}


def error_reply(
    req_id: int | None,
    code: str,
    message: str,
    retry_after_ms: int | None = None,
) -> dict[str, Any]:
    """A failed reply. ``retry_after_ms`` hints when to retry (queue_full)."""
    error: dict[str, Any] = {"code": str(code), "message": message}
    if retry_after_ms is not None:
        error["retry_after_ms"] = retry_after_ms
    return {"v": VERSION, "id": req_id, "ok": False, "error": error}


class ForeignFault(Fault):
    """An error reply whose code this build does not know (a newer or foreign
    peer): ``internal`` to the code here, its own code kept in ``wire_code``
    so a client still sees it verbatim."""

    def __init__(self, wire_code: str, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message, retry_after_ms)
        self.wire_code = wire_code


def fault_of(header: dict[str, Any], prefix: str = "") -> Fault:
    """The typed fault an error reply carries: its code's class
    (``faults.from_code``), its message (after ``prefix``) and its retry hint.

    The one reader of an error reply: the clients (``SkiffError``), a stage's
    link to the next stage and the HTTP front's upstream all go through it,
    so a code means the same class everywhere."""
    error = header.get("error")
    if not isinstance(error, dict):
        error = {}
    code = str(error.get("code", ErrorCode.INTERNAL.value))
    message = f"{prefix}{error.get('message', '')}"
    retry = error.get("retry_after_ms")
    retry_ms = retry if type(retry) is int else None
    cls = from_code(code)
    if cls is Fault:
        return ForeignFault(code, message, retry_ms)
    return cls(message, retry_ms)


def wire_code(fault: Fault) -> str:
    """The code ``fault`` travels under: its class's, or a foreign one verbatim."""
    return fault.wire_code if isinstance(fault, ForeignFault) else fault.code.value
