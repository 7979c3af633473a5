"""Grade the lab (LABS.md): run each attempted task's checks, print one table, write grade.json.

    make grade               every task;  make grade LEVEL=4: one level;  make grade TASK=4.2: one task
    python -m common.classroom.grade --help
    python -m common.classroom.grade --submission DIR     a teacher's grade of one submission (common/classroom/gradebook.py runs it)

A task whose marked regions still hold the student edition's stubs is "not attempted", and is not run. The others
are built (level 4; levels 5-7 where there is a GPU) and checked in one pytest session, by the tests marked
task("<id>"): tests/test_tasks.py, tests/test_level2.py and, for a level's row, the level's tests in
tests/test_levels.py; in the teacher's repository also the held-out checks of tests/test_holdout.py, which the
student edition does not contain. A task that needs others is checked only once they pass; until then it is
"blocked". A task whose code imports PyTorch (or another library that would do its work) fails with that reason.
GPU tasks on a machine without an NVIDIA GPU are "needs GPU": not graded here, and not failed.

With --submission, the submission's code runs only in bubblewrap sandboxes (common/classroom/bwrap.py): its builds, its memory
check and the worker that answers the checks (common/classroom/sandbox.py); every verdict is computed here, from its outputs.
The exit status is 0 only when every attempted task passes (--strict: every task; --require-gpu: GPU tasks that
cannot run here fail).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from common.classroom import bwrap, lab, sandbox
from common.classroom.lab import Task
from common.levels import LEVELS, ROOT, gpu_available, level

# The held-out checks are the teacher's: the student edition leaves tests/test_holdout.py out (common/classroom/lab.py).
TEST_FILES = ("tests/test_tasks.py", "tests/test_level2.py", "tests/test_levels.py", "tests/test_holdout.py")
# What each native level's checks load, built before they run (`make -s ...`): the level and the lab's libraries for its
# tasks (common/levels.py); the GPU levels' only where there is a GPU.
BUILDS = {lv.number: (lv.name, *lv.lab_libraries) for lv in LEVELS if {"cc", "nvcc"} & set(lv.needs)}
NEEDS_GPU = "needs GPU"  # a status: not gradeable on this machine, and not failed
NO_GPU = "needs an NVIDIA GPU, and none is visible here: grade it on a GPU machine (LABS.md, 'GPU tasks')"
VERIFIED = "chapter 3, section 4, 'Verified against level 1'"
# What the verifier's numbers mean, in the words of the chapter that teaches them: added to a failing task's note where
# its message uses them, so that "(1.2e-38 allowed)" reads as a rule, not a constant.
WORDS = (
    ("from the float64 step", "the float64 step is the same step in double precision, as exact as we get; your "
     "result may be at most twice as far from it as PyTorch's own float32 result, plus float32's rounding of it, "
     f"so a result that is off by more than rounding fails ({VERIFIED})"),
    ("float32 noise allows", "float32 noise is how far PyTorch's own run drifts from the same run in double "
     f"precision; your run may differ from PyTorch's by a few times that ({VERIFIED})"),
)


@dataclass
class Result:
    task: Task
    status: str = "not attempted"  # then "pass", "FAIL", "blocked" or NEEDS_GPU
    note: str = ""  # why it failed, was blocked or could not be graded here
    outcomes: list[tuple[str, str, str]] = field(default_factory=list)  # (test, "passed"/"failed"/"skipped", message)

    @property
    def earned(self) -> int:
        return self.task.points if self.status == "pass" else 0


def with_needs(selected: list[Task]) -> list[Task]:
    """The selected tasks and every task they need, in the list's order."""
    wanted = {t.id for t in selected}
    for t in reversed(lab.TASKS):
        if t.id in wanted:
            wanted.update(t.needs)
    return [t for t in lab.TASKS if t.id in wanted]


def prepare(tasks: list[Task], root: Path = ROOT) -> dict[str, Result]:
    """A result per task: not attempted, FAIL (no markers, a forbidden library, does not build), blocked, or "run" for
    the checks to run. root holds the code under grade (a submission's sandbox, or this repository)."""
    results = {t.id: Result(t) for t in tasks}
    for r in results.values():
        try:
            if lab.attempted(r.task, root):
                r.status = "run"
                if why := lab.forbidden_use(r.task, root):
                    r.status, r.note = "FAIL", why
        except LookupError as e:
            r.status, r.note = "FAIL", str(e)
    for r in results.values():
        waiting = [n for n in r.task.needs if results[n].status == "not attempted"]
        if r.status == "run" and waiting:
            r.status, r.note = "blocked", f"needs {', '.join(waiting)} (not attempted)"
    for number in sorted({r.task.level for r in results.values() if r.status == "run"}):
        on_gpu = "gpu" in level(number).needs
        if number in BUILDS and (not on_gpu or gpu_available()) and (error := build(BUILDS[number], on_gpu)):
            for r in results.values():
                if r.task.level == number and r.status == "run":
                    r.status, r.note = "FAIL", f"does not build: {error}"
    return results


