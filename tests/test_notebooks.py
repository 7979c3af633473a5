"""The chapters: each runs from top to bottom, its committed outputs are current, its exercises name real code and say
how to check them, and the teachers' answers (answers/, not in the student edition) cover every exercise and question.

The chapters are found by glob (common.book.make.CHAPTERS), so a new one is tested without editing this file. Each test is
marked `notebooks` and its level's marker (from the folder name, levelN_...), so `pytest -m level3` also runs level 3's
chapter. Executing needs nbclient and ipykernel (the `test` extra); where they are missing those tests skip, saying so.
"""

from __future__ import annotations

import ast
import base64
import json
import re
import struct
from pathlib import Path

import pytest

from common.book import cited
from common.book import make as book
from common.book.chapter import SCREEN_WIDTH, c_function
from common.classroom.lab import MARKER
from common.levels import ROOT, gpu_available

MAX_KIB = 1536  # a chapter with its figures; PNGs at screen resolution keep each well under this
# The student edition (make lab) ships its chapters without outputs: they would show the solutions' code.
EDITION = "the student edition ships its chapters without outputs (a student's own run makes them)"


def chapter_params() -> list:
    """One pytest.param per chapter, marked `notebooks` and levelN."""
    params = []
    for path in book.CHAPTERS:
        marker = getattr(pytest.mark, path.parent.name.split("_")[0])
        name = path.parent.name if path.stem == "chapter" else f"{path.parent.name}-{path.stem}"
        params.append(pytest.param(path, marks=[pytest.mark.notebooks, marker], id=name))
    return params


@pytest.mark.parametrize("path", chapter_params())
def test_chapter_runs(path: Path):
    for module in ("nbformat", "nbclient", "ipykernel"):
        pytest.importorskip(module, reason=f"executing the chapters needs {module}: pip install -e '.[test]'")
    fresh = book.execute(path)  # a failing cell raises CellExecutionError, with the cell and its traceback
    record = json.loads(path.read_text())["metadata"].get(book.KEY)
    # A GPU chapter reads different files with a GPU (its own run) than without one (the committed results): compare
    # only a run on the kind of machine its outputs were made on.
    if record and bool(record.get("gpu")) == gpu_available():
        unrecorded = set(fresh.metadata[book.KEY]["files"]) - set(record["files"])
        assert not unrecorded, f"{path.relative_to(ROOT)} uses files its record lacks: {sorted(unrecorded)}"


@pytest.mark.parametrize("path", chapter_params())
def test_chapter_outputs_are_current(path: Path):
    if (ROOT / MARKER).exists():
        pytest.skip(EDITION)
    why = book.stale(path)
    where = "a GPU machine" if book.needs_gpu(path) else "this machine"
    assert not why, f"{path.relative_to(ROOT)}'s committed outputs are stale ({'; '.join(why)}): run `make chapters` " \
                    f"on {where} and commit the notebook"


@pytest.mark.parametrize("path", chapter_params())
def test_chapter_is_committed_readable(path: Path):
    """Executed in one go, top to bottom, without errors; small enough to open anywhere; figures at screen size."""
    if (ROOT / MARKER).exists():
        pytest.skip(EDITION)
    notebook = json.loads(path.read_text())
    assert notebook["metadata"]["kernelspec"]["name"] == "python3", "the tests run chapters with the python3 kernel"
    code = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1)), \
        f"{path.relative_to(ROOT)} was not executed top to bottom in one go: run `make chapters`"
    errors = [i for i, c in enumerate(code) for o in c["outputs"] if o["output_type"] == "error"]
    assert not errors, f"{path.relative_to(ROOT)}: code cells {errors} end in an error"
    assert path.stat().st_size <= MAX_KIB * 1024, f"{path.relative_to(ROOT)} is {path.stat().st_size // 1024} KiB"
    for o in (o for c in code for o in c["outputs"]):
        if png := o.get("data", {}).get("image/png"):
            width = struct.unpack(">I", base64.b64decode(png)[16:20])[0]  # the IHDR chunk's first field
            assert width <= SCREEN_WIDTH, f"{path.relative_to(ROOT)}: a figure {width} pixels wide"


# An exercise that asks for a change names its target so that a test can find it:
#   In `level3_numpy/mlp.py`, function `softmax_xent_backward`, change the line `return (probs - onehot) / batch` ...
TARGET = re.compile(r"`(?P<file>[\w./-]+\.(?:py|c|cu|cuh|h))`, (?:function|kernel|method|macro|struct) "
                    r"`(?P<name>[\w.]+)`(?:, (?:the )?line `(?P<line>[^`]+)`)?")
PATH = re.compile(r"`((?:level\d\w*|common|tests)/[\w./-]+\.\w+)`")


def markdown(path: Path) -> str:
    return "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown")


