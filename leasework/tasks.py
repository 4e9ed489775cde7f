"""What a task is, when a periodic one fires, what the stages may ask of the registry that holds
them, and the options every enqueue takes (declared once, `EnqueueOptions`) with the checks it
makes of them. The app, the stages and the families build on this module; it imports none of
them."""

from __future__ import annotations

import difflib
import math
import re
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Generic, Literal, Protocol, TypedDict, TypeVar, Unpack
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import psycopg
from cronsim import CronSim, CronSimError

from . import results
from .config import Config
from .encoding import check_json
from .errors import ConfigError, PayloadError, WrongConnection
from .text import MAX_LABEL, control_problem, label_problem

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
    """What `App.enqueue_run` did: the run's id, and whether it is a run of the key that was
    there already rather than a new one. `how`, when it is: "active" (the key's active run, or
    its waiting run for an exclusive enqueue), "window" (the key's run of a unique window, which
    may have finished), "debounced" (the key's pending run, which took this payload).
    `wait()` waits for the run's end (docs/workflows.md, "Waiting for a result")."""

    run_id: int
    existing: bool = False
    how: str | None = field(default=None, compare=False)
    # The connection it was enqueued on, weakly (`wait()` without one waits there).
    origin: weakref.ref[Any] | None = field(default=None, compare=False, repr=False)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled without its connection (a weak reference cannot be pickled)."""
        return (Enqueued, (self.run_id, self.existing, self.how))

    def bound(self, conn: Any) -> Enqueued:
        """This, remembering `conn` as the connection it was enqueued on."""
        return Enqueued(self.run_id, self.existing, self.how, weakref.ref(conn))

    def wait(self, conn: Any = None, *, timeout: float | None = None) -> Any:
        """Wait until the run ends and return its result, or raise `RunFailed` (`RunCancelled`,
        `RunPartial`: the run's status, error and result on it); `WaitTimeout` (a TimeoutError)
        after `timeout` seconds, the run left as it is. On `conn`, else on the connection the
        run was enqueued on, once its transaction committed (a connection still inside it is
        refused: the run cannot start before the commit). On a psycopg AsyncConnection it
        returns an awaitable: `await handle.wait(timeout=5)`. Woken by NOTIFY on a direct
        connection, polling (50 ms growing to 1 s) through a pooler."""
        if conn is None:
            conn = None if self.origin is None else self.origin()
            if conn is None:
                raise WrongConnection(
                    f"wait(): run {self.run_id}'s enqueue connection is unknown or gone: pass an "
                    "open connection, handle.wait(conn, timeout=...)"
                )
        if isinstance(conn, psycopg.AsyncConnection):
            return results.wait_async(conn, self.run_id, timeout)
        return results.wait(conn, self.run_id, timeout)


# merge(old_payload, new_payload) -> the payload of the key's debounced run: the stored one (as
# JSON decodes it) and the one being enqueued (as given). Called in the enqueuing process.
Merge = Callable[[Any, Any], Any]
WINDOW_OPTIONS = ("unique_for", "debounce", "debounce_max", "debounce_merge")


@dataclass(frozen=True)
class Windows:
    """An enqueue's unique window and debounce, each None when off. `unique_for`: an enqueue of
    a key whose window run was enqueued less than this many seconds ago, and did not end failed
    or cancelled, returns that run. `debounce`: an enqueue of a key whose debounced run of this
    kind is still pending gives it this payload (or `debounce_merge(old, new)`) and makes it due
    this many seconds from now, at the latest `debounce_max` after its first enqueue."""

    unique_for: float | None = None
    debounce: float | None = None
    debounce_max: float | None = None
    debounce_merge: Merge | None = None

    @property
    def any(self) -> bool:
        return self.unique_for is not None or self.debounce is not None

    def named(self) -> str:
        """The option in force, for an error line."""
        return "unique_for" if self.unique_for is not None else "debounce"


def json_type(value: Any) -> str:
    """The JSON type of a payload as Python holds it, for an error line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, list | tuple):
        return "array"
    return type(value).__name__


