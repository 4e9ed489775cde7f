"""What an operator does to runs and kinds: look a run up, list runs, retry, delete, pause and
resume a kind. The CLI, the dashboard and `App` call these; each takes the caller's connection
and acts in one transaction of its own. Never writes lease columns and never touches a live run:
bad input (an unknown id, a live run, an unknown kind) raises ConfigError with one line and
changes nothing."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import psycopg
from psycopg.rows import dict_row

from .errors import ConfigError, NotFound, StateConflict
from .queries import load
from .text import label_problem

Q = load("leasework", "operations.sql")
Conn = psycopg.Connection[Any]

STATUSES = (
    "blocked",
    "waiting",
    "queued",
    "running",
    "succeeded",
    "partial",
    "failed",
    "cancelled",
)
LIVE = frozenset({"blocked", "waiting", "queued", "running"})
TERMINAL = ("succeeded", "partial", "failed", "cancelled")
RETRYABLE = ("failed", "cancelled", "partial")
MAX_PAGE = 1000

_SINCE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


# -- pure helpers ------------------------------------------------------------------------------


def parse_since(text: str, now: datetime) -> datetime:
    """`--since`: an age (`90s`, `15m`, `2h`, `7d`, `1w`) counted back from `now`, or an ISO 8601
    time (UTC unless it says otherwise)."""
    m = _SINCE.match(text)
    if m:
        return now - timedelta(seconds=float(m.group(1)) * _UNIT[m.group(2)])
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ConfigError(
            f"--since {text!r}: give an age such as 30m, 2h or 7d, or a time such as "
            "2026-05-01T12:00"
        ) from None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def check_statuses(
    statuses: str | Iterable[str] | None, allowed: Sequence[str]
) -> list[str] | None:
    """Status filter values, each one of `allowed`; a string may hold several, comma-separated."""
    if statuses is None:
        return None
    items = statuses.split(",") if isinstance(statuses, str) else list(statuses)
    out = [s.strip() for s in items if s.strip()]
    for s in out:
        if s not in allowed:
            raise ConfigError(f"status {s!r} is not one of {', '.join(allowed)}")
    return out or None


def check_ids(ids: Iterable[object]) -> list[int]:
    out: list[int] = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or i < 1:
            raise ConfigError(f"run id must be a positive integer, got {i!r}")
        out.append(i)
    if not out:
        raise ConfigError("no run id given")
    return sorted(set(out))


# -- flow control: limits as values (pure) -------------------------------------------------------

MAX_RUNNING_RANGE = (1, 100_000)  # max_running and group_limit (kind_limits_valid in schema.sql)
RATE_COUNT_RANGE = (1, 1_000_000)
RATE_PERIOD_RANGE = (0.1, 604_800.0)  # seconds: a tenth of a second to 7 days
RATE_PER = ("tenant", "group")
LIMIT_NAMES = ("max_running", "group_limit", "rate", "rate_per")
_RATE = re.compile(r"^\s*(\d+)\s*/\s*(\d+(?:\.\d+)?|\.\d+)?\s*(ms|s|m|h|d)\s*$")
_RATE_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_RATE_HELP = (
    "write COUNT/PERIOD, such as 100/10s, 5/m, 1000/1h or 20000/1d (a count from "
    f"{RATE_COUNT_RANGE[0]} to {RATE_COUNT_RANGE[1]:,}, a period from 0.1s to 7d)"
)


def parse_rate(value: object, name: str = "rate") -> tuple[int, float]:
    """A rate, "COUNT/PERIOD" (`100/10s`, `5/m`: a period of one unit), as (count, seconds);
    ConfigError naming what is valid for anything else."""
    m = _RATE.match(value) if isinstance(value, str) else None
    if m is None:
        raise ConfigError(f"{name} {_shown(value)} is not valid: {_RATE_HELP}")
    count = int(m.group(1))
    seconds = float(m.group(2) or 1) * _RATE_UNIT[m.group(3)]
    low, high = RATE_PERIOD_RANGE
    if not (RATE_COUNT_RANGE[0] <= count <= RATE_COUNT_RANGE[1] and low <= seconds <= high):
        raise ConfigError(f"{name} {_shown(value)} is out of range: {_RATE_HELP}")
    return count, round(seconds, 6)


def check_limit(name: str, value: object) -> Any:
    """One limit's value as stored: max_running and group_limit an integer in
    MAX_RUNNING_RANGE, rate (count, seconds) from its text, rate_per one of RATE_PER; None removes
    the limit. ConfigError naming what is valid."""
    if value is None:
        return None
    if name in ("max_running", "group_limit"):
        low, high = MAX_RUNNING_RANGE
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ConfigError(
                f"{name} must be an integer from {low} to {high:,} (runs at once), "
                f"got {_shown(value)}"
            )
        return value
    if name == "rate":
        return list(parse_rate(value))
    if name == "rate_per":
        if value not in RATE_PER:
            raise ConfigError(
                f"rate_per must be {' or '.join(repr(v) for v in RATE_PER)} (each its own "
                f"budget), got {_shown(value)}"
            )
        return value
    raise ConfigError(f"unknown limit {_shown(name)}: use one of {', '.join(LIMIT_NAMES)}")


def declared_limits(
    max_running: int | None = None,
    group_limit: int | None = None,
    rate: str | None = None,
    rate_per: str | None = None,
) -> dict[str, Any]:
    """A task's limits as the workers declare them (leasework.kind_limits.declared): the ones it
    sets, checked. ConfigError for a bad value, or rate_per without a rate."""
    given = {"max_running": max_running, "group_limit": group_limit, "rate": rate}
    given["rate_per"] = rate_per
    out = {k: check_limit(k, v) for k, v in given.items() if v is not None}
    if "rate_per" in out and "rate" not in out:
        whose = "tenant" if rate_per == "tenant" else "tenant's group"
        raise ConfigError(f"rate_per={rate_per!r} needs a rate= (each {whose} gets that rate)")
    return out


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


MAX_SEARCH = 1000  # characters of an --error search
MAX_TAGS = 20  # tags a filter (or a run) names at most


@dataclass(frozen=True)
class Filters:
    """Which runs: each field optional. `since` is the earliest created_at. `error`: text its
    error holds (a substring, case-insensitive); `payload`: a JSON value its payload contains
    (`{"account": 42}`: jsonb containment, @>); `tags`: tags it has, every one. Checked when made
    (ConfigError naming the bad one)."""

    statuses: list[str] | None = None
    kind: str | None = None
    key: str | None = None
    tenant: str | None = None
    since: datetime | None = None
    error: str | None = None
    payload: Any = None
    tags: Sequence[str] | None = None

    def __post_init__(self) -> None:
        if self.error is not None and (
            not isinstance(self.error, str) or not 1 <= len(self.error) <= MAX_SEARCH
        ):
            raise ConfigError(
                f"error search must be 1-{MAX_SEARCH} characters of text, got {_shown(self.error)}"
            )
        if self.payload is not None:
            try:
                orjson.dumps(self.payload)
            except TypeError:
                raise ConfigError(
                    f"payload filter must be a JSON value such as {{\"account\": 42}}, got "
                    f"{_shown(self.payload)}"
                ) from None
        if self.tags is not None:
            object.__setattr__(self, "tags", check_tag_filter(self.tags))

    def params(self) -> dict[str, Any]:
        return {
            "statuses": self.statuses,
            "kind": self.kind,
            "key": self.key,
            "tenant": self.tenant,
            "since": self.since,
            "error": None if self.error is None else "%" + _like_escaped(self.error) + "%",
            "payload": None if self.payload is None else orjson.dumps(self.payload).decode(),
            "tags": self.tags or None,
        }

    @property
    def empty(self) -> bool:
        return not (
            self.kind
            or self.key
            or self.tenant
            or self.since
            or self.error
            or self.payload is not None
            or self.tags
        )

    def described(self) -> str:
        """The filters given, as a log field or a confirm line: `kind=mail status=failed`."""
        given = {
            "status": ",".join(self.statuses) if self.statuses else None,
            "kind": self.kind,
            "key": self.key,
            "tenant": self.tenant,
            "since": self.since.isoformat() if self.since else None,
            "error": self.error,
            "payload": orjson.dumps(self.payload).decode() if self.payload is not None else None,
            "tag": ",".join(self.tags) if self.tags else None,
        }
        return " ".join(f"{k}={v}" for k, v in given.items() if v is not None) or "none"


def _like_escaped(text: str) -> str:
    """`text` matched literally by LIKE / ILIKE (backslash is their default escape)."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def check_tag_filter(tags: object) -> list[str]:
    """Tags to filter by: a list of labels (leasework.label_problem's rule), distinct, sorted."""
    if isinstance(tags, str | bytes) or not isinstance(tags, Iterable):
        raise ConfigError(f"tags must be a list of strings, got {_shown(tags)}")
    out = list(tags)
    if len(out) > MAX_TAGS:
        raise ConfigError(f"tags: at most {MAX_TAGS} in a filter, got {len(out)}")
    for tag in out:
        if not isinstance(tag, str):
            raise ConfigError(f"a tag must be a string, got {_shown(tag)}")
        problem = label_problem(tag)
        if problem is not None:
            raise ConfigError(f"tag {_shown(tag)} {problem}")
    return sorted(set(out))