def definition(file: Path, name: str) -> str:
    """The source of a Python function or method (Class.method) or of a C/CUDA definition."""
    if file.suffix != ".py":
        return c_function(file.relative_to(ROOT), name)[1]
    text = file.read_text()
    scope: list = ast.parse(text).body
    for part in name.split("."):
        node = next((n for n in scope if getattr(n, "name", None) == part), None)
        assert node is not None, f"{file.relative_to(ROOT)} has no {name}"
        scope = getattr(node, "body", [])
    return ast.get_source_segment(text, node)


@pytest.mark.parametrize("path", chapter_params())
def test_exercises_name_code_that_exists(path: Path):
    text = markdown(path)
    for file in (f for f in PATH.findall(text) if not f.endswith(".so")):  # a library is built, not committed
        assert (ROOT / file).exists(), f"{path.relative_to(ROOT)} names {file}, which does not exist"
    for target in TARGET.finditer(text):
        source = definition(ROOT / target["file"], target["name"])
        if target["line"]:
            lines = {line.strip() for line in source.splitlines()}
            assert target["line"].strip() in lines, (f"{path.relative_to(ROOT)}: {target['file']}'s {target['name']} has "
                                                     f"no line `{target['line']}`")


# Every chapter ends with exercises a student can check and a short questionnaire, in two sections numbered 1, 2, ...:
#   ## Exercises        1. **Title.** What to change or run ... and, indented in the item, a line "Check: ..." that
#                          says how the student knows the answer: a test to run, an output to read, an expected range
#   ## Check yourself   1. A question the chapter's text answers.
# The teachers' worked answers are in answers/<chapter>.md, under the same two headings, one "### N." per item.
MIN_EXERCISES = 5
QUESTIONS = range(5, 9)
ITEM = re.compile(r"^(\d+)\. ", re.M)
CHECK = re.compile(r"^\s+Check: \S", re.M)
ANSWER = re.compile(r"^### (\d+)\. \S.*\n+(?P<body>(?:(?!#).*\S.*\n?)+)", re.M)


def section(text: str, heading: str) -> str:
    """The Markdown under `## heading`, up to the next heading of that level (empty when there is none)."""
    match = re.search(rf"^## {re.escape(heading)}\n(?P<body>.*?)(?=^## |\Z)", text, re.M | re.S)
    return match["body"] if match else ""


def items(text: str) -> dict[int, str]:
    """A section's numbered items (a line starting "N. "), number -> the item's text."""
    starts = list(ITEM.finditer(text))
    return {int(m[1]): text[m.start() : nxt.start() if nxt else len(text)] for m, nxt in zip(starts, starts[1:] + [None])}


def answers_file(path: Path) -> Path:
    """The teachers' answers of a chapter: answers/level3.md for level3_numpy/chapter.ipynb, answers/level3b.md for
    level3_numpy/chapter_lenet.ipynb."""
    return ROOT / "answers" / f"{path.parent.name.split('_')[0]}{'' if path.stem == 'chapter' else 'b'}.md"


@pytest.mark.parametrize("path", chapter_params())
def test_every_chapter_ends_with_exercises_to_check_and_a_questionnaire(path: Path):
    text, name = markdown(path), path.relative_to(ROOT)
    exercises = items(section(text, "Exercises"))
    assert len(exercises) >= MIN_EXERCISES, f"{name} has {len(exercises)} numbered exercises, fewer than {MIN_EXERCISES}"
    assert list(exercises) == list(range(1, len(exercises) + 1)), f"{name}: exercises numbered {list(exercises)}"
    unchecked = [n for n, item in exercises.items() if not CHECK.search(item)]
    assert not unchecked, f"{name}: exercises {unchecked} have no line 'Check: ...' saying how to check the answer"
    last = "".join(json.loads(path.read_text())["cells"][-1]["source"])
    assert last.startswith("## Check yourself\n"), f"{name} does not end with its '## Check yourself' questionnaire"
    questions = items(section(text, "Check yourself"))
    assert len(questions) in QUESTIONS and list(questions) == list(range(1, len(questions) + 1)), \
        f"{name}: 'Check yourself' has questions {list(questions)}, not 1 to 5-8"


@pytest.mark.parametrize("path", chapter_params())
def test_the_teachers_answers_cover_every_exercise_and_question(path: Path):
    if (ROOT / MARKER).exists():
        pytest.skip("the student edition has no answers/: they are the teacher's")
    text, answers = markdown(path), answers_file(path)
    assert answers.is_file(), f"{path.relative_to(ROOT)} has no teachers' answers: write {answers.relative_to(ROOT)}"
    for heading in ("Exercises", "Check yourself"):
        asked = set(items(section(text, heading)))
        answered = [int(m[1]) for m in ANSWER.finditer(section(answers.read_text(), heading))]
        assert sorted(answered) == sorted(asked) and len(answered) == len(set(answered)), \
            f"{answers.relative_to(ROOT)}, '## {heading}': answers {answered}, but the chapter has {sorted(asked)}"


