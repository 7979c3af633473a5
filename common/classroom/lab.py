"""The classroom labs: the one list of tasks, their marked solutions, and the student edition (LABS.md).

A task is a function a student writes (or two that go together). Its reference solution sits in the level's
source, inside the function's body, between one pair of comment lines per function: "BEGIN LAB 3.2 linear_backward"
and "END LAB", each a `#` comment in Python and a `/* */` one in C and CUDA. The repository stays complete.
`make lab` (python -m common.classroom.lab) writes the student edition: the tracked files less the solutions, every region
replaced by a stub that builds and fails clearly, and a LAB.md per level.
`make grade` (common/classroom/grade.py) runs each attempted task's checks: the tests marked task("<id>").

    python -m common.classroom.lab [--out lab] [--files]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from common.levels import ROOT, level


@dataclass(frozen=True)
class Task:
    id: str  # "4.2": level 4, task 2, in the order a student takes them
    name: str  # as in its markers: the function to write, or what the marked code computes
    path: str | None  # the file holding its marked regions; None for a level's row, which has no code of its own
    checks: str  # what its grade checks
    points: int
    needs: tuple[str, ...] = ()  # tasks whose code its checks run too: it is graded once they pass
    exercise: bool = False  # a chapter's exercise: its level runs without it
    optional: bool = False  # what the level's own run never calls (it trains with SGD): its row runs without it too

    @property
    def level(self) -> int:
        """The level's number."""
        return int(self.id.split(".")[0])

    @property
    def gpu(self) -> bool:
        """Whether its checks need an NVIDIA GPU: those of levels 5-7 but level 6's calls, which NumPy checks."""
        return "gpu" in level(self.level).needs and self.path != CUBLAS


C_LAYERS = "level4_c/mlp.c"
CUDA_SHARED = "common/native/cuda_mlp.cuh"
CUDA_NAIVE = "level5_cuda_naive/mlp.cu"
CUBLAS = "level6_cublas/mlp.cu"
FUSED = "level7_fused/mlp.cu"
FLOAT64 = "against float64 at odd sizes and on MNIST rows"
NUMPY_LENET = "level3_numpy/lenet.py"
C_LENET = "level4_c/lenet.c"
CONV64 = "against float64 at odd sizes and on MNIST digits"
CUDA_LENET = "level5_cuda_naive/lenet.cu"
AUTOGRAD = "level2_theory/autograd.py"
FRAMEWORK_CPU = "level8_framework/cpu.py"
GRADS64 = "gradients against float64, values used many times"

