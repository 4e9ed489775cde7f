"""next_fire is pure: the next fire time from now, never from the previous one."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

from hypothesis import given
from hypothesis import strategies as st

from leasework.tasks import ScheduleSpec, first_fire, next_fire

moments = st.datetimes(
    min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.just(UTC)
)


@given(now=moments, every=st.floats(min_value=0.001, max_value=1e7))
def test_every_is_now_plus_period(now: datetime, every: float) -> None:
    spec = ScheduleSpec.make("k", every=every)
    assert next_fire(spec, now) == now + timedelta(seconds=every)
    assert first_fire(spec, now) == now


@given(now=moments)
def test_quarter_hour_cron_is_the_next_boundary(now: datetime) -> None:
    spec = ScheduleSpec.make("k", cron="*/15 * * * *", tz="Asia/Kathmandu")  # +05:45
    nxt = next_fire(spec, now)
    assert now < nxt <= now + timedelta(minutes=15)
    local = nxt.astimezone(ZoneInfo("Asia/Kathmandu"))
    assert local.minute % 15 == 0 and local.second == 0
    assert first_fire(spec, now) == nxt


def test_cron_follows_the_time_zone_across_dst() -> None:
    spec = ScheduleSpec.make("k", cron="0 9 * * *", tz="America/New_York")
    winter = next_fire(spec, datetime(2024, 3, 9, 15, 0, tzinfo=UTC))
    summer = next_fire(spec, datetime(2024, 3, 10, 15, 0, tzinfo=UTC))
    assert winter == datetime(2024, 3, 10, 13, 0, tzinfo=UTC)  # 09:00 EDT on the switch day
    assert summer == datetime(2024, 3, 11, 13, 0, tzinfo=UTC)
    assert next_fire(spec, datetime(2024, 1, 5, 12, 0, tzinfo=UTC)) == datetime(
        2024, 1, 5, 14, 0, tzinfo=UTC
    )


def test_downtime_never_backfills() -> None:
    spec = ScheduleSpec.make("k", cron="*/15 * * * *")
    missed_since = datetime(2024, 1, 1, 0, 0, tzinfo=UTC)
    now = missed_since + timedelta(hours=6, minutes=7)
    assert next_fire(spec, now) == datetime(2024, 1, 1, 6, 15, tzinfo=UTC)
