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
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import pytest

from common.classroom import bwrap, lab
from common.classroom import grade as grader
from common.levels import ROOT, gpu_available
from plant_bugs import ADAM_BUGS, BUGS, apply, scratch_copy

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
from level2_theory.autograd import Value
from level8_framework import Tensor
for stub in (lambda: (Value(2.0) * 3.0).backward(), lambda: Tensor([1.0], requires_grad=True).mean().backward()):
    try:
        stub()
    except NotImplementedError as e:
        print(e)
"""
    run = run_in(edition, sys.executable, "-c", script)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "lab 3.1: linear_forward is not written yet" in run.stdout
    assert "lab 2.7: backward is not written yet" in run.stdout
    assert "lab 8.1: run_backward (autograd) is not written yet" in run.stdout
    assert "level4_c/mlp.c" in run.stdout and "lab 4.9: mlp_create (the model) is not written yet" in run.stdout


@pytest.mark.skipif(not shutil.which("nvcc"), reason="building the CUDA levels needs nvcc")
def test_a_fresh_editions_cuda_levels_build(edition):
    """Levels 5-7 and their lab libraries, from the stubs, warnings as errors (one GPU architecture, to be quick)."""
    targets = ["level5", "level6", "level7", "build/lab_level5.so", "build/lab_level7.so"]
    build = run_in(edition, "make", "-s", *targets, f"PYTHON={sys.executable}",
                   "CUDA_ARCH=-gencode arch=compute_90,code=sm_90")
    assert build.returncode == 0, build.stderr[-3000:]


def level_params() -> list:
    """A pytest.param per level of the lab, marked gpu where one of its tasks needs a GPU (`make test-gpu` runs it)."""
    levels = sorted({t.level for t in lab.TASKS})
    return [pytest.param(n, marks=[pytest.mark.gpu] if any(t.gpu for t in lab.TASKS if t.level == n) else [],
                         id=f"level{n}") for n in levels]


@pytest.mark.parametrize("number", level_params())
def test_this_repository_passes_every_task_it_can_run(number, tmp_path):
    run, tasks = grade(ROOT, tmp_path / "grade.json", "--level", str(number))
    assert run.returncode == 0, run.stdout[-3000:]
    for t in (t for t in lab.TASKS if t.level == number):
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


def owner(level: int, file: str, good, by_row: bool = True) -> str | None:
    """The task whose regions hold a bug's correct code (of any level: level 8's Adam is level 3's adam_update), else
    the level's row when its tasks are in that file (the row runs the level's own tests), else None: no task grades
    that code (LeNet's helpers outside its tasks, which tests/test_lenet.py checks; level 8's, which has no row; code
    the row's tests do not run, by_row False: Adam's outside adam_update, since the rows train with SGD, which
    tests/test_optimizers.py checks)."""
    for t in lab.TASKS:
        bodies = [r.body for r in lab.regions(t.path) if r.task == t.id] if t.path == file else []
        if bodies and all(any(old in body for body in bodies) for old in (good if isinstance(good, tuple) else [good])):
            return t.id
    row = lab.level_row(level)
    return row.id if row and by_row and any(lab.task(n).path == file for n in row.needs) else None


def bug_params() -> list:
    """pytest.param per classic bug of a level with tasks, with the task it must fail; marked gpu where it needs one."""
    params = []
    for number, file, good, bad, what in BUGS:
        by_row = (file, good, bad, what) not in ADAM_BUGS  # the rows' tests train with SGD
        if any(t.level == number for t in lab.TASKS) and (graded_by := owner(number, file, good, by_row)):
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
        run, tasks = grade(repo, tmp_path / "grade.json", "--level", str(task.level))
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


AUTOGRAD, TENSOR, CPU, NUMPY = "level2_theory.autograd", "level8_framework.tensor", "level8_framework.cpu", \
    "level3_numpy.mlp"
FAN_OUT = {"expression": "fan_out", "length": 0}
MATMUL_SQUARE = {"M": 5, "K": 5, "N": 5, "a_view": False, "b_view": False}
STEP_1 = {"step": 1, "hyper": {}}
# A classic bug: (its module, the correct code, the buggy code, the check, the check's arguments, the hint's words).
ENGINE_HINTS = {
    "a node listed twice": (AUTOGRAD, "        if id(node) in visited:\n            continue\n", "",
                            "test_scalar_topological_order", FAN_OUT, "listed twice"),
    "a recursive sort": (AUTOGRAD, None, None, "test_scalar_topological_order",
                         {"expression": "chain", "length": 5_000}, "stops at Python's limit of 1,000 nested calls"),
    "a gradient overwritten": (AUTOGRAD, "parent.grad += local * node.grad", "parent.grad = local * node.grad",
                               "test_scalar_backward_adds_every_contribution", {},
                               "overwritten instead of accumulated"),
    "the order walked the wrong way": (AUTOGRAD, "for node in reversed(order):", "for node in order:",
                                       "test_scalar_backward_adds_every_contribution", {}, "no gradient reached"),
    "grads not zeroed": (AUTOGRAD, "node.grad = 0.0", "node.grad += 0.0", "test_scalar_backward", FAN_OUT,
                         "set every grad of the graph to 0"),
    "log-sum-exp without the max": (AUTOGRAD, "m = Value(max(v.data for v in z))", "m = Value(0.0)",
                                    "test_scalar_log_softmax_nll", {"B": 3, "C": 10, "scale": 1000.0},
                                    "exp() overflowed"),
    "the max not added back": (AUTOGRAD, "return m + total.log()", "return total.log()", "test_scalar_log_softmax_nll",
                               {"B": 4, "C": 3, "scale": 3.0}, "must add it back"),
    "a tensor listed twice": (TENSOR, "        elif id(t) not in visited:\n", "        elif True:\n",
                              "test_tensor_topological_order", FAN_OUT, "listed twice"),
    "a tensor that requires no grad listed": (TENSOR, "if i.requires_grad and id(i) not in visited:",
                                              "if id(i) not in visited:", "test_tensor_topological_order",
                                              FAN_OUT, "requires no grad"),
    "a tensor's gradient overwritten": (TENSOR, "grads[key] = i.backend.add(grads[key], gi)", "grads[key] = gi",
                                        "test_tensor_backward_adds_every_contribution", {},
                                        "overwritten instead of accumulated"),
    "the tensors' order walked the wrong way": (TENSOR, "for t in reversed(order):", "for t in order:",
                                                "test_tensor_backward_adds_every_contribution", {},
                                                "no gradient reached"),
    ".grad replaced": (TENSOR, "if t.grad is None else _new(", "if True else _new(", "test_tensor_backward", FAN_OUT,
                       "replaced .grad instead of adding"),
    "the graph never freed": (TENSOR, "node.inputs, node.backward = (), None", "node.inputs = node.inputs",
                              "test_tensor_backward", FAN_OUT, "did not raise"),
    "matmul's db transposed": (CPU, "else a.T @ g", "else g.T @ a", "test_matmul_backward", MATMUL_SQUARE,
                               "transpose of the answer"),
    "a view's gradient not in its layout": (CPU, "db = (g.T @ a).T if transposed(b) else a.T @ g", "db = a.T @ g",
                                            "test_matmul_backward", {**MATMUL_SQUARE, "b_view": True},
                                            "not laid out as the view"),
    "broadcast axes not summed": (CPU, ("return g.sum(axis=0)", "return g.sum(axis=axes).reshape(shape)"),
                                  ("return g[0]", "return g[(0,) * lead].reshape(shape)"), "test_broadcast_backward",
                                  {"g_shape": (13, 37), "shape": (37,)}, "broadcast axes are not summed"),
    "stretched axes not summed": (CPU, "return g.sum(axis=axes).reshape(shape)",
                                  "return g.sum(axis=tuple(range(lead)))", "test_broadcast_backward",
                                  {"g_shape": (2, 3, 5, 4), "shape": (3, 1, 1)}, "leading axes only"),
    "the mean, not the sum": (CPU, "return g.sum(axis=axes).reshape(shape)", "return g.mean(axis=axes).reshape(shape)",
                              "test_broadcast_backward", {"g_shape": (2, 3, 5, 4), "shape": (3, 1, 1)},
                              "the mean over the broadcast axes"),
    "Adam's eps inside the square root": (NUMPY, "np.sqrt(v) / np.float32(bias_correction2_sqrt) + np.float32(eps)",
                                          "np.sqrt(v + np.float32(eps)) / np.float32(bias_correction2_sqrt)",
                                          "test_adam_update", STEP_1, "eps went inside the square root"),
    "Adam without bias correction": (NUMPY, ("bias_correction1 = 1 - beta1**step",
                                             "bias_correction2_sqrt = (1 - beta2**step) ** 0.5"),
                                     ("bias_correction1 = 1", "bias_correction2_sqrt = 1.0"), "test_adam_update",
                                     {"step": 1000, "hyper": {}}, "no bias correction"),
    "Adam's moment not in place": (NUMPY, "m += np.float32(1 - beta1) * (grad - m)",
                                   "m = m + np.float32(1 - beta1) * (grad - m)", "test_adam_update", STEP_1,
                                   "exp_avg fc1.weight is as it was"),
}


def with_bug(name: str, good, bad) -> types.ModuleType:
    """A fresh copy of a module with a bug planted in its source (the module itself is left as it is)."""
    import importlib.util

    from plant_bugs import edits

    path = importlib.util.find_spec(name).origin
    text = Path(path).read_text()
    for old, new in edits(good, bad):
        assert text.count(old) == 1, f"{name}: expected one {old!r}"
        text = text.replace(old, new)
    module = types.ModuleType(name)
    module.__file__ = path
    exec(compile(text, path, "exec"), module.__dict__)  # noqa: S102 - this repository's own source, with a bug
    return module


def recursive_order(root) -> list:
    """A topological order by recursion, the classic one: it stops at Python's 1,000 nested calls."""
    order, seen = [], set()

    def visit(node):
        if id(node) not in seen:
            seen.add(id(node))
            for parent in node.parents:
                visit(parent)
            order.append(node)

    visit(root)
    return order