@dataclass(frozen=True)
class Page:
    """One page of runs, newest first; `next_before` pages on (None: this was the last page)."""

    runs: list[dict[str, Any]]
    next_before: int | None


@dataclass(frozen=True)
class Acted:
    """What an action did: the runs it changed (`ids`: retried, deleted, cancelled, made due) and
    how many it acted on (`count`; for a dry run, how many it would). A cancel's running runs that
    got a cancel request are `requested` (counted too); the runs an action left as they were
    are `skipped` (by id: a finished run to cancel, a run due already to run now; by filter: a
    run to retry whose key is busy). `pages`: the transactions it took (by filter)."""

    ids: list[int] = field(default_factory=list)
    dry_run: bool = False
    count: int = 0
    requested: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    pages: int = 0


# -- reading -----------------------------------------------------------------------------------


def get_run(conn: Conn, run_id: int) -> dict[str, Any] | None:
    """Every column of one run (payload, result, error, history, lease, worker), plus
    `kind_paused`; None if there is no such run (never was, or pruned)."""
    (run_id,) = check_ids([run_id])
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(Q["get_run"], {"id": run_id}).fetchone()


GRAPH_MAX = 10_000  # runs of a graph counted, parents or children listed, at most


def dependencies(conn: Conn, run_id: int) -> dict[str, Any]:
    """A run's place in its graph (docs/workflows.md): `parents` (the runs it waits or waited
    for) and `children` (the runs that wait or waited for it), each {id, kind, status,
    on_failure, member}; `graph`: {status: runs} over every run linked to it by dependencies,
    either way (empty for a run without any)."""
    (run_id,) = check_ids([run_id])
    params = {"id": run_id, "limit": GRAPH_MAX}
    with conn.cursor(row_factory=dict_row) as cur:
        parents = cur.execute(Q["run_parents"], params).fetchall()
        children = cur.execute(Q["run_children"], params).fetchall()
        graph = {} if not (parents or children) else {
            r["status"]: int(r["runs"]) for r in cur.execute(Q["run_graph"], params)
        }
    return {"parents": parents, "children": children, "graph": graph}