def build(targets: tuple[str, ...], gpu: bool) -> str | None:
    """`make -s targets` (in a teacher's grade: in the submission's sandbox); None when it builds, else the first
    error."""
    if sandbox.submission():
        return sandbox.build(targets, gpu)
    return lab.make(targets)


class Recorder:
    """A pytest plugin: keeps the tests of the tasks to run, in task order, skips those of a task whose needs did
    not pass and the rest of a task's once one has failed (its status is settled: a bug's grade costs the time to find
    it, not the whole level's), and records every outcome in the tasks' results."""

    def __init__(self, results: dict[str, Result]):
        self.results = results
        self.order = list(results)
        self.task_of: dict[str, str] = {}
        self.broken: list[str] = []  # test files that did not import: their tasks run no check

    def pytest_collectreport(self, report):
        if report.failed:
            self.broken.append(f"{report.nodeid} does not import: {_message(report)}")

    def pytest_collection_modifyitems(self, config, items):
        for item in items:
            marker = item.get_closest_marker("task")
            if marker and marker.args[0] in self.results and self.results[marker.args[0]].status == "run":
                self.task_of[item.nodeid] = marker.args[0]
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in self.task_of])
        items[:] = sorted((item for item in items if item.nodeid in self.task_of),
                          key=lambda item: self.order.index(self.task_of[item.nodeid]))

    def pytest_runtest_setup(self, item):
        import pytest

        mine = self.results[self.task_of[item.nodeid]]
        if failed := next((name for name, outcome, _ in mine.outcomes if outcome == "failed"), None):
            pytest.skip(f"not run: {mine.task.id} already failed ({failed})")
        needs = [self.results[n] for n in mine.task.needs]
        if failing := [r.task.id for r in needs if not passing(r) and not skipped(r)]:
            pytest.skip(f"blocked by {', '.join(failing)}")
        if waiting := [r for r in needs if skipped(r)]:
            pytest.skip(waiting[0].outcomes[0][2])

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            name = report.nodeid.split("::")[-1]
            self.results[self.task_of[report.nodeid]].outcomes.append((name, report.outcome, _message(report)))


def passing(r: Result) -> bool:
    """Whether a task's checks have all passed so far (at least one ran; skipped ones aside)."""
    outcomes = [o for _, o, _ in r.outcomes]
    return r.status == "run" and "passed" in outcomes and "failed" not in outcomes


def skipped(r: Result) -> bool:
    """Whether every check of a task was skipped for want of a GPU (not because its own needs failed)."""
    return (r.status == "run" and bool(r.outcomes) and all(o == "skipped" for _, o, _ in r.outcomes)
            and not r.outcomes[0][2].startswith("blocked by"))


def _message(report) -> str:
    """The first line of why a test failed or was skipped."""
    if report.passed:
        return ""
    if report.skipped:
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(report.longrepr, "reprcrash", None)
    lines = [line.strip() for line in (crash.message if crash else str(report.longrepr)).splitlines() if line.strip()]
    if lines and lines[0].startswith("File "):  # an exception raised while importing: its last line says what
        lines = [line for line in lines if re.match(r"\w+(Error|Exception)\b", line)][-1:] + lines[:1]
    return "; ".join(lines[:3]).removeprefix("AssertionError: ")[:300] or "failed"


def check(results: dict[str, Result], verbose: bool, pytest_args: list[str]) -> None:
    """Run the checks of the tasks marked "run" in one pytest session, and settle each one's status."""
    import pytest

    recorder = Recorder(results)
    if any(r.status == "run" for r in results.values()):
        files = [str(ROOT / f) for f in TEST_FILES if (ROOT / f).exists()]
        # The checks use none of the plugins that Jupyter's and anyio's packages register (nbmake alone takes seconds
        # to load, once per grade: a gradebook pays it per student).
        args = files + ["-m", "task", "-p", "no:cacheprovider", "-p", "no:nbmake", "-p", "no:anyio",
                        "--continue-on-collection-errors", *pytest_args]
        output = contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO())
        with output:
            pytest.main(args + (["-rfs", "--tb=short"] if verbose else ["-q", "--tb=no"]), plugins=[recorder])
    for r in results.values():
        if r.status == "run":
            r.status, r.note = settle(r, recorder.broken)


