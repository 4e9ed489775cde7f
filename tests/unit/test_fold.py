"""status.fold: the kinds past max_kinds_shown summed into one `other` (the listing of `leasework
status`, the dashboard's tables), whatever the number of kinds."""

from __future__ import annotations

from typing import Any

from leasework import status


def snap(**kinds: dict[str, int]) -> dict[str, Any]:
    return {
        "runs_by_kind": kinds,
        "oldest_due": {k: float(v.get("queued", 0)) for k, v in kinds.items() if v.get("queued")},
        "unserved": [
            {"kind": k, "due": v["queued"], "oldest_due": 99.0, "alive": 0}
            for k, v in kinds.items()
            if v.get("queued")
        ],
    }


def test_the_busiest_kinds_keep_their_line_and_the_rest_are_summed() -> None:
    folded = status.fold(
        snap(
            busy={"queued": 5, "succeeded": 10},
            mid={"queued": 3},
            b={"queued": 1},
            a={"succeeded": 1},
            other={"queued": 7},  # a kind named other is summed there too
        ),
        2,
    )
    assert folded["runs_by_kind"] == {
        "busy": {"queued": 5, "succeeded": 10},
        "mid": {"queued": 3},
        "other": {"queued": 8, "succeeded": 1},
    }
    assert folded["kinds_folded"] == 3
    assert folded["oldest_due"] == {"busy": 5.0, "mid": 3.0, "other": 7.0}
    assert [u["kind"] for u in folded["unserved"]] == ["busy", "mid", "other"]
    assert folded["unserved"][-1]["due"] == 8
    text = status.render(
        {**folded, "workers": [], "runs_by_status": {}, "running": [], "recent_failures": []}
    )
    assert "(other: 3 more kinds summed; max_kinds_shown)" in text
    assert text.index("  busy") < text.index("  other")


def test_nothing_is_folded_under_the_limit() -> None:
    s = snap(a={"queued": 1}, b={"succeeded": 2})
    assert status.fold(s, 2) == {**s, "kinds_folded": 0}
    assert status.shown_kinds({"a": {"queued": 1}}, 5, ["z"]) == {"a", "z"}
    # ties by name
    assert status.shown_kinds({"b": {"queued": 1}, "a": {"queued": 1}}, 1) == {"a"}
