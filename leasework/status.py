"""`leasework status`: one read-only snapshot of workers, queue depth and running runs, rendered
as text (80 columns) or returned as JSON-ready data. Never writes."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

import psycopg
from psycopg.rows import dict_row
from psycopg.types.datetime import TimestamptzLoader
from psycopg.types.json import JsonbLoader

from .queries import load

Q = load("leasework", "status.sql")


class _BoundedTimestamptzLoader(TimestamptzLoader):
    """Reads a timestamptz Python cannot hold (infinity, past year 9999, before year 1) as the
    nearest datetime instead of raising: a reader shows any row (psycopg's documented recipe)."""

    def load(self, data: Any) -> datetime:
        if bytes(data).startswith(b"-"):  # -infinity
            return datetime.min.replace(tzinfo=UTC)
        try:
            return super().load(data)
        except psycopg.DataError:
            early = bytes(data).endswith(b"BC")
            return (datetime.min if early else datetime.max).replace(tzinfo=UTC)


# How deep a jsonb value a reader takes as JSON: Python's encoders (json.dumps with an indent,
# which the readers fall back to past orjson's limits) recurse per level, and a value that
# decodes may still be too deep to print.
READABLE_DEPTH = 200


class _BoundedJsonbLoader(JsonbLoader):
    """Reads a jsonb nested deeper than READABLE_DEPTH as its text (a string) instead of raising
    there or later: the worker role can write such a payload, result or history."""

    def load(self, data: Any) -> Any:
        raw = bytes(data)
        try:
            value = super().load(raw)
        except RecursionError:
            return raw.decode("utf-8", "replace")
        # The nesting is at most the number of brackets: count them (fast) before walking.
        if raw.count(b"[") + raw.count(b"{") > READABLE_DEPTH and _deeper(value, READABLE_DEPTH):
            return raw.decode("utf-8", "replace")
        return value


def _deeper(value: Any, limit: int) -> bool:
    """Whether `value` nests lists and dicts more than `limit` deep (without recursing)."""
    stack = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


_Reader = TypeVar("_Reader", psycopg.Connection[Any], psycopg.Cursor[Any])


def tolerant(reader: _Reader) -> _Reader:
    """`reader` (a cursor, or a connection and its cursors to come), reading every timestamptz
    and every jsonb however deep, whatever its value (_BoundedTimestamptzLoader,
    _BoundedJsonbLoader)."""
    reader.adapters.register_loader("timestamptz", _BoundedTimestamptzLoader)
    reader.adapters.register_loader("jsonb", _BoundedJsonbLoader)
    return reader


def terminal_safe(text: object) -> str:
    """One line for a terminal: control characters (ESC, BEL, CR, newlines, C1 codes...) shown
    escaped (`\\x1b`), so no value from the database can move the cursor, retitle the window
    or forge a line."""
    value = "" if text is None else str(text)
    if value.isprintable():
        return value
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in value)


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in row.items()}


