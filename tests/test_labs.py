"""The lab's machinery end to end (common/lab.py, common/grade.py, LABS.md): the student edition and its grade.

A fresh edition builds, its stubs fail clearly, and it grades every task "not attempted" without a crash; this
repository passes every task this machine can run; one level's solutions copied back into the edition pass that
level; no line of a solution is left in the edition; and each classic bug of tests/plant_bugs.py, planted in a copy
of this repository, fails exactly one row of the grade table: its task's, or its level's where it lies outside
every task. Each grade runs in a process of its own, as `make grade` does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common import lab
from common.levels import ROOT, gpu_available
from plant_bugs import BUGS, apply, scratch_copy

pytestmark = pytest.mark.lab


def shipped() -> list[str]:
    """lab.shipped(), or a skip where this copy of the repository is not a git checkout (a copy without .git)."""
    try:
        return lab.shipped()
    except lab.NotACheckout as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def edition(tmp_path_factory) -> Path:
    """A fresh student edition, with this repository's MNIST linked in (as a student's `make grade` would fetch it)."""
    shipped()  # skips where there is nothing to make it from
    out = tmp_path_factory.mktemp("edition") / "lab"
    lab.write_edition(out)
    if (ROOT / "data").exists():
        (out / "data").symlink_to(ROOT / "data")
    return out


def run_in(repo: Path, *command: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """A command in the repository (or edition) at repo, importing its own code."""
    path = os.pathsep.join(filter(None, (str(repo), os.environ.get("PYTHONPATH"))))  # keeps where cffi may live
    env = {**os.environ, "PYTHONPATH": path, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(command, cwd=repo, capture_output=True, text=True, env=env, timeout=timeout)


def grade(repo: Path, out: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict[str, dict]]:
    """`make grade` of the repository at repo, in a process of its own: the run, and the tasks of grade.json (out)."""
    run = run_in(repo, sys.executable, "-m", "common.grade", "--json", str(out), *args)
    assert "Traceback" not in run.stderr + run.stdout, run.stderr[-3000:] + run.stdout[-3000:]
    return run, {t["id"]: t for t in json.loads(out.read_text())["tasks"]}


def test_the_markers_are_the_list():
    """Every task has its marked regions in its file, with its name; no file holds a region of a task not listed."""
    for t in lab.TASKS:
        if t.path:
            mine = [r for r in lab.regions(t.path) if r.task == t.id]
            assert mine and all(r.name == t.name for r in mine), f"{t.id}: regions {[r.name for r in mine]}"
    marked = {t.path for t in lab.TASKS if t.path}
    for name in shipped():
        if lab.language(name) and name not in marked and not name.startswith("common/lab"):
            assert not lab.regions(name), f"{name} holds marked regions, but no task of common/lab.py is in it"
        if name in marked:
            assert {r.task for r in lab.regions(name)} <= {t.id for t in lab.TASKS if t.path == name}, name


def test_a_fresh_edition_grades_every_task_not_attempted(edition, tmp_path):
    run, tasks = grade(edition, tmp_path / "grade.json")
    assert run.returncode == 0, run.stdout[-3000:]
    assert {t["status"] for t in tasks.values()} == {"not attempted"}, run.stdout
    assert set(tasks) == {t.id for t in lab.TASKS}


def test_a_fresh_edition_builds_and_its_stubs_fail_clearly(edition):
    """The stubs compile with the warnings as errors, and each says which task is not written yet."""
    build = run_in(edition, "make", "-s", "level4", "build/lab_level4.so", f"PYTHON={sys.executable}")
    assert build.returncode == 0, build.stderr[-3000:]
    script = """
import numpy as np
from common.model import init_params
from common.native import NativeError
from level3_numpy import mlp
try:
    mlp.linear_forward(np.ones((2, 3), np.float32), np.ones((4, 3), np.float32), np.ones(4, np.float32))
except NotImplementedError as e:
    print(e)
try:
    import level4_c
    level4_c.MLP(init_params(0))
except NativeError as e:
    print(e)
