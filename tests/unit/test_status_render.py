"""`leasework status` text stays readable at 80 columns, whatever the counts."""

from __future__ import annotations

from leasework.status import bar, render


def test_render_fits_in_80_columns_with_big_numbers():
    big = 10**12
    snap = {
        "workers": [
            {
                "id": "w" * 60,
                "host": "h" * 60,
                "pid": 4_194_304,
                "current_run": big,
                "alive": True,
                "heartbeat_age": 12.0,
            }
        ],
        "runs_by_status": dict.fromkeys(
            ["waiting", "queued", "running", "succeeded", "partial", "failed", "cancelled"], big
        ),
        "runs_by_kind": {"k" * 50: {"queued": big, "running": big, "failed": big}},
        "running": [
            {
                "id": big,
                "kind": "x" * 40,
                "processed_units": big // 3,
                "total_units": big,
                "cancel_requested": True,
            }
        ],
        "recent_failures": [{"id": big, "kind": "y" * 40, "error": "E" * 300}],
    }
    text = render(snap)
    assert "succeeded" in text and "cancel requested"[:5] in text
    too_long = [line for line in text.splitlines() if len(line) > 80]
    assert not too_long, too_long


def test_bar_bounds():
    assert bar(0, 10).startswith("[....")
    assert bar(10, 10).startswith("[####################]")
    assert bar(20, 10).startswith("[####################]")
    assert "?" in bar(3, None)
