"""The dashboard's HTML: pure functions from snapshots (plain dicts) to pages. Every value that
came from the database or a user goes through `esc`; no page carries a script. Every link and
form action starts with the view's root (the WSGI SCRIPT_NAME, so the dashboard works mounted
under a prefix); the action forms (POST, with the CSRF token) are drawn only when the view has
one, that is when actions are enabled."""

from __future__ import annotations

import html
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

import orjson

from ..status import OTHER, held_back_lines, instant_text, number_text, rate_spec
from ..text import UNSAFE, tags_text


@dataclass(frozen=True)
class View:
    """What a page needs from its request: `root`, the prefix of every link and form action (''
    when served at /); `csrf`, the token the action forms carry (None: actions are off, and no
    form is drawn); `flash`, a one-line message from the action just done; `actions_on`, that
    the dashboard has actions enabled, for the header's mode on a page that draws no form (an
    error page, or a refusal made before this browser's token was known)."""

    root: str = ""
    csrf: str | None = None
    flash: str | None = None
    actions_on: bool = False

    @property
    def actions(self) -> bool:
        return self.csrf is not None

    def url(self, path: str) -> str:
        return self.root + path


PLAIN = View()

STATUS_ORDER = (
    "blocked",
    "waiting",
    "queued",
    "running",
    "succeeded",
    "partial",
    "failed",
    "cancelled",
)
LIVE_STATUSES = frozenset({"blocked", "waiting", "queued", "running"})
REFRESH_SECONDS = 5

CSS = """\
:root { --fg: #1d2330; --muted: #6b7385; --line: #dde1e8; --bg: #f6f7f9; --card: #fff;
        --ok: #1f8a4c; --bad: #c0392b; --warn: #b7791f; --run: #2563eb; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif;
       color: var(--fg); background: var(--bg); }
header { display: flex; align-items: baseline; gap: 1.5em; padding: .8em 1.5em;
         background: #1d2330; color: #fff; }
header h1 { font-size: 1.15em; margin: 0; }
header a { color: #fff; text-decoration: none; }
header .note { color: #aab1c2; font-size: .9em; }
header nav a { margin-right: 1em; }
form.filters { display: flex; flex-wrap: wrap; gap: .6em; align-items: end; margin: 0 0 .8em; }
form.filters label { display: flex; flex-direction: column; font-size: .85em; color: var(--muted); }
.pager { margin-top: .8em; }
main { padding: 1em 1.5em 3em; max-width: 1400px; }
section { background: var(--card); border: 1px solid var(--line); border-radius: 6px;
          padding: .8em 1em; margin: 0 0 1em; }
h2 { font-size: 1em; margin: 0 0 .6em; }
.cards { display: flex; flex-wrap: wrap; gap: .8em; margin-bottom: 1em; }
.card { background: var(--card); border: 1px solid var(--line); border-radius: 6px;
        padding: .6em 1em; min-width: 9em; }
.card .n { font-size: 1.6em; font-weight: 600; }
.card .l { color: var(--muted); font-size: .85em; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: .3em .6em; border-bottom: 1px solid var(--line);
         vertical-align: top; }
th { color: var(--muted); font-weight: 500; font-size: .85em; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
.muted, .empty { color: var(--muted); }
.status { display: inline-block; padding: 0 .5em; border-radius: 3px; font-size: .85em;
          background: #eef0f4; }
.s-succeeded, .s-alive, .s-active { background: #e3f4ea; color: var(--ok); }
.s-failed, .s-gone, .s-expired, .s-crashed { background: #fbe7e4; color: var(--bad); }
.s-partial, .s-cancelled, .s-released, .s-retry, .s-will-retry, .s-paused { background: #fbf1df; color: var(--warn); }
.s-running, .s-snoozed { background: #e3ecfd; color: var(--run); }
progress { width: 12em; height: .9em; vertical-align: middle; }
.progress { white-space: nowrap; }
pre { background: #f3f4f7; border: 1px solid var(--line); border-radius: 4px; padding: .6em;
      overflow: auto; max-height: 30em; margin: 0; white-space: pre-wrap; word-break: break-word; }
dl { display: grid; grid-template-columns: max-content 1fr; gap: .2em 1.2em; margin: 0; }
dt { color: var(--muted); }
dd { margin: 0; }
.error { color: var(--bad); }
form.action { display: inline; margin: 0 .3em 0 0; }
form.action button { font: inherit; font-size: .85em; padding: .05em .6em; cursor: pointer;
                     border: 1px solid var(--line); border-radius: 3px; background: #fff; }
form.action button.danger { color: var(--bad); border-color: #e8b4ad; }
form.action label { font-size: .85em; color: var(--muted); margin-right: .4em; }
.flash { background: #e3f4ea; color: var(--ok); border: 1px solid #b9e0c8; border-radius: 6px;
         padding: .5em 1em; margin: 0 0 1em; }
.charts { display: flex; flex-wrap: wrap; gap: 1.5em; }
.chart h3 { font-size: .9em; font-weight: 500; color: var(--muted); margin: 0 0 .3em; }
.chart svg.plot { display: block; }
.chart svg.plot text { font-size: 10px; fill: var(--muted); }
.legend { list-style: none; margin: .3em 0 0; padding: 0; font-size: .85em; max-width: 360px; }
.legend li { display: inline-block; margin-right: .9em; white-space: nowrap; }
"""


FAVICON = (
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16">'
    '<rect width="16" height="16" rx="3" fill="#1d2330"/>'
    '<rect x="3" y="9" width="10" height="3" rx="1" fill="#2563eb"/>'
    '<rect x="3" y="4" width="6" height="3" rx="1" fill="#1f8a4c"/></svg>\n'
)


_CONTROL = {c: repr(chr(c))[1:-1] for c in UNSAFE if c not in (9, 10)}


def esc(value: object) -> str:
    """Text for HTML (element content and quoted attributes alike); control characters other
    than tab and newline, bidi controls and line separators (leasework.text) are shown escaped
    (`\\x1b`, `\\u202e`), as in the terminal: a row cannot reverse or split what is shown."""
    return html.escape("" if value is None else str(value), quote=True).translate(_CONTROL)


def when(value: object) -> str:
    """A timestamp (datetime or ISO text) as `YYYY-MM-DD HH:MM:SS` UTC (`infinity`, `-infinity`
    for one past Python's years); blank when unset; anything else as it is."""
    if isinstance(value, datetime | str | None):
        return instant_text(value, empty="")
    return str(value)


def ago(seconds: object) -> str:
    """A duration for people: `4 s`, `3 min 5 s`, `2 h 10 min`, `3 d 4 h`."""
    if not isinstance(seconds, int | float):
        return ""
    if isinstance(seconds, float) and (math.isnan(seconds) or seconds == math.inf):
        return number_text(seconds)  # a row's NaN or Infinity
    s = max(0, int(seconds)) if seconds > -math.inf else 0
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


