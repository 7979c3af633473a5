"""Shared fixtures: the implementations under test (read from common/levels.py), real MNIST, level 1's reference runs."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from common.classroom import lab, sandbox
from common.harness.compare import epoch_order, runs_for
from common.levels import LEVELS, THE_MLP, Level, missing
from common.nets import Network

# In a teacher's grade (common/classroom/grade.py --submission), the submission's code runs only in its sandboxed worker.
if sandbox.submission():
    sandbox.stand_in_for_python_tasks()

# Every (level, device), GPU ones included (they skip with the reason where there is none).
ALL = runs_for([lv.number for lv in LEVELS], gpu=True)
# What the suite checks against level 1 on the CPU, the gold standard.
IMPLEMENTATIONS = ALL[1:]
# The levels with a native library (C and CUDA), and of those the ones whose kernels are ours.
NATIVE = [pair for pair in ALL if pair[0].library_for()]
OWN_KERNELS = [pair for pair in NATIVE if pair[1] == "cuda"]


def each_variant(pairs) -> list[tuple[Level, str, dict[str, str]]]:
    """Each (level, device) once per variant the harness runs of it (common/nets' list: level 5's three matrix
    products, level 8's recorded step on the GPU), as (level, device, options)."""
    return [(lv, device, options) for lv, device in pairs for options in THE_MLP.variants(lv.number, device)]


def pytest_configure(config):
    """A marker per level, from common/levels.py's list (`pytest -m level4` runs level 4's tests and chapter)."""
    for lv in LEVELS:
        config.addinivalue_line("markers", f"{lv.name}: level {lv.number}, {lv.title}")


# The slowest tests on a GPU machine (half a minute to minutes each), slowest kinds first. pytest-xdist hands tests to
# its workers in the order they are collected: started first, these end beside the short ones, not after them all.
SLOWEST_FIRST = ("test_chapter_run_in_lockstep_with_level1", "test_kernels_are_clean_under_compute_sanitizer",
                 "test_a_planted_bug_fails_exactly_its_task", "test_gpu_kernels_are_clean_under_compute_sanitizer",
                 "test_this_repository_passes_every_task_it_can_run", "test_chapter_free_run_agrees_within_float32_noise")


def pytest_collection_modifyitems(config, items):
    """In a pytest-xdist worker (each collects the same list, in the same order), the slowest tests first."""
    if hasattr(config, "workerinput"):
        rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
        # A stable sort: the rest keep their order.
        items.sort(key=lambda item: rank.get(getattr(item, "originalname", ""), len(rank)))


def pytest_addoption(parser):
    parser.addoption(
        "--require-gpu",
        action="store_true",
        help="fail, instead of skipping, a GPU test that cannot run (for `make test-gpu` on the GPU machine)",
    )


def implementation_params(pairs=IMPLEMENTATIONS, graded: bool = False):
    """pytest.param per (level, device) or (level, device, options) (each_variant), as (level, device, options),
    marked levelN, plus gpu where it runs on one; graded: also task("<id>") of the level's row in the lab's grade
    (common/classroom/lab.py), which these tests then check: for the level's default variant, the code a student
    writes (level 5's kernels 2 and 3, in level5_cuda_naive/matmul.cuh, are outside every task)."""
    params = []
    for lv, device, *rest in pairs:
        options = rest[0] if rest else {}
        marks = [getattr(pytest.mark, lv.name)] + ([pytest.mark.gpu] if device == "cuda" else [])
        if graded and options == THE_MLP.variants(lv.number)[0] and (row := lab.level_row(lv.number)):
            marks.append(pytest.mark.task(row.id))
        params.append(pytest.param((lv, device, options), marks=marks, id=variant_id(lv, device, options)))
    return params


def variant_id(lv: Level, device: str, options: dict[str, str]) -> str:
    """A test's id for one variant of a level: "level5-cuda-tiled"."""
    return "-".join([lv.name, device, *options.values()])


def graded(level: int, name: str):
    """The mark of a check of the lab's grade: task("<id>") of the task of this level and name (common/classroom/lab.py)."""
    return pytest.mark.task(next(t.id for t in lab.TASKS if t.level == level and t.name == name))


def require(lv: Level, device: str, config, network: Network = THE_MLP) -> None:
    """Skip (or, with --require-gpu, fail) when this machine cannot run the level (for a network)."""
    why = missing(lv, device, network, built=not sandbox.submission())  # a submission's is built in its sandbox
    if why:
        message = f"{lv.name} on {device} cannot run here: {'; '.join(why)}"
        if device == "cuda" and config.getoption("--require-gpu"):
            pytest.fail(message)
        pytest.skip(message)


def sanitize(tool: str, script: str) -> None:
    """Run a Python script under compute-sanitizer's tool (memcheck, racecheck, synccheck); fail with its report."""
    import shutil
    import subprocess
    import sys

    sanitizer = shutil.which("compute-sanitizer") or shutil.which("/usr/local/cuda/bin/compute-sanitizer")
    if sanitizer is None:
        pytest.skip("compute-sanitizer (CUDA toolkit) not found")
    run = subprocess.run([sanitizer, "--tool", tool, "--error-exitcode", "1", sys.executable, "-c", script],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.fixture
def factory(impl, request):
    """factory(params) -> a fresh model of the implementation under test (skips when this machine cannot run it)."""
    lv, device, options = impl
    require(lv, device, request.config)
    if sandbox.submission() and lv.number > 1:  # the level is the submission's: its worker makes the models
        return sandbox.model_factory(lv.number, device, options)
    if lv.takes_device:
        return partial(lv.load(), device=device, **options)
    return partial(lv.load(), **options) if options else lv.load()  # a class, where it takes no option


def reference(params):
    """Level 1 on the CPU: the gold standard."""
    return LEVELS[0].load()(params, device="cpu")


def twin(params):
    """Level 1's float64 twin: the yardstick of float32 noise for free runs (common/harness/verify.py)."""
    return LEVELS[0].load()(params, device="cpu", dtype="float64")


@pytest.fixture
def cpu_rows(monkeypatch):
    """A table of the CPU's rows, whatever the machine: on one with a GPU, level 1 on CUDA and the peers would be rows
    too, and the tests that use it read rows by their place."""
    from common.harness import compare

    monkeypatch.setattr(compare, "gpu_available", lambda: False)


@pytest.fixture(scope="session")
def mnist():
    """The training images (normalized, read-only) and labels, and the test set, as every level sees them."""
    from common.harness.data import load_mnist, normalize

    data = load_mnist(quiet=True)
    return normalize(data.train_images), data.train_labels, normalize(data.test_images), data.test_labels


def train(model, X, y, epochs: int, batch: int, lr: float, shuffle: bool = False, seed: int = 0) -> np.ndarray:
    """Every step's loss over several epochs, in the harness's batch order."""
    return np.concatenate(
        [model.train_epoch(X, y, batch, lr, epoch_order(len(X), e, seed, shuffle)) for e in range(epochs)]
    )


def pytest_terminal_summary(terminalreporter, config):
    """Where a long run's time went, by test (all its parameters together) and fixture setup: the suite's phases, the
    longest first (each test's own durations: --durations=N)."""
    seconds, counts = {}, {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) not in ("setup", "call") or not hasattr(report, "duration"):
                continue
            name = report.nodeid.split("[")[0].removeprefix("tests/") + (" (setup)" if report.when == "setup" else "")
            seconds[name] = seconds.get(name, 0.0) + report.duration
            counts[name] = counts.get(name, 0) + (report.when == "call")
    total = sum(seconds.values())
    if total < 60:  # a quick run (a grade, one test) needs no table
        return
    terminalreporter.write_sep("=", f"where the tests' {total:.0f} s went (summed over workers), longest first")
    for name, s in [item for item in sorted(seconds.items(), key=lambda item: -item[1]) if item[1] >= 1][:25]:
        terminalreporter.write_line(f"{s:8.1f} s {s / total:6.1%}  {counts[name]:4d} x {name}")
