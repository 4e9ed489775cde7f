"""Enqueue and cancel runs, with or without the handlers: `Client` checks what it is given and
sends the statements of runs.sql (one call of leasework.enqueue per run, COPY for many), on a
psycopg Connection or, awaited, an AsyncConnection. The App is a Client that also knows its
kinds. Imports no handler, no stage and no worker: a web process enqueues with it alone."""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Unpack

import psycopg
from psycopg.types.json import Jsonb

from . import results, tracing
from .config import Config
from .errors import ConfigError, LeaseworkError, NotFound, WrongConnection
from .queries import load
from .tasks import (
    ANY,
    DEFAULT_TIMEOUT,
    Accepts,
    Dependencies,
    Enqueued,
    EnqueueOptions,
    ManyOptions,
    Merge,
    Windows,
    accept_options,
    check_after,
    check_attempts,
    check_key,
    check_kind,
    check_options,
    check_seconds,
    check_windows,
    check_windows_fit,
    encode_payload,
    enqueue_windows,
)

Q = load("leasework", "runs.sql")
Conn = psycopg.Connection[Any]
AConn = psycopg.AsyncConnection[Any]


def _copy_many() -> str:
    """The COPY of enqueue_many without keys (rows of _Many.copy_rows, ids drawn beforehand)."""
    return (
        'COPY leasework.runs (id, kind, tenant, "group", priority, payload, max_attempts, '
        "lease_seconds, timeout_seconds, queued_at, tags) FROM STDIN"
    )


__all__ = ["Client", "KindDefaults"]


@dataclass(frozen=True)
class KindDefaults:
    """What a run of a kind gets unless the enqueue says: None for max_attempts is the
    configured default, None for lease is the worker's lease, None for timeout is none; the
    unique window and debounce of its enqueues (tasks.Windows; None: off)."""

    max_attempts: int | None = None
    lease: float | None = None
    timeout: float | None = DEFAULT_TIMEOUT
    unique_for: float | None = None
    debounce: float | None = None
    debounce_max: float | None = None
    debounce_merge: Merge | None = None

    @property
    def windows(self) -> Windows:
        return Windows(self.unique_for, self.debounce, self.debounce_max, self.debounce_merge)


# How many times a debounce_merge reads and merges again when the key's pending run changed
# under it (claimed, or merged into by a racing enqueue) before it gives up.
MERGE_TRIES = 20

# The second half of a debounce_merge when none was pending (leasework.enqueue's merge_into).
NONE_PENDING = 0


@dataclass(frozen=True)
class _One:
    """A checked enqueue of one run: the parameters of enqueue_run, and for a debounce_merge the
    merge function and the payload as given (merged with the pending one before it is sent)."""

    params: dict[str, Any]
    merge: Merge | None = None
    body: Any = None


@dataclass(frozen=True)
class _Many:
    """A checked enqueue_many: the columns every row shares, the payloads encoded, the keys."""

    common: dict[str, Any]
    encoded: list[bytes]
    keys: list[str | None] | None
    windows: Windows
    payloads: Sequence[Any]  # as given (a debounce_merge merges these)
    # What each payload's run waits for (docs/workflows.md).
    after: Dependencies = field(default_factory=Dependencies)

    def keyed_params(self) -> dict[str, Any]:
        return {**self.common, "payloads": [p.decode() for p in self.encoded], "keys": self.keys}

    def ones(self, client: Client) -> Iterator[_One]:
        """Each payload as an enqueue of one run (a debounce_merge merges one at a time)."""
        assert self.keys is not None
        c = self.common
        for payload, key in zip(self.payloads, self.keys, strict=True):
            body = payload if payload is not None else {}
            params = {
                **c,
                "key": key,
                "exclusive": False,
                "payload": Jsonb(body, dumps=client._dumps),
                "merge_into": None,
                "merge_seen": None,
            }
            yield _One(params, self.windows.debounce_merge, body)

    def waiting(self, client: Client) -> Iterator[_One]:
        """Each payload as an enqueue of one run that waits for `after` (enqueue_after)."""
        for payload in self.payloads:
            body = payload if payload is not None else {}
            params = {
                **self.common,
                "key": None,
                "exclusive": False,
                "payload": Jsonb(body, dumps=client._dumps),
                "merge_into": None,
                "merge_seen": None,
                **_dependency_params(self.after),
            }
            yield _One(params)

    def copy_rows(self, ids: Sequence[int], due: Any) -> Iterator[tuple[Any, ...]]:
        c = self.common
        for run_id, payload in zip(ids, self.encoded, strict=True):
            yield (
                run_id,
                c["kind"],
                c["tenant"],
                c["group"],
                c["priority"],
                payload.decode(),
                c["max_attempts"],
                c["lease"],
                c["timeout"],
                due,
                c["tags"],
            )


