"""The configuration reference in docs/configuration.md is the one generated from
leasework/config/, and the README keeps its two commands."""

from __future__ import annotations

from pathlib import Path

import pytest

from leasework import config
from leasework.cli import config_sections

SECTIONS = config_sections()  # the built-in families' sections, as the CLI reads them

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CONFIGURATION = ROOT / "docs" / "configuration.md"
START, END = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"


def test_configuration_reference_is_current() -> None:
    text = CONFIGURATION.read_text(encoding="utf-8")
    assert START in text and END in text, "docs/configuration.md lost its config-reference markers"
    section = text[text.index(START) + len(START) : text.index(END)]
    assert section == config.reference(SECTIONS), (
        "docs/configuration.md's configuration reference is stale: replace the lines between the "
        "config-reference markers with the output of `leasework config --reference`"
    )


def test_every_setting_is_in_the_reference() -> None:
    reference = config.reference(SECTIONS)
    for name in config.all_keys(SECTIONS):
        assert f"| `{name}` |" in reference
        assert config.field_of(name, SECTIONS).metadata.get("doc"), f"setting {name} has no doc(...) text"


def test_readme_keeps_the_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    assert "make test" in text and "make demo" in text


def test_config_command_prints_the_reference_and_hides_the_password(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from leasework.cli import main

    assert main(["config", "--reference"]) == 0
    assert capsys.readouterr().out == config.reference(SECTIONS)
    assert main(["config", "--dsn", "postgresql://app:s3cret@db/app"]) == 0
    out = capsys.readouterr().out
    assert 'dsn = "postgresql://app:***@db/app"' in out and "s3cret" not in out
    assert "lease = 120.0" in out
    # what it prints is a valid config file: an unset key is a comment
    assert "# app is unset" in out
    import tomllib

    printed = tomllib.loads(out.replace('"postgresql://app:***@db/app"', '"dbname=x"'))
    assert printed["lease"] == 120.0 and "app" not in printed
