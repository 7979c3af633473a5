"""The seeded harness: initial weights, batch order, the compare job end to end, and its verdict."""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest

from common.contract import is_immutable
from common.harness import bench, compare
from common.harness.data import load_mnist
from common.levels import LEVELS, ROOT, gpu_tag, level, missing
from common.nets import get
from common.nets.mlp import PARAM_NAMES, init_params, param_shapes
from conftest import SLOWEST_FIRST

pytestmark = pytest.mark.harness


def test_same_seed_same_weights_other_seed_other_weights():
    a, b, c = init_params(7), init_params(7), init_params(8)
    for name in PARAM_NAMES:
        np.testing.assert_array_equal(a[name], b[name])
        assert a[name].dtype == np.float32 and a[name].shape == param_shapes()[name]
    assert not np.array_equal(a["fc1.weight"], c["fc1.weight"])


def test_he_uniform_bounds_and_zero_biases():
    params = init_params(0, 300)
    for name, fan_in in (("fc1.weight", 784), ("fc2.weight", 300)):
        bound = np.sqrt(2 / fan_in)
        assert np.abs(params[name]).max() <= bound
        assert np.abs(params[name]).max() > 0.99 * bound  # uniform over the whole range, not a narrower one
    assert not params["fc1.bias"].any() and not params["fc2.bias"].any()


def test_results_are_filed_under_the_gpus_model():
    names = ["NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA GeForce RTX 4090", "NVIDIA A100-SXM4-80GB", "Tesla T4",
             "NVIDIA Graphics Device", ""]
    assert [gpu_tag(name) for name in names] == ["h100", "h200", "4090", "a100", "t4", "device", "gpu"]


def test_epoch_order_is_in_order_or_a_seeded_permutation():
    np.testing.assert_array_equal(compare.epoch_order(5, 3, 0, shuffle=False), np.arange(5))
    first, again = compare.epoch_order(100, 0, 0, True), compare.epoch_order(100, 0, 0, True)
    np.testing.assert_array_equal(first, again)
    assert sorted(first) == list(range(100))
    assert not np.array_equal(first, compare.epoch_order(100, 1, 0, True)), "each epoch its own permutation"
    assert not np.array_equal(first, compare.epoch_order(100, 0, 1, True)), "each seed its own permutations"


def test_every_trainable_level_is_reported_or_skipped_with_a_reason(tmp_path, capsys):
    numbers = [lv.number for lv in LEVELS if lv.trains]
    args = ["--levels", ",".join(map(str, numbers)), "--epochs", "2", "--train-size", "100", "--batch", "13"]
    assert compare.main(args + ["--hidden", "16", "--out", str(tmp_path), "--quiet"]) == 0
    out = capsys.readouterr().out
    results = json.loads((tmp_path / "results.json").read_text())
    labels = [row["level"] for row in results["table"]]
    for lv in LEVELS:
        if lv.trains and missing(lv):
            assert f"skipping {lv.name}" in out
        elif lv.trains:
            assert any(label.startswith(f"{lv.name}[") for label in labels), lv.name
    assert all(row["agrees"] for row in results["table"])
    assert results["settings"]["batch"] == 13 and "MNIST" in results["data"]
    assert results["runs"][0]["steps"] == 2 * 8  # 100 images in batches of 13: 7 full steps and one of 9
    for run in results["runs"][1:-1]:  # every level but the reference (first) and its float64 twin (last)
        assert run["lockstep"]["steps"] == 16 and run["lockstep"]["failure"] is None
        assert run["free_run"]["failure"] is None and len(run["free_run"]["band"]) == 2
    assert results["runs"][-1]["label"] == "level1[cpu, float64]"
    assert (tmp_path / "loss_curves.png").stat().st_size > 0 and (tmp_path / "lockstep.png").stat().st_size > 0


