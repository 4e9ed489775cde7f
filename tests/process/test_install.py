"""README "Installing" and "Quick start", as written: the wheel built from this checkout (`pip
wheel --no-deps`), or the checkout itself (`pip install -e .`, the quick start's own line),
installed into a fresh virtualenv, then the quick start's own commands (read from the README)
run with that virtualenv's `leasework`, in a directory of their own, against a database of their
own that they create. The fresh virtualenv finds leasework's dependencies in
the test environment's site-packages (a path in a .pth file: no index needed for them), never
its leasework: the one imported is checked to be the one installed. Building fetches the build
backend (hatchling) from the package index unless it is installed here. About 20 s each."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def quick_start() -> list[str]:
    """The quick start's shell block, line by line (heredocs kept whole)."""
    (block,) = re.findall(r"```sh\n(.*?)```", section("Quick start").split("### ")[0], re.S)
    return block.splitlines()


def build_wheel(out: Path) -> Path:
    """`pip wheel --no-deps` of this checkout, as README "Installing" builds it."""
    # With the build backend installed here, no index is needed; else pip fetches it.
    isolation = ["--no-build-isolation"] if _has("hatchling") else []
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "--wheel-dir", str(out),
         str(ROOT)],
        capture_output=True, text=True, timeout=180, env=_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = out.glob("leasework-*.whl")
    return wheel


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _env(**extra: str) -> dict[str, str]:
    """The environment without this checkout on the path and without leasework's settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "PYTHONPATH" and not k.startswith(("LEASEWORK_", "PG")) and k != "DATABASE_URL"
    }
    env.update(extra)
    return env


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    """A fresh virtualenv (no pip of its own: this one's pip installs into it) that sees this
    environment's site-packages after its own, for leasework's dependencies."""
    where = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, env=_env(),
    ).stdout.strip()  # fmt: skip
    ours = sysconfig.get_paths()["purelib"]
    (Path(purelib) / "dependencies.pth").write_text(ours + "\n")
    return where


@pytest.fixture
def quickstart_db(server_dsn: str) -> Iterator[str]:
    """The name the quick start's `createdb` makes (unique per test), dropped afterwards."""
    name = f"lw_quickstart_{os.getpid()}_{secrets.token_hex(3)}"
    yield name
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def test_the_wheel_installs_and_runs_the_quick_start(
    tmp_path: Path, venv: Path, quickstart_db: str, server_dsn: str
) -> None:
    if shutil.which("createdb") is None:
        pytest.skip("the quick start's createdb (Postgres client tools) is not installed")
    wheel = build_wheel(tmp_path / "dist")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    assert "leasework/schema.sql" in names, "the wheel must carry schema.sql"
    assert any(n.startswith("leasework/migrations/0001_") for n in names)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
         str(wheel)],
        capture_output=True, text=True, timeout=120, env=_env(),
    )  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr
    assert imported_from(python, tmp_path).startswith(str(venv))
    run_quick_start(venv, tmp_path, server_dsn, quickstart_db)


def test_the_checkout_installs_editable_and_runs_the_quick_start(
    tmp_path: Path, venv: Path, quickstart_db: str, server_dsn: str
) -> None:
    """The quick start's own install line, `pip install -e .`, from this checkout."""
    if shutil.which("createdb") is None:
        pytest.skip("the quick start's createdb (Postgres client tools) is not installed")
    python = venv / "bin" / "python"
    isolation = ["--no-build-isolation"] if _has("hatchling") and _has("editables") else []
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
         *isolation, "-e", str(ROOT)],
        capture_output=True, text=True, timeout=180, env=_env(), cwd=ROOT,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr
    assert imported_from(python, tmp_path).startswith(str(ROOT / "leasework"))
    run_quick_start(venv, tmp_path, server_dsn, quickstart_db)


def imported_from(python: Path, cwd: Path) -> str:
    """Where `python` imports leasework from (outside this checkout, no PYTHONPATH)."""
    where = subprocess.run(
        [str(python), "-c", "import leasework; print(leasework.__file__)"],
        capture_output=True, text=True, cwd=cwd, env=_env(),
    )  # fmt: skip
    assert where.returncode == 0, where.stderr
    return where.stdout.strip()


def run_quick_start(venv: Path, tmp_path: Path, server_dsn: str, quickstart_db: str) -> None:
    """The quick start as written, but for what the test replaces (its virtualenv and install)
    and where it points (this test's server, directory and database)."""
    lines = quick_start()
    assert lines[0].startswith("python3 -m venv") and lines[1].startswith("pip install")
    server = conninfo_to_dict(server_dsn)
    host, port = server.get("host", "127.0.0.1"), server.get("port", "5432")
    user = server.get("user", "postgres")
    app_dir = tmp_path / "lw-app"
    script = "\n".join(lines[2:])
    for old, new in [
        ("-h 127.0.0.1 -U postgres", f"-h {host} -p {port} -U {user}"),
        ("postgresql://postgres@127.0.0.1/", f"postgresql://{user}@{host}:{port}/"),
        ("lw_quickstart", quickstart_db),
        ("/tmp/lw-app", str(app_dir)),
    ]:
        assert old in script, f"the quick start no longer says {old!r}"
        script = script.replace(old, new)
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env=_env(PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"),
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert re.search(r"^\d+$", done.stdout, re.M), f"enqueue printed no run id: {out}"
    assert "succeeded" in done.stdout, out
    # The run is in the quick start's own database.
    params = {**server, "dbname": quickstart_db}
    with psycopg.connect(**params) as conn:  # type: ignore[arg-type]
        row = conn.execute("SELECT status, result FROM leasework.runs").fetchone()
        assert row == ("succeeded", {"sent": 48})
