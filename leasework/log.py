"""Logs are events: a stable name plus structured fields, one per line: a JSON object (orjson)
when stderr is not a terminal, a readable `key=value` line on one (`log_format` chooses).

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

# A password in key=value form: its whole value as libpq reads it, quoted (spaces and escaped
# quotes inside) or not (backslash-escaped characters, `Top\ Secret`, included).
_PASSWORD_KV = re.compile(
    r"(password\s*=\s*)(?:'(?:[^'\\]|\\.)*'?|(?:\\.|[^\s\\])+)", re.IGNORECASE | re.DOTALL
)
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def redact_dsn(text: str) -> str:
    """Hide passwords in a DSN or in any message that may quote one, however malformed: a URL's
    whole userinfo after the user name (up to the last `@` on its line, so a password holding an
    unencoded `@`, `:` or a space goes whole) and a key=value password's whole value."""
    text = _PASSWORD_KV.sub(r"\1***", text)
    out: list[str] = []
    pos = 0
    for m in _SCHEME.finditer(text):
        start = m.end()
        if start < pos:
            continue
        end = text.find("\n", start)
        end = len(text) if end == -1 else end
        at = text.rfind("@", start, end)
        if at == -1:
            continue
        userinfo = text[start:at]
        if ":" not in userinfo:
            continue
        out.append(text[pos:start] + userinfo.split(":", 1)[0] + ":***")
        pos = at
    out.append(text[pos:])
    return "".join(out)


def has_password(dsn: str) -> bool:
    """True if a DSN (well formed or not) carries a password."""
    return redact_dsn(dsn) != dsn


def first_line(exc: BaseException) -> str:
    """An error as one log-safe line: its message's first line, DSN passwords redacted; the
    exception's type when the message is empty."""
    text = str(exc).strip()
    return redact_dsn(text.splitlines()[0] if text else type(exc).__name__)


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    """The event's structured fields, with any DSN password in a string value hidden."""
    fields = getattr(record, "fields", None) or {}
    return {k: redact_dsn(v) if isinstance(v, str) else v for k, v in fields.items()}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: {"ts", "level", "event", **fields}. For machines (journald,
    log shippers): the default when stderr is not a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "event": record.getMessage(),
        }
        doc.update(_fields(record))
        if record.exc_info:
            doc["exc"] = redact_dsn(self.formatException(record.exc_info))
        return orjson.dumps(doc, default=str).decode()


class TextFormatter(logging.Formatter):
    """One readable line per event: `12:00:01.250 INFO  run_claimed run_id=7 kind=sync`. For
    people: the default on a terminal. A traceback, when there is one, follows indented."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        millis = int(record.msecs)
        parts = [f"{stamp}.{millis:03d} {record.levelname:<5} {record.getMessage()}"]
        for key, value in _fields(record).items():
            if not isinstance(value, str):
                text = orjson.dumps(value, default=str).decode()
            elif not value or any(ch.isspace() or ch in '"=' for ch in value):
                text = orjson.dumps(value).decode()  # quoted, so the line stays one line
            else:
                text = value
            parts.append(f"{key}={text}")
        line = " ".join(parts)
        if record.exc_info:
            trace = redact_dsn(self.formatException(record.exc_info))
            line += "\n" + "\n".join("    " + t for t in trace.splitlines())
        return line


LOG_FORMATS = ("auto", "json", "text")


def resolve_format(fmt: str, stream: Any = None) -> str:
    """ "auto" is text on a terminal, JSON otherwise."""
    fmt = fmt.lower()
    if fmt != "auto":
        return fmt
    stream = sys.stderr if stream is None else stream
    try:
        return "text" if stream.isatty() else "json"
    except (AttributeError, ValueError):
        return "json"


def setup(level: str = "INFO", fmt: str = "auto", stream: Any = None) -> None:
    """Route leasework's events to stderr (or `stream`), one per line, as JSON or text
    (idempotent: a second call replaces the format and level)."""
    stream = sys.stderr if stream is None else stream
    chosen = resolve_format(fmt, stream)
    formatter: logging.Formatter = TextFormatter() if chosen == "text" else JsonFormatter()
    for h in logger.handlers:
        if getattr(h, "_leasework", False):
            h.setFormatter(formatter)
            logger.setLevel(level.upper())
            return
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
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
