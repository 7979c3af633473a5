"""What a framework costs (common/harness/framework_cost.py) at small sizes: each row is verified before it is timed, a
row's repeats that disagree are flagged and not published, and the files say what ran. The times themselves are
measured by the script, never asserted here (speed goals live in make bench)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from common.harness import framework_cost as fc
from common.harness import results

pytestmark = pytest.mark.level8


def small_data(mnist, steps: int = 6):
    from common.harness.data import dataset

    n = steps * fc.BATCH
    return dataset(mnist[0][:n], mnist[1][:n])


def test_the_operation_is_timed_each_way_on_the_cpu():
    """Four rows, in order, each read back as having run on the CPU; the framework's cost is recording minus the
    backend's function."""
    ops = fc.measure_ops("cpu", calls=40, repeats=3, parts=4)
    assert [r["label"] for r in ops["rows"]] == list(fc.OP_ROWS)
    assert {r["ran"] for r in ops["rows"]} == {"cpu"}
    for r in ops["rows"]:
        assert len(r["repeats_us"]) == 3 and min(r["repeats_us"]) > 0
        assert r["us_range"] == [min(r["repeats_us"]), max(r["repeats_us"])]
    by = {r["label"]: r["us"] for r in ops["rows"]}
    if None not in (by["level 8, recording"], by["backend function"]):
        assert ops["framework_us_per_op"] == pytest.approx(by["level 8, recording"] - by["backend function"])
    else:
        assert ops["framework_us_per_op"] is None


def test_the_ways_compute_the_same_relu():
    """The four ways time one operation: the same values, and only the recording ones leave a node in the graph."""
    ways = fc.op_calls("cpu")
    expected = ways["backend function"][0]()
    for label in ("level 8, no graph", "level 8, recording"):
        with ways[label][2]():
            out = ways[label][0]()
        np.testing.assert_array_equal(out.numpy(), expected)
        assert (out.node is not None) == (label == "level 8, recording")
    theirs = ways["PyTorch, recording"][0]()
    np.testing.assert_array_equal(theirs.detach().numpy(), expected)
    assert theirs.grad_fn is not None


def test_each_step_is_verified_then_timed_on_the_cpu(mnist):
    steps = fc.measure_steps("cpu", small_data(mnist), steps=6, hidden=16, repeats=2, parts=2)
    rows = {r["label"]: r for r in steps["rows"]}
    assert list(rows) == ["level3[cpu]", "level1[cpu]", "level8[cpu]"]
    assert rows["level8[cpu]"]["ran"] == {"device": "cpu"}  # SGD, the default, goes unnamed
    assert rows["level1[cpu]"]["lockstep_used"] is None  # the reference
    assert 0 <= rows["level3[cpu]"]["lockstep_used"] < 1 and 0 <= rows["level8[cpu]"]["lockstep_used"] < 1


def test_a_step_that_fails_lockstep_is_not_timed(mnist, monkeypatch):
    """Level 8 with a learning rate 0.2% too large (a bug lockstep catches at the first step) raises before timing."""
    from level8_framework import optim

    original = optim.SGD._step

    def off(self, live):
        self.lr *= 1.002
        original(self, live)
        self.lr /= 1.002

    monkeypatch.setattr(optim.SGD, "_step", off)
    monkeypatch.setattr(fc, "in_rounds", lambda *a: pytest.fail("timed an implementation that failed lockstep"))
    with pytest.raises(AssertionError, match=r"level8\[cpu\] failed lockstep with level 1, so it is not timed"):
        fc.measure_steps("cpu", small_data(mnist), steps=6, hidden=16, repeats=2, parts=2)


def test_repeats_more_than_the_steady_ratio_apart_are_flagged_and_not_published():
    steady = fc.row("a", [1e-6, 1.1e-6, 1.05e-6])
    assert steady["steady"] and steady["us"] == pytest.approx(1.05)
    unsteady = fc.row("b", [1e-6, 1.1e-6, 1e-6 * fc.STEADY_RATIO * 1.01])
    assert not unsteady["steady"] and unsteady["us"] is None
    assert "unsteady" in fc._us(unsteady) and fc.ratio(1.0, unsteady["us"]) == "-"


def test_the_files_say_what_ran_and_flag_an_unsteady_row(mnist, monkeypatch, tmp_path):
    """main writes results/<tag>/framework-cost.json and .md: the machine, its load, each row's median and range; a
    row whose repeats disagree shows its range, flagged, and no time or ratio."""
    monkeypatch.setattr(results, "ROOT", tmp_path)
    small = fc.measure
    monkeypatch.setattr(fc, "measure", lambda: small(calls=40, steps=6, repeats=2, parts=2, hidden=16, quiet=True))
    monkeypatch.setattr(fc, "devices", lambda: ["cpu"])
    assert fc.main(["--tag", "test"]) == 0
    record = json.loads((tmp_path / "results/test/framework-cost.json").read_text())
    assert record["machine"]["cpu_count"] and len(record["load"]["before"]) == 3
    assert [ops["device"] for ops in record["ops"]] == [steps["device"] for steps in record["steps"]] == ["cpu"]
    table = (tmp_path / "results/test/framework-cost.md").read_text()
    assert "| level 8, recording |" in table and "| level8[cpu] |" in table
    step = record["steps"][0]["rows"][0]
    record["steps"][0]["rows"][0] = {**step, "us": None, "steady": False}
    flagged = fc.markdown(record)
    line = next(line for line in flagged.splitlines() if line.startswith(f"| {step['label']} |"))
    assert "unsteady" in line and "not published" in line and "x |" not in line


@pytest.mark.gpu
def test_the_gpu_rows_are_verified_then_timed(mnist, request):
    """On a GPU: the operation each way on the device (read back from what ran), and level 8's step, op by op and
    replayed as a CUDA graph, beside level 6's and PyTorch eager's, each verified in lockstep first."""
    from common.levels import level
    from conftest import require

    require(level(8), "cuda", request.config)
    require(level(6), "cuda", request.config)
    ops = fc.measure_ops("cuda", calls=40, repeats=2, parts=2)
    assert {r["ran"] for r in ops["rows"]} == {"cuda"}
    steps = fc.measure_steps("cuda", small_data(mnist), steps=6, hidden=16, repeats=2, parts=2)
    rows = {r["label"]: r for r in steps["rows"]}
    assert list(rows) == ["level6[cuda]", "torch-eager[cuda]", "level8[cuda]", "level8[cuda, graph]"]
    assert rows["level8[cuda]"]["ran"] == {"device": "cuda"}  # SGD, the default, goes unnamed
    assert rows["level8[cuda, graph]"]["ran"] == {"device": "cuda", "step": "graph"}
    assert all(0 <= r["lockstep_used"] < 1 for r in rows.values())