def run_steps(conn: Conn, run_id: int) -> list[dict[str, Any]]:
    """A run's stored durable steps (ctx.step), oldest first: name, bytes (of the value's
    JSON), attempt (the one that stored it), created_at, preview (the value's JSON, its first
    200 characters)."""
    (run_id,) = check_ids([run_id])
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(Q["run_steps"], {"id": run_id}).fetchall()


def held_back(conn: Conn, run_id: int) -> list[dict[str, Any]]:
    """Why a queued run is not being claimed now, one entry per rule holding it (empty: nothing
    does; a worker takes it when one is free), each {"reason": ..., ...}: `not_due` (until),
    `paused`, `capped` (running, max_running), `rate_limited` (until, rate, per), `group_full`
    (tenant, group, running, group_limit), `tenant_exclusive` (an exclusive run of its tenant
    runs), `exclusive_waits` (running: the other runs of its tenant it waits for). A run that is
    not queued: `waiting` for its key's active run, or nothing."""
    (run_id,) = check_ids([run_id])
    with conn.cursor(row_factory=dict_row) as cur:
        r = cur.execute(Q["held_back"], {"id": run_id}).fetchone()
    if r is None:
        return []
    if r["status"] == "waiting":
        return [{"reason": "waiting", "detail": "an active run of its key: it waits its turn"}]
    if r["status"] == "blocked":
        open_ = [p["id"] for p in dependencies(conn, run_id)["parents"] if p["status"] in LIVE]
        return [{"reason": "blocked", "parents": open_}]
    if r["status"] != "queued":
        return []
    out: list[dict[str, Any]] = []
    if r["not_due"]:
        out.append({"reason": "not_due", "until": r["queued_at"]})
    if r["paused"]:
        out.append({"reason": "paused"})
    if r["max_running"] is not None and r["running"] >= r["max_running"]:
        out.append(
            {"reason": "capped", "running": r["running"], "max_running": r["max_running"]}
        )
    if r["rate_count"] is not None and r["rate_free_at"] > r["now"]:
        per_tenant = r["rate_per"] is not None and r["tenant"] is not None
        if per_tenant:
            # Rated per group, a run without a group counts against its tenant's budget.
            per = "group" if r["rate_per"] == "group" and r["group"] is not None else "tenant"
        else:
            per = "no tenant" if r["rate_per"] else "kind"
        out.append(
            {
                "reason": "rate_limited",
                "until": r["rate_free_at"],
                "rate_count": r["tenant_rate_count"] if per_tenant else r["rate_count"],
                "rate_seconds": r["tenant_rate_seconds"] if per_tenant else r["rate_seconds"],
                "per": per,
            }
        )
    if r["tenant"] is not None:
        if r["exclusive_running"]:
            out.append({"reason": "tenant_exclusive", "tenant": r["tenant"]})
        elif r["exclusive"] and r["tenant_running"]:
            out.append(
                {"reason": "exclusive_waits", "tenant": r["tenant"], "running": r["tenant_running"]}
            )
        elif r["group"] is not None and r["group_running"] >= r["group_limit"]:
            out.append(
                {
                    "reason": "group_full",
                    "tenant": r["tenant"],
                    "group": r["group"],
                    "running": r["group_running"],
                    "group_limit": r["group_limit"],
                }
            )
    return out


def list_runs(
    conn: Conn, filters: Filters | None = None, *, limit: int = 50, before: int | None = None
) -> Page:
    """Runs matching `filters`, newest first, at most `limit` (1-1000). Keyset paging: pass the
    page's `next_before` as `before` for the next page."""
    filters = filters or Filters()
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
        raise ConfigError(f"limit must be an integer from 1 to {MAX_PAGE}, got {limit!r}")
    if before is not None:
        (before,) = check_ids([before])
    params = {**filters.params(), "before": before, "limit": limit + 1}
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(Q["list_runs"], params).fetchall()
    more = len(rows) > limit
    rows = rows[:limit]
    return Page(rows, rows[-1]["id"] if more and rows else None)


