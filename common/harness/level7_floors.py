"""The floors of level 7's hand-over, measured alone on a GPU machine: a barrier, and a barrier with the shares.

    python3 -m common.harness.level7_floors [--tag h100]      # writes results/<tag>/level7_floors.txt

Builds build/level7_floors.so (level7_fused/floors.cu: level 7's own exchange, in kernels that do nothing else) and
times, in microseconds per round: a barrier alone (the grid's, or the cluster's hardware barrier), and the exchange of
a step - each block's share of the logits sent, waited for, every block's share read - through global memory and the
grid barrier, or into every block's shared memory with a barrier of its own per block; what a step of the fused kernel
cannot go below. And a ping-pong between two blocks of a cluster through their shared memory.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

from cffi import FFI

from common.levels import ROOT, machine_tag
from common.harness import results

ROUNDS = 20_000
GRIDS = (16, 32, 128)  # blocks of a cooperative grid
CLUSTERS = (8, 16)  # blocks of a cluster: 8 is the portable maximum, 16 the H100's


def load() -> tuple[FFI, object]:
    """(ffi, lib) of the floors' library, built by make, declared from its source's cdef markers."""
    subprocess.run(["make", "-s", "build/level7_floors.so", f"PYTHON={sys.executable}"], cwd=ROOT, check=True)
    source = (ROOT / "level7_fused" / "floors.cu").read_text()
    ffi = FFI()
    ffi.cdef(re.search(r"/\* cdef-begin \*/(.*)/\* cdef-end \*/", source, re.S).group(1)
             + "const char *mlp_last_error(void);")
    return ffi, ffi.dlopen(str(ROOT / "build" / "level7_floors.so"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tag", default=None, help="results/<tag>/ (default: the GPU's model)")
    args = p.parse_args()
    args.tag = args.tag or machine_tag()  # the results folder of the GPU that measures
    ffi, lib = load()
    out = ffi.new("double *")

    def measured(status: int) -> float:
        if status:
            raise RuntimeError(ffi.string(lib.mlp_last_error()).decode())
        return out[0]

    lines = [f"level 7's hand-over alone, microseconds per round (median of 5 of {ROUNDS:,} rounds' differences)"]
    rows = [(f"grid of {g} blocks", 0, g) for g in GRIDS] + [(f"cluster of {c} blocks", 1, c) for c in CLUSTERS]
    lines.append(f"  {'':<24}{'barrier':>10}{'exchange':>10}")
    for label, cluster, blocks in rows:
        times = [sorted(measured(lib.floor_exchange(cluster, blocks, ROUNDS, shares, out)) for _ in range(5))[2]
                 for shares in (0, 1)]
        lines.append(f"  {label:<24}{times[0]:10.3f}{times[1]:10.3f}")
    for c in CLUSTERS:
        trip = sorted(measured(lib.floor_round_trip(c, ROUNDS, out)) for _ in range(5))[2]
        lines.append(f"  shared-memory round trip, block 0 <-> block {c - 1} of a cluster of {c}: {trip:.3f} us")
    print("\n".join(lines))
    print(f"wrote {results.write(args.tag, 'level7_floors.txt', lines)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
