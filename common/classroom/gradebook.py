"""A class's grades in one command: every submission graded in isolation, one CSV, a summary and a plot (LABS.md).

    make gradebook SUBMISSIONS=dir [JOBS=2] [LEVEL=3]
    python -m common.classroom.gradebook dir [--out gradebook] [--jobs 2] [--level 3] [--timeout 1800]

`dir` holds one folder per student (named for the student): a copy of their edition, or a clone of their
repository. Only the files a student writes in (python -m common.classroom.lab --files) are taken from it, without following
links, into a fresh copy of the edition made here; the checks are this repository's, the held-out ones included.
Each submission is graded by `python -m common.classroom.grade --submission` in a process of its own, several at once, with
a time limit for the whole grade and one per call of the student's code (common/classroom/sandbox.py), whose worker cannot
see this repository, the other submissions or the grades. A submission that hangs, crashes or breaks things gets
zero for what it broke, and the gradebook goes on.

Writes to --out: grades.csv (student, task, name, points, max_points, status, note), summary.md (the score
distribution and each task's pass rate), summary.png, and each student's grade as json/<student>.json.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common.classroom import lab, sandbox
from common.levels import ROOT

MAX_FILE_BYTES = 4 << 20  # a student's source file larger than this is not taken (and the task is not attempted)


def student_files(submission: Path) -> dict[str, bytes]:
    """The files a student writes in, from their folder or, where the working tree lacks one, their repository's
    last commit; links are not followed (a link could point at the grader's files)."""
    found = {}
    for name in lab.files_to_write():
        path = submission / name
        if path.is_file() and not path.is_symlink() and not any(p.is_symlink() for p in path.parents
                                                                 if p.is_relative_to(submission)):
            data = path.read_bytes()
        elif (submission / ".git").exists():
            run = subprocess.run(["git", "-C", str(submission), "show", f"HEAD:{name}"], capture_output=True,
                                 timeout=60)
            data = run.stdout if run.returncode == 0 else None
        else:
            data = None
        if data is not None and len(data) <= MAX_FILE_BYTES:
            found[name] = data
    return found


def sandbox_for(edition: Path, submission: Path, work: Path) -> Path:
    """A fresh copy of the edition with the student's files in it: what the student's code runs in."""
    folder = work / submission.name
    shutil.copytree(edition, folder, symlinks=True)
    for name, data in student_files(submission).items():
        (folder / name).write_bytes(data)
    return folder


def grade_one(folder: Path, out: Path, level: int | None, timeout: float, hidden: list[Path]) -> dict:
    """One submission's grade, by common.classroom.grade in a process of its own; on a time-out or a crash, zero for all."""
    json_path = out / "json" / f"{folder.name}.json"
    command = [sys.executable, "-m", "common.classroom.grade", "--submission", str(folder), "--json", str(json_path)]
    command += ["--level", str(level)] if level is not None else []
    env = {**os.environ, sandbox.HIDE_ENV: os.pathsep.join(map(str, hidden))}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        output = process.communicate(timeout=timeout)[0].decode(errors="replace")
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return failed(level, f"the grade took longer than {timeout:.0f} s and was stopped")
    (out / "logs" / f"{folder.name}.txt").write_text(output)
    try:
        return json.loads(json_path.read_text())
    except (OSError, json.JSONDecodeError):
        return failed(level, f"the grade did not finish (exit status {process.returncode}; logs/{folder.name}.txt)")


def failed(level: int | None, why: str) -> dict:
    """A grade of zero for every task, and why."""
    tasks = [t for t in lab.TASKS if level is None or t.level == level]
    return {"score": 0, "points": sum(t.points for t in tasks),
            "tasks": [{"id": t.id, "level": t.level, "name": t.name, "points": t.points, "earned": 0, "status": "FAIL",
                       "note": why} for t in tasks]}


def write_csv(grades: dict[str, dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["student", "task", "name", "points", "max_points", "status", "note"])
        for student, grade in grades.items():
            for t in grade["tasks"]:
                out.writerow([student, t["id"], t["name"], t["earned"], t["points"], t["status"], t["note"]])


def summary(grades: dict[str, dict]) -> str:
    """The score distribution and each task's pass rate, as Markdown."""
    scores = sorted(g["score"] for g in grades.values())
    points = max((g["points"] for g in grades.values()), default=0)
    lines = [f"# Gradebook: {len(grades)} submissions", "",
             f"Scores out of {points}: median {scores[len(scores) // 2] if scores else '-'}, "
             f"lowest {scores[0] if scores else '-'}, highest {scores[-1] if scores else '-'}.", "",
             "| score | students |", "|---:|---:|"]
    step = max(1, points // 10)
    for low in range(0, points + 1, step):
        count = sum(low <= s < low + step or (s == points and low + step > points) for s in scores)
        lines.append(f"| {low}-{min(low + step - 1, points)} | {count} |")
    lines += ["", "| task | name | pass | FAIL | blocked | not attempted | needs GPU | pass rate |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    for t in lab.TASKS:
        statuses = [x["status"] for g in grades.values() for x in g["tasks"] if x["id"] == t.id]
        if not statuses:
            continue
        count = {s: statuses.count(s) for s in ("pass", "FAIL", "blocked", "not attempted", "needs GPU")}
        graded = len(statuses) - count["needs GPU"]
        rate = f"{count['pass'] / graded:.0%}" if graded else "-"
        lines.append(f"| {t.id} | {t.name} | " + " | ".join(str(n) for n in count.values()) + f" | {rate} |")
    return "\n".join(lines) + "\n"


def plot(grades: dict[str, dict], path: Path) -> None:
    """The score distribution and each task's pass rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [1, 2]})
    left.hist([g["score"] for g in grades.values()], bins=20, color="#1f77b4")
    left.set(xlabel="score", ylabel="students", title="Scores")
    ids = [t.id for t in lab.TASKS]
    rates = []
    for task_id in ids:
        statuses = [x["status"] for g in grades.values() for x in g["tasks"] if x["id"] == task_id]
        graded = [s for s in statuses if s != "needs GPU"]
        rates.append(sum(s == "pass" for s in graded) / len(graded) if graded else 0)
    right.bar(range(len(ids)), rates, color="#2ca02c")
    right.set_xticks(range(len(ids)), ids, rotation=90, fontsize=7)
    right.set(ylabel="pass rate", ylim=(0, 1), title="Each task's pass rate (of the submissions graded here)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("submissions", type=Path, help="a folder of submissions, one folder per student")
    p.add_argument("--out", type=Path, default=ROOT / "gradebook", help="where the gradebook goes (replaced)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="submissions graded at once")
    p.add_argument("--level", type=int, help="grade one level's tasks only")
    p.add_argument("--timeout", type=float, default=1800, help="seconds for one submission's whole grade")
    args = p.parse_args(argv)
    submissions = sorted(d.resolve() for d in args.submissions.iterdir() if d.is_dir() and not d.is_symlink())
    if not submissions:
        raise SystemExit(f"no submissions in {args.submissions}: one folder per student")
    out = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    for folder in ("json", "logs"):
        (out / folder).mkdir(parents=True)
    if not sandbox.namespaces_work():
        print("WARNING: this machine allows no user namespace (unshare -rmn), so the students' code runs in its own "
              "process and folder but can read what this user can read, and reach the network (LABS.md).")
    with tempfile.TemporaryDirectory(prefix="gradebook-") as scratch:
        edition, work = Path(scratch) / "edition", Path(scratch) / "work"
        lab.write_edition(edition, commit=False)
        work.mkdir()
        folders = [sandbox_for(edition, s, work) for s in submissions]
        hidden = [args.submissions.resolve(), out, work]  # a worker sees its own folder only
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            grades = dict(zip((f.name for f in folders), pool.map(
                lambda f: grade_one(f, out, args.level, args.timeout, hidden), folders)))
        seconds = time.perf_counter() - start
    write_csv(grades, out / "grades.csv")
    text = summary(grades) + f"\nGraded in {seconds:.0f} s, {args.jobs} at a time, on {os.cpu_count()} cores.\n"
    (out / "summary.md").write_text(text)
    plot(grades, out / "summary.png")
    print(text + f"\nwrote {out}/grades.csv, summary.md, summary.png and json/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