def collect(
    conn: psycopg.Connection[Any],
    *,
    heartbeat_interval: float = 15.0,
    previous: dict[str, Any] | None = None,
    max_kinds: int | None = None,
) -> dict[str, Any]:
    """The snapshot behind `leasework status`, `--json` and the dashboard: JSON-ready data.

    Each running run carries `rate` (units per second) and `eta` (seconds), or None while
    unknown. Given the `previous` snapshot, the rate is measured between the two; otherwise it
    is the attempt's average, known only for a first attempt (a resumed attempt starts part way).
    With `max_kinds` (config `max_kinds_shown`), the kinds past it are summed into `other` (fold).
    """
    with tolerant(conn.cursor(row_factory=dict_row)) as cur:
        now_row = cur.execute(Q["status_now"]).fetchone()
        workers = cur.execute(Q["status_workers"], {"stale": heartbeat_interval * 2}).fetchall()
        counts = cur.execute(Q["status_counts"]).fetchall()
        running = cur.execute(Q["status_running"]).fetchall()
        failures = cur.execute(Q["status_failures"]).fetchall()
        connections = cur.execute(Q["status_connections"]).fetchall()
        documents = cur.execute(Q["status_files"]).fetchall()
        paused = cur.execute(Q["status_paused"]).fetchall()
        queued = cur.execute(Q["status_queued_kinds"]).fetchall()
        limited = cur.execute(Q["status_limits"]).fetchall()
    taken_at = float(now_row["taken_at"]) if now_row else 0.0
    by_status: dict[str, int] = {}
    by_kind: dict[str, dict[str, int]] = {}
    for row in counts:
        by_status[row["status"]] = by_status.get(row["status"], 0) + row["n"]
        by_kind.setdefault(row["kind"], {})[row["status"]] = row["n"]
    before = {(r["id"], r["attempts"]): r for r in (previous or {}).get("running", []) if "id" in r}
    elapsed = taken_at - float((previous or {}).get("taken_at") or 0.0)
    for r in running:
        r["rate"], r["eta"] = progress_rate(r, before.get((r["id"], r["attempts"])), elapsed)
    snap = {
        "taken_at": taken_at,
        "workers": [_plain(w) for w in workers],
        "runs_by_status": by_status,
        "runs_by_kind": by_kind,
        "running": [_plain(r) for r in running],
        "recent_failures": [_plain(f) for f in failures],
        "connections": [_plain(c) for c in connections],
        "files": {r["status"]: r["n"] for r in documents if r["what"] == "files"},
        "uploads": {r["status"]: r["n"] for r in documents if r["what"] == "uploads"},
        "paused": [_plain(p) for p in paused],
        "limits": [_plain(r) for r in limited],
        "oldest_due": {r["kind"]: r["oldest_due"] for r in queued},
        # A kind held back by its limits is not "unserved": its runs wait for a place or room.
        "unserved": unserved(
            workers,
            queued,
            {p["kind"] for p in paused} | {r["kind"] for r in limited if r["held_back"]},
            heartbeat_interval,
        ),
        "pools": pools(workers),
    }
    return snap if max_kinds is None else fold(snap, max_kinds)


# Where the kinds past `max_kinds_shown` are summed (fold, /metrics' kind label). A kind named
# `other` is always summed there too, so that no label, line or row is ever given twice.
OTHER = "other"


def shown_kinds(
    by_kind: dict[str, dict[str, int]], limit: int, also: Iterable[str] = ()
) -> set[str]:
    """The kinds that get a line (a label) of their own: of those in `by_kind` and `also` (none
    of their runs in the table), the `limit` with the most runs in the table (`runs_by_kind`),
    ties by name; never one named `other`."""
    ranked = sorted(
        {k for k in (*by_kind, *also) if k != OTHER},
        key=lambda k: (-sum(by_kind.get(k, {}).values()), k),
    )
    return set(ranked[:limit])


def fold(snap: dict[str, Any], limit: int) -> dict[str, Any]:
    """`snap` with its per-kind parts bounded: runs by kind, the oldest due per kind and the
    unserved warnings of the kinds past the `limit` with the most runs (shown_kinds) summed into
    one `other` (its oldest due: the oldest of theirs); `kinds_folded` says how many kinds were."""
    by_kind: dict[str, dict[str, int]] = snap["runs_by_kind"]
    everything = set(by_kind) | set(snap["oldest_due"]) | {u["kind"] for u in snap["unserved"]}
    shown = shown_kinds(by_kind, limit, everything)
    folded = everything - shown
    if not folded:
        return {**snap, "kinds_folded": 0}
    runs: dict[str, dict[str, int]] = {k: v for k, v in by_kind.items() if k in shown}
    other: dict[str, int] = {}
    for kind in folded:
        for st, n in by_kind.get(kind, {}).items():
            other[st] = other.get(st, 0) + n
    if other:
        runs[OTHER] = other
    oldest = {k: v for k, v in snap["oldest_due"].items() if k in shown}
    ages = [v for k, v in snap["oldest_due"].items() if k in folded]
    if ages:
        oldest[OTHER] = max(ages)
    unserved_rows = [u for u in snap["unserved"] if u["kind"] in shown]
    rest = [u for u in snap["unserved"] if u["kind"] in folded]
    if rest:
        unserved_rows.append(
            {
                "kind": OTHER,
                "due": sum(u["due"] for u in rest),
                "oldest_due": max(u["oldest_due"] for u in rest),
                "alive": max(u["alive"] for u in rest),
            }
        )
    return {
        **snap,
        "runs_by_kind": runs,
        "oldest_due": oldest,
        "unserved": unserved_rows,
        "kinds_folded": len(folded),
    }


