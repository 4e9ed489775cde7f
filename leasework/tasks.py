"""What a task is, and the checks every enqueue makes of what it is given: a leaf module (the
app, the stages and the families build on it; it imports none of them)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from .errors import ConfigError, PayloadError
from .workers.context import Context

# A run's attempt is aborted (and retried while attempts remain) after this long unless its task
# says otherwise: a deadlocked handler would otherwise hold its lease for ever, the keeper
# renewing it. `@app.task(timeout=None)` turns it off for a task.
DEFAULT_TIMEOUT = 3600.0

_NAME_RE = re.compile(r"^[A-Za-z0-9_.:/@+-]{1,200}$")
_MAX_LABEL = 200


@dataclass(frozen=True)
class Task:
    kind: str
    fn: Callable[[Context, Any], Any]
    max_attempts: int | None = None
    lease: float | None = None
    timeout: float | None = None
    # The stage that claims and executes this kind: "runs" for user tasks, syncs and purges;
    # families with a stage of their own (e.g. "ingest") name it here.
    stage: str = "runs"
    # Short tasks may opt into claiming up to `batch` runs per statement (runs stage, one at a
    # time inline, each under its own lease) and finishing the successes in one statement.
    batch: int = 1
    # The family that registered it (None: the user's own task); App.with_config re-installs
    # families rather than copying their tasks.
    family: str | None = None


def check_kind(kind: object) -> str:
    if not isinstance(kind, str) or not _NAME_RE.match(kind):
        raise ConfigError(
            f"kind {kind!r} is not valid: use 1-200 characters from letters, digits and _ . : / @ + -"
        )
    return kind


def check_label(name: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > _MAX_LABEL:
        raise ConfigError(
            f"{name} must be a non-empty string of at most {_MAX_LABEL} characters, got {value!r}"
        )
    if any(ord(ch) < 32 or ch == "\x7f" for ch in value):
        raise ConfigError(f"{name} {value!r} contains control characters")
    return value


def check_seconds(name: str, value: object, *, allow_zero: bool) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a number of seconds, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(
            f"{name} must be {'>= 0' if allow_zero else '> 0'} seconds, got {value!r}"
        )
    return float(value)


def check_attempts(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1000:
        raise ConfigError(f"max_attempts must be an integer from 1 to 1000, got {value!r}")
    return value


def encode_payload(payload: Any, max_bytes: int) -> bytes:
    """JSON via orjson (never pickle), capped at `max_bytes`."""
    try:
        data = orjson.dumps(payload)
    except (orjson.JSONEncodeError, TypeError) as exc:
        raise PayloadError(f"payload is not JSON-serializable: {exc}") from None
    if len(data) > max_bytes:
        raise PayloadError(f"payload is {len(data)} bytes, over the cap of {max_bytes} bytes")
    if b"\\u0000" in data:
        raise PayloadError(
            "payload contains a NUL character (\\u0000), which Postgres jsonb cannot store"
        )
    return data


def check_priority(priority: object) -> int:
    if (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or not -(2**31) <= priority < 2**31
    ):
        raise ConfigError(f"priority must be a 32-bit integer (lower runs first), got {priority!r}")
    return priority
