"""structlog set-up shared by the LLM and speech workers.

JSON lines in production (``--log-format json``), aligned key=value in a
terminal (``console``). Request-scoped keys (request id, op, session) are
bound with ``bind_request`` through contextvars, so every line logged while a
request is handled carries them without threading a logger through calls.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

LOG_FORMATS = ("auto", "json", "console")


def configure(log_format: str = "auto", level: str = "info") -> None:
    """Configure structlog once per process; ``auto`` picks by TTY."""
    if log_format == "auto":
        log_format = "console" if sys.stderr.isatty() else "json"
    renderer: Any
    if log_format == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def bind_request(req_id: Any, op: Any, session: Any) -> None:
    """Bind the request keys every log line of this request must carry."""
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(request_id=req_id, op=op, session=session)


def clear_request() -> None:
    structlog.contextvars.clear_contextvars()


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)
