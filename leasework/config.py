"""Configuration: one TOML file, overridden by LEASEWORK_* environment variables, overridden by
flags. Read and validated here, once, then passed explicitly; there are no global settings.

Every default equals the seed's figure. Unknown keys, wrong types and impossible values are
refused at start-up with the key's name and where it came from.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
import stat
import sys
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from .errors import MAX_RETRY_AFTER, ConfigError

ENV_PREFIX = "LEASEWORK_"


@dataclass(frozen=True)
class Range:
    """The values a numeric setting accepts: from `lo` to `hi`, both included (`lo` excluded when
    `above`); for a list, each item, and `items` is how many there may be. Attached to the field
    (metadata "range") and checked by one validator, `check_range`; shown in the reference."""

    lo: float
    hi: float
    above: bool = False
    items: tuple[int, int] | None = None

    def holds(self, value: float) -> bool:
        # nan fails both comparisons; an int too large for a float compares exactly
        return (self.lo < value if self.above else self.lo <= value) and value <= self.hi

    def describe(self) -> str:
        lo, hi = _number(self.lo), _number(self.hi)
        text = f"> {lo} and <= {hi}" if self.above else f"{lo} to {hi}"
        if self.items is not None:
            text = f"{self.items[0]}-{self.items[1]} items, each {text}"
        return text


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def doc(text: str, default: str | None = None, *, range: Range | None = None) -> dict[str, Any]:
    """A field's line in the reference; `default` describes a default derived from others;
    `range` the values it accepts."""
    meta: dict[str, Any] = {"doc": text}
    if default is not None:
        meta["default"] = default
    if range is not None:
        meta["range"] = range
    return meta


DAY = 86400.0
SECONDS = Range(0, 30 * DAY, above=True)  # a positive duration of at most 30 days
RETENTION = Range(1, 10 * 365 * DAY)


POOL_KEYS = ("name", "processes", "kinds", "concurrency")
EVERY_OTHER = "*"  # a pool's kinds: every kind no other pool of the host names


@dataclass(frozen=True)
class Pool:
    """A share of a host's children that claims only its kinds (`[[pools]]`). `kinds` None: the
    host's "everything else" pool, which claims every kind of the app that no other pool of this
    host names (an exclusion list: supervisor/parent.py forks it, Config.pool_serves decides)."""

    name: str
    processes: int
    kinds: tuple[str, ...] | None = None
    # Async runs each of its children holds at once (async handlers); None: the config's.
    concurrency: int | None = None

    def spec(self) -> str:
        """The pool as `--pool` takes it: NAME:PROCESSES:KIND,KIND (or `*`), the processes
        written PROCESSESxCONCURRENCY when it sets a concurrency."""
        kinds = EVERY_OTHER if self.kinds is None else ",".join(self.kinds)
        each = "" if self.concurrency is None else f"x{self.concurrency}"
        return f"{self.name}:{self.processes}{each}:{kinds}"


@dataclass(frozen=True)
class Config:
    dsn: str | None = field(
        default=None,
        metadata=doc("libpq connection string or URL; else DATABASE_URL, else libpq defaults"),
    )
    pooler: str = field(
        default="auto",
        metadata=doc(
            "auto, on or off: whether dsn goes through a pooler in transaction mode (PgBouncer): "
            "then no prepared statement, no session state, and wake-up by NOTIFY only over "
            "listen_dsn; auto detects it on each connection"
        ),
    )
    listen_dsn: str | None = field(
        default=None,
        metadata=doc(
            "a direct (unpooled) connection string for LISTEN when dsn goes through a pooler: "
            "the supervisor holds one per host and relays wake-ups to its children (a "
            "standalone worker holds its own); unset: idle workers behind a pooler poll every "
            "poll_interval"
        ),
    )
    app: str | None = field(default=None, metadata=doc("MODULE:ATTR of the user's App"))
    poll_interval: float = field(
        default=2.0,
        metadata=doc(
            "seconds between polls of an idle worker with no wake-up (behind a pooler without "
            "listen_dsn), and of a stage that cannot tell when it is next due",
            range=Range(0.01, 3600),
        ),
    )
    idle_poll_max: float = field(
        default=30.0,
        metadata=doc(
            "seconds an idle worker woken by NOTIFY may sleep at most: it sleeps until a NOTIFY, "
            "the next delayed or retried run, lease expiry, schedule or maintenance period comes "
            "due, or this long (never less than poll_interval)",
            range=Range(0.01, 3600),
        ),
    )
    lease: float = field(
        default=120.0, metadata=doc("lease length in seconds (database time)", range=Range(1, DAY))
    )
    renew_interval: float | None = field(
        default=None,
        metadata=doc(
            "renew the lease after this many seconds; unset: a third of the lease",
            "lease / 3",
            range=Range(0.01, DAY),
        ),
    )
    control_interval: float | None = field(
        default=None,
        metadata=doc(
            "seconds between control queries (lost / cancel requested); unset: min(2, lease / 6)",
            "min(2, lease / 6)",
            range=Range(0.01, 3600),
        ),
    )
    abort_grace: float = field(
        default=5.0,
        metadata=doc(
            "seconds a handler gets to return once its run is cancelled, timed out, lost or shut "
            "down, before its process is killed",
            range=Range(0.1, 3600),
        ),
    )
    heartbeat_interval: float = field(
        default=15.0, metadata=doc("seconds between worker heartbeats", range=Range(0.1, 3600))
    )
    lock_timeout: float = field(
        default=0.5,
        metadata=doc(
            "seconds a statement of leasework's own (a worker's, its lease keeper's, the "
            "supervisor's) waits for a row or key another session holds, such as an operator's "
            "open transaction, before it gives up; it is tried again at the next poll",
            range=Range(0.01, 600),
        ),
    )
    statement_timeout: float = field(
        default=60.0,
        metadata=doc(
            "seconds a statement of leasework's own may run before the server cancels it (0: no "
            "limit); a handler's statements are not bound by it",
            range=Range(0, DAY),
        ),
    )
    pool_size: int = field(
        default=4,
        metadata=doc(
            "connections per worker process at most besides its lease keeper's: the control "
            "connection (claims, outcomes, stages) and up to pool_size - 1 opened for handlers "
            "when they ask",
            range=Range(2, 100),
        ),
    )
    max_attempts: int = field(
        default=3,
        metadata=doc("attempts per run unless the task says otherwise", range=Range(1, 1000)),
    )
    backoff: tuple[float, ...] = field(
        default=(5.0, 30.0, 120.0),
        metadata=doc(
            "retry delays in seconds by attempt; the last repeats",
            range=Range(0, MAX_RETRY_AFTER, items=(1, 100)),
        ),
    )
    backoff_jitter: float = field(
        default=0.2,
        metadata=doc(
            "each delay is multiplied by uniform(1 - jitter, 1 + jitter)", range=Range(0, 0.99)
        ),
    )
    payload_max_bytes: int = field(
        default=1 << 20,
        metadata=doc("largest accepted payload, in bytes", range=Range(64, 64 << 20)),
    )
    result_max_bytes: int = field(
        default=1 << 20,
        metadata=doc(
            "largest result a handler may return, in bytes (a larger one fails the attempt)",
            range=Range(64, 64 << 20),
        ),
    )
    concurrency: int | None = field(
        default=None,
        metadata=doc(
            "async runs (`async def` handlers) one worker process holds at once, across its "
            "async kinds; unset: the largest `concurrency=` of the async tasks it serves (10 "
            "unless a task says); a pool's own `concurrency` overrides it for its children",
            "the tasks'",
            range=Range(1, 1000),
        ),
    )
    processes: int = field(
        default=2, metadata=doc("worker processes the supervisor forks", range=Range(1, 1024))
    )
    pools: tuple[Pool, ...] = field(
        default=(),
        metadata=doc(
            "pools of children that claim only their kinds: `[[pools]]` tables with name, "
            "processes and kinds (a list, or `*` / omitted for every kind no other pool names); "
            "set, the children are the pools' processes and `processes` is not used. "
            "Env and --pool: NAME:PROCESSES:KIND,KIND separated by `;`",
            "none",
        ),
    )
    graceful_timeout: float = field(
        default=30.0,
        metadata=doc("seconds a stopping worker lets its current job finish", range=Range(0, DAY)),
    )
    # -- the supervisor (supervisor/parent.py; decisions in supervisor/policy.py) ------------
    max_jobs_per_child: int = field(
        default=0,
        metadata=doc(
            "restart a child after this many jobs (leaky user code); 0: never",
            range=Range(0, 1_000_000_000),
        ),
    )
    watchdog: bool = field(
        default=True,
        metadata=doc("kill a child that holds a lease it stopped renewing, or went silent"),
    )
    watchdog_margin: float | None = field(
        default=None,
        metadata=doc(
            "kill a child whose lease was not renewed for lease minus this many s; unset: lease / 6",
            "lease / 6",
            range=Range(0, DAY),
        ),
    )
    deadman: bool = field(
        default=True,
        metadata=doc(
            "a kernel timer kills a worker process before a lease it could not renew expires "
            "(even when nothing in it can run); off only to debug a paused worker"
        ),
    )
    hang_timeout: float = field(
        default=120.0,
        metadata=doc(
            "kill a child unresponsive this many s (stopped, or a C call holding the GIL); 0: never",
            range=Range(0, DAY),
        ),
    )
    restart_backoff: float = field(
        default=0.1,
        metadata=doc(
            "first restart delay in s after a crash; doubles per crash", range=Range(0.001, 3600)
        ),
    )
    restart_backoff_max: float = field(
        default=30.0, metadata=doc("longest restart delay in seconds", range=Range(0.001, DAY))
    )
    restart_reset_after: float = field(
        default=30.0,
        metadata=doc(
            "a child up this many seconds clears its slot's crash streak", range=Range(0, DAY)
        ),
    )
    log_level: str = field(default="info", metadata=doc("debug, info, warning or error"))
    log_runs_slower_than: float = field(
        default=1.0,
        metadata=doc(
            "a run that succeeds after this many seconds or more logs run_succeeded at info;"
            " quicker ones, and every run_claimed, at debug (0: every success at info)",
            range=Range(0, DAY),
        ),
    )
    log_format: str = field(
        default="auto",
        metadata=doc("json, text, or auto: text on a terminal, JSON lines otherwise"),
    )

    # The settings of the stages and families (sections registered with `section`), as
    # (key, value) pairs: read with `config.section(TheirSettings)`.
    extra: tuple[tuple[str, Any], ...] = field(default=(), repr=False, metadata={"internal": True})
    # Where `load` found each setting it set: (key, "--app" | "LEASEWORK_APP" | "FILE: app"),
    # so that an error about a value (an app that does not import) names the place to fix it,
    # not a flag the user never typed. Not part of the configuration: left out of equality.
    origins: tuple[tuple[str, str], ...] = field(
        default=(), repr=False, compare=False, metadata={"internal": True}
    )

    @classmethod
    def make(cls, **values: Any) -> Config:
        """A Config from flat keys, the engine's and every registered section's (the keys of the
        file and the environment); an unknown key is refused. Not validated: `load` does that."""
        return cls().replace(**values)

    def replace(self, **changes: Any) -> Config:
        own = {k: v for k, v in changes.items() if k in FIELDS}
        extra = dict(self.extra)
        for key, value in changes.items():
            if key in FIELDS:
                continue
            if key not in _OWNER:
                raise ConfigError(f"unknown setting {short(key)}{did_you_mean(key)}")
            extra[key] = value
        return dataclasses.replace(self, **own, extra=tuple(sorted(extra.items())))

    def origin(self, key: str) -> str:
        """Where a setting was given, for an error about its value: `--app`, `LEASEWORK_APP`,
        `FILE: app`, or the bare key when `load` did not set it (a default, or code)."""
        return dict(self.origins).get(key, key)

    def section(self, cls: type[S]) -> S:
        """The frozen settings of one stage or family: its defaults, overridden by the keys the
        file, the environment and the flags set."""
        return cast(S, _section(self, cast(type, cls)))

    def __getattr__(self, name: str) -> Any:
        owner = _OWNER.get(name)
        if owner is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise AttributeError(
            f"{name} is a setting of {owner.__module__}: read it as "
            f"config.section({owner.__name__}).{name}"
        )

    # The timings derived from the lease unless set: renew at a third, control every 2 s at most,
    # the watchdog's margin a sixth (the seed's 40 s, 2 s and 20 s for a 120 s lease).

    @property
    def renew_every(self) -> float:
        return self.lease / 3 if self.renew_interval is None else self.renew_interval

    @property
    def control_every(self) -> float:
        if self.control_interval is not None:
            return self.control_interval
        return min(2.0, self.lease / 6, self.renew_every / 2)

    @property
    def kill_margin(self) -> float:
        return self.lease / 6 if self.watchdog_margin is None else self.watchdog_margin

    @property
    def children(self) -> int:
        """How many children the supervisor forks: the pools' processes, else `processes`."""
        return sum(p.processes for p in self.pools) if self.pools else self.processes

    def pool(self, name: str) -> Pool:
        for p in self.pools:
            if p.name == name:
                return p
        known = ", ".join(p.name for p in self.pools) or "none configured"
        raise ConfigError(f"unknown pool {short(name)}; pools: {known}")

    def pool_serves(self, pool: str | None, kind: str) -> bool:
        """Whether a worker of `pool` (None: no pool, every kind) claims `kind`. The pool with no
        kinds takes every kind that no other pool of this configuration names."""
        if pool is None:
            return True
        kinds = self.pool(pool).kinds
        if kinds is not None:
            return kind in kinds
        return not any(p.kinds is not None and kind in p.kinds for p in self.pools)


