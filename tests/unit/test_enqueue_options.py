"""The enqueue options are declared once (leasework.tasks): every enqueue variant takes exactly the
keywords it took when each declared its own, refuses another before anything else (a TypeError
naming it, as a call would), and checks the values in one place with the same one-line errors.
Also `Family.has_schedules()`, and the deprecated `Family.schedules()` still honoured."""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Callable
from typing import Any

import pytest

from leasework import App, Client, ConfigError, Context, KindDefaults
from leasework.app import Family
from leasework.tasks import (
    EnqueueOptions,
    ManyOptions,
    Options,
    RunTaskOptions,
    check_options,
)
from leasework.testing import run_task

# Unique windows and debounce (issue 31) were added to both, and to no other variant.
WINDOWS = {"unique_for", "debounce", "debounce_max", "debounce_merge"}
AFTER = {"after", "on_parent_failure"}  # dependencies (docs/workflows.md)
TAGS = {"tags"}  # search and tags (docs/operations.md, "Search, tags and bulk actions")
ONE = {
    "key", "tenant", "group", "exclusive", "priority", "delay", "max_attempts",
    *WINDOWS, *AFTER, *TAGS,
}
MANY = {"keys", "tenant", "group", "priority", "delay", "max_attempts", *WINDOWS, *AFTER, *TAGS}


def test_each_variant_takes_the_keywords_it_always_took_the_windows_and_after() -> None:
    assert EnqueueOptions.__optional_keys__ == ONE
    assert ManyOptions.__optional_keys__ == MANY
    assert RunTaskOptions.__optional_keys__ == {"key", "tenant", "group", "max_attempts"}
    assert not (
        EnqueueOptions.__required_keys__
        or ManyOptions.__required_keys__
        or RunTaskOptions.__required_keys__
    )


def test_the_defaults_are_those_of_the_old_signatures() -> None:
    assert check_options({}) == Options(
        key=None,
        tenant=None,
        group=None,
        exclusive=False,
        priority=0,
        delay=0.0,
        max_attempts=None,
    )
    # None given for delay is no delay, as before
    assert check_options({"delay": None}).delay == 0.0


def _calls(client: Client) -> list[tuple[str, Callable[..., Any]]]:
    """Each variant called with an option it does not take, on something not a connection:
    the option is what is refused, before the connection is looked at."""

    def run(coro: Any) -> Any:
        return asyncio.run(coro)

    return [
        ("enqueue", lambda **o: client.enqueue("x", "k", **o)),
        ("enqueue_run", lambda **o: client.enqueue_run("x", "k", **o)),
        ("enqueue_reserved", lambda **o: client.enqueue_reserved("x", "k", **o)),
        ("enqueue_async", lambda **o: run(client.enqueue_async("x", "k", **o))),
        ("enqueue_run_async", lambda **o: run(client.enqueue_run_async("x", "k", **o))),
        ("enqueue_many", lambda **o: client.enqueue_many("x", "k", [], **o)),
        ("enqueue_many_async", lambda **o: run(client.enqueue_many_async("x", "k", [], **o))),
    ]


@pytest.mark.parametrize("index", range(7))
def test_an_option_a_variant_does_not_take_is_refused_first(index: int) -> None:
    method, call = _calls(Client())[index]
    with pytest.raises(
        TypeError,
        match=rf"^{method}\(\) got an unexpected keyword argument 'priorty' \(did you mean "
        r"'priority'\?\); it takes after, debounce, debounce_max, debounce_merge, delay, ",
    ):
        call(priorty=1)
    wrong = "keys" if "many" not in method else "key"
    with pytest.raises(TypeError, match=rf"unexpected keyword argument '{wrong}'"):
        call(**{wrong: None})
    if "many" in method:
        with pytest.raises(TypeError, match="unexpected keyword argument 'exclusive'"):
            call(exclusive=True)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"key": "leasework:x"}, r"^key 'leasework:x' is refused: keys starting with "),
        ({"tenant": 5}, r"^tenant must be a non-empty string of at most 200 characters, got 5$"),
        ({"group": ""}, r"^group must be a non-empty string"),
        ({"exclusive": "yes"}, r"^exclusive must be true or false, got 'yes'$"),
        ({"priority": 2**31}, r"^priority must be a 32-bit integer \(lower runs first\)"),
        ({"delay": -1}, r"^delay must be a number of seconds from 0 to 31536000, got -1$"),
        ({"max_attempts": 0}, r"^max_attempts must be an integer from 1 to 1000, got 0$"),
    ],
)
def test_bad_values_get_their_one_line_error(given: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_options(given)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"unique_for": 0}, r"^task 'report': unique_for must be a number of seconds above 0 "),
        ({"debounce": "30"}, r"^task 'report': debounce must be a number of seconds above 0 "),
        ({"debounce_max": 60}, r"^task 'report': debounce_max needs debounce"),
        ({"debounce_merge": max}, r"^task 'report': debounce_merge needs debounce"),
        (
            {"debounce": 30, "debounce_merge": "union"},
            r"^task 'report': debounce_merge must be a function merge\(old_payload, "
            r"new_payload\) -> payload, got 'union'$",
        ),
        (
            {"debounce": 30, "debounce_max": 10},
            r"^task 'report': debounce_max must be at least debounce \(30\), got 10$",
        ),
        (
            {"unique_for": 60, "debounce": 30},
            r"^task 'report': unique_for and debounce cannot be combined",
        ),
    ],
)
def test_a_tasks_bad_windows_are_refused_in_one_line_naming_it(
    given: dict[str, Any], message: str
) -> None:
    """At registration (`@app.task`) and in a Client's KindDefaults, before any enqueue."""
    with pytest.raises(ConfigError, match=message):
        App().task("report", **given)
    with pytest.raises(ConfigError, match=message):
        Client(kinds={"report": KindDefaults(**given)})