def paused(conn: Conn) -> list[dict[str, Any]]:
    """The paused kinds: kind, paused_at and how many runs of it are queued."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(Q["list_paused"]).fetchall()


# -- acting ------------------------------------------------------------------------------------
#
# By id, an action checks every run first (an unknown id, or a run whose state does not allow
# it, changes nothing). By filter (and by id past PAGE runs) it walks the matching runs by id, a
# page at a time, each page its own short transaction (one statement for cancel, run-now and
# delete; retry's key checks and its update for retry), so that a bulk action over a million
# runs never holds one giant transaction, and each page reads the runs as they are then: a run
# a worker claimed since the count is running, and a cancel asks it to stop (leasework.cancel),
# as a cancel of that one run would. The connection must not be inside a transaction of the
# caller's (a page would then be a savepoint in it).

PAGE = 500  # runs per page (and transaction) of a bulk action
CANCELLABLE = ("blocked", "waiting", "queued", "running")
RUN_NOW = ("queued",)

# Called after each page has committed: (page number from 1, what the action did so far).
PageHook = Callable[[int, "Acted"], None]


# A run an action decides about: id, kind, key, status, tenant.
_Row = tuple[int, str, str | None, str, str | None]


def _in_tenant(tenant: str | None) -> str:
    return f" in tenant {tenant!r}" if tenant is not None else ""


def _locked(conn: Conn, ids: list[int]) -> list[_Row]:
    rows = [
        (int(r[0]), str(r[1]), r[2], str(r[3]), r[4])
        for r in conn.execute(Q["lock_runs"], {"ids": ids}).fetchall()
    ]
    _refuse_missing(ids, [r[0] for r in rows])
    return rows


def _refuse_missing(wanted: Sequence[int], found: Iterable[int]) -> None:
    missing = sorted(set(wanted) - set(found))
    if missing:
        shown = ", ".join(str(i) for i in missing[:10])
        raise NotFound(f"no run with id {shown} (it may have been pruned); nothing changed")


def _refuse_statuses(
    rows: Sequence[_Row], allowed: Sequence[str], action: str
) -> None:
    bad = [r for r in rows if r[3] not in allowed]
    if not bad:
        return
    first = bad[0]
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    if first[3] in LIVE and action != "run now":
        why = f"is {first[3]}: only a finished run can be {action}"
        if first[3] in ("queued", "running", "waiting") and action == "deleted":
            why += " (cancel it first: leasework cancel ID)"
        if first[3] == "queued" and action == "retried":
            why += " (to start a queued run waiting for its due time now: leasework run-now ID)"
    else:
        why = f"is {first[3]}: only {', '.join(allowed)} runs can be {action}"
    raise StateConflict(f"run {first[0]} {why}{more}; nothing changed")


def _filter_statuses(filters: Filters, allowed: Sequence[str], action: str) -> list[str]:
    statuses = filters.statuses or list(allowed)
    bad = [s for s in statuses if s not in allowed]
    if bad:
        raise ConfigError(
            f"--status {bad[0]}: only {', '.join(allowed)} runs can be {action}; nothing changed"
        )
    return statuses


def _need_filters(filters: Filters | None, action: str) -> Filters:
    if filters is None or (filters.empty and not filters.statuses):
        raise ConfigError(
            f"{action}: name run ids, or filters (--kind, --status, --key, --tenant, --since, "
            "--error, --payload, --tag)"
        )
    return filters


def _check_page_size(page_size: int) -> int:
    if isinstance(page_size, bool) or not isinstance(page_size, int) or not 1 <= page_size <= 10_000:
        raise ConfigError(f"page_size must be an integer from 1 to 10000, got {page_size!r}")
    return page_size


def _outside_transaction(conn: Conn, action: str) -> None:
    """A paged action commits each page: refused inside a transaction of the caller's, where its
    pages would all commit together at the caller's commit (one giant transaction)."""
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise ConfigError(
            f"{action} commits a page of runs at a time: call it on a connection "
            "outside any transaction (autocommit, or after commit); nothing changed"
        )


def _walk(
    conn: Conn,
    query: str,
    params: Mapping[str, Any],
    page_size: int,
    between_pages: PageHook | None,
    acted: Callable[[Any], Acted],
) -> Acted:
    """Run a page statement (`query`: operations.sql, one statement per page: it returns how many
    runs it read, the last id read, and what it did) from the lowest matching id up, each in a
    transaction of its own, until a page reads fewer than `page_size` runs. `acted(row)`: what a
    page did, summed into the result."""
    total = Acted()
    after: int | None = None
    page = 0
    while True:
        with conn.transaction():
            row = conn.execute(
                Q[query], {**params, "after": after, "limit": page_size}
            ).fetchone()
        assert row is not None
        page += 1
        done = acted(row)
        total = Acted(
            sorted(total.ids + done.ids),
            False,
            total.count + done.count,
            requested=sorted(total.requested + done.requested),
            skipped=sorted(total.skipped + done.skipped),
            pages=page,
        )
        if between_pages is not None:
            between_pages(page, total)
        if int(row[0]) < page_size:
            return total
        after = int(row[1])


def _ids_params(ids: list[int]) -> dict[str, Any]:
    """Parameters of a page statement acting on these ids only, whatever the filters."""
    return {**Filters().params(), "ids": ids}


def _filter_params(filters: Filters) -> dict[str, Any]:
    return {**filters.params(), "ids": None}


