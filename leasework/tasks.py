"""What a task is, when a periodic one fires, what the stages may ask of the registry that holds
them, and the options every enqueue takes (declared once, `EnqueueOptions`) with the checks it
makes of them. The app, the stages and the families build on this module; it imports none of
them."""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol, TypedDict, Unpack
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import psycopg
from cronsim import CronSim, CronSimError

from .config import Config
from .encoding import check_json
from .errors import ConfigError
from .text import MAX_LABEL, control_problem

Handler = Callable[[Any, Any], Any]  # fn(ctx, payload): a Context, or an AsyncContext

# A run's attempt is aborted (and retried while attempts remain) after this long unless its task
# says otherwise: a deadlocked handler would otherwise hold its lease for ever, the keeper
# renewing it. `@app.task(timeout=None)` turns it off for a task.
DEFAULT_TIMEOUT = 3600.0

# Runs of one async kind a worker process holds at once unless its task says otherwise
# (`@app.task(kind, concurrency=N)`).
DEFAULT_CONCURRENCY = 10

_NAME_RE = re.compile(r"^[A-Za-z0-9_.:/@+-]{1,200}$")


@dataclass(frozen=True)
class Enqueued:
    """What `App.enqueue_run` did: the run's id, and whether it is the key's run that was
    already active (or waiting) rather than a new one."""

    run_id: int
    existing: bool = False


@dataclass(frozen=True)
class Task:
    kind: str
    fn: Handler
    max_attempts: int | None = None
    lease: float | None = None
    timeout: float | None = None
    # The stage that claims and executes this kind: "runs" for user tasks, syncs and purges;
    # families with a stage of their own (e.g. "ingest") name it here.
    stage: str = "runs"
    # Short tasks may opt into claiming up to `batch` runs per statement (runs stage, one at a
    # time inline, each under its own lease) and finishing the successes in one statement.
    batch: int = 1
    # An `async def` handler's kind (stage "async"): at most this many of its runs at once in one
    # worker process, on its event loop.
    concurrency: int = DEFAULT_CONCURRENCY
    # The family that registered it (None: the user's own task); App.with_config re-installs
    # families rather than copying their tasks.
    family: str | None = None
    # Flow control across the fleet (README, "Flow control"), as its workers declare it
    # (operations.declared_limits: max_running, group_limit, rate as [count, seconds], rate_per);
    # empty: none. An operator's `leasework limits set` wins over it until reset.
    limits: Mapping[str, Any] = field(default_factory=dict, hash=False)


def check_kind(kind: object) -> str:
    if not isinstance(kind, str) or not _NAME_RE.fullmatch(kind):
        raise ConfigError(
            f"kind {_short(kind)} is not valid: use 1-200 characters from letters, digits and "
            "_ . : / @ + -"
        )
    return kind


def check_label(name: str, value: object) -> str | None:
    """A key, tenant or group: None, or 1-200 characters with no control, bidi control or line
    separator (leasework.text, the rule leasework.enqueue applies in SQL)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_LABEL:
        raise ConfigError(
            f"{name} must be a non-empty string of at most {MAX_LABEL} characters, "
            f"got {_short(value)}"
        )
    problem = control_problem(value)
    if problem is not None:
        raise ConfigError(f"{name} {_short(value)} {problem}")
    return value


# Keys under this prefix are leasework's own families' (leasework:connection:{id},
# leasework:file:{id}): the public enqueue refuses them, Family.enqueue may use them, and
# leasework.enqueue (schema.sql) refuses them to a role that may not write leasework.runs itself,
# so no application key can hold or take a connection's or a file's runs.
RESERVED_KEY_PREFIX = "leasework:"


def check_key(value: object, *, reserved: bool = False) -> str | None:
    """A run's key: a label (check_label), and unless `reserved` (a family's own enqueue) not
    under RESERVED_KEY_PREFIX."""
    key = check_label("key", value)
    if key is not None and not reserved and key.startswith(RESERVED_KEY_PREFIX):
        raise ConfigError(
            f"key {_short(key)} is refused: keys starting with {RESERVED_KEY_PREFIX!r} are "
            "reserved for leasework's own families (connections, files); use a key without "
            "that prefix"
        )
    return key


# The ranges every enqueue checks (leasework.enqueue in schema.sql checks the same ones): a run
# due further out than MAX_DELAY holds its key all that time and is more likely a unit mistake
# (milliseconds for seconds) than a plan; a lease or timeout outside its range breaks the worker
# that claims the run.
MAX_DELAY = 365 * 86400.0  # seconds
TASK_LEASE_RANGE = (1.0, 86400.0)  # seconds, both included
MAX_TIMEOUT = 30 * 86400.0  # seconds
MAX_EVERY = 10 * 365 * 86400.0  # seconds between runs of a periodic task


def check_seconds(
    name: str,
    value: object,
    *,
    allow_zero: bool,
    minimum: float = 0.0,
    maximum: float = MAX_DELAY,
) -> float | None:
    """None, or a finite number of seconds within [minimum, maximum] (above 0 unless
    allow_zero); anything else (nan, infinity, a bool, a string) is refused naming the range."""
    if value is None:
        return None
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok:
        try:
            number = float(value)  # type: ignore[arg-type]
        except OverflowError:  # an int too large for a float
            ok = False
        else:
            ok = (
                math.isfinite(number)
                and minimum <= number <= maximum
                and (allow_zero or number > 0)
            )
    if not ok:
        low = f"from {minimum:g}" if allow_zero or minimum > 0 else "above 0"
        raise ConfigError(
            f"{name} must be a number of seconds {low} to {maximum:.0f}, got {_short(value)}"
        )
    return float(value)  # type: ignore[arg-type]


def check_bool(name: str, value: object) -> bool:
    """True or False only: "no", 0 or None are not booleans, and a truthy string is no yes."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {_short(value)}")
    return value


