"""Logs are events: a stable name plus structured fields, one JSON object per line (orjson).

Never logs a DSN's password: `redact_dsn` is applied wherever a DSN could reach a message.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from typing import Any

import orjson

logger = logging.getLogger("leasework")

_PASSWORD_KV = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)
_PASSWORD_URL = re.compile(r"(://[^:/@\s]*:)([^@\s]*)(@)")


def redact_dsn(text: str) -> str:
    """Hide passwords in a DSN or in any message that may quote one."""
    text = _PASSWORD_KV.sub(r"\1***", text)
    return _PASSWORD_URL.sub(r"\1***\3", text)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "event": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            doc.update(fields)
        if record.exc_info:
            doc["exc"] = redact_dsn(self.formatException(record.exc_info))
        return orjson.dumps(doc, default=str).decode()


def setup(level: str = "INFO") -> None:
    """Route leasework's events to stderr as JSON lines (idempotent)."""
    if any(getattr(h, "_leasework", False) for h in logger.handlers):
        logger.setLevel(level.upper())
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    handler._leasework = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


def event(name: str, level: int = logging.INFO, exc_info: bool = False, **fields: Any) -> None:
    """Log one event: `event("run_claimed", run_id=7, kind="sync")`."""
    if logger.isEnabledFor(level):
        logger.log(level, name, extra={"fields": fields}, exc_info=exc_info)


def monotonic() -> float:
    return time.monotonic()
