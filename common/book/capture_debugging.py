"""The GPU chapter's debugging and profiling section, captured for real on a GPU machine.

    python3 -m common.book.capture_debugging [--tag h100]      # writes results/<tag>/debugging/
    python3 -m common.book.capture_debugging --only framework_timeline   # one capture (or several, comma-separated)

What it records, each into a text file the level 5 chapter shows (the last one, level 8's):
  memcheck.txt     compute-sanitizer memcheck on a planted out-of-bounds kernel (a bounds check dropped): the
                   losses do not change, the tool names the kernel, the thread and the address;
  racecheck.txt    compute-sanitizer racecheck on a planted race (a __syncthreads removed from a reduction);
  async_error.txt  an illegal address planted in a kernel: where the error surfaces without and with
                   CUDA_LAUNCH_BLOCKING=1;
  timeline.txt     one training step of levels 5, 6 and 7 as a timeline of GPU work (torch.profiler):
                   each kernel's start, length and the gap before it;
  ncu.txt          Nsight Compute on level 5's naive forward kernel and on cuBLAS's, side by side: sectors per
                   request (coalescing), memory and compute throughput;
  ceilings.json    this GPU's measured FP32 matrix-product rate and device-memory bandwidth, the ceilings beside
                   every GFLOP/s figure of the chapters;
  framework_timeline.txt   one training step of level 8 on the GPU (op by op, and replayed as a CUDA graph), of level
                   6 (the same kernels called by hand) and of PyTorch eager, as timelines of GPU work (level 8's
                   chapter).
  conv1_wgrad.json LeNet-5's conv1 weight gradient at batches 16 to 256: its distance from float64 on the CPU and on
                   the GPU (level 1's deterministic mode, the peers' benchmark mode) and cuDNN's kernels (chapter 7b).
The bugs are planted in scratch copies of the repository (tests/plant_bugs.py's scratch_copy); nothing here changes
the working tree. sources.json records the sources each capture quotes (common.book.make.write_capture), so the chapter that
shows them is stale once one of those changes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common.book.make import write_capture
from common.levels import ROOT, machine_tag

spec = importlib.util.spec_from_file_location("plant_bugs", ROOT / "tests" / "plant_bugs.py")
plant_bugs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plant_bugs)

# A small run through every kernel, with partial batches: what the sanitizers watch.
SCRIPT = """
import numpy as np, level5_cuda_naive
from common.nets.mlp import init_params
rng = np.random.default_rng(0)
X = rng.standard_normal((200, 784)).astype(np.float32)
y = rng.integers(0, 10, 200)
model = level5_cuda_naive.MLP(init_params(0, 37))
print("losses of the first steps:", model.train_epoch(X, y, 13, 0.1)[:4])
"""
LEVEL5 = ["level5_cuda_naive/mlp.cu", "common/native/cuda_mlp.cuh"]  # the sources of what SCRIPT runs
RACE = ("        if (t < half) partial[t] += partial[t + half];\n        __syncthreads();\n",
        "        if (t < half) partial[t] += partial[t + half];\n")
FAR_WRITE = ("    out[(size_t)r * n_out + o] = sum;\n", "    out[(size_t)r * n_out + o + ((size_t)1 << 34)] = sum;\n")


def planted(file: str, good: str, bad: str) -> Path:
    """A scratch copy of the repository with one edit, level 5 built; its path."""
    repo = plant_bugs.scratch_copy()
    path = repo / file
    text = path.read_text()
    assert text.count(good) == 1, f"{file}: the code to plant into changed"
    path.write_text(text.replace(good, bad))
    subprocess.run(["make", "-s", "level5", f"PYTHON={sys.executable}"], cwd=repo, check=True, capture_output=True)
    return repo


def run(command: list[str], cwd: Path, env: dict | None = None) -> str:
    """stdout and stderr of a command, as it printed them."""
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=600)
    return result.stdout + result.stderr


def sanitizer_report(tool: str, repo: Path) -> str:
    """compute-sanitizer's own lines (the first reports and the summary) for SCRIPT in repo."""
    out = run(["compute-sanitizer", "--tool", tool, "--print-limit", "3", sys.executable, "-c", SCRIPT], repo)
    keep = [line for line in out.splitlines() if line.startswith("=========") and "Host Frame" not in line
            and not re.match(r"=+\s+#\d", line)]
    losses = [line for line in out.splitlines() if line.startswith("losses")]
    return "\n".join(keep[:40] + losses) + "\n"