def test_a_level_that_disagrees_fails_the_job(tmp_path, monkeypatch, capsys):
    cls = level(3).load()
    original = cls.train_epoch
    monkeypatch.setattr(cls, "train_epoch", lambda self, *a, **k: original(self, *a, **k) + 1e-3)
    assert compare.main(["--levels", "1,3", "--epochs", "1", "--train-size", "64", "--out", str(tmp_path), "--quiet"]) == 1
    assert "FAIL: level3[cpu] lockstep: step 0: loss" in capsys.readouterr().out


def test_a_peer_is_checked_and_reported_but_the_exit_status_is_the_levels(tmp_path, monkeypatch, capsys):
    """The peers (level1_pytorch/peers.py) are yardsticks: a failed check is printed and recorded, a missing peer is
    named, and neither fails the job. Level 3, off by 1e-3, stands in for a peer on a machine without a GPU."""
    cls = level(3).load()
    original = cls.train_epoch
    off = type("OffByALittle", (cls,), {"train_epoch": lambda self, *a, **k: original(self, *a, **k) + 1e-3})
    monkeypatch.setattr(compare, "gpu_available", lambda: True)  # on a machine without one, level 1 on CUDA is skipped
    monkeypatch.setattr(compare, "machine", lambda: {"cpu": "test"})
    monkeypatch.setattr(compare, "peer_runs", lambda model: [compare.Run("torch-graph[cuda]", 1, "cpu", off)])
    monkeypatch.setattr(compare, "missing_peers", lambda network: {"jax-scan": "JAX is not installed"})
    args = ["--levels", "1,3", "--epochs", "1", "--train-size", "64", "--out", str(tmp_path), "--quiet"]
    assert compare.main(args) == 0
    out = capsys.readouterr().out
    assert "FAIL: torch-graph[cuda] lockstep: step 0: loss" in out
    assert "skipping the peer jax-scan: JAX is not installed" in out
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["peers_not_run"] == {"jax-scan": "JAX is not installed"}
    agrees = {row["level"]: row["agrees"] for row in results["table"]}
    assert agrees.pop("torch-graph[cuda]") is False and all(agrees.values())  # level 1 on CUDA too, where it ran
    assert all(row["speedup_vs_graph"] > 0 and row["speedup_vs_eager"] is None for row in results["table"])
    table = bench.markdown_table(results)
    assert "| vs L1 cpu | vs graph | GFLOP/s |" in table  # the peers it had
    assert "| jax-scan[cuda] | not run: JAX is not installed |" in table  # and the one it lacked


def test_a_row_whose_rounds_disagree_is_flagged_not_published(tmp_path, monkeypatch, capsys):
    """--rounds times every row again on a fresh model; a row whose rounds are more than STEADY_RATIO apart shows
    its range as unsteady, and no time or ratio of it (nor ratios against it) is published."""
    cls = level(3).load()
    original = cls.train_epoch
    calls = {"n": 0}

    def disturbed_second_round(self, *args, **kwargs):
        calls["n"] += 1
        if 4 <= calls["n"] <= 5:  # level 3's second round (a warm-up epoch, then the timed one)
            time.sleep(0.3)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, "train_epoch", disturbed_second_round)
    args = ["--levels", "1,3", "--epochs", "1", "--train-size", "64", "--rounds", "3", "--out", str(tmp_path),
            "--quiet"]
    assert compare.main(args) == 0
    out = capsys.readouterr().out
    assert "UNSTEADY: level3[cpu]'s rounds took" in out and "every row timed 3 times" in out
    rows = {row["level"]: row for row in json.loads((tmp_path / "results.json").read_text())["table"]}
    assert rows["level1[cpu]"]["rounds"] == rows["level3[cpu]"]["rounds"] == 3
    assert not rows["level3[cpu]"]["steady"] and rows["level3[cpu]"]["us_per_step"] is None
    assert rows["level3[cpu]"]["speedup_vs_level1"] is None
    assert "| level3[cpu] | " in bench.markdown_table(json.loads((tmp_path / "results.json").read_text()))
    assert "unsteady" in compare.table(list(rows.values()))


