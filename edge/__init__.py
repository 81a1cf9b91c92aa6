"""The edge every skiff process shares: the ROUTER loop, envelope checks,
typed error -> code, non-blocking sends, request log binding and logging set-up.

It imports ``protocol`` and ``faults`` only, never ``worker``, so the gateway
and other client-side processes can run on it too.
"""

from .server import EdgeConfig, EdgeServer, bind_request, clear_request
from .service import Handler, Outgoing, Request, Service, failure_header

__all__ = [
    "EdgeConfig",
    "EdgeServer",
    "Handler",
    "Outgoing",
    "Request",
    "Service",
    "bind_request",
    "clear_request",
    "failure_header",
]
