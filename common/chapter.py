"""Helpers the chapter notebooks share: show the real code, train a small run with the harness, show results.

Each chapter prints the code it discusses from the level's own source, so prose and code cannot drift apart.
"""

from __future__ import annotations

import inspect
import json
import re
import tempfile
from pathlib import Path

import numpy as np

from common import compare, verify
from common.levels import ROOT, gpu_available

# What a brace counter must step over in C: comments and string or character literals (they may hold braces).
_C_TOKENS = re.compile(r"/\*.*?\*/|//[^\n]*|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'|[{};]", re.S)
BENCH = "measured with `make bench` (python -m common.bench) and committed"


def show_source(obj) -> None:
    """Print a Python object's source, as the tests run it."""
    print(inspect.getsource(obj))


def c_function(path: str | Path, name: str) -> tuple[int, str]:
    """(line, text) of the C/CUDA function, kernel, struct or macro `name`, from its leading comment to its end."""
    text = (ROOT / path).read_text()
    # A definition starts in column 0 (calls are indented), perhaps after __launch_bounds__(...); a prototype meets a
    # ';' before any '{'.
    for match in re.finditer(rf"^(#define\s+|(?![\s#])[^\n;{{}}=]*?\b){re.escape(name)}\b\s*[({{]", text, re.M):
        end = match.start()
        if match.group(1).startswith("#define"):  # up to the first line without a continuation backslash
            while text[end : text.find("\n", end)].endswith("\\"):
                end = text.find("\n", end) + 1
            return _with_leading_comment(text, match.start(), text.find("\n", end))
        depth = 0
        for token in _C_TOKENS.finditer(text, match.start()):
            if token.group() == ";" and depth == 0:
                break
            depth += {"{": 1, "}": -1}.get(token.group(), 0)
            if token.group() == "}" and depth == 0:
                return _with_leading_comment(text, match.start(), text.find("\n", token.end()))
    raise LookupError(f"no definition of {name!r} in {path} (was it renamed?)")


def _with_leading_comment(text: str, start: int, end: int) -> tuple[int, str]:
    """Extend text[start:end] back over a `template <...>` line and the comment right above it (no blank line)."""
    end = len(text) if end < 0 else end
    above = text.rfind("\n", 0, start - 1) + 1
    if text[above:start].startswith("template"):
        start = above
    if text[:start].rstrip(" \t").endswith("*/\n"):
        opening = text.rfind("/*", 0, start)
        line_start = text.rfind("\n", 0, opening) + 1
        if not text[line_start:opening].strip():  # the comment starts its line: it is not a trailing one
            start = line_start
    while start and text[text.rfind("\n", 0, start - 1) + 1 : start].lstrip().startswith("//"):
        start = text.rfind("\n", 0, start - 1) + 1
    return text.count("\n", 0, start) + 1, text[start:end]


def show_c_function(path: str | Path, name: str) -> None:
    """Print one C/CUDA definition (path relative to the repository root), headed by where it is."""
    line, code = c_function(path, name)
    print(f"// {path}, line {line}\n{code}\n")


def small_run(levels: list[int], epochs: int = 2, train_size: int = 1000, batch: int = 8, hidden: int = 256,
              out: str | Path | None = None) -> dict:
    """Train `levels` with the harness (it skips, saying why, those this machine cannot run); its results.

    Raises when the harness reports a failure, so that a chapter (and its test) cannot show a failed check as a pass.
    """
    folder = ROOT / out if out else Path(tempfile.mkdtemp(prefix="chapter-"))
    status = compare.main(["--levels", ",".join(map(str, levels)), "--epochs", str(epochs), "--train-size",
                           str(train_size), "--batch", str(batch), "--hidden", str(hidden), "--out", str(folder), "--quiet"])
    if status:
        raise RuntimeError(f"the harness reports a failure (exit status {status}): see the FAIL lines above")
    return load_results(folder)


def load_results(folder: str | Path) -> dict | None:
    """A folder's results.json (relative to the repository root) plus its "folder"; None, saying why, if absent."""
    folder = ROOT / folder
    if not (folder / "results.json").exists():
        shown = folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder
        print(f"No results in {shown}/ yet: they are {BENCH}. This cell shows them once they are there.")
        return None
    return {**json.loads((folder / "results.json").read_text()), "folder": str(folder)}