S = TypeVar("S")

# The engine's own settings (the worker, its lease, the supervisor, a run's defaults) are the
# fields of Config. A stage or a family declares its own beside it: a frozen dataclass whose
# fields carry `doc(...)` metadata, registered with `@section(...)`. The keys stay flat in the
# file and the environment (`ingest_limit`, LEASEWORK_INGEST_LIMIT), so a key names one setting of
# one section; `load` knows the sections registered when it runs (the CLI imports the built-in
# families and the named app first).
FIELDS: dict[str, dataclasses.Field[Any]] = {
    f.name: f for f in dataclasses.fields(Config) if not f.metadata.get("internal")
}
_SECTIONS: dict[type, tuple[str, int]] = {}  # section class -> (title, order in the reference)
_OWNER: dict[str, type] = {}  # setting key -> its section class
_SECTION_FIELDS: dict[str, dataclasses.Field[Any]] = {}


def section(title: str, order: int = 100) -> Callable[[type[S]], type[S]]:
    """Register a frozen dataclass as the settings of a stage or a family: its fields become
    keys of the config file, the environment and the reference (under `title`; `order` places
    the section there). A `check(self)` method, if any, refuses impossible combinations."""

    def register(cls: type[S]) -> type[S]:
        params = getattr(cls, "__dataclass_params__", None)
        if params is None or not params.frozen:
            raise TypeError(f"{cls.__qualname__}: a settings section is a frozen dataclass")
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            owner = _OWNER.get(f.name)
            same = owner is not None and (owner.__module__, owner.__qualname__) == (
                cls.__module__,
                cls.__qualname__,
            )
            if f.name in FIELDS or (owner is not None and not same):
                taken = "the engine" if f.name in FIELDS else owner.__qualname__  # type: ignore[union-attr]
                raise TypeError(f"{cls.__qualname__}: setting {f.name!r} is already {taken}'s")
            if f.default is dataclasses.MISSING:
                raise TypeError(f"{cls.__qualname__}: setting {f.name!r} needs a default")
        for old in [c for c in _SECTIONS if (c.__module__, c.__qualname__) ==
                    (cls.__module__, cls.__qualname__)]:  # fmt: skip
            del _SECTIONS[old]  # the same class defined again (a module reloaded)
        _SECTIONS[cls] = (title, order)
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            _OWNER[f.name] = cls
            _SECTION_FIELDS[f.name] = f
        return cls

    return register