def status_badge(status: object) -> str:
    text = esc(status)
    return f'<span class="status s-{text.replace(" ", "-")}">{text}</span>'


def progress(done: object, total: object) -> str:
    """A `<progress>` bar with `processed / total` beside it; indeterminate when total is unknown."""
    done_n = done if isinstance(done, int) else 0
    if isinstance(total, int) and total > 0:
        pct = min(100.0, 100.0 * done_n / total)
        return (
            f'<span class="progress"><progress value="{min(done_n, total)}" max="{total}">'
            f"{pct:.0f}%</progress> {done_n:,} / {total:,} ({pct:.0f}%)</span>"
        )
    return f'<span class="progress"><progress></progress> {done_n:,} / ?</span>'


def run_link(run_id: object, v: View = PLAIN) -> str:
    if not isinstance(run_id, int):
        return ""
    return f'<a class="run-link" href="{esc(v.url(f"/runs/{run_id}"))}">#{run_id}</a>'


def first_line(text: object, limit: int = 160) -> str:
    lines = str(text or "").strip().splitlines()
    line = lines[0] if lines else ""
    return line if len(line) <= limit else line[: limit - 1] + "\u2026"


def pretty_json(value: Any) -> str:
    try:
        return orjson.dumps(
            value, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS, default=str
        ).decode()
    except (
        orjson.JSONEncodeError
    ):  # what orjson cannot write (an integer past 64 bits, deep nesting)
        return json.dumps(value, indent=2, sort_keys=True, default=str, ensure_ascii=False)


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], *, empty: str) -> str:
    """Rows are already-escaped cells; a header starting with '#' is right-aligned (numbers)."""
    body = [
        "<tr>"
        + "".join(
            f'<td class="num">{cell}</td>' if h.startswith("#") else f"<td>{cell}</td>"
            for h, cell in zip(headers, row, strict=True)
        )
        + "</tr>"
        for row in rows
    ]
    if not body:
        return f'<p class="empty">{esc(empty)}</p>'
    head = "".join(
        f'<th class="num">{esc(h[1:])}</th>' if h.startswith("#") else f"<th>{esc(h)}</th>"
        for h in headers
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def layout(title: str, body: str, *, refresh: int | None, v: View = PLAIN) -> str:
    meta = f'<meta http-equiv="refresh" content="{refresh}">' if refresh else ""
    mode = "actions on" if v.actions or v.actions_on else "read-only"
    note = f"{mode}; refreshes every {refresh} s" if refresh else mode
    flash = f'<p class="flash" id="flash">{esc(v.flash)}</p>' if v.flash else ""
    r = esc(v.root)
    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"{meta}<title>{esc(title)} \u00b7 leasework</title>"
        f'<link rel="stylesheet" href="{r}/static/dashboard.css">'
        f'<link rel="icon" href="{r}/static/favicon.svg" type="image/svg+xml"></head><body>'
        f'<header><h1><a href="{r}/">leasework</a></h1>'
        f'<nav><a href="{r}/runs">runs</a> <a href="{r}/kinds">kinds</a> '
        f'<a href="{r}/schedules">schedules</a> <a href="{r}/connections">connections</a></nav>'
        f'<span class="note">{esc(note)}</span></header>'
        f"<main>{flash}{body}</main></body></html>\n"
    )


def _card(label: str, value: object, key: str) -> str:
    return (
        f'<div class="card" data-card="{esc(key)}"><div class="n">{esc(value)}</div>'
        f'<div class="l">{esc(label)}</div></div>'
    )


def overview(
    snap: Mapping[str, Any],
    recent: Sequence[Mapping[str, Any]],
    *,
    oldest_queued: float | None,
    now: object,
    v: View = PLAIN,
    charts: Series | None = None,
) -> str:
    """The `/` page: cards, running runs with progress bars, queue by kind, workers, connections,
    recent failures and the newest runs."""
    workers = list(snap.get("workers") or [])
    alive = sum(1 for w in workers if w.get("alive"))
    by_status: Mapping[str, int] = snap.get("runs_by_status") or {}
    cards = "".join(
        [
            _card("workers alive", alive, "workers-alive"),
            _card("queued", by_status.get("queued", 0), "queued"),
            _card("running", by_status.get("running", 0), "running"),
            _card("waiting", by_status.get("waiting", 0), "waiting"),
            _card("failed", by_status.get("failed", 0), "failed"),
            _card(
                "oldest queued",
                ago(oldest_queued)
                if oldest_queued is not None
                else ("none due" if by_status.get("queued") else "-"),
                "oldest-queued",
            ),
        ]
    )
    parts = [
        f'<p class="muted">database time {esc(when(now))} UTC</p>',
        f'<div class="cards">{cards}</div>',
        _charts_section(charts),
        _running_section(snap.get("running") or [], v),
        _queue_section(
            snap.get("runs_by_kind") or {},
            {str(p.get("kind")) for p in snap.get("paused") or []},
            int(snap.get("kinds_folded") or 0),
        ),
        _limits_section(snap.get("limits") or []),
        _pools_section(snap.get("pools") or []),
        _workers_section(workers, v),
        _connections_section(snap.get("connections") or [], v),
        _failures_section(snap.get("recent_failures") or [], v),
        _recent_section(recent, v),
    ]
    return layout("overview", "".join(parts), refresh=REFRESH_SECONDS, v=v)


# The overview's charts (the last hour, per minute; dashboard.sql, dashboard_chart): at most
# CHART_KINDS kinds of their own, the rest drawn as `other`, whatever max_kinds_shown says.
CHART_KINDS = 6
CHART_MINUTES = 60
CHARTS = (
    ("done", "completions per minute"),
    ("failed", "failed attempts per minute"),
    ("depth", "queue depth (due runs at each minute's end)"),
)
PALETTE = ("#2563eb", "#1f8a4c", "#c0392b", "#b7791f", "#7c3aed", "#0891b2", "#6b7385")
Series = dict[str, dict[str, list[int]]]  # chart -> kind -> a value per minute, oldest first


def chart_kinds(by_kind: Mapping[str, Mapping[str, int]], limit: int = CHART_KINDS) -> list[str]:
    """The kinds the charts draw on their own: the `limit` with the most runs in the table (the
    tables' order), never `other`."""
    ranked = sorted(
        (k for k in by_kind if k != OTHER), key=lambda k: (-sum(by_kind[k].values()), k)
    )
    return ranked[:limit]