def test_a_row_says_what_ran_and_fails_when_the_model_ran_something_else(tmp_path, monkeypatch, capsys, cpu_rows):
    """Each row records the variant the trained model reports (variant()), and a row whose model reports another
    than the one asked for fails instead of being timed under the wrong name."""
    cls = level(3).load()
    monkeypatch.setattr(cls, "variant", lambda self: {"device": "cuda"})
    args = ["--levels", "1,3", "--epochs", "1", "--train-size", "64", "--out", str(tmp_path), "--quiet"]
    assert compare.main(args) == 1
    assert "FAIL: level3[cpu] ran something else than its row says: device 'cpu' asked for, 'cuda' ran" in \
        capsys.readouterr().out
    rows = json.loads((tmp_path / "results.json").read_text())["table"]
    assert rows[0]["ran"] == {"device": "cpu", "dtype": "float32", "threads": 1}  # threads: read from torch
    assert rows[1]["ran"] == {"device": "cuda"}


def test_level1_on_the_cpu_runs_on_one_thread_at_a_small_step_and_says_what_ran(tmp_path, monkeypatch, capsys):
    """Level 1's threads spin while they wait for each other: below ONE_THREAD_BELOW FLOPs a step (the chapter's batch
    8) its row is timed on one PyTorch thread, above it on PyTorch's default; either way the row records the count
    read back from torch during its run, the table says it, and the process's setting is left as it was."""
    import torch

    default = torch.get_num_threads()
    assert compare.cpu_threads(get("mlp"), 8, 256) == 1 and compare.cpu_threads(get("mlp"), 256, 1024) is None
    seen = []
    cls = level(1).load()
    original = cls.train_epoch
    monkeypatch.setattr(cls, "train_epoch", lambda self, *a, **k: seen.append(torch.get_num_threads())
                        or original(self, *a, **k))
    for batch, threads in ((8, 1), (128, default)):  # 6.5 and 105 MFLOP a step
        args = ["--levels", "1", "--epochs", "1", "--train-size", "256", "--batch", str(batch), "--out", str(tmp_path),
                "--quiet"]
        seen.clear()
        assert compare.main(args) == 0
        results = json.loads((tmp_path / "results.json").read_text())
        # the estimate's first steps, the warm-up and the timed epoch; then the float64 twin, then lockstep (one thread)
        assert results["table"][0]["ran"]["threads"] == threads and seen[:4] == [threads] * 4
        assert f"level1[cpu] on {threads} PyTorch thread" in capsys.readouterr().out
        assert torch.get_num_threads() == default


def test_a_busy_machine_is_named_and_a_quiet_one_is_not(tmp_path, monkeypatch, capsys):
    """The fixed loop timed before and after the timed rows, the CPU time other programs took meanwhile and the load
    average: past BUSY_RATIO, BUSY_CORES or the core count, one warning line, recorded in results.json (and in the
    Markdown table); a steady machine gets none. Made-up clocks and counters: this test's own machine may be busy."""
    quiet = {"load_average": 0.5, "cpu_s": 100.0, "own_cpu_s": 10.0, "wall_s": 1000.0}
    later = {"load_average": 1.0, "cpu_s": 111.0, "own_cpu_s": 20.0, "wall_s": 1010.0}  # others: 1 s in 10
    assert compare.busy(quiet, later, [0.2, 0.22], 2) == (None, pytest.approx(0.1))
    why, others = compare.busy(quiet, {**later, "cpu_s": 120.0}, [0.2, 0.22], 2)
    assert others == pytest.approx(1.0) and why == "other programs used 1.0 of its 2 cores"
    assert "more than 1.3x apart" in compare.busy(quiet, later, [0.2, 0.5], 2)[0]
    # the load average counts this job's own processes (level 9's two workers on 2 cores): not a sign where the
    # others' CPU time is known, the fallback where it is not (no /proc/stat)
    assert compare.busy(quiet, {**later, "load_average": 2.5}, [0.2, 0.2], 2) == (None, pytest.approx(0.1))
    assert compare.busy({**quiet, "cpu_s": None}, {**later, "load_average": 2.5}, [0.2, 0.2], 2) == (
        "the load average reached 2.5 on 2 cores", None)
    assert compare.busy({**quiet, "cpu_s": None}, later, [0.2, 0.2], 2) == (None, None)  # no /proc/stat: not known

    args = ["--levels", "1,3", "--epochs", "1", "--train-size", "64", "--out", str(tmp_path), "--quiet"]
    for calibration, warned in (([0.2, 0.21], False), ([0.2, 0.5], True)):
        times = iter(calibration)
        counters = iter([quiet, later])
        monkeypatch.setattr(compare, "calibrate", lambda: next(times))
        monkeypatch.setattr(compare, "snapshot", lambda: next(counters))
        assert compare.main(args) == 0
        out = capsys.readouterr().out
        assert ("WARNING: the machine was busy while the rows were timed" in out) == warned
        results = json.loads((tmp_path / "results.json").read_text())
        assert (results["busy"] is not None) == warned and results["load"]["calibration_s"] == calibration
        assert ("**Measured on a busy machine**" in bench.markdown_table(results)) == warned