@pytest.mark.parametrize("bug", ENGINE_HINTS)
def test_each_classic_bug_of_the_autograd_and_adam_tasks_gets_its_hint(bug, monkeypatch):
    """Each bug, planted in a fresh copy of its module that the checks then run (common/classroom/lab_autograd.py
    imports it by name), fails its check with its hint."""
    import importlib
    import warnings

    import test_tasks

    name, good, bad, check, arguments, hint = ENGINE_HINTS[bug]
    module = importlib.import_module(name)  # its package holds it from now on
    module = module if good is None else with_bug(name, good, bad)
    if good is None:
        monkeypatch.setattr(module, "topological_order", recursive_order)
    monkeypatch.setitem(sys.modules, name, module)
    package, _, attribute = name.rpartition(".")
    monkeypatch.setattr(importlib.import_module(package), attribute, module)
    if check == "test_adam_update":
        arguments = {**arguments, "layers": types.SimpleNamespace(adam_update=module.adam_update)}
    if check == "test_matmul_backward":
        arguments = {**arguments, "images": np.zeros((64, 784), np.float32)}
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


def fingerprint() -> dict[str, object]:
    """This repository, byte for byte (links as links, build outputs and caches included), and the list of its
    environment's and data's files with their sizes and times: what no submission may change."""
    found: dict[str, object] = {}
    for folder, dirs, files in os.walk(ROOT):
        for name in dirs + files:
            path = Path(folder) / name
            key = str(path.relative_to(ROOT))
            found[key] = os.readlink(path) if path.is_symlink() else path.read_bytes() if path.is_file() else "dir"
    for linked in (ROOT / ".venv", ROOT / "data"):
        for folder, _, files in os.walk(linked, followlinks=True):
            for name in files:
                info = (Path(folder) / name).lstat()
                found[f"{folder}/{name}"] = (info.st_size, info.st_mtime_ns)
    return found


