"""Logs are events: a stable name plus structured fields, one per line: a JSON object (orjson)
when stderr is not a terminal, a readable `key=value` line on one (`log_format` chooses).

Never logs a DSN's password: `redact_dsn` is applied wherever a DSN could reach a message.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import orjson

logger = logging.getLogger("leasework")

# The run whose handler is executing in this thread ({run_id, kind, attempt}), set by the
# executor around the handler: every record logged meanwhile, the handler's own included, carries
# it (`record.leasework_run`, stamped when the record is made: see install_record_factory).
RUN: ContextVar[dict[str, Any] | None] = ContextVar("leasework_run", default=None)


class _RunField:
    """`record.run_id` (kind, attempt) of a RunRecord: read from its `leasework_run`. A non-data
    descriptor, not an instance attribute, so that a handler's own `extra={"kind": ...}` neither
    collides with it (logging refuses an extra key the record already holds: a KeyError raised
    into the handler's log call) nor is hidden by it: the extra lands in the instance and wins."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __get__(self, record: logging.LogRecord | None, owner: type | None = None) -> Any:
        if record is None:
            return self
        try:
            return record.__dict__["leasework_run"][self.key]
        except KeyError:
            raise AttributeError(self.key) from None


class RunRecord(logging.LogRecord):
    """A record logged while a handler ran: its run's fields are attributes (`record.run_id`,
    `record.kind`, `record.attempt`) for any logging handler, pytest's caplog included, besides
    the dict `record.leasework_run`. A module-level class, so the record still pickles (a
    multiprocessing QueueHandler)."""

    run_id = _RunField("run_id")
    kind = _RunField("kind")
    attempt = _RunField("attempt")


def _stamping(previous: Callable[..., logging.LogRecord]) -> Callable[..., logging.LogRecord]:
    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        run = RUN.get()
        if run is not None:
            record.leasework_run = dict(run)
            if type(record) is logging.LogRecord:  # an application's own record class is kept
                record.__class__ = RunRecord
        return record

    factory._leasework = True  # type: ignore[attr-defined]
    return factory


def install_record_factory() -> None:
    """Stamp the run in progress on every record as it is made, in the handler's thread: so the
    run's fields reach every logging handler (caplog in a user's tests, an application's own
    handlers, a QueueHandler formatting in another thread), not only leasework's formatters.
    Wraps the factory in place (an application's own is kept and called first); idempotent."""
    current = logging.getLogRecordFactory()
    if not getattr(current, "_leasework", False):
        logging.setLogRecordFactory(_stamping(current))


# A password in key=value form: the key, then its whole value as libpq reads it, quoted (spaces
# and escaped quotes inside, to the closing quote or the end) or not (backslash-escaped
# characters, `Top\ Secret`, included).
_PASSWORD_KEY = re.compile(r"password\s*=\s*", re.IGNORECASE)
_QUOTED_REST = re.compile(r"(?:[^'\\]|\\.)*'?", re.DOTALL)  # after the opening quote
_BARE = re.compile(r"(?:\\.|[^\s\\])*", re.DOTALL)


def _hide_kv_passwords(text: str) -> str:
    """Every `password=`'s value hidden, a key inside another key's value included (in
    `password='password=' password='secret'` the second key's value opens the quote the third
    key's value closes, so a left-to-right match that took the first value whole showed
    `secret`). Linear: a value starting inside an earlier value of the same kind (quoted, bare)
    ends where that one ends, since both scans meet at a position no backslash precedes, so each
    kind's scans cover disjoint stretches of the text."""
    hidden: list[tuple[int, int]] = []  # merged [start, end) spans, in order
    ends = {True: -1, False: -1}  # per kind, the end of the last value scanned
    for key in _PASSWORD_KEY.finditer(text):
        start = key.end()
        quoted = text.startswith("'", start)
        scan = start + 1 if quoted else start  # no backslash precedes it
        if scan < ends[quoted]:  # inside the last value of its kind, with the same end
            end = ends[quoted]
        else:
            rest = _QUOTED_REST if quoted else _BARE
            end = ends[quoted] = rest.match(text, scan).end()  # type: ignore[union-attr]
        if end <= start:
            continue
        if hidden and start <= hidden[-1][1]:
            hidden[-1] = (hidden[-1][0], max(hidden[-1][1], end))
        else:
            hidden.append((start, end))
    if not hidden:
        return text
    out: list[str] = []
    pos = 0
    for start, end in hidden:
        out.append(text[pos:start] + "***")
        pos = end
    out.append(text[pos:])
    return "".join(out)


# A URL's `scheme://` (letters, digits, `+.-`, at least one letter). A match may only start where
# a run of scheme characters starts (the look-behind), and `[0-9+.-]*` never takes a letter: a
# failed try costs the run once, not once per character of it (`[A-Za-z][A-Za-z0-9+.-]*://` was
# quadratic in a long run of letters and digits: 100,000 of them took 10 s).
_SCHEME = re.compile(r"(?<![A-Za-z0-9+.-])[0-9+.-]*[A-Za-z][A-Za-z0-9+.-]*://")


def redact_dsn(text: str, *, cut: bool = False) -> str:
    """Hide passwords in a DSN or in any message that may quote one, however malformed: a URL's
    whole userinfo after the user name (up to the last `@` on its line, so a password holding an
    unencoded `@`, `:` or a space goes whole) and a key=value password's whole value. Linear in
    the text. `cut`: the text is the head of a longer one, so a URL on its last line whose `@`
    was cut off is hidden to the end (what follows the user name may be the password)."""
    text = _hide_kv_passwords(text)
    out: list[str] = []
    pos = 0  # text[:pos] is in `out`
    search = 0
    while (m := _SCHEME.search(text, search)) is not None:
        start = m.end()
        end = text.find("\n", start)
        end = len(text) if end == -1 else end
        at = text.rfind("@", start, end)  # the last on the line: no later URL on it has one
        if at == -1 and cut and end == len(text):
            at = end
        if at == -1:
            search = end + 1  # no `@` after this URL on its line: none for any other URL on it
            continue
        search = at  # no `://` before `at` has an `@` beyond it but `at` itself
        if text.find(":", start, at) == -1:
            continue
        out.append(text[pos:start] + text[start : text.index(":", start, at)] + ":***")
        pos = at
    out.append(text[pos:])
    return "".join(out)


def clip(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters (its last one `…` when cut), passwords hidden.
    The work is bounded by `limit` however long the text: only the kept head is scanned, and a
    password reaching past the cut is hidden (`redact_dsn(cut=True)`), so nothing of a secret
    is kept because its end was not read."""
    cut = len(text) > limit
    out = redact_dsn(text[: max(0, limit - 1)] if cut else text, cut=cut)
    if not cut and len(out) <= limit:
        return out
    return out[: max(0, limit - 1)] + "…"  # `***` can be longer than what it hides


def has_password(dsn: str) -> bool:
    """True if a DSN (well formed or not) carries a password."""
    return redact_dsn(dsn) != dsn


FIRST_LINE_MAX = 2000


def first_line(exc: BaseException) -> str:
    """An error as one log-safe line: its message's first line (at most FIRST_LINE_MAX
    characters), DSN passwords redacted; the exception's type when the message is empty."""
    text = str(exc).strip()
    return clip(text.splitlines()[0] if text else type(exc).__name__, FIRST_LINE_MAX)


def _event(record: logging.LogRecord) -> tuple[str, dict[str, Any]]:
    """(event name, fields) of a record. A leasework event is its name and its structured fields;
    any other record (the application's, a handler's own `logging` call) is the event `log` with
    its logger's name and its message. Both carry the run they were logged in (stamped on the
    record; else the run in progress, RUN), if any. A DSN's password is hidden in every string
    value."""
    fields = getattr(record, "fields", None)
    if fields is not None:
        name, out = record.getMessage(), dict(fields)
    else:
        name, out = "log", {"logger": record.name, "message": record.getMessage()}
    run = getattr(record, "leasework_run", None)
    for key, value in (run if isinstance(run, dict) else RUN.get() or {}).items():
        out.setdefault(key, value)
    return name, {k: redact_dsn(v) if isinstance(v, str) else v for k, v in out.items()}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: {"ts", "level", "event", **fields}. For machines (journald,
    log shippers): the default when stderr is not a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        name, fields = _event(record)
        doc: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "event": name,
        }
        doc.update(fields)
        if record.exc_info:
            doc["exc"] = redact_dsn(self.formatException(record.exc_info))
        return orjson.dumps(doc, default=str).decode()


