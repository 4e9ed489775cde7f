"""Flow control's values, without a database: rates as written (COUNT/PERIOD) and read back, the
decorator's limits checked with one line naming what is valid, and the status lines of a
limited kind within 80 columns."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from leasework import App, operations, status
from leasework.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "rate"),
    [
        ("100/10s", (100, 10.0)),
        ("5/m", (5, 60.0)),
        ("1000/1h", (1000, 3600.0)),
        ("20000/1d", (20000, 86400.0)),
        ("10/500ms", (10, 0.5)),
        (" 3 / 0.5s ", (3, 0.5)),
    ],
)
def test_rates_as_written(text: str, rate: tuple[int, float]) -> None:
    assert operations.parse_rate(text) == rate


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("100", "is not valid"),
        ("100/10x", "is not valid"),
        ("-1/s", "is not valid"),
        ("0/s", "out of range"),
        ("1000001/s", "out of range"),
        ("1/50ms", "out of range"),
        ("1/8d", "out of range"),
        (100, "is not valid"),
        (None, "is not valid"),
    ],
)
def test_a_bad_rate_is_one_line_naming_what_is_valid(bad: Any, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as caught:
        operations.parse_rate(bad)
    assert "COUNT/PERIOD, such as 100/10s" in str(caught.value) and "\n" not in str(caught.value)


@given(st.integers(1, 1_000_000), st.sampled_from([0.5, 1, 10, 60, 90, 3600, 7200, 86400]))
def test_a_rate_reads_back_as_shown(count: int, seconds: float) -> None:
    assert operations.parse_rate(status.rate_spec(count, seconds)) == (count, float(seconds))


def test_the_decorator_declares_its_limits_and_refuses_bad_ones() -> None:
    app = App()
    app.task("crm.sync", rate="100/10s", rate_per="tenant", max_running=5)(lambda c, p: None)
    assert dict(app.tasks["crm.sync"].limits) == {
        "max_running": 5,
        "rate": [100, 10.0],
        "rate_per": "tenant",
    }
    app.task("plain")(lambda c, p: None)
    assert dict(app.tasks["plain"].limits) == {}
    for bad, says in [
        ({"max_running": 0}, "max_running must be an integer from 1 to 100,000"),
        ({"group_limit": 2.5}, "group_limit must be an integer"),
        ({"rate": "fast"}, "rate 'fast' is not valid"),
        ({"rate_per": "tenant"}, "needs a rate="),
        ({"rate": "1/s", "rate_per": "key"}, "rate_per must be 'tenant' or 'group'"),
    ]:
        with pytest.raises(ConfigError, match=says):
            app.task("bad", **bad)


def test_status_lines_of_a_limited_kind_fit_80_columns() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    rows = [
        {
            "kind": "k" * 60,
            "max_running": 5,
            "running": 5,
            "group_limit": 3,
            "rate_count": 100,
            "rate_seconds": 10.0,
            "rate_per": "tenant",
            "rate_used": 100,
            "rate_free_at": now + timedelta(seconds=4),
            "due": 12,
            "held_back": 12,
            "closed": "capped",
            "paused": True,
            "overrides": {"max_running": 5},
            "tenant_rates": [{"tenant": "t" * 100, "rate_count": 5, "rate_seconds": 60.0}],
        }
    ]
    lines = status.limit_lines(rows, now.timestamp())
    assert all(len(line) <= 80 for line in lines)
    assert "max_running* 5/5" in lines[0] and "paused, at its cap, 12 of 12 due held back" in lines[1]
    rows[0]["closed"] = "rate_limited"
    assert "rate-limited, room again in 4s" in status.limit_lines(rows, now.timestamp())[1]