def forget(cls: type) -> None:
    """Unregister a section (tests that declare one of their own)."""
    _SECTIONS.pop(cls, None)
    for key in [k for k, owner in _OWNER.items() if owner is cls]:
        del _OWNER[key], _SECTION_FIELDS[key]


def sections() -> list[type]:
    """The registered sections, in the reference's order."""
    return sorted(_SECTIONS, key=lambda c: (_SECTIONS[c][1], _SECTIONS[c][0]))


@functools.cache
def _section(cfg: Config, cls: type) -> Any:
    if cls not in _SECTIONS:
        raise TypeError(f"{cls.__qualname__} is not a registered settings section")
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in cfg.extra if k in names})


def _field(name: str) -> dataclasses.Field[Any]:
    return FIELDS[name] if name in FIELDS else _SECTION_FIELDS[name]


def known(name: str) -> bool:
    return name in FIELDS or name in _OWNER


def all_keys() -> list[str]:
    return [*FIELDS, *(f.name for c in sections() for f in dataclasses.fields(c))]


_LOG_LEVELS = ("debug", "info", "warning", "error")
_LOG_FORMATS = ("auto", "json", "text")
_POOLER = ("auto", "on", "off")


def _coerce(name: str, value: Any, where: str) -> Any:
    """One raw value (TOML value, env string or flag) as the field's type, within its range."""
    out = _convert(name, value, where)
    check_range(name, out, where)
    return out