def processes() -> dict[int, tuple[str, str, int]]:
    """Every live process: (its command line, its name, its user)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            status = Path(f"/proc/{pid}/status").read_text()
            if "\nState:\tZ" not in status:
                uid = int(re.search(r"\nUid:\t(\d+)", status)[1])
                found[int(pid)] = (cmdline, Path(f"/proc/{pid}/comm").read_text().strip(), uid)
        except OSError:
            pass
    return found


def snapshot(folder: Path) -> dict[str, object]:
    """A folder's files as they are (links as their targets, never followed)."""
    return {str(p.relative_to(folder)): os.readlink(p) if p.is_symlink() else p.read_bytes()
            for p in folder.rglob("*") if p.is_symlink() or p.is_file()}


@pytest.fixture(scope="module")
def gradebook(tmp_path_factory):
    """The gradebook of a class (tests/lab_submissions.py): a correct submission of levels 3 and 4, a stubbed one, two
    planted bugs, one of each hostile kind, and the files of the autograd tasks, correct and with a bug in each; its
    students' kinds, its CSV rows by student, and what is to be checked around it: this repository before and after,
    the submissions before, the processes before and after, its own scratch folder, its output folder."""
    shipped()
    if why := bwrap.problem():
        pytest.skip(why)
    import lab_submissions

    folder = tmp_path_factory.mktemp("class")
    subs, scratch = folder / "subs", folder / "scratch"
    kinds = lab_submissions.write(subs, 4, levels=(3,))  # correct, stubbed and two planted bugs
    correct = next(student for student, kind in kinds.items() if kind == "correct")
    for name in lab.files_to_write():  # level 4 too
        if name.startswith("level4"):
            (subs / correct / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / name, subs / correct / name)
    for i, kind in enumerate(lab_submissions.HOSTILE):
        student = subs / f"hostile{i:02d}"
        (student / "level3_numpy").mkdir(parents=True)
        (student / "level3_numpy" / "mlp.py").write_text(lab_submissions.hostile(kind))
        kinds[student.name] = f"hostile: {kind}"
    for i, (kind, make) in enumerate(lab_submissions.FOLDERS.items()):
        make(subs / f"special{i}")
        kinds[f"special{i}"] = f"hostile: {kind}"
    for kind in ("autograd: correct", "autograd: bugs"):  # checks whose graphs the worker builds from numbers
        for name, good, bad, _ in autograd_bugs():
            text = (ROOT / name).read_text()
            (subs / kind[10:] / name).parent.mkdir(parents=True, exist_ok=True)
            (subs / kind[10:] / name).write_text(text.replace(good, bad, 1) if kind.endswith("bugs") else text)
        kinds[kind[10:]] = kind
    scratch.mkdir()
    before, before_subs, running = fingerprint(), snapshot(subs), processes()
    env = {**os.environ, "LAB_CALL_TIMEOUT_S": "20", "TMPDIR": str(scratch), "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "common.classroom.gradebook", str(subs), "--out", str(folder / "book"),
                          "--jobs", "2", "--timeout", "600"], cwd=ROOT, capture_output=True, text=True, timeout=1500,
                         env=env)
    seconds = time.perf_counter() - start
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    left = {pid: p for pid, p in processes().items() if pid not in running}
    time.sleep(2)  # a daemon's writes would land by now
    rows = {}
    with (folder / "book" / "grades.csv").open() as f:
        for row in csv.DictReader(f):
            rows.setdefault(row["student"], {})[row["task"]] = row
    return {"kinds": kinds, "rows": rows, "before": before, "before_subs": before_subs, "subs": subs,
            "running": running, "left": left, "scratch": scratch, "book": folder / "book", "seconds": seconds}