def test_the_table_fits_a_terminal_says_its_units_and_sums_up_the_ties(tmp_path, capsys, cpu_rows):
    """The default view: at most 110 columns, even with four peers (the committed H100 run, an older results.json),
    the units under it; --wide and the Markdown table keep every column. One line sums up the ties by level; --verbose
    lists them. Before training the job says how long it will take, and at the end how long it took."""
    committed = json.loads((ROOT / "results/h100/chapter/results.json").read_text())["table"]
    text = compare.table(committed) + "\n" + compare.legend(committed)
    assert max(map(len, text.splitlines())) <= 115 and "vs jax" in text and "GFLOP/s" not in text
    assert "1.00 = the limit" in text and "us/step: microseconds per training step" in text
    assert "GFLOP/s" in compare.table(committed, wide=True) and "| train s |" in compare.table(committed, markdown=True)
    args = ["--levels", "1,3,4", "--epochs", "1", "--train-size", "496", "--out", str(tmp_path), "--quiet"]
    assert compare.main(args) == 0
    out = capsys.readouterr().out
    assert "this will take about" in out and "took " in out and "(estimated: about" in out
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    tied = {run["label"]: [tie["step"] for tie in run["lockstep"]["ties"]] for run in runs if run.get("lockstep")}
    line = next((line for line in out.splitlines() if line.startswith("ties found and explained")), "")
    assert all((f"{label} {len(steps)} at step" in line) == bool(steps) for label, steps in tied.items()), line
    # The full MNIST's step 58 has a ReLU within float32's reach of 0 (not the offline subset's). Which level's sums
    # round it the other way depends on the CPU's BLAS (level 3 on this course's CI, level 4 on an H200's host).
    full = not load_mnist(quiet=True).offline
    assert re.search(r"level[34]\[cpu\] 1 at step 58\b", line) or not full, line
    assert "tie: " not in out and "where the" not in out
    assert compare.main(args + ["--verbose", "--wide"]) == 0
    out = capsys.readouterr().out
    assert (re.search(r"tie: level[34]\[cpu\] at step 58\b", out) or not full) and "where the" in out
    assert "GFLOP/s" in out
    assert compare.ties_line([compare.Run("level4[cpu]", 4, "cpu", None, lockstep={"ties": [{"step": s} for s in
                                                                                         (3, 9, 27, 81)]})]) \
        .endswith("level4[cpu] 4 at steps 3, 9, 27 and 1 more")
    assert compare.duration(42) == "42 s" and compare.duration(200) == "3 min 20 s"