def sync_connection(conn: object, method: str) -> Conn:
    """`conn` if it is a psycopg Connection; otherwise one line saying what to pass instead."""
    if isinstance(conn, psycopg.Connection):
        return conn
    if isinstance(conn, psycopg.AsyncConnection):
        raise WrongConnection(
            f"{method}() got a psycopg.AsyncConnection: use `await {method}_async(conn, ...)`, "
            "or pass a psycopg.Connection"
        )
    raise WrongConnection(
        f"{method}() needs a psycopg.Connection, got {type(conn).__module__}."
        f"{type(conn).__qualname__}"
    )


def async_connection(conn: object, method: str) -> AConn:
    """`conn` if it is a psycopg AsyncConnection; otherwise one line saying what to pass."""
    if isinstance(conn, psycopg.AsyncConnection):
        return conn
    plain = method.removesuffix("_async")
    if isinstance(conn, psycopg.Connection):
        raise WrongConnection(
            f"{method}() got a psycopg.Connection (not async): call {plain}(conn, ...) without "
            "await, or pass a psycopg.AsyncConnection"
        )
    raise WrongConnection(
        f"{method}() needs a psycopg.AsyncConnection, got {type(conn).__module__}."
        f"{type(conn).__qualname__}"
    )


# leasework.enqueued_existing (runs.sql, enqueue_run) as Enqueued.how.
_HOW = {"true": "active", "window": "window", "debounced": "debounced"}


def _enqueued(row: Any) -> Enqueued:
    if row is None or row[0] is None:
        raise LeaseworkError("enqueue inserted nothing")  # leasework.enqueue always returns
    how = _HOW.get(str(row[1]))
    return Enqueued(int(row[0]), existing=how is not None, how=how)


Step = tuple[Any, dict[str, Any]]  # a statement of runs.sql and its parameters


def _merged(client: Client, one: _One) -> Generator[Step, Any, Enqueued]:
    """A debounce_merge as the statements it sends, each answered with its first row (None: no
    row): read the key's pending debounced run (locked, leasework.debounce_pending), merge, and
    hand the merge to leasework.enqueue, which writes it only if that run is still pending as it
    was read (else it returns no id, and this reads and merges again). Without a transaction of
    the caller's the lock ends with each statement; the check of what was read still holds.
    One generator for the sync and the awaited path."""
    p = one.params
    assert one.merge is not None
    where = {"kind": p["kind"], "key": p["key"], "tenant": p["tenant"]}
    for _ in range(MERGE_TRIES):
        pending = yield Q["debounce_pending"], where
        if pending is None:
            send = {**p, "merge_into": NONE_PENDING, "merge_seen": None}
        else:
            run_id, old, seen = pending
            merged = one.merge(old, one.body)
            client._dumps(merged)  # refused (too large, not JSON) before anything is written
            client.accepts(p["kind"]).check(p["kind"], merged, " (the debounce_merge's)")
            send = {
                **p,
                "payload": Jsonb(merged, dumps=client._dumps),
                "merge_into": run_id,
                "merge_seen": seen,
            }
        row = yield Q["enqueue_run"], send
        if row is not None and row[0] is not None:
            return _enqueued(row)
    raise LeaseworkError(
        f"could not debounce key {p['key']!r}: its pending run kept changing ({MERGE_TRIES} tries)"
    )


