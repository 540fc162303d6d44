"""structlog setup: human-readable lines on a terminal, JSON lines in a run's log files."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog


def configure_logging(*, json_lines: bool | None = None, level: str = "info", stream: TextIO | None = None) -> None:
    """Configure structlog once per process. JSON when the stream is not a terminal (log files)."""
    stream = stream or sys.stderr
    if json_lines is None:
        json_lines = not stream.isatty()
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=True,
    )
    logging.getLogger("asyncio").addFilter(_quiet_tls_close)


def _quiet_tls_close(record: logging.LogRecord) -> bool:
    """asyncio warns on every TLS connection a server closes first (each actor's, at the end of a run);
    the close is expected and the line is noise."""
    return "eof_received() has no effect when using ssl" not in record.getMessage()