def test_each_variant_of_a_level_is_a_row_of_its_own():
    """The network list names each level's variants (its convolutions, its matrix products, the MLP's level 8 step
    replayed as a CUDA graph on a GPU), the default first; the harness makes a row of each, named after its options."""
    mlp, lenet = get("mlp"), get("lenet")
    assert mlp.variants(5) == ({"matmul": "naive"}, {"matmul": "tiled"}, {"matmul": "blocked"})
    assert mlp.variants(4) == mlp.variants(6) == ({},)
    assert lenet.variants(5) == ({"convolution": "direct"}, {"convolution": "tiled"}) and lenet.variants(6) == ({},)
    assert mlp.variants(8, "cuda") == ({}, {"step": "graph"}) and mlp.variants(8) == lenet.variants(8, "cuda") == ({},)
    assert compare.row_label(level(8), "cuda", {"step": "graph"}) == "level8[cuda, graph]"
    assert compare.row_label(level(5), "cuda", {"matmul": "tiled"}) == "level5[cuda, tiled]"
    assert compare.row_label(level(4), "cpu", {}) == "level4[cpu]"


def test_committed_variants_that_are_the_same_bits_launched_their_own_kernels():
    """Level 5's three matrix products add each output's terms in one order, so their committed rows agree to the
    last bit (loss, lockstep, accuracy): the numbers alone cannot show that each variant reached the GPU. Each row's
    `ran` is read back from the library (mlp_get_matmul), and the same tag's profile.json, taken by the GPU's
    profiler, must show each of those rows launching kernels of its own at that preset's size."""
    checked = 0
    for profile_path in sorted(ROOT.glob("results/*/profile.json")):
        launched = {(r["level"], r["batch"], r["hidden"]): frozenset(name for name, _ in r["top_kernels"])
                    for r in json.loads(profile_path.read_text())}
        for preset in ("chapter", "large-b256"):
            path = profile_path.parent / preset / "results.json"
            if not path.exists():
                continue
            results = json.loads(path.read_text())
            size = (results["settings"]["batch"], results["settings"]["hidden"])
            same: dict[tuple, list[dict]] = {}
            for row in results["table"]:
                key = (row["level"].split("[")[0], row["final_loss"], row["lockstep_used"], row["test_accuracy"])
                same.setdefault(key, []).append(row)
            for rows in (rows for rows in same.values() if len(rows) > 1):
                where = f"{path.relative_to(ROOT)}: {[r['level'] for r in rows]}"
                assert len({json.dumps(r["ran"], sort_keys=True) for r in rows}) == len(rows), where
                kernels = [launched.get((r["level"], *size)) for r in rows]
                assert None not in kernels, f"{where}: not in {profile_path.relative_to(ROOT)} at batch, hidden {size}"
                assert len(set(kernels)) == len(rows), f"{where}: the profile shows the same kernels"
                checked += len(rows)
    assert checked, "no committed rows of one level that are the same bits were checked against a profile"


def test_adam_trains_the_levels_that_implement_it_and_says_so(tmp_path, capsys, cpu_rows):
    """--optimizer adam: the levels that implement Adam train with it (PyTorch's lr, 1e-3, by default) and are
    verified with its state; the others are skipped with the reason; results.json records it in its settings and, read
    back from each model, in each row's variant."""
    args = ["--levels", "1,3,4", "--optimizer", "adam", "--epochs", "1", "--train-size", "64", "--out", str(tmp_path),
            "--quiet"]
    assert compare.main(args) == 0
    out = capsys.readouterr().out
    assert "skipping level4 (Plain C through cffi): " in out and "level 4 trains with SGD only, not Adam" in out
    assert ", Adam, lr 0.001," in out
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["settings"]["optimizer"] == "adam" and results["settings"]["lr"] == 1e-3
    assert [(row["level"], row["ran"]["optimizer"]) for row in results["table"]] == [("level1[cpu]", "adam"),
                                                                                    ("level3[cpu]", "adam")]
    lockstep = results["runs"][1]["lockstep"]
    assert lockstep["failure"] is None and lockstep["steps"] == 8
    assert {"fc1.weight", "fc1.weight.exp_avg", "fc1.weight.exp_avg_sq"} <= set(lockstep["update_err"])
    assert results["runs"][-1]["ran"] == {"device": "cpu", "dtype": "float64", "optimizer": "adam",  # the twin
                                          "threads": 1}