# A number in the environment: ASCII digits only. int() and float() also read other scripts'
# digits (`١٢` is 12) and underscores (`1_0` is 10), which nobody types on purpose.
_ENV_INTEGER = re.compile(r"[+-]?[0-9]+")
_ENV_FLOAT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def env_number(text: str, integer: bool = False) -> int | float:
    """An integer (or a number) written in the environment or a spec, or ValueError."""
    text = text.strip()
    if not (_ENV_INTEGER if integer else _ENV_FLOAT).fullmatch(text):
        raise ValueError(f"not an ASCII number: {text!r}")
    return int(text) if integer else float(text)


def _convert(name: str, value: Any, where: str) -> Any:
    """Convert one raw value (TOML value or env string) to the field's type, or refuse it."""
    kind = _field(name).type
    from_env = isinstance(value, str) and where.startswith("env")
    try:
        if kind in ("str | None", "str"):
            if not isinstance(value, str):
                raise TypeError
            return value
        if kind == "bool":
            if from_env and value.strip().lower() in ("1", "true", "yes", "on"):
                return True
            if from_env and value.strip().lower() in ("0", "false", "no", "off"):
                return False
            if not isinstance(value, bool):
                raise TypeError
            return value
        if kind in ("float", "float | None"):
            if isinstance(value, bool):
                raise TypeError
            number = env_number(value) if from_env else value
            if not isinstance(number, int | float) or not math.isfinite(number):
                raise TypeError
            return float(number)
        if kind in ("int", "int | None"):
            if isinstance(value, bool):
                raise TypeError
            number = env_number(value, integer=True) if from_env else value
            if not isinstance(number, int):
                raise TypeError
            return number
        if kind == "tuple[Pool, ...]":
            return parse_pools(value, where)
        if kind == "tuple[float, ...]":
            items = value.split(",") if from_env else value
            if not isinstance(items, list | tuple) or not items:
                raise TypeError
            out = tuple(env_number(x) if from_env else x for x in items)
            if any(isinstance(x, bool) or not isinstance(x, int | float) for x in out):
                raise TypeError
            return tuple(float(x) for x in out)
    except (TypeError, ValueError, OverflowError):
        pass
    expected = {
        "float": "a number",
        "float | None": "a number",
        "int": "an integer",
        "int | None": "an integer",
        "tuple[float, ...]": "a non-empty list of numbers",
        "bool": "true or false",
    }.get(str(kind), "a string")
    written = {  # how the environment writes them
        "float": "in ASCII digits (like 2.5)",
        "float | None": "in ASCII digits (like 2.5)",
        "int": "in ASCII digits (like 8)",
        "int | None": "in ASCII digits (like 8)",
        "tuple[float, ...]": "in ASCII digits (like 5,30,120)",
    }.get(str(kind))
    if from_env and written:
        expected += f" {written}"
    raise ConfigError(f"{where}: {name} must be {expected}, got {short(value)}")


