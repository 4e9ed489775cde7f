"""What a user imports from `leasework` itself: every name of `__all__` is there, the handler
contexts among them (`Context` and `AsyncContext`), and the manual's examples import them from
there rather than from the modules they live in."""

from __future__ import annotations

import re
from pathlib import Path

import leasework

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"```python\n(.*?)```", re.S)


def test_every_name_in_all_is_importable_from_leasework() -> None:
    for name in leasework.__all__:
        assert hasattr(leasework, name), f"leasework.__all__ names {name}, which is missing"


def test_both_handler_contexts_are_exported() -> None:
    from leasework.workers.acontext import AsyncContext
    from leasework.workers.context import Context

    assert {"Context", "AsyncContext"} <= set(leasework.__all__)
    assert leasework.AsyncContext is AsyncContext
    assert leasework.Context is Context


def test_the_manuals_examples_import_public_names_from_leasework() -> None:
    """An example that imports a public name from an internal module teaches users a path that
    may move (`from leasework.workers.acontext import AsyncContext`)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = []
    for page in pages:
        for block in FENCE.findall(page.read_text(encoding="utf-8")):
            for line in block.splitlines():
                m = re.match(r"\s*from (leasework\.[\w.]+) import (.+)", line)
                if m is None:
                    continue
                names = [n.strip().split(" as ")[0] for n in m.group(2).strip("()").split(",")]
                public = [n for n in names if n in leasework.__all__]
                if public:
                    found.append(f"{page.name}: {line.strip()}")
    assert not found, f"import these from leasework itself: {found}"
