"""A reply as the clients see it: ``Reply``, ``SkiffError``, and the helpers
both clients (``client.py``, ``async_client.py``) use to build a request's
frames and read a reply's."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import zmq

from faults import Fault

from . import frames, sockets, transport


class SkiffError(Exception):
    """An error reply from a worker, or a client-side failure (``timeout``).

    ``code`` is the wire code (a string to branch on); ``fault`` is the reply's
    typed class from ``transport.fault_of`` (``except`` on it, or ``isinstance``
    against ``faults``), None for the client's own failures."""

    def __init__(
        self,
        code: str,
        message: str,
        retry_after_ms: int | None = None,
        fault: Fault | None = None,
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms
        self.fault = fault

    @classmethod
    def of(cls, fault: Fault) -> SkiffError:
        return cls(transport.wire_code(fault), fault.message, fault.retry_after_ms, fault)


@dataclass
class Reply:
    """One reply: the decoded header and the raw buffer frames after it."""

    header: dict[str, Any]
    buffers: list[memoryview] = field(default_factory=list)

    @property
    def result(self) -> dict[str, Any]:
        value = self.header.get("result", {})
        return value if isinstance(value, dict) else {}

    @property
    def done(self) -> bool:
        return bool(self.header.get("done", "event" not in self.header))

    @property
    def frame(self) -> frames.Frame:
        """The reply's tensor frame (zero-copy views over its buffers); a
        result carries it under ``result.frame``, a stream event under ``frame``."""
        raw = self.result.get("frame") if "result" in self.header else self.header.get("frame")
        return frames.parse(raw, self.buffers)

    def raise_for_error(self) -> Reply:
        if not self.header.get("ok", False):
            raise SkiffError.of(transport.fault_of(self.header))
        return self


def client_options(
    options: sockets.SocketOptions | None, curve: sockets.Curve | None
) -> sockets.SocketOptions | None:
    """``options`` with ``curve`` set (a client's defaults when there are none)."""
    if curve is None:
        return options
    return replace(options or sockets.SocketOptions(max_message_bytes=-1), curve=curve)


def request_frames(header: dict[str, Any], buffers: Sequence[Any]) -> list[Any]:
    return [transport.encode(header), *buffers]


def parse_reply(frames: list[zmq.Frame]) -> Reply:
    header = transport.decode(frames[0].buffer, max_bytes=1 << 30)
    return Reply(header, [f.buffer for f in frames[1:]])


Extract = Callable[[Reply], Any]


def result_of(reply: Reply) -> dict[str, Any]:
    return reply.result