def statuses(grade: dict, level: int) -> dict[str, str]:
    return {task: t["status"] for task, t in grade.items() if lab.task(task).level == level}


def notes(grade: dict) -> dict[str, str]:
    """The notes a grade has (an assertion on its statuses prints them: why a task failed)."""
    return {task: t["note"] for task, t in grade.items() if t["note"]}


def honest(level: int, passing: set[str] = frozenset(), failing: set[str] = frozenset()) -> dict[str, str]:
    """A level's statuses for a submission of one file of it whose code is correct but where failing fail: "pass"
    for its file's tasks (the level's row too, when all pass), "blocked" where one fails, else "not attempted"."""
    expected = {t.id: "FAIL" if t.id in failing else "pass" if t.path in passing else "not attempted"
                for t in lab.TASKS if t.level == level}
    row = lab.level_row(level)
    if all(expected[n] != "not attempted" for n in row.needs):
        expected[row.id] = "pass" if all(expected[n] == "pass" for n in row.needs) else "blocked"
    for t in lab.TASKS:  # a task whose needs fail is blocked
        if t.level == level and t.path and any(expected[n] == "FAIL" for n in t.needs) and expected[t.id] != "FAIL":
            expected[t.id] = "blocked"
    return expected


MLP3 = "level3_numpy/mlp.py"
# The tasks whose checks build their graphs in the worker (common/classroom/lab_autograd.py), and Adam's; a classic bug
# of tests/plant_bugs.py in each of their files: (file, correct code, buggy code, the task it fails).
AUTOGRAD_TASKS = ("2.6", "2.7", "2.8", "3.14", "8.1", "8.2", "8.3")