@dataclass(frozen=True)
class Accepts:
    """The payloads a task's handler can be called with (handles.accepts reads it from the
    handler's parameters). `spread`: its parameters after ctx are keyword-only, so the payload
    must be a JSON object, spread into them; else the payload is passed whole, and when it is
    annotated with a dataclass (`model`) a JSON object is turned into one, so its keys must fit
    the fields (any other JSON value is passed as it is). `required` keys must be there, no key
    beyond `required` and `optional` may be unless `extra` (`**kwargs`). Without `spread` or
    `model`, anything JSON is accepted. `declared()` is what the worker records in
    leasework.kinds, for leasework.enqueue's own check."""

    spread: bool = False
    model: str | None = None
    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    extra: bool = True

    @property
    def anything(self) -> bool:
        return not self.spread and self.model is None

    def takes(self) -> str:
        """What the handler takes, for an error line."""
        keys = [*self.required, *(f"{k} (optional)" for k in self.optional)]
        if self.extra:
            keys.append("any other key")
        listed = ", ".join(keys) or "no key"
        if self.spread:
            return f"keyword arguments: a JSON object with {listed}"
        if self.model is not None:
            return f"a {self.model}: a JSON object with {listed} (or another JSON value, passed as it is)"
        return "any JSON value"

    def problem(self, payload: Any) -> str | None:
        """What keeps `payload` (None: enqueued as {}) from binding to the handler, or None."""
        if self.anything:
            return None
        body = {} if payload is None else payload
        if not isinstance(body, Mapping):
            if self.spread:
                return f"the payload is a JSON {json_type(body)}, not an object"
            return None
        if not self.extra:  # first: a misspelt key is what went wrong, not the one it misses
            known = (*self.required, *self.optional)
            for key in body:
                if key not in known:
                    close = difflib.get_close_matches(str(key), known, n=1)
                    hint = f" (did you mean {close[0]!r}?)" if close else ""
                    return f"the payload has an unexpected key {str(key)!r}{hint}"
        missing = [k for k in self.required if k not in body]
        if missing:
            return f"the payload has no key {', '.join(map(repr, missing))}"
        return None

    def check(self, kind: str, payload: Any, where: str = "") -> None:
        """PayloadError, in one line naming the kind, what was wrong and what the handler
        takes, for a payload it cannot take; `where`: which payload (enqueue_many's)."""
        problem = self.problem(payload)
        if problem is not None:
            raise PayloadError(
                f"task {kind!r} cannot take this payload{where}: {problem}; its handler takes "
                f"{self.takes()}"
            )

    def declared(self) -> dict[str, Any]:
        """As leasework.kinds.accepts holds it (leasework.payload_problem reads it): `takes`
        is "any", "keywords" (an object, spread) or "fields" (an object's keys checked, any
        other JSON passed); `allowed` null with `extra`."""
        if self.anything:
            return {"takes": "any"}
        return {
            "takes": "keywords" if self.spread else "fields",
            "required": list(self.required),
            "allowed": None if self.extra else [*self.required, *self.optional],
            "describe": self.takes(),
        }


ANY = Accepts()


@dataclass(frozen=True)
class Task:
    """A registered kind, as `@app.task` records it (`app.tasks[kind]`): its handler and its
    settings, each None where the config's default applies."""

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
    # Its enqueues' unique window and debounce unless an enqueue says (Windows,
    # docs/flow-control.md).
    windows: Windows = field(default_factory=Windows)
    # Flow control across the fleet (docs/flow-control.md), as its workers declare it
    # (operations.declared_limits: max_running, group_limit, rate as [count, seconds], rate_per);
    # empty: none. An operator's `leasework limits set` wins over it until reset.
    limits: Mapping[str, Any] = field(default_factory=dict, hash=False)
    # The payloads its handler can be called with (checked at enqueue; declared by its workers in
    # leasework.kinds for leasework.enqueue's check).
    accepts: Accepts = ANY


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


# -- unique windows and debounce (docs/flow-control.md) -----------------------------------------


