"""The lab's machinery end to end (common/classroom/lab.py, common/classroom/grade.py, LABS.md): the student edition and its grade.

A fresh edition builds, its stubs fail clearly, and it grades every task "not attempted" without a crash; this
repository passes every task this machine can run; one level's solutions copied back into the edition pass that
level; no line of a solution is left in the edition; and each classic bug of tests/plant_bugs.py, planted in a copy
of this repository, fails exactly one row of the grade table: its task's, or its level's where it lies outside
every task. Each grade runs in a process of its own, as `make grade` does.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from common.classroom import lab
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
    run = run_in(repo, sys.executable, "-m", "common.classroom.grade", "--json", str(out), *args)
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
            assert not lab.regions(name), f"{name} holds marked regions, but no task of common/classroom/lab.py is in it"
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
from common.nets.mlp import init_params
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
        expected = "needs GPU" if t.gpu and not gpu_available() else "pass"
        assert tasks[t.id]["status"] == expected, f"{t.id}: {tasks[t.id]}"


def test_one_levels_solutions_copied_back_pass_that_level(edition, tmp_path):
    copy = tmp_path / "lab"
    shutil.copytree(edition, copy, symlinks=True)
    for path in {t.path for t in lab.TASKS if t.level == 3 and t.path}:  # mlp.py and lenet.py
        shutil.copy(ROOT / path, copy / path)
    run, tasks = grade(copy, tmp_path / "grade.json", "--level", "3")
    assert run.returncode == 0, run.stdout[-3000:]
    assert {i: t["status"] for i, t in tasks.items()} == {t.id: "pass" for t in lab.TASKS if t.level == 3}


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


def owner(level: int, file: str, good) -> str | None:
    """The task whose regions hold a bug's correct code, else the level's row when its tasks are in that file (the
    row runs the level's own tests), else None: no task grades that code (LeNet's helpers outside its tasks, which
    tests/test_lenet.py checks)."""
    for t in lab.TASKS:
        bodies = [r.body for r in lab.regions(t.path) if r.task == t.id] if t.path == file else []
        if bodies and all(any(old in body for body in bodies) for old in (good if isinstance(good, tuple) else [good])):
            return t.id
    row = lab.level_row(level)
    return row.id if any(lab.task(n).path == file for n in row.needs) else None


def bug_params() -> list:
    """pytest.param per classic bug of a level with tasks, with the task it must fail; marked gpu where it needs one."""
    params = []
    for number, file, good, bad, what in BUGS:
        if lab.level_row(number) and (graded_by := owner(number, file, good)):
            task = lab.task(graded_by)
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
    assert {t["status"] for i, t in tasks.items() if i not in failed} <= {"pass", "blocked", "needs GPU"}, run.stdout


# ---- a self-contained edition ----


def test_the_edition_is_a_git_repository_of_one_commit_without_the_teachers_files(edition):
    log = run_in(edition, "git", "log", "--oneline")
    assert log.returncode == 0 and len(log.stdout.splitlines()) == 1, log.stdout + log.stderr
    assert run_in(edition, "git", "status", "--porcelain").stdout == ""  # everything in the commit
    for name in lab.WITHHELD:
        assert not (edition / name).exists(), f"{name} is the teacher's"
    assert (edition / lab.MARKER).is_file()
    for chapter in edition.glob("level*/chapter*.ipynb"):
        cells = json.loads(chapter.read_text())["cells"]
        assert not any(c.get("outputs") for c in cells), f"{chapter.name} ships outputs (they show the solutions)"


def test_code_in_the_edition_imports_only_the_editions_modules(edition):
    """From inside the edition, this repository's environment cannot import this repository's code: it fails loudly."""
    script = "import common, sys; print(common.__file__)"
    theirs = subprocess.run([sys.executable, "-c", script], cwd=edition / "level4_c", capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert theirs.returncode != 0 and "this is the student edition" in theirs.stderr, theirs.stdout + theirs.stderr
    own = run_in(edition, sys.executable, "-c", script)
    assert own.returncode == 0 and own.stdout.strip() == str(edition / "common" / "__init__.py"), own.stderr


def test_the_editions_cpu_chapters_run_with_the_stubs_filled_in(edition, tmp_path):
    """A student's edition, every CPU task written: its chapters run from top to bottom, results it lacks said so."""
    copy = tmp_path / "lab"
    shutil.copytree(edition, copy, symlinks=True)
    for name in lab.files_to_write():
        shutil.copy(ROOT / name, copy / name)
    make = run_in(copy, "make", "-s", "level4", f"PYTHON={sys.executable}")
    assert make.returncode == 0, make.stderr[-2000:]
    script = ("import json, sys\nfrom common.book import make as book\n"
              "for path in sys.argv[1:]:\n"
              "    notebook = book.execute(book.ROOT / path)\n"
              "    print(json.dumps([o.get('text', '') for c in notebook.cells if c.cell_type == 'code' "
              "for o in c.outputs]))\n")
    chapters = ["level1_pytorch/chapter.ipynb", "level3_numpy/chapter.ipynb", "level4_c/chapter.ipynb"]
    run = run_in(copy, sys.executable, "-c", script, *chapters, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "results/memory/leak.txt here" in run.stdout  # level 4's chapter says which result the edition lacks


# ---- feedback, integrity ----


HINTS = {  # a classic bug: (the check, the buggy function, what the hint must say)
    "no 1/B": ("test_softmax_xent_backward", "softmax_xent_backward",
               lambda p, y: (lambda d: (d.__setitem__((np.arange(len(y)), y), d[np.arange(len(y)), y] - 1), d)[1])(
                   p.copy()), {"B": 13}, "did you divide by the batch size?"),
    "no bias": ("test_linear_forward", "linear_forward", lambda x, w, b: x @ w.T, {"B": 13, "n_in": 37, "n_out": 5},
                "the bias is missing"),
    "transposed": ("test_linear_backward", "linear_backward", lambda dout, x, w: (
        dout @ w if w is not None else None, (dout.T @ x).T.copy(), dout.sum(axis=0)), {"B": 3, "n_in": 5, "n_out": 5},
        "transpose of the answer"),
    "mask from da": ("test_relu_backward", "relu_backward", lambda da, h: da * (da > 0), {},
                     "mask comes from its output gradient da"),
    "softmax overflow": ("test_softmax_xent_forward", "softmax_xent_forward", lambda z, y: (lambda e: (
        np.float32(np.mean(np.log(e.sum(1)) - np.log(e[np.arange(len(y)), y]))), e / e.sum(1, keepdims=True)))(
        np.exp(z)), {"B": 13, "n_out": 10, "scale": 1000.0}, "exp() overflowed"),
    "lr 0.2% off": ("test_sgd_update", "sgd_update", lambda params, grads, lr: [
        params[n].__isub__(np.float32(lr * 1.002) * g) for n, g in grads.items()], {}, "1.002 times lr * grad"),
    "sum over the wrong axis": ("test_linear_backward", "linear_backward", lambda dout, x, w: (
        dout @ w if w is not None else None, dout.T @ x, dout.sum(axis=1)), {"B": 13, "n_in": 37, "n_out": 5},
        "summed over the wrong axis"),
}


@pytest.mark.parametrize("bug", HINTS)
def test_each_classic_bug_gets_its_hint(bug):
    import types
    import warnings

    import test_tasks
    from level3_numpy import mlp

    check, function, buggy, sizes, hint = HINTS[bug]
    layers = types.SimpleNamespace(**{name: getattr(mlp, name) for name in dir(mlp) if not name.startswith("_")})
    setattr(layers, function, buggy)
    arguments = {"layers": layers, **sizes}
    if "n_in" in sizes:
        arguments["images"] = np.zeros((64, 784), np.float32)
    with warnings.catch_warnings(), pytest.raises(AssertionError) as failure:
        warnings.simplefilter("ignore")
        getattr(test_tasks, check)(**arguments)
    assert hint in str(failure.value), str(failure.value)


CHAPTERS = {"level 2's": "level2_theory/chapter.ipynb", "LeNet's": "level3_numpy/chapter_lenet.ipynb"}


def section_headings(chapter: str) -> dict[str | None, list[str]]:
    """A chapter's headings by section number ("2" for "## 2. Title" and the headings under it)."""
    cells = json.loads((ROOT / chapter).read_text())["cells"]
    headings = [line.lstrip("#").strip().replace("$", "") for c in cells if c["cell_type"] == "markdown"
                for line in "".join(c["source"]).splitlines() if line.startswith("#")]
    section, titles = None, {}
    for heading in headings:
        if match := re.match(r"(\d+)\. ", heading):
            section, heading = match[1], heading[match.end():]
        titles.setdefault(section, []).append(heading)
    return titles


def test_each_hint_points_at_a_section_that_exists():
    """Every "(level 2's chapter, section N, 'Title')" of the checks' hints, or LeNet's, names a heading there."""
    import test_tasks

    hints = [v for k, v in vars(test_tasks).items() if k.isupper() and isinstance(v, str) and "chapter, section" in v]
    pointers = [p for hint in hints for p in re.findall(r"(level 2's|LeNet's) chapter, section (\d+), '([^']+)'", hint)]
    assert len(pointers) == len(hints) >= 12
    for whose, number, title in pointers:
        titles = section_headings(CHAPTERS[whose])
        assert any(h.startswith(title) for h in titles.get(number, [])), \
            f"{CHAPTERS[whose]}: section {number} has no heading '{title}'"


def test_a_task_that_calls_pytorch_is_refused(tmp_path):
    copy = tmp_path / "repo"
    (copy / "level3_numpy").mkdir(parents=True)
    text = (ROOT / "level3_numpy" / "mlp.py").read_text()
    (copy / "level3_numpy" / "mlp.py").write_text(text.replace(
        "    return x @ w.T + b\n", "    import torch\n    return torch.nn.functional.linear(x, w, b)\n", 1))
    assert "uses torch" in lab.forbidden_use(lab.task("3.1"), copy)
    assert lab.forbidden_use(lab.task("3.1"), ROOT) is None
    c = (ROOT / "level4_c" / "mlp.c").read_text()
    (copy / "level4_c").mkdir()
    (copy / "level4_c" / "mlp.c").write_text(c.replace("    /* BEGIN LAB 4.1 linear_forward */\n",
                                                       "    /* BEGIN LAB 4.1 linear_forward */\n    cblas_sgemm();\n", 1))
    assert "cblas" in lab.forbidden_use(lab.task("4.1"), copy)


# ---- GPU tasks, for a student without a GPU ----


def test_the_hosted_gpu_notebook_runs_real_commands():
    """grade_on_gpu.ipynb is a valid notebook whose make targets and options exist here."""
    nbformat = pytest.importorskip("nbformat", reason="reading the notebook needs nbformat")
    notebook = nbformat.read(ROOT / "grade_on_gpu.ipynb", as_version=4)
    nbformat.validate(notebook)
    code = "\n".join(c.source for c in notebook.cells if c.cell_type == "code")
    makefile = (ROOT / "Makefile").read_text()
    targets = {t for line in re.findall(r"!make -s ([^\n]*)", code) for t in line.split() if "=" not in t}
    assert targets and all(re.search(rf"^{re.escape(t)}\s*:", makefile, re.M) for t in targets), targets
    assert "make -s grade LEVEL=$number PYTHON=python3" in code and "LEVEL" in makefile


# ---- the teacher's gradebook ----


def test_the_workers_answers_carry_numbers_and_never_code():
    """The codec between the grader and a submission's worker: arrays, numbers and text round-trip exactly; an
    answer that claims an array of objects, of records, or bytes it does not hold is refused."""
    import struct

    from common.classroom.sandbox import WorkerError, decode, encode

    message = {"out": np.arange(6, dtype=np.float32).reshape(2, 3).T, "loss": np.float32(0.25),
               "rest": (np.zeros((0, 3)), "text", None, 1.5, [np.int32(7)])}
    back = decode(encode(message))
    assert back["out"].dtype == np.float32 and np.array_equal(back["out"], message["out"]) and back["out"].flags.writeable
    assert back["loss"] == np.float32(0.25) and back["rest"][1:4] == ("text", None, 1.5) and back["rest"][4] == [7]
    for forged in ({"dtype": "O", "shape": [1]}, {"dtype": "i4,f8", "shape": [1]}, {"dtype": "<f4", "shape": [99]},
                   {"dtype": "<f4", "shape": [-1]}, {"dtype": "nonsense", "shape": [1]}):
        head = json.dumps({"__array__": 0, **forged}).encode()
        with pytest.raises(WorkerError):
            decode(struct.pack("<Q", len(head)) + head + b"\0" * 8)
    with pytest.raises(TypeError):
        encode({"code": print})


@pytest.fixture(scope="module")
def gradebook(tmp_path_factory):
    """The gradebook of a small class of level 3 (tests/lab_submissions.py): correct, stubbed, a planted bug, and
    each hostile kind; its students' kinds, its CSV rows by student, and this repository's files before it ran."""
    shipped()
    import lab_submissions

    folder = tmp_path_factory.mktemp("class")
    kinds = lab_submissions.write(folder / "subs", 4, levels=(3,))  # correct, stubbed and two planted bugs
    for i, kind in enumerate(lab_submissions.HOSTILE):
        student = folder / "subs" / f"hostile{i}"
        (student / "level3_numpy").mkdir(parents=True)
        (student / "level3_numpy" / "mlp.py").write_text(lab_submissions.hostile(kind))
        kinds[student.name] = f"hostile: {kind}"
    before = {name: (ROOT / name).read_bytes() for name in shipped() if name.startswith("tests/")}
    before_subs = {p: p.read_bytes() for p in (folder / "subs").rglob("*") if p.is_file()}
    run = subprocess.run([sys.executable, "-m", "common.classroom.gradebook", str(folder / "subs"), "--out",
                          str(folder / "book"), "--level", "3", "--jobs", "2", "--timeout", "600"], cwd=ROOT,
                         capture_output=True, text=True, timeout=1500, env={**os.environ, "LAB_CALL_TIMEOUT_S": "20"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = {}
    with (folder / "book" / "grades.csv").open() as f:
        for row in csv.DictReader(f):
            rows.setdefault(row["student"], {})[row["task"]] = row
    return kinds, rows, before, before_subs, folder


def test_the_gradebook_grades_each_kind_of_submission(gradebook):
    kinds, rows, _, _, folder = gradebook
    by_kind = {kind: rows[student] for student, kind in kinds.items()}
    assert set(rows) == set(kinds)
    assert all(t["status"] == "pass" for t in by_kind["correct"].values())
    assert all(t["status"] == "not attempted" for t in by_kind["stubbed"].values())
    for kind, grade in by_kind.items():
        failed = {task for task, t in grade.items() if t["status"] == "FAIL"}
        if kind.startswith("bug: "):
            assert failed, f"{kind} passed"
        if kind.startswith("hostile: ") and kind not in ("hostile: uses torch", "hostile: deletes"):
            assert failed == {"3.1"}, (kind, grade)  # each breaks linear_forward, gets zero for it, and no more
    torch = by_kind["hostile: uses torch"]  # the whole file is refused, and the level's row waits for it; the
    # level's other file (LeNet's) is a stub there
    refused = lab.task("3.1").path
    assert {task: t["status"] for task, t in torch.items()} == {
        t.id: "blocked" if t.path is None else "FAIL" if t.path == refused else "not attempted"
        for t in lab.TASKS if t.level == 3}
    deletes = by_kind["hostile: deletes"]  # it deleted its own copy only
    assert {t["status"] for t in deletes.values()} <= {"pass", "FAIL", "blocked", "not attempted"}
    assert "uses torch" in by_kind["hostile: uses torch"]["3.1"]["note"]
    assert "no answer after 20 s" in by_kind["hostile: hangs"]["3.1"]["note"]
    assert "held_out" in by_kind["hostile: fits the visible checks"]["3.1"]["note"]  # the visible checks pass it
    summary = (folder / "book" / "summary.md").read_text()
    assert "| 3.1 | linear_forward |" in summary and (folder / "book" / "summary.png").stat().st_size > 0


@pytest.mark.skipif(not __import__("common.classroom.sandbox", fromlist=["sandbox"]).namespaces_work(),
                    reason="this machine allows no user namespace: the worker cannot be kept from the grader's files")
def test_the_gradebook_keeps_the_graders_files_and_the_other_submissions_safe(gradebook):
    _, _, before, before_subs, _ = gradebook
    assert all((ROOT / name).read_bytes() == data for name, data in before.items())  # the held-out checks included
    assert all(path.read_bytes() == data for path, data in before_subs.items())


def test_a_fitted_solution_passes_the_visible_checks_only(edition, tmp_path):
    import lab_submissions

    copy = tmp_path / "lab"
    shutil.copytree(edition, copy, symlinks=True)
    (copy / "level3_numpy" / "mlp.py").write_text(lab_submissions.hostile("fits the visible checks"))
    _, tasks = grade(copy, tmp_path / "grade.json", "--task", "3.1")
    assert tasks["3.1"]["status"] == "pass"  # the student's own grade: the edition has no held-out checks
