"""Every chapter notebook runs from top to bottom, and is committed clean (no outputs, no execution counts).

The chapters are found by glob, level*/chapter.ipynb, so a new one is tested without editing this file. Each test is
marked `notebooks` and its level's marker (from the folder name, levelN_...), so `pytest -m level3` also runs level 3's
chapter. Executing needs nbclient and ipykernel (the `test` extra); where they are missing those tests skip, saying so.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.levels import ROOT

CHAPTERS = sorted(ROOT.glob("level*/chapter.ipynb"))


def chapter_params() -> list:
    """One pytest.param per chapter, marked `notebooks` and levelN."""
    params = []
    for path in CHAPTERS:
        marker = getattr(pytest.mark, path.parent.name.split("_")[0])
        params.append(pytest.param(path, marks=[pytest.mark.notebooks, marker], id=path.parent.name))
    return params


@pytest.mark.parametrize("path", chapter_params())
def test_chapter_runs(path: Path):
    nbformat = pytest.importorskip("nbformat", reason="executing the chapters needs nbformat: pip install -e '.[test]'")
    nbclient = pytest.importorskip("nbclient", reason="executing the chapters needs nbclient: pip install -e '.[test]'")
    pytest.importorskip("ipykernel", reason="executing the chapters needs ipykernel: pip install -e '.[test]'")
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()  # a failing cell raises CellExecutionError, with the cell and its traceback


@pytest.mark.parametrize("path", chapter_params())
def test_chapter_is_committed_without_outputs(path: Path):
    notebook = json.loads(path.read_text())
    dirty = [
        i
        for i, cell in enumerate(notebook["cells"])
        if cell.get("outputs") or cell.get("execution_count") is not None
    ]
    assert not dirty, (
        f"{path.relative_to(ROOT)}: cells {dirty} hold outputs or execution counts; clear them with "
        f"`jupyter nbconvert --clear-output --inplace {path.relative_to(ROOT)}`"
    )
    assert notebook["metadata"]["kernelspec"]["name"] == "python3", "the tests run chapters with the python3 kernel"