_POOL_PROCESSES = Range(1, 1024)
_CONCURRENCY = Range(1, 1000)


def parse_pools(value: Any, where: str) -> tuple[Pool, ...]:
    """`pools` from TOML (a list of tables), or from the environment or --pool (NAME:PROCESSES:
    KIND,KIND specs, `;`-separated or a list). One line naming the pool for any mistake: an
    unknown key, a pool naming no kind, processes below 1, two pools claiming one kind, two
    "everything else" pools, a repeated name."""
    if isinstance(value, str):
        value = [part for part in value.split(";") if part.strip()]
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{where}: pools must be a list of [[pools]] tables, got {short(value)}")
    pools: list[Pool] = []
    for i, item in enumerate(value):
        label = f"{where}: pools[{i}]"
        if isinstance(item, str):
            item = _pool_spec(item, label)
        if not isinstance(item, dict):
            raise ConfigError(
                f"{label} must be a table (name, processes, kinds), got {short(item)}"
            )
        for key in item:
            if key not in POOL_KEYS:
                raise ConfigError(
                    f"{label}: unknown key {short(key)}; a pool has {', '.join(POOL_KEYS)}"
                )
        name = item.get("name")
        if not isinstance(name, str) or not name.strip() or not name.isprintable():
            raise ConfigError(f"{label}: name must be a non-empty string, got {short(name)}")
        label = f"{where}: pool {short(name)}"
        processes = item.get("processes")
        if isinstance(processes, bool) or not isinstance(processes, int):
            raise ConfigError(f"{label}: processes must be an integer, got {short(processes)}")
        if not _POOL_PROCESSES.holds(processes):
            raise ConfigError(
                f"{label}: processes must be {_POOL_PROCESSES.describe()}, got {processes}"
            )
        kinds = item.get("kinds", EVERY_OTHER)
        if kinds == [EVERY_OTHER]:
            kinds = EVERY_OTHER
        if kinds != EVERY_OTHER:
            if not isinstance(kinds, list | tuple) or not all(
                isinstance(k, str) and k.strip() and k != EVERY_OTHER for k in kinds
            ):
                raise ConfigError(
                    f"{label}: kinds must be a list of kind names, or {EVERY_OTHER!r} for every "
                    f"kind no other pool names, got {short(kinds)}"
                )
            if not kinds:
                raise ConfigError(
                    f"{label} names no kind: list its kinds, or {EVERY_OTHER!r} for every kind "
                    "no other pool names"
                )
        concurrency = item.get("concurrency")
        if concurrency is not None and (
            isinstance(concurrency, bool)
            or not isinstance(concurrency, int)
            or not _CONCURRENCY.holds(concurrency)
        ):
            raise ConfigError(
                f"{label}: concurrency must be an integer {_CONCURRENCY.describe()}, "
                f"got {short(concurrency)}"
            )
        pools.append(
            Pool(
                name,
                processes,
                None if kinds == EVERY_OTHER else tuple(dict.fromkeys(kinds)),
                concurrency,
            )
        )
    seen: dict[str, str] = {}
    names: set[str] = set()
    rest: str | None = None
    for p in pools:
        if p.name in names:
            raise ConfigError(f"{where}: two pools are named {short(p.name)}")
        names.add(p.name)
        if p.kinds is None:
            if rest is not None:
                raise ConfigError(
                    f"{where}: pools {short(rest)} and {short(p.name)} both take every other "
                    "kind; at most one pool may omit its kinds"
                )
            rest = p.name
            continue
        for k in p.kinds:
            if k in seen:
                raise ConfigError(
                    f"{where}: pools {short(seen[k])} and {short(p.name)} both claim kind "
                    f"{short(k)}; a kind belongs to one pool per host"
                )
            seen[k] = p.name
    return tuple(pools)


