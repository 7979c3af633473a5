"""LeNet-5 served without PyTorch: a PyTorch state_dict in, the GPU levels' forward out, checked and timed.

    python -m common.harness.serving                          # trains level 1 (LeNet's chapter run), saves, serves that file
    python -m common.harness.serving --weights my_lenet.pt [--batches 1,1024] [--calls 1000] [--out results/h100/lenet-inference]
    make infer

The weights are a PyTorch state_dict of LeNet-5 (common/nets/lenet.py's ten names and PyTorch's shapes, float32), saved
with torch.save by level 1 or by your own PyTorch code; a file that is not one is refused with the reason. Each of
levels 5 (direct and tiled convolutions), 6 (cuDNN + cuBLAS) and 7 (one fused kernel) then serves it, as lenet.h's
inference calls run it: the batch loaded on the GPU once, its forward replayed as one CUDA graph. Before a level is
timed, it is checked:
  - every layer's output, on real test digits, against PyTorch's, caught by forward hooks: each layer from the level's
    own inputs to it, at most common/harness/verify_lenet.py's allowance from float64 (PyTorch's own distance, doubled, plus
    rounding; a ReLU and a max-pool exactly);
  - its predictions on the whole test set against PyTorch's: a digit may be classified differently only where
    PyTorch's two largest logits are within TIE of each other (a float32 tie, reported).
Then every row, ours and PyTorch's (eager, the forward captured as a CUDA graph, torch.compile: the fastest forms a
PyTorch user writes, checked against plain twins by `python -m common.harness.peers --check`), is timed the same way
from Python: `calls` calls on the loaded batch, each one forward and a wait for the GPU, by perf_counter; p50 and p99;
in ROUNDS rounds over the rows. After all the timing, PyTorch's profiler sums the GPU's own time per call. Writes
results.json and table.md to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from common.harness import verify_lenet
from common.harness.compare import STEADY_RATIO
from common.harness.data import load_mnist, normalize
from common.levels import ROOT, gpu_available, level, missing
from common.nets import get, lenet
from level1_pytorch.peers import plain_pytorch

LENET = get("lenet")  # the network served
CHECK_DIGITS = 512  # test digits of the per-layer check
TIE = 1e-4  # a differing prediction is a float32 tie when PyTorch's top two logits are this close (times its largest)
WARMUP = 50  # calls before the timed ones (first-call setup, caches, clocks)
PROFILED = 200  # calls whose GPU time the profiler sums
ROUNDS = 3  # every row timed in three rounds over the rows
ROWS = (("level5[direct]", 5, "direct"), ("level5[tiled]", 5, "tiled"), ("level6[cudnn]", 6, "direct"),
        ("level7[fused]", 7, "direct"))


# ---- the weights ----


def load_weights(path: str | Path) -> dict[str, np.ndarray]:
    """A PyTorch state_dict file of LeNet-5 as float32 arrays; a clear error for anything else."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such weights file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # tensors and containers only: no code runs
    except Exception as e:
        raise ValueError(f"{path}: not a PyTorch file of tensors (torch.load: {e})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path}: holds a {type(state).__name__}, not a state_dict: save model.state_dict()")
    names = set(map(str, state))
    if names != set(lenet.PARAM_NAMES):
        missing_names = [n for n in lenet.PARAM_NAMES if n not in names]
        extra = sorted(names - set(lenet.PARAM_NAMES))
        raise ValueError(f"{path}: not LeNet-5's parameters: missing {missing_names or 'none'}, unexpected "
                         f"{extra or 'none'} (expected {list(lenet.PARAM_NAMES)})")
    params = {}
    for name in lenet.PARAM_NAMES:
        value = state[name]
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{path}: {name} is a {type(value).__name__}, not a tensor")
        if value.dtype != torch.float32:
            raise TypeError(f"{path}: {name} is {value.dtype}; the levels compute in float32: save "
                            "model.float().state_dict()")
        if tuple(value.shape) != lenet.SHAPES[name]:
            raise ValueError(f"{path}: {name} has shape {tuple(value.shape)}, LeNet-5's is {lenet.SHAPES[name]}")
        params[name] = value.detach().contiguous().numpy().copy()
        if not np.isfinite(params[name]).all():
            raise ValueError(f"{path}: {name} contains NaN or infinity")
    return params