def settle(r: Result, broken: list[str]) -> tuple[str, str]:
    """A run task's status and note from its tests' outcomes."""
    failed = [(name, message) for name, outcome, message in r.outcomes if outcome == "failed"]
    if failed:
        name, message = failed[0]
        words = "".join(f". In words: {words}" for term, words in WORDS if term in message)
        return "FAIL", f"{message} ({name}){words}"
    if not r.outcomes:
        return "FAIL", f"no check ran: {broken[0] if broken else f'no test is marked task({r.task.id!r})'}"
    if all(outcome == "skipped" for _, outcome, _ in r.outcomes):
        reason = r.outcomes[0][2]
        if reason.startswith("blocked by"):
            return "blocked", reason
        return NEEDS_GPU, NO_GPU if not gpu_available() else reason
    return "pass", ""


def table(results: list[Result]) -> str:
    """The grade table: task, result, points, what it checks; the score of what was graded here, the points that need
    a GPU apart; then why each task failed or was blocked, and what could not be graded here."""
    lines = [f"{'task':<5} {'name':<22} {'result':<14} {'points':>6}  checks"]
    for r in results:
        points = f"{r.earned}/{r.task.points}" if r.status != NEEDS_GPU else f"-/{r.task.points}"
        lines.append(f"{r.task.id:<5} {r.task.name:<22} {r.status:<14} {points:>6}  {r.task.checks}")
    here = [r for r in results if r.status != NEEDS_GPU]
    counts = {s: sum(r.status == s for r in here) for s in ("pass", "FAIL", "blocked", "not attempted")}
    lines.append(f"score {sum(r.earned for r in here)}/{sum(r.task.points for r in here)}: "
                 + ", ".join(f"{n} {s}" for s, n in counts.items() if n))
    if gpu := [r for r in results if r.status == NEEDS_GPU]:
        lines.append(f"not graded here: {len(gpu)} tasks, {sum(r.task.points for r in gpu)} points ({NO_GPU})")
    lines += [f"  {r.task.id} {r.status}: {r.note}" for r in results if r.note and r.status != NEEDS_GPU]
    return "\n".join(lines)


def report(results: list[Result]) -> dict:
    """grade.json: the score and every task's result."""
    return {
        "score": sum(r.earned for r in results),
        "points": sum(r.task.points for r in results),
        "tasks": [{"id": r.task.id, "level": r.task.level, "name": r.task.name, "checks": r.task.checks,
                   "points": r.task.points, "earned": r.earned, "status": r.status, "note": r.note} for r in results],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--level", type=int, help="grade one level's tasks")
    p.add_argument("--task", help="grade one task, e.g. 4.2")
    p.add_argument("--json", default="grade.json", help="where to write the results (default grade.json)")
    p.add_argument("-v", "--verbose", action="store_true", help="show pytest's report: the failing check and why")
    p.add_argument("--require-gpu", action="store_true", help="fail GPU tasks that cannot run here")
    p.add_argument("--submission", type=Path,
                   help="grade this folder as a teacher does: a copy of the edition with a student's code in it, which "
                        "runs only in bubblewrap sandboxes (common/classroom/gradebook.py makes the copy)")
    p.add_argument("--trust-submissions", action="store_true",
                   help="with --submission: run its code without a sandbox (only for code you trust: your own)")
    p.add_argument("--strict", action="store_true",
                   help="exit 0 only when every selected task passes, not attempted ones too (for autograders that "
                        "award a test's points on exit status 0)")
    args = p.parse_args(argv)
    selected = lab.select(args.level, args.task)
    if not selected:
        raise SystemExit(f"no task matches; tasks are {', '.join(t.id for t in lab.TASKS)}")
    root = ROOT
    if args.submission:
        root = args.submission.resolve()
        os.environ[sandbox.ENV] = str(root)
        if args.trust_submissions:
            os.environ[bwrap.TRUST_ENV] = "1"
        elif not bwrap.trusted() and (why := bwrap.problem()):
            raise SystemExit(f"grade --submission: {why}")
    try:
        results = prepare(with_needs(selected), root)
        check(results, args.verbose, ["--require-gpu"] if args.require_gpu else [])
    finally:
        sandbox.stop_workers()
    shown = [results[t.id] for t in selected]
    print(table(shown))
    Path(args.json).write_text(json.dumps(report(shown), indent=1) + "\n")
    passed = ("pass",) if args.strict else ("pass", "not attempted", NEEDS_GPU)
    return 0 if all(r.status in passed for r in shown) else 1


if __name__ == "__main__":
    sys.exit(main())