def _pool_spec(text: str, label: str) -> dict[str, Any]:
    """NAME:PROCESSES:KIND,KIND (or NAME:PROCESSES:*) as a [[pools]] table; PROCESSESxN sets the
    pool's concurrency (async runs per child) too: `io:2x20:fetch`."""
    parts = text.strip().split(":", 2)
    if len(parts) != 3:  # kinds left off: `*` says "every other kind", never a guess
        raise ConfigError(
            f"{label} must look like NAME:PROCESSES:KIND,KIND (or NAME:PROCESSES:* for every "
            f"other kind; NAME:PROCESSESxCONCURRENCY:... for async runs per child), got "
            f"{short(text)}"
        )
    size, _, each = parts[1].partition("x")
    table: dict[str, Any] = {"name": parts[0], "processes": _integer(size)}
    if each:
        table["concurrency"] = _integer(each)
    kinds = parts[2].strip()
    table["kinds"] = (
        EVERY_OTHER if kinds == EVERY_OTHER else [k.strip() for k in kinds.split(",") if k.strip()]
    )
    return table


def _integer(text: str) -> Any:
    """An integer written in a spec (ASCII digits), or the text as it was (the table's check
    names it)."""
    try:
        return env_number(text, integer=True)
    except ValueError:
        return text


def check_range(name: str, value: Any, where: str = "config") -> None:
    """The one check of every numeric setting against the Range attached to its field: one
    line naming the key, where it came from and what would be valid."""
    bound: Range | None = _field(name).metadata.get("range")
    if bound is None or value is None:
        return
    items = value if isinstance(value, tuple) else (value,)
    ok = all(bound.holds(x) for x in items)
    if bound.items is not None and not bound.items[0] <= len(items) <= bound.items[1]:
        ok = False
    if not ok:
        shown = list(value) if isinstance(value, tuple) else value
        raise ConfigError(f"{where}: {name} must be {bound.describe()}, got {short(shown)}")


