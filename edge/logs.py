"""structlog set-up shared by every skiff process.

JSON lines in production (``--log-format json``), aligned key=value in a
terminal (``console``). Configuration only: request-scoped keys (request
id, op, session) are bound where a request meets the log, by
``edge/server.py``'s ``bind_request`` through contextvars; the processors
set up here merge them into every line.

Logging must never end a process. Only values the edge validated are bound
(an int id, a short op string, a session string); the JSON renderer turns
anything it cannot serialise into its ``repr`` and non-finite floats into
strings (strict JSON parsers reject bare ``NaN``); and a line that still
fails to render or write is dropped rather than raised.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
from typing import Any, TextIO

import structlog

LOG_FORMATS = ("auto", "json", "console")


def configure(log_format: str = "auto", level: str = "info") -> None:
    """Configure structlog once per process; ``auto`` picks by TTY."""
    if log_format == "auto":
        log_format = "console" if sys.stderr.isatty() else "json"
    renderer: Any
    if log_format == "json":
        renderer = structlog.processors.JSONRenderer(serializer=safe_json)
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
        wrapper_class=_never_raising(
            structlog.make_filtering_bound_logger(
                logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
            )
        ),
        logger_factory=_SafeLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


def _never_raising(base: type[Any]) -> type[Any]:
    """A bound-logger class whose processing failures drop the line, not the process."""

    class NeverRaising(base):  # type: ignore[misc]
        def _proxy_to_logger(self, method_name: str, event: Any = None, **kw: Any) -> Any:
            try:
                return super()._proxy_to_logger(method_name, event, **kw)
            except Exception:
                return None

    return NeverRaising


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by its name (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def safe_json(obj: Any, **kwargs: Any) -> str:
    """Strict JSON for any event dict: never raises, never writes NaN."""
    kwargs.pop("default", None)
    try:
        return json.dumps(obj, default=repr, allow_nan=False, **kwargs)
    except (ValueError, TypeError, RecursionError):
        pass
    try:
        return json.dumps(_finite(obj), default=repr, allow_nan=False, **kwargs)
    except Exception:
        return json.dumps({"event": "log_render_failed", "logged": repr(obj.get("event"))})


class _SafeLogger(structlog.PrintLogger):
    """A PrintLogger whose failures (closed pipe, full disk) are swallowed."""

    def msg(self, message: str) -> None:
        with contextlib.suppress(Exception):
            super().msg(message)

    log = debug = info = warn = warning = err = error = critical = exception = fatal = msg


class _SafeLoggerFactory:
    def __init__(self, file: TextIO) -> None:
        self._file = file

    def __call__(self, *args: Any) -> _SafeLogger:
        return _SafeLogger(self._file)


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)