def chart_series(rows: Iterable[Mapping[str, Any]]) -> Series:
    """dashboard_chart's rows (what, kind, minute, n) as a value per minute for each chart and
    kind; minutes without a row are 0."""
    series: Series = {what: {} for what, _ in CHARTS}
    for r in rows:
        minute = int(r["minute"])
        if str(r["what"]) in series and 0 <= minute < CHART_MINUTES:
            values = series[str(r["what"])].setdefault(str(r["kind"]), [0] * CHART_MINUTES)
            values[minute] = int(r["n"])
    return series


def _charts_section(series: Series | None) -> str:
    """Completions, failed attempts and queue depth per minute by kind over the last hour, as
    inline SVG (no script): a line per kind, its colour in the legend with the hour's total (the
    depth's: now)."""
    if series is None:
        return ""
    charts = "".join(_chart(what, title, series.get(what) or {}) for what, title in CHARTS)
    return (
        '<section id="charts"><h2>Last hour</h2>'
        f'<div class="charts">{charts}</div>'
        '<p class="muted">from the runs still in the table; other: every kind not drawn</p>'
        "</section>"
    )


def _chart(what: str, title: str, lines: Mapping[str, Sequence[int]]) -> str:
    width, height, left, bottom, top = 360, 140, 34, 16, 6
    inner_w, inner_h = width - left - 6, height - bottom - top
    peak = max([1, *(max(v) for v in lines.values() if v)])
    order = sorted(lines, key=lambda k: (k == OTHER, -sum(lines[k]), k))
    step = inner_w / (CHART_MINUTES - 1)

    def y(value: float) -> float:
        return top + inner_h - value / peak * inner_h

    parts = [
        f'<line x1="{left}" y1="{y(0):.1f}" x2="{width - 6}" y2="{y(0):.1f}" stroke="#dde1e8"/>',
        f'<line x1="{left}" y1="{top}" x2="{width - 6}" y2="{top}" stroke="#eef0f4"/>',
        f'<text x="{left - 4}" y="{top + 8}" text-anchor="end">{peak}</text>',
        f'<text x="{left - 4}" y="{y(0):.1f}" text-anchor="end">0</text>',
        f'<text x="{left}" y="{height - 3}">-60 min</text>',
        f'<text x="{left + inner_w / 2:.1f}" y="{height - 3}" text-anchor="middle">-30</text>',
        f'<text x="{width - 6}" y="{height - 3}" text-anchor="end">now</text>',
    ]
    legend = []
    for i, kind in enumerate(order):
        colour = PALETTE[-1] if kind == OTHER else PALETTE[i % (len(PALETTE) - 1)]
        values = lines[kind]
        points = " ".join(f"{left + m * step:.1f},{y(v):.1f}" for m, v in enumerate(values))
        parts.append(
            f'<polyline data-kind="{esc(kind)}" fill="none" stroke="{colour}" '
            f'stroke-width="1.5" points="{points}"><title>{esc(kind)}</title></polyline>'
        )
        shown = values[-1] if what == "depth" else sum(values)
        legend.append(
            f'<li><svg width="10" height="10" aria-hidden="true"><rect width="10" height="10" '
            f'fill="{colour}"/></svg> {esc(kind)} <span class="muted">{shown}</span></li>'
        )
    if not order:
        parts.append(
            f'<text x="{left + inner_w / 2:.1f}" y="{top + inner_h / 2:.1f}" '
            'text-anchor="middle">nothing in the last hour</text>'
        )
    svg = (
        f'<svg class="plot" data-chart="{esc(what)}" xmlns="http://www.w3.org/2000/svg" '
        f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{esc(title)}">' + "".join(parts) + "</svg>"
    )
    return (
        f'<div class="chart"><h3>{esc(title)}</h3>{svg}'
        f'<ul class="legend">{"".join(legend)}</ul></div>'
    )


def _running_section(running: Sequence[Mapping[str, Any]], v: View) -> str:
    rows = []
    for r in running:
        flags = (
            ' <span class="status s-cancelled">cancel requested</span>'
            if r.get("cancel_requested")
            else ""
        )
        rate = r.get("rate")
        eta = r.get("eta")
        rows.append(
            [
                run_link(r.get("id"), v),
                esc(r.get("kind")),
                esc(r.get("key") or ""),
                progress(r.get("processed_units"), r.get("total_units")) + flags,
                esc(f"{rate:.1f}/s") if isinstance(rate, int | float) else "",
                esc(ago(eta)) if isinstance(eta, int | float) else "",
                esc(f"{r.get('attempts')}/{r.get('max_attempts')}"),
                esc(ago(r.get("running_for"))),
                esc(ago(r.get("lease_left"))),
                esc(r.get("lease_worker") or ""),
            ]
        )
    headers = [
        "run",
        "kind",
        "key",
        "progress",
        "rate",
        "eta",
        "attempt",
        "running",
        "lease left",
        "worker",
    ]
    return f'<section id="running"><h2>Running</h2>{table(headers, rows, empty="nothing running")}</section>'


def _queue_section(
    by_kind: Mapping[str, Mapping[str, int]], paused: set[str], folded: int = 0
) -> str:
    """Runs by kind and status; with `folded` kinds summed into `other` (config
    `max_kinds_shown`, status.fold), that row last, saying how many."""
    order = sorted(by_kind.items(), key=lambda kv: (folded > 0 and kv[0] == OTHER, kv[0]))
    rows = [
        [folded_name(kind, folded) + (" " + status_badge("paused") if kind in paused else "")]
        + [esc(per.get(s, 0) or "") for s in STATUS_ORDER]
        for kind, per in order
    ]
    headers = ["kind", *(f"#{s}" for s in STATUS_ORDER)]
    return f'<section id="queue"><h2>Runs by kind</h2>{table(headers, rows, empty="no runs")}</section>'


def folded_name(kind: str, folded: int) -> str:
    """A kind's name in a table; `other`, when kinds were folded into it, with how many."""
    if folded and kind == OTHER:
        return f'{esc(kind)} <span class="muted">({folded:,} more kinds)</span>'
    return esc(kind)


