"""Source mutants the suite must catch: bugs planted in Python code, which tests/db/test_mutations.py
(SQL only, monkeypatched in-process) cannot plant. Each is applied to a copy of the package in a
temporary directory, never to the files here (other processes load them), and the named tests are
run against that copy in a pytest of their own: the mutant is caught when they fail saying what
the mutant broke.

    python -m tests.mutants [NAME ...]     # or: make mutants

prints caught/survived per mutant and exits 1 if any survived (about a minute: a pytest session
and a database per mutant, hence not in `make test`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "leasework"
TIMEOUT = 300  # seconds for one mutant's tests


@dataclass(frozen=True)
class Mutant:
    """In `path` (inside the package), `remove` (found exactly once) becomes `replace`; the tests
    `tests` (pytest node ids) must then fail, their output containing `says`."""

    name: str
    path: str
    remove: str
    replace: str
    tests: tuple[str, ...]
    says: str
    why: str


MUTANTS = [
    Mutant(
        name="csrf-accepts-a-prefix",
        path="dashboard/csrf.py",
        remove="hmac.compare_digest(token.encode(), token_for(secret, nonce).encode())",
        replace="token_for(secret, nonce).startswith(token)",
        tests=tuple(
            "tests/db/test_dashboard_actions.py"
            f"::test_a_post_without_the_right_token_is_refused_and_changes_nothing[{forge}]"
            for forge in ("truncated token", "a prefix of the token")
        ),
        says="AssertionError: ('truncated token', ",
        why="the CSRF check accepts any prefix of the right token",
    ),
    Mutant(
        name="keeper-renews-at-the-config-lease",
        path="config/timing.py",
        remove="scaled = renew * lease_seconds / lease",
        replace="scaled = renew",
        tests=("tests/db/test_keeper.py::test_a_run_with_a_shorter_lease_never_lapses",),
        says="lease lapsed",
        why="a run with a lease shorter than the config's is renewed at the config lease's pace",
    ),
    Mutant(
        name="async-cancel-deferred-forever",
        path="workers/acontext.py",
        remove="if self._shield == 0 and self._pending:",
        replace="if self._shield == 1 and self._pending:",
        tests=(
            "tests/db/test_async.py"
            "::test_a_cancel_that_arrives_during_leaseworks_statement_is_delivered_after_it",
        ),
        says="not delivered after the statement",
        why="a cancel that arrives during leasework's own statement is never delivered",
    ),
    Mutant(
        name="async-cancel-inside-the-statement",
        path="workers/acontext.py",
        remove="        if self._shield:\n            self._pending = True",
        replace="        if False:\n            self._pending = True",
        tests=(
            "tests/db/test_async.py"
            "::test_a_cancel_that_arrives_during_leaseworks_statement_is_delivered_after_it",
        ),
        says="delivered inside leasework's statement",
        why="a cancel is delivered inside leasework's own statement (the pool connection given "
        "back half-way)",
    ),
    Mutant(
        name="snooze-charges-an-attempt",
        path="workers/outcome.py",
        remove='return Outcome("snooze", label="snoozed",',
        replace='return Outcome("requeue", label="snoozed",',
        tests=("tests/db/test_outcomes.py::test_a_snooze_requeues_without_charging_an_attempt",),
        says="charged an attempt",
        why="a handler's Snooze is written as a retry: it charges an attempt (max_attempts used "
        "up by waiting)",
    ),
    Mutant(
        name="debounce-merge-not-applied",
        path="client.py",
        remove="merged = one.merge(old, one.body)",
        replace="merged = one.body",
        tests=(
            "tests/db/lease/test_debounce.py::test_a_merge_function_combines_old_and_new_payloads",
        ),
        says="the merge was not applied",
        why="a debounce_merge task's pending payload is replaced by each enqueue's, not merged",
    ),
    Mutant(
        name="task-windows-ignored",
        path="tasks.py",
        remove="    if not any(name in given for name in WINDOW_OPTIONS):\n        return task",
        replace="    if not any(name in given for name in WINDOW_OPTIONS):\n        return Windows()",
        tests=(
            "tests/db/lease/test_unique_windows.py"
            "::test_task_defaults_apply_and_an_enqueue_overrides_them",
        ),
        says="the task's unique_for was not applied",
        why="an enqueue that gives no window option gets none, not its task's unique_for",
    ),
    Mutant(
        name="enqueue-skips-the-payload-check",
        path="client.py",
        remove="        self.accepts(kind).check(kind, body)\n",
        replace="",
        tests=(
            "tests/db/test_payload_shapes.py::test_enqueue_refuses_a_payload_the_handler_cannot_take",
        ),
        says="DID NOT RAISE",
        why="an enqueue takes a payload its handler cannot be called with: the run fails every "
        "attempt",
    ),
    Mutant(
        name="plain-enqueue-keeps-stale-defaults",
        path="client.py",
        remove="        return source is self.source and config is self.config\n",
        replace="        return True\n",
        tests=("tests/db/test_enqueue_plain.py::test_a_kinds_new_defaults_are_seen",),
        says="assert (4, 60.0",
        why="an enqueue without options keeps the parameters made from a kind's old defaults",
    ),
    Mutant(
        name="plain-enqueue-skips-the-payload-check",
        path="client.py",
        remove="        client.accepts(kind).check(kind, body)\n",
        replace="",
        tests=("tests/db/test_enqueue_plain.py::test_each_payload_is_checked_again",),
        says="DID NOT RAISE",
        why="a second enqueue of a kind without options takes a payload its handler cannot be "
        "called with",
    ),
    Mutant(
        name="sync-handler-warned-as-a-blocked-loop",
        path="workers/aexecutor.py",
        remove="level=30 if run_id is not None or not sync else 10,",
        replace="level=30,",
        tests=(
            "tests/db/test_async.py"
            "::test_a_sync_handler_of_a_mixed_worker_is_not_reported_as_blocking_the_loop",
        ),
        says="['loop_lagged']",
        why="a sync handler run inline on a mixed worker's loop is warned about as an async "
        "handler's blocking call",
    ),
]


@dataclass(frozen=True)
class Outcome:
    mutant: Mutant
    caught: bool
    seconds: float
    output: str

    def line(self) -> str:
        verdict = "caught" if self.caught else "SURVIVED"
        return f"{verdict:8} {self.mutant.name} ({self.seconds:.1f} s): {self.mutant.why}"


# A plugin loaded into the mutant's pytest: at the end it writes where every leasework module it
# imported came from, so a mutant cannot pass for survived (or caught) on the real package.
PROBE = """
import os, sys