def train_weights(path: Path) -> None:
    """Level 1 trained on LeNet's chapter run (common/nets), its state_dict saved to `path` with torch.save."""
    import torch

    run = LENET.run
    data = load_mnist(quiet=True)
    X, y = normalize(data.train_images[: run["train_size"]]), data.train_labels[: run["train_size"]]
    model = level(1).load(LENET)(lenet.init_params(0))
    for _ in range(run["epochs"]):
        model.train_epoch(X, y, run["batch"], run["lr"])
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.net.state_dict(), path)


# ---- PyTorch: the reference, and the peers ----


def pytorch_net(params: dict[str, np.ndarray], device: str):
    """Level 1's nn.Module with these weights, for inference."""
    return level(1).load(LENET)(params, device=device).net.eval()


def hooked_layers(net, X: np.ndarray) -> dict[str, np.ndarray]:
    """Every layer's output of PyTorch's forward of X, as its forward hooks see them."""
    import torch

    seen, hooks = {}, []
    for name in lenet.ACTIVATIONS:
        hook = lambda module, inputs, output, name=name: seen.__setitem__(name, output.detach().cpu().numpy())
        hooks.append(getattr(net, name).register_forward_hook(hook))
    try:
        with torch.inference_mode():
            net(torch.from_numpy(X).to(next(net.parameters()).device))
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def pytorch_logits(net, X: np.ndarray) -> np.ndarray:
    """PyTorch's logits of X."""
    import torch

    with torch.inference_mode():
        return net(torch.from_numpy(X).to(next(net.parameters()).device)).cpu().numpy()


class TorchForward:
    """PyTorch's forward as a user serving it would write it: the batch on the GPU, inference mode, each call waited
    for. mode "eager", "graph" (the forward captured once as a CUDA graph, replayed) or "compile" (torch.compile with
    mode="reduce-overhead", which also replays CUDA graphs)."""

    def __init__(self, params: dict[str, np.ndarray], mode: str):
        import torch

        self.torch, self.mode = torch, mode
        self.net = pytorch_net(params, "cuda")
        self.forward = torch.compile(self.net, mode="reduce-overhead") if mode == "compile" else self.net

    def load(self, X: np.ndarray) -> None:
        torch = self.torch
        self.x = torch.from_numpy(X).cuda()
        if self.mode == "graph":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.inference_mode():  # PyTorch's recipe: warm up on a side stream
                for _ in range(3):
                    self.net(self.x)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph), torch.inference_mode():
                self.out = self.net(self.x)

    def run(self) -> None:
        if self.mode == "graph":
            self.graph.replay()
        else:
            with self.torch.inference_mode():
                self.out = self.forward(self.x)
        self.torch.cuda.synchronize()


class LevelForward:
    """One of our levels as lenet.h's inference calls serve it (common/native: infer_load, infer_run)."""

    def __init__(self, params: dict[str, np.ndarray], number: int, convolution: str):
        self.model = level(number).load(LENET)(params, convolution=convolution)
        if (ran := self.model.variant()["convolution"]) != convolution:  # a row times what it is named for
            raise RuntimeError(f"level {number} was asked for the {convolution} convolution and reports {ran}")

    def load(self, X: np.ndarray) -> None:
        self.model.infer_load(X)

    def run(self) -> None:
        self.model.infer_run(logits=False)


# ---- the checks and the clock ----


