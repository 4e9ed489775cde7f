"""The manual (docs/, mkdocs.yml): every page is in the nav and every nav entry is a page, no
relative link in it or in README.md points at a missing page or anchor (checked here without
building), and, where mkdocs is installed, the site builds with --strict (no warning) and its API
reference holds every name `leasework` exports."""

from __future__ import annotations

import re
import subprocess
import sys
import unicodedata
from functools import cache
from pathlib import Path

import pytest

import leasework

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
HOME = "index.md"  # README.md, made the site's home page by tools/docs_home.py

LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6}) (.+?)\s*#*\s*$")


def pages() -> set[str]:
    return {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}


def nav() -> list[str]:
    """The files mkdocs.yml's nav names, in order (read as text: no YAML parser needed)."""
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    block = text[text.index("\nnav:\n") :]
    return re.findall(r"^\s+- [^:\n]+: (\S+\.md)\s*$", block, re.M)


def prose(text: str) -> list[str]:
    """The lines outside fenced code blocks, inline code removed."""
    lines, fence = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if not fence:
            lines.append(re.sub(r"`[^`]*`", "``", line))
    return lines


def slug(heading: str) -> str:
    """Python-Markdown's toc slug of a heading's text (what mkdocs gives as its anchor; GitHub's
    is the same for the headings used here)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = re.sub(r"[*_]{1,2}([^*_]+)[*_]{1,2}", r"\1", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors_of(text: str) -> set[str]:
    found: set[str] = set()
    for line in prose_with_code(text):
        m = HEADING.match(line)
        if m:
            base = slug(m.group(2))
            name, n = base, 0
            while name in found:  # toc's rule for a repeated heading
                n += 1
                name = f"{base}_{n}"
            found.add(name)
    return found


def prose_with_code(text: str) -> list[str]:
    """The lines outside fenced code blocks, inline code kept (a heading's text keeps it)."""
    lines, fence = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if not fence:
            lines.append(line)
    return lines


@cache
def anchors(path: Path) -> frozenset[str]:
    return frozenset(anchors_of(path.read_text(encoding="utf-8")))


def broken_links(source: Path, text: str, base: Path, outside_docs: bool) -> list[str]:
    """Each relative link of `text` (a file in `base`) whose file or anchor is missing. A page of
    the site may link only into docs/ and to ../README.md (the home page: tools/docs_home.py);
    README.md, anywhere in the repository."""
    problems = []
    own = anchors_of(text)
    for line in prose(text):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            where = f"{source.name}: ({target})"
            if not path:
                if anchor not in own:
                    problems.append(f"{where}: no heading with anchor #{anchor} in this page")
                continue
            file = (base / path).resolve()
            if not file.exists():
                problems.append(f"{where}: no file {path}")
                continue
            if not outside_docs and not file.is_relative_to(DOCS) and file != ROOT / "README.md":
                problems.append(f"{where}: outside docs/, so not in the site; name it in code")
                continue
            if anchor and file.suffix == ".md" and anchor not in anchors(file):
                problems.append(f"{where}: {path} has no heading with anchor #{anchor}")
    return problems


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page() -> None:
    entries = nav()
    assert HOME in entries, "mkdocs.yml's nav lost its home page"
    assert not (DOCS / HOME).exists(), (
        "docs/index.md would hide the home page made from README.md (tools/docs_home.py)"
    )
    listed = set(entries) - {HOME}
    assert len(entries) == len(set(entries)), "a page is named twice in mkdocs.yml's nav"
    assert not listed - pages(), f"mkdocs.yml's nav names pages that are missing: {listed - pages()}"
    assert not pages() - listed, f"pages missing from mkdocs.yml's nav: {pages() - listed}"


def test_no_relative_link_points_at_a_missing_page_or_anchor() -> None:
    problems = []
    for page in sorted(DOCS.rglob("*.md")):
        problems += broken_links(page, page.read_text(encoding="utf-8"), page.parent, False)
    readme = ROOT / "README.md"
    problems += broken_links(readme, readme.read_text(encoding="utf-8"), ROOT, True)
    assert not problems, "\n".join(problems)


def test_the_readme_links_every_page() -> None:
    """README.md is the front door: its list of pages holds every page of the manual."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    linked = {t.partition("#")[0].removeprefix("docs/") for t in LINK.findall(text)}
    assert not pages() - linked, f"README.md does not link {pages() - linked}"


def test_the_link_check_catches_a_missing_page_and_a_missing_anchor() -> None:
    page = DOCS / "concepts.md"
    text = (
        "# A page\n\n## A heading, `with code`\n\nSee [here](#a-heading-with-code), "
        "[there](flow-control.md#debounce), [gone](no-such-page.md), [lost](#nowhere), "
        "[wrong](flow-control.md#nowhere), [out](../ARCHITECTURE.md), "
        "`[in code](no-such-page.md)`.\n\n```\n[in a block](no-such-page.md)\n```\n"
    )
    problems = broken_links(page, text, DOCS, False)
    assert [p.split(": ", 2)[1] for p in problems] == [
        "(no-such-page.md)",
        "(#nowhere)",
        "(flow-control.md#nowhere)",
        "(../ARCHITECTURE.md)",
    ], problems


def test_anchors_follow_the_toc_rules() -> None:
    text = "# Guarantees\n## Handlers that never call `ctx.check()`\n## A, b: c\n## A, b: c\n"
    assert anchors_of(text) == {
        "guarantees",
        "handlers-that-never-call-ctxcheck",
        "a-b-c",
        "a-b-c_1",
    }


def test_the_home_page_is_the_readme_with_its_links_made_the_sites() -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from docs_home import home_page  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(ROOT / "tools"))
    text = (
        "See [Workflows](docs/workflows.md#batches), ![shot](docs/images/x.png), "
        "[ARCHITECTURE.md](ARCHITECTURE.md), [the rooms](ARCHITECTURE.md), [up](#quick-start) "
        "and [a site](https://example.org)."
    )
    assert home_page(text) == (
        "See [Workflows](workflows.md#batches), ![shot](images/x.png), "
        "`ARCHITECTURE.md`, the rooms (`ARCHITECTURE.md`), [up](#quick-start) "
        "and [a site](https://example.org)."
    )


def test_the_site_builds_with_no_warning_and_documents_every_public_name(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (the test extra has it)")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed (the test extra)")
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "WARNING" not in out, out
    for page in pages():
        assert (site / page.removesuffix(".md") / "index.html").exists(), f"{page} was not built"
    home = (site / "index.html").read_text(encoding="utf-8")
    assert "Quick start" in home and 'href="guarantees/"' in home, "the home page is not README.md"
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    missing = [
        name
        for name in leasework.__all__
        if not name.startswith("_")  # __version__, named in the page's text
        and f'id="leasework.{name}"' not in api  # a class, a function
        and f'id="leasework.{name}.' not in api  # a module: its members
    ]
    assert not missing, f"the API reference lacks {missing}"
