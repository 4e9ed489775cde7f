"""The import contracts cover every module: each top-level module or package of leasework has a
place in the layers contract (pyproject.toml), and every package with modules of its own is in
the no-cycle contract, so a new room cannot be added without saying where it stands."""

from __future__ import annotations

import pkgutil
import tomllib
from pathlib import Path

import leasework

ROOT = Path(__file__).resolve().parents[2]


def _contracts() -> list[dict[str, object]]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts: list[dict[str, object]] = data["tool"]["importlinter"]["contracts"]
    return contracts


def _layered() -> set[str]:
    (layers,) = [c for c in _contracts() if c["type"] == "layers"]
    names: set[str] = set()
    for layer in layers["layers"]:  # type: ignore[attr-defined]
        for part in str(layer).replace(":", "|").split("|"):
            names.add(part.strip())
    return names


def test_every_top_level_module_has_a_layer() -> None:
    modules = {f"leasework.{m.name}" for m in pkgutil.iter_modules(leasework.__path__)}
    missing = modules - _layered()
    assert not missing, f"not in the layers contract (pyproject.toml): {sorted(missing)}"


def test_every_package_is_checked_for_cycles() -> None:
    (acyclic,) = [c for c in _contracts() if c["type"] == "acyclic_siblings"]
    packages = {"leasework"} | {
        f"leasework.{m.name}"
        for m in pkgutil.iter_modules(leasework.__path__)
        if m.ispkg and len(list(pkgutil.iter_modules([str(ROOT / "leasework" / m.name)]))) > 1
    }
    missing = packages - set(acyclic["ancestors"])  # type: ignore[arg-type]
    assert not missing, f"not in the no-cycle contract (pyproject.toml): {sorted(missing)}"
