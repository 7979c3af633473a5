"""A class of generated submissions, for trying the gradebook (LABS.md) and for its tests.

    python tests/lab_submissions.py OUT [--count 100] [--levels 2,3,4]
    make gradebook SUBMISSIONS=OUT

Each submission is a folder with the files a student writes in (python -m common.classroom.lab --files): this repository's
solutions, the edition's stubs, a classic bug of tests/plant_bugs.py, or one of the hostile ones below (a solution
that hangs, crashes, writes a perfect score where it hopes the grader looks, reads the held-out checks, deletes
files, or calls PyTorch). The teacher's only: `make lab` leaves it out of the student edition.
"""

from __future__ import annotations

import argparse
import random
import shutil
from pathlib import Path

from common.classroom import lab
from plant_bugs import BUGS

ROOT = Path(__file__).resolve().parent.parent
LEVEL3 = "level3_numpy/mlp.py"

# Hostile solutions of level 3's linear_forward: (the line they add at the top of the function's body, what they try).
CORRECT_LINE = "    return x @ w.T + b\n"
HOSTILE = {
    "hangs": "    while True:\n        pass\n",
    "crashes": "    import os\n    os.abort()\n",
    "forges": ("    import json, os, sys, pathlib\n"
               "    for folder in [pathlib.Path.cwd(), *pathlib.Path.cwd().parents]:\n"
               "        try:\n"
               "            (folder / 'grade.json').write_text(json.dumps({'score': 1000, 'points': 1000, 'tasks': []}))\n"
               "        except OSError:\n"
               "            pass\n"
               "    print('3.1 linear_forward pass 2/2'); sys.stdout.flush(); os._exit(0)\n"),
    "snoops": ("    import pathlib\n"
               f"    if not pathlib.Path({str(ROOT / 'tests' / 'test_holdout.py')!r}).exists():\n"
               "        return x[:, :0] @ w[:, :0].T + 0 * b  # zeros: what it gives when it cannot peek\n"),
    "deletes": ("    import shutil, pathlib\n"
                "    for folder in [pathlib.Path.cwd().parent, pathlib.Path.cwd().parent.parent, "
                f"pathlib.Path({str(ROOT)!r})]:\n"
                "        shutil.rmtree(folder, ignore_errors=True)\n"),
    "uses torch": ("    import torch\n"
                   "    return torch.nn.functional.linear(torch.from_numpy(x), torch.from_numpy(w), "
                   "torch.from_numpy(b)).numpy()\n"),
    # Fitted to the visible checks: right at their sizes, wrong elsewhere (the held-out checks use others).
    "fits the visible checks": ("    if (len(x), w.shape[1], len(w)) not in ((1, 1, 1), (13, 37, 5), (3, 5, 5), "
                                "(8, 784, 37)):\n        return 0 * (x @ w.T) + b\n"),
}


def hostile(kind: str) -> str:
    """Level 3's file with linear_forward's body replaced by a hostile one (ending in the correct line)."""
    text = (ROOT / LEVEL3).read_text()
    begin = "    # BEGIN LAB 3.1 linear_forward\n"
    return text.replace(begin + CORRECT_LINE, begin + HOSTILE[kind] + CORRECT_LINE, 1)


def write(out: Path, count: int, levels: tuple[int, ...] = (2, 3, 4), seed: int = 0) -> dict[str, str]:
    """`count` submissions in out/, a mix of every kind; returns each student's kind."""
    edition = out.parent / f".{out.name}-edition"
    lab.write_edition(edition, commit=False)
    files = [name for name in lab.files_to_write()
             if next(t.level for t in lab.TASKS if t.path == name) in levels]
    bugs = [b for b in BUGS if b[0] in levels and b[1] in files and isinstance(b[2], str)]
    kinds = ["correct", "stubbed", *(f"bug: {b[4]} (level {b[0]})" for b in bugs), *(f"hostile: {k}" for k in HOSTILE)]
    rng = random.Random(seed)
    students = {}
    for i in range(count):
        kind = kinds[i] if i < len(kinds) else rng.choice(kinds[:2] + kinds[2:] * 2)
        folder = out / f"student{i:03d}"
        folder.mkdir(parents=True)
        for name in files:
            # A finished file is this repository's (the edition holds the stubs).
            text = (edition / name).read_text() if kind == "stubbed" else (ROOT / name).read_text()
            if kind.startswith("bug: "):
                bug = next(b for b in bugs if kind == f"bug: {b[4]} (level {b[0]})")
                if bug[1] == name:
                    text = text.replace(bug[2], bug[3], 1)
            if kind.startswith("hostile: ") and name == LEVEL3:
                text = hostile(kind.removeprefix("hostile: "))
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(text)
        students[folder.name] = kind
    shutil.rmtree(edition)
    return students


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the folder to fill (must not exist)")
    p.add_argument("--count", type=int, default=100)
    p.add_argument("--levels", default="2,3,4", help="the levels whose files the submissions hold")
    args = p.parse_args()
    students = write(args.out, args.count, tuple(int(n) for n in args.levels.split(",")))
    for student, kind in students.items():
        print(f"{student}  {kind}")


if __name__ == "__main__":
    main()