def _limits_section(limits: Sequence[Mapping[str, Any]]) -> str:
    """Each kind with a limit (docs/flow-control.md): its cap and how full, its group limit, its
    rate and the claims its window counts, the due runs held back; `*` set at run time (they win
    over the app's until `leasework limits reset`). Nothing when no kind has a limit."""
    if not limits:
        return ""
    rows = []
    for r in limits:
        # What an operator set: a JSON object, unless a writer put something else there.
        given = r.get("overrides")
        set_now: Mapping[str, Any] = given if isinstance(given, Mapping) else {}

        def mark(name: str, set_now: Mapping[str, Any] = set_now) -> str:
            return "*" if name in set_now else ""

        cap = (
            f"{r.get('running')} of {r['max_running']}{mark('max_running')}"
            if r.get("max_running") is not None
            else ""
        )
        group = f"{r['group_limit']}{mark('group_limit')}" if r.get("group_limit") else ""
        rate = ""
        if r.get("rate_count") is not None:
            per = f" per {r['rate_per']}" if r.get("rate_per") else ""
            rate = f"{rate_spec(r['rate_count'], r['rate_seconds'])}{mark('rate')}{per}"
            rate += f" ({r.get('rate_used')} used)"
        state = {"capped": "at its cap", "rate_limited": "rate-limited"}.get(
            str(r.get("closed")), ""
        )
        held = f"{r.get('held_back')} of {r.get('due')}" if r.get("due") else "0"
        rows.append(
            [esc(r.get("kind")), esc(cap), esc(group), esc(rate), esc(state), esc(held)]
        )
    headers = ["kind", "running / max_running", "group_limit", "rate", "now", "due held back"]
    return (
        '<section id="limits"><h2>Limits</h2>'
        + table(headers, rows, empty="no limits")
        + '<p class="muted">* set at run time (leasework limits reset KIND)</p></section>'
    )


def _pools_section(pools: Sequence[Mapping[str, Any]]) -> str:
    """The live workers by host and pool (config `pools`); nothing when no worker has a pool."""
    if not pools:
        return ""
    rows = [
        [
            esc(p.get("host")),
            esc(p.get("pool")),
            esc(", ".join(map(str, p["kinds"])) if p.get("kinds") is not None else "every other kind"),
            esc(p.get("workers")),
            esc(p.get("busy")),
        ]
        for p in pools
    ]
    headers = ["host", "pool", "kinds", "#workers", "#busy"]
    return f'<section id="pools"><h2>Pools</h2>{table(headers, rows, empty="no pools")}</section>'


def _workers_section(workers: Sequence[Mapping[str, Any]], v: View) -> str:
    rows = [
        [
            status_badge("alive" if w.get("alive") else "gone"),
            esc(w.get("host")),
            esc(w.get("pid")),
            esc(w.get("pool") or "-"),
            run_link(w.get("current_run"), v) or '<span class="muted">idle</span>',
            esc(ago(w.get("heartbeat_age"))) + " ago",
            esc(when(w.get("started_at"))),
            esc(w.get("id")),
        ]
        for w in workers
    ]
    headers = [
        "state", "host", "#pid", "pool", "current run", "heartbeat", "started (UTC)", "worker id"
    ]  # fmt: skip
    return f'<section id="workers"><h2>Workers</h2>{table(headers, rows, empty="no workers")}</section>'


def _connections_section(connections: Sequence[Mapping[str, Any]], v: View = PLAIN) -> str:
    if not connections:
        return ""
    rows = []
    for c in connections:
        tables = c.get("tables")
        if not isinstance(tables, Mapping):  # a result of another shape: no per-table results
            tables = {}
        results = "<br>".join(
            f"{esc(name)}: {_table_result(t)}" for name, t in sorted(tables.items())
        )
        last = (
            f"{run_link(c.get('last_run_id'), v)} {esc(c.get('last_run_kind'))} "
            f"{status_badge(c.get('last_run_status'))}"
            if c.get("last_run_id")
            else '<span class="muted">never run</span>'
        )
        every = c.get("sync_interval_seconds")
        rows.append(
            [
                esc(c.get("id")),
                esc(f"{c.get('workspace')}/{c.get('provider')}"),
                status_badge(c.get("status")),
                last,
                results,
                esc(f"every {ago(every)}") if every else '<span class="muted">on demand</span>',
                esc(when(c.get("next_run_at"))),
            ]
        )
    headers = [
        "#id",
        "workspace/provider",
        "status",
        "last run",
        "per-table results",
        "schedule",
        "next run (UTC)",
    ]
    return (
        f'<section id="connections"><h2>Connections</h2>{table(headers, rows, empty="")}</section>'
    )


def _table_result(t: object) -> str:
    if not isinstance(t, Mapping):
        return esc(t)
    if t.get("status") == "failed":
        return f'<span class="error">failed: {esc(first_line(t.get("error")))}</span>'
    return esc(f"+{t.get('upserted', 0)} upserted, -{t.get('tombstoned', 0)} tombstoned")


def _failures_section(failures: Sequence[Mapping[str, Any]], v: View) -> str:
    rows = [
        [
            run_link(f.get("id"), v),
            esc(f.get("kind")),
            esc(f.get("key") or ""),
            status_badge("will retry" if f.get("will_retry") else f.get("status", "failed")),
            esc(f.get("attempts")),
            esc(when(f.get("failed_at") or f.get("finished_at"))),
            f'<span class="error">{esc(first_line(f.get("error")))}</span>',
        ]
        for f in failures
    ]
    headers = ["run", "kind", "key", "status", "#attempts", "failed at (UTC)", "error"]
    return f'<section id="failures"><h2>Recent failures</h2>{table(headers, rows, empty="no failures")}</section>'


def _recent_section(recent: Sequence[Mapping[str, Any]], v: View) -> str:
    rows = [
        [
            run_link(r.get("id"), v),
            esc(r.get("kind")),
            esc(r.get("key") or ""),
            esc(r.get("tenant") or ""),
            status_badge(r.get("status")),
            esc(f"{r.get('attempts')}/{r.get('max_attempts')}"),
            progress(r.get("processed_units"), r.get("total_units"))
            if r.get("total_units") or r.get("processed_units")
            else "",
            esc(when(last_change(r))),
        ]
        for r in recent
    ]
    headers = ["run", "kind", "key", "tenant", "status", "attempt", "progress", "last change (UTC)"]
    return f'<section id="recent"><h2>Newest runs</h2>{table(headers, rows, empty="no runs")}</section>'


def last_change(r: Mapping[str, Any]) -> object:
    """When the run last changed: finished, else started, else queued; a run queued for later
    (a delay, a retry's backoff) changed when it was queued, not at its future due time."""
    if r.get("finished_at") or r.get("started_at"):
        return r.get("finished_at") or r.get("started_at")
    due, created = r.get("queued_at"), r.get("created_at")
    if isinstance(due, datetime) and isinstance(created, datetime) and due > created:
        return created
    return due