def autograd_bugs() -> list[tuple]:
    """(file, correct code, buggy code, task) of the first such bug in each file, read from this repository's code when
    asked, not when the module is collected: tests/plant_bugs.py collects these tests from a copy with a bug in it."""
    return [next((file, good, bad, task) for number, file, good, bad, _ in BUGS if file == name
                 and isinstance(good, str) and (task := owner(number, file, good)) in AUTOGRAD_TASKS)
            for name in ("level2_theory/autograd.py", "level8_framework/tensor.py", "level8_framework/cpu.py", MLP3)]


def test_the_gradebook_grades_each_kind_of_submission(gradebook):
    """Each submission gets what its honest code earns: every hostile one's attack fails, and costs it no more than
    the calls it broke."""
    kinds, rows = gradebook["kinds"], gradebook["rows"]
    by_kind = {kind: rows[student] for student, kind in kinds.items()}
    assert set(rows) == set(kinds)
    correct = by_kind["correct"]  # levels 3 and 4
    assert {task for task, t in correct.items() if t["status"] == "pass"} == {t.id for t in lab.TASKS
                                                                             if t.level in (3, 4)}
    assert all(t["status"] == "not attempted" for t in by_kind["stubbed"].values())
    for kind, grade in by_kind.items():
        if kind.startswith("bug: "):
            assert any(t["status"] == "FAIL" for t in grade.values()), f"{kind} passed"
    fails_3_1 = ("hangs", "crashes", "forges", "snoops", "fits the visible checks", "unmounts", "stalls an answer",
                 "oversized answer", "torch through builtins")
    passes = ("deletes", "daemon", "sabotages the others", "floods /tmp", "log link")
    for kind in fails_3_1:
        grade = by_kind[f"hostile: {kind}"]
        assert statuses(grade, 3) == honest(3, {MLP3}, {"3.1"}), (kind, notes(grade))
    for kind in passes:
        grade = by_kind[f"hostile: {kind}"]
        assert statuses(grade, 3) == honest(3, {MLP3}), (kind, notes(grade))
    torch = by_kind["hostile: uses torch"]  # the whole file is refused; the level's other file (LeNet's) is absent
    assert statuses(torch, 3) == honest(3, {MLP3}, {t.id for t in lab.TASKS if t.path == MLP3})
    for kind in ("git file", "git alternates"):  # nothing taken from another repository
        grade = by_kind[f"hostile: {kind}"]
        assert {t["status"] for t in grade.values()} == {"not attempted"}, kind
        assert "git" in grade["3.1"]["note"], grade["3.1"]["note"]
    forge = by_kind["hostile: C forge"]  # its leak fails 4.8, `system (` 4.3; its code at load and exit is not taken
    level4 = honest(4, {"level4_c/mlp.c"}, {"4.3", "4.8"})
    assert statuses(forge, 4) == level4 and set(statuses(forge, 3).values()) == {"not attempted"}
    assert "LeakSanitizer" in forge["4.8"]["note"] and "calls system" in forge["4.3"]["note"]
    notes = {kind: by_kind[f"hostile: {kind}"]["3.1"]["note"] for kind in fails_3_1}
    assert "uses torch" in torch["3.1"]["note"]
    assert all("no complete answer after 20 s" in notes[kind] for kind in ("hangs", "stalls an answer"))
    assert "announced an answer of 3,221,225,472 bytes" in notes["oversized answer"]
    assert "torch is not available" in notes["torch through builtins"]
    assert "held_out" in notes["fits the visible checks"]  # the visible checks pass it
    assert "a link" in by_kind["hostile: log link"]["3.10"]["note"]  # LeNet's file, a link to the solutions
    summary = (gradebook["book"] / "summary.md").read_text()
    assert "| 3.1 | linear_forward |" in summary and (gradebook["book"] / "summary.png").stat().st_size > 0
    assert bwrap.version() in summary and "6 GiB of memory" in summary and "20 s per call" in summary


