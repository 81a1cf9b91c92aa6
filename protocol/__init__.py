"""skiff wire protocol: envelope, codec, tensor frames and clients."""

from .async_client import AsyncClient
from .client import Client
from .envelope import VERSION, ErrorCode, Op
from .reply import Reply, SkiffError

__all__ = ["VERSION", "AsyncClient", "Client", "ErrorCode", "Op", "Reply", "SkiffError"]