def test_a_level_that_trains_with_another_optimizer_than_asked_fails(tmp_path, monkeypatch, capsys):
    cls = level(3).load()
    monkeypatch.setattr(cls, "variant", lambda self: {"device": "cpu"})
    args = ["--levels", "1,3", "--optimizer", "adam", "--epochs", "1", "--train-size", "64", "--out", str(tmp_path),
            "--quiet"]
    assert compare.main(args) == 1
    assert "FAIL: level3[cpu] ran something else than its row says: optimizer 'adam' asked for, None ran" in \
        capsys.readouterr().out


@pytest.mark.parametrize("optimizer, lr", [("sgd", 0.01), ("adam", 1e-3)])
def test_the_timed_epochs_come_after_an_untimed_one_from_the_same_weights(tmp_path, monkeypatch, mnist, optimizer, lr,
                                                                          cpu_rows):
    """Compilation and graph captures happen in a first call: the harness trains one epoch before the clock starts,
    then loads the initial weights back, and forgets Adam's moments, so the free run is the one the lockstep checks,
    from a first step."""
    cls = level(3).load()
    original = cls.train_epoch

    def slow_first_call(self, *args, **kwargs):
        if not getattr(self, "warm", False):
            self.warm = True
            time.sleep(0.5)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, "train_epoch", slow_first_call)
    args = ["--levels", "1,3", "--epochs", "2", "--train-size", "64", "--optimizer", optimizer, "--lr", str(lr),
            "--out", str(tmp_path), "--quiet"]
    assert compare.main(args) == 0
    run = json.loads((tmp_path / "results.json").read_text())["runs"][1]
    assert run["label"] == "level3[cpu]" and max(run["epoch_seconds"]) < 0.5
    fresh = level(1).load()(init_params(0), device="cpu", optimizer=optimizer)
    losses = [fresh.train_epoch(mnist[0][:64], mnist[1][:64], 8, lr) for _ in range(2)]
    # from the initial weights and a fresh optimizer, not the warm ones: every epoch (Adam's state lives on in the second)
    assert run["epoch_means"] == pytest.approx([epoch.mean() for epoch in losses], rel=1e-5)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--levels", "3"], "level 1 is the gold standard"),
        (["--levels", "1,99"], f"no level 99: the levels are {','.join(str(lv.number) for lv in LEVELS)}"),
        (["--levels", "1,a"], "comma-separated level numbers"),
        (["--seed", "-1"], "--seed must be >= 0"),
        (["--lr", "nan"], "--lr must be a finite number"),
        (["--epochs", "0"], "--epochs must be >= 1"),
        (["--out", "/proc/no-such-place"], "cannot write there"),
    ],
)
def test_bad_arguments_are_refused_before_any_training(args, words, capsys):
    with pytest.raises(SystemExit):
        compare.main(args)
    assert words in capsys.readouterr().err


def test_repeated_data_set_stays_immutable(tmp_path, monkeypatch, mnist):
    """--repeat must hand the levels immutable arrays too, or every native level re-uploads the data set each epoch."""
    seen = []
    cls = level(3).load()
    original = cls.train_epoch
    monkeypatch.setattr(cls, "train_epoch", lambda self, X, y, *a, **k: seen.append((X, y)) or original(self, X, y, *a, **k))
    n = len(mnist[0]) + 500  # more than the data set holds, whichever set this machine has
    args = ["--levels", "1,3", "--epochs", "1", "--train-size", str(n), "--repeat", "--batch", "500"]
    assert compare.main(args + ["--out", str(tmp_path), "--quiet"]) == 0
    X, y = seen[0]
    assert len(X) == len(y) == n and is_immutable(X) and is_immutable(y)


# ---- level 5's matrix-product kernels against cuBLAS (common/harness/matmul_kernels.py) ----


