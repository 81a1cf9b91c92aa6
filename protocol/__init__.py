"""skiff wire protocol: envelope, codec, tensor frames and clients."""

from .async_client import AsyncClient
from .client import Client, Reply, SkiffError
from .envelope import VERSION, ErrorCode, Op

__all__ = ["VERSION", "AsyncClient", "Client", "ErrorCode", "Op", "Reply", "SkiffError"]
