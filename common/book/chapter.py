"""Helpers the chapter notebooks share: show the real code, train a small run with the harness, show results.

Each chapter shows the code it discusses from the level's own source, so prose and code cannot drift apart. Every
repository file a chapter shows or reads goes through these helpers, which note it: `make chapters` records those
files' hashes in the notebook (common/book/make.py), and the tests fail when one changed after the outputs were made.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

from common.harness import compare, verify
from common.levels import LEVELS, ROOT, gpu_available
from common.nets import NETWORKS

# What a brace counter must step over in C: comments and string or character literals (they may hold braces).
_C_TOKENS = re.compile(r"/\*.*?\*/|//[^\n]*|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'|[{};]", re.S)
BENCH = "measured with `make bench` (python -m common.harness.bench) and committed"
SCREEN_WIDTH = 900  # pixels: the widest a figure is embedded in a chapter

_read: set[Path] = set()  # repository files shown or read through these helpers (see used_files)


# The lab's markers around a solution (common/classroom/lab.py): they mean nothing to a reader of the chapter. Nor do
# the lines of testing and measuring scaffolding a source marks "/* scaffold */" (level 7's stress and phase builds).
_LAB_MARKER = re.compile(r"^[ \t]*(?:#|/\*) (?:BEGIN LAB \d+\.\d+ .*|END LAB)(?: \*/)?\n", re.M)
_SCAFFOLD = re.compile(r"^.*/\* scaffold \*/[ \t]*\n", re.M)


class Code:
    """Source code as a chapter shows it: highlighted where Markdown is rendered (Jupyter, GitHub), plain elsewhere."""

    def __init__(self, text: str, language: str):
        self.text, self.language = _SCAFFOLD.sub("", _LAB_MARKER.sub("", text + "\n")).rstrip("\n"), language

    def _repr_markdown_(self) -> str:
        return f"```{self.language}\n{self.text}\n```"

    def __repr__(self) -> str:
        return self.text


def _note(path: str | Path) -> Path:
    """The absolute path of a repository file, noted as read by the chapter."""
    path = ROOT / path
    _read.add(path.resolve())
    return path


def show_source(*objects) -> None:
    """Show Python objects' source (functions, classes, methods), as the tests run it."""
    from IPython.display import display

    for obj in objects:
        _note(inspect.getsourcefile(obj))
        display(Code(inspect.getsource(obj), "python"))


def read_source(path: str | Path) -> str:
    """The text of a source file of the repository (path relative to its root), for a chapter that searches it."""
    return _note(path).read_text()


def read_result(path: str | Path) -> str | None:
    """The text of a committed results file (path relative to the repository root); None, saying why, if absent."""
    file = _note(path)
    if not file.exists():
        print(f"No {path} here: it is {BENCH}. This cell shows it once it is there.")
        return None
    return file.read_text()


def capture_part(text: str, start: str) -> str:
    """The part of a capture that begins at the line starting with `start`, up to the next blank line (one level's
    timeline) or the next line starting with "---" (one kernel of Nsight Compute's report)."""
    lines = text.splitlines()
    begin = next(i for i, line in enumerate(lines) if line.startswith(start))
    end = next((i for i in range(begin + 1, len(lines)) if not lines[i].strip() or lines[i].startswith("---")),
               len(lines))
    return "\n".join(lines[begin:end])


def show_capture(path: str | Path, lines: int = 14, part: str | None = None) -> str | None:
    """Print the first lines of a committed capture (or of its part starting with `part`); return its text."""
    text = read_result(path)
    if text is None:
        return None
    if part:
        text = capture_part(text, part)
    shown = text.splitlines()
    print("\n".join(shown[:lines]) + (f"\n[... {len(shown) - lines} more lines]" if len(shown) > lines else ""))
    return text


def read_result_json(path: str | Path):
    """A committed results file parsed as JSON; None, saying why, if absent."""
    text = read_result(path)
    return None if text is None else json.loads(text)


def c_function(path: str | Path, name: str) -> tuple[int, str]:
    """(line, text) of the C/CUDA function, kernel, struct or macro `name`, from its leading comment to its end."""
    text = _note(path).read_text()
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
    """Show one C/CUDA definition (path relative to the repository root), headed by where it is."""
    from IPython.display import display

    line, code = c_function(path, name)
    display(Code(f"// {path}, line {line}\n{code}", "cuda" if str(path).endswith((".cu", ".cuh")) else "c"))