def test_a_chapter_is_stale_once_a_result_it_looked_for_is_there(tmp_path):
    """A chapter made before a result existed said so ("No results ... yet"): once the result is there, its outputs are
    stale, as when a file it read changed."""
    notebook = {"cells": [{"cell_type": "code", "source": ["print(1)"]}], "metadata": {}}
    notebook["metadata"][book.KEY] = {"code": book.code_digest(notebook), "files": {"README.md": "missing",
                                                                                    "results/never/results.json": "missing"}}
    path = tmp_path / "chapter.ipynb"
    path.write_text(json.dumps(notebook))
    assert book.stale(path) == ["README.md is there now"]


def test_a_capture_is_stale_once_a_source_it_quotes_changes(tmp_path):
    """A tool's output names our files by line (valgrind's `mlp.c:296`); the capture records those files' hashes, and
    a chapter showing it is stale once one changes (as if mlp.c had changed since: its recorded hash is altered)."""
    capture = tmp_path / "leak.txt"
    book.write_capture(capture, "==1==    by 0x10AE7D: mlp_set_data (mlp.c:296)\nat cuda_mlp.cuh:547\n",
                       ["tests/check_memory.c"])
    sources = json.loads((tmp_path / book.SOURCES).read_text())["leak.txt"]
    assert set(sources) == {"level4_c/mlp.c", "common/native/cuda_mlp.cuh", "tests/check_memory.c"}
    assert book.capture_stale(capture) == []
    (tmp_path / book.SOURCES).write_text(json.dumps({"leak.txt": {**sources, "level4_c/mlp.c": "0" * 16}}))
    assert book.capture_stale(capture) == [f"{capture} quotes level4_c/mlp.c, which changed since it was captured"]


def test_every_committed_capture_quotes_the_current_sources():
    """Every capture with a record (results/**/sources.json) was taken from the sources as they are now."""
    if (ROOT / MARKER).exists():
        pytest.skip("the student edition has no results/")
    captures = [record.parent / name for record in ROOT.glob("results/**/" + book.SOURCES)
                for name in json.loads(record.read_text())]
    assert captures, "no capture records its sources"
    stale = [why for capture in captures for why in book.capture_stale(capture)]
    assert not stale, "; ".join(stale) + ": capture them again (common/book/capture_memory.py, common/book/capture_debugging.py)"


# ---- the numbers the answers quote (common/book/cited.py) ----

def answer_files() -> list[Path]:
    if (ROOT / MARKER).exists():
        pytest.skip("the student edition has no answers/: they are the teacher's")
    return sorted((ROOT / "answers").glob("*.md"))


def test_every_number_an_answer_quotes_is_what_its_source_says():
    """A result measured again, or a chapter made again, leaves no answer quoting its old number
    (python -m common.book.cited --refresh writes them again)."""
    problems = [problem for path in answer_files() for problem in cited.check(path)]
    assert not problems, "\n".join(problems)


COMMITTED_TIME = re.compile(r"(?<![\w.,])(" + cited.NUMBER + r")(?:%(?!<!--)| µs| GFLOP/s)")


def test_a_committed_number_in_an_answer_names_its_source():
    """In a paragraph that calls its numbers committed, every time, rate and percentage carries its source: a number
    copied by hand would not follow its result."""
    uncited = []
    for path in answer_files():
        text = path.read_text()  # a paragraph, or one row of a table (its other rows may be a student's own runs)
        for paragraph in re.split(r"\n\n|\n(?=\|)", text):
            if "committed" in paragraph.lower():
                bare = COMMITTED_TIME.findall(re.sub(r"\$[^$]*\$|`[^`]*`", "", paragraph))
                uncited += [f"{path.name}: {number} in: {paragraph[:80]}..." for number in bare]
    assert not uncited, "\n".join(uncited)


def test_the_quote_checker_finds_a_number_its_source_no_longer_says(tmp_path):
    """Sharpness: one number of the source changed is found; --refresh writes it again in the quote's own format."""
    (tmp_path / "r.json").write_text(json.dumps({"table": [{"level": "level6[cuda]", "us": 1234.56}]}))
    (tmp_path / "cap.txt").write_text("  grid of 16 blocks   1.436\n")
    answer = tmp_path / "a.md"
    answer.write_text("took 1,234.6<!-- r.json: table[level=level6[cuda]].us --> µs, "
                      "a round 1.44<!-- cap.txt: /grid of 16 blocks +([\\d.]+)/ --> µs, 99<!-- r.json: x.y -->\n")
    assert [p.split(": ")[-1] for p in cited.check(answer, tmp_path)] == ["'x'"]
    (tmp_path / "r.json").write_text(json.dumps({"table": [{"level": "level6[cuda]", "us": 987.0}], "x": {"y": 99}}))
    assert [p.rsplit(": ", 1)[-1] for p in cited.check(answer, tmp_path)] == ["the source says 987.0"]
    assert cited.refresh(answer, tmp_path) == 1 and cited.check(answer, tmp_path) == []
    assert answer.read_text().startswith("took 987.0<!--")
