"""MkDocs hooks (mkdocs.yml `hooks:`): the site's home page is README.md, so that the front door
is written once. Its links into docs/ become the site's own; a link to a file of the repository
outside docs/ (ARCHITECTURE.md) becomes its name in code, as the site does not hold that file. A
page's link to ../README.md (which works where docs/ is read as files) is a link to the home."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mkdocs.structure.files import Files

LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")


def home_page(readme: str) -> str:
    """README.md as the site's index.md."""

    def link(m: re.Match[str]) -> str:
        bang, label, target = m.groups()
        if target.startswith(("http://", "https://", "mailto:", "#")):
            return m.group(0)
        if target.startswith("docs/"):
            return f"{bang}[{label}]({target.removeprefix('docs/')})"
        return f"`{target}`" if label in (target, f"`{target}`") else f"{label} (`{target}`)"

    return LINK.sub(link, readme)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return markdown.replace("](../README.md", "](index.md")


def on_files(files: Files, config: Any) -> Files:
    from mkdocs.structure.files import File

    readme = Path(config.config_file_path).parent / "README.md"
    files.append(File.generated(config, "index.md", content=home_page(readme.read_text("utf-8"))))
    return files