def pools(workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The live workers grouped by host and pool (config `pools`): how many, how many busy, and
    the kinds the pool claims (None: every kind no other pool of its host names). Empty when no
    live worker has a pool."""
    alive = [w for w in workers if w["alive"] and w.get("pool") is not None]
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for w in alive:
        g = groups.setdefault(
            (w["host"], w["pool"]),
            {"host": w["host"], "pool": w["pool"], "kinds": w.get("pool_kinds"), "workers": 0,
             "busy": 0},
        )  # fmt: skip
        g["workers"] += 1
        g["busy"] += w["current_run"] is not None
    return [groups[k] for k in sorted(groups)]


def serves(worker: dict[str, Any], kind: str, workers: list[dict[str, Any]]) -> bool:
    """Whether `worker` (a status row) claims `kind` by its pool: no pool, every kind; a pool
    with kinds, those; the pool without kinds, every kind no other live pool of its host names."""
    if worker.get("pool") is None:
        return True
    if worker.get("pool_kinds") is not None:
        return kind in worker["pool_kinds"]
    return not any(
        kind in (w.get("pool_kinds") or ())
        for w in workers
        if w["alive"] and w["host"] == worker["host"]
    )


def unserved(
    workers: list[dict[str, Any]],
    queued: list[dict[str, Any]],
    paused: set[str],
    heartbeat_interval: float,
) -> list[dict[str, Any]]:
    """Queued kinds that no live worker seems to serve: due runs of a kind that is not paused,
    the oldest due for over two heartbeats, while no worker is alive or some live worker sits
    idle (a busy fleet is a backlog, not a missing worker). Workers do not record their kinds,
    so this is the evidence there is: an idle worker leaves only runs it does not serve."""
    alive = [w for w in workers if w["alive"]]
    wait = max(30.0, 2 * heartbeat_interval)
    out = []
    for r in queued:
        if r["kind"] in paused or r["oldest_due"] <= wait:
            continue
        # A pool's workers are evidence only for the kinds they claim: a busy `reports` pool is
        # a backlog of reports, an idle one says nothing of other kinds.
        mine = [w for w in alive if serves(w, r["kind"], alive)]
        if mine and all(w["current_run"] is not None for w in mine):
            continue
        out.append(
            {"kind": r["kind"], "due": r["due"], "oldest_due": r["oldest_due"], "alive": len(mine)}
        )
    return out


def progress_rate(
    run: dict[str, Any], before: dict[str, Any] | None, elapsed: float
) -> tuple[float | None, float | None]:
    """(units per second, seconds left) for one running run; None where unknown."""
    done = int(run.get("processed_units") or 0)
    rate: float | None = None
    if before is not None and elapsed > 0.2 and done >= int(before.get("processed_units") or 0):
        measured = (done - int(before.get("processed_units") or 0)) / elapsed
        # Between two close snapshots nothing may have moved: keep the earlier figure then.
        rate = measured if measured > 0 or before.get("rate") is None else before.get("rate")
    elif run.get("attempts") == 1 and (run.get("running_for") or 0) > 0.5:
        rate = done / float(run["running_for"])
    total = run.get("total_units")
    eta = None
    if rate and total is not None and total >= done:
        eta = (total - done) / rate
    return rate, eta


def duration(seconds: float | None) -> str:
    """`42s`, `3m05s`, `2h07m`; `?` when unknown; `∞` and `NaN` for a float column's values
    that are no duration (a row's `Infinity` or `NaN`, which the schema admits)."""
    if seconds is None:
        return "?"
    if math.isnan(seconds) or seconds == math.inf:
        return number_text(seconds)
    s = max(0, round(seconds)) if seconds > -math.inf else 0
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def number_text(value: float) -> str:
    """A float as people read it (`60`, `0.5`, `1e+15`): `∞`, `-∞` and `NaN` for the values a
    float column admits that are no number to format."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "∞" if value > 0 else "-∞"
    return f"{value:g}"


def seconds_text(value: float) -> str:
    """An interval in seconds as written in a row: `60s`, `0.5s`; `∞`, `NaN` (number_text)."""
    return f"{value:g}s" if math.isfinite(value) else number_text(value)


# What _BoundedTimestamptzLoader reads `infinity` and `-infinity` as (and any timestamp past
# what Python holds, after year 9999 or before year 1).
AFTER_ALL = datetime.max.replace(tzinfo=UTC)
BEFORE_ALL = datetime.min.replace(tzinfo=UTC)


def instant_text(value: datetime | str | None, empty: str = "-") -> str:
    """A timestamp (a datetime, or the ISO text of a JSON snapshot) as `YYYY-MM-DD HH:MM:SS`
    UTC; `infinity` or `-infinity` for one Python cannot hold (tolerant's reading); text that is
    no timestamp as it is; `empty` when unset."""
    if value is None or value == "":
        return empty
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return str(value)
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    if value == AFTER_ALL:
        return "infinity"
    if value == BEFORE_ALL:
        return "-infinity"
    try:
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
    except OverflowError:  # within Python's years in its own zone, not in UTC's
        return value.strftime("%Y-%m-%d %H:%M:%S%z")


def rate_text(rate: float | None) -> str:
    if rate is None:
        return "?/s"
    return f"{rate:.1f}/s" if rate < 100 else f"{rate:.0f}/s"


def rate_spec(count: int, seconds: float) -> str:
    """A rate limit as written (operations.parse_rate reads it back): `100/10s`, `5/1m`."""
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if seconds >= size and (seconds / size).is_integer():
            return f"{count}/{int(seconds / size)}{unit}"
    return f"{count}/{number_text(seconds)}s"


def limits(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    """Every kind with a limit and how full it is now (status.sql, status_limits): its effective
    max_running, group_limit, rate (rate_count per rate_seconds) and rate_per, what its app
    declared and what an operator set (`declared`, `overrides`), `running` (live leases),
    `rate_used` and `rate_free_at` (its window), `due`, `held_back` (due runs no claim may take
    now), `closed` ('capped', 'rate_limited' or None), `paused`, and `tenant_rates`."""
    with tolerant(conn.cursor(row_factory=dict_row)) as cur:
        return cur.execute(Q["status_limits"]).fetchall()


def limit_lines(rows: list[dict[str, Any]], now: float | None = None) -> list[str]:
    """Each limited kind in a line or two (80 columns): its limits (`*`: set at run time) and
    how full each is; `now` (epoch seconds) turns when a window frees into seconds from now."""
    out: list[str] = []
    for r in rows:
        # What an operator set: a JSON object, unless a writer put something else there.
        given = r.get("overrides")
        set_now: dict[str, Any] = given if isinstance(given, dict) else {}
        mark = {k: "*" if k in set_now else "" for k in
                ("max_running", "group_limit", "rate", "rate_per")}
        parts = []
        if r.get("max_running") is not None:
            parts.append(f"max_running{mark['max_running']} {r['running']}/{r['max_running']}")
        if r.get("group_limit") is not None:
            parts.append(f"group_limit{mark['group_limit']} {r['group_limit']}")
        if r.get("rate_count") is not None:
            per = f" per {r['rate_per']}{mark['rate_per']}" if r.get("rate_per") else ""
            used = r.get("rate_used")
            whose = " (no tenant)" if r.get("rate_per") else ""
            spec = rate_spec(r["rate_count"], r["rate_seconds"])
            parts.append(f"rate{mark['rate']} {spec}{per}, {used} used{whose}")
        state = []
        if r.get("paused"):
            state.append("paused")
        if r.get("closed") == "capped":
            state.append("at its cap")
        elif r.get("closed") == "rate_limited":
            state.append(f"rate-limited, room again {_when(r.get('rate_free_at'), now)}")
        if r.get("held_back"):
            state.append(f"{r['held_back']} of {r['due']} due held back")
        elif r.get("due"):
            state.append(f"{r['due']} due")
        line = f"  {r['kind'][:28]}: " + "; ".join(parts)
        out.append(line[:80])
        if state:
            out.append(("    " + ", ".join(state))[:80])
        for t in r.get("tenant_rates") or []:
            spec = rate_spec(t["rate_count"], t["rate_seconds"])
            out.append(f"    tenant {t['tenant'][:40]}: rate* {spec}"[:80])
    if any("*" in line for line in out):
        out.append("  (* set at run time: `leasework limits reset KIND` for the app's)")
    return out


def held_back_lines(held: Sequence[dict[str, Any]], now: Any) -> list[str]:
    """Why a queued run is not being claimed now (operations.held_back), a line per reason."""

    def until(at: Any) -> str:
        try:
            return f"{instant_text(at)} UTC (in {duration((at - now).total_seconds())})"
        except (TypeError, AttributeError):
            return instant_text(at)

    out = []
    for h in held:
        reason = h.get("reason")
        if reason == "not_due":
            out.append(f"not due until {until(h['until'])}")
        elif reason == "paused":
            out.append("its kind is paused (leasework resume KIND)")
        elif reason == "capped":
            out.append(f"capped: {h['running']} of {h['max_running']} running (max_running)")
        elif reason == "rate_limited":
            spec = rate_spec(h["rate_count"], h["rate_seconds"])
            whose = {
                "tenant": "its tenant's",
                "group": "its group's",
                "no tenant": "runs without a tenant:",
            }.get(
                h["per"], "its kind's"
            )
            out.append(f"rate-limited until {until(h['until'])}: {whose} rate {spec} is used")
        elif reason == "group_full":
            out.append(
                f"group full: {h['running']} of {h['group_limit']} running in group "
                f"{h['group']} of tenant {h['tenant']} (group_limit)"
            )
        elif reason == "tenant_exclusive":
            out.append(f"an exclusive run of tenant {h['tenant']} is running")
        elif reason == "exclusive_waits":
            out.append(f"exclusive: waits for {h['running']} running run(s) of tenant {h['tenant']}")
        elif reason == "waiting":
            out.append("waiting for its key's active run to end")
        elif reason == "blocked":
            ids = ", ".join(f"#{i}" for i in h["parents"][:20])
            more = f" and {len(h['parents']) - 20} more" if len(h["parents"]) > 20 else ""
            out.append(f"blocked: waits for {ids}{more} to end" if ids else "blocked: deciding")
    return out


def _when(value: datetime | str | None, now: float | None) -> str:
    """A moment to come as `in 4s` from `now` (epoch seconds), else as instant_text."""
    at = value
    if isinstance(value, str):
        try:
            at = datetime.fromisoformat(value)
        except ValueError:
            return value
    if isinstance(at, datetime) and now is not None and at not in (AFTER_ALL, BEFORE_ALL):
        return f"in {duration(at.timestamp() - now)}"
    return instant_text(value)


def bar(done: int, total: int | None, width: int = 20) -> str:
    """A text progress bar: `[#######.............]  35%`, or a blank one when total is unknown."""
    if not total:
        return "[" + "?" * width + "]     "
    frac = min(1.0, max(0.0, done / total))
    filled = round(frac * width)
    return "[" + "#" * filled + "." * (width - filled) + f"] {frac * 100:3.0f}%"


def render(snap: dict[str, Any]) -> str:
    out: list[str] = []
    workers = snap["workers"]
    alive = sum(1 for w in workers if w["alive"])
    out.append(f"workers: {alive} alive, {len(workers) - alive} gone")
    shown = [w for w in workers if w["alive"]][:20] + [w for w in workers if not w["alive"]][:5]
    for w in shown:
        state = "alive" if w["alive"] else "gone "
        run = f"run {w['current_run']}" if w["current_run"] else "idle"
        age = w["heartbeat_age"]
        beat = f"beat {age:.0f}s ago" if age is not None else "beat ?"
        out.append(f"  {state} {w['host'][:24]:<24} pid {w['pid']:<7} {run:<12} {beat}")
    if len(shown) < len(workers):
        out.append(f"  ... and {len(workers) - len(shown)} more")
    for p in snap.get("pools") or []:
        named = p["kinds"]
        kinds = ", ".join(str(k) for k in named) if named is not None else "every other kind"
        out.append(
            f"  pool {p['pool'][:16]} on {p['host'][:20]}: {p['workers']} worker(s), "
            f"{p['busy']} busy; claims {kinds}"[:80]
        )
    out.append("")
    order = [
        "blocked",
        "waiting",
        "queued",
        "running",
        "succeeded",
        "partial",
        "failed",
        "cancelled",
    ]
    totals = snap["runs_by_status"]
    counts = [
        f"{s}\u00a0{totals.get(s, 0)}" for s in order
    ]  # no-break: a count stays with its name
    wrapped = textwrap.wrap("  ".join(counts), width=74, break_long_words=False)
    out.extend(
        ("runs: " if i == 0 else "      ") + line.replace("\u00a0", " ")
        for i, line in enumerate(wrapped)
    )
    for kind, per in sorted(snap["runs_by_kind"].items(), key=lambda kv: kv[0] == OTHER):
        live = " ".join(f"{s}={per[s]}" for s in order if per.get(s))
        out.append(f"  {kind[:30]:<30} {live}"[:80])
    if snap.get("kinds_folded"):
        out.append(f"  (other: {snap['kinds_folded']:,} more kinds summed; max_kinds_shown)")
    files, uploads = snap.get("files") or {}, snap.get("uploads") or {}
    if files or uploads:
        out.append(
            "files: "
            + "  ".join(
                f"{s} {files.get(s, 0)}" for s in ("pending", "indexing", "ready", "failed")
            )
        )
        out.append(
            "uploads: "
            + "  ".join(
                f"{s} {uploads.get(s, 0)}" for s in ("pending", "processing", "done", "failed")
            )
        )
    for p in snap.get("paused") or []:
        out.append(
            f"  paused: {p['kind']} ({p['queued']} queued; leasework resume {p['kind']})"[:80]
        )
    limited = snap.get("limits") or []
    if limited:
        out.append("limits:")
        out.extend(limit_lines(limited, snap.get("taken_at")))
    for u in snap.get("unserved") or []:
        who = f"{u['alive']} live worker(s) idle" if u["alive"] else "no live worker"
        what = "these kinds" if u["kind"] == OTHER and snap.get("kinds_folded") else "this kind"
        out.append(
            f"  warning: {u['kind']}: {u['due']} run(s) due for {duration(u['oldest_due'])}, "
            f"{who}: no worker serves {what}?"
        )
    if snap["running"]:
        out.append("")
        out.append("running:")
        for r in snap["running"]:
            total = r["total_units"]
            progress = bar(r["processed_units"], total, width=16)
            units = f"{r['processed_units']}/{total if total is not None else '?'}"
            pace = ""
            if total or r.get("rate") is not None:
                pace = f" {rate_text(r.get('rate'))} eta {duration(r.get('eta'))}"
            flag = " cancel requested" if r["cancel_requested"] else ""
            line = f"  #{r['id']:<6} {r['kind'][:14]:<14} {progress} {units}{pace}"
            out.append((line[: 80 - len(flag)] + flag) if flag else line[:80])
    if snap["recent_failures"]:
        out.append("")
        out.append("recent failures:")
        for f in snap["recent_failures"]:
            first = (f["error"] or "").splitlines()[0] if f["error"] else ""
            when = "retrying" if f.get("will_retry") else f.get("status", "failed")
            tries = f"{f.get('attempts', '?')}/{f.get('max_attempts', '?')}"
            out.append(f"  #{f['id']:<6} {f['kind'][:14]:<14} {when:<8} {tries:<5} {first}"[:80])
    out.extend(_render_connections(snap.get("connections") or []))
    return "\n".join(terminal_safe(line) for line in out) + "\n"


def _render_connections(connections: list[dict[str, Any]]) -> list[str]:
    """Each connection: its last run, per-table results and next run (80 columns)."""
    if not connections:
        return []
    out = ["", "connections:"]
    for c in connections:
        last = (
            f"last #{c['last_run_id']} {c['last_run_kind']} {c['last_run_status']}"
            if c["last_run_id"]
            else "never run"
        )
        nxt = f"next {instant_text(c['next_run_at'])}" if c["next_run_at"] else "no schedule"
        head = f"  {c['id']:<5} {c['workspace'][:12]}/{c['provider'][:12]} {c['status']} "
        out.append(f"{head}{last}; {nxt}"[:80])
        # The run's result is whatever its handler (or a worker-role write) left: per-table
        # results only when they have that shape, anything else shown as it is.
        tables = c["tables"] if isinstance(c["tables"], dict) else {}
        for name, t in sorted(tables.items())[:10]:
            if not isinstance(t, dict):
                detail = str(t)
            elif t.get("status") == "failed":
                detail = f"failed: {t.get('error') or ''}"
            else:
                detail = f"+{t.get('upserted', 0)} upserted, -{t.get('tombstoned', 0)} tombstoned"
            out.append(f"        {name[:20]:<20} {detail}"[:80])
    return out