def test_the_gradebook_grades_the_autograd_tasks_from_the_submissions_code(gradebook):
    """The tasks whose checks hand the worker numbers to build Values and Tensors from, and Adam's: the correct code
    passes them, and each planted bug fails exactly its task (and blocks those that need it), in the sandbox."""
    rows = {kind: gradebook["rows"][student] for student, kind in gradebook["kinds"].items()}
    assert {task: rows["autograd: correct"][task]["status"] for task in AUTOGRAD_TASKS} == \
        {task: "pass" for task in AUTOGRAD_TASKS}
    failing = {task for *_, task in autograd_bugs()}
    expected = {task: "FAIL" if task in failing else "blocked" if failing & set(lab.task(task).needs) else "pass"
                for task in AUTOGRAD_TASKS}
    assert {task: rows["autograd: bugs"][task]["status"] for task in AUTOGRAD_TASKS} == expected


def test_the_gradebook_keeps_the_graders_files_and_the_other_submissions_safe(gradebook):
    """This repository (the held-out checks, its environment) and every submission are as they were; the grades are
    the grader's (a daemon's rewrite would have landed); no process of the class is left; nothing stays in /tmp."""
    after = fingerprint()
    changed = [name for name in gradebook["before"].keys() | after.keys()
               if gradebook["before"].get(name) != after.get(name)]
    assert not changed, changed[:10]
    assert snapshot(gradebook["subs"]) == gradebook["before_subs"]
    with (gradebook["book"] / "grades.csv").open() as f:
        assert sum(1 for _ in csv.DictReader(f)) == len(gradebook["kinds"]) * len(lab.TASKS)
    left = [p for p in gradebook["left"].values()  # a sandbox, a grade, a daemon, or a sandbox's user (as root)
            if str(gradebook["scratch"]) in p[0] or p[1] == "lab-daemon" or (os.geteuid() == 0 and p[2] >= bwrap.USERS)]
    assert not left, left
    assert not list(gradebook["scratch"].glob("gradebook-*"))  # the gradebook's copies are gone
    assert not list(Path(tempfile.gettempdir()).glob("lab-flood-*")) and not Path("/tmp/lab-pwned").exists()


