"""The head stage's direct return: a second DEALER straight to the last stage.

With 3+ stages the head connects to the chain's last stage (as the stage
before it dials it) so sampled tokens come home in one hop instead of being
relayed by every stage in between. Where that stage is comes from the
chain's ``info`` (the next stage's, asked down the chain); the socket is
ready once a ``ping`` through it is answered, so the last stage can route
to it from the first forward that names it.

Nothing here waits: the link asks for the chain without blocking, hands the
answer to ``learn``, and ``ready`` looks for the ping's reply whenever the
link sends; until then forwards take the relayed way, which gives the same
results. A chain that cannot be dialled (no endpoint, no CURVE key, no
answer to the ping) is ``refused``: the link fails the forward that finds
out with ``stage_unavailable`` and asks again at the next, as it did when
the set-up waited.
"""

from __future__ import annotations

import os
import time
from typing import Any

import zmq
from structlog import get_logger

from faults import Fault, StageUnavailable
from protocol import sockets, transport
from protocol.transport import request

_log = get_logger("skiff.stage")
PING_MS = 5_000  # the last stage answers a ping within a turn


class DirectReturn:
    def __init__(self, context: zmq.Context[Any], curve: sockets.Curve | None) -> None:
        self._ctx = context
        self.curve = curve  # this stage's pair; the last stage's key comes from the chain
        self.known = False  # the chain is known: dialled, or no direct return needed
        self.sock: zmq.Socket[Any] | None = None  # once the last stage answered the ping
        self.endpoint: str | None = None
        self.refused: Fault | None = None  # why the chain cannot be dialled (or is unknown)
        self._dialing: tuple[zmq.Socket[Any], str, float] | None = None

    def close(self) -> None:
        for sock in (self.sock, self._dialing[0] if self._dialing else None):
            if sock is not None:
                sock.close(linger=0)

    def learn(self, chain: object) -> None:
        """The chain, as the next stage's ``info`` reports it: nothing to do
        (the next stage is the last), dial its last stage, or refuse."""
        if not isinstance(chain, list) or len(chain) < 2:
            self.known = True  # the next stage is the last: its replies are already direct
            return
        endpoint = chain[-2].get("next") if isinstance(chain[-2], dict) else None
        if not isinstance(endpoint, str) or not endpoint:
            self.refused = StageUnavailable("the chain's last stage endpoint is unknown")
            return
        curve = None
        if self.curve is not None:
            last = chain[-1] if isinstance(chain[-1], dict) else {}
            key = last.get("curve_key")
            if not isinstance(key, str):
                self.refused = StageUnavailable("the chain's last stage reports no CURVE key")
                return
            curve = self.curve.toward(key.encode())
        routing_id = b"skiff-head-" + os.urandom(8).hex().encode()
        opts = sockets.SocketOptions(curve=curve, routing_id=routing_id)
        try:
            sock: zmq.Socket[Any] = sockets.dealer(self._ctx, endpoint, opts)
        except zmq.ZMQError as exc:
            self.refused = StageUnavailable(f"the chain's last stage ({endpoint}): {exc}")
            return
        sock.send(transport.encode(request(0, "ping", None, None)))
        self._dialing = (sock, endpoint, time.monotonic() + PING_MS / 1000)

    def ready(self) -> bool:
        """True once the socket is up (the last stage answered its ping)."""
        if self._dialing is None:
            return self.sock is not None
        sock, endpoint, deadline = self._dialing
        if sock.poll(0):
            sock.recv_multipart()
            self._dialing = None
            self.sock, self.endpoint, self.known = sock, endpoint, True
            _log.info("stage_direct_return", last_stage=endpoint)
            return True
        if time.monotonic() > deadline:
            sock.close(linger=0)
            self._dialing = None
            self.refused = StageUnavailable(f"the chain's last stage ({endpoint}) did not answer")
        return False

    @property
    def dialing(self) -> bool:
        return self._dialing is not None
