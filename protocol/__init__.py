"""skiff wire protocol: envelope and transport, tensor frames and clients."""

from .async_client import AsyncClient
from .client import Client
from .reply import Reply, SkiffError
from .transport import VERSION, ErrorCode, Op

__all__ = ["VERSION", "AsyncClient", "Client", "ErrorCode", "Op", "Reply", "SkiffError"]
