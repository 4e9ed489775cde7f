"""Enqueue and cancel runs, with or without the handlers: `Client` checks what it is given and
sends the statements of runs.sql (one call of leasework.enqueue per run, COPY for many), on a
psycopg Connection or, awaited, an AsyncConnection. The App is a Client that also knows its
kinds. Imports no handler, no stage and no worker: a web process enqueues with it alone."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Unpack

import psycopg
from psycopg.types.json import Jsonb

from .config import Config
from .errors import ConfigError, LeaseworkError, NotFound, WrongConnection
from .queries import load
from .tasks import (
    DEFAULT_TIMEOUT,
    Enqueued,
    EnqueueOptions,
    ManyOptions,
    accept_options,
    check_attempts,
    check_key,
    check_kind,
    check_options,
    check_seconds,
    encode_payload,
)

Q = load("leasework", "runs.sql")
Conn = psycopg.Connection[Any]
AConn = psycopg.AsyncConnection[Any]


def _copy_many() -> str:
    """The COPY of enqueue_many without keys (rows of _Many.copy_rows, ids drawn beforehand)."""
    return (
        'COPY leasework.runs (id, kind, tenant, "group", priority, payload, max_attempts, '
        "lease_seconds, timeout_seconds, queued_at) FROM STDIN"
    )


__all__ = ["Client", "KindDefaults"]


@dataclass(frozen=True)
class KindDefaults:
    """What a run of a kind gets unless the enqueue says: None for max_attempts is the
    configured default, None for lease is the worker's lease, None for timeout is none."""

    max_attempts: int | None = None
    lease: float | None = None
    timeout: float | None = DEFAULT_TIMEOUT


@dataclass(frozen=True)
class _Many:
    """A checked enqueue_many: the columns every row shares, the payloads encoded, the keys."""

    common: dict[str, Any]
    encoded: list[bytes]
    keys: list[str | None] | None

    def keyed_params(self) -> dict[str, Any]:
        return {**self.common, "payloads": [p.decode() for p in self.encoded], "keys": self.keys}

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


def _enqueued(row: Any) -> Enqueued:
    if row is None or row[0] is None:
        raise LeaseworkError("enqueue inserted nothing")  # leasework.enqueue always returns
    return Enqueued(int(row[0]), existing=bool(row[1]))


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
    (the worker that claims it knows it; a kind no worker knows ends `failed`, README "Enqueue
    without the handlers"); its runs get `max_attempts` from the configuration unless given, the
    worker's lease and a one-hour timeout. `App` is a Client that knows its kinds and their
    settings, and refuses any other kind."""

    def __init__(
        self, config: Config | None = None, *, kinds: Mapping[str, KindDefaults] | None = None
    ) -> None:
        """`kinds`: the settings of the tasks this client enqueues, where they are not the
        defaults (`{"reports.send": KindDefaults(max_attempts=5, timeout=600)}`), so that a
        process without the handlers still gives their runs the task's attempts, lease and
        timeout."""
        self.config = config or Config()
        self.kind_defaults: dict[str, KindDefaults] = {}
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
            self.kind_defaults[kind] = given

    def defaults(self, kind: str) -> KindDefaults:
        """What a run of `kind` gets unless the enqueue says; raises for a kind refused here."""
        check_kind(kind)
        return self.kind_defaults.get(kind, KindDefaults())

    # -- checks (shared by the sync and async paths; nothing is sent before they pass) ---------

    def _dumps(self, obj: Any) -> bytes:
        return encode_payload(obj, self.config.payload_max_bytes)

    def _one(
        self, kind: str, payload: Any, options: EnqueueOptions, *, reserved: bool = False
    ) -> dict[str, Any]:
        """The parameters of enqueue_run (runs.sql), every argument checked; `reserved`: the key
        may be under RESERVED_KEY_PREFIX (a family's own run, enqueue_reserved)."""
        defaults = self.defaults(kind)
        body = payload if payload is not None else {}
        opts = check_options(options, reserved=reserved)
        params = {
            "kind": kind,
            "key": opts.key,
            "tenant": opts.tenant,
            "group": opts.group,
            "exclusive": opts.exclusive,
            "priority": opts.priority,
            "payload": Jsonb(body, dumps=self._dumps),
            "max_attempts": opts.max_attempts or defaults.max_attempts or self.config.max_attempts,
            "lease": defaults.lease,
            "timeout": defaults.timeout,
            "delay": opts.delay,
        }
        self._dumps(body)  # refuse before touching the database
        return params

    def _many(self, kind: str, payloads: Iterable[Any], options: ManyOptions) -> _Many:
        defaults = self.defaults(kind)
        encoded = [self._dumps(p if p is not None else {}) for p in payloads]
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
        common = {
            "kind": kind,
            "tenant": opts.tenant,
            "group": opts.group,
            "priority": opts.priority,
            "max_attempts": opts.max_attempts or defaults.max_attempts or self.config.max_attempts,
            "lease": defaults.lease,
            "timeout": defaults.timeout,
            "delay": opts.delay,
        }
        return _Many(common, encoded, checked_keys)

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
        sync_connection(conn, "enqueue")
        return self.enqueue_run(conn, kind, payload, **options).run_id

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
        params = self._one(kind, payload, options)
        return _enqueued(c.execute(Q["enqueue_run"], params).fetchone())

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
        params = self._one(kind, payload, options, reserved=True)
        return _enqueued(c.execute(Q["enqueue_run"], params).fetchone()).run_id

    async def enqueue_async(
        self,
        conn: AConn,
        kind: str,
        payload: Any = None,
        **options: Unpack[EnqueueOptions],
    ) -> int:
        """`enqueue` on a psycopg AsyncConnection, inside its transaction."""
        accept_options("enqueue_async", options, EnqueueOptions)
        async_connection(conn, "enqueue_async")
        done = await self.enqueue_run_async(conn, kind, payload, **options)
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
        params = self._one(kind, payload, options)
        cur = await c.execute(Q["enqueue_run"], params)
        return _enqueued(await cur.fetchone())

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
        return ids

    # -- cancel ---------------------------------------------------------------------------------

    def cancel(self, conn: Conn, run_id: int) -> str:
        """Cancel a run. Queued or waiting: `cancelled` now. Running: the cancel is requested
        and its worker stops at its next control check; returns `running`. Finished: its final
        status, unchanged."""
        c = sync_connection(conn, "cancel")
        run_id = _check_run_id(run_id)
        return _cancelled(c.execute(Q["cancel_run"], {"id": run_id}).fetchone(), run_id)

    async def cancel_async(self, conn: AConn, run_id: int) -> str:
        """`cancel` on a psycopg AsyncConnection."""
        c = async_connection(conn, "cancel_async")
        run_id = _check_run_id(run_id)
        cur = await c.execute(Q["cancel_run"], {"id": run_id})
        return _cancelled(await cur.fetchone(), run_id)