def run_page(run: Mapping[str, Any], *, now: datetime | None, v: View = PLAIN) -> str:
    """The `/runs/<id>` page: fields, progress, attempt history, per-table results, payload,
    result and error; with actions on, the run's actions (cancel, retry, delete) and its kind's
    pause or resume. Refreshes itself while the run is live."""
    rid = run.get("id")
    status = run.get("status")
    lease_left = ""
    expires = run.get("lease_expires_at")
    if isinstance(expires, datetime) and now is not None:
        lease_left = ago((expires - now).total_seconds())
    fields: list[tuple[str, str]] = [
        ("status", status_badge(status)),
        ("kind", esc(run.get("kind"))),
        ("key", esc(run.get("key") or "")),
        ("tenant", esc(run.get("tenant") or "")),
        ("group", esc(run.get("group") or "")),
        ("tags", esc(tags_text(run.get("tags")))),
        ("priority", esc(run.get("priority"))),
        ("exclusive", "yes" if run.get("exclusive") else "no"),
        ("attempts", esc(f"{run.get('attempts')} of {run.get('max_attempts')}")),
        *(
            [("snoozes", esc(f"{run.get('snoozes')} (not charged as attempts)"))]
            if run.get("snoozes")
            else []
        ),
        (
            "progress",
            progress(run.get("processed_units"), run.get("total_units"))
            if run.get("total_units") or run.get("processed_units")
            else '<span class="muted">none reported</span>',
        ),
        ("created (UTC)", esc(when(run.get("created_at")))),
        ("due (UTC)", esc(when(run.get("queued_at")))),
        ("started (UTC)", esc(when(run.get("started_at")))),
        ("finished (UTC)", esc(when(run.get("finished_at")))),
    ]
    if run.get("lease_worker"):
        fields.append(("worker", esc(run.get("lease_worker"))))
        fields.append(("lease left", esc(lease_left)))
    if run.get("cancel_requested_at"):
        fields.append(("cancel requested (UTC)", esc(when(run.get("cancel_requested_at")))))
    if run.get("kind_paused"):
        fields.append(("kind paused", status_badge("paused")))
    if run.get("debounce_count") is not None:  # docs/flow-control.md, "Debounce"
        latest = run.get("debounce_deadline")
        merged = f"{run.get('debounce_count')} enqueues merged; due at the latest "
        merged += when(latest) if latest else "(never bounded)"
        fields.append(("debounced", esc(merged)))
    if run.get("unique_at") is not None:  # docs/flow-control.md, "Unique windows"
        fields.append(("unique window since (UTC)", esc(when(run.get("unique_at")))))
    held = held_back_lines(run.get("held_back") or [], now)
    if held:
        fields.append(("held back", "<br>".join(esc(line) for line in held)))
    dl = "".join(f"<dt>{esc(k)}</dt><dd>{value}</dd>" for k, value in fields)
    parts = [
        f'<section id="run"><h2>Run #{esc(rid)}</h2><dl>{dl}</dl></section>',
        _run_actions(run, v),
        _dependencies_section(run.get("dependencies"), v),
        _steps_section(run.get("steps")),
        _history_section(run.get("history"), run, now),
        _tables_section(run.get("result")),
    ]
    if run.get("error"):
        parts.append(
            f'<section id="error"><h2>Error</h2><pre class="error">{esc(run.get("error"))}</pre></section>'
        )
    parts.append(
        f'<section id="payload"><h2>Payload</h2><pre>{esc(pretty_json(run.get("payload")))}</pre></section>'
    )
    result = run.get("result")
    parts.append(
        '<section id="result"><h2>Result</h2>'
        + (
            f"<pre>{esc(pretty_json(result))}</pre>"
            if result is not None
            else '<p class="empty">'
            + ("no result yet" if status in LIVE_STATUSES else "no result")
            + "</p>"
        )
        + "</section>"
    )
    live = status in LIVE_STATUSES
    return layout(f"run #{rid}", "".join(parts), refresh=REFRESH_SECONDS if live else None, v=v)


def _dependencies_section(found: Mapping[str, Any] | None, v: View) -> str:
    """A run's parents and children, each linked, with its status and the policy of the edge,
    and its graph's runs by status (docs/workflows.md); nothing for a run without any."""
    if not found or not (found.get("parents") or found.get("children")):
        return ""
    parts = ['<section id="dependencies"><h2>Dependencies</h2>']
    graph = found.get("graph") or {}
    if graph:
        counts = ", ".join(f"{esc(n)} {esc(s)}" for s, n in sorted(graph.items()))
        parts.append(f"<p>graph: {esc(sum(graph.values()))} runs: {counts}</p>")
    for title in ("parents", "children"):
        rows = found.get(title) or []
        if not rows:
            continue
        body = "".join(
            f"<tr><td>{run_link(r.get('id'), v)}</td><td>{esc(r.get('kind') or '')}</td>"
            f"<td>{status_badge(r.get('status'))}</td><td>{esc(r.get('on_failure'))}</td>"
            f"<td>{'yes' if r.get('member') else ''}</td></tr>"
            for r in rows
        )
        parts.append(
            f'<p class="deps-title">{esc(title)}</p><table class="{esc(title)}"><thead><tr><th>run</th><th>kind</th>'
            f"<th>status</th><th>on failure</th><th>batch member</th></tr></thead>"
            f"<tbody>{body}</tbody></table>"
        )
    parts.append("</section>")
    return "".join(parts)


# Characters of a durable step's stored value (its JSON) shown on the run page.
STEP_PREVIEW = 120


def _steps_section(steps: Sequence[Mapping[str, Any]] | None) -> str:
    """A run's durable steps (ctx.step, docs/workflows.md, "Durable steps"), oldest first: name, when
    stored, the attempt that stored it, size, and the start of its value's JSON, escaped (a
    value is whatever a step returned: text a page must never run)."""
    if not steps:
        return ""
    rows = []
    for s in steps:
        text = str(s.get("preview") or "")  # at most 200 characters (operations.run_steps)
        if len(text) > STEP_PREVIEW:
            text = text[:STEP_PREVIEW] + "…"
        rows.append(
            [
                esc(s.get("name")),
                esc(when(s.get("created_at"))),
                esc(s.get("attempt")),
                esc(s.get("bytes")),
                f'<code class="step-value">{esc(text)}</code>',
            ]
        )
    headers = ["step", "stored (UTC)", "#attempt", "#bytes", "value"]
    return (
        f'<section id="steps"><h2>Durable steps ({esc(len(steps))})</h2>'
        f"{table(headers, rows, empty='no steps')}</section>"
    )


# -- actions: POST forms carrying the CSRF token, drawn only when actions are on ---------------

CANCELLABLE = frozenset({"blocked", "waiting", "queued", "running"})
RETRYABLE = frozenset({"failed", "cancelled", "partial"})
TERMINAL = frozenset({"succeeded", "partial", "failed", "cancelled"})