def cancel(
    conn: Conn,
    ids: Iterable[int] | None = None,
    *,
    filters: Filters | None = None,
    dry_run: bool = False,
    page_size: int = PAGE,
    between_pages: PageHook | None = None,
) -> Acted:
    """Cancel runs, by id or by `filters` (their status filter among blocked, waiting, queued,
    running; default all four), as `leasework.cancel` cancels one (App.cancel): a blocked,
    waiting or queued run is `cancelled` now (`ids`); a running one gets a cancel request and
    stops at its worker's next control check (`requested`); a finished one is left as it is
    (`skipped`, by id). By id, every id must exist (NotFound, nothing changed). A page at a time
    (`page_size` runs, each page its own transaction; `between_pages(page, so_far)` is called
    after each commits): a run claimed between the count and its page is cancelled as running.
    `dry_run`: count only."""
    page_size = _check_page_size(page_size)
    if ids is not None:
        wanted = check_ids(ids)
        rows = conn.execute(Q["run_statuses"], {"ids": wanted}).fetchall()
        _refuse_missing(wanted, (int(r[0]) for r in rows))
        live = [int(r[0]) for r in rows if r[1] in CANCELLABLE]
        finished = sorted(int(r[0]) for r in rows if r[1] not in CANCELLABLE)
        if dry_run:
            return Acted([], True, len(live))
        params = _ids_params(live)
        statuses: list[str] = list(CANCELLABLE)
    else:
        f = _need_filters(filters, "cancel")
        statuses = _filter_statuses(f, CANCELLABLE, "cancelled")
        if dry_run:
            return Acted([], True, _count(conn, f, statuses))
        params = _filter_params(f)
        finished = []
    if ids is not None and not live:
        return Acted([], False, 0, skipped=finished)
    if ids is None or len(live) > page_size:  # a few ids may ride in the caller's transaction
        _outside_transaction(conn, "cancel")

    def page(row: Any) -> Acted:
        cancelled, requested = list(row[2]), list(row[3])
        return Acted(cancelled, False, len(cancelled) + len(requested), requested=requested)

    done = _walk(conn, "cancel_page", {**params, "statuses": statuses}, page_size, between_pages, page)
    return dataclasses.replace(done, skipped=sorted(done.skipped + finished))


def run_now(
    conn: Conn,
    ids: Iterable[int] | None = None,
    *,
    filters: Filters | None = None,
    dry_run: bool = False,
    page_size: int = PAGE,
    between_pages: PageHook | None = None,
) -> Acted:
    """Make queued runs that wait for their due time (a delay, a retry's backoff, a snooze, a
    debounce) due now, and wake idle workers; by id (each must exist and be queued:
    StateConflict otherwise, nothing changed; one due already is left as it is, `skipped`) or
    by `filters` (queued runs only). Their attempts, history and everything else stay. A page
    at a time, as `cancel`. `dry_run`: count the runs not yet due."""
    page_size = _check_page_size(page_size)
    if ids is not None:
        wanted = check_ids(ids)
        rows = conn.execute(Q["run_statuses"], {"ids": wanted}).fetchall()
        _refuse_missing(wanted, (int(r[0]) for r in rows))
        _refuse_statuses(
            [(int(r[0]), "", None, str(r[1]), None) for r in rows], RUN_NOW, "run now"
        )
        waiting = [int(r[0]) for r in rows if r[2]]
        due = sorted(int(r[0]) for r in rows if not r[2])
        if dry_run:
            return Acted([], True, len(waiting))
        if not waiting:
            return Acted([], False, 0, skipped=due)
        params = _ids_params(waiting)
    else:
        f = _need_filters(filters, "run-now")
        _filter_statuses(f, RUN_NOW, "run now")
        if dry_run:
            return Acted([], True, _count(conn, f, list(RUN_NOW), not_due=True))
        params = _filter_params(f)
        due = []
    if ids is None or len(params["ids"]) > page_size:
        _outside_transaction(conn, "run-now")

    def page(row: Any) -> Acted:
        return Acted(list(row[2]), False, len(row[2]))

    done = _walk(conn, "run_now_page", params, page_size, between_pages, page)
    return dataclasses.replace(done, skipped=sorted(done.skipped + due))


def _count(conn: Conn, filters: Filters, statuses: Sequence[str], not_due: bool = False) -> int:
    row = conn.execute(
        Q["count_runs"], {**filters.params(), "statuses": list(statuses), "not_due": not_due}
    ).fetchone()
    return int(row[0]) if row else 0


def count(conn: Conn, filters: Filters, action: str) -> int:
    """How many runs `action` ("retry", "cancel", "delete", "run-now") would act on now, of
    those matching `filters` (the dashboard's "all N matching this filter")."""
    allowed = {
        "retry": RETRYABLE,
        "cancel": CANCELLABLE,
        "delete": TERMINAL,
        "run-now": RUN_NOW,
    }[action]
    statuses = [s for s in (filters.statuses or allowed) if s in allowed]
    if not statuses:
        return 0
    return _count(conn, filters, statuses, not_due=action == "run-now")


def count_matching(conn: Conn, filters: Filters, *, limit: int = 100_000) -> int:
    """How many runs match `filters` (any status the filter allows), counted up to `limit`."""
    row = conn.execute(Q["count_matching"], {**filters.params(), "limit": limit}).fetchone()
    return int(row[0]) if row else 0