def small_run(levels: list[int], epochs: int = 2, train_size: int = 1000, batch: int = 8, hidden: int = 256,
              out: str | Path | None = None, model: str = "mlp") -> dict:
    """Train `levels` with the harness (it skips, saying why, those this machine cannot run); its results. model: a
    network of common/nets (LeNet-5 has no hidden size: `hidden` is then left out).

    Raises when the harness reports a failure, so that a chapter (and its test) cannot show a failed check as a pass.
    """
    folder = ROOT / out if out else Path(tempfile.mkdtemp(prefix="chapter-"))
    with contextlib.redirect_stdout(io.StringIO()) as log:  # show_results prints the table the chapter wants
        size = ["--hidden", str(hidden)] if model == "mlp" else []
        status = compare.main(["--model", model, "--levels", ",".join(map(str, levels)), "--epochs", str(epochs),
                               "--train-size", str(train_size), "--batch", str(batch), *size, "--out", str(folder),
                               "--quiet"])
    if status:
        print(log.getvalue())
        raise RuntimeError(f"the harness reports a failure (exit status {status}): see the FAIL lines above")
    return load_results(folder)


def load_results(folder: str | Path) -> dict | None:
    """A folder's results.json (relative to the repository root) plus its "folder"; None, saying why, if absent."""
    folder = ROOT / folder
    _note(folder / "results.json")
    if not (folder / "results.json").exists():
        shown = folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder
        print(f"No results in {shown}/ yet: they are {BENCH}. This cell shows them once they are there.")
        return None
    return {**json.loads((folder / "results.json").read_text()), "folder": str(folder)}


def show_results(results: dict | str | Path, plots: bool = True, rows=None) -> None:
    """Print a run's settings, machine, rules, how it was timed and its table (rows: the labels to show, default all);
    display its free-run and lockstep plots inline."""
    from IPython.display import Image, display

    if not isinstance(results, dict) and (results := load_results(results)) is None:
        return
    s, m = results["settings"], results["machine"]
    gpu = f"{m['gpu']} (driver {m.get('driver', '?')}, CUDA {m.get('cuda_runtime', '?')}) + " if "gpu" in m else ""
    rules = ", ".join(f"{k.replace('_', ' ')} {v:g}" for k, v in results["rules"].items())
    size = f", hidden {s['hidden']}" if "hidden" in s else ""
    network = "LeNet-5: " if s.get("model") == "lenet" else ""
    print(f"{network}{s['train_size']:,} images x {s['epochs']} epochs, batch {s['batch']}{size}, lr {s['lr']}\n"
          f"machine: {gpu}{m.get('cpu', '?')}\ndata: {results['data']}\n"
          f"rules (common/harness/verify.py): {rules}\n{compare.timing_rule(s)}\n")
    table = [r for r in results["table"] if rows is None or r["level"] in rows]
    compare.print_table(table)
    if results.get("busy"):
        print(f"WARNING: the machine was busy while the rows were timed ({results['busy']}): their times are not to be "
              "trusted")
    for r in table:
        if "written as" in r.get("ran", {}):
            print(f"  {r['level']}: {r['ran']['written as']}")
    for name in ("loss_curves.png", "lockstep.png") if plots else ():
        if (Path(results["folder"]) / name).exists():
            display(Image(data=screen_png(_note(Path(results["folder"]) / name))))


def screen_png(path: Path) -> bytes:
    """A PNG file scaled down to SCREEN_WIDTH pixels at most, so that a chapter carries no more than it shows."""
    from PIL import Image

    picture = Image.open(path)
    if picture.width > SCREEN_WIDTH:
        picture = picture.resize((SCREEN_WIDTH, round(picture.height * SCREEN_WIDTH / picture.width)), Image.LANCZOS)
    return _png(picture)


def _png(picture) -> bytes:
    """A PIL image as a PNG of 256 colours: a third of the bytes for a plot, and no visible difference."""
    buffer = io.BytesIO()
    picture.convert("RGB").quantize(256).save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def show_figure(fig, dpi: int = 100) -> None:
    """Display a matplotlib figure at screen resolution (at most SCREEN_WIDTH pixels wide) and close it."""
    import matplotlib.pyplot as plt
    from IPython.display import Image, display
    from PIL import Image as Picture

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=min(dpi, SCREEN_WIDTH / fig.get_figwidth()), bbox_inches="tight")
    plt.close(fig)
    picture = Picture.open(buffer)
    if picture.width > SCREEN_WIDTH:  # bbox_inches="tight" may widen a figure past its size
        picture = picture.resize((SCREEN_WIDTH, round(picture.height * SCREEN_WIDTH / picture.width)), Picture.LANCZOS)
    display(Image(data=_png(picture)))