def test_the_kernels_table_counts_a_steps_matrix_products():
    """The five products the script times are the step's: their multiply-adds are flops_per_step's, at both sizes."""
    from common.harness import matmul_kernels as mk
    from common.nets.mlp import flops_per_step

    assert mk.KERNELS == ["cublas", "naive", "tiled", "blocked"]  # kernel 0, the reference, first
    for batch, hidden in mk.SIZES:
        shapes = [product.shape(batch) for product in mk.step_products(hidden)]
        assert sum(2 * m * n * k for m, n, k in shapes) == flops_per_step(batch, hidden)


def test_the_kernels_check_passes_float32_rounding_and_fails_a_dropped_term():
    """A kernel is timed only after its result is within the bound of any float32 sum: the float64 product rounded to
    float32 uses a small share of it; a product that drops the last term of its sums (a tile bound one short) is past
    it."""
    from common.harness import matmul_kernels as mk

    for product in mk.step_products(37):
        x, w, dout = data = mk.operands(13, product)
        k = product.shape(13)[2]
        assert mk.error_share(product.exact(*data).astype(np.float32), product, data, k) < 0.5, product.name
        short = [(x.copy(), w, dout), (x, w, dout.copy()), (x, w, dout.copy())][product.kind]
        [short[0][:, -1], short[2][-1], short[2][:, -1]][product.kind][...] = 0  # the sum's last term: 0
        assert mk.error_share(product.exact(*short).astype(np.float32), product, data, k) > 5, product.name


def test_the_kernels_table_names_each_kernel_and_its_share_of_cublas():
    from common.harness import matmul_kernels as mk

    timing = {"cublas": 2.0, "naive": 8.0, "tiled": 4.0, "blocked": 2.5}  # us: made up, for the layout only
    products = [{"product": p.name, **dict(zip("mnk", p.shape(8))),
                 "kernels": {kernel: {"us": us, "gflops": 2 * np.prod(p.shape(8)) / us / 1e3}
                             for kernel, us in timing.items()}} for p in mk.step_products(256)]
    table = mk.markdown([{"batch": 8, "hidden": 256, "products": products, "step": mk.step_total(products)}],
                        {"gpu": "a GPU"})
    assert "| kernel 0: cublas |" in table and "| kernel 3: blocked |" in table
    assert "(100%)" in table and "(25%)" in table and "(50%)" in table and "(80%)" in table
    assert "| h = x W1^T (8 x 256 x 784) |" in table


def test_the_kernels_libraries_build_and_refuse_bad_sizes_before_touching_a_gpu():
    """build/matmul_level5.so and build/matmul_level6.so (one source, each level's mlp.cu) compile with the levels'
    flags, and their one function checks its arguments first."""
    import shutil

    from common.harness import matmul_kernels as mk
    from common.levels import level

    if not shutil.which("nvcc") or not level(6).library_for().exists():
        pytest.skip("the kernels' libraries need nvcc and cuBLAS (make level6)")
    ffi, libraries = mk.load()
    x = np.zeros(4, dtype=np.float32)
    for lib in libraries.values():
        buffer = ffi.from_buffer("float[]", x)
        assert lib.product_run(1, lib.PRODUCT_FORWARD, buffer, buffer, buffer, 0, 2, 2, buffer, 1, 1, buffer) == 1
        assert "sizes, launches and repeats must be >= 1" in ffi.string(lib.mlp_last_error()).decode()


