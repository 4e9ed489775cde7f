"""Configuration: TOML file, overridden by LEASEWORK_* environment, overridden by flags; defaults
equal the seed's figures; every refusal names its key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from leasework.config import Config, lease_timing, load
from leasework.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "leasework.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_are_the_seed_figures() -> None:
    cfg = load(env={})
    assert cfg.poll_interval == 2.0
    assert cfg.lease == 120.0
    timing = lease_timing(cfg)
    assert timing.renew == 40.0  # a third of the lease
    assert timing.control == 2.0
    assert timing.margin == 20.0
    assert (cfg.renew_interval, cfg.control_interval, cfg.watchdog_margin) == (None, None, None)
    assert cfg.heartbeat_interval == 15.0
    assert cfg.pool_size == 4
    assert cfg.max_attempts == 3
    assert cfg.backoff == (5.0, 30.0, 120.0)
    assert cfg.backoff_jitter == 0.2
    assert cfg.payload_max_bytes == 1 << 20
    assert cfg.dsn is None


def test_file_then_env_then_flags(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        'lease = 100\nrenew_interval = 20\npool_size = 6\nbackoff = [1, 2.5]\ndsn = "dbname=file"\n',
    )
    cfg = load(path, env={})
    assert (cfg.lease, cfg.renew_interval, cfg.pool_size) == (100.0, 20.0, 6)
    assert cfg.backoff == (1.0, 2.5)
    assert cfg.dsn == "dbname=file"

    env = {"LEASEWORK_LEASE": "90", "LEASEWORK_POOL_SIZE": "5", "LEASEWORK_BACKOFF": "3,4,5"}
    cfg = load(path, env=env)
    assert (cfg.lease, cfg.renew_interval, cfg.pool_size) == (90.0, 20.0, 5)
    assert cfg.backoff == (3.0, 4.0, 5.0)

    cfg = load(path, env=env, overrides={"lease": 60, "dsn": "dbname=flag", "pool_size": None})
    assert (cfg.lease, cfg.pool_size, cfg.dsn) == (60.0, 5, "dbname=flag")


def test_origin_names_where_each_setting_was_given(tmp_path: Path) -> None:
    """What an error about a value names (load_app's refusals): the flag, the variable or the
    file's key that set it, whichever won."""
    path = write(tmp_path, 'app = "file:app"\nlease = 60\n')
    cfg = load(path, env={"LEASEWORK_APP": "env:app", "LEASEWORK_POOL_SIZE": "3"})
    assert cfg.app == "env:app" and cfg.origin("app") == "LEASEWORK_APP"
    assert cfg.origin("lease") == f"{path}: lease"
    assert cfg.origin("pool_size") == "LEASEWORK_POOL_SIZE"
    assert cfg.origin("poll_interval") == "poll_interval"  # a default: the bare key
    flagged = load(path, env={"LEASEWORK_APP": "env:app"}, overrides={"app": "flag:app"})
    assert flagged.origin("app") == "--app"
    assert load(path, env={}).origin("app") == f"{path}: app"
    assert flagged == load(path, env={}, overrides={"app": "flag:app"})  # not in equality


def test_config_file_from_env(tmp_path: Path) -> None:
    path = write(tmp_path, "max_attempts = 7\n")
    assert load(env={"LEASEWORK_CONFIG": str(path)}).max_attempts == 7


def test_dsn_precedence() -> None:
    assert load(env={"DATABASE_URL": "dbname=url"}).dsn == "dbname=url"
    env = {"DATABASE_URL": "dbname=url", "LEASEWORK_DSN": "dbname=env"}
    assert load(env=env).dsn == "dbname=env"
    assert load(env=env, overrides={"dsn": "dbname=flag"}).dsn == "dbname=flag"


def test_empty_env_values_are_ignored() -> None:
    assert load(env={"LEASEWORK_LEASE": ""}).lease == 120.0


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("poll_interval", 0),
        ("lease", -1),
        ("control_interval", 0),
        ("heartbeat_interval", -5),
        ("graceful_timeout", -1),
        ("pool_size", 1),
        ("pool_size", 0),
        ("max_attempts", 0),
        ("payload_max_bytes", 0),
        ("runs_limit", 0),
        ("settle_limit", 0),
        ("processes", 0),
        ("backoff", [5, -1]),
        ("backoff_jitter", 1.0),
        ("backoff_jitter", -0.1),
        ("log_level", "loud"),
        ("pooler", "yes"),
        ("pooler", "transaction"),
    ],
)
def test_impossible_values_name_their_key(key: str, value: Any) -> None:
    with pytest.raises(ConfigError) as err:
        load(env={}, overrides={key: value})
    assert key in str(err.value)
    assert "\n" not in str(err.value)


