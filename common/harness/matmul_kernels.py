"""Level 5's matrix-product kernels against cuBLAS, product by product, on a GPU machine: GFLOP/s and % of cuBLAS.

    python -m common.harness.matmul_kernels [--tag h100]   # writes results/<tag>/matmul-kernels.json and .md

Kernel 0 is cuBLAS (level 6's sgemm, the reference), kernels 1 to 3 are level 5's naive, tiled and blocked products
(mlp.h's MLP_MATMUL_*), each run by the very function a step calls (common/harness/matmul_kernels.cu). For each of a
step's five products, at the chapter's size and the large one, every kernel's result is first checked against the
product computed in float64: each element within the bound that any float32 sum of its K terms meets, whatever its
order. Only then is it timed: LAUNCHES launches captured as one CUDA graph, one replay to warm up, then REPEATS replays,
each timed with CUDA events; a kernel's time is the median replay's, per launch.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
from cffi import FFI

from common.harness import results
from common.levels import ROOT, THE_MLP, machine_tag
from common.native import NativeMLP
from common.nets.mlp import N_IN, N_OUT

# The kernels in teaching order, numbered by mlp.h (kernel 0: cuBLAS), and the level whose library runs each.
LEVEL_OF = {"cublas": 6, **{name: 5 for name in dict(THE_MLP.matmuls)[5]}}
KERNELS = sorted(LEVEL_OF, key=NativeMLP.MATMULS.index)
SIZES = ((8, 256), (256, 1024))  # (batch, hidden): the chapter's, and the large setting's (make bench's large-b256)
LAUNCHES, REPEATS = 20, 25
SOURCE = ROOT / "common" / "harness" / "matmul_kernels.cu"


@dataclass(frozen=True)
class Product:
    """One of a step's matrix products: which of the three it is (matmul_kernels.cu's PRODUCT_*) and on which layer."""

    name: str
    kind: int  # PRODUCT_FORWARD, PRODUCT_DW or PRODUCT_DX
    n_in: int
    n_out: int  # the layer's: its weight is (n_out, n_in)

    def shape(self, batch: int) -> tuple[int, int, int]:
        """(M, N, K) of C (M, N) = A (M, K) @ B (K, N)."""
        return [(batch, self.n_out, self.n_in), (self.n_out, self.n_in, batch), (batch, self.n_in, self.n_out)][self.kind]

    def exact(self, x: np.ndarray, w: np.ndarray, dout: np.ndarray, absolute: bool = False) -> np.ndarray:
        """The product in float64 (of the operands' absolute values: what bounds its rounding)."""
        x, w, dout = (np.abs(a) if absolute else a for a in (x.astype(np.float64), w.astype(np.float64),
                                                               dout.astype(np.float64)))
        return [x @ w.T, dout.T @ x, dout @ w][self.kind]


def step_products(hidden: int) -> list[Product]:
    """The five matrix products of a step, in the order it runs them (common/native/cuda_mlp.cuh's forward_backward)."""
    return [Product("h = x W1^T", 0, N_IN, hidden), Product("logits = a W2^T", 0, hidden, N_OUT),
            Product("dW2 = dlogits^T a", 1, hidden, N_OUT), Product("da = dlogits W2", 2, hidden, N_OUT),
            Product("dW1 = dh^T x", 1, N_IN, hidden)]


def load() -> tuple[FFI, dict[int, object]]:
    """(ffi, each level's library), built by make and declared from the source's cdef markers."""
    targets = [f"build/matmul_level{number}.so" for number in sorted(set(LEVEL_OF.values()))]
    subprocess.run(["make", "-s", *targets, f"PYTHON={sys.executable}"], cwd=ROOT, check=True)
    ffi = FFI()
    ffi.cdef(re.search(r"/\* cdef-begin \*/(.*)/\* cdef-end \*/", SOURCE.read_text(), re.DOTALL).group(1)
             + "const char *mlp_last_error(void);")
    return ffi, {number: ffi.dlopen(str(ROOT / "build" / f"matmul_level{number}.so"))
                 for number in sorted(set(LEVEL_OF.values()))}


def error_share(result: np.ndarray, product: Product, operands, k: int) -> float:
    """The largest error of a float32 result against the float64 product, as a share of its bound: |c - exact| <=
    gamma(K) (|A| @ |B|), gamma(K) = K u / (1 - K u), u = 2^-24, which every order of a float32 sum of K terms meets
    (Higham, Accuracy and Stability of Numerical Algorithms, 3.1). Above 1: the kernel computed something else."""
    u = 2.0**-24
    bound = k * u / (1 - k * u) * product.exact(*operands, absolute=True)
    error = np.abs(result.astype(np.float64).reshape(bound.shape) - product.exact(*operands))
    return float(np.max(error / np.maximum(bound, np.finfo(np.float64).tiny)))


def measure(ffi, libraries, kernel: str, product: Product, batch: int, operands, launches: int = LAUNCHES,
            repeats: int = REPEATS) -> dict:
    """One kernel on one product: checked, then timed. Raises where the library fails or the result is wrong."""
    m, n, k = product.shape(batch)
    result = np.empty(m * n, dtype=np.float32)
    ms = np.empty(repeats, dtype=np.float32)
    lib = libraries[LEVEL_OF[kernel]]
    x, w, dout = (np.ascontiguousarray(a) for a in operands)
    status = lib.product_run(NativeMLP.MATMULS.index(kernel), product.kind, ffi.from_buffer("float[]", x),
                             ffi.from_buffer("float[]", w), ffi.from_buffer("float[]", dout), batch, product.n_in,
                             product.n_out, ffi.from_buffer("float[]", result), launches, repeats,
                             ffi.from_buffer("float[]", ms))
    if status:
        raise RuntimeError(f"{kernel}, {product.name}: {ffi.string(lib.mlp_last_error()).decode()}")
    share = error_share(result, product, operands, k)
    if share > 1:
        raise AssertionError(f"{kernel}, {product.name} at batch {batch}: an error of {share:.3g} times the bound of "
                             "any float32 sum: not timed")
    us = 1e3 * float(np.median(ms))
    return {"us": us, "us_range": [1e3 * float(ms.min()), 1e3 * float(ms.max())], "gflops": 2 * m * n * k / us / 1e3,
            "error_share": share}


def operands(batch: int, product: Product, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (batch, n_in), w (n_out, n_in), dout (batch, n_out): seeded normal floats."""
    rng = np.random.default_rng(seed)
    shapes = ((batch, product.n_in), (product.n_out, product.n_in), (batch, product.n_out))
    return tuple(rng.standard_normal(shape).astype(np.float32) for shape in shapes)


def run(sizes=SIZES, launches: int = LAUNCHES, repeats: int = REPEATS, quiet: bool = False) -> list[dict]:
    """Every kernel on every product of a step at each (batch, hidden): a record per size."""
    ffi, libraries = load()
    records = []
    for batch, hidden in sizes:
        products = []
        for product in step_products(hidden):
            data = operands(batch, product)
            kernels = {kernel: measure(ffi, libraries, kernel, product, batch, data, launches, repeats)
                       for kernel in KERNELS}
            m, n, k = product.shape(batch)
            products.append({"product": product.name, "m": m, "n": n, "k": k, "kernels": kernels})
            if not quiet:
                print(f"batch {batch}, hidden {hidden}, {product.name} ({m} x {n} x {k}): " + ", ".join(
                    f"{kernel} {r['us']:.2f} us" for kernel, r in kernels.items()), flush=True)
        records.append({"batch": batch, "hidden": hidden, "products": products, "step": step_total(products)})
    return records


def step_total(products: list[dict]) -> dict:
    """The five products together, each kernel's times added: its rate over the matrix products of a step."""
    flops = sum(2 * p["m"] * p["n"] * p["k"] for p in products)
    return {kernel: {"us": (us := sum(p["kernels"][kernel]["us"] for p in products)), "gflops": flops / us / 1e3}
            for kernel in KERNELS}


def share(record: dict, kernel: str) -> float:
    """A kernel's speed as a share of cuBLAS's on the same work."""
    return record[kernel]["gflops"] / record["cublas"]["gflops"]


def title(kernel: str) -> str:
    """A kernel as the tables name it: "kernel 2: tiled"."""
    return f"kernel {NativeMLP.MATMULS.index(kernel)}: {kernel}"


def markdown(records: list[dict], machine: dict) -> str:
    """The running table: each kernel's GFLOP/s and % of cuBLAS over a step's products, then product by product."""
    sizes = [f"batch {r['batch']}, hidden {r['hidden']}" for r in records]
    lines = [(f"Level 5's matrix-product kernels against cuBLAS on {machine.get('gpu', '?')}: GFLOP/s (% of cuBLAS). "
              f"Each result checked against float64 first; each time the median of {REPEATS} CUDA-graph replays of "
              f"{LAUNCHES} launches, per launch (`python -m common.harness.matmul_kernels`)."), "",
             "The five matrix products of a step together:", "",
             "| kernel | " + " | ".join(sizes) + " |", "|---|" + "---:|" * len(sizes)]
    lines += [f"| {title(kernel)} | " + " | ".join(f"{r['step'][kernel]['gflops']:,.0f} ({share(r['step'], kernel):.0%})"
                                                   for r in records) + " |" for kernel in KERNELS]
    for size, r in zip(sizes, records):
        lines += ["", f"{size}, product by product (M x N x K):", "",
                  "| product | " + " | ".join(title(kernel) for kernel in KERNELS) + " |",
                  "|---|" + "---:|" * len(KERNELS)]
        lines += [f"| {p['product']} ({p['m']} x {p['n']} x {p['k']}) | " + " | ".join(
            f"{p['kernels'][kernel]['gflops']:,.0f} ({share(p['kernels'], kernel):.0%})" for kernel in KERNELS) + " |"
            for p in r["products"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tag", default=None, help="results/<tag>/ (default: the GPU's model)")
    args = p.parse_args(argv)
    args.tag = args.tag or machine_tag()  # the results folder of the GPU that measures
    from common.harness.compare import machine

    about = machine()
    records = run()
    how = (f"each kernel checked against float64 (error within gamma(K) |A||B|), then timed: {LAUNCHES} launches as one "
           f"CUDA graph, one warm-up replay, the median of {REPEATS} replays timed with CUDA events, per launch")
    table = markdown(records, about)
    print("\n" + table)
    results.write(args.tag, "matmul-kernels.json", [json.dumps({"machine": about, "how": how, "kernels": KERNELS,
                                                                "sizes": records}, indent=1)])
    print(f"wrote {results.write(args.tag, 'matmul-kernels.md', [table])} and matmul-kernels.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