_WRITTEN = (
    Task("2.1", "linear layer", "level2_theory/backprop.py", "forward; dx, dW, db by finite differences, autograd", 3),
    Task("2.2", "ReLU", "level2_theory/backprop.py", "forward; backward by finite differences, autograd", 2),
    Task("2.3", "softmax cross-entropy", "level2_theory/backprop.py",
         "softmax, loss; dlogits by finite differences, autograd", 3),
    Task("2.5", "tanh_backward", "level2_theory/backprop.py", "the chapter's exercise, by finite differences", 2,
         exercise=True),
    Task("2.6", "topological_order", AUTOGRAD, "each node once, after its parents; a chain 200,001 nodes deep", 2),
    Task("2.7", "backward", AUTOGRAD, f"{GRADS64}; backward() twice, from a second output", 3, needs=("2.6",)),
    Task("2.8", "log-softmax + NLL", AUTOGRAD, "log_sum_exp and a row's loss and gradient against float64; logits "
         "of 2,000", 2, needs=("2.6", "2.7")),
    Task("3.1", "linear_forward", "level3_numpy/mlp.py", f"x w^T + b {FLOAT64}", 2),
    Task("3.2", "linear_backward", "level3_numpy/mlp.py", f"dx, dw, db {FLOAT64}; square w", 4),
    Task("3.3", "relu_forward", "level3_numpy/mlp.py", "exactly max(h, 0), zeros included", 1),
    Task("3.4", "relu_backward", "level3_numpy/mlp.py", "exactly, the mask from h; 0 where h is exactly 0", 2),
    Task("3.5", "softmax_xent_forward", "level3_numpy/mlp.py", f"loss and softmax {FLOAT64}; logits of 2,000", 3),
    Task("3.6", "softmax_xent_backward", "level3_numpy/mlp.py", "(p - onehot(y)) / B against float64, B = 1 and 13", 2),
    Task("3.7", "sgd_update", "level3_numpy/mlp.py", "in place, against float64; an lr 0.2% off fails", 1),
    Task("3.9", "sgd_momentum_update", "level3_numpy/mlp.py",
         "the chapter's exercise: 20 steps against torch.optim.SGD(momentum=0.9)", 2, exercise=True),
    Task("3.10", "conv2d_forward", NUMPY_LENET, f"im2col and one product {CONV64}", 3),
    Task("3.11", "conv2d_backward", NUMPY_LENET, f"col2im; dx, dw, db {CONV64}; no dx for the first layer", 4,
         needs=("3.10",)),
    Task("3.12", "maxpool_forward", NUMPY_LENET, "each window's maximum and its position, the first of equal ones", 2),
    Task("3.13", "maxpool_backward", NUMPY_LENET, "the gradient to the chosen element alone, ties included", 2),
    Task("3.14", "adam_update", "level3_numpy/mlp.py", "one step from a state against float64: steps 1-1,000, "
         "gradients 1e-9 to 1", 3, optional=True),
    Task("4.1", "linear_forward", C_LAYERS, f"x w^T + b {FLOAT64}", 3),
    Task("4.2", "linear_backward", C_LAYERS, f"dx, dw, db {FLOAT64}; dx NULL", 5),
    Task("4.3", "relu_forward", C_LAYERS, "exactly max(h, 0), zeros included", 1),
    Task("4.4", "relu_backward", C_LAYERS, "exactly, the mask from h; 0 where h is exactly 0", 2),
    Task("4.5", "softmax_xent_forward", C_LAYERS, f"loss and softmax {FLOAT64}; logits of 2,000", 3),
    Task("4.6", "softmax_xent_backward", C_LAYERS, "(p - onehot(y)) / B against float64, B = 1 and 13", 2),
    Task("4.7", "sgd_update", C_LAYERS, "in place, against float64", 1),
    Task("4.8", "batch buffers", C_LAYERS,
         "ensure_capacity, free_batch_buffers under ASan + UBSan: sizes, growth, no leak, limit refused", 3),
    Task("4.9", "the model", C_LAYERS, "mlp_create, mlp_destroy under ASan + UBSan: sizes, zeroed, no leak", 3,
         needs=("4.8",)),
    Task("4.11", "conv2d_forward", C_LENET, f"direct loops {CONV64}", 3),
    Task("4.12", "conv2d_backward", C_LENET, f"direct loops: dx, dw, db {CONV64}; dx NULL", 4),
    Task("4.13", "maxpool_forward", C_LENET, "each window's maximum and its position, the first of equal ones", 2),
    Task("4.14", "maxpool_backward", C_LENET, "the gradient to the chosen element alone, ties included", 2),
    Task("5.1", "linear_forward", CUDA_NAIVE, f"x w^T {FLOAT64}; partial tiles, no write past out", 4),
    Task("5.2", "linear_backward", CUDA_NAIVE, f"dx, dw {FLOAT64}; partial tiles, no write past them; dx NULL", 5),
    Task("5.3", "bias_forward", CUDA_SHARED, "out + b, exactly", 1),
    Task("5.4", "bias_backward", CUDA_SHARED, "sums of dout's columns against float64", 2),
    Task("5.5", "relu_forward", CUDA_SHARED, "exactly max(h, 0)", 1),
    Task("5.6", "relu_backward", CUDA_SHARED, "exactly, the mask from h", 1),
    Task("5.7", "softmax_xent_forward", CUDA_SHARED, f"loss and softmax {FLOAT64}; logits of 2,000", 4),
    Task("5.8", "softmax_xent_backward", CUDA_SHARED, "(p - onehot(y)) / B against float64", 1),
    Task("5.9", "sgd_update", CUDA_SHARED, "in place, against float64", 1),
    Task("5.11", "conv2d_forward", CUDA_LENET, f"a thread per output {CONV64}; no write past out", 3),
    Task("5.12", "conv2d_forward_tiled", CUDA_LENET,
         f"shared-memory tiles and their halo {CONV64}; tiles cut by the edge, no write past out", 5),
    Task("6.1", "out = x @ w^T", CUBLAS, "the call through cuBLAS's column-major rules (common/classroom/sgemm.py)", 3),
    Task("6.2", "dw = dout^T @ x", CUBLAS, "the call through cuBLAS's column-major rules (common/classroom/sgemm.py)", 3),
    Task("6.3", "dx = dout @ w", CUBLAS, "the call through cuBLAS's column-major rules (common/classroom/sgemm.py)", 3),
    Task("7.1", "grid_barrier", FUSED, "1,000 rounds: no block leaves before every block has arrived", 5),
    Task("7.2", "owned_units", FUSED, "every hidden unit has exactly one owner, the last block fewer", 3),
    Task("8.1", "autograd", "level8_framework/tensor.py", f"the sort, as 2.6; {GRADS64}; .grad accumulated, graph "
         "freed", 4),
    Task("8.2", "matmul_backward", FRAMEWORK_CPU, f"da, db {FLOAT64}; transposed views, in their layout", 3),
    Task("8.3", "broadcast backward", FRAMEWORK_CPU, "add's backward: g summed over the leading and stretched axes, "
         "against float64", 2),
)