def action_form(
    v: View,
    path: str,
    label: str,
    *,
    back: str,
    fields: Mapping[str, str] | None = None,
    danger: bool = False,
    confirm: str | None = None,
) -> str:
    """One POST form with one button: the CSRF token, where to go back to (a path under the
    root) and any hidden fields. `confirm`: a required checkbox (a second click, without script)."""
    if v.csrf is None:
        return ""
    hidden = "".join(
        f'<input type="hidden" name="{esc(k)}" value="{esc(value)}">'
        for k, value in {"csrf": v.csrf, "back": back, **(fields or {})}.items()
    )
    check = (
        f'<label><input type="checkbox" name="confirm" value="yes" required> {esc(confirm)}</label>'
        if confirm
        else ""
    )
    cls = ' class="danger"' if danger else ""
    name = path.rsplit("/", 1)[-1]
    return (
        f'<form class="action" data-action="{esc(name)}" method="post" action="{esc(v.url(path))}">'
        f"{hidden}{check}<button type=\"submit\"{cls}>{esc(label)}</button></form>"
    )


def run_actions(run: Mapping[str, Any], v: View, *, back: str, full: bool) -> str:
    """The buttons a run's status allows: cancel (live, not already requested), retry (failed,
    cancelled or partial); on the run's own page (`full`) also delete (finished)."""
    rid, status = run.get("id"), run.get("status")
    if not v.actions or not isinstance(rid, int):
        return ""
    out = []
    if status in CANCELLABLE and not run.get("cancel_requested_at"):
        out.append(action_form(v, f"/runs/{rid}/cancel", "cancel", back=back, danger=True))
    if status in RETRYABLE:
        out.append(action_form(v, f"/runs/{rid}/retry", "retry", back=back))
    if full and status in TERMINAL:
        out.append(
            action_form(
                v, f"/runs/{rid}/delete", "delete", back="/runs", danger=True, confirm="sure"
            )
        )
    return "".join(out)


def kind_action(kind: str, paused: bool, v: View, *, back: str) -> str:
    if paused:
        return action_form(v, "/kinds/resume", "resume", back=back, fields={"kind": kind})
    return action_form(v, "/kinds/pause", "pause", back=back, fields={"kind": kind}, danger=True)


def _run_actions(run: Mapping[str, Any], v: View) -> str:
    if not v.actions:
        return ""
    rid, kind = run.get("id"), str(run.get("kind"))
    back = f"/runs/{rid}"
    buttons = run_actions(run, v, back=back, full=True) or (
        '<span class="muted">none for a run in this state</span>'
    )
    kind_button = kind_action(kind, bool(run.get("kind_paused")), v, back=back)
    return (
        f'<section id="actions"><h2>Actions</h2><p>{buttons}</p>'
        f"<p>kind {esc(kind)}: {kind_button}</p></section>"
    )


def _duration(start: object, end: object) -> str:
    try:
        a = datetime.fromisoformat(str(start))
        b = datetime.fromisoformat(str(end))
        return ago((b - a).total_seconds())
    except (ValueError, TypeError, OverflowError):  # not timestamps, or one naive, one aware
        return ""


def _history_note(h: Mapping[str, Any]) -> str:
    """An entry's last cell: its error, or for a snooze (not a failure) until when, and why."""
    if h.get("outcome") == "snoozed":
        bits = [f"until {when(h.get('due_at'))} UTC"] if h.get("due_at") else []
        if h.get("error"):
            bits.append(first_line(h.get("error"), 300))
        return f'<span class="muted">{esc(" · ".join(bits))}</span>' if bits else ""
    if h.get("error"):
        return f'<span class="error">{esc(first_line(h.get("error"), 300))}</span>'
    return ""


def _history_section(history: object, run: Mapping[str, Any], now: datetime | None) -> str:
    """Ended attempts from the run's history, then the attempt in progress, if any (a crashed
    attempt stays `running` until it is reclaimed; its entry is already in the history: the one
    with its owner). An entry of another shape (the history is jsonb a worker-role write can set
    to anything) is shown as its JSON."""
    entries = history_entries(history)
    rows = [
        [
            esc(h.get("attempt")),
            esc(h.get("worker") or ""),
            esc(when(h.get("started_at"))),
            esc(when(h.get("ended_at"))),
            esc(_duration(h.get("started_at"), h.get("ended_at"))),
            status_badge(h.get("outcome")),
            _history_note(h),
        ]
        if isinstance(h, Mapping)
        else ["", "", "", "", "", "", esc(first_line(json.dumps(h, ensure_ascii=False), 300))]
        for h in entries
    ]
    # The attempt in progress is recorded already when an entry has its owner (the claim's
    # token). Not by attempt number: a snooze or a release gives its attempt back, so the next
    # attempt has the number of the entry before it. A row without an owner: by number.
    owner = run.get("lease_owner")
    mapped = [h for h in entries if isinstance(h, Mapping)]
    if owner is not None:
        recorded = any(h.get("owner") == str(owner) for h in mapped)
    else:
        recorded = run.get("attempts") in [h.get("attempt") for h in mapped]
    started = run.get("started_at")
    if run.get("status") == "running" and not recorded:
        took = (now - started).total_seconds() if isinstance(started, datetime) and now else None
        rows.append(
            [
                esc(run.get("attempts")),
                esc(run.get("lease_worker") or ""),
                esc(when(started)),
                "",
                esc(ago(took)),
                status_badge("running"),
                "",
            ]
        )
    headers = ["#attempt", "worker", "started (UTC)", "ended (UTC)", "took", "outcome", "error"]
    return f'<section id="history"><h2>Attempt history</h2>{table(headers, rows, empty="not started yet")}</section>'


def history_entries(history: object) -> list[Any]:
    """A run's history as a list of entries: a list as it is, nothing for NULL, and any other
    JSON value as one entry."""
    if history is None:
        return []
    return list(history) if isinstance(history, list) else [history]


def _tables_section(result: object) -> str:
    tables = result.get("tables") if isinstance(result, Mapping) else None
    if not isinstance(tables, Mapping) or not tables:
        return ""
    rows = []
    for name, t in sorted(tables.items()):
        t = t if isinstance(t, Mapping) else {}
        rows.append(
            [
                esc(name),
                status_badge(t.get("status", "")),
                esc(t.get("upserted", "")),
                esc(t.get("tombstoned", "")),
                f'<span class="error">{esc(first_line(t.get("error"), 300))}</span>'
                if t.get("error")
                else "",
            ]
        )
    headers = ["table", "status", "#upserted", "#tombstoned", "error"]
    return (
        f'<section id="tables"><h2>Per-table results</h2>{table(headers, rows, empty="")}</section>'
    )


def error_page(code: int, message: str, v: View = PLAIN) -> str:
    return layout(
        str(code),
        f'<section><h2>{code}</h2><p class="error" id="error-line">{esc(message)}</p>'
        f'<p><a href="{esc(v.url("/"))}">overview</a> \u00b7 '
        f'<a href="{esc(v.url("/runs"))}">runs</a></p></section>',
        refresh=None,
        v=View(v.root, actions_on=v.actions or v.actions_on),  # no form, no flash: the mode
    )


