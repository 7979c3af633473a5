"""The numbers the answers quote from committed results: each one marked with its source, and checked against it.

A quoted number is followed by an HTML comment naming where it comes from (GitHub's page does not show it):

    level 6 took 87.9<!-- results/h100/chapter/results.json: table[level=level6[cuda]].us_per_step --> µs a step

The source is either a JSON file and a path into it, or any other file and a regular expression between slashes
whose first group is the number. A path into JSON has keys and list indices, `name[key=value]` for the one list item
whose key has that value (`[a=1&b=2]`: several keys), `*100` at its end for a percentage, and `A / B` for the ratio of
two numbers of the file. A text source is a capture (`results/h100/level7_floors.txt`), a table, or a chapter, whose
outputs are searched (`level1_pytorch/chapter.ipynb: /^ +8 +(\\d+)/`). A quote must be what its source says, written
as the quote is: as many decimals, and the same thousands separators.

    python -m common.book.cited            # check every answer; exit status 1 where a quote differs from its source
    python -m common.book.cited --refresh  # write each quoted number again from its source, in the same format

A result measured again changes the answers with it (--refresh); the tests fail on a quote left behind.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ANSWERS = ROOT / "answers"
NUMBER = r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?"
CITATION = re.compile(rf"(?P<number>{NUMBER})[%×x]?<!-- (?P<source>[^:\s]+): (?P<where>.*?) -->")
_STEP = re.compile(r"^(?P<key>[^\[\]]*)(?:\[(?P<where>\w+=.*)\])?$")


@dataclass
class Quote:
    """One marked number of an answer: where it stands, what it says, and its source."""

    file: Path
    line: int
    number: str
    source: str
    where: str

    def __str__(self) -> str:
        name = self.file.relative_to(ROOT) if self.file.is_relative_to(ROOT) else self.file
        return f"{name}:{self.line}: {self.number} <- {self.source}: {self.where}"


def quotes(path: Path) -> list[Quote]:
    """Every marked number of a Markdown file, in order."""
    text = path.read_text()
    return [Quote(path, text.count("\n", 0, m.start()) + 1, m["number"], m["source"], m["where"])
            for m in CITATION.finditer(text)]


def _json_steps(where: str) -> list[str]:
    """'table[level=level6[cuda]].us_per_step' -> ['table[level=level6[cuda]]', 'us_per_step']: dots inside [] kept."""
    steps, depth, start = [], 0, 0
    for i, ch in enumerate(where):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "." and depth == 0:
            steps.append(where[start:i])
            start = i + 1
    return steps + [where[start:]]


def _from_json(data, where: str) -> float:
    if " / " in where:  # a ratio of two numbers of the same file
        over, under = where.split(" / ", 1)
        return _from_json(data, over) / _from_json(data, under)
    scale = 1.0
    if m := re.fullmatch(r"(.*)\*(\d+)", where):
        where, scale = m[1], float(m[2])
    for step in _json_steps(where):
        if isinstance(data, dict) and step in data:  # a key as it is, brackets and digits too: 'level7[fused]', '1'
            data = data[step]
            continue
        m = _STEP.match(step)
        if m is None:
            raise ValueError(f"cannot read {step!r}")
        if m["key"]:
            data = data[int(m["key"])] if isinstance(data, list) else data[m["key"]]
        if m["where"]:  # the one list item whose fields have these values: [level=level6[cuda]&batch=8]
            wanted = dict(condition.split("=", 1) for condition in m["where"].split("&"))
            found = [item for item in data if all(str(item.get(k)) == v for k, v in wanted.items())]
            if len(found) != 1:
                raise ValueError(f"{len(found)} items with {m['where']}, not one")
            data = found[0]
    if not isinstance(data, (int, float)) or isinstance(data, bool):
        raise ValueError(f"{where!r} is {data!r}, not a number")
    return float(data) * scale


def notebook_outputs(path: Path) -> str:
    """A chapter's outputs as text, cell after cell: what a reader of the chapter sees printed."""
    parts = []
    for cell in json.loads(path.read_text())["cells"]:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            parts.append("".join(output.get("text", "") or data.get("text/markdown", "") or data.get("text/plain", "")))
    return "\n".join(parts)


def _from_text(text: str, where: str) -> float:
    if not (where.startswith("/") and where.endswith("/") and len(where) > 2):
        raise ValueError(f"{where!r}: a regular expression between slashes")
    m = re.search(where[1:-1], text, re.M)
    if m is None or not m.groups():
        raise ValueError(f"{where} matches nothing (or has no group)")
    return float(m[1].replace(",", ""))


def source_value(source: str, where: str, root: Path = ROOT) -> float:
    """The number a source holds at `where`; ValueError naming the problem where it holds none."""
    path = root / source
    if not path.is_file():
        raise ValueError(f"{source}: no such file")
    if path.suffix == ".json":
        return _from_json(json.loads(path.read_text()), where)
    return _from_text(notebook_outputs(path) if path.suffix == ".ipynb" else path.read_text(), where)


def written_like(value: float, quoted: str) -> str:
    """The value written as the quote is: as many decimals, thousands separated where the quote separates them."""
    decimals = len(quoted.split(".")[1]) if "." in quoted else 0
    separated = "," in quoted or abs(float(quoted)) < 1000  # 983 may become 1,326; 1326 stays unseparated
    return f"{value:,.{decimals}f}" if separated else f"{value:.{decimals}f}"


def check(path: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with a file's quotes: a quote its source no longer says, or a source that holds no number."""
    problems = []
    for q in quotes(path):
        try:
            expected = written_like(source_value(q.source, q.where, root), q.number)
        except (ValueError, KeyError, IndexError, TypeError) as e:
            problems.append(f"{q}: {e}")
            continue
        if expected != q.number:
            problems.append(f"{q}: the source says {expected}")
    return problems


def refresh(path: Path, root: Path = ROOT) -> int:
    """Write every quoted number of a file again from its source; how many changed."""
    changed = 0

    def again(m: re.Match) -> str:
        nonlocal changed
        new = written_like(source_value(m["source"], m["where"], root), m["number"])
        changed += new != m["number"]
        return m.group(0).replace(m["number"], new, 1)

    text = path.read_text()
    path.write_text(CITATION.sub(again, text))
    return changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Check (or refresh) the numbers the answers quote from committed results.")
    p.add_argument("files", nargs="*", type=Path, help="Markdown files (default: answers/*.md)")
    p.add_argument("--refresh", action="store_true", help="write each quoted number again from its source")
    args = p.parse_args(argv)
    files = [f.resolve() for f in args.files] or sorted(ANSWERS.glob("*.md"))
    if args.refresh:
        for f in files:
            if n := refresh(f):
                print(f"{f.relative_to(ROOT)}: {n} number(s) written again; read the sentences around them")
        return 0
    problems = [problem for f in files for problem in check(f)]
    print("\n".join(problems) or f"{sum(len(quotes(f)) for f in files)} quoted numbers, each as its source says")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