def _needs(*paths: str) -> tuple[str, ...]:
    """The tasks of these files, but the chapters' exercises and what the level's run never calls."""
    return tuple(t.id for t in _WRITTEN if t.path in paths and not t.exercise and not t.optional)


LEVEL_ROW = "the level's tests in tests/test_levels.py: lockstep with level 1, autograd, odd sizes"
_ROWS = (
    Task("2.4", "mlp_loss_and_grads", None, "every gradient of the MLP by finite differences and autograd", 2,
         needs=_needs("level2_theory/backprop.py")),
    Task("3.8", "the level", None, LEVEL_ROW, 5, needs=_needs("level3_numpy/mlp.py")),
    Task("4.10", "the level", None, LEVEL_ROW, 5, needs=_needs(C_LAYERS)),
    Task("5.10", "the level", None, LEVEL_ROW, 5, needs=_needs(CUDA_NAIVE, CUDA_SHARED)),
    Task("6.4", "the level", None, LEVEL_ROW, 4, needs=_needs(CUBLAS, CUDA_SHARED)),
    Task("7.3", "the level", None, LEVEL_ROW, 5, needs=_needs(FUSED, CUBLAS, CUDA_SHARED)),
)

TASKS: tuple[Task, ...] = tuple(sorted(_WRITTEN + _ROWS, key=lambda t: tuple(map(int, t.id.split(".")))))


def task(task_id: str) -> Task:
    """The task with this id."""
    for t in TASKS:
        if t.id == task_id:
            return t
    raise KeyError(f"no task {task_id}; tasks are {', '.join(t.id for t in TASKS)}")


def select(level_number: int | None = None, task_id: str | None = None) -> list[Task]:
    """The tasks of one level, or one task; every task where neither is given."""
    return [t for t in TASKS if level_number in (None, t.level) and task_id in (None, t.id)]


def level_row(number: int) -> Task | None:
    """The level's row: its main-suite tests, graded once all its tasks pass."""
    return next((t for t in _ROWS if t.level == number), None)


def tasks_named(name: str) -> list[Task]:
    """The written tasks of this name, one per level that has it."""
    return [t for t in _WRITTEN if t.name == name]


# ---- the marked regions ----

BEGIN = re.compile(r"^(?P<indent>[ \t]*)(?:#|/\*) BEGIN LAB (?P<id>\d+\.\d+) (?P<name>.+?)(?: \*/)?$")
END = re.compile(r"^[ \t]*(?:#|/\*) END LAB(?: \*/)?$")
# A comment that mentions a marker but is none (a typo, a nested BEGIN): an error, never silently part of a region.
# Code that merely holds the words (a pattern, a message) is no marker.
MARKER_LIKE = re.compile(r"^[ \t]*(?:#|/\*|//).*\b(?:BEGIN|END) LAB\b")


@dataclass(frozen=True)
class Region:
    task: str  # its task's id
    name: str  # as in the BEGIN marker
    function: str  # the function it sits in
    body: str  # the lines between the markers
    stub: str  # what the student edition puts there


def regions_in(text: str, language: str) -> list[Region]:
    """The marked regions of a source text ("python", "c" or "cuda")."""
    lines = text.splitlines(keepends=True)
    found, begin = [], None
    for i, line in enumerate(lines):
        line = line.rstrip("\n")
        if (match := BEGIN.match(line)) and begin is None:
            begin = (i, match)
        elif END.match(line) and begin is not None:
            start, match = begin
            function, stub = _stub(lines[:start], match, language)
            found.append(Region(match["id"], match["name"], function, "".join(lines[start + 1 : i]), stub))
            begin = None
        elif MARKER_LIKE.match(line):
            raise ValueError(f"line {i + 1}: a marker out of place (regions do not nest, and each has its END): {line}")
    if begin is not None:
        raise ValueError(f"line {begin[0] + 1}: BEGIN LAB {begin[1]['id']} has no END LAB")
    return found


