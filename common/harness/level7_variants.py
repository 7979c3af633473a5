"""Level 7's variants timed side by side on a GPU machine: the same library under each of its knobs.

    python3 -m common.harness.level7_variants [--tag h100]      # writes results/<tag>/level7_variants.txt

For the chapter's setting and the large one (batch 64 and 256), each variant - how the shares travel (one cluster or
a grid), the hidden units per block, the blocks that share each tile of x - gets its plan, its median epoch's time
per step (three timed epochs after an untimed one), and how far its first steps' losses are from level 6's from the
same weights: a sign that it computes the step, beside the tests' lockstep, which is the check.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from common.harness.data import load_mnist, normalize
from common.nets.mlp import init_params
from common.harness import results
from common.levels import machine_tag

# setting: (images, batch, hidden, variants); a variant is the knobs it sets (level7_fused/mlp.cu's opening comment)
SETTINGS = {
    "chapter": (10_000, 8, 256, [{}, {"MLP_FUSED_UNITS": "8"}, {"MLP_FUSED_EXCHANGE": "grid"}]),
    "large-b64": (60_000, 64, 1024, [{}, {"MLP_FUSED_UNITS": "16"}]),
    "large-b256": (60_000, 256, 1024, [{}, {"MLP_FUSED_UNITS": "16"}]),
}
KNOBS = ("MLP_FUSED_UNITS", "MLP_FUSED_EXCHANGE")
FIRST_STEPS = 20  # losses compared with level 6's over these, before float32's rounding lets two runs part


def timed_epochs(model, X, y, batch: int, epochs: int = 3) -> tuple[np.ndarray, float]:
    """The untimed first epoch's losses, and the median of the timed epochs' seconds."""
    first = model.train_epoch(X, y, batch, 0.01)
    seconds = []
    for _ in range(epochs):
        start = time.perf_counter()
        model.train_epoch(X, y, batch, 0.01)
        seconds.append(time.perf_counter() - start)
    return first, float(np.median(seconds))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tag", default=None, help="results/<tag>/ (default: the GPU's model)")
    args = p.parse_args()
    args.tag = args.tag or machine_tag()  # the results folder of the GPU that measures
    import warnings

    from level6_cublas import MLP as Level6
    from level7_fused import MLP as Level7

    warnings.simplefilter("ignore", RuntimeWarning)  # a variant that does not fuse says so in its plan
    data = load_mnist(quiet=True)
    lines = ["level 7's variants: median epoch of 3 (after an untimed one), us per step; 'losses' is the largest "
             f"relative difference from level 6's over the first {FIRST_STEPS} steps of the untimed epoch"]
    for name, (n, batch, hidden, variants) in SETTINGS.items():
        X, y = normalize(data.train_images[:n]), data.train_labels[:n]
        steps = -(-n // batch)
        params = init_params(0, hidden)
        reference = Level6(params).train_epoch(X, y, batch, 0.01)[:FIRST_STEPS]
        lines.append(f"\n{name}: {n:,} images, batch {batch}, hidden {hidden} ({steps:,} steps)")
        for knobs in variants:
            for knob in KNOBS:
                os.environ.pop(knob, None)
            os.environ.update(knobs)
            model = Level7(params)
            plan = model.plan(batch)
            losses, seconds = timed_epochs(model, X, y, batch)
            gap = float(np.max(np.abs(losses[:FIRST_STEPS] - reference) / np.abs(reference)))
            label = " ".join(f"{k.removeprefix('MLP_FUSED_').lower()}={v}" for k, v in knobs.items()) or "default"
            lines.append(f"  {label:<28}{seconds / steps * 1e6:9.2f} us/step   losses {gap:.1e}   {plan}")
            print(lines[-1], flush=True)
    for knob in KNOBS:
        os.environ.pop(knob, None)
    print(f"wrote {results.write(args.tag, 'level7_variants.txt', lines)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
