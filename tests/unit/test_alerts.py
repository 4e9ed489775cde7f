"""deploy/alerts.yml, the example alert rules of docs/operations.md, "Metrics": `promtool check rules` accepts
them, and `promtool test rules` (tests/unit/alerts_test.yml) sees them fire once for figures two
dashboards report alike, and not for a kind that is fine. Every metric they name is served."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "alerts.yml"
PROMTOOL = shutil.which("promtool")

pytestmark = pytest.mark.skipif(
    PROMTOOL is None, reason="no promtool: `apt-get install -y prometheus` (.ci/run installs it)"
)


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_the_rules_pass_promtool_check() -> None:
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 9 rules found" in done.stdout


def test_the_rules_fire_as_tested() -> None:
    done = promtool("test", "rules", str(ROOT / "tests" / "unit" / "alerts_test.yml"))
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_metric_the_rules_name_is_served() -> None:
    served = (ROOT / "leasework" / "dashboard" / "metrics.py").read_text()
    named = set(re.findall(r"\b(leasework_[a-z_]+)", RULES.read_text()))
    assert named
    for name in named:
        base = re.sub(r"_(total|bucket|count|sum)$", "", name)
        assert f'"{base}"' in served, name