def capture_sanitizers(folder: Path) -> None:
    bug = next(b for b in plant_bugs.BUGS if b[0] == 5 and "bounds check" in b[4])
    repo = planted(bug[1], bug[2], bug[3])
    write_capture(folder / "memcheck.txt",
                  f"planted in {bug[1]}: {bug[2]!r} -> {bug[3]!r} ({bug[4]})\n\n"
                  f"without the tool:\n{run([sys.executable, '-c', SCRIPT], repo)}\n"
                  f"compute-sanitizer --tool memcheck:\n{sanitizer_report('memcheck', repo)}", [bug[1], *LEVEL5])
    shutil.rmtree(repo.parent)
    repo = planted("common/native/cuda_mlp.cuh", *RACE)
    write_capture(folder / "racecheck.txt",
                  "planted in common/native/cuda_mlp.cuh, mean_loss_kernel: the __syncthreads() after each halving removed\n\n"
                  f"compute-sanitizer --tool racecheck:\n{sanitizer_report('racecheck', repo)}", LEVEL5)
    shutil.rmtree(repo.parent)


def capture_async_error(folder: Path) -> None:
    repo = planted("level5_cuda_naive/mlp.cu", *FAR_WRITE)
    lines = ["planted in level5_cuda_naive/mlp.cu, linear_forward_kernel: out[... + 2^34] = sum (16 GiB past the end)"]
    for env in ({}, {"CUDA_LAUNCH_BLOCKING": "1"}):
        error = [line for line in run([sys.executable, "-c", SCRIPT], repo, env).splitlines() if "NativeError" in line]
        lines.append(f"\n{' '.join(f'{k}={v}' for k, v in env.items()) or 'by default'}:\n" + "\n".join(error[-1:]))
    write_capture(folder / "async_error.txt", "\n".join(lines) + "\n", LEVEL5)
    shutil.rmtree(repo.parent)


def step_timeline(name: str, model, X, y) -> list[str]:
    """One training step of a model (batch 8) as GPU work on a time line, from torch.profiler: each kernel's start,
    length and the gap before it, after one untimed epoch."""
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    model.train_epoch(X, y, 8, 0.01)  # warm-up
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.train_epoch(X, y, 8, 0.01, np.arange(8, dtype=np.int32))  # one step
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    t0, end = events[0].time_range.start, events[0].time_range.start
    lines = [f"{name}: one step, batch 8, hidden 256 ({len(events)} pieces of GPU work)",
             f"{'start us':>9} {'length us':>10} {'gap before us':>14}  kernel"]
    for e in events:
        lines.append(f"{e.time_range.start - t0:9.1f} {e.time_range.end - e.time_range.start:10.1f} "
                     f"{max(0.0, e.time_range.start - end):14.1f}  {e.name[:70]}")
        end = max(end, e.time_range.end)
    busy = sum(e.time_range.end - e.time_range.start for e in events)
    return lines + [f"first start to last end {end - t0:.1f} us, of which the GPU computed {busy:.1f} us\n"]


def timeline_data():
    """The batches the timelines train on: 64 seeded images and labels, immutable (uploaded once)."""
    import numpy as np

    from common.contract import immutable

    rng = np.random.default_rng(0)
    return immutable(rng.standard_normal((64, 784)).astype(np.float32)), immutable(rng.integers(0, 10, 64))


def capture_timeline(folder: Path) -> None:
    """One step of levels 5, 6 and 7 (batch 8, hidden 256) as a timeline of GPU work: each level's chapter shows its
    own."""
    import level5_cuda_naive
    import level6_cublas
    import level7_fused
    from common.nets.mlp import init_params

    X, y = timeline_data()
    lines = []
    for name, cls in (("level5", level5_cuda_naive.MLP), ("level6", level6_cublas.MLP), ("level7", level7_fused.MLP)):
        lines += step_timeline(name, cls(init_params(0)), X, y)
    nsys = shutil.which("nsys")
    where = f"found at {nsys}" if nsys else "not on this machine (torch.profiler reads the same CUPTI timestamps)"
    lines.append(f"Nsight Systems: {where}")
    write_capture(folder / "timeline.txt", "\n".join(lines) + "\n",
                  [*LEVEL5, "level6_cublas/mlp.cu", "level7_fused/mlp.cu"])