RUN_FILTERS = ("status", "kind", "key", "tenant", "error", "payload", "tag")
SEARCH_LABELS = {"error": "error holds", "payload": "payload contains (JSON)", "tag": "tag"}

# The bulk actions of the runs list (POST /runs/bulk), in the order their buttons are drawn, with
# the statuses each acts on (operations: RETRYABLE, CANCELLABLE, TERMINAL, queued not due).
BULK_ACTIONS = {
    "retry": "failed, cancelled or partial",
    "cancel": "blocked, waiting, queued or running",
    "run-now": "queued and not due yet",
    "delete": "succeeded, partial, failed or cancelled",
}


def runs_page(
    rows: Sequence[Mapping[str, Any]],
    *,
    filters: Mapping[str, str],
    next_before: int | None,
    paused: Sequence[Mapping[str, Any]] = (),
    back: str = "/runs",
    v: View = PLAIN,
    matching: int | None = None,
) -> str:
    """The `/runs` page: every run, newest first, filtered by status, kind, key and tenant and
    searched by error text, payload (JSON containment) and tag (a plain GET form: no script),
    paged by id (`before`); with actions on, each row's cancel or retry (`back`: this page, where
    the action returns to), paused kinds' resume, and the bulk actions: a checkbox per run
    (`form="bulk"`) and, under a filter, "all N matching this filter" (`matching`: N), each
    bulk action confirmed on a page of its own before anything changes."""
    options = "".join(
        f'<option value="{esc(s)}"{" selected" if filters.get("status") == s else ""}>{esc(s)}</option>'
        for s in ("", *STATUS_ORDER)
    )
    fields = "".join(
        f'<label>{esc(SEARCH_LABELS.get(name, name))}<input name="{esc(name)}" '
        f'value="{esc(filters.get(name, ""))}"></label>'
        for name in ("kind", "key", "tenant", "error", "payload", "tag")
    )
    form = (
        f'<form class="filters" method="get" action="{esc(v.url("/runs"))}">'
        f'<label>status<select name="status">{options}</select></label>{fields}'
        f'<button type="submit">filter</button> <a href="{esc(v.url("/runs"))}">clear</a></form>'
    )
    body = [
        [
            *(
                [
                    f'<input type="checkbox" name="id" value="{esc(r.get("id"))}" form="bulk" '
                    f'aria-label="select run {esc(r.get("id"))}">'
                ]
                if v.actions
                else []
            ),
            run_link(r.get("id"), v),
            esc(r.get("kind")),
            esc(r.get("key") or ""),
            esc(r.get("tenant") or ""),
            status_badge(r.get("status")),
            esc(f"{r.get('attempts')}/{r.get('max_attempts')}"),
            esc(when(r.get("created_at"))),
            esc(when(last_change(r))),
            f'<span class="error">{esc(first_line(r.get("error")))}</span>'
            if r.get("error")
            else "",
            esc(tags_text(r.get("tags"))),
            *([run_actions(r, v, back=back, full=False)] if v.actions else []),
        ]
        for r in rows
    ]
    headers = [
        *(["select"] if v.actions else []),
        "run",
        "kind",
        "key",
        "tenant",
        "status",
        "attempt",
        "created (UTC)",
        "last change (UTC)",
        "error",
        "tags",
        *(["actions"] if v.actions else []),
    ]
    pager = ""
    if next_before is not None:
        query = urlencode({**{k: f for k, f in filters.items() if f}, "before": next_before})
        pager = (
            f'<p class="pager"><a id="next-page" href="{esc(v.url("/runs"))}?{esc(query)}">'
            "older runs &rarr;</a></p>"
        )
    note = ""
    if paused:
        names = ", ".join(
            esc(p.get("kind")) + " " + kind_action(str(p.get("kind")), True, v, back=back)
            for p in paused
        )
        note = f'<p class="muted" id="paused">paused kinds: {names}</p>'
    bulk = bulk_form(filters, matching, back=back, v=v) if rows else ""
    section = (
        f'<section id="runs"><h2>Runs</h2>{form}{note}{bulk}'
        f"{table(headers, body, empty='no runs match')}{pager}</section>"
    )
    return layout("runs", section, refresh=None, v=v)


def bulk_form(
    filters: Mapping[str, str], matching: int | None, *, back: str, v: View
) -> str:
    """The runs list's bulk form (`id="bulk"`, which each row's checkbox names): which runs (the
    ones ticked, or every run matching the page's filters: `matching` of them) and one button per
    action. Posts to /runs/bulk, which answers a confirm page first."""
    if v.csrf is None:
        return ""
    hidden = "".join(
        f'<input type="hidden" name="{esc(k)}" value="{esc(value)}">'
        for k, value in {
            "csrf": v.csrf,
            "back": back,
            **{f"filter_{k}": f for k, f in filters.items() if f and k in RUN_FILTERS},
        }.items()
    )
    scope = '<label><input type="radio" name="scope" value="ids" checked> the runs ticked below</label>'
    if matching is not None:
        shown = f"{number_text(matching)}{'+' if matching >= MATCHING_MAX else ''}"
        scope += (
            f' <label><input type="radio" name="scope" value="filter" id="scope-filter"> all '
            f'<span id="matching">{esc(shown)}</span> runs matching this filter</label>'
        )
    danger = ' class="danger"'
    buttons = "".join(
        f'<button type="submit" name="action" value="{esc(name)}"'
        f'{danger if name in ("cancel", "delete") else ""}>{esc(name)}</button> '
        for name in BULK_ACTIONS
    )
    return (
        f'<form class="action bulk" id="bulk" method="post" action="{esc(v.url("/runs/bulk"))}">'
        f"{hidden}<p>{scope} &middot; {buttons}</p></form>"
    )


MATCHING_MAX = 100_000  # runs counted for "all N matching" at most (N+ past it)