def check_windows(given: Mapping[str, Any], *, task: str | None = None) -> Windows:
    """The values of `given` (some of WINDOW_OPTIONS) checked one by one and together, in the
    order leasework.window_problem (schema.sql) checks them; ConfigError names the bad one.
    `task`: the kind whose defaults they are (named in the line)."""
    where = f"task {task!r}: " if task is not None else ""
    try:
        unique_for = check_seconds("unique_for", given.get("unique_for"), allow_zero=False)
        debounce = check_seconds("debounce", given.get("debounce"), allow_zero=False)
        debounce_max = check_seconds("debounce_max", given.get("debounce_max"), allow_zero=False)
    except ConfigError as exc:
        raise ConfigError(f"{where}{exc}") from None
    merge = given.get("debounce_merge")
    problem = None
    if debounce is None and debounce_max is not None:
        problem = "debounce_max needs debounce: it bounds how far enqueues postpone a debounced run"
    elif debounce is None and merge is not None:
        problem = "debounce_merge needs debounce: it merges the payloads a debounce coalesces"
    elif merge is not None and not callable(merge):
        problem = (
            "debounce_merge must be a function merge(old_payload, new_payload) -> payload, got "
            f"{_short(merge)}"
        )
    elif debounce is not None and debounce_max is not None and debounce_max < debounce:
        problem = f"debounce_max must be at least debounce ({debounce:g}), got {debounce_max:g}"
    elif unique_for is not None and debounce is not None:
        problem = (
            "unique_for and debounce cannot be combined: a unique window keeps the key's run as "
            "it is, a debounce changes it; give one of them"
        )
    if problem is not None:
        raise ConfigError(f"{where}{problem}")
    return Windows(unique_for, debounce, debounce_max, merge)


def enqueue_windows(given: Mapping[str, Any], task: Windows, kind: str) -> Windows:
    """The windows of one enqueue: the options it gives over its task's (`task`), checked. An
    enqueue that turns the task's debounce off (`debounce=None`) drops its debounce_max and
    debounce_merge too; one that gives unique_for to a debounced task (or debounce to one with a
    unique window) is refused unless it turns the other off."""
    if not any(name in given for name in WINDOW_OPTIONS):
        return task
    values: dict[str, Any] = {
        "unique_for": task.unique_for,
        "debounce": task.debounce,
        "debounce_max": task.debounce_max,
        "debounce_merge": task.debounce_merge,
    }
    if "debounce" in given and given["debounce"] is None:
        values["debounce_max"] = values["debounce_merge"] = None
    values.update({name: given[name] for name in WINDOW_OPTIONS if name in given})
    try:
        return check_windows(values)
    except ConfigError as exc:
        inherited = any(
            name not in given and getattr(task, name) is not None for name in WINDOW_OPTIONS
        )
        if inherited:  # part of the clash is the task's: say so
            raise ConfigError(f"{exc} (task {kind!r} has {_describe_windows(task)})") from None
        raise


def _describe_windows(w: Windows) -> str:
    parts = [
        f"{name}={getattr(w, name):g}"
        for name in ("unique_for", "debounce", "debounce_max")
        if getattr(w, name) is not None
    ]
    return ", ".join(parts)


def check_windows_fit(
    w: Windows,
    *,
    keyed: bool,
    exclusive: bool,
    delay: float,
    kind: str,
    give: str = "key=...",
    task: Windows | None = None,
) -> None:
    """What an enqueue's windows need of its other options: a key (`keyed`; `give`: what to
    pass), not exclusive, no delay with a debounce (leasework.window_problem's last rules).
    `task`: the kind's own windows, named in the line when the option in force is the task's."""
    if not w.any:
        return
    name = w.named()
    if not keyed:
        if task is not None and getattr(task, name) == getattr(w, name):
            how = f"task {kind!r} has {name}={getattr(w, name):g}: enqueue it with {give}"
            how += f", or {name}=None"
        else:
            how = f"enqueue {kind!r} with {give}"
        raise ConfigError(
            f"{name} needs a key: it applies to the runs of one key in its tenant ({how})"
        )
    if exclusive:
        raise ConfigError(
            f"exclusive cannot be combined with {name}: an exclusive run waits for its key "
            "whatever came before it"
        )
    if w.debounce is not None and delay:
        raise ConfigError(
            "delay cannot be combined with debounce: a debounced run is due debounce seconds "
            "after its last enqueue"
        )