def retry(
    conn: Conn,
    ids: Iterable[int] | None = None,
    *,
    filters: Filters | None = None,
    attempts: int | None = None,
    budgets: Mapping[str, int] | None = None,
    default_attempts: int = 3,
    dry_run: bool = False,
    clear_steps: bool = False,
    page_size: int = PAGE,
    between_pages: PageHook | None = None,
) -> Acted:
    """Put failed, cancelled or partial runs back to `queued`, due now, with a fresh attempt
    budget (`attempts`, else the kind's figure in `budgets`, else `default_attempts`), their
    history, result and checkpoint kept. By id (every one must exist and be retryable, and no
    key busy, or nothing changes: NotFound, StateConflict) or by `filters` (a status filter
    limited to the retryable ones), a page at a time as `cancel`: a run whose key has another
    active run (or a run before it in the page) is left as it is and counted in `skipped`.
    Their durable steps (ctx.step) are kept, so the retry resumes after the last stored step,
    unless `clear_steps` (after a fix to a step: every step runs again)."""
    if attempts is not None and (
        isinstance(attempts, bool) or not isinstance(attempts, int) or not 1 <= attempts <= 1000
    ):
        raise ConfigError(f"attempts must be an integer from 1 to 1000, got {attempts!r}")
    page_size = _check_page_size(page_size)
    retried = {
        "attempts": attempts,
        "budgets": orjson.dumps(dict(budgets or {})).decode(),
        "default_attempts": default_attempts,
    }
    if ids is not None:
        with conn.transaction():
            rows = _locked(conn, check_ids(ids))
            _refuse_statuses(rows, RETRYABLE, "retried")
            _refuse_busy_keys(conn, rows)
            if dry_run:
                return Acted([], True, len(rows))
            done = _retry_rows(conn, rows, retried, clear_steps)
        return Acted(done, False, len(done))
    f = _need_filters(filters, "retry")
    statuses = _filter_statuses(f, RETRYABLE, "retried")
    if dry_run:
        return Acted([], True, _count(conn, f, statuses))
    _outside_transaction(conn, "retry")
    total = Acted()
    after: int | None = None
    page = 0
    while True:
        with conn.transaction():
            params = {**f.params(), "statuses": statuses, "after": after, "limit": page_size}
            rows = [
                (int(r[0]), str(r[1]), r[2], str(r[3]), r[4])
                for r in conn.execute(Q["select_runs"], params).fetchall()
            ]
            free, busy = _free_keys(conn, rows)
            done = _retry_rows(conn, free, retried, clear_steps)
        page += 1
        total = Acted(
            sorted(total.ids + done),
            False,
            total.count + len(done),
            skipped=sorted(total.skipped + [r[0] for r in busy]),
            pages=page,
        )
        if between_pages is not None:
            between_pages(page, total)
        if len(rows) < page_size:
            return total
        after = rows[-1][0]


def _refuse_busy_keys(conn: Conn, rows: Sequence[_Row]) -> None:
    """StateConflict when two of `rows` share a key in their tenant, or one's key has an active
    run: retried, it would be a second active run of its key (runs_one_active_per_key)."""
    keyed = [(r[4], r[2]) for r in rows if r[2] is not None]
    if len(keyed) != len(set(keyed)):
        dup = next(k for k in keyed if keyed.count(k) > 1)
        raise StateConflict(
            f"two of these runs share key {dup[1]!r}{_in_tenant(dup[0])}: retry one at a time; "
            "nothing changed"
        )
    busy = _busy(conn, rows)
    if busy:
        run = next(r for r in rows if (r[4], r[2]) in busy)
        raise StateConflict(
            f"run {run[0]}: key {run[2]!r}{_in_tenant(run[4])} already has a queued or running "
            "run; nothing changed"
        )


def _busy(conn: Conn, rows: Sequence[_Row]) -> set[tuple[str | None, str]]:
    keyed = [(r[4], r[2]) for r in rows if r[2] is not None]
    if not keyed:
        return set()
    params = {"tenants": [t for t, _ in keyed], "keys": [k for _, k in keyed]}
    return {(r[0], r[1]) for r in conn.execute(Q["busy_keys"], params).fetchall()}


def _free_keys(conn: Conn, rows: Sequence[_Row]) -> tuple[list[_Row], list[_Row]]:
    """`rows` split into those a retry may take and those it must leave: a key with an active
    run, or a key an earlier row of the page takes."""
    busy = _busy(conn, rows)
    free: list[_Row] = []
    left: list[_Row] = []
    for r in rows:
        pair = (r[4], r[2])
        if r[2] is not None and pair in busy:
            left.append(r)
            continue
        if r[2] is not None:
            busy.add((r[4], r[2]))
        free.append(r)
    return free, left


def _retry_rows(
    conn: Conn, rows: Sequence[_Row], retried: Mapping[str, Any], clear_steps: bool
) -> list[int]:
    """The retry of `rows` (locked, checked), inside the caller's transaction: their counts to
    leasework.counters, back to queued, their steps cleared if asked, idle workers woken."""
    if not rows:
        return []
    batch = [r[0] for r in rows]
    conn.execute(Q["tally_retried"], {"ids": batch})
    changed = conn.execute(Q["retry_runs"], {"ids": batch, **retried}).fetchall()
    if clear_steps and changed:
        conn.execute(Q["clear_steps"], {"ids": [int(r[0]) for r in changed]})
    for kind in sorted({str(r[1]) for r in changed}):
        conn.execute(Q["notify_kind"], {"kind": kind})
    return sorted(int(r[0]) for r in changed)