def short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def validate(cfg: Config) -> Config:
    """Every setting within its range (check_range), then the combinations that are impossible,
    naming the key."""

    def bad(key: str, why: str) -> ConfigError:
        return ConfigError(f"config: {key} {why}")

    for name in FIELDS:
        check_range(name, getattr(cfg, name))
    for cls in sections():
        settings: Any = cfg.section(cls)
        for f in dataclasses.fields(cls):
            check_range(f.name, getattr(settings, f.name))
        check = getattr(settings, "check", None)
        if check is not None:
            check()
    if cfg.renew_every >= cfg.lease / 2:
        raise bad(
            "renew_interval",
            f"must be shorter than half the lease ({cfg.lease / 2:g} s), got {cfg.renew_every:g}",
        )
    if cfg.control_every >= cfg.renew_every:
        raise bad(
            "control_interval",
            f"must be shorter than renew_interval ({cfg.renew_every:g} s), got {cfg.control_every:g}",
        )
    if not 0 <= cfg.kill_margin < cfg.lease - cfg.renew_every:
        raise bad(
            "watchdog_margin",
            f"must be >= 0 and below lease - renew_interval ({cfg.lease - cfg.renew_every:g} s), "
            f"or healthy children would be killed; got {cfg.kill_margin:g}",
        )
    if cfg.hang_timeout != 0 and cfg.hang_timeout <= 2 * cfg.poll_interval:
        raise bad(
            "hang_timeout",
            f"must be 0 (off) or more than two poll intervals ({2 * cfg.poll_interval:g} s), "
            f"got {cfg.hang_timeout:g}",
        )
    if cfg.restart_backoff_max < cfg.restart_backoff:
        raise bad(
            "restart_backoff_max",
            f"must be >= restart_backoff ({cfg.restart_backoff:g} s), got {cfg.restart_backoff_max:g}",
        )
    if cfg.pooler not in _POOLER:
        raise bad("pooler", f"must be one of {', '.join(_POOLER)}, got {short(cfg.pooler)}")
    if cfg.log_level.lower() not in _LOG_LEVELS:
        raise bad(
            "log_level", f"must be one of {', '.join(_LOG_LEVELS)}, got {short(cfg.log_level)}"
        )
    if cfg.log_format.lower() not in _LOG_FORMATS:
        raise bad(
            "log_format", f"must be one of {', '.join(_LOG_FORMATS)}, got {short(cfg.log_format)}"
        )
    return cfg


CONFIG_MAX_BYTES = 1 << 20  # a config file is a few KiB; anything this large is a mistake
# LEASEWORK_* variables that are not settings (the config file's path, the test suite's, the
# demo's and the benchmarks'): never warned about.
_OTHER_VARS = frozenset(
    {
        "CONFIG",
        "TEST_DSN",
        "DEMO_EMBEDDED",
        "CHAOS_EXAMPLES",
        "CHAOS_FAST_EXAMPLES",
        "CHROMIUM",
        "BENCH_RESULTS",
        "DASHBOARD_TOKEN",
    }
)


def _stderr_warning(message: str) -> None:
    print(f"leasework: warning: {message}", file=sys.stderr)