# -- the enqueue options: declared here once, taken by every enqueue as `**options` -------------


class _KeyOption(TypedDict, total=False):
    # At most one active run per key in its tenant (Client.enqueue).
    key: str | None


class _RunOptions(TypedDict, total=False):
    tenant: str | None
    group: str | None
    max_attempts: int | None  # None: the task's, else the configured default


class _TagOptions(TypedDict, total=False):
    # Labels for operators' searches (`leasework runs --tag T`, docs/operations.md, "Search,
    # tags and bulk actions"): at most MAX_TAGS, each a label (check_tags); stored distinct and
    # sorted.
    tags: Sequence[str] | None


class _OrderOptions(TypedDict, total=False):
    priority: int  # lower runs first
    delay: float  # seconds before the run is due


class _WindowOptions(TypedDict, total=False):
    # Unique windows and debounce (Windows; docs/flow-control.md): each needs a key. Not given:
    # the task's (`@app.task(kind, unique_for=...)`, KindDefaults); None: off for this enqueue.
    unique_for: float | None  # seconds: one run per key in that window, finished runs counted
    debounce: float | None  # seconds: coalesce into the key's pending run, due this long after
    debounce_max: float | None  # seconds after its first enqueue a debounced run is due at most
    debounce_merge: Merge | None  # merge(old, new) payloads, in place of replacing the old one


class _DepOptions(TypedDict, total=False):
    # Dependencies (docs/workflows.md): the run waits (`blocked`) until every run in `after` has
    # ended; a parent that ended `failed` or `cancelled` then cancels it (on_parent_failure
    # "cancel", the default) or not ("run"); a parent given as After(run, on_failure) has a policy
    # of its own. No key, exclusive, unique_for or debounce with it.
    after: Sequence[ParentRef] | None
    on_parent_failure: str | None


class EnqueueOptions(
    _KeyOption, _RunOptions, _TagOptions, _OrderOptions, _WindowOptions, _DepOptions, total=False
):
    """The options of an enqueue of one run (`Client.enqueue` and its variants, a task's
    `.configure`, `Family.enqueue`); their defaults are `Options`' (the windows': the task's)."""

    exclusive: bool  # wait while the key is busy rather than return its run


class ManyOptions(
    _RunOptions, _TagOptions, _OrderOptions, _WindowOptions, _DepOptions, total=False
):
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
    tags: list[str] | None = None


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
    if not given:
        return NO_OPTIONS  # every default passes its check: nothing to look at

    default = NO_OPTIONS

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
        tags=check_tags(get("tags")),
    )


# An enqueue that gives no option (the usual one, and a run's pickup latency counts the Python
# of its enqueue: bench/README.md, issue 30, fourth pass).
NO_OPTIONS = Options()

MAX_TAGS = 20  # leasework.tags_problem's bound too


def check_tags(value: object) -> list[str] | None:
    """An enqueue's tags: None, or a list (tuple, set) of at most MAX_TAGS labels, each as a key
    is (check_label: 1-200 characters, no control, bidi control or line separator); returned
    distinct and sorted, as stored (None for an empty list). A refused tag is named by its place,
    in the words of leasework.tags_problem (schema.sql)."""
    if value is None:
        return None
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise ConfigError(f"tags must be a list of strings, got {_short(value)}")
    tags = list(value)
    if len(tags) > MAX_TAGS:
        raise ConfigError(f"tags: at most {MAX_TAGS} per run, got {len(tags)}")
    for n, tag in enumerate(tags, start=1):
        if not isinstance(tag, str):
            raise ConfigError(f"tag {n} of {len(tags)} must be a string, got {_short(tag)}")
        problem = label_problem(tag)
        if problem is not None:
            raise ConfigError(f"tag {n} of {len(tags)} {problem}")
    return sorted(set(tags)) or None


# "batch": run anyway, the parents counted as the members of the batch whose callback this is
# (what app.batch gives its callback; docs/workflows.md).
ON_PARENT_FAILURE = ("cancel", "run", "batch")