def capture_framework_timeline(folder: Path) -> None:
    """One step of level 8 on the GPU beside level 6's (the same kernels, called by hand) and PyTorch eager's, as
    timelines of GPU work: the framework's own chapter shows them."""
    import level6_cublas
    import level8_framework
    from common.nets.mlp import init_params
    from level1_pytorch.peers import Eager

    X, y = timeline_data()
    lines = []
    for name, model in (("level6", level6_cublas.MLP(init_params(0))), ("torch-eager", Eager(init_params(0))),
                        ("level8", level8_framework.MLP(init_params(0), device="cuda")),
                        ("level8-graph", level8_framework.MLP(init_params(0), device="cuda", step="graph"))):
        lines += step_timeline(name, model, X, y)
    write_capture(folder / "framework_timeline.txt", "\n".join(lines) + "\n",
                  [*LEVEL5, "level6_cublas/mlp.cu", "level8_framework/ops.cu", "level8_framework/cuda.py",
                   "level8_framework/tensor.py", "level8_framework/nn.py", "level8_framework/optim.py",
                   "level8_framework/mlp.py", "level8_framework/graphs.py"])


def capture_ncu(folder: Path) -> None:
    """Nsight Compute's memory and compute figures for the naive forward kernel and for cuBLAS's, on the same product."""
    metrics = ",".join([
        "gpu__time_duration.sum",
        "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum",
        "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
        "sm__throughput.avg.pct_of_peak_sustained_elapsed",
        "dram__throughput.avg.pct_of_peak_sustained_elapsed",
        "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    ])
    script = ("import numpy as np, level{n}_{pkg}\nfrom common.nets.mlp import init_params\n"
              "X = np.random.default_rng(0).standard_normal((256, 784)).astype(np.float32)\n"
              "level{n}_{pkg}.MLP(init_params(0, 1024)).forward(X)\n")
    out = ["Nsight Compute, the first product of forward() (x (256, 784) @ fc1.weight^T, hidden 1024):"]
    for n, pkg, kernel in ((5, "cuda_naive", "linear_forward_kernel"), (6, "cublas", "regex:gemm")):
        report = run(["ncu", "--kernel-name", kernel, "--launch-count", "1", "--metrics", metrics, sys.executable,
                      "-c", script.format(n=n, pkg=pkg)], ROOT)
        out.append(f"\n--- level {n}: {kernel} ---")
        out += [line for line in report.splitlines() if "==PROF==" not in line and line.strip()][-12:]
    write_capture(folder / "ncu.txt", "\n".join(out) + "\n", [*LEVEL5, "level6_cublas/mlp.cu"])


def capture_ceilings(folder: Path) -> None:
    """The measured ceilings: an 8192^3 FP32 matrix product (TF32 off) and an 8 GiB device-to-device copy."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    a, b = (torch.randn(8192, 8192, device="cuda") for _ in range(2))
    src = torch.empty(2 * 1024**3, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)

    def best(fn, repeats: int = 10) -> float:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    matmul_s = best(lambda: a @ b)
    copy_s = best(lambda: dst.copy_(src))
    props = torch.cuda.get_device_properties(0)
    ceilings = {
        "gpu": props.name,
        "fp32_matmul_tflops_measured": 2 * 8192**3 / matmul_s / 1e12,
        "copy_tb_per_s_measured": 2 * src.numel() * 4 / copy_s / 1e12,  # bytes read + bytes written
        "multiprocessors": props.multi_processor_count,
        "how": "median of 10: an 8192^3 float32 torch.matmul with TF32 off; an 8 GiB device-to-device copy",
    }
    (folder / "ceilings.json").write_text(json.dumps(ceilings, indent=1) + "\n")


WGRAD_BATCHES = (16, 32, 64, 128, 256)


def capture_conv1_wgrad(folder: Path) -> None:
    """LeNet-5's conv1 weight gradient on the first images of MNIST at each of WGRAD_BATCHES: how far from float64 it
    lands on the CPU in float32 and on the GPU, in level 1's deterministic mode and in the peers' (cuDNN's benchmark
    mode), and which kernels computed it there (torch.profiler). Chapter 7b reads conv1_wgrad.json."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from common.harness.data import load_mnist, normalize
    from common.nets import lenet
    from level1_pytorch.lenet import Net
    from level1_pytorch.peers import plain_pytorch

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    mnist = load_mnist(quiet=True)
    net = Net().double()
    net.load_state_dict({name: torch.from_numpy(p) for name, p in lenet.init_params(0).items()})
    shape = net.conv1.weight.shape

    def wgrad(x, g):
        return torch.nn.grad.conv2d_weight(x, shape, g)  # cuDNN's backward-filter on the GPU

    def on_gpu(x, g) -> tuple[float, list[str]]:
        x, g = x.float().cuda(), g.float().cuda()
        wgrad(x, g)  # the first call picks the algorithm (benchmark mode times several)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            w = wgrad(x, g)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type.name == "CUDA" and "memset" not in e.name.lower()]
        # a kernel's name without its return type ("void ", "std::enable_if<...>::type "), template and arguments
        kernels = sorted({re.split(r"[(<]", name.removeprefix("void ").split("::type ")[-1])[0] for name in names})
        return w.double().cpu(), kernels

    rows = []
    for batch in WGRAD_BATCHES:
        x = torch.from_numpy(normalize(mnist.train_images[:batch]).copy()).double()
        y = torch.from_numpy(mnist.train_labels[:batch].astype(np.int64))
        keep = {}
        loss = F.cross_entropy(net(x, keep), y)
        g = torch.autograd.grad(loss, keep["conv1"])[0]  # the gradient reaching conv1's output, in float64
        x = x.reshape(-1, 1, lenet.IMAGE, lenet.IMAGE)
        exact = wgrad(x, g)
        row = {"batch": batch, "largest": float(exact.abs().max()),
               "cpu_float32": float((wgrad(x.float(), g.float()).double() - exact).abs().max())}
        torch.use_deterministic_algorithms(True)  # level 1's mode on the GPU
        w, row["deterministic_kernels"] = on_gpu(x, g)
        row["deterministic"] = float((w - exact).abs().max())
        torch.use_deterministic_algorithms(False)
        with plain_pytorch():
            w, row["benchmark_kernels"] = on_gpu(x, g)
        row["benchmark"] = float((w - exact).abs().max())
        rows.append(row)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
              "how": "conv1's weight gradient of LeNet-5 (common/nets/lenet.py's initial weights, seed 0) on the "
                     "first `batch` training images, the gradient at conv1's output from float64; errors: the largest "
                     "absolute difference from the float64 result", "rows": rows}
    (folder / "conv1_wgrad.json").write_text(json.dumps(result, indent=1) + "\n")


CAPTURES = {"ceilings": capture_ceilings, "conv1_wgrad": capture_conv1_wgrad, "timeline": capture_timeline,
            "framework_timeline": capture_framework_timeline, "ncu": capture_ncu, "sanitizers": capture_sanitizers,
            "async_error": capture_async_error}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tag", default=None, help="results/<tag>/ (default: the GPU's model)")
    p.add_argument("--only", default=None, help=f"comma-separated captures, of {', '.join(CAPTURES)} (default: all)")
    args = p.parse_args()
    args.tag = args.tag or machine_tag()  # the results folder of the GPU that measures
    folder = ROOT / "results" / args.tag / "debugging"
    folder.mkdir(parents=True, exist_ok=True)
    chosen = args.only.split(",") if args.only else list(CAPTURES)
    if unknown := [name for name in chosen if name not in CAPTURES]:
        p.error(f"no capture {unknown[0]!r}: the captures are {', '.join(CAPTURES)}")
    for capture in (CAPTURES[name] for name in chosen):
        start = time.perf_counter()
        capture(folder)
        print(f"{capture.__name__}: {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
