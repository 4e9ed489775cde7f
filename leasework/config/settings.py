"""The settings: the engine's own (`Config`, the worker, its lease, the supervisor, a run's
defaults) and how a Config holds the values of the sections its stages and families declare
(`config.section(TheirSettings)`). Frozen; read and validated by the loader, then passed
explicitly: there are no global settings."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from ..errors import MAX_RETRY_AFTER, ConfigError
from .fields import DAY, Range, did_you_mean, doc, is_section, short

S = TypeVar("S")

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
    max_kinds_shown: int = field(
        default=30,
        metadata=doc(
            "kinds that get a line of their own in `leasework status`, the dashboard's tables and "
            "charts and a `kind` label in /metrics: those with the most runs in the table; the "
            "rest are summed into one `other` (each kind shown adds about 4 KB to a scrape; docs/operations.md, \"Metrics\")",
            range=Range(1, 10_000),
        ),
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
            "limit); a handler's statements are not bound by it. A transaction of leasework's own "
            "left idle longer than `lease` is ended by the server (a host cut off between two "
            "statements holds no row lock for longer)",
            range=Range(0, DAY),
        ),
    )
    pool_size: int = field(
        default=4,
        metadata=doc(
            "connections per worker process at most besides its lease keeper's: the main "
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
    max_snoozes: int = field(
        default=100,
        metadata=doc(
            "times a run may snooze (a handler's Snooze: requeued without charging an attempt); "
            "the snooze past that ends it `failed` (0: a snooze fails the run)",
            range=Range(0, 1_000_000),
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

    # The settings of the stages and families (the sections they declare, `@section`), as
    # (key, value) pairs: read with `config.section(TheirSettings)`.
    extra: tuple[tuple[str, Any], ...] = field(default=(), repr=False, metadata={"internal": True})
    # The sections this configuration was read with (their keys are the ones it knows besides
    # the engine's): what the App and its families declare, as the loader was given them. Empty
    # for a Config made in code without them: its section keys are kept for the sections that
    # read them, and an app checks them against its own when it assembles its stages.
    sections: tuple[type, ...] = field(
        default=(), repr=False, compare=False, metadata={"internal": True}
    )
    # Where `load` found each setting it set: (key, "--app" | "LEASEWORK_APP" | "FILE: app"),
    # so that an error about a value (an app that does not import) names the place to fix it,
    # not a flag the user never typed. Not part of the configuration: left out of equality.
    origins: tuple[tuple[str, str], ...] = field(
        default=(), repr=False, compare=False, metadata={"internal": True}
    )

    @classmethod
    def make(cls, *, sections: Iterable[type] = (), **values: Any) -> Config:
        """A Config from flat keys, the engine's and those of `sections` (the keys of the file
        and the environment); a key of none of them is refused when `sections` are given. Not
        validated: `load` does that."""
        return cls(sections=tuple(dict.fromkeys(sections))).replace(**values)

    def replace(self, **changes: Any) -> Config:
        own = {k: v for k, v in changes.items() if k in FIELDS}
        extra = dict(self.extra)
        keys = section_fields(self.sections)
        for key, value in changes.items():
            if key in FIELDS:
                continue
            if self.sections and key not in keys:
                raise ConfigError(
                    f"unknown setting {short(key)}{did_you_mean(key, [*FIELDS, *keys])}"
                )
            extra[key] = value
        return dataclasses.replace(self, **own, extra=tuple(sorted(extra.items())))

    def unknown(self, sections: Iterable[type] = ()) -> list[str]:
        """The section keys this configuration holds that neither its own sections nor
        `sections` (an app's) have."""
        keys = section_fields((*self.sections, *sections))
        return [key for key, _ in self.extra if key not in keys]

    def origin(self, key: str) -> str:
        """Where a setting was given, for an error about its value: `--app`, `LEASEWORK_APP`,
        `FILE: app`, or the bare key when `load` did not set it (a default, or code)."""
        return dict(self.origins).get(key, key)

    def section(self, cls: type[S]) -> S:
        """The frozen settings of one stage or family: its defaults, overridden by the keys the
        file, the environment and the flags set."""
        return cast(S, _section(self, cast(type, cls)))

    def __getattr__(self, name: str) -> Any:
        # Only the instance's own dict: this runs for any missing attribute, copies included.
        owner = next(
            (c for c in self.__dict__.get("sections", ()) if name in section_fields((c,))), None
        )
        if owner is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise AttributeError(
            f"{name} is a setting of {owner.__module__}: read it as "
            f"config.section({owner.__name__}).{name}"
        )

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


# The engine's own settings (the worker, its lease, the supervisor, a run's defaults) are the
# fields of Config. A stage or a family declares its own beside it: a frozen dataclass whose
# fields carry `doc(...)` metadata, marked with `@section(...)` (sections.py), and named by the
# family (`Family.config_sections`) or the app (`App.section`) that reads it. The keys stay flat
# in the file and the environment (`ingest_limit`, LEASEWORK_INGEST_LIMIT), so a key names one
# setting of one section.
FIELDS: dict[str, dataclasses.Field[Any]] = {
    f.name: f for f in dataclasses.fields(Config) if not f.metadata.get("internal")
}


def section_fields(sections: Iterable[type]) -> dict[str, dataclasses.Field[Any]]:
    """The settings of `sections` by their flat key."""
    return {f.name: f for cls in sections for f in dataclasses.fields(cls)}


@functools.cache
def _section(cfg: Config, cls: type) -> Any:
    if not is_section(cls):
        raise TypeError(f"{cls.__qualname__} is not a settings section (declare it with @section)")
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in cfg.extra if k in names})