def say(text: str) -> None:
    """A paragraph whose numbers or comparisons come from the run or the results above it, written by the cell that
    computes them, so that the text and the output cannot disagree. Shown as Markdown."""
    from IPython.display import Markdown, display

    display(Markdown(text))


SAME = 1.05  # two times within 5% of each other are "as fast as" each other in a sentence


def speed_words(ours: float | None, theirs: float | None) -> str:
    """A comparison of two times in words: "1.3x faster than", "as fast as" (within SAME), "1.2x slower than"; None
    for a time the results withheld (an unsteady row) gives "not comparable with"."""
    if ours is None or theirs is None:
        return "not comparable with (a row too unsteady to publish)"
    if theirs / ours >= SAME:
        return f"{theirs / ours:.1f}x faster than"
    if ours / theirs >= SAME:
        return f"{ours / theirs:.1f}x slower than"
    return "as fast as"


def show_side_by_side(folders: list[str], key: str = "gflops", rows=None) -> None:
    """Print one column of several runs' tables side by side (by default GFLOP/s, comparable across sizes); rows: the
    labels to show (default: every one)."""
    runs = {Path(f).name: r for f in folders if (r := load_results(f))}
    if not runs:
        return
    print(f"{key:<16}" + "".join(f"{name:>14}" for name in runs))
    print(f"{'batch, hidden':<16}" + "".join(f"{r['settings']['batch']:>8}, {r['settings']['hidden']:>4}" for r in runs.values()))
    for label in dict.fromkeys(row["level"] for r in runs.values() for row in r["table"]):
        if rows is not None and label not in rows:
            continue
        found = [next((row for row in r["table"] if row["level"] == label), None) for r in runs.values()]
        print(f"{label:<16}" + "".join(f"{row[key]:>14.2f}" if row and row[key] is not None else f"{'-':>14}"
                                       for row in found))


def show_profile(path: str = "results/h100/profile.json", rows=None) -> None:
    """Show where a GPU step's time goes (common.harness.bench's profile): GPU busy time, launches, the rest, busiest
    kernels; rows: the implementations to show (default: every one)."""
    from IPython.display import Markdown, display

    from common.harness.bench import profile_markdown

    if (profile := read_result_json(path)) is not None:
        display(Markdown(profile_markdown([r for r in profile if rows is None or r["level"] in rows])))


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


def used_files() -> list[str]:
    """The repository files this chapter's kernel has used, relative to the root: the modules it imported, the sources
    of the native libraries those load, and the files shown or read through these helpers, those it looked for and did
    not find too (a result not measured yet). `make chapters` records their hashes ("missing" for one not there), so
    that a change to any of them, or a result that appears, marks the chapter's committed outputs as stale."""
    looked_for = {f for f in _read if not f.exists() and f.is_relative_to(ROOT)}
    files = set(_read)
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and Path(file).resolve().is_relative_to(ROOT) and ".venv" not in Path(file).parts:
            files.add(Path(file).resolve())
    for lv in LEVELS:
        module = sys.modules.get(lv.package)
        for network in NETWORKS:
            library = lv.library_for(network)
            if module and library and network.class_name in vars(module):  # the library it loaded
                files |= native_sources(library.parent / library.name.removeprefix("lib").removesuffix(".so"))
    kept = [f for f in files if f.is_relative_to(ROOT) and (f.is_file() or f in looked_for)]
    return sorted(str(f.relative_to(ROOT)) for f in kept)


def native_sources(stem: Path) -> set[Path]:
    """The C/CUDA files a native library is built from: its own (stem.c or stem.cu, e.g. level4_c/mlp for libmlp.so),
    and every file they #include "...", in turn."""
    todo = [stem.with_suffix(suffix).resolve() for suffix in (".c", ".cu")]
    seen: set[Path] = set()
    while todo:
        file = todo.pop()
        if file in seen or not file.exists():
            continue
        seen.add(file)
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', file.read_text(), re.M):
            todo += [(where / name).resolve() for where in (file.parent, ROOT / "common" / "native")]
    return seen
