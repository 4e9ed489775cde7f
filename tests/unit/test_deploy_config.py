"""deploy/leasework.toml documents every setting, and uncommented it is a valid config."""

from __future__ import annotations

import re
from pathlib import Path

from leasework import config
from leasework.cli import config_sections

SECTIONS = config_sections()  # the built-in families' sections, as the CLI reads them

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "leasework.toml"
SETTING = re.compile(r"^# ([a-z_]+ = .*?)(   \(default: unset\))?$")


def test_every_setting_is_documented_and_the_example_is_valid(tmp_path: Path) -> None:
    lines = [m.group(1) for line in EXAMPLE.read_text().splitlines() if (m := SETTING.match(line))]
    keys = [line.split(" = ", 1)[0] for line in lines]
    assert sorted(keys) == sorted(config.all_keys(SECTIONS))
    uncommented = tmp_path / "leasework.toml"
    uncommented.write_text("\n".join(lines) + "\n")
    cfg = config.load(uncommented, env={}, sections=SECTIONS)
    defaults = config.Config.make(sections=SECTIONS)
    for key in config.all_keys(SECTIONS):
        if key in ("dsn", "listen_dsn", "app", "embedder", "concurrency"):  # examples of unset
            continue
        if key not in config.FIELDS:
            assert config.value(cfg, key) == config.value(defaults, key), key
        else:
            # An unset timing derived from the lease is shown with its derived value.
            derived = {
                "renew_interval": "renew",
                "control_interval": "control",
                "watchdog_margin": "margin",
            }.get(key)
            if derived is None:
                assert getattr(cfg, key) == getattr(defaults, key), key
            else:
                got = getattr(config.lease_timing(cfg), derived)
                assert got == getattr(config.lease_timing(defaults), derived), key