def delete(
    conn: Conn,
    ids: Iterable[int] | None = None,
    *,
    filters: Filters | None = None,
    dry_run: bool = False,
    page_size: int = PAGE,
    between_pages: PageHook | None = None,
) -> Acted:
    """Delete finished runs (succeeded, partial, failed, cancelled), by id (every one must exist
    and be finished, or nothing changes) or by `filters`, a page at a time as `cancel`.
    `dry_run`: count only. What they counted for /metrics is kept (leasework.counters)."""
    page_size = _check_page_size(page_size)
    if ids is not None:
        with conn.transaction():
            rows = _locked(conn, check_ids(ids))
            _refuse_statuses(rows, TERMINAL, "deleted")
            if dry_run:
                return Acted([], True, len(rows))
            gone = conn.execute(Q["delete_runs"], {"ids": [r[0] for r in rows]}).fetchall()
            done = sorted(int(r[0]) for r in gone)
            return Acted(done, False, len(done))
    f = _need_filters(filters, "delete")
    statuses = _filter_statuses(f, TERMINAL, "deleted")
    if dry_run:
        return Acted([], True, _count(conn, f, statuses))
    _outside_transaction(conn, "delete")

    def page(row: Any) -> Acted:
        return Acted(list(row[2]), False, len(row[2]))

    return _walk(
        conn, "delete_page", {**_filter_params(f), "statuses": statuses}, page_size,
        between_pages, page,
    )


def pause(conn: Conn, kinds: Iterable[str], *, known: Iterable[str] = ()) -> list[str]:
    """Pause kinds: no worker claims their runs (batch claims and reclaims included) until they
    are resumed; running runs finish. A kind must be known: registered (`known`), or seen in a
    run or a schedule. Returns the kinds newly paused (already paused ones are left as they are)."""
    wanted = _kinds(kinds)
    with conn.transaction():
        _refuse_unknown(conn, wanted, known, "paused")
        rows = conn.execute(Q["pause_kinds"], {"kinds": wanted}).fetchall()
        return sorted(str(r[0]) for r in rows)


def resume(conn: Conn, kinds: Iterable[str], *, known: Iterable[str] = ()) -> list[str]:
    """Resume paused kinds (workers are woken at once). Returns the kinds resumed: one that was
    not paused is left as it is, as `pause` leaves a paused one, so that a retried or scripted
    resume is harmless. A kind nothing knows (a typo) is refused, as by `pause`: resuming it
    would report success for a kind no worker will ever claim."""
    wanted = _kinds(kinds)
    with conn.transaction():
        current = {str(r["kind"]) for r in paused(conn)}
        _refuse_unknown(conn, wanted, {*known, *current}, "resumed")
        rows = conn.execute(Q["resume_kinds"], {"kinds": wanted}).fetchall()
        return sorted(str(r[0]) for r in rows)


WEIGHT_MIN, WEIGHT_MAX = 0.001, 1000.0


