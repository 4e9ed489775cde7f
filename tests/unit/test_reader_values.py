"""How the readers show the values a row can hold that are no ordinary value: NaN and ±Infinity
in a float column, a timestamp Python cannot hold (read as the nearest one), jsonb nested deeper
than Python's JSON decoder goes, a history of any shape. Pure: the database side is
tests/security/test_readers_fuzz.py."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from psycopg.adapt import Transformer

from leasework import cli, status
from leasework.dashboard import pages


@pytest.mark.parametrize(
    ("value", "number", "seconds", "duration", "ago"),
    [
        (math.nan, "NaN", "NaN", "NaN", "NaN"),
        (math.inf, "∞", "∞", "∞", "∞"),
        (-math.inf, "-∞", "-∞", "0s", "0 s"),
        (60.0, "60", "60s", "1m00s", "1 min 0 s"),
        (1e300, "1e+300", "1e+300s", None, None),
    ],
)
def test_floats_that_are_no_number_are_named(
    value: float, number: str, seconds: str, duration: str | None, ago: str | None
) -> None:
    assert status.number_text(value) == number
    assert status.seconds_text(value) == seconds
    if duration is not None:
        assert status.duration(value) == duration
        assert pages.ago(value) == ago


@given(st.floats())
def test_every_float_is_shown(value: float) -> None:
    for text in (status.number_text(value), status.duration(value), pages.ago(value)):
        assert isinstance(text, str) and text


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (status.AFTER_ALL, "infinity"),
        (status.BEFORE_ALL, "-infinity"),
        (status.AFTER_ALL.isoformat(), "infinity"),  # a --json snapshot's text
        (datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC), "2024-01-02 03:04:05"),
        (datetime(2024, 1, 2, 4, 4, 5, tzinfo=timezone(timedelta(hours=1))), "2024-01-02 03:04:05"),
        # in Python's years in its own zone, past them in UTC's
        (
            datetime(9999, 12, 31, 20, tzinfo=timezone(timedelta(hours=-5))),
            "9999-12-31 20:00:00-0500",
        ),
        ("soon", "soon"),
        (None, "-"),
    ],
)
def test_timestamps_past_pythons_years_are_named(value: Any, shown: str) -> None:
    assert status.instant_text(value) == shown
    assert pages.when(value) == ("" if value is None else shown)


def _load_jsonb(text: str) -> Any:
    loader = status._BoundedJsonbLoader(3802, Transformer())  # 3802: jsonb
    return loader.load(text.encode())


@pytest.mark.parametrize("depth", [status.READABLE_DEPTH + 1, 3000, 100_000])
def test_jsonb_too_deep_to_print_is_read_as_its_text(depth: int) -> None:
    text = "[" * depth + "]" * depth
    assert _load_jsonb(text) == text
    deep_object = '{"a": ' * depth + "1" + "}" * depth
    assert _load_jsonb(deep_object) == deep_object


def test_jsonb_within_the_depth_is_read_as_json() -> None:
    depth = status.READABLE_DEPTH
    value = _load_jsonb("[" * depth + "]" * depth)
    assert isinstance(value, list)
    # many brackets, little depth: JSON, and a string of brackets stays a string
    assert _load_jsonb("[" + ",".join(["[]"] * 1000) + "]") == [[]] * 1000
    assert _load_jsonb('"' + "[" * 1000 + '"') == "[" * 1000


RUN = {
    "id": 1, "kind": "echo", "status": "failed", "cancel_requested_at": None, "key": None,
    "tenant": None, "group": None, "priority": 0, "attempts": 1, "max_attempts": 1,
    "processed_units": 0, "total_units": None, "created_at": status.BEFORE_ALL,
    "queued_at": status.AFTER_ALL, "started_at": None, "finished_at": None, "lease_owner": None,
    "payload": {}, "result": None, "error": None,
}  # fmt: skip


@pytest.mark.parametrize(
    "history",
    [
        "a plain string",
        7,
        None,
        {"attempt": 1},
        ["x", 5, None, [], {"attempt": [1], "error": 7, "started_at": {"a": 1}}],
        [{"attempt": 1, "started_at": "2024-01-01", "ended_at": "2024-01-01T00:00:01+00:00"}],
    ],
)
def test_a_history_of_any_shape_is_shown(history: Any) -> None:
    run = {**RUN, "history": history}
    text = cli.render_run(run, datetime.now(UTC))
    assert "history (" in text and "infinity" in text and "-infinity" in text
    page = pages.run_page(run, now=datetime.now(UTC))
    assert 'id="history"' in page
    if history is not None:
        assert len(pages.history_entries(history)) == (
            len(history) if isinstance(history, list) else 1
        )