def check_level(model, params: dict[str, np.ndarray], X: np.ndarray, labels: np.ndarray, reference: dict,
                reference_logits: np.ndarray) -> dict:
    """Per layer on the first CHECK_DIGITS of X against PyTorch's hooks (reference: hooked_layers of those digits),
    and predictions on all of X against PyTorch's (reference_logits)."""
    digits = X[:CHECK_DIGITS]
    model.infer_load(digits)
    shares, failure = verify_lenet.per_layer_forward(model.infer_layers(), reference, params, digits)
    model.infer_load(X)
    logits, theirs = model.infer_run(), reference_logits
    differ = np.flatnonzero(logits.argmax(1) != theirs.argmax(1))
    top2 = np.sort(theirs, axis=1)[:, -2:]
    ties = [int(i) for i in differ if top2[i, 1] - top2[i, 0] <= TIE * np.abs(theirs[i]).max()]
    if failure is None and len(ties) < len(differ):
        i = next(int(i) for i in differ if int(i) not in ties)
        failure = (f"test digit {i} is classified {int(logits[i].argmax())}, PyTorch says {int(theirs[i].argmax())}, "
                   f"and PyTorch's top two logits are {top2[i, 1] - top2[i, 0]:.3g} apart: not a float32 tie")
    accuracy = float((logits.argmax(1) == labels).mean())
    return {"per_layer": max(shares.values()), "failure": failure, "accuracy": accuracy, "ties": ties}


def p50_p99(row, X: np.ndarray, calls: int) -> tuple[float, float]:
    """p50 and p99 microseconds of `calls` calls of row.run() on the loaded batch X, after WARMUP calls."""
    row.load(X)
    for _ in range(WARMUP):
        row.run()
    times = np.empty(calls)
    for i in range(calls):
        start = time.perf_counter()
        row.run()
        times[i] = time.perf_counter() - start
    p50, p99 = np.percentile(times, [50, 99]) * 1e6
    return float(p50), float(p99)


def time_rows(rows: dict, X: np.ndarray, batches: list[int], calls: int) -> dict[str, dict[str, dict]]:
    """Each row's latency per batch size, in ROUNDS rounds over the rows (p50: the median of the rounds' p50s, with
    their range; a row whose rounds are more than STEADY_RATIO apart is flagged unsteady), then the GPU's own time
    per call. The profiler comes last: once it has run, PyTorch leaves NVIDIA's profiling library (CUPTI) attached,
    and every later launch of the process is slower."""
    rounds = {name: {b: [] for b in batches} for name in rows}
    for _ in range(ROUNDS):
        for name, row in rows.items():
            for b in batches:
                rounds[name][b].append(p50_p99(row, X[:b], calls))
    times = {}
    for name, row in rows.items():
        times[name] = {}
        for b in batches:
            p50s, p99s = (np.array(t) for t in zip(*rounds[name][b]))
            times[name][str(b)] = {"p50_us": float(np.median(p50s)), "p50_range": [float(p50s.min()),
                                   float(p50s.max())], "p99_us": float(np.median(p99s)),
                                   "steady": bool(p50s.max() <= STEADY_RATIO * p50s.min()),
                                   "images_per_s": float(b / np.median(p50s) * 1e6)}
    for name, row in rows.items():
        for b in batches:
            row.load(X[:b])
            times[name][str(b)]["gpu_us"] = gpu_time(row)
    return times


