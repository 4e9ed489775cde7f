"""One rule for names (leasework/text.py): a key, tenant or group, a tenant's weight, a project
name and a ZIP member name refuse C0 and C1 controls, DEL, the bidi controls and the line and
paragraph separators, and leasework.label_problem in SQL says exactly what the Python rule says
for every text Postgres can hold."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leasework import App, ConfigError, operations
from leasework.config import Config
from leasework.documents import Documents
from leasework.text import UNSAFE, label_problem

from ..db.checks import sql_labels_refuse_every_unsafe_character

Conn = psycopg.Connection[Any]

# Each class of refused character, by its first and last code point (and U+009B, a terminal's
# CSI), and the neighbours just outside each range, which are fine.
REFUSED = {
    "C0": ["\x01", "\x1b", "\x1f"],
    "DEL": ["\x7f"],
    "C1": ["\x80", "\x9b", "\x9f"],
    "bidi": ["\u061c", "\u200e", "\u200f", "\u202a", "\u202e", "\u2066", "\u2069"],
    "separators": ["\u2028", "\u2029"],
}
ALLOWED = ["\xa0", "\u061b", "\u200d", "\u2027", "\u202f", "\u2065", "\u206a", "é", "日", "😀"]

# Text Postgres can hold (no NUL, no lone surrogate), drawn often from the refused ranges and
# their edges, at lengths around the 200-character limit too.
near = st.sampled_from([c for cs in REFUSED.values() for c in cs] + ALLOWED)
storable = st.characters(exclude_categories=("Cs",), exclude_characters="\x00")
labels = st.text(storable | near, max_size=12) | st.text(
    storable | near, min_size=195, max_size=205
)

PROPERTY = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def sql_problems(conn: Conn, values: list[str]) -> list[str | None]:
    rows = conn.execute(
        "SELECT leasework.label_problem(v) FROM unnest(%s::text[]) WITH ORDINALITY AS u(v, i)"
        " ORDER BY i",
        (values,),
    ).fetchall()
    return [r[0] for r in rows]


@PROPERTY
@given(st.lists(labels, min_size=1, max_size=20))
def test_python_and_sql_give_the_same_verdict_in_the_same_words(
    conn: Conn, values: list[str]
) -> None:
    assert sql_problems(conn, values) == [label_problem(v) for v in values]


def test_the_rule_is_exactly_the_listed_ranges(conn: Conn) -> None:
    listed = {ord(c) for cs in REFUSED.values() for c in cs}
    assert listed <= UNSAFE and not {ord(c) for c in ALLOWED} & UNSAFE
    expected = {
        *range(0x00, 0x20), *range(0x7F, 0xA0), 0x061C, 0x200E, 0x200F,
        *range(0x2028, 0x202F), *range(0x2066, 0x206A),
    }  # fmt: skip
    assert expected == UNSAFE
    for code in range(0x110000):
        if 0xD800 <= code <= 0xDFFF:
            continue
        assert (label_problem(f"a{chr(code)}") is not None) == (code in UNSAFE), hex(code)
    # Every code point of the basic plane Postgres text can hold, in SQL (the other planes hold
    # no refused character; the property test above draws from them): the same set but NUL.
    refused = conn.execute(
        "SELECT array_agg(c ORDER BY c) FROM generate_series(1, 65535) AS c"
        " WHERE c NOT BETWEEN 55296 AND 57343"
        "   AND leasework.label_problem('a' || chr(c)) IS NOT NULL"
    ).fetchone()
    assert refused is not None and set(refused[0]) == UNSAFE - {0}


def _app(tmp_path: Path) -> tuple[App, Documents]:
    app = App(Config.make(file_store=str(tmp_path / "store")))
    app.task("echo")(lambda ctx, payload: payload)
    return app, app.use(Documents())


def test_sql_enqueue_refuses_every_character_of_the_rule(conn: Conn) -> None:
    sql_labels_refuse_every_unsafe_character(conn)  # also the mutation check's (\x7f accepted)


CASES = [(cls, ch) for cls, chars in REFUSED.items() for ch in chars]


@pytest.mark.parametrize(("cls", "ch"), CASES, ids=[f"{c}-U+{ord(h):04X}" for c, h in CASES])
def test_each_class_is_refused_everywhere_a_name_is_given(
    conn: Conn, tmp_path: Path, cls: str, ch: str
) -> None:
    value = f"a{ch}2J"
    words = f"contains control characters (U+{ord(ch):04X};"
    said = re.escape(words)
    app, docs = _app(tmp_path)
    doc = tmp_path / "doc.txt"
    doc.write_text("hello")
    for label in ("key", "tenant", "group"):
        with pytest.raises(ConfigError, match=rf"^{label} .* {said}"):
            app.enqueue(conn, "echo", {}, **{label: value})
        with pytest.raises(psycopg.errors.InvalidParameterValue) as caught:
            conn.execute(f'SELECT leasework.enqueue(%s, "{label}" => %s)', ("echo", value))
        assert str(caught.value).startswith(f"{label} {words}")
        conn.rollback()
    with pytest.raises(ConfigError, match=said):
        operations.set_tenant_weight(conn, value, 2)
    with pytest.raises(ConfigError, match=rf"^project .* {said}"):
        docs.add_file(conn, project=value, path=doc)
    assert conn.execute("SELECT count(*) FROM leasework.runs").fetchone() == (0,)
    assert conn.execute("SELECT count(*) FROM leasework.tenants").fetchone() == (0,)
    assert conn.execute("SELECT count(*) FROM leasework.files").fetchone() == (0,)


def test_the_neighbours_of_each_range_are_accepted(conn: Conn, tmp_path: Path) -> None:
    app, docs = _app(tmp_path)
    doc = tmp_path / "doc.txt"
    doc.write_text("hello")
    for i, ch in enumerate(ALLOWED):
        value = f"a{ch}b"
        assert label_problem(value) is None
        app.enqueue(conn, "echo", {}, key=f"{value}{i}", tenant=value, group=value)
        conn.execute(
            'SELECT leasework.enqueue(%s, key => %s, "group" => %s)', ("echo", value, value)
        )
        operations.set_tenant_weight(conn, value, 2)
        docs.add_file(conn, project=value, path=doc)
    stored = conn.execute("SELECT count(*) FROM leasework.runs WHERE tenant IS NOT NULL").fetchone()
    assert stored == (len(ALLOWED),)
