"""Where a step of level 7's fused kernel spends its time, phase by phase, on a GPU machine.

    python3 -m common.harness.level7_phases [--tag h100]      # writes results/<tag>/level7_phases.txt

Builds a measuring variant of the level (make build/level7_phases.so, -DFUSED_PROFILE: block 0 reads clock64()
between the phases of each step, and __syncthreads() first, so each phase ends when the whole block is done with it),
trains one epoch at the chapter's setting and one at the large setting, and writes the cycles per step of each
phase, in microseconds at the GPU's clock. The extra synchronizations make the measuring build a little slower
than the real one; its total is printed beside the real level's for comparison.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from common.harness.data import load_mnist, normalize
from common.levels import ROOT, machine_tag
from common.native import NativeMLP, ffi
from common.nets.mlp import init_params
from common.harness import results

PHASES = ("start of the step", "forward", "share of the logits", "the exchange's wait", "softmax and loss",
          "dW2, db2, dh", "dW1 and the updates")
SETTINGS = {"chapter": (10_000, 8, 256), "large": (60_000, 256, 1024)}


def build() -> str:
    """The measuring variant of level 7 (make build/level7_phases.so: -DFUSED_PROFILE); its path."""
    subprocess.run(["make", "-s", "build/level7_phases.so", f"PYTHON={sys.executable}"], cwd=ROOT, check=True)
    return str(ROOT / "build" / "level7_phases.so")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tag", default=None, help="results/<tag>/ (default: the GPU's model)")
    args = p.parse_args()
    args.tag = args.tag or machine_tag()  # the results folder of the GPU that measures
    import torch

    import level7_fused

    ffi.cdef("int mlp_fused_cycles(unsigned long long *out);")
    lib = ffi.dlopen(build())
    measured = type("MLP", (NativeMLP,), {"lib": lib})
    clock_ghz = torch.cuda.get_device_properties(0).clock_rate / 1e6  # kHz -> GHz
    data = load_mnist(quiet=True)
    lines = [f"level 7, one epoch, cycles per step of each phase (block 0) at {clock_ghz:.2f} GHz, in microseconds"]
    for name, (n, batch, hidden) in SETTINGS.items():
        X, y = normalize(data.train_images[:n]), data.train_labels[:n]
        steps = -(-n // batch)
        cycles = ffi.new("unsigned long long[8]")
        seconds = {}
        for label, cls in (("measuring build", measured), ("level 7 as built", level7_fused.MLP)):
            model = cls(init_params(0, hidden))
            model.train_epoch(X, y, batch, 0.01)  # warm-up
            if cls is measured:
                lib.mlp_fused_cycles(cycles)  # reset
            start = time.perf_counter()
            model.train_epoch(X, y, batch, 0.01)
            seconds[label] = time.perf_counter() - start
            if cls is measured:
                lib.mlp_fused_cycles(cycles)
        lines.append(f"\n{name}: {n:,} images, batch {batch}, hidden {hidden} ({steps:,} steps); "
                     + ", ".join(f"{k} {s / steps * 1e6:.2f} us/step" for k, s in seconds.items()))
        for i, phase in enumerate(PHASES):
            lines.append(f"  {phase:<22}{cycles[i] / steps / (clock_ghz * 1e3):8.2f} us")
    print("\n".join(lines))
    print(f"wrote {results.write(args.tag, 'level7_phases.txt', lines)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