def read_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The TOML file at `path`: a regular file of at most CONFIG_MAX_BYTES, UTF-8 (a byte-order
    mark is accepted). Opened without blocking, so a FIFO or a device is refused, not waited on."""
    where = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"config file {where} not found") from None
    except OSError as exc:
        raise ConfigError(f"config file {where} cannot be read: {exc.strerror}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kinds = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO", stat.S_ISCHR: "a device",
                 stat.S_ISBLK: "a device", stat.S_ISSOCK: "a socket"}  # fmt: skip
        what = next((text for test, text in kinds.items() if test(mode)), "not a regular file")
        raise ConfigError(f"config file {where} is {what}: give a regular TOML file")
    with os.fdopen(fd, "rb") as fh:
        try:
            data = fh.read(CONFIG_MAX_BYTES + 1)
        except OSError as exc:
            raise ConfigError(f"config file {where} cannot be read: {exc.strerror}") from None
    if len(data) > CONFIG_MAX_BYTES:
        raise ConfigError(
            f"config file {where} is over {CONFIG_MAX_BYTES} bytes: a config file is a few KiB"
        )
    try:
        return tomllib.loads(data.decode("utf-8-sig"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {where} is not valid TOML: {exc}") from None
    except RecursionError:  # the parser recurses once per level of nested arrays or tables
        raise ConfigError(
            f"config file {where} nests arrays or inline tables too deeply: its keys are flat "
            "(`pools`, a list of tables, is the deepest value)"
        ) from None


def misspelt(env: Mapping[str, str]) -> list[str]:
    """A warning for each LEASEWORK_* variable that is no setting but looks like one."""
    out = []
    names = {name.upper() for name in all_keys()}
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX):
            continue
        rest = var[len(ENV_PREFIX) :]
        if rest in names or rest in _OTHER_VARS:
            continue
        close = difflib.get_close_matches(rest, sorted(names | _OTHER_VARS), n=1, cutoff=0.75)
        hint = f"; did you mean {ENV_PREFIX}{close[0]}?" if close else ""
        shown = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in var[:80])
        out.append(f"{shown} is not a leasework setting and is ignored{hint}")
    return out


def load(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    warn: Callable[[str], None] | None = None,
    prepare: Callable[[str | None], None] | None = None,
) -> Config:
    """File, then environment, then flags (None values in `overrides` are ignored). Warnings
    (a misspelt LEASEWORK_* variable) go to `warn`, else one line each on stderr; pass
    `warn=lambda m: None` to silence them. A key is known if the engine or a registered section
    has it: `prepare(app)`, called with the app named by the flags, the environment or the file
    before any key is checked, may import what registers more (the CLI imports the built-in
    families and the app)."""
    warn = _stderr_warning if warn is None else warn
    env = os.environ if env is None else env
    overrides = overrides or {}
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    if path is None and env.get(ENV_PREFIX + "CONFIG"):
        path = env[ENV_PREFIX + "CONFIG"]
    raw = read_file(path) if path is not None else {}
    if prepare is not None:
        app = overrides.get("app") or env.get(ENV_PREFIX + "APP") or raw.get("app")
        prepare(app if isinstance(app, str) else None)
    for key, value in raw.items():
        if not known(key) and isinstance(value, dict):
            inner = ", ".join(f"`{k} = ...`" for k in list(value)[:3])
            raise ConfigError(
                f"{path}: unknown table [{short(key)[1:-1]}]: the keys are flat, even where the "
                f"reference groups them; write {inner or 'its keys'} at the top level"
            )
        if not known(key):
            raise ConfigError(f"{path}: unknown key {short(key)}{did_you_mean(key)}")
        values[key] = _coerce(key, value, str(path))
        origins[key] = f"{path}: {key}"
    for message in misspelt(env):
        warn(message)
    for name in all_keys():
        var = ENV_PREFIX + name.upper()
        if var in env and env[var] != "":
            values[name] = _coerce(name, env[var], f"env {var}")
            origins[name] = var
    if "dsn" not in values and env.get("DATABASE_URL"):
        values["dsn"] = env["DATABASE_URL"]
    for key, value in overrides.items():
        if value is None:
            continue
        if not known(key):
            raise ConfigError(f"unknown setting {short(key)}{did_you_mean(key)}")
        flag = "--pool" if key == "pools" else f"--{key.replace('_', '-')}"
        values[key] = _coerce(key, value, flag)
        origins[key] = flag
    made = Config.make(**values)
    return validate(dataclasses.replace(made, origins=tuple(sorted(origins.items()))))


def value(cfg: Config, key: str) -> Any:
    """One setting by its flat key, the engine's or a section's."""
    if key in FIELDS:
        return getattr(cfg, key)
    return getattr(cfg.section(_OWNER[key]), key)


def did_you_mean(key: str) -> str:
    """`; did you mean `lease`?` for a misspelt key, else where the keys are listed."""
    close = difflib.get_close_matches(key.lower(), all_keys(), n=1, cutoff=0.6)
    if close:
        return f"; did you mean `{close[0]}`?"
    return " (`leasework config --reference` lists every key)"


def toml_string(text: str) -> str:
    """A TOML basic string: quotes and backslashes escaped, and every character a terminal could
    act on or that would not show as itself (C0 and C1 controls, DEL, bidi controls, line and
    paragraph separators: what `isprintable()` refuses) written as `\\uXXXX`, so the output is
    valid TOML, one line, and inert on a terminal."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch.isprintable():
            out.append(ch)
        elif ord(ch) <= 0xFFFF:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(f"\\U{ord(ch):08X}")
    return '"' + "".join(out) + '"'


def toml_value(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Pool):  # a spec string, which `pools` also reads back
        return f'"{value.spec()}"'
    return repr(value)


def reference() -> str:
    """The configuration reference as Markdown tables, generated from the field definitions: the
    engine's, then each registered section's. `leasework config --reference` prints it (with the
    built-in families imported), and the README's copy is checked against it."""
    out = [_table(dataclasses.fields(Config), "The engine: the worker, its lease, the supervisor")]
    for cls in sections():
        out.append(_table(dataclasses.fields(cls), f"{_SECTIONS[cls][0]} (`{cls.__module__}`)"))
    return "\n".join(out)


def _table(fields: Any, title: str) -> str:
    rows = [f"**{title}**", "", "| key | default | range | environment | meaning |",
            "|---|---|---|---|---|"]  # fmt: skip
    for f in fields:
        if f.metadata.get("internal"):
            continue
        text = f.metadata.get("doc", "").replace("|", "\\|")
        default = f.metadata.get("default") or toml_value(f.default)
        bound = f.metadata.get("range")
        shown = bound.describe().replace("|", "\\|") if bound is not None else ""
        rows.append(
            f"| `{f.name}` | `{default}` | {shown} | `{ENV_PREFIX}{f.name.upper()}` | {text} |"
        )
    return "\n".join(rows) + "\n"