def language(path: str | Path) -> str | None:
    """The language of a file's markers, by its suffix; None for a file that cannot hold any."""
    return {".py": "python", ".ipynb": "python", ".c": "c", ".cu": "cuda", ".cuh": "cuda"}.get(Path(path).suffix)


def regions(path: str, root: Path = ROOT) -> list[Region]:
    """The marked regions of a file (a notebook's: of its code cells, in order)."""
    return [r for text in _sources(root / path) for r in regions_in(text, language(path))]


def _sources(path: Path) -> list[str]:
    """The texts that can hold regions: the file, or a notebook's code cells."""
    if path.suffix != ".ipynb":
        return [path.read_text()]
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def attempted(t: Task, root: Path = ROOT) -> bool:
    """Whether a student has touched the task: some region of it no longer holds the stub (a row: all its needs)."""
    if t.path is None:
        return all(attempted(task(n), root) for n in t.needs)
    mine = [r for r in regions(t.path, root) if r.task == t.id]
    if not mine:
        raise LookupError(f"{t.path} has no BEGIN LAB {t.id} marker: put the markers back around your code")
    return any(r.body != r.stub for r in mine)


# ---- stubs: code that builds and fails clearly ----


def message(task_id: str, name: str, function: str) -> str:
    """What a stub says: 'lab 4.2: linear_backward is not written yet'."""
    what = function if name == function else f"{function} ({name})"
    return f"lab {task_id}: {what} is not written yet"


def _stub(before: list[str], begin: re.Match, lang: str) -> tuple[str, str]:
    """(the enclosing function's name, the stub for the region that starts after `before`)."""
    indent = begin["indent"]
    if lang == "python":
        function = next(m[1] for line in reversed(before) if (m := re.match(r"\s*def (\w+)", line)))
        return function, f'{indent}raise NotImplementedError("{message(begin["id"], begin["name"], function)}")\n'
    head, function, params = _c_signature(before)
    text = message(begin["id"], begin["name"], function)
    used = f"{indent}{', '.join(f'(void){p}' for p in params)};\n" if params else ""
    if "__global__" in head or "__device__" in head:  # device code cannot report: the host that launches it does
        returns = "" if re.search(r"\bvoid\b", head) else f"{indent}return {{}};\n"
        pending = f'#ifndef LAB_TODO_DEVICE\n#define LAB_TODO_DEVICE "{text}"\n#endif\n'
        return function, pending + used + returns
    if re.search(r"\bint\b", head):
        return function, f'{used}{indent}return FAIL(MLP_ERR_ARG, "{text}");\n'
    returns = "" if re.search(r"\bvoid\b", head) else f"{indent}return 0;\n"
    return function, f'{used}{indent}LAB_TODO("{text}");\n{returns}'


def _c_signature(before: list[str]) -> tuple[str, str, list[str]]:
    """(return type and qualifiers, name, parameter names) of the C function whose body the region is in.

    A definition starts in column 0 (statements are indented) and ends its signature at the first '{'.
    """
    start = next(i for i in range(len(before) - 1, -1, -1) if re.match(r"[A-Za-z_]", before[i]))
    text = "".join(before[start:])
    match = re.match(r"(?P<head>[^(]*?)\b(?P<name>\w+)\s*\((?P<params>[^)]*)\)[^{;]*\{", text, re.S)
    names = [m[1] for p in match["params"].split(",") if (m := re.search(r"(\w+)\s*(?:\[\s*\])?\s*$", p))]
    return match["head"], match["name"], [n for n in names if n != "void"]


def strip(text: str, lang: str) -> str:
    """The text with every region's body replaced by its stub (the markers stay: they show where to write)."""
    return _rewrite(text, lambda match, before, k: _stub(before, match, lang)[1])


def splice(submitted: str, given: str, lang: str) -> tuple[str, list[str]]:
    """The given file (the edition's) with each region's body taken from the submitted file, matched by task, name and
    order: a student's code is what they write between the markers, and the code outside them is the edition's,
    whatever the submitted file holds there. Also what could not be taken: a region the submitted file lacks, or
    markers out of place (those regions keep their stubs)."""
    try:
        bodies: dict[tuple[str, str], list[str]] = {}
        for r in regions_in(submitted, lang):
            bodies.setdefault((r.task, r.name), []).append(r.body)
    except ValueError as e:
        return given, [f"markers out of place ({e}): its code is not taken"]
    missing = []

    def body(match: re.Match, before: list[str], k: int) -> str:
        theirs = bodies.get((match["id"], match["name"]), [])
        if k < len(theirs):
            return theirs[k]
        missing.append(f"no BEGIN LAB {match['id']} {match['name']} marker: put the markers back around your code")
        return _stub(before, match, lang)[1]

    return _rewrite(given, body), missing


