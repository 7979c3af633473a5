"""make bench: every level's speed at the chapter's settings and at larger ones, each level verified before it is timed.

    python -m common.bench [--tag h100] [--presets chapter,large-b64,large-b256] [--levels 1,3,4,5,6]
    python -m common.bench --report          # only rewrite README.md's results block from results/*/

Each preset is one run of the compare harness (common.compare), so every level is checked against
level 1 step by step before its time counts; results go to results/<tag>/<preset>/. On a GPU it
also profiles one epoch of every GPU implementation to split a step into kernel time and the rest
(launch overhead and gaps between kernels), written to results/<tag>/profile.json.
The README's numbers are tables this script writes from those files, never typed by hand.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


from common import compare
from common.data import load_mnist, normalize
from common.levels import ROOT, gpu_available, level, missing
from common.model import init_params

PRESETS = {
    "chapter": [],
    "large-b64": ["--train-size", "60000", "--repeat", "--hidden", "1024", "--batch", "64", "--epochs", "2"],
    "large-b256": ["--train-size", "60000", "--repeat", "--hidden", "1024", "--batch", "256", "--epochs", "3"],
}
README = ROOT / "README.md"
BEGIN, END = "<!-- results:begin (written by python -m common.bench --report) -->", "<!-- results:end -->"


def profile_gpu(batches: tuple[int, ...] = (8, 256), steps: int = 500) -> list[dict]:
    """Per step of each GPU implementation: wall time, summed kernel time (CUPTI via torch.profiler), launches."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    data = load_mnist(quiet=True)
    rows = []
    for batch in batches:
        n = min(steps * batch, len(data.train_images))
        X, y = normalize(data.train_images[:n]), data.train_labels[:n]
        for lv, options in ((level(1), {"device": "cuda"}), (level(5), {}), (level(6), {})):
            if missing(lv):
                continue
            model = lv.load()(init_params(0), **options)
            model.train_epoch(X, y, batch, 0.01)  # warm-up and data upload
            start = time.perf_counter()
            n_steps = len(model.train_epoch(X, y, batch, 0.01))
            wall = (time.perf_counter() - start) / n_steps
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                model.train_epoch(X, y, batch, 0.01)
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            kernel_s = sum(e.device_time for e in kernels) * 1e-6 / n_steps  # device_time is in microseconds
            rows.append(
                {
                    "level": f"{lv.name}[cuda]",
                    "batch": batch,
                    "wall_us_per_step": wall * 1e6,
                    "kernel_us_per_step": kernel_s * 1e6,
                    "launches_per_step": len(kernels) / n_steps,
                    "other_us_per_step": (wall - kernel_s) * 1e6,
                }
            )
            print(
                f"{rows[-1]['level']:<16} batch {batch:>4}: {wall * 1e6:8.1f} us/step = {kernel_s * 1e6:8.1f} us in "
                f"{len(kernels) / n_steps:.0f} kernels + {(wall - kernel_s) * 1e6:8.1f} us launch overhead and gaps"
            )
    return rows


def markdown_table(results: dict) -> str:
    """One preset's table, as the README shows it."""
    s = results["settings"]
    m = results["machine"]
    where = m.get("gpu", m.get("cpu", "?")) + (f", driver {m['driver']}, CUDA {m['cuda_runtime']}" if "gpu" in m else "")
    lines = [
        f"**{s['train_size']:,} images x {s['epochs']} epochs, batch {s['batch']}, hidden {s['hidden']}** - {where}; "
        f"data: {results['data'].split(',')[0]}" + (", repeated to fill the epoch" if s.get("repeat") and "OFFLINE" in results["data"] else ""),
        "",
        "| level | train s | us/step | steps/s | vs level 1 CPU | vs level 1 CUDA | GFLOP/s | test acc | max abs dloss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["table"]:
        vs_cuda = f"{r['speedup_vs_level1_cuda']:.2f}x" if r.get("speedup_vs_level1_cuda") else "-"
        lines.append(
            f"| {r['level']} | {r['train_s']:.2f} | {r['us_per_step']:.1f} | {r['steps_per_s']:.0f} | "
            f"{r['speedup_vs_level1']:.2f}x | {vs_cuda} | {r['gflops']:.2f} | {r['test_accuracy']:.4f} | "
            f"{r['max_abs_dloss']:.1e} |"
        )
    return "\n".join(lines)


def report() -> None:
    """Rewrite README.md's results block from every results/<tag>/<preset>/results.json."""
    blocks = []
    for tag_dir in sorted(p for p in (ROOT / "results").iterdir() if p.is_dir() and p.name != "local"):
        for preset in PRESETS:
            path = tag_dir / preset / "results.json"
            if path.exists():
                blocks.append(f"`results/{tag_dir.name}/{preset}/`\n\n" + markdown_table(json.loads(path.read_text())))
        profile_path = tag_dir / "profile.json"
        if profile_path.exists():
            lines = [
                f"`results/{tag_dir.name}/profile.json` - where a GPU step's time goes (one epoch under torch.profiler)",
                "",
                "| implementation | batch | us/step | in kernels | kernels/step | launch overhead and gaps |",
                "|---|---:|---:|---:|---:|---:|",
            ]
            for r in json.loads(profile_path.read_text()):
                lines.append(
                    f"| {r['level']} | {r['batch']} | {r['wall_us_per_step']:.1f} | {r['kernel_us_per_step']:.1f} | "
                    f"{r['launches_per_step']:.0f} | {r['other_us_per_step']:.1f} |"
                )
            blocks.append("\n".join(lines))
    text = README.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"README.md has no results block ({BEGIN} ... {END})")
    head, rest = text.split(BEGIN, 1)
    README.write_text(head + BEGIN + "\n\n" + "\n\n".join(blocks) + "\n\n" + END + rest.split(END, 1)[1])
    print(f"README.md: results block rewritten from {len(blocks)} tables")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tag", default="h100" if gpu_available() else "cpu", help="results/<tag>/ (default: h100 or cpu)")
    p.add_argument("--presets", default=",".join(PRESETS), help=f"comma-separated, from {list(PRESETS)}")
    p.add_argument("--levels", default=None, help="comma-separated level numbers (default: all this machine can run)")
    p.add_argument("--report", action="store_true", help="only rewrite README.md's results block")
    args = p.parse_args(argv)
    if args.report:
        report()
        return 0
    status = 0
    for preset in args.presets.split(","):
        print(f"\n=== {preset} ===")
        extra = ["--levels", args.levels] if args.levels else []
        out = ROOT / "results" / args.tag / preset
        status |= compare.main(PRESETS[preset] + extra + ["--out", str(out), "--quiet"])
    if gpu_available():
        print("\n=== where a GPU step's time goes ===")
        (ROOT / "results" / args.tag / "profile.json").write_text(json.dumps(profile_gpu(), indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