def tenants(conn: Conn) -> list[dict[str, Any]]:
    """Every tenant: name, weight, turn, priority (of its best queued run; None: nothing queued),
    queued and running counts."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(Q["tenants"]).fetchall()


def set_tenant_weight(conn: Conn, name: str | None, weight: float) -> None:
    """Give a tenant `weight` turns for every one of a tenant of weight 1 (within a priority, the
    claim serves tenants with queued runs in turn; docs/state-machine.md). A tenant not seen yet
    is made with it. `name` None: the runs without a tenant, which take turns as one more
    participant. Raises ConfigError for a weight outside 0.001-1000 or a bad name."""
    if name is not None and not isinstance(name, str):
        raise ConfigError(f"tenant must be a string, got {type(name).__name__}")
    problem = None if name is None else label_problem(name)  # every enqueue's rule for a tenant
    if name is not None and problem is not None:
        raise ConfigError(f"tenant {name[:80]!r} {problem}")
    if not (
        isinstance(weight, int | float)
        and not isinstance(weight, bool)
        and WEIGHT_MIN <= weight <= WEIGHT_MAX
    ):
        raise ConfigError(
            f"weight must be a number from {WEIGHT_MIN:g} to {WEIGHT_MAX:g} (1 is the default "
            f"share), got {weight!r}"
        )
    with conn.transaction():
        if name is None:
            conn.execute(Q["set_untenanted_weight"], {"weight": float(weight)})
        else:
            conn.execute(Q["set_tenant_weight"], {"name": name, "weight": float(weight)})


def untenanted_turn(conn: Conn) -> dict[str, Any]:
    """The turn runs without a tenant share: weight, turn, queued and running counts (weight 1
    and turn 0 when its row is gone)."""
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(Q["untenanted_turn"]).fetchone()
    assert row is not None
    return row


# -- flow control: limits set at run time ---------------------------------------------------------


def set_limits(
    conn: Conn, kind: str, *, known: Iterable[str] = (), **changes: Any
) -> dict[str, Any]:
    """Set limits of `kind` at run time, for every host from their next claim: `max_running=`,
    `group_limit=` (integers), `rate=` ("100/10s"), `rate_per=` ("tenant"); None removes that
    limit (whatever the app declares) until `reset_limits`. Each wins over the app's declared
    value until reset. A kind must be known (as for `pause`). Returns the kind's overrides.
    ConfigError (one line, nothing changed) for an unknown name or a bad value."""
    if not changes:
        raise ConfigError(f"no limit given: set one of {', '.join(LIMIT_NAMES)}")
    checked = {}
    for name, value in changes.items():
        if name not in LIMIT_NAMES:
            raise ConfigError(
                f"unknown limit {_shown(name)}: use one of {', '.join(LIMIT_NAMES)}; nothing changed"
            )
        checked[name] = check_limit(name, value)
    (kind,) = _kinds([kind])
    with conn.transaction():
        _refuse_unknown(conn, [kind], known, "changed")
        row = conn.execute(Q["lock_limits"], {"kind": kind}).fetchone()
        declared = dict(row[1]) if row else {}
        overrides = {**(dict(row[2]) if row else {}), **checked}
        effective = {**declared, **overrides}
        if effective.get("rate_per") is not None and effective.get("rate") is None:
            raise ConfigError(
                f"{kind}: rate_per {effective['rate_per']!r} needs a rate (set --rate too, or "
                "rate_per none); nothing changed"
            )
        conn.execute(
            Q["set_limit_overrides"],
            {"kind": kind, "overrides": orjson.dumps(overrides).decode()},
        )
        conn.execute(Q["drop_empty_limits"], {"kind": kind})
    return overrides


def reset_limits(conn: Conn, kind: str, names: Iterable[str] | None = None) -> list[str]:
    """Drop an operator's limits of `kind` (all, or those `names`): the app's declared values
    hold again. Returns the names reset (one not set is left as it is)."""
    (kind,) = _kinds([kind])
    wanted = list(LIMIT_NAMES if names is None else names)
    for name in wanted:
        if name not in LIMIT_NAMES:
            raise ConfigError(
                f"unknown limit {_shown(name)}: use one of {', '.join(LIMIT_NAMES)}; nothing changed"
            )
    with conn.transaction():
        row = conn.execute(Q["lock_limits"], {"kind": kind}).fetchone()
        if row is None:
            return []
        overrides = dict(row[2])
        gone = sorted(n for n in wanted if n in overrides)
        if gone:
            kept = {k: v for k, v in overrides.items() if k not in gone}
            effective = {**dict(row[1]), **kept}
            if effective.get("rate_per") is not None and effective.get("rate") is None:
                raise ConfigError(
                    f"{kind}: without its rate override, rate_per {effective['rate_per']!r} "
                    "would have no rate: reset rate_per too; nothing changed"
                )
            conn.execute(
                Q["set_limit_overrides"], {"kind": kind, "overrides": orjson.dumps(kept).decode()}
            )
            conn.execute(Q["drop_empty_limits"], {"kind": kind})
        return gone


def set_tenant_rate(conn: Conn, kind: str, tenant: str, rate: str | None) -> None:
    """Give one tenant's runs of `kind` a rate of their own ("100/10s"), or its kind's again
    (None). `kind` must be rated per tenant (rate_per "tenant"), or per group ("group": the
    tenant's rate then holds each of its groups). ConfigError otherwise."""
    (kind,) = _kinds([kind])
    if not isinstance(tenant, str):
        raise ConfigError(f"tenant must be a string, got {type(tenant).__name__}")
    problem = label_problem(tenant)
    if problem is not None:
        raise ConfigError(f"tenant {tenant[:80]!r} {problem}")
    count, seconds = parse_rate(rate) if rate is not None else (None, None)
    with conn.transaction():
        row = conn.execute(Q["lock_limits"], {"kind": kind}).fetchone()
        if row is None or row[3] is None or row[4] not in RATE_PER:
            raise ConfigError(
                f"{kind} has no rate per tenant or group: set one first (leasework limits set "
                f"{kind} --rate COUNT/PERIOD --rate-per tenant); nothing changed"
            )
        conn.execute(
            Q["set_tenant_rate"],
            {"kind": kind, "tenant": tenant, "count": count, "seconds": seconds},
        )


def declare_limits(conn: Conn, declared: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """A worker starting: record its app's limits, {kind: declared_limits(...)} for each of its
    kinds ({} for one with none), where they changed; an operator's overrides stay. One row per
    statement (autocommit), so that no declaration waits on a claim that waits on it. Returns the
    kinds whose declaration changed."""
    if not declared:
        return []
    kinds = sorted(declared)
    rows = conn.execute(Q["declared_limits"], {"kinds": kinds}).fetchall()
    have = {str(r[0]): dict(r[1]) for r in rows}
    changed = []
    for kind in kinds:
        wanted = dict(declared[kind])
        if have.get(kind, {}) == wanted:
            continue
        with conn.transaction():
            conn.execute(
                Q["declare_limits"], {"kind": kind, "declared": orjson.dumps(wanted).decode()}
            )
            if not wanted:
                conn.execute(Q["drop_empty_limits"], {"kind": kind})
        changed.append(kind)
    return changed


def _refuse_unknown(conn: Conn, wanted: list[str], known: Iterable[str], action: str) -> None:
    """NotFound for the first kind that is neither in `known` (registered) nor seen in a run or a
    schedule."""
    seen = {
        str(r[0]) for r in conn.execute(Q["known_kinds"], {"kinds": wanted}).fetchall()
    } | set(known)
    unknown = [k for k in wanted if k not in seen]
    if unknown:
        raise NotFound(
            f"unknown kind {unknown[0]!r}: no task, run or schedule has it; nothing {action}"
        )


def _kinds(kinds: Iterable[str]) -> list[str]:
    out = sorted({k for k in kinds})
    if not out:
        raise ConfigError("no kind given")
    for k in out:
        if not isinstance(k, str) or not k or len(k) > 200:
            raise ConfigError(f"kind must be a non-empty string, got {k!r}")
    return out


def db_now(conn: Conn) -> datetime:
    row = conn.execute(Q["db_now"]).fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


__all__ = [
    "Acted",
    "Filters",
    "Page",
    "cancel",
    "count",
    "count_matching",
    "delete",
    "get_run",
    "held_back",
    "list_runs",
    "parse_rate",
    "parse_since",
    "pause",
    "paused",
    "reset_limits",
    "resume",
    "retry",
    "run_now",
    "set_limits",
    "set_tenant_rate",
]