# A dependency's own policy (After.on_failure; leasework.set_dependency_policy in SQL).
Policy = Literal["cancel", "run"]
POLICIES: tuple[Policy, ...] = ("cancel", "run")

T_co = TypeVar("T_co", covariant=True)


@dataclass(frozen=True)
class After(Generic[T_co]):
    """One parent with a policy of its own (docs/workflows.md, "A policy per dependency"):
    `after=[fetched, After(mirrored, on_failure="run")]` waits for both, and is cancelled if
    `fetched` fails or is cancelled, but runs whatever `mirrored`'s end. `parent`: a run id, or
    anything with an int `run_id` (an Enqueued); in a workflow, a node or a group. `on_failure`:
    what the parent's end `failed` or `cancelled` means for this run, "cancel" or "run"; the
    parents given without one follow the run's `on_parent_failure`."""

    parent: T_co
    on_failure: Policy


# What `after` takes: run ids, handles (Enqueued), and either with a policy of its own.
ParentRef = int | Enqueued | After[int] | After[Enqueued]


@dataclass(frozen=True)
class Dependencies:
    """The dependency options as checked (check_after): the parents' ids, or None (no
    dependency), the policy when a parent fails or is cancelled (None: "cancel"), and `policies`:
    the parents whose own policy (After) differs from that, (parent, policy) in order, each once."""

    parents: list[int] | None = None
    on_parent_failure: str | None = None
    policies: tuple[tuple[int, Policy], ...] = ()


NO_DEPENDENCIES = Dependencies()


def check_after(given: Mapping[str, Any]) -> Dependencies:
    """`after` and `on_parent_failure` checked: a list of run ids (an int each, or anything with
    an int `run_id`, such as Enqueued, each maybe in an After with its own policy), and "cancel"
    or "run"; ConfigError names a bad one."""
    after = given.get("after")
    policy = given.get("on_parent_failure")
    if policy is not None and policy not in ON_PARENT_FAILURE:
        raise ConfigError(
            f"on_parent_failure must be 'cancel', 'run' or 'batch', got {policy!r}"
        )
    if after is None:
        if policy is not None:
            raise ConfigError("on_parent_failure needs after: the runs this run waits for")
        return NO_DEPENDENCIES
    if isinstance(after, str | bytes | int | After) or not isinstance(after, Iterable):
        raise ConfigError(f"after must be a list of run ids, got {type(after).__name__}")
    default: Policy = "run" if policy in ("run", "batch") else "cancel"
    parents: list[int] = []
    chosen: dict[int, Policy] = {}  # each parent's policy: its After's, else the run's
    for item in after:
        edge = default
        if isinstance(item, After):
            if policy == "batch":
                raise ConfigError(
                    "after cannot give a parent a policy of its own (After) with "
                    "on_parent_failure='batch': every parent of a batch's callback is a member"
                )
            edge = check_policy(item)
            item = item.parent
        run_id = getattr(item, "run_id", item)
        if isinstance(run_id, bool) or not isinstance(run_id, int) or not 1 <= run_id < 2**63:
            raise ConfigError(f"after must be a list of run ids (positive integers), got {item!r}")
        parents.append(run_id)
        if chosen.setdefault(run_id, edge) != edge:
            raise ConfigError(
                f"after gives run {run_id} two policies, {chosen[run_id]!r} and {edge!r} (a "
                "parent without After has the run's on_parent_failure): name each parent once"
            )
    if len(parents) > AFTER_MAX:
        raise ConfigError(f"after takes at most {AFTER_MAX} run ids, got {len(parents)}")
    policies = tuple((p, edge) for p, edge in chosen.items() if edge != default)
    return Dependencies(parents, policy, policies)


def check_policy(after: After[Any]) -> Policy:
    """An After's `on_failure` checked: "cancel" or "run"."""
    if after.on_failure not in POLICIES:
        raise ConfigError(
            f"After(..., on_failure=) must be 'cancel' or 'run', got {after.on_failure!r}"
        )
    return after.on_failure


AFTER_MAX = 10_000  # leasework.enqueue_blocked's bound too


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