def show_results(results: dict | str | Path, plots: bool = True) -> None:
    """Print a run's settings, machine, rules and table; display its free-run and lockstep plots inline."""
    from IPython.display import Image, display

    if not isinstance(results, dict) and (results := load_results(results)) is None:
        return
    s, m = results["settings"], results["machine"]
    gpu = f"{m['gpu']} (driver {m.get('driver', '?')}, CUDA {m.get('cuda_runtime', '?')}) + " if "gpu" in m else ""
    rules = ", ".join(f"{k.replace('_', ' ')} {v:g}" for k, v in results["rules"].items())
    print(f"{s['train_size']:,} images x {s['epochs']} epochs, batch {s['batch']}, hidden {s['hidden']}, lr {s['lr']}\n"
          f"machine: {gpu}{m.get('cpu', '?')}\ndata: {results['data']}\nrules (common/verify.py): {rules}\n")
    compare.print_table(results["table"])
    print("\nepoch times, median [fastest, slowest]: " + "; ".join(
        f"{r['level']} {r['epoch_s_median'] * 1e3:.1f} [{r['epoch_s_spread'][0] * 1e3:.1f}, {r['epoch_s_spread'][1] * 1e3:.1f}] ms"
        for r in results["table"]))
    for name in ("loss_curves.png", "lockstep.png") if plots else ():
        if (Path(results["folder"]) / name).exists():
            display(Image(filename=str(Path(results["folder"]) / name)))


def show_side_by_side(folders: list[str], key: str = "gflops") -> None:
    """Print one column of several runs' tables side by side (by default GFLOP/s, comparable across sizes)."""
    runs = {Path(f).name: r for f in folders if (r := load_results(f))}
    if not runs:
        return
    print(f"{key:<16}" + "".join(f"{name:>14}" for name in runs))
    print(f"{'batch, hidden':<16}" + "".join(f"{r['settings']['batch']:>8}, {r['settings']['hidden']:>4}" for r in runs.values()))
    for label in dict.fromkeys(row["level"] for r in runs.values() for row in r["table"]):
        rows = [next((row for row in r["table"] if row["level"] == label), None) for r in runs.values()]
        print(f"{label:<16}" + "".join(f"{row[key]:>14.2f}" if row else f"{'-':>14}" for row in rows))


def show_profile(path: str = "results/h100/profile.json") -> None:
    """Show where a GPU step's time goes (common.bench's profile): GPU busy time, launches, the rest, busiest kernels."""
    from IPython.display import Markdown, display

    from common.bench import profile_markdown

    if not (ROOT / path).exists():
        print(f"No {path} yet: it is {BENCH}.")
        return
    display(Markdown(profile_markdown(json.loads((ROOT / path).read_text()))))


def first_relu_split(a, b, X, y, batch: int, lr: float, steps: int) -> tuple[dict | None, np.ndarray]:
    """Train two level-1 models (say float32 and its float64 twin) side by side on the same batches, in order.

    Returns the first ReLU they decide differently - step, image, hidden unit, both pre-activations and float32's
    rounding bound there - or None within `steps`; and |loss_a - loss_b| at every step taken.
    """
    import torch

    gaps, split = [], None
    for k in range(steps):
        rows = np.arange(k * batch, (k + 1) * batch, dtype=np.int32)
        with torch.no_grad():  # the pre-activations each model's own step is about to compute
            h = [m.net.fc1(torch.from_numpy(X[rows]).to(m.dtype)).double().numpy() for m in (a, b)]
        differ = np.argwhere((h[0] > 0) != (h[1] > 0))
        if split is None and len(differ):
            r, j = differ[0]
            exact = verify.exact_step(a.state_dict(), X[rows], y[rows], lr)
            split = {"step": k, "image": int(rows[r]), "unit": int(j), "h_a": h[0][r, j], "h_b": h[1][r, j],
                     "bound": exact.bound(r, j)}
        gaps.append(abs(float(a.train_epoch(X, y, batch, lr, rows)[0]) - float(b.train_epoch(X, y, batch, lr, rows)[0])))
    return split, np.array(gaps)


def gpu_here() -> bool:
    """True when this machine has an NVIDIA GPU that the GPU levels can use."""
    return gpu_available()