class _Plain:
    """An enqueue of a kind without options, checked once: the parameters that do not depend on
    the payload (kind, max_attempts, lease, timeout, the rest at their defaults), reused while
    what they were made from holds (the kind's defaults, the configuration). Every payload is
    still checked (the handler's Accepts) and encoded: only the checks of the options, which
    were all at their defaults, are not made again. A run's pickup latency counts the Python of
    its enqueue, which after an idle pause runs many times slower than in a loop (bench/README.md,
    issue 30, fourth pass)."""

    __slots__ = ("config", "params", "source")

    def __init__(self, source: object, config: Config, params: dict[str, Any]) -> None:
        self.source = source
        self.config = config
        self.params = {name: value for name, value in params.items() if name != "payload"}

    def holds(self, source: object, config: Config) -> bool:
        return source is self.source and config is self.config

    def one(self, client: Client, kind: str, payload: Any) -> _One:
        body = payload if payload is not None else {}
        client.accepts(kind).check(kind, body)
        params = {**self.params, "payload": Jsonb(body, dumps=_Encoded(client._dumps(body)))}
        return _One(params, None, body)


class _Encoded:
    """A Jsonb parameter's `dumps` that gives the payload as it was encoded and checked already
    (Client._dumps), whatever it is asked to encode."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __call__(self, obj: Any) -> bytes:
        return self.data


def _statement(one: _One) -> bytes:
    """enqueue_run, or enqueue_after for a run that waits for others (enqueue_after_policies when
    some parent has a policy of its own): a run without them sends the statement it always
    sent."""
    if "edge_parents" in one.params:
        return Q["enqueue_after_policies"]
    return Q["enqueue_after"] if "after" in one.params else Q["enqueue_run"]


def _dependency_params(after: Dependencies) -> dict[str, Any]:
    """The parameters of enqueue_after (and, with policies of their own, of
    enqueue_after_policies) for a run that waits for `after.parents`."""
    params: dict[str, Any] = {
        "after": after.parents,
        "on_parent_failure": after.on_parent_failure,
    }
    if after.policies:
        params["edge_parents"] = [p for p, _ in after.policies]
        params["edge_policies"] = [policy for _, policy in after.policies]
    return params


def _check_run_id(run_id: object) -> int:
    if isinstance(run_id, bool) or not isinstance(run_id, int) or not 1 <= run_id < 2**63:
        raise ConfigError(f"run id must be a positive 64-bit integer, got {run_id!r}")
    return run_id


def _cancelled(row: Any, run_id: int) -> str:
    if row is None or row[0] is None:
        raise NotFound(f"no run with id {run_id}")
    return str(row[0])


class Client:
    """Enqueue and cancel by kind, inside the caller's transaction, without the handlers: for a
    web process that must not import the worker's modules. A kind is checked for its form only
    (the worker that claims it knows it; a kind no worker knows ends `failed`, docs/enqueue.md,
    "Typed enqueue, and enqueue without the handlers"); its runs get `max_attempts` from the
    configuration unless given, the worker's lease and a one-hour timeout. `App` is a Client
    that knows its kinds and their settings, and refuses any other kind."""

    def __init__(
        self, config: Config | None = None, *, kinds: Mapping[str, KindDefaults] | None = None
    ) -> None:
        """`kinds`: the settings of the tasks this client enqueues, where they are not the
        defaults (`{"reports.send": KindDefaults(max_attempts=5, timeout=600)}`), so that a
        process without the handlers still gives their runs the task's attempts, lease and
        timeout."""
        self.config = config or Config()
        self.kind_defaults: dict[str, KindDefaults] = {}
        # Per kind: the parameters of its last enqueue without options (_Plain).
        self._plain: dict[str, _Plain] = {}
        for kind, given in (kinds or {}).items():
            if not isinstance(given, KindDefaults):
                raise ConfigError(
                    f"kinds[{kind!r}] must be a KindDefaults(max_attempts=, lease=, timeout=), "
                    f"got {type(given).__name__}"
                )
            check_kind(kind)
            check_attempts(given.max_attempts)
            if given.lease is not None:
                check_seconds("lease", given.lease, allow_zero=False)
            if given.timeout is not None:
                check_seconds("timeout", given.timeout, allow_zero=False)
            check_windows(
                {
                    "unique_for": given.unique_for,
                    "debounce": given.debounce,
                    "debounce_max": given.debounce_max,
                    "debounce_merge": given.debounce_merge,
                },
                task=kind,
            )
            self.kind_defaults[kind] = given

    def defaults(self, kind: str) -> KindDefaults:
        """What a run of `kind` gets unless the enqueue says; raises for a kind refused here."""
        check_kind(kind)
        return self.kind_defaults.get(kind, KindDefaults())

    def accepts(self, kind: str) -> Accepts:
        """The payloads a run of `kind` may carry: anything JSON for a Client, which knows no
        handler (leasework.enqueue still checks what the kind's workers declared); the handler's
        parameters for an App (App.accepts)."""
        return ANY

    # -- checks (shared by the sync and async paths; nothing is sent before they pass) ---------

    def _dumps(self, obj: Any) -> bytes:
        return encode_payload(obj, self.config.payload_max_bytes)

    def _defaults_source(self, kind: str) -> object:
        """What `defaults(kind)` is made from (App: the registered Task, immutable): an enqueue
        without options reuses the parameters it made last for `kind` while this is the same
        object and the configuration too (_Plain)."""
        return self.kind_defaults.get(kind)

    def _one(
        self, kind: str, payload: Any, options: EnqueueOptions, *, reserved: bool = False
    ) -> _One:
        """The parameters of enqueue_run (runs.sql), every argument checked; `reserved`: the key
        may be under RESERVED_KEY_PREFIX (a family's own run, enqueue_reserved)."""
        if not options and isinstance(kind, str):
            plain = self._plain.get(kind)
            if plain is not None and plain.holds(self._defaults_source(kind), self.config):
                return plain.one(self, kind, payload)
        defaults = self.defaults(kind)
        body = payload if payload is not None else {}
        opts = check_options(options, reserved=reserved)
        windows = enqueue_windows(options, defaults.windows, kind)
        check_windows_fit(
            windows,
            keyed=opts.key is not None,
            exclusive=opts.exclusive,
            delay=opts.delay,
            kind=kind,
            task=defaults.windows,
        )
        self.accepts(kind).check(kind, body)
        after = check_after(options)
        if after.parents is not None and (opts.key is not None or opts.exclusive or windows.any):
            raise ConfigError(
                "after cannot be combined with key, exclusive, unique_for or debounce: a run "
                f"that waits for other runs holds no key (enqueue {kind!r} without them)"
            )
        params: dict[str, Any] = {
            "kind": kind,
            "key": opts.key,
            "tenant": opts.tenant,
            "group": opts.group,
            "exclusive": opts.exclusive,
            "priority": opts.priority,
            # Encoded once, here, where a payload that cannot be stored is refused before
            # anything is sent; the parameter hands those bytes on.
            "payload": Jsonb(body, dumps=_Encoded(self._dumps(body))),
            "max_attempts": opts.max_attempts or defaults.max_attempts or self.config.max_attempts,
            "lease": defaults.lease,
            "timeout": defaults.timeout,
            "delay": opts.delay,
            "unique_for": windows.unique_for,
            "debounce": windows.debounce,
            "debounce_max": windows.debounce_max,
            "merge_into": None,
            "merge_seen": None,
            "tags": opts.tags,
        }
        if after.parents is not None:  # the statement of a run that waits (enqueue_after)
            params.update(_dependency_params(after))
        if not options and not windows.any and isinstance(kind, str):
            self._plain[kind] = _Plain(self._defaults_source(kind), self.config, params)
        return _One(params, windows.debounce_merge, body)

    def _many(self, kind: str, payloads: Iterable[Any], options: ManyOptions) -> _Many:
        defaults = self.defaults(kind)
        given = list(payloads)
        accepts = self.accepts(kind)
        if not accepts.anything:
            for i, p in enumerate(given):
                accepts.check(kind, p, f" (payload {i})")
        encoded = [self._dumps(p if p is not None else {}) for p in given]
        keys = options.get("keys")
        checked_keys: list[str | None] | None = None
        if keys is not None:
            if isinstance(keys, str | bytes) or not isinstance(keys, Sequence):
                raise ConfigError(
                    f"keys must be a list of strings (or None), one per payload, got "
                    f"{type(keys).__name__}"
                )
            if len(keys) != len(encoded):
                raise ConfigError(f"enqueue_many got {len(encoded)} payloads but {len(keys)} keys")
            checked_keys = [check_key(k) for k in keys]
        opts = check_options(options)
        windows = enqueue_windows(options, defaults.windows, kind)
        if windows.any:
            keyless = [i for i, k in enumerate(checked_keys or [None] * len(encoded)) if k is None]
            check_windows_fit(
                windows,
                keyed=not keyless,
                exclusive=False,
                delay=opts.delay,
                kind=kind,
                give=(
                    "keys=[...], one for every payload"
                    if checked_keys is None
                    else f"a key for every payload: payload {keyless[0]} has none"
                )
                if keyless
                else "",
                task=defaults.windows,
            )
        after = check_after(options)
        if after.parents is not None and (any(k is not None for k in keys or ()) or windows.any):
            raise ConfigError(
                "after cannot be combined with keys, unique_for or debounce: a run that waits "
                f"for other runs holds no key (enqueue {kind!r} without them)"
            )
        common = {
            "kind": kind,
            "tenant": opts.tenant,
            "group": opts.group,
            "priority": opts.priority,
            "max_attempts": opts.max_attempts or defaults.max_attempts or self.config.max_attempts,
            "lease": defaults.lease,
            "timeout": defaults.timeout,
            "delay": opts.delay,
            "unique_for": windows.unique_for,
            "debounce": windows.debounce,
            "debounce_max": windows.debounce_max,
            "tags": opts.tags,
        }
        return _Many(common, encoded, checked_keys, windows, given, after)

    # -- enqueue --------------------------------------------------------------------------------

    def enqueue(
        self,
        conn: Conn,
        kind: str,
        payload: Any = None,
        **options: Unpack[EnqueueOptions],
    ) -> int:
        """Enqueue a run inside the caller's transaction and return its id.

        With a `key`, at most one run per key is active (queued or running) in its `tenant` (runs
        without a tenant are a namespace of their own): a second enqueue returns the existing
        run's id. An `exclusive` run whose key is busy waits and is promoted once the key is
        idle; a second one returns the waiting run's id. A key under "leasework:" is refused
        (the families' own keys). `enqueue_run` takes the same arguments and also says which of
        the two happened.
        """
        accept_options("enqueue", options, EnqueueOptions)
        c = sync_connection(conn, "enqueue")
        return self._send(c, self._one(kind, payload, options)).run_id

    def enqueue_run(
        self,
        conn: Conn,
        kind: str,
        payload: Any = None,
        **options: Unpack[EnqueueOptions],
    ) -> Enqueued:
        """`enqueue`, returning Enqueued(run_id, existing): `existing` is True when the key
        already had an active (or, for an exclusive run, a waiting) run, whose id it is."""
        accept_options("enqueue_run", options, EnqueueOptions)
        c = sync_connection(conn, "enqueue_run")
        return self._send(c, self._one(kind, payload, options)).bound(c)

    def _send(self, c: Conn, one: _One) -> Enqueued:
        """enqueue_run, or the statements of a debounce_merge (_merged), on `c`; then, when the
        caller is in a span (tracing, docs/operations.md, "Tracing"), its traceparent into a new run."""
        if one.merge is None:
            done = _enqueued(c.execute(_statement(one), one.params).fetchone())
        else:
            steps = _merged(self, one)
            query, params = next(steps)
            while True:
                row = c.execute(query, params).fetchone()
                try:
                    query, params = steps.send(row)
                except StopIteration as stop:
                    done = stop.value
                    break
        if tracing.AVAILABLE and not done.existing:
            parent = tracing.traceparent()
            if parent is not None:
                c.execute(Q["trace_run"], {"id": done.run_id, "traceparent": parent})
        return done

    async def _send_async(self, c: AConn, one: _One) -> Enqueued:
        """`_send` on an AsyncConnection: the same statements, awaited."""
        if one.merge is None:
            cur = await c.execute(_statement(one), one.params)
            done = _enqueued(await cur.fetchone())
        else:
            steps = _merged(self, one)
            query, params = next(steps)
            while True:
                row = await (await c.execute(query, params)).fetchone()
                try:
                    query, params = steps.send(row)
                except StopIteration as stop:
                    done = stop.value
                    break
        if tracing.AVAILABLE and not done.existing:
            parent = tracing.traceparent()
            if parent is not None:
                await c.execute(Q["trace_run"], {"id": done.run_id, "traceparent": parent})
        return done

    def enqueue_reserved(
        self,
        conn: Conn,
        kind: str,
        payload: Any = None,
        **options: Unpack[EnqueueOptions],
    ) -> int:
        """`enqueue` for a family's own runs (Family.enqueue): `key` may also be under
        RESERVED_KEY_PREFIX ("leasework:"), which `enqueue` refuses, so that no application key
        can hold or take it. leasework.enqueue accepts such a key only from a role that may
        write leasework.runs itself (the worker role, the owner), not from the enqueue role."""
        accept_options("enqueue_reserved", options, EnqueueOptions)
        c = sync_connection(conn, "enqueue_reserved")
        return self._send(c, self._one(kind, payload, options, reserved=True)).run_id

    async def enqueue_async(
        self,
        conn: AConn,
        kind: str,
        payload: Any = None,
        **options: Unpack[EnqueueOptions],
    ) -> int:
        """`enqueue` on a psycopg AsyncConnection, inside its transaction."""
        accept_options("enqueue_async", options, EnqueueOptions)
        c = async_connection(conn, "enqueue_async")
        done = await self._send_async(c, self._one(kind, payload, options))
        return done.run_id

    async def enqueue_run_async(
        self,
        conn: AConn,
        kind: str,
        payload: Any = None,
        **options: Unpack[EnqueueOptions],
    ) -> Enqueued:
        """`enqueue_run` on a psycopg AsyncConnection."""
        accept_options("enqueue_run_async", options, EnqueueOptions)
        c = async_connection(conn, "enqueue_run_async")
        done = await self._send_async(c, self._one(kind, payload, options))
        return done.bound(c)

    def enqueue_many(
        self,
        conn: Conn,
        kind: str,
        payloads: Iterable[Any],
        **options: Unpack[ManyOptions],
    ) -> list[int]:
        """Enqueue many runs of one kind in one statement, inside the caller's transaction.

        Without `keys` the rows are streamed with COPY. With `keys` (one per payload, None for
        no key) a payload whose key already has an active run in `tenant` is skipped, as
        `enqueue` would;
        the ids returned are those of the rows actually inserted, in payload order.
        """
        accept_options("enqueue_many", options, ManyOptions)
        c = sync_connection(conn, "enqueue_many")
        many = self._many(kind, payloads, options)
        if not many.encoded:
            return []
        if many.after.parents is not None:
            return [self._send(c, one).run_id for one in many.waiting(self)]
        if many.windows.any:
            return self._trace_many(c, self._each(c, many))
        if many.common["tenant"] is not None:
            c.execute(Q["ensure_tenant"], {"tenant": many.common["tenant"]})
        if many.keys is not None:
            ids = [int(r[0]) for r in c.execute(Q["enqueue_many"], many.keyed_params())]
        else:
            # COPY the rows in with ids drawn from the sequence first, so they can be returned.
            ids = [int(r[0]) for r in c.execute(Q["reserve_ids"], {"n": len(many.encoded)})]
            due = c.execute(Q["due_at"], {"delay": many.common["delay"]}).fetchone()
            assert due is not None
            with c.cursor().copy(_copy_many()) as copy:
                for row in many.copy_rows(ids, due[0]):
                    copy.write_row(row)
        c.execute(Q["notify"], {"kind": kind})
        return self._trace_many(c, ids)

    @staticmethod
    def _trace_many(c: Conn, ids: list[int]) -> list[int]:
        """The runs `enqueue_many` made, given the caller's traceparent when it is in a span
        (docs/operations.md, "Tracing"): one statement more then, none otherwise."""
        parent = tracing.traceparent() if tracing.AVAILABLE and ids else None
        if parent is not None:
            c.execute(Q["trace_runs"], {"ids": ids, "traceparent": parent})
        return ids

    async def enqueue_many_async(
        self,
        conn: AConn,
        kind: str,
        payloads: Iterable[Any],
        **options: Unpack[ManyOptions],
    ) -> list[int]:
        """`enqueue_many` on a psycopg AsyncConnection (the same statements, awaited)."""
        accept_options("enqueue_many_async", options, ManyOptions)
        c = async_connection(conn, "enqueue_many_async")
        many = self._many(kind, payloads, options)
        if not many.encoded:
            return []
        if many.after.parents is not None:
            return [(await self._send_async(c, one)).run_id for one in many.waiting(self)]
        if many.windows.any:
            return await self._trace_many_async(c, await self._each_async(c, many))
        if many.common["tenant"] is not None:
            await c.execute(Q["ensure_tenant"], {"tenant": many.common["tenant"]})
        if many.keys is not None:
            cur = await c.execute(Q["enqueue_many"], many.keyed_params())
            ids = [int(r[0]) for r in await cur.fetchall()]
        else:
            cur = await c.execute(Q["reserve_ids"], {"n": len(many.encoded)})
            ids = [int(r[0]) for r in await cur.fetchall()]
            due = await (await c.execute(Q["due_at"], {"delay": many.common["delay"]})).fetchone()
            assert due is not None
            async with c.cursor().copy(_copy_many()) as copy:
                for row in many.copy_rows(ids, due[0]):
                    await copy.write_row(row)
        await c.execute(Q["notify"], {"kind": kind})
        return await self._trace_many_async(c, ids)

    @staticmethod
    async def _trace_many_async(c: AConn, ids: list[int]) -> list[int]:
        """`_trace_many` on an AsyncConnection."""
        parent = tracing.traceparent() if tracing.AVAILABLE and ids else None
        if parent is not None:
            await c.execute(Q["trace_runs"], {"ids": ids, "traceparent": parent})
        return ids

    def _each(self, c: Conn, many: _Many) -> list[int]:
        """enqueue_many with a unique window or a debounce: leasework.enqueue per payload (one
        statement, enqueue_each; a debounce_merge one payload at a time), the ids of the runs
        made, in payload order (a payload absorbed by a window or merged into a pending run is
        no new run, as one whose key is active is not)."""
        if many.windows.debounce_merge is None:
            rows = c.execute(Q["enqueue_each"], many.keyed_params()).fetchall()
            done = [_enqueued(r) for r in rows]
        else:
            done = [self._send(c, one) for one in many.ones(self)]
        return [d.run_id for d in done if not d.existing]

    async def _each_async(self, c: AConn, many: _Many) -> list[int]:
        """`_each` on an AsyncConnection."""
        if many.windows.debounce_merge is None:
            cur = await c.execute(Q["enqueue_each"], many.keyed_params())
            done = [_enqueued(r) for r in await cur.fetchall()]
        else:
            done = [await self._send_async(c, one) for one in many.ones(self)]
        return [d.run_id for d in done if not d.existing]

    # -- cancel ---------------------------------------------------------------------------------

    def cancel(self, conn: Conn, run_id: int) -> str:
        """Cancel a run. Queued or waiting: `cancelled` now. Running: the cancel is requested
        and its worker stops at its next control check; returns `running`. Finished: its final
        status, unchanged."""
        c = sync_connection(conn, "cancel")
        run_id = _check_run_id(run_id)
        return _cancelled(c.execute(Q["cancel_run"], {"id": run_id}).fetchone(), run_id)

    # -- waiting for a run's end (results.py; docs/workflows.md, "Waiting for a result") --------------------

    def wait(self, conn: Conn, run_id: int, *, timeout: float | None = None) -> Any:
        """Wait on `conn` (outside any transaction) until run `run_id` ends: its result, or
        RunFailed / RunCancelled / RunPartial raised; WaitTimeout after `timeout` seconds
        (None: no limit), the run left as it is. `handle.wait()` for a run enqueued here."""
        c = sync_connection(conn, "wait")
        return results.wait(c, _check_run_id(run_id), timeout)

    async def wait_async(self, conn: AConn, run_id: int, *, timeout: float | None = None) -> Any:
        """`wait` on a psycopg AsyncConnection."""
        c = async_connection(conn, "wait_async")
        return await results.wait_async(c, _check_run_id(run_id), timeout)

    async def cancel_async(self, conn: AConn, run_id: int) -> str:
        """`cancel` on a psycopg AsyncConnection."""
        c = async_connection(conn, "cancel_async")
        run_id = _check_run_id(run_id)
        cur = await c.execute(Q["cancel_run"], {"id": run_id})
        return _cancelled(await cur.fetchone(), run_id)