def _rewrite(text: str, body) -> str:
    """The text with the body of each region replaced by body(its BEGIN match, the lines before it, how many regions
    of the same task and name came before it)."""
    lines = text.splitlines(keepends=True)
    out, skipping, seen = [], False, {}
    for i, line in enumerate(lines):
        bare = line.rstrip("\n")
        if END.match(bare):
            skipping = False
        if not skipping:
            out.append(line)
        if match := BEGIN.match(bare):
            key = (match["id"], match["name"])
            seen[key] = seen.get(key, 0) + 1
            out.append(body(match, lines[:i], seen[key] - 1))
            skipping = True
    return "".join(out)


def strip_file(path: Path) -> str:
    """A file's text for the student edition: a notebook's code cells stripped one by one."""
    lang = language(path)
    if path.suffix != ".ipynb":
        return strip(path.read_text(), lang) if lang else path.read_text()
    notebook = json.loads(path.read_text())
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            cell["source"] = strip("".join(cell["source"]), lang).splitlines(keepends=True)
    return json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"


# ---- the student edition ----

# Not for students: the bugs list and the lab's own tests hold the correct lines, the held-out checks are the teacher's,
# the results quote lines of solutions (the chapters say where a result is missing), and answers/ holds the worked
# answers to the chapters' exercises and questions.
WITHHELD = ("tests/plant_bugs.py", "tests/test_labs.py", "tests/test_sandbox.py", "tests/test_holdout.py",
            "tests/lab_submissions.py", "results/", "answers/")
MARKER = "LAB_EDITION"  # at the edition's root: common/__init__.py refuses code imported from anywhere else
MARKER_TEXT = """This folder is a student edition of the course, made by `make lab`.
Python code run here must import this folder's modules (common/__init__.py checks it).
"""
# What a task's code must not use: the libraries that would do its work, or a way around the checks.
LIBRARIES = ("torch", "jax", "jaxlib", "tensorflow", "scipy", "sklearn")  # they would do a task's work; the worker
# (common/classroom/worker.py) cannot import them either
FORBIDDEN_PY = (*LIBRARIES, "importlib", "__import__", "exec", "eval")
EDITION_CI = """#!/usr/bin/env bash
# CI of the student edition (written by `make lab`): grade every task; the exit status fails on a failing task.
set -euo pipefail
cd "$(dirname "$0")/.."
make grade
"""


class NotACheckout(RuntimeError):
    """The edition is made of the files git tracks, and there is no git checkout (or no git) to ask."""


def shipped(root: Path = ROOT) -> list[str]:
    """The repository's tracked files that go into the edition: nothing built, downloaded or ignored goes out."""
    try:
        run = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True)
    except FileNotFoundError:
        raise NotACheckout("the student edition is made of the files git tracks, and git is not installed") from None
    if run.returncode:
        raise NotACheckout(f"the student edition is made of the files git tracks: run this in a git clone of the "
                           f"repository ({run.stderr.strip()})")
    return [f for f in run.stdout.split("\0") if f and not f.startswith(WITHHELD)]


def write_edition(out: Path, root: Path = ROOT, commit: bool = True) -> None:
    """The student edition in `out` (replaced if there): files, stubs for the solutions, chapters without outputs (they
    would show the solutions' code), a LAB.md per level; a git repository of one commit, so that a student can diff
    and restore."""
    if out.exists():
        shutil.rmtree(out)
    marked = {t.path for t in TASKS if t.path}
    for name in shipped(root):
        target = out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target)
        if name in marked:
            target.write_text(strip_file(root / name))
        elif name.endswith(".ipynb"):
            target.write_text(without_outputs(root / name))
    (out / ".ci" / "run").write_text(EDITION_CI)
    (out / MARKER).write_text(MARKER_TEXT)
    for number in sorted({t.level for t in TASKS}):
        (out / level(number).package / "LAB.md").write_text(lab_page(number, root))
    if commit:
        identity = ["-c", "user.name=lab", "-c", "user.email=lab@localhost", "-c", "commit.gpgsign=false"]
        for command in (["init", "-q"], ["add", "-A"], [*identity, "commit", "-q", "-m", "The lab: the student edition"]):
            subprocess.run(["git", *command], cwd=out, check=True, capture_output=True)