def test_renewal_must_be_shorter_than_half_the_lease() -> None:
    with pytest.raises(ConfigError, match="renew_interval"):
        load(env={}, overrides={"lease": 60, "renew_interval": 30})
    with pytest.raises(ConfigError, match="renew_interval"):
        load(env={}, overrides={"lease": 60, "renew_interval": 60})
    assert load(env={}, overrides={"lease": 60, "renew_interval": 20}).renew_interval == 20


def test_control_must_be_shorter_than_renewal() -> None:
    with pytest.raises(ConfigError, match="control_interval"):
        load(env={}, overrides={"control_interval": 40})


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('lease = "long"\n', "lease"),
        ("lease = true\n", "lease"),
        ("pool_size = 2.5\n", "pool_size"),
        ('pool_size = "4"\n', "pool_size"),
        ("backoff = 5\n", "backoff"),
        ("backoff = []\n", "backoff"),
        ('backoff = [1, "x"]\n', "backoff"),
        ("log_level = 3\n", "log_level"),
        ("bogus_knob = 1\n", "bogus_knob"),
    ],
)
def test_file_wrong_types_and_unknown_keys_name_key_and_file(
    tmp_path: Path, text: str, key: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load(path, env={})
    assert key in str(err.value)
    assert str(path) in str(err.value)


@pytest.mark.parametrize(
    ("var", "value", "key"),
    [
        ("LEASEWORK_LEASE", "abc", "lease"),
        ("LEASEWORK_LEASE", "nan", "lease"),
        ("LEASEWORK_LEASE", "inf", "lease"),
        ("LEASEWORK_POOL_SIZE", "3.5", "pool_size"),
        ("LEASEWORK_BACKOFF", "1,x", "backoff"),
    ],
)
def test_env_wrong_types_name_key_and_variable(var: str, value: str, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(env={var: value})
    assert key in str(err.value)
    assert var in str(err.value)


def test_flag_wrong_type_and_unknown_flag() -> None:
    with pytest.raises(ConfigError, match="lease"):
        load(env={}, overrides={"lease": "soon"})
    with pytest.raises(ConfigError, match="no_such_setting"):
        load(env={}, overrides={"no_such_setting": 1})


def test_missing_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load(tmp_path / "absent.toml", env={})
    path = write(tmp_path, "lease = = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(path, env={})


def test_config_is_frozen() -> None:
    cfg = Config()
    with pytest.raises(AttributeError):
        cfg.lease = 1.0  # type: ignore[misc]
    assert cfg.replace(lease=10.0).lease == 10.0


def test_pooler_takes_auto_on_or_off_from_the_environment() -> None:
    assert load(env={}).pooler == "auto"
    assert load(env={"LEASEWORK_POOLER": "on"}).pooler == "on"
    with pytest.raises(ConfigError, match="pooler must be one of auto, on, off"):
        load(env={"LEASEWORK_POOLER": "pgbouncer"})


# -- sections: each stage and family declares its own settings beside it -----------------------


def test_a_sections_keys_are_flat_in_file_and_env_and_read_through_the_section(
    tmp_path: Path,
) -> None:
    from leasework import App
    from leasework.documents import Documents, IngestSettings
    from leasework.stages.maintenance import MaintenanceSettings

    app = App()
    app.use(Documents())  # the family declares its sections; the app's stages declare theirs
    path = write(tmp_path, "ingest_limit = 3\nretention_failed = 100\n")
    cfg = load(path, env={"LEASEWORK_INGEST_BATCH": "50"}, sections=app.sections())
    assert cfg.section(IngestSettings).ingest_limit == 3
    assert cfg.section(IngestSettings).ingest_batch == 50
    assert cfg.section(MaintenanceSettings).retention_failed == 100.0
    assert cfg.section(MaintenanceSettings).retention_succeeded == 7 * 86400.0  # its default
    # Not an attribute of Config: the error says where the setting lives.
    with pytest.raises(AttributeError, match=r"config.section\(IngestSettings\).ingest_limit"):
        cfg.ingest_limit  # noqa: B018


def test_a_sections_values_are_checked_like_the_engines(tmp_path: Path) -> None:
    from leasework.documents import Documents

    known = Documents.config_sections
    with pytest.raises(ConfigError, match=r"ingest_limit must be 1 to 100, got 0"):
        load(write(tmp_path, "ingest_limit = 0\n"), env={}, sections=known)
    with pytest.raises(ConfigError, match=r"file_store must be a directory path"):
        load(env={"LEASEWORK_FILE_STORE": ""}, overrides={"file_store": ""}, sections=known)
    with pytest.raises(ConfigError, match=r"unknown key 'ingest_limt'; did you mean `ingest_limit`"):
        load(write(tmp_path, "ingest_limt = 2\n"), env={}, sections=known)


def test_make_and_replace_route_keys_to_their_sections() -> None:
    from leasework import App
    from leasework.stages.runs import RunsSettings

    cfg = Config.make(lease=30, runs_limit=4, sections=[RunsSettings])
    assert (cfg.lease, cfg.section(RunsSettings).runs_limit) == (30, 4)
    other = cfg.replace(runs_limit=5)
    assert other.section(RunsSettings).runs_limit == 5
    assert cfg.section(RunsSettings).runs_limit == 4  # frozen: the first is unchanged
    with pytest.raises(ConfigError, match=r"unknown setting 'runs_limt'; did you mean `runs_limit`"):
        cfg.replace(runs_limt=5)
    # Made in code without its sections, a config keeps a section's keys for the section that
    # reads them; the app refuses one that none of its sections has when it assembles its stages.
    loose = Config.make(runs_limit=4)
    assert loose.section(RunsSettings).runs_limit == 4
    assert [s.name for s in App(loose).stages()] == ["schedule", "runs", "deps", "maintenance"]
    with pytest.raises(ConfigError, match=r"unknown setting 'runs_limt'; did you mean `runs_limit`"):
        App(loose.replace(runs_limt=5)).stages()


def test_a_new_section_is_declared_by_its_family_and_refuses_a_taken_key(
    tmp_path: Path,
) -> None:
    from dataclasses import dataclass, field

    from leasework import App
    from leasework.app import Family
    from leasework.config import Range, catalogue, doc, section

    @section("A test family", order=900)
    @dataclass(frozen=True)
    class BumpSettings:
        bump_limit: int = field(default=100, metadata=doc("bumped per poll", range=Range(1, 10)))

    class Bumps(Family):
        name = "bumps"
        config_sections = (BumpSettings,)

    app = App()
    app.use(Bumps())
    assert BumpSettings in app.sections()
    # The CLI's `prepare` returns what the named app declares, before any key is checked.
    named: list[Any] = []
    cfg = load(
        write(tmp_path, "bump_limit = 7\n"),
        env={},
        overrides={"app": "someapp:app"},
        prepare=lambda spec: named.append(spec) or app.sections(),
    )
    assert named == ["someapp:app"]
    assert cfg.section(BumpSettings).bump_limit == 7
    with pytest.raises(ConfigError, match=r"bump_limit must be 1 to 10, got 11"):
        load(env={"LEASEWORK_BUMP_LIMIT": "11"}, sections=app.sections())
    # Declared by no app or family the loader is told of, its key is unknown: nothing is
    # registered by defining (or importing) the class.
    with pytest.raises(ConfigError, match=r"unknown key 'bump_limit'"):
        load(write(tmp_path, "bump_limit = 7\n"), env={})

    with pytest.raises(TypeError, match=r"setting 'lease' is already the engine's"):

        @section("Another")
        @dataclass(frozen=True)
        class Clash:
            lease: float = 1.0

    @section("A second")
    @dataclass(frozen=True)
    class Twice:
        bump_limit: int = 1

    with pytest.raises(TypeError, match=r"setting 'bump_limit' is already .*BumpSettings's"):
        catalogue([BumpSettings, Twice])

    with pytest.raises(TypeError, match=r"frozen dataclass"):

        @section("Mutable")
        @dataclass
        class Mutable:
            thing: int = 1


def test_a_section_without_postponed_annotations_is_read_like_any_other() -> None:
    """A section written as the example stage is, in a module without `from __future__ import
    annotations`: its fields hold the types themselves, and a file or the environment sets them
    all the same."""
    namespace: dict[str, Any] = {}
    source = (
        "from dataclasses import dataclass, field\n"
        "from leasework.config import Range, doc, section\n"
        "@section('Plain')\n"
        "@dataclass(frozen=True)\n"
        "class Plain:\n"
        "    plain_limit: int = field(default=1, metadata=doc('x', range=Range(1, 10)))\n"
        "    plain_wait: float | None = field(default=None, metadata=doc('y'))\n"
    )
    exec(compile(source, "plain", "exec", dont_inherit=True), namespace)  # not this module's flags
    plain = namespace["Plain"]
    assert plain.__dataclass_fields__["plain_limit"].type is int
    env = {"LEASEWORK_PLAIN_LIMIT": "3", "LEASEWORK_PLAIN_WAIT": "2.5"}
    assert load(env=env, sections=[plain]).section(plain) == plain(3, 2.5)
    with pytest.raises(ConfigError, match=r"plain_limit must be 1 to 10, got 11"):
        load(env={"LEASEWORK_PLAIN_LIMIT": "11"}, sections=[plain])


def test_a_table_named_like_a_section_is_refused_with_the_flat_keys_hint(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown table \[runs\]: the keys are flat.*`runs_limit = \.\.\.`"):
        load(write(tmp_path, "[runs]\nruns_limit = 5\n"), env={})