def gpu_time(row, calls: int = PROFILED) -> float:
    """Microseconds per call that the GPU spends in kernels and copies (CUPTI, through PyTorch's profiler): what is
    left of a call's time is launching, waiting, and the gaps between its kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            row.run()
    return sum(e.device_time for e in prof.events() if e.device_type.name == "CUDA") / calls


# ---- the table ----


def markdown(results: dict) -> str:
    """The table: each row's checks and, per batch size, its latency and its speed against PyTorch's CUDA graph."""
    batches = results["batches"]
    head = "| implementation | per layer | test accuracy |"
    rule = "|---|---:|---:|"
    for b in batches:
        head += f" batch {b}: p50 µs (range) | p99 µs | GPU µs | images/s | vs graph |"
        rule += "---:|---:|---:|---:|---:|"
    lines = [head, rule]
    for name, row in results["rows"].items():
        check = row.get("check")
        line = (f"| {name} | {check['per_layer']:.2f} | {check['accuracy']:.4f} |" if check
                else f"| {name} | (reference) | {results['pytorch_accuracy']:.4f} |")
        for b in batches:
            t, graph = row["times"][str(b)], results["rows"]["torch-graph"]["times"][str(b)]
            low, high = t["p50_range"]
            if not t["steady"]:
                line += f" unsteady {low:.1f}-{high:.1f} | - | {t['gpu_us']:.1f} | - | - |"
                continue
            vs = f"{graph['p50_us'] / t['p50_us']:.2f}x" if graph["steady"] else "-"
            line += (f" {t['p50_us']:.1f} ({low:.1f}-{high:.1f}) | {t['p99_us']:.1f} | {t['gpu_us']:.1f} | "
                     f"{t['images_per_s']:,.0f} | {vs} |")
        lines.append(line)
    flops, weights = lenet.forward_flops(1), 4 * sum(int(np.prod(s)) for s in lenet.SHAPES.values())
    per_batch = "; ".join(f"batch {b}: {flops * b / 1e6:,.1f} MFLOP" for b in batches)
    lines += ["", f"p50: the median of {ROUNDS} rounds over the rows, each the median of {results['calls']:,} calls, "
              f"with the rounds' range; a row whose rounds are more than {STEADY_RATIO}x apart is shown unsteady and "
              "not compared. Per layer: the worst layer's share of its allowance (at most 1). GPU µs: the GPU's own "
              "work per call "
              "(kernels and copies, by the profiler); the rest of p50 is launching, waiting and the gaps between "
              f"kernels. The floor of a call: {flops / 1e6:.2f} MFLOP per image, and reading the {weights / 1e3:.0f} KB "
              f"of weights and {4 * 784 / 1e3:.1f} KB per image ({per_batch})."]
    return "\n".join(lines) + "\n"


# ---- main ----


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", type=Path, help="a PyTorch state_dict file of LeNet-5 (default: train level 1)")
    p.add_argument("--batches", default="1,1024", help="comma-separated batch sizes to time")
    p.add_argument("--calls", type=int, default=1000, help="timed calls per row and batch size (at least 100)")
    p.add_argument("--out", type=Path, help="folder for results.json and table.md")
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches takes comma-separated batch sizes, e.g. 1,1024; got {args.batches!r}")
    if args.calls < 100 or min(batches) < 1:
        p.error("--calls must be >= 100 and every batch size >= 1")
    if not gpu_available():
        print("python -m common.harness.serving serves LeNet-5 on the GPU levels: no NVIDIA GPU is visible on this machine")
        return 1
    weights = args.weights
    if weights is None:
        weights = ROOT / "build" / "lenet.pt"
        print(f"no --weights: training level 1 on LeNet's chapter run, saved to {weights.relative_to(ROOT)}")
        train_weights(weights)
    params = load_weights(weights)
    data = load_mnist(quiet=True)
    X, labels = normalize(data.test_images), data.test_labels
    net = pytorch_net(params, "cpu")  # PyTorch on the CPU, the gold standard
    reference = hooked_layers(net, X[:CHECK_DIGITS])  # every layer of the checked digits: 42 KB per digit
    reference_logits = pytorch_logits(net, X)
    results = {"weights": str(weights), "batches": batches, "calls": args.calls, "rows": {},
               "pytorch_accuracy": float((reference_logits.argmax(1) == labels).mean())}
    status, timed = 0, {}
    for name, number, convolution in ROWS:
        if why := missing(level(number), "cuda", LENET):
            print(f"{name}: skipped ({'; '.join(why)})")
            continue
        row = LevelForward(params, number, convolution)
        check = check_level(row.model, params, X, labels, reference, reference_logits)
        print(f"{name}: per layer {check['per_layer']:.2f} of the allowance, test accuracy {check['accuracy']:.4f} "
              f"(PyTorch {results['pytorch_accuracy']:.4f}), {len(check['ties'])} float32 ties"
              + (f"; FAILED: {check['failure']}" if check["failure"] else ""))
        if check["failure"]:
            status = 1
            continue
        results["rows"][name] = {"check": check}
        timed[name] = row
    timed |= {f"torch-{mode}": TorchForward(params, mode) for mode in ("eager", "graph", "compile")}
    with plain_pytorch():
        for name, times in time_rows(timed, X, batches, args.calls).items():
            results["rows"].setdefault(name, {})["times"] = times
    table = markdown(results)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        (args.out / "table.md").write_text(table)
    return status


if __name__ == "__main__":
    sys.exit(main())