def make(targets: list[str] | tuple[str, ...], root: Path = ROOT) -> str | None:
    """`make -s targets` in root with this interpreter; None when it builds, else the first error."""
    run = subprocess.run(["make", "-s", *targets, f"PYTHON={sys.executable}"], cwd=root, capture_output=True, text=True)
    return None if run.returncode == 0 else first_error(run.stderr + run.stdout)


def first_error(output: str) -> str:
    """The line of a failed build's output that says what went wrong."""
    lines = output.splitlines()
    return next((line.strip() for line in lines if "error" in line), lines[-1].strip() if lines else "make failed")


def files_to_write() -> list[str]:
    """The files a student writes in, each once, in the tasks' order."""
    return list(dict.fromkeys(t.path for t in TASKS if t.path))


def without_outputs(path: Path) -> str:
    """A chapter with its outputs and its record of them taken out, as a student's first run will make them."""
    notebook = json.loads(path.read_text())
    notebook["metadata"].pop("made_from", None)
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    return json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"


def forbidden_use(t: Task, root: Path = ROOT) -> str | None:
    """Why a task's code is not allowed (a library that would do its work, a way around the checks), or None."""
    if t.path is None:
        return None
    bodies = [r.body for r in regions(t.path, root) if r.task == t.id]
    if t.path.endswith(".py"):
        import ast

        names = set()
        try:
            tree = ast.parse((root / t.path).read_text())
        except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
            return f"{t.path} is not Python that parses: {e}"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module.split(".")[0])
        names |= {w for w in FORBIDDEN_PY if re.search(rf"\b{w}\b", "".join(bodies))}
        used = sorted(names & set(FORBIDDEN_PY))
        if used:
            return (f"{t.path} uses {', '.join(used)}: a lab task computes by hand, with NumPy (torch, SciPy and the "
                    "like would do the task's work)")
        return None
    calls = given_calls(t.path, root) if language(t.path) == "c" else None
    for body in bodies:
        if why := c_problem(body, calls, blas=t.path == CUBLAS):  # level 6's tasks are calls to cuBLAS
            return f"task {t.id}'s code {why}"
    return None


# ---- what a C or CUDA task's code may hold ----

# A task's code is the body of a function, and must stay one: no preprocessor, no way out of its braces, no code
# that runs at load or exit, no call through a pointer. In C (level 4, whose memory check is judged in the same
# process as the code it checks) it may call only the level's own functions and these of C's library; in CUDA, any
# function but those that end, signal, start, load or reach outside the process (DENIED), which neither level's code
# may even name: an address taken is a call waiting for a callback.
C_LIBRARY = ("malloc", "calloc", "realloc", "free", "memset", "memcpy", "memmove", "memcmp", "expf", "exp", "logf",
             "log", "log1pf", "expm1f", "sqrtf", "sqrt", "fabsf", "fabs", "fmaxf", "fmax", "fminf", "fmin", "tanhf",
             "tanh", "powf", "pow", "floorf", "floor", "ceilf", "ceil", "isnan", "isinf", "isfinite")
DENIED = ("exit", "_exit", "_Exit", "quick_exit", "abort", "atexit", "at_quick_exit", "on_exit", "system", "popen",
          "pclose", "fork", "vfork", "clone", "execl", "execle", "execlp", "execv", "execve", "execvp", "execvpe",
          "fexecve", "posix_spawn", "posix_spawnp", "kill", "killpg", "raise", "signal", "sigaction", "sigprocmask",
          "alarm", "setitimer", "pthread_create", "pthread_kill", "pthread_exit", "pthread_atfork", "thrd_create",
          "dlopen", "dlmopen", "dlsym", "dlvsym", "syscall", "mmap", "mprotect", "munmap", "ptrace", "prctl", "open",
          "openat", "creat", "fopen", "freopen", "fdopen", "write", "pwrite", "read", "pread", "close", "dup", "dup2",
          "unlink", "remove", "rename", "setenv", "putenv", "unsetenv", "chdir", "setjmp", "longjmp", "sigsetjmp",
          "siglongjmp", "sleep", "usleep", "cudaDeviceReset")
NOT_IN_A_BODY = ("asm", "__asm", "__asm__", "_Pragma", "__attribute", "__attribute__", "__declspec", "typedef",
                 "typeof", "__typeof", "__typeof__", "decltype", "template", "using", "namespace", "operator", "std")