def bulk_confirm_page(
    action: str,
    *,
    count: int,
    which: str,
    fields: Mapping[str, str],
    ids: Sequence[int] = (),
    back: str,
    v: View,
) -> str:
    """The second step of a bulk action: what it will do to how many runs (`which`: the ids or
    the filter), and the form that does it (the same fields, the ticked `ids`, confirm=yes)."""
    hidden = "".join(
        f'<input type="hidden" name="{esc(k)}" value="{esc(value)}">'
        for k, value in [
            *{**fields, "csrf": v.csrf or "", "confirm": "yes"}.items(),
            *(("id", str(i)) for i in ids),
        ]
    )
    body = (
        f'<section id="confirm"><h2>{esc(action)} {esc(number_text(count))} run'
        f'{"s" if count != 1 else ""}?</h2>'
        f'<p id="confirm-line">{esc(action)} <span class="n" id="confirm-count">{esc(count)}</span> '
        f"run(s): {esc(which)} ({esc(BULK_ACTIONS.get(action, ''))} ones only). Workers may claim "
        "runs meanwhile: a run claimed by then is acted on as it is then (a cancel asks it to "
        "stop).</p>"
        + (
            f'<form class="action" method="post" action="{esc(v.url("/runs/bulk"))}">{hidden}'
            f'<button type="submit" id="confirm-button" class="danger">yes, {esc(action)} '
            f"{esc(count)} run(s)</button></form> "
            if count
            else '<p class="empty">nothing to do.</p>'
        )
        + f'<a href="{esc(v.url(back))}">back</a></section>'
    )
    return layout(f"{action}?", body, refresh=None, v=v)


def kinds_page(
    by_kind: Mapping[str, Mapping[str, int]],
    paused: Sequence[Mapping[str, Any]],
    registered: Iterable[str] = (),
    v: View = PLAIN,
    limits: Sequence[Mapping[str, Any]] = (),
    folded: int = 0,
) -> str:
    """The `/kinds` page: every kind (registered with the app, or seen in a run) with its runs by
    status, whether it is paused and its limits (docs/flow-control.md); with actions on, pause
    or resume, and set its limits at run time or reset them. With `folded` kinds summed into
    `other` (config `max_kinds_shown`), that row last, without actions."""
    paused_at = {str(p.get("kind")): p.get("paused_at") for p in paused}
    limited = {str(r.get("kind")): r for r in limits}
    kinds = sorted(
        {*by_kind, *paused_at, *registered, *limited}, key=lambda k: (folded > 0 and k == OTHER, k)
    )
    rows = []
    for kind in kinds:
        per = by_kind.get(kind) or {}
        if folded and kind == OTHER:
            rows.append(
                [folded_name(kind, folded), ""]
                + [esc(per.get(s, 0) or "") for s in STATUS_ORDER]
                + [""]
                + ([""] if v.actions else [])
            )
            continue
        is_paused = kind in paused_at
        state = status_badge("paused") if is_paused else status_badge("active")
        if is_paused and paused_at[kind]:
            state += f' <span class="muted">since {esc(when(paused_at[kind]))}</span>'
        link = f'<a href="{esc(v.url("/runs"))}?{esc(urlencode({"kind": kind}))}">{esc(kind)}</a>'
        mine = limited.get(kind)
        rows.append(
            [link, state]
            + [esc(per.get(s, 0) or "") for s in STATUS_ORDER]
            + [esc(_limits_text(mine)) if mine else '<span class="muted">none</span>']
            + (
                [kind_action(kind, is_paused, v, back="/kinds") + limits_form(kind, mine, v)]
                if v.actions
                else []
            )
        )
    headers = [
        "kind",
        "state",
        *(f"#{s}" for s in STATUS_ORDER),
        "limits",
        *(["action"] if v.actions else []),
    ]
    note = (
        '<p class="muted">a paused kind is claimed by no worker (batch claims and reclaims '
        "included) until it is resumed; runs already running finish</p>"
    )
    section = f'<section id="kinds"><h2>Kinds</h2>{note}{table(headers, rows, empty="no kinds")}</section>'
    return layout("kinds", section, refresh=None, v=v)


def _limits_text(r: Mapping[str, Any]) -> str:
    """A kind's limits in one line; `*` set at run time."""
    given = r.get("overrides")  # a JSON object, unless a writer put something else there
    set_now: Mapping[str, Any] = given if isinstance(given, Mapping) else {}
    parts = []
    if r.get("max_running") is not None:
        parts.append(f"max_running {r['max_running']}" + ("*" if "max_running" in set_now else ""))
    if r.get("group_limit") is not None:
        parts.append(f"group_limit {r['group_limit']}" + ("*" if "group_limit" in set_now else ""))
    if r.get("rate_count") is not None:
        per = f" per {r['rate_per']}" if r.get("rate_per") else ""
        star = "*" if "rate" in set_now else ""
        parts.append(f"rate {rate_spec(r['rate_count'], r['rate_seconds'])}{star}{per}")
    return ", ".join(parts)


def limits_form(kind: str, limits: Mapping[str, Any] | None, v: View) -> str:
    """Set a kind's limits at run time (each field left empty is left as it is; `none` removes
    that limit), and reset them when something was set."""
    if v.csrf is None:
        return ""
    hidden = "".join(
        f'<input type="hidden" name="{esc(k)}" value="{esc(value)}">'
        for k, value in {"csrf": v.csrf, "back": "/kinds", "kind": kind}.items()
    )
    inputs = "".join(
        f'<input name="{name}" placeholder="{esc(hint)}">'
        for name, hint in (
            ("max_running", "max_running"),
            ("group_limit", "group_limit"),
            ("rate", "rate 100/10s"),
            ("rate_per", "rate_per"),
        )
    )
    form = (
        f'<form class="action" data-action="limits" method="post" '
        f'action="{esc(v.url("/kinds/limits"))}">{hidden}{inputs}'
        '<button type="submit">set limits</button></form>'
    )
    if limits and limits.get("overrides"):
        form += action_form(
            v, "/kinds/reset-limits", "reset limits", back="/kinds", fields={"kind": kind}
        )
    return form


def schedules_page(rows: Sequence[Mapping[str, Any]], v: View = PLAIN) -> str:
    """The `/schedules` page: periodic tasks, their next run and their last run."""
    body = [
        [
            esc(r.get("name")),
            esc(r.get("kind")),
            esc(
                f"every {ago(r.get('every_seconds'))}"
                if r.get("every_seconds") is not None
                else f"{r.get('cron')} {r.get('timezone')}"
            ),
            esc(when(r.get("next_run_at"))),
            (
                f"{run_link(r.get('last_run_id'), v)} {status_badge(r.get('last_run_status'))}"
                if r.get("last_run_id")
                else '<span class="muted">never</span>'
            ),
        ]
        for r in rows
    ]
    headers = ["name", "kind", "schedule", "next run (UTC)", "last run"]
    section = f'<section id="schedules"><h2>Schedules</h2>{table(headers, body, empty="no schedules")}</section>'
    return layout("schedules", section, refresh=None, v=v)


def connections_page(connections: Sequence[Mapping[str, Any]], v: View = PLAIN) -> str:
    """The `/connections` page: every connection with its last run and per-table results."""
    section = _connections_section(connections, v) or (
        '<section id="connections"><h2>Connections</h2><p class="empty">no connections</p></section>'
    )
    return layout("connections", section, refresh=REFRESH_SECONDS, v=v)
