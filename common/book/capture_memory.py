"""Level 4's chapter, memory management: what `make check-memory` says about a planted leak and a planted overflow.

    python -m common.book.capture_memory      # writes results/memory/leak.txt and overflow.txt (needs valgrind and gcc)

Each bug is planted in a scratch copy of the repository (tests/plant_bugs.py's scratch_copy), where
`make check-memory` runs tests/check_memory.c - every function of mlp.h, a thousand models - under valgrind
and then under AddressSanitizer + UBSan. The files keep the tools' own words, trimmed to the reports;
results/memory/sources.json records the sources they quote (common.book.make.write_capture), so the chapter that shows
them is stale once one of those changes.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys

from common.book.make import write_capture
from common.levels import ROOT

spec = importlib.util.spec_from_file_location("plant_bugs", ROOT / "tests" / "plant_bugs.py")
plant_bugs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plant_bugs)

BUGS = {
    "leak.txt": ("mlp_destroy forgets the data set", "    free(m->data_x), free(m->data_y);\n    free(m);\n",
                 "    free(m);\n"),
    "overflow.txt": ("the batch buffer one float short", "    m->x = malloc(sizeof(float) * R * m->n_in);\n",
                     "    m->x = malloc(sizeof(float) * (R * m->n_in - 1));\n"),
}


def report(output: str) -> str:
    """The lines of the tools' reports worth reading: errors, leaks, summaries, and the first frames of each stack."""
    keep = re.compile(r"(definitely lost|indirectly lost|ERROR SUMMARY|Invalid (read|write)|at 0x|by 0x|"
                      r"ERROR: AddressSanitizer|WRITE of size|READ of size|#[0-3] |located|allocated by|"
                      r"SUMMARY: AddressSanitizer|unexpected statuses|All heap blocks)")
    return "\n".join(line for line in output.splitlines() if keep.search(line)) + "\n"


def main() -> int:
    folder = ROOT / "results" / "memory"
    folder.mkdir(parents=True, exist_ok=True)
    for name, (what, good, bad) in BUGS.items():
        repo = plant_bugs.scratch_copy()
        path = repo / "level4_c" / "mlp.c"
        text = path.read_text()
        assert text.count(good) == 1, f"level4_c/mlp.c changed: cannot plant '{what}'"
        path.write_text(text.replace(good, bad))
        run = subprocess.run(["make", "check-memory"], cwd=repo, capture_output=True, text=True)
        text = (f"planted in level4_c/mlp.c: {what}\n  {good.strip()!r}\n  -> {bad.strip()!r}\n"
                f"make check-memory: exit status {run.returncode}\n\n{report(run.stdout + run.stderr)}")
        write_capture(folder / name, text, ["level4_c/mlp.c", "tests/check_memory.c"])
        shutil.rmtree(repo.parent)
        print(f"{name}: make check-memory exit status {run.returncode}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