def test_a_class_of_ten_attacks_grades_in_bounded_time(gradebook):
    """The whole class, every attack included, within the time its deadlines bound: each hostile submission costs at
    most one call's deadline (20 s here) on top of its honest code's grade."""
    attacks = sum(kind.startswith("hostile: ") for kind in gradebook["kinds"].values())
    assert attacks >= 10
    assert gradebook["seconds"] < 1200, gradebook["seconds"]


def test_a_fitted_solution_passes_the_visible_checks_only(edition, tmp_path):
    import lab_submissions

    copy = tmp_path / "lab"
    shutil.copytree(edition, copy, symlinks=True)
    (copy / "level3_numpy" / "mlp.py").write_text(lab_submissions.hostile("fits the visible checks"))
    _, tasks = grade(copy, tmp_path / "grade.json", "--task", "3.1")
    assert tasks["3.1"]["status"] == "pass"  # the student's own grade: the edition has no held-out checks


@pytest.fixture(scope="module")
def odd_class(tmp_path_factory):
    """The gradebook of a class of folders odd by accident (tests/lab_submissions.py's odd()), task 3.1 alone: its
    run, its CSV rows by student, each entry's kind, its output folder."""
    shipped()
    if why := bwrap.problem():
        pytest.skip(why)
    import lab_submissions

    folder = tmp_path_factory.mktemp("odd")
    kinds = lab_submissions.odd(folder / "subs")
    env = {**os.environ, "LAB_CALL_TIMEOUT_S": "20", "PYTHONDONTWRITEBYTECODE": "1"}
    run = subprocess.run([sys.executable, "-m", "common.classroom.gradebook", str(folder / "subs"), "--out",
                          str(folder / "book"), "--task", "3.1", "--jobs", "2", "--timeout", "600"], cwd=ROOT,
                         capture_output=True, text=True, timeout=900, env=env)
    rows = {}
    if (folder / "book" / "grades.csv").exists():
        with (folder / "book" / "grades.csv").open(encoding="utf-8") as f:
            rows = {row["student"]: row for row in csv.DictReader(f)}
    return {"run": run, "rows": rows, "kinds": kinds, "book": folder / "book"}


def test_the_gradebook_grades_any_folder_a_class_hands_in(odd_class):
    """Every entry of the class is its student's row (a hidden file aside): honest code earns its points whatever its
    folder's name, an odd folder scores what was taken from it with a note that says what happened, and the control
    and the victim graded after every odd folder keep their scores. Names are in grades.csv as they are, escaped
    where they are not UTF-8 text and neutralised where a spreadsheet would read a formula."""
    run, rows, kinds = odd_class["run"], odd_class["rows"], odd_class["kinds"]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    in_csv = {"not UTF-8": "caf\\xe9", "a formula": "'" + '=HYPERLINK("evil.example","0")'}
    by_kind = {kind: rows.get(in_csv.get(kind, student)) for student, kind in kinds.items()}
    assert len(rows) == len(kinds) and all(by_kind.values()), sorted(rows)
    honest = ("control", "victim", "a name of 251 bytes", "a name of 252 bytes", "not UTF-8", "a formula",
              "hard links inside")
    for kind in honest:
        assert (by_kind[kind]["status"], by_kind[kind]["points"]) == ("pass", "2"), (kind, by_kind[kind])
    notes = {  # the others: (status, what the note says)
        "a hard link outside": ("not attempted", "a hard link with a name outside its folder"),
        "a linked folder": ("FAIL", "a link, not a folder"),
        "a pipe for .git/HEAD": ("not attempted", "its .git holds HEAD, which is not a plain file"),
        "a file": ("FAIL", "not a folder"),
    }
    for kind, (status, note) in notes.items():
        assert by_kind[kind]["status"] == status and note in by_kind[kind]["note"], (kind, by_kind[kind])
        assert by_kind[kind]["points"] == "0"
    graded = [student for student, kind in kinds.items() if kind not in ("a linked folder", "a file")]
    assert len(list((odd_class["book"] / "json").glob("*.json"))) == len(graded)
    assert (odd_class["book"] / "summary.md").read_text().startswith(f"# Gradebook: {len(kinds)} submissions")


