"""structlog set-up: key-value lines with a snake_case event and fixed keys (role, replica_id, ...)."""

from __future__ import annotations

import logging
import sys

import structlog


def _stderr_logger(*_: object) -> structlog.PrintLogger:
    """A logger on ``sys.stderr`` as it is when a line is written, not as it was at set-up (a caller that
    configured logging under a replaced, since closed, stderr, e.g. a CLI run inside a test, breaks nothing)."""
    return structlog.PrintLogger(sys.stderr)


def setup_logging(role: str, replica_id: str = "", level: str = "info", fmt: str = "console") -> structlog.BoundLogger:
    """Configure structlog once per process and return a logger bound to this role and replica."""
    renderer: structlog.types.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.processors.KeyValueRenderer(key_order=["ts", "level", "event", "role", "replica_id"],
                                                         drop_missing=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", key="ts"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(role=role, replica_id=replica_id)
    return structlog.get_logger()