def test_a_family_may_use_the_reserved_prefix() -> None:
    assert check_options({"key": "leasework:file:1"}, reserved=True).key == "leasework:file:1"


def test_a_task_handle_and_run_task_refuse_an_option_they_do_not_take() -> None:
    app = App()

    @app.task("report")
    def report(ctx: Context, *, week: int) -> int:
        return week

    assert report.configure(key="w1", priority=3).options == {"key": "w1", "priority": 3}
    with pytest.raises(TypeError, match=r"^configure\(\) got an unexpected keyword argument 'kee'"):
        report.configure(kee="w1")  # type: ignore[call-arg]
    # run_task's run is due at once and first: no priority, delay or exclusive; refused before
    # any connection is opened (the DSN here leads nowhere)
    for option in ("priority", "delay", "exclusive", "keys"):
        refused = rf"^run_task\(\) got an unexpected keyword argument '{option}'"
        with pytest.raises(TypeError, match=refused):
            run_task(app, "host=/nonexistent", "report", **{option: 1})


def test_has_schedules_says_whether_a_family_overrides_enqueue_due() -> None:
    class Plain(Family):
        pass

    class Scheduling(Family):
        def enqueue_due(self, conn: Any, limit: int) -> int:
            return 0

    assert not Plain().has_schedules()
    assert Scheduling().has_schedules()
    with pytest.warns(DeprecationWarning, match=r"has_schedules\(\)"):
        assert Scheduling().schedules() is True


def test_a_family_that_overrides_the_old_name_is_still_asked() -> None:
    with pytest.warns(DeprecationWarning, match=r"Legacy overrides Family.schedules\(\)"):

        class Legacy(Family):
            def enqueue_due(self, conn: Any, limit: int) -> int:
                return 0

            def schedules(self) -> bool:
                return False

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Legacy().has_schedules() is False


def test_after_gives_each_parent_the_runs_policy_or_its_own() -> None:
    """check_after: bare parents (ids, handles) follow on_parent_failure, an After has its own;
    only the policies that differ from the run's are sent, each parent once, in order."""
    from leasework import After, Enqueued
    from leasework.tasks import Dependencies, check_after

    assert check_after({}) == Dependencies()
    got = check_after({"after": [3, After(5, "run"), Enqueued(7), After(Enqueued(9), "cancel")]})
    assert got == Dependencies([3, 5, 7, 9], None, ((5, "run"),))
    got = check_after({"after": [3, After(5, "cancel"), After(5, "cancel")], "on_parent_failure": "run"})
    assert got == Dependencies([3, 5, 5], "run", ((5, "cancel"),))
    for given, message in [
        ({"after": [After(1, "skip")]}, "must be 'cancel' or 'run', got 'skip'"),
        ({"after": [1, After(1, "run")]}, "after gives run 1 two policies, 'cancel' and 'run'"),
        ({"after": [After(1, "run"), After(1, "cancel")]}, "two policies, 'run' and 'cancel'"),
        ({"after": [After(1, "run")], "on_parent_failure": "batch"}, "a member"),
        ({"after": After(1, "run")}, "after must be a list of run ids, got After"),
        ({"after": [After(True, "run")]}, "positive integers"),
    ]:
        with pytest.raises(ConfigError, match=message):
            check_after(given)