def test_a_failing_check_is_explained_in_the_chapters_words():
    """The verifier's numbers come with what they mean: "(1.2e-38 allowed)" reads as the rule of chapter 3."""
    task = next(t for t in lab.TASKS if t.level == 3)
    message = ("lockstep: step 0: the fc1.bias update is 1e-05 from the float64 step, where level 1's is 0 "
               "(1.2e-38 allowed)")
    status, note = grader.settle(grader.Result(task, "run", outcomes=[("test_x", "failed", message)]), [])
    assert status == "FAIL" and note.startswith(message) and "twice as far" in note and "chapter 3, section 4" in note
    status, note = grader.settle(grader.Result(task, "run", outcomes=[("test_x", "failed", "assert 1 == 2")]), [])
    assert note == "assert 1 == 2 (test_x)"  # nothing added where the message names none of the verifier's numbers


def test_an_edition_in_the_courses_folder_uses_the_courses_environment(tmp_path):
    """make lab writes lab/ in the course: its make grade takes the course's .venv (2 GB, set up once) rather than
    setting up another; an edition elsewhere, or before the course's is set up, sets up its own."""
    course, edition = tmp_path / "course", tmp_path / "course" / "lab"
    (course / "common").mkdir(parents=True)
    (course / "common" / "levels.py").write_text("")
    (course / ".venv").mkdir()
    (course / ".venv" / ".installed").touch()
    edition.mkdir()
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, edition)
    (edition / lab.MARKER).touch()

    def dry_grade() -> str:
        return subprocess.run(["make", "-n", "grade"], cwd=edition, capture_output=True, text=True).stdout

    assert "../.venv/bin/python -m common.classroom.grade" in dry_grade() and "-m venv" not in dry_grade()
    (course / ".venv" / ".installed").unlink()
    assert "python3 -m venv .venv" in dry_grade() and ".venv/bin/python -m common.classroom.grade" in dry_grade()


def test_a_task_stops_at_its_first_failing_check_and_the_others_go_on(tmp_path):
    """Once one of a task's checks fails, its status is settled: its later checks are skipped (a bug's grade costs
    the time to find it), while every other task's checks still run."""
    checks = tmp_path / "test_checks.py"
    ran = tmp_path / "ran"
    checks.write_text(
        "import pytest\n"
        f"RAN = {str(ran)!r}\n"
        "def mark(name):\n"
        "    open(RAN, 'a').write(name + '\\n')\n"
        "@pytest.mark.task('3.1')\n"
        "def test_first_passes(): mark('first')\n"
        "@pytest.mark.task('3.1')\n"
        "def test_second_fails(): mark('second'); assert 1 == 2\n"
        "@pytest.mark.task('3.1')\n"
        "def test_third(): mark('third')\n"
        "@pytest.mark.task('3.3')\n"
        "def test_other_task(): mark('other')\n")
    results = {t: grader.Result(lab.task(t), "run") for t in ("3.1", "3.3")}
    recorder = grader.Recorder(results)
    pytest.main([str(checks), "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--rootdir", str(tmp_path)],
                plugins=[recorder])
    assert ran.read_text().split() == ["first", "second", "other"]
    assert [outcome for _, outcome, _ in results["3.1"].outcomes] == ["passed", "failed", "skipped"]
    assert "not run: 3.1 already failed (test_second_fails)" in results["3.1"].outcomes[2][2]
    assert grader.settle(results["3.1"], []) == ("FAIL", "assert 1 == 2 (test_second_fails)")
    assert grader.settle(results["3.3"], [])[0] == "pass"