def test_the_roofline_puts_each_gpu_levels_step_under_the_measured_roof():
    """common/book/figures/roofline.py under the committed H100 ceilings: the roof bends at their ridge, each GPU
    level's step (not a peer, not a CPU row, not an unpublished one) is a point at its sizes' intensity, and the caption
    says what is measured: the kernels' points only once their file exists."""
    from common.book.figures import roofline
    from common.nets.mlp import bytes_per_step, flops_per_step

    ceilings = json.loads((ROOT / "results/h100/debugging/ceilings.json").read_text())
    ridge = ceilings["fp32_matmul_tflops_measured"] / ceilings["copy_tb_per_s_measured"]
    assert roofline.roof(np.array([ridge / 2, ridge, 2 * ridge]), ceilings) == pytest.approx(
        ceilings["fp32_matmul_tflops_measured"] * 1e3 * np.array([0.5, 1, 1]))

    def row(level: str, device: str, gflops: float | None) -> dict:
        return {"level": level, "device": device, "gflops": gflops}

    # Two runs of make bench's form with made-up rates, for the arithmetic only
    runs = [{"settings": {"batch": batch, "hidden": hidden},
             "table": [row("level1[cpu]", "cpu", 5.0), row("level5[cuda]", "cuda", 100.0), row("level6[cuda]", "cuda", None),
                       row("level7[cuda]", "cuda", 900.0), row("torch-graph[cuda]", "cuda", 300.0)]}
            for batch, hidden in ((8, 256), (256, 1024))]
    points = roofline.step_points(runs)
    assert {label for label, *_ in points} == {"level5[cuda]", "level7[cuda]"}  # level 6's time was not published
    for label, index, x, y in points:
        s = runs[index]["settings"]
        assert x == flops_per_step(s["batch"], s["hidden"]) / bytes_per_step(s["batch"], s["hidden"]) and y > 0

    def caption(figure) -> str:
        return " ".join(" ".join(text.get_text() for text in figure.texts).split())

    product = {"m": 8, "n": 256, "k": 784}  # one product alone, made-up rates: for the arithmetic only
    kernels = {"sizes": [{"batch": 8, "hidden": 256, "products": [product],
                          "step": {"cublas": {"gflops": 500.0}, "tiled": {"gflops": 90.0}}}]}
    assert roofline.kernel_points(kernels) == [("cublas", 0, pytest.approx(2 * 8 * 256 * 784 / (4 * (8 * 784 + 784 * 256
                                                + 8 * 256))), 500.0), ("tiled", 0, pytest.approx(3.84, rel=1e-2), 90.0)]
    assert "the kernels are not measured yet" in caption(roofline.roofline(ceilings, runs))
    assert "and of each kernel (matmul_kernels.py)" in caption(roofline.roofline(ceilings, runs, kernels))
    # A chapter draws only the rows its reader has met; level 7's note on its bytes goes with level 7's point.
    assert {label for label, *_ in roofline.step_points(runs, {"level5[cuda]"})} == {"level5[cuda]"}
    assert "Level 7 keeps its weights on chip" in caption(roofline.roofline(ceilings, runs))
    assert "Level 7" not in caption(roofline.roofline(ceilings, runs, kernels, rows={"level5[cuda]",
                                                                                     "level5[cuda, tiled]"}))


def test_the_slowest_first_are_tests_that_exist():
    """conftest's SLOWEST_FIRST names test functions by name: one renamed would silently lose its place at the front."""
    defined = {name for path in (ROOT / "tests").glob("test_*.py")
               for name in re.findall(r"^def (test_\w+)\(", path.read_text(), re.MULTILINE)}
    assert set(SLOWEST_FIRST) <= defined, sorted(set(SLOWEST_FIRST) - defined)


def test_bench_times_two_gpus_only_where_there_are_two(monkeypatch, capsys):
    import torch

    from common.harness import scaling
    from common.harness.phases import Phases
    from level9_data_parallel import allreduce

    asked = []
    monkeypatch.setattr(allreduce, "main", lambda argv: asked.append(("allreduce", argv)) or 0)
    monkeypatch.setattr(scaling, "main", lambda argv: asked.append(("scaling", argv)) or 0)
    monkeypatch.setattr(bench, "gpu_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert bench.time_two_gpus("h200", Phases()) == 0 and asked == []  # one GPU: nothing timed, nothing said
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert bench.time_two_gpus("h200", Phases()) == 0
    folder = bench.RESULTS / "h200x2"
    assert asked == [("allreduce", ["--backend", "nccl", "--out", str(folder / "allreduce.json")]),
                     ("scaling", ["--out", str(folder / "scaling.json")])]
    assert "2 GPUs" in capsys.readouterr().out