RESERVED_OK = ("__func__", "__FILE__", "__LINE__", "__syncthreads", "__syncwarp", "__shared__", "__device__",
               "__restrict__", "__forceinline__", "__threadfence", "__threadfence_block", "__ldg", "__ldcg", "__stcg",
               "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync", "__ballot_sync",
               "__any_sync", "__all_sync", "__activemask", "__expf", "__logf", "__fdividef", "__fmaf_rn", "__popc",
               "__clz", "__ffs", "__nanosleep", "_Bool")
KEYWORDS = ("if", "for", "while", "switch", "return", "sizeof", "_Alignof", "alignof", "do", "else", "case")
CAST_WORDS = ("void", "char", "short", "int", "long", "float", "double", "signed", "unsigned", "const", "volatile",
              "restrict", "_Bool", "bool", "size_t", "ptrdiff_t", "int8_t", "int16_t", "int32_t", "int64_t", "uint8_t",
              "uint16_t", "uint32_t", "uint64_t", "struct", "union", "enum", "*")
C_TOKEN = re.compile(r"""(?P<skip>\s+|//[^\n]*|/\*.*?\*/)
    |(?P<literal>"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*')
    |(?P<number>\.?\d(?:[\w.]|'(?=\w)|[eEpP][+-])*)
    |(?P<name>[A-Za-z_]\w*)
    |(?P<punct><<<|->|::|<:|:>|<%|%>|%:|.)""", re.S | re.X)


def c_tokens(text: str) -> list[str]:
    """C or CUDA source as tokens, comments and blanks left out (a literal is one token)."""
    return [m.group() for m in C_TOKEN.finditer(text) if m.lastgroup != "skip"]


def given_calls(path: str, root: Path = ROOT) -> set[str]:
    """What a C file's given code (outside its regions) and the headers it includes call or define, but DENIED: the
    functions and macros of the level, which a task's code may call."""
    texts, queue, seen = [], [root / path], set()
    while queue:
        file = queue.pop()
        if file in seen or not file.is_file():
            continue
        seen.add(file)
        texts.append(strip(file.read_text(), language(file) or "c"))
        queue += [folder / name for name in re.findall(r'#include\s+"([^"]+)"', texts[-1])
                  for folder in (file.parent, root / "common" / "native")]
    tokens = [t for text in texts for t in c_tokens(text)]
    return {a for a, b in zip(tokens, tokens[1:]) if b == "(" and re.match(r"[A-Za-z_]", a)} - set(DENIED)


def c_problem(body: str, calls: set[str] | None, blas: bool = False) -> str | None:
    """What is not allowed in a region's C or CUDA code, or None. calls: the functions it may call (C), or None for
    any but DENIED (CUDA, whose one directive allowed is `#pragma unroll`); blas: cuBLAS's calls are the task."""
    if calls is None:
        body = re.sub(r"(?m)^[ \t]*#[ \t]*pragma[ \t]+unroll(?:[ \t]+\d+)?[ \t]*$", "", body)
    if "??" in body:
        return "holds ??, which C reads as a trigraph"
    if re.search(r"\\\r?\n", body):
        return "continues a line with a backslash"
    tokens = c_tokens(body)
    opened: list[int] = []  # where each open bracket is
    for i, token in enumerate(tokens):
        before, after = tokens[i - 1] if i else "", tokens[i + 1] if i + 1 < len(tokens) else ""
        if token in ("#", "%:", "<:", ":>", "<%", "%>"):
            return f"uses the preprocessor or a digraph ({token}): a task's code is plain statements"
        if token == "(" and before == "]":
            return "calls through a pointer: a task calls functions by name"
        if token in "([{":
            opened.append(i)
        elif token in ")]}":
            if not opened or tokens[opened[-1]] != {")": "(", "]": "[", "}": "{"}[token]:
                return f"has a {token} that does not close its own bracket: a task's code stays inside its function"
            start = opened.pop()
            condition = start and tokens[start - 1] in ("if", "while", "for", "switch")  # `if (c) (x)++;`
            if token == ")" and after == "(" and not condition and not _a_type(tokens[start + 1 : i]):
                return "calls through a pointer (a function's, or a call's result): a task calls functions by name"
        if token == "::" and not re.match(r"[A-Za-z_]", before):
            return "names something of the global namespace (::): a task calls the level's functions"
        if not re.match(r"[A-Za-z_]", token):
            continue
        if token in NOT_IN_A_BODY:
            return f"uses {token}, which a task's code has no use for"
        if re.match(r"__|_[A-Z]", token) and token not in RESERVED_OK:
            return f"uses {token}, a name reserved to the compiler and its libraries"
        if token.lower().startswith(("cblas", "cublas")) and not blas:
            return f"calls {token}: a lab task computes with its own loops and kernels"
        if token in DENIED:  # its address is as good as a call: a function that takes a callback would make it one
            verb = "calls" if after in ("(", "<<<") else "names"
            return f"{verb} {token}, which a lab task has no use for (it may not end, signal or leave its process)"
        if after not in ("(", "<<<") or token in KEYWORDS or token in CAST_WORDS or calls is None:
            continue
        if before in (".", "->"):
            return f"calls {token} through a pointer: a task calls functions by name"
        elif token not in calls and token not in C_LIBRARY:
            return (f"calls {token}: a task's code calls the level's own functions and, of C's library, "
                    f"{', '.join(C_LIBRARY[:10])} and its other math functions")
    if opened:
        return f"leaves a {tokens[opened[-1]]} open: a task's code stays inside its function"
    return None


