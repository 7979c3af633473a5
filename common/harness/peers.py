"""The peers' speed checked: the harness's peer rows against the same loops written plainly, apart from the harness.

    python -m common.harness.peers --check results/h100/chapter              # a training preset's peer rows
    python -m common.harness.peers --check results/h100/lenet-inference      # make infer's PyTorch rows

The harness's peers (level1_pytorch/peers.py, common/harness/serving.py) are classes that fit the level contract, so
that they are verified like any level. Their plain twins (level1_pytorch/plain_peers.py) share none of their code.
Each twin is timed the way the harness times its row, at the settings the results folder records, and a harness row
more than plain_peers.TOLERANCE from its twin, slower or faster, fails: then one of them is not the code its name
says.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from common.harness.compare import training_set
from common.harness.data import load_mnist, normalize
from common.harness.serving import load_weights
from common.nets import get
from level1_pytorch import plain_peers


def check(folder) -> list[str]:
    """Time plain_peers' loops at the settings of a results folder (a training preset's, or make infer's) and compare
    them with its peer rows; print both, return the rows that disagree by more than plain_peers.TOLERANCE."""
    results = json.loads((Path(folder) / "results.json").read_text())
    if "batches" in results:  # make infer's
        pairs = serving_pairs(results)
    else:
        pairs = training_pairs(results)
    bad = []
    print(f"{folder}: the harness's row against its plain twin (ratio = harness / plain)")
    for name, harness, plain, unit in pairs:
        ratio = harness / plain
        agrees = 1 / plain_peers.TOLERANCE <= ratio <= plain_peers.TOLERANCE
        print(f"  {name:<24} harness {harness:10.1f} {unit}   plain {plain:10.1f} {unit}   {ratio:5.2f}x"
              f"  {'ok' if agrees else 'DISAGREE'}")
        bad += [] if agrees else [f"{folder}: {name}"]
    return bad


def training_pairs(results: dict) -> list[tuple[str, float, float, str]]:
    """(peer, harness us/step, plain us/step) at a training preset's settings; an unsteady harness row (no time
    published) is left out, and said."""
    s = results["settings"]
    network = get(s["model"])
    args = type("Settings", (), {**s, "repeat": True, "hidden": s.get("hidden")})
    X, y, n = training_set(load_mnist(quiet=True), args)
    params = network.network.init_params(s["seed"], s.get("hidden"))
    plain = plain_peers.training_peers(s["model"], params, X, y, s["batch"], s["lr"], s.get("hidden"), s["epochs"])
    steps = -(-n // s["batch"])
    rows = {r["level"].removesuffix("[cuda]"): r for r in results["table"]}
    for name in plain:
        if name in rows and rows[name]["us_per_step"] is None:
            print(f"  {name}: its harness row is unsteady (no time published): not compared")
    return [(name, rows[name]["us_per_step"], 1e6 * seconds / steps, "us/step") for name, seconds in plain.items()
            if name in rows and rows[name]["us_per_step"]]


def serving_pairs(results: dict) -> list[tuple[str, float, float, str]]:
    """(peer at a batch size, harness p50 us, plain p50 us) of make infer's PyTorch rows."""
    params = load_weights(results["weights"])
    X = normalize(load_mnist(quiet=True).test_images)
    pairs = []
    for batch in results["batches"]:
        plain = plain_peers.serving_peers(params, X[:batch], results["calls"])
        pairs += [(f"{name}, batch {batch}", results["rows"][name]["times"][str(batch)]["p50_us"], us, "us/call")
                  for name, us in plain.items() if name in results["rows"]]
    return pairs


def main(argv: list[str] | None = None) -> int:
    import argparse

    import torch

    p = argparse.ArgumentParser(description="Check the harness's peer rows against the same loops written plainly.")
    p.add_argument("--check", nargs="+", required=True, metavar="FOLDER",
                   help="results folders: a preset of make bench (results/h100/chapter) or make infer's")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("the peers run on an NVIDIA GPU, and PyTorch sees none here")
        return 1
    bad = [row for folder in args.check for row in check(folder)]
    for row in bad:
        print(f"DISAGREE: {row}: the harness's peer and its plain twin are more than {plain_peers.TOLERANCE}x apart")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
