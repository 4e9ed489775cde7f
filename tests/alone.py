"""Every test file must pass run alone (`pytest FILE`), not only in the whole suite's order: a
test that leans on what an earlier file left behind (a registered setting, a table, a fixture's
state) passes in `make test` and fails for whoever runs its file. This runs each test file of
`make test` (every tier but tests/chaos) in a pytest of its own and lists the files that fail.

    python -m tests.alone [FILE ...]       # or: make test-alone (slow: a pytest per file)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
NO_TESTS = 5  # pytest's exit status when a file holds no test to run


def test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if p.relative_to(TESTS).parts[0] != "chaos")


def main(argv: list[str]) -> int:
    files = [Path(a) for a in argv] or test_files()
    missing = [f for f in files if not f.is_file()]
    if missing:
        print(f"no test file {missing[0]}: give test files, e.g. tests/db/test_cli.py", file=sys.stderr)
        return 2
    # This tree's package first, for the commands the tests start too (`python -m leasework`), which
    # would otherwise import whichever leasework the environment has installed.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    failed: list[str] = []
    for f in files:
        name = str(f.resolve().relative_to(ROOT))
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", name],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        took = time.monotonic() - started
        ok = proc.returncode in (0, NO_TESTS)
        summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
        print(f"{'ok' if ok else 'FAILED':6} {name} ({took:.0f} s): {summary}", flush=True)
        if not ok:
            failed.append(name)
            print(proc.stdout[-4000:] + proc.stderr[-2000:], file=sys.stderr, flush=True)
    print(f"{len(files) - len(failed)} of {len(files)} test files pass alone")
    for name in failed:
        print(f"  fails alone: {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
