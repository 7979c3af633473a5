"""make bench: every level's speed at the chapter's settings and at larger ones, each level verified before it is timed.

    python -m common.harness.bench [--tag h200] [--presets chapter,large-b256,lenet,lenet-b64,lenet-b256]
    python -m common.harness.bench --presets none    # only the GPU profile (--no-profile: the presets only)
    python -m common.harness.bench --report          # only rewrite results/README.md's tables and results/speed.png
    python -m common.harness.bench --quick           # every preset small, one round: a change checked in minutes
    python -m common.harness.bench --resume          # a stopped run finished: the rounds already timed are kept

Each preset is one run of the compare harness (common.harness.compare), so every level is checked against
level 1 step by step before its time counts, and every row is timed ROUNDS times, in rounds over the rows (a row whose
rounds disagree is flagged, not published); results go to results/<tag>/<preset>/. On a GPU it
also profiles one epoch of every GPU implementation to split a step into kernel time and the rest
(launch overhead and gaps between kernels), written to results/<tag>/profile.json. On a machine with two GPUs it
then times NCCL's all-reduce and the MLP's step on one GPU and in DDP on two (level9_data_parallel/allreduce.py,
common/harness/scaling.py), written to results/<tag>x2/.
On a GPU machine the presets time the rows on the GPU (and level 1 on the CPU, the reference): the CPU levels' tables
come from a CPU machine. The lockstep runs in one process per core (common/harness/parallel.py); each preset prints
where its time went, and the bench each preset's total at the end. --quick writes to results/<tag>-quick/, which is
not committed: its runs are too short to publish.
The tables of results/README.md and the README's picture, results/speed.png, are written by this script from those
files, never typed by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import Counter

import numpy as np

from common.contract import immutable
from common.harness import compare
from common.harness.data import load_mnist, normalize
from common.harness.phases import Phases
from common.levels import LEVELS, ROOT, THE_MLP, gpu_available, machine_tag, missing
from common.nets import get
from common.nets.mlp import init_params

PRESETS = {
    "chapter": [],
    "large-b256": ["--train-size", "60000", "--hidden", "1024", "--batch", "256", "--epochs", "3"],
    "lenet": ["--model", "lenet"],  # LeNet-5's chapter run (common/nets)
    # LeNet-5 at a larger batch, where the libraries' kernels have work: the GPU levels against the peers
    "lenet-b64": ["--model", "lenet", "--levels", "1,5,6,7,8", "--train-size", "5120", "--batch", "64",
                  "--epochs", "3"],
    "lenet-b256": ["--model", "lenet", "--levels", "1,5,6,7,8", "--train-size", "5120", "--batch", "256",
                   "--epochs", "3"],
}
ROUNDS = 3  # each row timed three times: its median, its range, and a flag where they disagree
# --quick: every preset on fewer images and epochs, one round (appended: the last of an option counts)
QUICK = {"chapter": ["--train-size", "2000", "--epochs", "1"],
         "large-b256": ["--train-size", "5120", "--epochs", "1"],
         "lenet": ["--train-size", "1600", "--epochs", "1"],
         "lenet-b64": ["--train-size", "1024", "--epochs", "1"],
         "lenet-b256": ["--train-size", "1024", "--epochs", "1"]}
QUICK_PROFILE_STEPS = 100
GPU_ONLY = {"lenet-b64", "lenet-b256"}  # presets of GPU levels alone: left out where no GPU is
RESULTS = ROOT / "results"
TABLES = RESULTS / "README.md"  # its block of tables is written here; the README shows SPEED
SPEED = RESULTS / "speed.png"
BEGIN, END = "<!-- results:begin (written by python -m common.harness.bench --report) -->", "<!-- results:end -->"


# (batch, hidden) of the profiled steps: the chapter's, and the large setting's.
PROFILE_SHAPES = ((8, 256), (256, 1024))


def profile_gpu(steps: int = 400, clock: Phases | None = None) -> list[dict]:
    """Per step of each GPU implementation: wall time, time in GPU work (CUPTI via torch.profiler), the busiest kernels.

    Every wall time is taken before the first profile: once the profiler has run, PyTorch leaves NVIDIA's profiling
    library (CUPTI) attached, and every later launch of the process is slower."""
    import torch

    clock = clock or Phases()
    from torch.profiler import ProfilerActivity, profile

    data = load_mnist(quiet=True)
    shapes = []
    for batch, hidden in PROFILE_SHAPES:
        n = steps * batch  # the data set repeated as needed: only the timing matters here
        X = normalize(np.resize(data.train_images, (n, data.train_images.shape[1])))
        y = immutable(np.resize(data.train_labels, n))  # immutable, as in the harness: uploaded once, not every epoch
        gpu_runs = [compare.Run(compare.row_label(lv, "cuda", options), lv.number, "cuda",
                                compare.factory(lv, "cuda", **options))
                    for lv, device in compare.runs_for([lv.number for lv in LEVELS], gpu=True)
                    if device == "cuda" and not missing(lv, "cuda") for options in THE_MLP.variants(lv.number, device)]
        for run in gpu_runs[:1] + compare.peer_runs(THE_MLP) + gpu_runs[1:]:
            with clock(f"profile: {run.label} made, warmed up and timed"):
                model = run.factory(init_params(0, hidden))
                model.train_epoch(X, y, batch, 0.01)  # warm-up and the one upload of the data set
                start = time.perf_counter()
                model.train_epoch(X, y, batch, 0.01)
                shapes.append((run, model, X, y, batch, hidden, (time.perf_counter() - start) / steps))
    rows = []
    for run, model, X, y, batch, hidden, wall in shapes:
        with clock("profile: every implementation under torch.profiler"), profile(
                activities=[ProfilerActivity.CUDA]) as prof:
            model.train_epoch(X, y, batch, 0.01)
        on_gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]  # kernels, copies
        busy = Counter()
        for event in on_gpu:
            busy[event.name] += event.device_time / steps  # microseconds per step
        gpu_us = sum(busy.values())
        rows.append(
            {
                "level": run.label,
                "batch": batch,
                "hidden": hidden,
                "wall_us_per_step": wall * 1e6,
                "kernel_us_per_step": gpu_us,
                "launches_per_step": len(on_gpu) / steps,
                "other_us_per_step": wall * 1e6 - gpu_us,
                "top_kernels": [[name, us] for name, us in busy.most_common(3)],
            }
        )
        r = rows[-1]
        print(
            f"{r['level']:<22} batch {batch:>3}, hidden {hidden:>4}: {r['wall_us_per_step']:7.1f} us/step = "
            f"{gpu_us:7.1f} us of GPU work in {r['launches_per_step']:.2g} launches + {r['other_us_per_step']:7.1f} us "
            f"launch overhead and gaps; busiest: "
            + ", ".join(f"{name[:40]} {us:.1f} us" for name, us in r["top_kernels"])
        )
    return rows


def markdown_table(results: dict) -> str:
    """One preset's table, as the README shows it: its settings, machine and timing rule, then compare's table."""
    s = results["settings"]
    m = results["machine"]
    where = f"{m.get('cpu', '?')}, {m.get('cpu_count', '?')} cores"
    if "gpu" in m:
        where = f"{m['gpu']} (driver {m['driver']}, CUDA {m['cuda_runtime']}); CPU levels on the host: {where}"
    network = f"hidden {s['hidden']}" if "hidden" in s else get(s["model"]).title
    lines = [
        f"**{s['train_size']:,} images x {s['epochs']} epochs, batch {s['batch']}, {network}** - {where}; "
        f"data: {results['data'].rsplit(', ', 1)[0]}. {compare.timing_rule(s)}",
        "",
        compare.table(results["table"], markdown=True),
    ]
    lines += [f"| {name}[cuda] | not run: {why} |" for name, why in results.get("peers_not_run", {}).items()]
    if results.get("busy"):  # recorded since the check of the machine's load (compare.busy); older files have none
        lines += ["", f"**Measured on a busy machine** ({results['busy']}): these times are not to be trusted."]
    peers = [row for row in results["table"] if "written as" in row.get("ran", {})]
    if peers:
        lines += ["", "The peers, as written: " + "; ".join(f"{row['level']}: {row['ran']['written as']}"
                                                          for row in peers) + "."]
    return "\n".join(lines)


def kernel_name(signature: str) -> str:
    """A kernel's name without return type, namespaces' noise, template and call arguments."""
    name = signature.removeprefix("void ").replace("(anonymous namespace)::", "").replace("at::native::", "")
    return re.split(r"[(<]", name)[0][:40]


def profile_markdown(rows: list[dict]) -> str:
    """The profile as a markdown table."""
    lines = [
        "| implementation | batch | hidden | us/step | GPU busy (us/step) | launches/step | launch overhead and gaps (us/step) "
        "| busiest kernels (us/step) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        busiest = ", ".join(f"`{kernel_name(name)}` {us:.1f}" for name, us in r["top_kernels"])
        lines.append(
            f"| {r['level']} | {r['batch']} | {r['hidden']} | {r['wall_us_per_step']:.1f} | {r['kernel_us_per_step']:.1f} | "
            f"{r['launches_per_step']:.2g} | {r['other_us_per_step']:.1f} | {busiest} |"
        )
    lines.append("\nEach row is one epoch under torch.profiler, in a run of its own: read it for how a step's time splits "
                 "(inside kernels and copies, and the rest), not for speed, which the tables time as the median of "
                 "repeated epochs without the profiler; the two us/step differ.")
    return "\n".join(lines)


def report() -> None:
    """Rewrite results/README.md's block of tables from every results/<tag>/<preset>/results.json, each failed row
    with its reason, and draw results/speed.png from the H100's."""
    blocks = []
    tags = RESULTS.iterdir() if RESULTS.is_dir() else ()
    for tag_dir in sorted(p for p in tags if p.is_dir() and p.name not in ("local", "memory")
                          and not p.name.endswith("-quick")):  # --quick's runs are too short to publish
        for preset in PRESETS:
            path = tag_dir / preset / "results.json"
            if path.exists():
                results = json.loads(path.read_text())
                failures = "".join(f"\n\n{row['level']} FAILED: {row['failure']}" for row in results["table"]
                                   if not row["agrees"])
                blocks.append(f"`{tag_dir.name}/{preset}/`\n\n" + markdown_table(results) + failures)
        if (scaled := tag_dir / "scaling.json").exists():  # a machine of two GPUs (--two-gpus)
            from common.harness import scaling

            allreduce = tag_dir / "allreduce.json"
            blocks.append(f"`{tag_dir.name}/scaling.json`\n\n" + scaling.markdown(
                json.loads(scaled.read_text()), json.loads(allreduce.read_text()) if allreduce.exists() else None))
        profile_path = tag_dir / "profile.json"
        if profile_path.exists():
            title = f"`{tag_dir.name}/profile.json` - where a GPU step's time goes (one epoch under torch.profiler)"
            blocks.append(title + "\n\n" + profile_markdown(json.loads(profile_path.read_text())))
    text = TABLES.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{TABLES.relative_to(ROOT)} has no block of tables ({BEGIN} ... {END})")
    head, rest = text.split(BEGIN, 1)
    TABLES.write_text(head + BEGIN + "\n\n" + "\n\n".join(blocks) + "\n\n" + END + rest.split(END, 1)[1])
    print(f"{TABLES.relative_to(ROOT)}: {len(blocks)} tables")
    if speed_figure(RESULTS / "h100"):
        print(f"{SPEED.relative_to(ROOT)}: drawn")


