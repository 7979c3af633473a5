"""common/'s rooms and the levels: imports in one direction, as pyproject.toml's import-linter contract states them.

    nets <- levels <- contract <- native <- the levels' packages (level 8 above the others) <- harness <- classroom | book

A lower room never imports a higher one, so each can be read, tested and reused without the ones above it. The
contract is checked here, so a wrong arrow fails the suite; and a planted one is shown to fail it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.levels import LEVELS, ROOT

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
CONTRACT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter's verdict on the packages under root, by its contract in root's pyproject.toml."""
    command = Path(sys.executable).with_name("lint-imports")
    if not command.exists():
        pytest.skip("import-linter is not installed: pip install -e '.[test]'")
    return subprocess.run([str(command), "--no-cache"], cwd=root, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)})


def test_imports_go_one_way():
    run = lint_imports(ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "1 kept, 0 broken" in run.stdout


def test_a_lower_room_importing_a_higher_one_fails(tmp_path):
    """The contract bites: the MLP's definition importing the harness breaks it, and the report names the arrow."""
    for package in CONTRACT["root_packages"]:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("*.so", "*.ipynb", "*.cu*"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    planted = tmp_path / "common" / "nets" / "mlp.py"
    planted.write_text(planted.read_text() + "\nfrom common.harness import verify  # noqa: E402, F401\n")
    run = lint_imports(tmp_path)
    assert run.returncode != 0 and "0 kept, 1 broken" in run.stdout
    assert "common.nets.mlp -> common.harness.verify" in run.stdout


def test_the_contract_lists_every_level():
    """The levels' layer and root packages are common/levels.py's list, no more and no less."""
    packages = {lv.package for lv in LEVELS}
    assert packages <= set(CONTRACT["root_packages"])
    assert set(CONTRACT["root_packages"]) - packages == {"common"}
    in_layers = {name.strip() for layer in CONTRACT["contracts"][0]["layers"] for name in layer.split("|")}
    assert {name for name in in_layers if not name.startswith("common")} == packages
