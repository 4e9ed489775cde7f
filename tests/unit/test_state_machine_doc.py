"""docs/state-machine.md lists every statement that changes a run's status: each statement in
leasework's `.sql` files (and each SQL string in its Python) that inserts into `leasework.runs`,
deletes from it or updates its `status` must appear there as `name` (`file`), and everything the
document names must still exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from leasework import queries

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "leasework"
DOC = ROOT / "docs" / "state-machine.md"

# `name` (`file`), the file relative to leasework/ (schema.sql: relative to the repository).
LISTED = re.compile(r"`([\w.]+)` \(`([\w/.]+\.(?:sql|py))`\)")

# A quoted literal (emptied), a quoted identifier (kept) or a comment (dropped).
_QUOTED_OR_COMMENT = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|--[^\n]*|/\*.*?\*/", re.S)
_RUNS = r"(?:\"?leasework\"?\.)?\"?runs\"?\b"
_INSERT = re.compile(rf"\binsert\s+into\s+{_RUNS}", re.I)
_COPY = re.compile(rf"\bcopy\s+{_RUNS}", re.I)
_DELETE = re.compile(rf"\bdelete\s+from\s+(?:only\s+)?{_RUNS}", re.I)
_UPDATE = re.compile(rf"\bupdate\s+(?:only\s+)?{_RUNS}(?:\s+(?:as\s+)?(?!set\b)\w+)?\s+set\b", re.I)
_SET_END = re.compile(r"\b(?:from|where|returning)\b", re.I)
_STATUS_TARGET = re.compile(
    r"^\s*(?:\w+\.)?\"?status\"?\s*=|^\s*\([^)]*\bstatus\b[^)]*\)\s*=", re.I
)


def _clean(sql: str) -> str:
    """The statement without comments and with every literal emptied ('...' -> ''), so that
    neither a comment nor a string can look like a write."""

    def one(m: re.Match[str]) -> str:
        token = m.group()
        return "''" if token[0] == "'" else token if token[0] == '"' else " "

    return _QUOTED_OR_COMMENT.sub(one, sql)


def _set_list(sql: str, start: int) -> str:
    """The SET list that starts at `start`: up to FROM, WHERE or RETURNING outside parentheses,
    or the end of the enclosing parenthesis (an UPDATE inside a CTE)."""
    depth = 0
    i = start
    while i < len(sql):
        ch = sql[i]
        if ch == "'":
            i = sql.index("'", i + 1) + 1
            continue
        if ch == "(":
            depth += 1
        elif ch == ")":
            if depth == 0:
                return sql[start:i]
            depth -= 1
        elif depth == 0:
            m = _SET_END.match(sql, i)
            if m and (i == 0 or not (sql[i - 1].isalnum() or sql[i - 1] == "_")):
                return sql[start:i]
        i += 1
    return sql[start:]


def _split_top_level(text: str) -> list[str]:
    parts, depth, last, i = [], 0, 0, 0
    while i < len(text):
        ch = text[i]
        if ch == "'":
            i = text.index("'", i + 1) + 1
            continue
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[last:i])
            last = i + 1
        i += 1
    parts.append(text[last:])
    return parts


def writes_run_status(sql: str) -> bool:
    """Does the statement insert a run, delete one, or assign `status` in an UPDATE of runs?"""
    text = _clean(sql)
    if _INSERT.search(text) or _COPY.search(text) or _DELETE.search(text):
        return True
    for m in _UPDATE.finditer(text):
        if any(_STATUS_TARGET.match(a) for a in _split_top_level(_set_list(text, m.end()))):
            return True
    return False


def _sql_statements() -> dict[tuple[str, str], str]:
    """{(name, file): statement} for every .sql file under leasework/ and schema.sql. A file
    without `-- name:` blocks (a migration, the schema) is one statement named by its stem. A
    `<name>` placeholder is the statement of that name in the same file (finish_and_claim)."""
    found: dict[tuple[str, str], str] = {}
    files = [(p, p.relative_to(PACKAGE).as_posix()) for p in sorted(PACKAGE.rglob("*.sql"))]
    files.append((ROOT / "schema.sql", "schema.sql"))
    for path, rel in files:
        text = path.read_text(encoding="utf-8")
        named = queries.parse(text) or {path.stem: text}
        for name, body in named.items():
            found[(name, rel)] = re.sub(
                r"<(\w+)>", lambda m, named=named: named.get(m.group(1), m.group()), body
            )
    return found


def _strings(node: ast.AST, where: str, rel: str, found: dict[tuple[str, str], list[str]]) -> None:
    """Collect the string constants under `node` by their innermost enclosing function."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            _strings(child, child.name, rel, found)
        elif isinstance(child, ast.Constant) and isinstance(child.value, str):
            found.setdefault((where, rel), []).append(child.value)
        elif isinstance(child, ast.JoinedStr):
            parts = [v.value if isinstance(v, ast.Constant) else " x " for v in child.values]
            found.setdefault((where, rel), []).append("".join(map(str, parts)))
        else:
            _strings(child, where, rel, found)