def speed_figure(tag_dir) -> bool:
    """results/speed.png: each implementation's time per step at the chapter's size and at batch 256, log scale, from
    a tag's committed results (unsteady rows left out, and said); False where the results are missing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from common.harness import plots

    presets = [(name, tag_dir / name / "results.json") for name in ("chapter", "large-b256")]
    if not all(path.exists() for _, path in presets):
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=False)
    for ax, (name, path) in zip(axes, presets):
        results = json.loads(path.read_text())
        rows = [r for r in results["table"] if r["device"] == "cuda" or r["level"] == compare.REFERENCE]
        steady = [r for r in rows if r["us_per_step"]]
        labels = [r["level"] for r in steady]
        palette = plots.colours(labels)
        ax.barh(range(len(steady)), [r["us_per_step"] for r in steady], color=[palette[label] for label in labels])
        for i, r in enumerate(steady):
            ax.text(r["us_per_step"] * 1.05, i, f"{r['us_per_step']:,.1f}", va="center", fontsize=7)
        ax.set_yticks(range(len(steady)), labels, fontsize=8)
        ax.invert_yaxis()
        s = results["settings"]
        left_out = [r["level"] for r in rows if not r["us_per_step"]]
        ax.set(xscale="log", xlabel="microseconds per training step (log scale)",
               title=f"batch {s['batch']}, hidden {s['hidden']}" + (f"\n(unsteady, not shown: {', '.join(left_out)})"
                                                                    if left_out else ""))
    gpu = json.loads(presets[0][1].read_text())["machine"].get("gpu", "?")
    fig.suptitle(f"The MLP, one training step, measured on an {gpu} (make bench; level 1 on the CPU for reference)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(SPEED, dpi=100)
    plt.close(fig)
    return True


def time_two_gpus(tag: str, clock: Phases) -> int:
    """On a machine with level 9's WORLD GPUs: NCCL's all-reduce and the MLP's step on one GPU and on WORLD, into
    results/<tag>x2/; nothing elsewhere. Imported here, so that what imports bench does not import level 9."""
    from common.harness import scaling
    from level9_data_parallel import allreduce
    from level9_data_parallel.mlp import WORLD

    if not gpu_available():
        return 0
    import torch

    if torch.cuda.device_count() < WORLD:
        return 0
    print(f"\n=== {WORLD} GPUs: NCCL's all-reduce, and the step on one GPU and on {WORLD} ===", flush=True)
    folder = RESULTS / f"{tag}x{WORLD}"
    with clock(f"{WORLD} GPUs"):
        return allreduce.main(["--backend", "nccl", "--out", str(folder / "allreduce.json")]) | scaling.main(
            ["--out", str(folder / "scaling.json")])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tag", default=None, help="results/<tag>/ (default: the GPU's model, h100 or h200, or cpu)")
    p.add_argument("--presets", default=None, help=f"comma-separated, from {list(PRESETS)} (default: all this "
                   "machine can run)")
    p.add_argument("--levels", default=None, help="comma-separated level numbers (default: all this machine can run)")
    p.add_argument("--rounds", type=int, default=ROUNDS,
                   help="how many times each row is timed (common.harness.compare --rounds)")
    p.add_argument("--jobs", type=int, default=None, help="processes for the lockstep (default: one per core)")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                   help="on a GPU, also profile each GPU implementation's step (results/<tag>/profile.json)")
    p.add_argument("--two-gpus", action=argparse.BooleanOptionalAction, default=True,
                   help="on a machine with two GPUs, also time NCCL's all-reduce and the MLP's step on one GPU and in "
                   "DDP on two (results/<tag>x2/)")
    p.add_argument("--quick", action="store_true", help="every preset small and timed once, into results/<tag>-quick/ "
                   "(a developer's check of a change, not for publishing)")
    p.add_argument("--resume", action="store_true", help="keep the rounds a stopped run already timed "
                   "(common.harness.compare --resume), and time the rest")
    p.add_argument("--report", action="store_true", help="only rewrite results/README.md's tables and speed.png")
    args = p.parse_args(argv)
    args.tag = args.tag or machine_tag()  # the results folder of the GPU that measures
    if args.report:
        report()
        return 0
    presets = args.presets.split(",") if args.presets else [p for p in PRESETS if gpu_available() or p not in GPU_ONLY]
    presets = [p for p in presets if p != "none"]
    if unknown := [p for p in presets if p not in PRESETS]:
        p.error(f"no preset {unknown[0]!r}: choose from {list(PRESETS)} or 'none'")
    tag = args.tag + ("-quick" if args.quick else "")
    status, clock, started = 0, Phases(), time.perf_counter()
    for preset in presets:
        print(f"\n=== {preset} ===", flush=True)
        extra = ["--levels", args.levels] if args.levels else []
        extra += ["--jobs", str(args.jobs or os.cpu_count() or 1)] + (["--gpu-only"] if gpu_available() else [])
        extra += (QUICK[preset] + ["--rounds", "1"] if args.quick else ["--rounds", str(args.rounds)])
        extra += ["--resume"] if args.resume else []
        with clock(preset):
            status |= compare.main(PRESETS[preset] + extra + ["--out", str(RESULTS / tag / preset), "--quiet",
                                                   "--verbose"])
    if args.profile and gpu_available():
        print("\n=== where a GPU step's time goes ===", flush=True)
        profile = profile_gpu(QUICK_PROFILE_STEPS if args.quick else 400, clock)
        (RESULTS / tag / "profile.json").write_text(json.dumps(profile, indent=1))
    if args.two_gpus and not args.quick:
        status |= time_two_gpus(args.tag, clock)
    print("\n" + clock.table(time.perf_counter() - started, f"make bench: {time.perf_counter() - started:.0f} s",
                              rest="the rest"))
    return status


if __name__ == "__main__":
    sys.exit(main())