def _short(value: object, limit: int = 80) -> str:
    """A value for an error line: its repr, cut at `limit` characters."""
    import reprlib

    r = reprlib.Repr()
    r.maxstring = r.maxother = r.maxlong = limit
    return r.repr(value)


def check_attempts(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1000:
        raise ConfigError(f"max_attempts must be an integer from 1 to 1000, got {_short(value)}")
    return value


def encode_payload(payload: Any, max_bytes: int) -> bytes:
    """JSON via orjson (never pickle), capped at `max_bytes`, stored exactly as given or refused
    (leasework.encoding.check_json)."""
    return check_json("payload", payload, max_bytes)


def check_priority(priority: object) -> int:
    if (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or not -(2**31) <= priority < 2**31
    ):
        raise ConfigError(
            f"priority must be a 32-bit integer (lower runs first), got {_short(priority)}"
        )
    return priority


# -- the enqueue options: declared here once, taken by every enqueue as `**options` -------------


class _KeyOption(TypedDict, total=False):
    # At most one active run per key in its tenant (Client.enqueue).
    key: str | None


class _RunOptions(TypedDict, total=False):
    tenant: str | None
    group: str | None
    max_attempts: int | None  # None: the task's, else the configured default


class _OrderOptions(TypedDict, total=False):
    priority: int  # lower runs first
    delay: float  # seconds before the run is due


class EnqueueOptions(_KeyOption, _RunOptions, _OrderOptions, total=False):
    """The options of an enqueue of one run (`Client.enqueue` and its variants, a task's
    `.configure`, `Family.enqueue`); their defaults are `Options`'."""

    exclusive: bool  # wait while the key is busy rather than return its run


class ManyOptions(_RunOptions, _OrderOptions, total=False):
    """The options of `Client.enqueue_many`: one key per payload rather than one key."""

    keys: Sequence[str | None] | None


class RunTaskOptions(_KeyOption, _RunOptions, total=False):
    """The options of `leasework.testing.run_task`: its run is due at once and first of its
    kind, so no delay, priority or exclusive."""


@dataclass(frozen=True)
class Options:
    """Enqueue options as checked (check_options); each default is that of an option not given."""

    key: str | None = None
    tenant: str | None = None
    group: str | None = None
    exclusive: bool = False
    priority: int = 0
    delay: float = 0.0
    max_attempts: int | None = None


def accept_options(method: str, given: Mapping[str, object], accepted: type[Any]) -> None:
    """Refuse an option `method` does not take (`accepted`: its TypedDict), as a call of a
    function declaring them would: TypeError, naming the closest one and those it takes."""
    names: frozenset[str] = accepted.__optional_keys__
    for name in given:
        if name not in names:
            raise unexpected_keyword(f"{method}()", name, sorted(names))


def unexpected_keyword(call: str, name: str, names: Sequence[str]) -> TypeError:
    """The one line for keyword `name` given to `call`, which takes `names`: the closest one
    first (a typo is the likely mistake), then all of them."""
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return TypeError(
        f"{call} got an unexpected keyword argument {name!r}{hint}; it takes "
        f"{', '.join(names) or 'no arguments'}"
    )


def check_options(given: Mapping[str, Any], *, reserved: bool = False) -> Options:
    """The enqueue options `given` (accepted by accept_options) checked, the others at their
    default; ConfigError names a bad one. `reserved`: the key may be under RESERVED_KEY_PREFIX
    (a family's own run). `keys` is enqueue_many's to check against its payloads."""
    default = Options()

    def get(name: str) -> Any:
        return given.get(name, getattr(default, name))

    return Options(
        key=check_key(get("key"), reserved=reserved),
        tenant=check_label("tenant", get("tenant")),
        group=check_label("group", get("group")),
        exclusive=check_bool("exclusive", get("exclusive")),
        priority=check_priority(get("priority")),
        max_attempts=check_attempts(get("max_attempts")),
        delay=check_seconds("delay", get("delay"), allow_zero=True) or 0.0,
    )


@dataclass(frozen=True)
class ScheduleSpec:
    """When a periodic task fires: every `every` seconds, or on `cron` in time zone `tz`."""

    kind: str
    every: float | None = None
    cron: str | None = None
    tz: str = "UTC"

    @classmethod
    def make(
        cls, kind: str, *, every: float | None = None, cron: str | None = None, tz: str = "UTC"
    ) -> ScheduleSpec:
        """Validate and build; ConfigError names what is wrong."""
        if (every is None) == (cron is None):
            raise ConfigError(f"task {kind!r}: give exactly one of every= and cron=")
        if every is not None:
            try:
                check_seconds("every", every, allow_zero=False, maximum=MAX_EVERY)
            except ConfigError as exc:
                raise ConfigError(f"task {kind!r}: {exc}") from None
        zone = _zone(kind, tz)
        if cron is not None:
            if not isinstance(cron, str):
                raise ConfigError(f"task {kind!r}: cron must be a string, got {cron!r}")
            try:
                next(CronSim(cron, datetime.now(zone)))
            except (CronSimError, StopIteration) as exc:
                raise ConfigError(f"task {kind!r}: cron {cron!r} is not valid: {exc}") from None
        return cls(kind, None if every is None else float(every), cron, tz)

    @property
    def name(self) -> str:
        """The schedule's row name; one schedule per task kind."""
        return self.kind

    @property
    def key(self) -> str:
        """The run key of its runs: one active run per schedule."""
        return f"schedule:{self.kind}"

    def describe(self) -> str:
        return f"every {self.every:g}s" if self.every is not None else f"cron {self.cron} {self.tz}"


def _zone(kind: str, tz: object) -> ZoneInfo:
    if not isinstance(tz, str) or not tz:
        raise ConfigError(f"task {kind!r}: tz must be an IANA time zone name, got {tz!r}")
    try:
        return ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError):
        raise ConfigError(
            f"task {kind!r}: unknown time zone {tz!r} (use an IANA name such as Europe/Berlin)"
        ) from None


def next_fire(spec: ScheduleSpec, now: datetime) -> datetime:
    """The next time after `now` (an aware datetime) the schedule fires, in UTC. Always computed
    from now, never from the previous fire time: that is the no-backlog rule."""
    if spec.every is not None:
        return (now + timedelta(seconds=spec.every)).astimezone(UTC)
    assert spec.cron is not None
    local = now.astimezone(ZoneInfo(spec.tz))
    return next(CronSim(spec.cron, local)).astimezone(UTC)


def first_fire(spec: ScheduleSpec, now: datetime) -> datetime:
    """A new `every` schedule fires at once; a new cron schedule at its next match."""
    return now.astimezone(UTC) if spec.every is not None else next_fire(spec, now)


class Registry(Protocol):
    """What the engine's stages need of the app: its task kinds, schedules and enqueue."""

    config: Config
    tasks: dict[str, Task]
    schedules: dict[str, ScheduleSpec]

    def kinds(self, stage: str | None = None) -> list[str]: ...

    def handler(self, kind: str) -> Handler: ...

    def enqueue(
        self,
        conn: psycopg.Connection[Any],
        kind: str,
        payload: Any = None,
        **options: Unpack[EnqueueOptions],
    ) -> int: ...
