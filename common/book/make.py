"""The chapters as they are read: each notebook committed with its outputs, and a record of what they were made from.

    python -m common.book              # re-make the chapters whose outputs are stale (make chapters)
    python -m common.book --all        # re-make every chapter this machine can run
    python -m common.book --check      # list the stale chapters; exit status 1 if there is one

A chapter is executed top to bottom in a fresh kernel, in its own folder, on the full MNIST. Its metadata then records
the machine, the data set, a hash of its code cells and a hash of every repository file it used (the modules it
imported, the sources of the native libraries they loaded, the files it showed or read: common.book.chapter.used_files).
The outputs are stale when any of these changed since, or when a capture of a tool's output the chapter shows quotes a
source that changed since it was captured (write_capture); the tests check it. The chapters of the GPU levels are made
only on a machine with an NVIDIA GPU, and elsewhere are left as they are.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from common.levels import LEVELS, ROOT, gpu_available

CHAPTERS = sorted(ROOT.glob("level*/chapter*.ipynb"))
KEY = "made_from"  # the record, in the notebook's metadata
TIMEOUT_S = 900  # one cell, at most


def digest(data: bytes) -> str:
    """A short SHA-256 of some bytes (16 hex digits: enough to notice a change)."""
    return hashlib.sha256(data).hexdigest()[:16]


def code_digest(notebook: dict) -> str:
    """A hash of the notebook's code cells, in order: editing one changes what its outputs would be."""
    return digest(json.dumps(["".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code"]).encode())


def file_digests(files: list[str]) -> dict[str, str]:
    """Each repository file's hash ('missing' for a file that is gone)."""
    return {f: digest((ROOT / f).read_bytes()) if (ROOT / f).is_file() else "missing" for f in files}


def needs_gpu(path: Path) -> bool:
    """True for the chapter of a level that runs only on an NVIDIA GPU."""
    return any(lv.package == path.parent.name and "gpu" in lv.needs for lv in LEVELS)


def stale(path: Path) -> list[str]:
    """Why the chapter's committed outputs are out of date (empty when they are current)."""
    notebook = json.loads(path.read_text())
    record = notebook["metadata"].get(KEY)
    if not record:
        return ["it has no record of what its outputs were made from: run `make chapters`"]
    why = []
    if record["code"] != code_digest(notebook):
        why.append("a code cell changed")
    now = file_digests(list(record["files"]))
    why += [f"{f} {'is there now' if d == 'missing' else 'changed'}" for f, d in record["files"].items() if now[f] != d]
    for f in record["files"]:
        why += capture_stale(ROOT / f)
    return why


# ---- captured tool output: a tool's words about our code (valgrind, compute-sanitizer, Nsight Compute) ----

SOURCES = "sources.json"  # beside the captures of a folder: the files each one quotes, and their hashes then
_QUOTED = re.compile(r"([\w./-]+\.(?:c|cu|cuh|h|py)):\d+")  # a file named with a line number: mlp.c:296


def quoted_files(text: str) -> set[str]:
    """The repository files a tool's output names with a line number, by their path or by a name only one has."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    found = set()
    for name in set(_QUOTED.findall(text)):
        matches = [f for f in tracked if f == name or f.endswith("/" + name)]
        if len(matches) == 1:
            found.add(matches[0])
    return found


def write_capture(path: Path, text: str, sources: list[str]) -> None:
    """Write a capture of a tool's output and record the sources it quotes (those given, and every file it names
    with a line number) with their hashes, so that a chapter showing it is stale once one of them changes."""
    path.write_text(text)
    record_file = path.parent / SOURCES
    records = json.loads(record_file.read_text()) if record_file.exists() else {}
    records[path.name] = file_digests(sorted(set(sources) | quoted_files(text)))
    record_file.write_text(json.dumps(dict(sorted(records.items())), indent=1) + "\n")


def capture_stale(path: Path) -> list[str]:
    """Why a capture no longer matches the code it quotes (empty for a current one, or for a file that is no
    capture)."""
    record_file = path.parent / SOURCES
    if path.name == SOURCES or not record_file.is_file():
        return []
    sources = json.loads(record_file.read_text()).get(path.name, {})
    now = file_digests(list(sources))
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return [f"{shown} quotes {f}, which changed since it was captured" for f, d in sources.items() if now[f] != d]


def machine_name() -> str:
    """The machine a chapter was made on, in words: its GPU if it has one, else its CPU."""
    from common.harness.compare import machine

    m = machine()
    cpu = f"{m.get('cpu', '?')}, {m['cpu_count']} cores"
    return f"{m['gpu']}; {cpu}" if "gpu" in m else cpu


def execute(path: Path) -> dict:
    """Run the notebook from a clean state in its folder; return it with its outputs and the record of its sources."""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    notebook.metadata.pop(KEY, None)
    client = NotebookClient(notebook, timeout=TIMEOUT_S, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(path.parent)}})
    # The kernel imports this checkout's packages, whatever the environment has installed.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with client.setup_kernel(env=env):
        for index, cell in enumerate(notebook.cells):
            client.execute_cell(cell, index)
        probe = nbformat.v4.new_code_cell("import json\nfrom common.book.chapter import used_files\n"
                                          "print(json.dumps(used_files()))")
        notebook.cells.append(probe)  # run in the chapter's kernel, then taken out again
        client.execute_cell(probe, len(notebook.cells) - 1)
        notebook.cells.pop()
    files = json.loads("".join(o.get("text", "") for o in probe.outputs if o.get("name") == "stdout"))
    notebook.metadata[KEY] = {"machine": machine_name(), "gpu": gpu_available(), "data": data_source(),
                              "code": code_digest(notebook),
                              "files": file_digests(files)}
    return notebook


def data_source() -> str:
    """Which MNIST the chapters read (they must be made on the full set)."""
    from common.harness.data import load_mnist

    return load_mnist(quiet=True).source


def make(path: Path) -> None:
    """Execute one chapter and write it back with its outputs and record."""
    import nbformat

    notebook = execute(path)
    nbformat.write(notebook, path)
    size = path.stat().st_size
    print(f"{path.relative_to(ROOT)}: made on {notebook.metadata[KEY]['machine']}, {size / 1024:.0f} KiB, "
          f"{len(notebook.metadata[KEY]['files'])} files recorded")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("chapters", nargs="*", type=Path, help="notebooks to make (default: every chapter)")
    parser.add_argument("--all", action="store_true", help="re-make chapters that are current too")
    parser.add_argument("--check", action="store_true", help="only list the stale chapters")
    args = parser.parse_args(argv)
    chapters = [p.resolve() for p in args.chapters] or CHAPTERS
    if not args.check and "full" not in data_source():
        print("The chapters are made on the full MNIST: unset MNIST_OFFLINE, or fetch it (make compare does).")
        return 1
    left = []
    for path in chapters:
        name = path.relative_to(ROOT)
        why = stale(path)
        if args.check or not (why or args.all):
            print(f"{name}: {'stale - ' + '; '.join(why) if why else 'current'}")
            left += [name] if why else []
        elif needs_gpu(path) and not gpu_available():
            print(f"{name}: {'stale' if why else 'current'}; not made here - it needs an NVIDIA GPU: "
                  "run `make chapters` on a GPU machine")
            left += [name] if why else []
        else:
            make(path)
    if left:
        print(f"{len(left)} chapter(s) stale: {', '.join(map(str, left))}")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