def _python_sql() -> dict[tuple[str, str], list[str]]:
    """{(function, file): [its string constants]} for leasework's Python (an f-string's
    literal parts joined around its fields)."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        _strings(tree, "<module>", path.relative_to(PACKAGE).as_posix(), found)
    return found


def status_writers() -> set[tuple[str, str]]:
    writers = {key for key, sql in _sql_statements().items() if writes_run_status(sql)}
    writers |= {
        key for key, texts in _python_sql().items() if any(writes_run_status(t) for t in texts)
    }
    return writers


def listed() -> set[tuple[str, str]]:
    return set(LISTED.findall(DOC.read_text(encoding="utf-8")))


def test_every_statement_that_writes_a_run_status_is_in_the_state_machine_document() -> None:
    missing = sorted(status_writers() - listed())
    assert not missing, (
        "these statements write leasework.runs.status (or insert or delete a run) but "
        f"docs/state-machine.md does not list them: {missing}. Add each transition it makes, "
        "as `name` (`file`), with its guard."
    )


def test_everything_the_document_names_still_exists() -> None:
    sql = _sql_statements()
    python = _python_sql()
    stale = sorted(
        (name, file)
        for name, file in listed()
        if (name, file) not in sql and (name, file) not in python
    )
    assert not stale, f"docs/state-machine.md names statements that are gone: {stale}"


def test_the_scan_finds_the_known_writers() -> None:
    """Guards the parser itself: a scan that found nothing would pass the first test."""
    assert {
        ("claim_runs", "leases/lease.sql"),
        ("expire_and_promote", "leases/lease.sql"),
        ("finish_run", "leases/lease.sql"),
        ("finish_and_claim", "leases/lease.sql"),
        ("finish_runs", "leases/lease.sql"),
        ("requeue_run", "leases/lease.sql"),
        ("release_run", "leases/lease.sql"),
        ("schema", "schema.sql"),  # leasework.enqueue(), which enqueue_run calls
        ("prune_runs", "stages/maintenance.sql"),
        ("_copy_many", "client.py"),
    } <= status_writers()
    lease_only = {k for k in status_writers() if k[1] == "leases/lease.sql"}
    assert ("renew_lease", "leases/lease.sql") not in lease_only
    assert ("expire_worker_leases", "leases/lease.sql") not in lease_only
    assert ("checkpoint_run", "leases/lease.sql") not in lease_only


@pytest.mark.parametrize(
    ("sql", "writes"),
    [
        ("UPDATE leasework.runs SET status = 'queued' WHERE id = 1", True),
        ("UPDATE leasework.runs r SET lease_owner = NULL, status = 'failed'", True),
        ("UPDATE leasework.runs AS r SET (status, error) = ('failed', 'x')", True),
        (
            "WITH e AS (UPDATE leasework.runs r SET r.status = 'x' FROM y RETURNING r.id) SELECT 1",
            True,
        ),
        ("UPDATE leasework.runs SET lease_expires_at = now() WHERE status = 'running'", False),
        ("UPDATE leasework.runs SET x = (SELECT status FROM t), y = 1 WHERE status = 'a'", False),
        ("UPDATE leasework.files SET status = 'ready'", False),
        ("-- UPDATE leasework.runs SET status = 'x'\nSELECT 1", False),
        ("SELECT 'UPDATE leasework.runs SET status = 1'", False),
        ("INSERT INTO leasework.runs (kind) VALUES ('k')", True),
        ("INSERT INTO leasework.tenants (name) VALUES ('t')", False),
        ("DELETE FROM leasework.runs r USING d WHERE r.id = d.id", True),
        ("COPY leasework.runs (id, kind) FROM STDIN", True),
    ],
)
def test_the_detector(sql: str, writes: bool) -> None:
    assert writes_run_status(sql) is writes