class TextFormatter(logging.Formatter):
    """One readable line per event: `12:00:01.250 INFO  run_claimed run_id=7 kind=sync`. For
    people: the default on a terminal. A traceback, when there is one, follows indented."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        millis = int(record.msecs)
        name, fields = _event(record)
        if name == "log":  # a plain record: `logger: message`, then the run's fields
            name = f"{fields.pop('logger')}: {fields.pop('message')}"
        parts = [f"{stamp}.{millis:03d} {record.levelname:<5} {name}"]
        for key, value in fields.items():
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
    """Route log records to stderr (or `stream`), one per line, as JSON or text: leasework's
    events and, in leasework's own processes, every other record too (the handlers' `logging`
    calls, with the run they belong to). The handler goes on the root logger, so leasework takes
    part in the logging configuration like any library: when the application configured logging
    itself (the root already has a handler that is not ours), leasework adds nothing and its
    events propagate to the application's handlers. Idempotent: a second call replaces the
    format and level."""
    explicit = stream is not None  # told where to write: write there whatever else is set up
    stream = sys.stderr if stream is None else stream
    chosen = resolve_format(fmt, stream)
    formatter: logging.Formatter = TextFormatter() if chosen == "text" else JsonFormatter()
    root = logging.getLogger()
    logger.setLevel(level.upper())
    logger.propagate = True
    for h in list(logger.handlers):  # from an older setup() that kept leasework to itself
        if getattr(h, "_leasework", False):
            logger.removeHandler(h)
    ours = [h for h in root.handlers if getattr(h, "_leasework", False)]
    for h in ours:
        if explicit and getattr(h, "stream", None) is not stream:
            root.removeHandler(h)
        else:
            h.setFormatter(formatter)
    if any(h in root.handlers for h in ours):
        root.setLevel(level.upper())
        return
    if root.handlers and not explicit:  # the application's own configuration: join it
        return
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    handler._leasework = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level.upper())


def event(name: str, level: int = logging.INFO, exc_info: bool = False, **fields: Any) -> None:
    """Log one event: `event("run_claimed", run_id=7, kind="sync")`."""
    if logger.isEnabledFor(level):
        logger.log(level, name, extra={"fields": fields}, exc_info=exc_info)


def enabled(level: int = logging.INFO) -> bool:
    """Whether an event at `level` would be logged: for a hot path, before it builds the fields
    of an event that would be dropped (logging caches the answer until its configuration
    changes)."""
    return logger.isEnabledFor(level)


def monotonic() -> float:
    return time.monotonic()
