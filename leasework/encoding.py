"""JSON for payloads and results: encoded with orjson (never pickle) and checked so that what is
stored is exactly what was given, or nothing is. Imports nothing of leasework but its errors."""

from __future__ import annotations

import math
import re
from typing import Any

import orjson

from .errors import PayloadError

# A NUL character in a string, as orjson writes it: `\u0000` not itself escaped (`\\u0000` is
# the six characters backslash, u, 0, 0, 0, 0, which jsonb stores fine).
_NUL = re.compile(rb"(?:^|[^\\])(?:\\\\)*\\u0000")


def check_json(what: str, value: Any, max_bytes: int) -> bytes:
    """`value` as JSON bytes, or PayloadError naming `what` and the reason: not JSON, a float
    that is not finite (orjson would write null), an integer past 64 bits (refused rather than
    rounded: send it as a string), a NUL character (jsonb cannot store it), over `max_bytes`."""
    try:
        data = orjson.dumps(value)
    except orjson.JSONEncodeError as exc:
        if "64-bit" in str(exc):
            raise PayloadError(
                f"{what} has an integer outside the 64-bit range, which would not be kept "
                "exactly: send it as a string"
            ) from None
        raise PayloadError(f"{what} is not JSON-serializable: {exc}") from None
    except TypeError as exc:
        raise PayloadError(f"{what} is not JSON-serializable: {exc}") from None
    if b"null" in data and _has_non_finite(value):
        raise PayloadError(
            f"{what} has a NaN or infinite number, which JSON cannot hold (it would be stored "
            "as null): send null, a finite number or a string"
        )
    if len(data) > max_bytes:
        raise PayloadError(f"{what} is {len(data)} bytes, over the cap of {max_bytes} bytes")
    if b"\\u0000" in data and _NUL.search(data):
        raise PayloadError(
            f"{what} contains a NUL character (\\u0000), which Postgres jsonb cannot store"
        )
    return data


def _has_non_finite(value: Any) -> bool:
    """True if a float nan or infinity is anywhere in `value` (orjson writes them as null; only
    called when the encoding has a null, so most values are never walked)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return False