"""
    run = run_in(edition, sys.executable, "-c", script)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "lab 3.1: linear_forward is not written yet" in run.stdout
    assert "level4_c/mlp.c" in run.stdout and "lab 4.9: mlp_create (the model) is not written yet" in run.stdout


@pytest.mark.skipif(not shutil.which("nvcc"), reason="building the CUDA levels needs nvcc")
def test_a_fresh_editions_cuda_levels_build(edition):
    """Levels 5-7 and their lab libraries, from the stubs, warnings as errors (one GPU architecture, to be quick)."""
    targets = ["level5", "level6", "level7", "build/lab_level5.so", "build/lab_level7.so"]
    build = run_in(edition, "make", "-s", *targets, f"PYTHON={sys.executable}",
                   "CUDA_ARCH=-gencode arch=compute_90,code=sm_90")
    assert build.returncode == 0, build.stderr[-3000:]


def test_this_repository_passes_every_task_it_can_run(tmp_path):
    run, tasks = grade(ROOT, tmp_path / "grade.json")
    assert run.returncode == 0, run.stdout[-3000:]
    for t in lab.TASKS:
        expected = "skipped" if t.gpu and not gpu_available() else "pass"
        assert tasks[t.id]["status"] == expected, f"{t.id}: {tasks[t.id]}"


def test_one_levels_solutions_copied_back_pass_that_level(edition, tmp_path):
    copy = tmp_path / "lab"
    shutil.copytree(edition, copy, symlinks=True)
    shutil.copy(ROOT / "level3_numpy" / "mlp.py", copy / "level3_numpy" / "mlp.py")
    run, tasks = grade(copy, tmp_path / "grade.json", "--level", "3")
    assert run.returncode == 0, run.stdout[-3000:]
    chapter = {t.id for t in lab.TASKS if t.path and t.path.endswith(".ipynb")}
    assert {i: t["status"] for i, t in tasks.items()} == {
        t.id: "not attempted" if t.id in chapter else "pass" for t in lab.TASKS if t.level == 3}


def solution_lines() -> set[str]:
    """The lines of every marked region that the complete repository has nowhere else (code it shares with given
    code, such as `return MLP_OK;`, is not a solution's)."""
    inside = {line.strip() for t in lab.TASKS if t.path for r in lab.regions(t.path) if r.task == t.id
              for line in r.body.splitlines() if line.strip()}
    outside = set()
    for name in shipped():
        path = ROOT / name
        text = lab.strip_file(path) if lab.language(name) else path.read_text(errors="replace")
        outside.update(line.strip() for line in _lines(name, text))
    return inside - outside


def _lines(name: str, text: str) -> list[str]:
    """A file's lines, a notebook's those of its cells."""
    if name.endswith(".ipynb"):
        return [line for cell in json.loads(text)["cells"] for line in "".join(cell["source"]).splitlines()]
    return text.splitlines()


def test_no_line_of_a_solution_is_in_the_edition(edition):
    solutions = solution_lines()
    assert len(solutions) > 150  # the regions' own lines, the notebooks' included
    found = []
    for path in edition.rglob("*"):
        if path.is_file() and "data" not in path.relative_to(edition).parts:
            name = str(path.relative_to(edition))
            found += [f"{name}: {line.strip()}" for line in _lines(name, path.read_text(errors="replace"))
                      if line.strip() in solutions]
    assert not found, "\n".join(found[:20])


def owner(level: int, file: str, good) -> str:
    """The task whose regions hold a bug's correct code, or the level's row when no task's do."""
    for t in lab.TASKS:
        bodies = [r.body for r in lab.regions(t.path) if r.task == t.id] if t.path == file else []
        if bodies and all(any(old in body for body in bodies) for old in (good if isinstance(good, tuple) else [good])):
            return t.id
    return lab.level_row(level).id


def bug_params() -> list:
    """pytest.param per classic bug of a level with tasks, with the task it must fail; marked gpu where it needs one."""
    params = []
    for number, file, good, bad, what in BUGS:
        if lab.level_row(number):
            task = lab.task(owner(number, file, good))
            marks = [pytest.mark.gpu] if task.gpu else []
            params.append(pytest.param(number, file, good, bad, task, marks=marks, id=f"{number}-{what}"))
    return params


@pytest.mark.parametrize("number, file, good, bad, task", bug_params())
def test_a_planted_bug_fails_exactly_its_task(number, file, good, bad, task, request, tmp_path):
    if task.gpu and not gpu_available():
        if request.config.getoption("--require-gpu"):
            pytest.fail(f"task {task.id} needs an NVIDIA GPU")
        pytest.skip(f"task {task.id} needs an NVIDIA GPU (none visible)")
    repo = scratch_copy()
    try:
        apply(repo, file, good, bad, task.name)
        run, tasks = grade(repo, tmp_path / "grade.json", "--level", str(number))
    finally:
        shutil.rmtree(repo.parent)
    failed = {i for i, t in tasks.items() if t["status"] == "FAIL"}
    assert failed == {task.id}, run.stdout
    assert run.returncode == 1
    assert {t["status"] for i, t in tasks.items() if i not in failed} <= {"pass", "blocked", "skipped"}, run.stdout
