"""The dashboard's HTML, without a database: whatever text the runs hold, the pages carry only
the dashboard's own tags and attributes (hypothesis), and the small formatters behave."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from html.parser import HTMLParser
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from leasework.dashboard import pages
from leasework.dashboard.server import _allowed_hosts, host_allowed

ALLOWED_TAGS = {
    "html", "head", "meta", "title", "link", "body", "header", "h1", "h2", "a", "span", "main",
    "section", "p", "div", "table", "thead", "tbody", "tr", "th", "td", "progress", "br", "pre",
    "dl", "dt", "dd", "nav", "form", "input", "button", "label", "select", "option",
}  # fmt: skip
ALLOWED_ATTRS = {"lang", "charset", "name", "content", "http-equiv", "rel", "href", "type", "class", "id", "value", "max", "data-card",
                 "method", "action", "data-action", "required", "selected", "placeholder",
                 # the runs list's bulk form: a checkbox per run outside it (form="bulk")
                 "form", "checked", "aria-label"}  # fmt: skip
# A kind's limits (the /kinds page's limits form) beside the actions' own fields.
FORM_FIELDS = {"csrf", "back", "kind", "confirm", "max_running", "group_limit", "rate", "rate_per",
               # the runs list's bulk form: the runs ticked, which runs, the list's filters
               "id", "scope", "action", *(f"filter_{k}" for k in pages.RUN_FILTERS)}  # fmt: skip
ROOT = "/ops/lw"
ACTIONS = pages.View(ROOT, csrf="t0ken", flash="run 1 cancelled")


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: set[str] = set()
        self.attrs: set[str] = set()
        self.hrefs: set[str] = set()
        self.forms: list[dict[str, str | None]] = []
        self.fields: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        for name, value in attrs:
            self.attrs.add(name)
            if name == "href":
                self.hrefs.add(value or "")
        if tag == "form":
            self.forms.append(dict(attrs))
        if tag == "input" and dict(attrs).get("type") in ("hidden", "checkbox"):
            self.fields.add(dict(attrs).get("name") or "")


def parse(page: str) -> _Tags:
    p = _Tags()
    p.feed(page)
    p.close()
    return p


def check_markup(page: str, root: str = "") -> _Tags:
    """Only our own tags and attributes; every link and form action under `root` (a mounted
    dashboard's prefix), every POST form carrying the CSRF token."""
    found = parse(page)
    assert found.tags <= ALLOWED_TAGS, found.tags - ALLOWED_TAGS
    assert found.attrs <= ALLOWED_ATTRS, found.attrs - ALLOWED_ATTRS
    for href in found.hrefs:
        local = href.removeprefix(root)
        assert href.startswith(root + "/"), (root, href)
        assert local in ("/", "/runs", "/kinds", "/schedules", "/connections") or local.startswith(
            ("/runs/", "/runs?", "/static/")
        ), href
    for form in found.forms:
        action = form.get("action") or ""
        assert action.startswith(root + "/"), (root, action)
        if form.get("method") == "post":
            assert "csrf" in found.fields
    assert found.fields <= FORM_FIELDS, found.fields
    return found


hostile = st.text(alphabet=st.sampled_from('<>"\'&=/ ab\n\u2028;:'), max_size=40) | st.sampled_from(
    ['<script>alert(1)</script>', '"><img src=x onerror=alert(1)>', "</pre><a href=//evil>", "javascript:x"]
)  # fmt: skip


def snapshot(t: str, n: int) -> dict[str, Any]:
    return {
        "workers": [
            {
                "id": t,
                "host": t,
                "pid": n,
                "current_run": n,
                "alive": True,
                "heartbeat_age": 1.5,
                "started_at": t,
            },
        ],
        "runs_by_status": {"queued": n, t: n},
        "runs_by_kind": {t: {"queued": n, t: n}},
        "running": [
            {
                "id": n,
                "kind": t,
                "key": t,
                "tenant": t,
                "attempts": n,
                "max_attempts": n,
                "processed_units": n,
                "total_units": n + 1,
                "lease_worker": t,
                "lease_left": 3.0,
                "running_for": 2.0,
                "cancel_requested": True,
                "rate": 1.5,
                "eta": 3.0,
            },
        ],
        "recent_failures": [
            {"id": n, "kind": t, "key": t, "status": t, "attempts": n, "failed_at": t, "error": t},
        ],
        "connections": [
            {
                "id": n,
                "workspace": t,
                "provider": t,
                "status": t,
                "sync_interval_seconds": 60,
                "next_run_at": t,
                "last_run_id": n,
                "last_run_kind": t,
                "last_run_status": t,
                "tables": {t: {"status": "failed", "error": t}, "x": {"status": t}},
            },
        ],
    }


@settings(max_examples=200, deadline=None)
@given(hostile, st.integers(min_value=1, max_value=10**12))
def test_overview_carries_only_its_own_markup(t: str, n: int) -> None:
    recent = [{"id": n, "kind": t, "key": t, "tenant": t, "status": t, "attempts": 1,
               "max_attempts": 3, "processed_units": 1, "total_units": None, "queued_at": None}]  # fmt: skip
    check_markup(pages.overview(snapshot(t, n), recent, oldest_queued=4.0, now=t))
    check_markup(pages.overview(snapshot(t, n), recent, oldest_queued=4.0, now=t, v=ACTIONS), ROOT)


@settings(max_examples=200, deadline=None)
@given(hostile, st.integers(min_value=1, max_value=10**12))
def test_run_page_carries_only_its_own_markup(t: str, n: int) -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    run = {
        "id": n, "kind": t, "key": t, "tenant": t, "group": t, "exclusive": True, "priority": 0,
        "status": t, "payload": {t: [t]}, "result": {"tables": {t: {"status": t, "error": t}}, t: t},
        "error": t, "attempts": 2, "max_attempts": 3, "queued_at": now, "created_at": now,
        "started_at": now, "finished_at": None, "lease_worker": t,
        "lease_expires_at": now + timedelta(seconds=30), "cancel_requested_at": now,
        "processed_units": 5, "total_units": 10,
        "history": [{"attempt": 1, "worker": t, "started_at": t, "ended_at": t, "outcome": t, "error": t}, t],
    }  # fmt: skip
    assert not parse(pages.run_page(run, now=now)).forms
    for status in ("queued", "running", "failed", "succeeded", t):
        page = pages.run_page({**run, "status": status, "cancel_requested_at": None}, now=now, v=ACTIONS)
        check_markup(page, ROOT)
    check_markup(pages.error_page(503, t))
    check_markup(pages.error_page(409, t, ACTIONS), ROOT)


@settings(max_examples=100, deadline=None)
@given(hostile, st.integers(min_value=1, max_value=10**12))
def test_lists_carry_only_their_own_markup_and_stay_under_the_root(t: str, n: int) -> None:
    runs = [{"id": n, "kind": t, "key": t, "tenant": t, "status": s, "attempts": 1, "max_attempts": 3,
             "created_at": t, "error": t} for s in (*pages.STATUS_ORDER, t)]  # fmt: skip
    paused = [{"kind": t, "paused_at": t, "queued": n}]
    for v, root in ((pages.PLAIN, ""), (ACTIONS, ROOT)):
        listing = check_markup(
            pages.runs_page(runs, filters={"kind": t}, next_before=n, paused=paused, v=v), root
        )
        kinds = check_markup(pages.kinds_page({t: {"queued": n}, "b": {}}, paused, ["c"], v), root)
        check_markup(pages.schedules_page([], v), root)
        check_markup(pages.connections_page(snapshot(t, n)["connections"], v), root)
        posts = [f for f in listing.forms + kinds.forms if f.get("method") == "post"]
        assert bool(posts) is (v is ACTIONS)


def test_action_forms_follow_the_run_status() -> None:
    def actions(status: str, **extra: Any) -> list[str]:
        run = {"id": 7, "kind": "mail", "status": status, **extra}
        found = parse(pages.run_page(run, now=None, v=ACTIONS))
        return sorted(str(f.get("data-action")) for f in found.forms if f.get("method") == "post")

    assert actions("queued") == ["cancel", "pause"]
    assert actions("running") == ["cancel", "pause"]
    assert actions("running", cancel_requested_at="2026-01-01") == ["pause"]
    assert actions("failed", kind_paused=True) == ["delete", "resume", "retry"]
    assert actions("succeeded") == ["delete", "pause"]
    assert actions("partial") == ["delete", "pause", "retry"]
    page = pages.run_page({"id": 7, "kind": "mail", "status": "failed"}, now=None, v=ACTIONS)
    assert 'action="/ops/lw/runs/7/retry"' in page and 'value="t0ken"' in page
    assert '<p class="flash" id="flash">run 1 cancelled</p>' in page
    # read-only: no form at all, whatever the status
    assert "<form" not in pages.run_page({"id": 7, "kind": "m", "status": "failed"}, now=None)


def test_progress_bars() -> None:
    assert '<progress value="4" max="10">' in pages.progress(4, 10)
    assert "4 / 10 (40%)" in pages.progress(4, 10)
    assert '<progress value="10" max="10">' in pages.progress(12, 10)  # a bar never overflows
    assert "<progress></progress> 3 / ?" in pages.progress(3, None)  # unknown total
    assert "<progress></progress> 0 / ?" in pages.progress(None, 0)


def test_durations_and_times() -> None:
    assert [pages.ago(s) for s in (0, 59, 61, 3600 + 120, 90000, -5)] == [
        "0 s", "59 s", "1 min 1 s", "1 h 2 min", "1 d 1 h", "0 s",
    ]  # fmt: skip
    assert pages.ago(None) == ""
    assert pages.when("2026-01-02T03:04:05.678+01:00") == "2026-01-02 02:04:05"
    assert pages.when(None) == "" and pages.when("not a time") == "not a time"


def test_refresh_only_while_a_run_is_live() -> None:
    base = {"id": 1, "payload": {}, "history": [], "result": None}
    assert 'http-equiv="refresh"' in pages.run_page({**base, "status": "running"}, now=None)
    assert 'http-equiv="refresh"' not in pages.run_page({**base, "status": "failed"}, now=None)


def test_host_allowlist() -> None:
    allowed = _allowed_hosts("127.0.0.1", 8080, ["dash.internal"])
    assert allowed is not None
    for good in ("127.0.0.1:8080", "localhost:8080", "localhost", "[::1]:8080", "dash.internal"):
        assert host_allowed(good, allowed, 8080), good
    assert not host_allowed("evil.example:8080", allowed, 8080)
    assert _allowed_hosts("0.0.0.0", 8080, []) is None  # not loopback: any Host


def test_display_details() -> None:
    """A finished run without a result says "no result", not "no result yet"; a delayed run's
    last change is when it was queued, not its future due time; "oldest queued" says "none due"
    while only delayed runs are queued."""
    from datetime import UTC, datetime, timedelta

    now = datetime(2026, 5, 1, 12, tzinfo=UTC)
    run = {"id": 7, "status": "failed", "payload": {}, "result": None, "history": [],
           "attempts": 3, "max_attempts": 3, "error": "boom"}  # fmt: skip
    page = pages.run_page(run, now=now)
    assert "no result</p>" in page and "no result yet" not in page
    assert "no result yet" in pages.run_page({**run, "status": "queued"}, now=now)
    delayed = {"queued_at": now + timedelta(hours=1), "created_at": now}
    assert pages.last_change(delayed) == now
    assert pages.last_change({"queued_at": now, "created_at": now}) == now
    assert pages.last_change({**delayed, "started_at": now + timedelta(hours=2)}) > now
    snap = {"workers": [], "runs_by_status": {"queued": 1}, "runs_by_kind": {}}
    overview = pages.overview(snap, [], oldest_queued=None, now=now)
    card = overview.split('data-card="oldest-queued"')[1].split("</div>")[0]
    assert "none due" in card


def test_run_page_says_a_run_is_debounced_or_holds_a_unique_window() -> None:
    at = datetime(2026, 5, 4, 12, 0, tzinfo=UTC)
    run = {"id": 7, "kind": "reindex", "status": "queued", "queued_at": at}
    plain = pages.run_page(run, now=at)
    assert "debounced" not in plain and "unique window" not in plain
    debounced = pages.run_page(
        {**run, "debounce_count": 3, "debounce_deadline": at + timedelta(minutes=5)}, now=at
    )
    assert "3 enqueues merged; due at the latest 2026-05-04 12:05" in debounced
    assert "(never bounded)" in pages.run_page({**run, "debounce_count": 1}, now=at)
    window = pages.run_page({**run, "unique_at": at}, now=at)
    assert "unique window since (UTC)" in window and "2026-05-04 12:00" in window


@settings(max_examples=50, deadline=None)
@given(kind=st.text(max_size=30), status=st.text(max_size=12))
def test_a_runs_dependencies_carry_only_the_dashboards_markup(kind: str, status: str) -> None:
    """docs/workflows.md: the run page lists parents and children, each linked, with its
    status and policy, and the graph's runs by status; whatever text they hold."""
    found = {
        "parents": [{"id": 3, "kind": kind, "status": status, "on_failure": "cancel", "member": False}],
        "children": [{"id": 9, "kind": "b", "status": "blocked", "on_failure": "run", "member": True}],
        "graph": {status: 2, "blocked": 1},
    }
    page = pages.run_page({"id": 7, "kind": "a", "status": "blocked", "dependencies": found}, now=None)
    tags = parse(page)
    assert tags.tags <= ALLOWED_TAGS and tags.attrs <= ALLOWED_ATTRS
    assert f"{ROOT}/runs/3" not in page  # PLAIN view: links from the root
    assert 'href="/runs/3"' in page and 'href="/runs/9"' in page
    assert "graph: 3 runs" in page
    assert 'id="dependencies"' not in pages.run_page({"id": 7, "kind": "a", "status": "queued"}, now=None)


@settings(max_examples=100, deadline=None)
@given(hostile, st.integers(min_value=0, max_value=10**12))
def test_the_bulk_form_and_confirm_page_carry_only_their_own_markup(t: str, n: int) -> None:
    """The runs list's bulk form under a hostile filter, and the confirm page of a bulk action
    naming a hostile filter: every value escaped, every form under the root, the ticked runs and
    the filters carried as hidden fields, confirm=yes only on the confirm page."""
    filters = {name: t for name in pages.RUN_FILTERS}
    listing = pages.runs_page(
        [{"id": n + 1, "kind": t, "status": "failed", "attempts": 1, "max_attempts": 3}],
        filters=filters,
        next_before=None,
        v=ACTIONS,
        matching=n,
    )
    check_markup(listing, ROOT)
    assert 'id="bulk"' in listing and 'form="bulk"' in listing and 'id="scope-filter"' in listing
    assert 'name="confirm"' not in listing.split('id="bulk"', 1)[1].split("</form>", 1)[0]
    page = pages.bulk_confirm_page(
        "cancel",
        count=n,
        which=f"every run matching kind={t}",
        fields={"action": "cancel", "scope": "filter", "back": "/runs", "filter_kind": t},
        ids=[n + 1],
        back="/runs",
        v=ACTIONS,
    )
    found = check_markup(page, ROOT)
    assert ("confirm-button" in page) is (n > 0)
    if n > 0:
        assert 'name="confirm" value="yes"' in page and f'name="id" value="{n + 1}"' in page
        assert {"confirm", "id", "filter_kind"} <= found.fields