def pytest_sessionfinish(session, exitstatus):
    with open(os.environ["LEASEWORK_MUTANT_PROBE"], "w", encoding="utf-8") as out:
        for name, module in sorted(sys.modules.items()):
            if name == "leasework" or name.startswith("leasework."):
                out.write(f"{getattr(module, '__file__', None)}\\n")
"""


def mutated_copy(mutant: Mutant, into: Path) -> Path:
    """A copy of the package under `into` with the mutant planted; the directory to put first on
    PYTHONPATH."""
    copy = into / "leasework"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "schema.sql", into / "schema.sql")  # beside the package, as in a checkout
    target = copy / mutant.path
    text = target.read_text(encoding="utf-8")
    if text.count(mutant.remove) != 1:
        raise SystemExit(
            f"mutant {mutant.name!r} no longer applies: {mutant.remove!r} must occur exactly once "
            f"in leasework/{mutant.path} (found {text.count(mutant.remove)}); update tests/mutants.py"
        )
    target.write_text(text.replace(mutant.remove, mutant.replace), encoding="utf-8")
    (into / "leasework_mutant_probe.py").write_text(PROBE, encoding="utf-8")
    return into


def run(mutant: Mutant, python: str = sys.executable) -> Outcome:
    """Run the mutant's tests against a mutated copy: caught when they fail saying `says`."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="leasework-mutant-") as tmp:
        where = mutated_copy(mutant, Path(tmp))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(where), str(ROOT)])
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        probe = where / "imported.txt"
        env["LEASEWORK_MUTANT_PROBE"] = str(probe)
        # -P: the working directory (the real package's parent) is not put first on sys.path.
        command = [python, "-P", "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
        try:
            proc = subprocess.run(
                [*command, "-p", "leasework_mutant_probe", *mutant.tests],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=TIMEOUT,
            )
        except subprocess.TimeoutExpired:  # killed: its test database is left behind
            output = f"the tests ran past {TIMEOUT} s: a hang is not a catch"
            return Outcome(mutant, False, time.monotonic() - started, output)
        output = proc.stdout + proc.stderr
        files = probe.read_text(encoding="utf-8").splitlines() if probe.exists() else []
        elsewhere = [
            f for f in files if f != "None" and not f.startswith(str(where / "leasework"))
        ]
        mutated = str(where / "leasework" / mutant.path)
        if not files or elsewhere or (mutated.endswith(".py") and mutated not in files):
            raise SystemExit(
                f"mutant {mutant.name!r}: its tests did not run on the mutated copy alone "
                f"(imported: {elsewhere or files}); output:\n{output[-3000:]}"
            )
    caught = proc.returncode == 1 and mutant.says in output
    return Outcome(mutant, caught, time.monotonic() - started, output)


def main(argv: list[str]) -> int:
    known = {m.name: m for m in MUTANTS}
    unknown = [a for a in argv if a not in known]
    if unknown:
        print(
            f"unknown mutant {unknown[0]!r}; known: {', '.join(known)}",
            file=sys.stderr,
        )
        return 2
    chosen = [known[a] for a in argv] or MUTANTS
    survived = 0
    for mutant in chosen:
        outcome = run(mutant)
        print(outcome.line(), flush=True)
        if not outcome.caught:
            survived += 1
            print(outcome.output[-3000:], file=sys.stderr)
    print(f"{len(chosen) - survived} of {len(chosen)} mutants caught")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
