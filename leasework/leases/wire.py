"""libpq under psycopg, for the one-at-a-time hot statement (`lease.Chain`): protocol-level
prepared statements kept per connection, parameters sent as the bytes they already are, rows
returned in binary and loaded with the connection's loaders, the NOTIFYs that came with an answer
handed back to psycopg, a statement the server forgot prepared again, and errors raised as
psycopg's cursor raises them. Knows no statement of its own (lease.py says what to send); never
runs job code."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import abc, errors, pq
from psycopg.adapt import Transformer

Conn = psycopg.Connection[Any]
TEXT = pq.Format.TEXT
BINARY = pq.Format.BINARY
_IDLE = pq.TransactionStatus.IDLE
_BAD = pq.ConnStatus.BAD
_FATAL = pq.ExecStatus.FATAL_ERROR
_TUPLES_OK = pq.ExecStatus.TUPLES_OK
_COMMAND_OK = pq.ExecStatus.COMMAND_OK
_SQLSTATE = pq.DiagnosticField.SQLSTATE


def numbered(text: bytes, names: Sequence[str]) -> bytes:
    """`text` with its %(name)s parameters numbered ($1 for names[0], ...), as libpq and a
    psycopg RawCursor take them. Raises ValueError if a parameter is not in `names`."""
    for i, name in enumerate(names, 1):
        text = text.replace(b"%%(%s)s" % name.encode(), b"$%d" % i)
    if b"%(" in text:
        raise ValueError(f"a parameter of the statement is not in {names}")
    return text


def array_text(values: Sequence[str | None]) -> str:
    """The text of a one-dimensional array: each element double-quoted with its backslashes and
    double quotes escaped, None as NULL (Postgres' array input syntax). Cheaper than psycopg's
    list dumper, which adapts and quotes a list element by element."""
    quoted = [
        "NULL" if v is None else '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        for v in values
    ]
    return "{" + ",".join(quoted) + "}"


def direct_and_idle(conn: Conn) -> bool:
    """Whether `conn` may run a statement of `Prepared`: a direct connection (behind a pooler no
    prepared statement outlives a transaction) outside a transaction (psycopg's cursor keeps
    track of the caller's)."""
    return conn.prepare_threshold is not None and conn.pgconn.transaction_status == _IDLE


def column_names(res: pq.abc.PGresult) -> list[str]:
    """The names of a result's columns."""
    return [(res.fname(i) or b"").decode() for i in range(res.nfields)]


class Prepared:
    """The protocol-level prepared statements a caller keeps on one connection at a time (the
    connection it last ran one on; another forgets them), and the Transformer that loads their
    rows with that connection's loaders. Not thread-safe: one per caller."""

    __slots__ = ("_names", "_transformer", "encoding", "pgconn")

    def __init__(self) -> None:
        self.pgconn: pq.abc.PGconn | None = None  # the one the statements are prepared on
        self.encoding = "utf-8"  # the client encoding of that connection
        self._names: set[bytes] = set()
        self._transformer: abc.Transformer | None = None

    def execute(
        self,
        conn: Conn,
        name: bytes,
        numbered: bytes,
        values: Sequence[Any],
        formats: Sequence[pq.Format],
    ) -> pq.abc.PGresult:
        """Run the statement `name` (its text `numbered`, prepared first if this connection has
        not got it) with `values` (bytes, None for NULL) in `formats`, its rows returned in
        binary. The caller checked `direct_and_idle(conn)`. Raises psycopg.Error as the cursor
        would."""
        pgconn = conn.pgconn
        with conn.lock:
            if self.pgconn is not pgconn or name not in self._names:
                self._prepare(conn, name, numbered)
            res = pgconn.exec_prepared(name, values, formats, BINARY)
            if res.status == _FATAL and res.error_field(_SQLSTATE) == b"26000":
                # The server forgot it (DISCARD ALL, DEALLOCATE): prepared again, sent again.
                self._names.clear()
                self._prepare(conn, name, numbered)
                res = pgconn.exec_prepared(name, values, formats, BINARY)
            # NOTIFYs that came with the answer wait in libpq's queue: hand them to psycopg as
            # its own reading of a result does, or conn.notifies() would not see them until
            # the socket next had something new.
            handler = pgconn.notify_handler
            while (note := pgconn.notifies()) is not None:
                if handler is not None:
                    handler(note)
        if res.status != _TUPLES_OK:
            raise self._error(pgconn, res)
        return res

    def load_row(self, res: pq.abc.PGresult, row: int) -> tuple[Any, ...]:
        """Row `row` of a result of `execute`, loaded as psycopg loads it."""
        tx = self._transformer
        assert tx is not None
        tx.set_pgresult(res)
        return tx.load_row(row, tuple)

    def load_rows(self, res: pq.abc.PGresult) -> list[tuple[Any, ...]]:
        """Every row of a result of `execute`: the result's loaders looked up once for all of
        them (a batch claim's 100 rows), not once per row."""
        tx = self._transformer
        assert tx is not None
        tx.set_pgresult(res)
        return tx.load_rows(0, res.ntuples, tuple)

    def _error(self, pgconn: pq.abc.PGconn, res: pq.abc.PGresult) -> psycopg.Error:
        """The exception psycopg's cursor would raise for `res`: the server's error as its
        class, a lost connection as OperationalError."""
        if pgconn.status == _BAD:
            return psycopg.OperationalError(res.get_error_message(self.encoding))
        return errors.error_from_result(res, encoding=self.encoding)

    def _prepare(self, conn: Conn, name: bytes, numbered: bytes) -> None:
        pgconn = conn.pgconn
        if self.pgconn is not pgconn:
            self._names.clear()
        self.encoding = conn.info.encoding
        res = pgconn.prepare(name, numbered)
        if res.status != _COMMAND_OK and res.error_field(_SQLSTATE) == b"42P05":
            # Prepared already on this session (a Chain made anew): made again from our text.
            pgconn.exec_(b"DEALLOCATE " + name)
            res = pgconn.prepare(name, numbered)
        if res.status != _COMMAND_OK:
            raise self._error(pgconn, res)
        if self.pgconn is not pgconn:
            self._transformer = Transformer(conn)
        self.pgconn = pgconn
        self._names.add(name)