def _a_type(tokens: list[str]) -> bool:
    """Whether the tokens between a pair of parentheses are a type, as in a cast `(float)(x)`."""
    return any(t not in ("*", "const", "volatile") for t in tokens) and all(
        t in CAST_WORDS or (i and tokens[i - 1] in ("struct", "union", "enum")) for i, t in enumerate(tokens))


def lab_page(number: int, root: Path = ROOT) -> str:
    """A level's LAB.md: what to write, in which order, how to check it."""
    lv = level(number)
    mine = [t for t in TASKS if t.level == number]
    rows = "\n".join(f"| {t.id} | {_what(t, root)} | {t.checks} | {t.points} |" for t in mine)
    on_gpu = [t.id for t in mine if t.gpu]
    gpu = (f"\nThe checks of {', '.join(on_gpu)} run on an NVIDIA GPU; where there is none, `make grade` reports them "
           "as \"needs GPU\" (not graded, not failed). Without a GPU of your own, grade_on_gpu.ipynb runs them on a "
           "hosted GPU.\n" if on_gpu else "")
    row = ("""
A task without code of its own ("the level") runs the level's part of the main test suite once all its tasks pass:
your functions together, in lockstep with level 1, the gold standard.
""" if level_row(number) else "")
    return f"""# Lab {number}: {lv.title}

Write each function below between its `BEGIN LAB` and `END LAB` markers, in place of the stub that fails with
"lab {number}.N: ... is not written yet" (leave the markers where they are: the grader finds your code by them).
The comment or docstring above each function says what it computes, with the shapes; the chapter,
`{lv.package}/chapter.ipynb`, explains the level. Take the tasks in this order, and check each one as you go:

    make grade TASK={mine[0].id}           # one task; add ARGS=-v to see the check that fails, and why
    make grade LEVEL={number}             # the whole level: the table, and grade.json
{gpu}
The first `make grade` sets up `.venv` in this folder (PyTorch, NumPy, cffi, pytest, Jupyter from the package index:
about 2 GB and a few minutes, once), unless this folder sits in the course's own, whose environment it then uses.
Open the chapters with `make notebooks`, which uses the same environment: a chapter runs your code. If you change a file and want it back, `git checkout <file>` (the edition is a git
repository) restores the version you were given.

| task | write | checked | points |
|---|---|---|---|
{rows}
{row}"""


def _what(t: Task, root: Path) -> str:
    """A task's "write" column: the function(s) and the file, or what its row runs."""
    if t.path is None:
        return f"(your functions together: {t.name})"
    functions = ", ".join(dict.fromkeys(f"`{r.function}`" for r in regions(t.path, root) if r.task == t.id))
    return f"{functions} in `{t.path}`"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="lab", help="where to write the student edition (replaced if there)")
    p.add_argument("--files", action="store_true",
                   help="only list the files a student writes in (to copy from a submission into a fresh edition)")
    args = p.parse_args(argv)
    if args.files:
        print("\n".join(files_to_write()))
        return 0
    out = Path(args.out).resolve()
    if out == ROOT or ROOT.is_relative_to(out):
        raise SystemExit(f"refusing to replace {out}: it holds the repository")
    try:
        write_edition(out)
    except NotACheckout as e:
        raise SystemExit(f"make lab: {e}") from None
    stubs = sum(t.path is not None for t in TASKS)
    print(f"student edition written to {out}: {stubs} stubs to write, {len(TASKS)} graded tasks (with the checks of "
          "what they add up to), a LAB.md per level (LABS.md says how to hand it out)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
