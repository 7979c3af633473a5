"""A class's grades in one command: every submission graded in its own sandbox, one CSV, a summary and a plot
(LABS.md).

    make gradebook SUBMISSIONS=dir [JOBS=2] [LEVEL=3 | TASK=3.1]
    python -m common.classroom.gradebook dir [--out gradebook] [--jobs 2] [--level 3 | --task 3.1] [--timeout 1800]
        [--trust-submissions]

`dir` holds one folder per student (named for the student): a copy of their edition, or a clone of their
repository. Of each, only the code between the markers of the files a student writes in (python -m
common.classroom.lab --files) is taken, into a fresh copy of the edition made here: plain files, opened without
following any link, or, where the working tree lacks one, the file of the repository's last commit, which git reads
in a sandbox holding that repository and nothing else. The checks are this repository's, the held-out ones included.
Each submission is read and graded by `python -m common.classroom.grade --submission` in a process of its own,
several at once, with a time limit for the whole of it; every piece of its code runs in a bubblewrap sandbox
(common/classroom/bwrap.py, common/classroom/sandbox.py) that sees its own copy and nothing else of this machine. A
submission that hangs, crashes or attacks gets zero for what it broke, and the gradebook goes on. Without bubblewrap
it refuses to run, unless --trust-submissions.

A folder's name is data, never a path: whatever it holds (bytes that are not UTF-8, 255 of them, a formula), the
gradebook's own files are named by key(), and grades.csv holds it escaped. Whatever goes wrong with one entry of
`dir` (a link, a file, a folder that cannot be read) is that student's row of zeros, with a note that says what.

Writes to --out, after every grade has ended: grades.csv (student, task, name, points, max_points, status, note),
summary.md (the score distribution, each task's pass rate, and what protected the grades), summary.png, and each
student's grade as json/<key>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import errno
import hashlib
import io
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from common.classroom import bwrap, lab, sandbox
from common.levels import ROOT

MAX_FILE_BYTES = 4 << 20  # a student's source file larger than this is not taken (and the task is not attempted)
GIT_TIMEOUT_S = 120  # for git's read of a repository's last commit, within the submission's own time limit
GIT_ENV = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_NO_REPLACE_OBJECTS": "1",
           "GIT_ATTR_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0"}
# A repository's own configuration may name programs to run: none runs, and its owner need not be this user.
GIT_OPTIONS = ["-c", "safe.directory=*", "-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null"]


DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW  # a folder opened as itself, never through a link


def plain_file(folder: Path, name: str) -> bytes | str | None:
    """The file `name` under folder, as bytes; None where there is none; why it is not taken where it is not a plain
    file of the folder's own (a link, in a linked folder, a hard link to a file elsewhere, a device, a pipe) or is too
    large. No link is followed: every folder on the way and the file are opened with O_NOFOLLOW, and the file is what
    was looked at."""
    *folders, last = name.split("/")
    try:
        fd = os.open(folder, DIRECTORY)
    except OSError as e:
        return f"its folder cannot be opened ({e.strerror})"
    try:
        for part in folders:
            fd, parent = os.open(part, DIRECTORY, dir_fd=fd), fd
            os.close(parent)
        seen = os.stat(last, dir_fd=fd, follow_symlinks=False)
        if not stat.S_ISREG(seen.st_mode):
            return "a link, or not a plain file: not followed" if stat.S_ISLNK(seen.st_mode) else "not a plain file"
        file = os.open(last, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY, dir_fd=fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        return "in a linked folder: not followed" if e.errno in (errno.ELOOP, errno.ENOTDIR) else e.strerror
    finally:
        os.close(fd)
    try:
        info = os.fstat(file)
        if (info.st_ino, info.st_dev) != (seen.st_ino, seen.st_dev) or not stat.S_ISREG(info.st_mode):
            return "changed while it was read: not taken"
        # A file of several names (hard links) is taken where all of them are in the folder: then it holds nothing
        # that a copy there would not. A name elsewhere makes it another file too (another student's, the teacher's):
        # linked in by whoever could write the class's folder, perhaps a file they could not read themselves (where
        # fs.protected_hardlinks is off), and it may change through that name while the class is graded. st_nlink
        # counts every name and a search of the folder finds those in it, so the count is exact; the search is made
        # for such a file only.
        if info.st_nlink > 1 and names_inside(folder, info) < info.st_nlink:
            return "a hard link with a name outside its folder: not taken (copy a class with cp -a, not cp -al)"
        data = os.read(file, MAX_FILE_BYTES + 1)
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    finally:
        os.close(file)
    return data if len(data) <= MAX_FILE_BYTES else f"larger than {MAX_FILE_BYTES >> 20} MiB: not taken"


def names_inside(folder: Path, file: os.stat_result) -> int:
    """How many of a file's names are under folder, counted until all are found."""
    found = 0
    with contextlib.closing(walk(folder)) as entries:
        for _, info in entries:
            found += (info.st_ino, info.st_dev) == (file.st_ino, file.st_dev)
            if found == file.st_nlink:
                break
    return found


def walk(folder: Path) -> Iterator[tuple[str, os.stat_result]]:
    """Every entry under folder, depth first: its path in folder and what it is (lstat). No link is followed: each
    folder is opened by its name in the one above it, with O_NOFOLLOW, and is kept open while it is read."""
    stack = [("", *listing(str(folder), None))]
    try:
        while stack:
            path, fd, entries = stack[-1]
            entry = next(entries, None)
            if entry is None:
                stack.pop()
                entries.close()
                os.close(fd)
                continue
            info = entry.stat(follow_symlinks=False)
            yield path + entry.name, info
            if stat.S_ISDIR(info.st_mode):
                stack.append((f"{path}{entry.name}/", *listing(entry.name, fd)))
    finally:
        for _, fd, entries in stack:
            entries.close()
            os.close(fd)


def listing(name: str, parent: int | None) -> tuple[int, Iterator[os.DirEntry]]:
    """A folder opened as itself (in parent, where given) and its entries."""
    fd = os.open(name, DIRECTORY, dir_fd=parent)
    try:
        return fd, os.scandir(fd)
    except OSError:
        os.close(fd)
        raise


def special_file(folder: Path) -> str | None:
    """The first entry under folder that is neither a folder, a plain file nor a link (a pipe, a socket, a device)."""
    with contextlib.closing(walk(folder)) as entries:
        return next((path for path, info in entries
                     if not (stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode))),
                    None)


def committed_files(submission: Path, deadline: float) -> dict[str, bytes] | str:
    """The files of the last commit of a submission's repository: git reads its .git folder in a sandbox that holds
    that folder and nothing else of this machine, so that nothing in it (a gitdir or an alternates file pointing at
    another repository, hooks, configuration) reaches past it, and stops by the submission's deadline. A .git that is a
    file or a link is not read, nor one that holds a pipe or a device, which git would wait on."""
    git = submission / ".git"
    if git.is_symlink() or not git.is_dir():
        return "its .git is a file or a link, which could name another repository: not read" if git.is_symlink() or \
            git.exists() else {}
    try:
        special = special_file(git)
    except OSError as e:
        return f"its .git cannot be read ({e.strerror})"
    if special:
        return f"its .git holds {special}, which is not a plain file (git would wait on a pipe): not read"
    where = str(git.resolve()) if bwrap.trusted() else "/repository"
    seconds = max(min(GIT_TIMEOUT_S, deadline - time.monotonic()), 0)
    ran = bwrap.run(["git", *GIT_OPTIONS, f"--git-dir={where}", "archive", "--format=tar", "HEAD"], None, bwrap.READER,
                    seconds, env=GIT_ENV, mounts=((git, "/repository"),), limit=256 << 20, stderr=False)
    if ran.status is None:
        return f"git did not read its last commit within {seconds:.0f} s: not read"
    if ran.status != 0 or ran.overflowed:
        return f"git could not read its last commit (exit status {ran.status}{', over 256 MiB' * ran.overflowed})"
    wanted, found = set(lab.files_to_write()), {}
    try:
        with tarfile.open(fileobj=io.BytesIO(ran.output), mode="r:") as tar:
            for member in tar:
                if member.name in wanted and member.isreg() and member.size <= MAX_FILE_BYTES:
                    found.setdefault(member.name, tar.extractfile(member).read())
    except (tarfile.TarError, EOFError, OSError) as e:
        return f"its last commit could not be read ({e})"
    return found


def student_files(submission: Path, deadline: float) -> tuple[dict[str, bytes], dict[str, str]]:
    """The files a student writes in, from their folder or, where its working tree lacks one, their repository's last
    commit (read by the deadline); and, by file, why one was not taken."""
    found, notes, committed = {}, {}, None
    for name in lab.files_to_write():
        data = plain_file(submission, name)
        if data is None:
            committed = committed_files(submission, deadline) if committed is None else committed
            data = committed.get(name) if isinstance(committed, dict) else committed
        if isinstance(data, bytes):
            found[name] = data
        elif data is not None:
            notes[name] = f"{name}: {data}"
    return found, notes


def sandbox_for(edition: Path, submission: Path, folder: Path, deadline: float) -> tuple[Path, dict[str, str]]:
    """A fresh copy of the edition at folder with the student's code in it (the code between the markers of each file:
    the rest is the edition's), and why any file was not taken. What the student's code runs in, and sees at /lab."""
    shutil.copytree(edition, folder, symlinks=True)
    files, notes = student_files(submission, deadline)
    for name, data in files.items():
        try:
            text = data.decode()
        except UnicodeDecodeError:
            notes[name] = f"{name}: not UTF-8 text: not taken"
            continue
        spliced, problems = lab.splice(text, (edition / name).read_text(), lab.language(name))
        (folder / name).write_text(spliced)
        if problems:
            notes[name] = f"{name}: {'; '.join(problems)}"
    for path in (folder, *folder.rglob("*")):  # the sandbox's user reads it (where the grade runs as root)
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() else 0o644)
    return folder, notes


@dataclass(frozen=True)
class Grading:
    """How each student of a class is graded."""

    edition: Path  # the fresh edition that each student's copy starts from
    work: Path  # where the copies are made
    out: Path  # the gradebook's folder
    options: tuple[str, ...]  # common.classroom.grade's --level or --task
    tasks: tuple[lab.Task, ...]  # the tasks they select
    timeout: float  # seconds for a student's whole grade, their folder's reading included


def students(folder: Path) -> list[Path]:
    """The entries of a class's folder, hidden files aside (a file manager's .DS_Store): each gets a row."""
    return sorted(e for e in folder.iterdir() if not (e.name.startswith(".") and stat.S_ISREG(e.lstat().st_mode)))


def not_a_folder(entry: Path) -> str | None:
    """Why an entry of the class's folder is not graded; None for a folder."""
    mode = entry.lstat().st_mode
    if stat.S_ISDIR(mode):
        return None
    if stat.S_ISLNK(mode):
        return "a link, not a folder: not followed (put the student's folder itself there)"
    return "not a folder: a submission is a folder (unpack an archive first)"


def grade_student(entry: Path, grading: Grading) -> dict:
    """One entry's grade, its folder's reading and its grade within the time limit; whatever goes wrong (no folder, a
    name no file may have, the gradebook's own error) is this student's grade of zero, which says what happened."""
    deadline = time.monotonic() + grading.timeout
    try:
        if why := not_a_folder(entry):
            return failed(grading.tasks, why)
        name = key(entry.name)
        folder, notes = sandbox_for(grading.edition, entry, grading.work / name, deadline)
        grade = grade_one(folder, name, grading, deadline)
    except Exception as e:  # noqa: BLE001 - one folder's surprise is its own row; the class's grades are written
        return failed(grading.tasks, f"the gradebook could not grade this folder ({type(e).__name__}: {e})")
    for t in grade["tasks"]:  # why a file's code was not taken
        if (path := lab.task(t["id"]).path) in notes and not t["note"]:
            t["note"] = notes[path]
    return grade


def grade_one(folder: Path, name: str, grading: Grading, deadline: float) -> dict:
    """One submission's grade, by common.classroom.grade in a process of its own, stopped at the deadline; its json and
    log are named name. On a time-out or a crash, zero for all."""
    json_path = grading.out / "json" / f"{name}.json"
    command = [sys.executable, "-m", "common.classroom.grade", "--submission", str(folder), "--json", str(json_path),
               *grading.options]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        output = process.communicate(timeout=max(deadline - time.monotonic(), 0))[0].decode(errors="replace")
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # its sandboxes end with it (bwrap --die-with-parent)
        process.wait()
        return failed(grading.tasks, f"the grade took longer than {grading.timeout:.0f} s and was stopped")
    (grading.out / "logs" / f"{name}.txt").write_text(output)
    try:
        return json.loads(json_path.read_text())
    except (OSError, json.JSONDecodeError):
        return failed(grading.tasks, f"the grade did not finish (exit status {process.returncode}; logs/{name}.txt)")


def failed(tasks: tuple[lab.Task, ...], why: str) -> dict:
    """A grade of zero for every task, and why."""
    return {"score": 0, "points": sum(t.points for t in tasks),
            "tasks": [{"id": t.id, "level": t.level, "name": t.name, "points": t.points, "earned": 0, "status": "FAIL",
                       "note": why} for t in tasks]}


# ---- a student's name: data, never a path ----

PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a folder's name that can name the gradebook's files


def key(name: str) -> str:
    """What names a student's files in the gradebook (json/, logs/, their copy): the folder's name where it is plain
    and short, else a readable part of it and a hash of all of it, joined by "~", which no plain name holds."""
    if PLAIN_NAME.fullmatch(name):
        return name
    raw = os.fsencode(name)
    return re.sub(rb"[^A-Za-z0-9._-]", b"_", raw[:40]).decode() + "~" + hashlib.sha256(raw).hexdigest()[:12]


def escape(name: str) -> str:
    """A folder's name as text that gives it back exactly: a byte that is not UTF-8 as \\xNN, a control character
    (a line break, a tab) as \\uNNNN, a backslash as two."""
    text = os.fsencode(name).replace(b"\\", b"\\\\").decode(errors="backslashreplace")
    return re.sub(r"[\x00-\x1f\x7f-\x9f]", lambda c: f"\\u{ord(c[0]):04x}", text)


FORMULA = ("=", "+", "-", "@", "\t", "\r")  # what makes a spreadsheet read a cell as a formula (OWASP's list)


def cell(text: str) -> str:
    """A CSV cell that a spreadsheet shows as text: one that would start a formula starts with ' (OWASP's advice
    against CSV injection), and so does one that starts with ', so that a reader can take it off again."""
    return "'" + text if text.startswith((*FORMULA, "'")) else text


def write_csv(grades: dict[str, dict], path: Path) -> None:
    """grades.csv: a row per student and task, the student's folder name escaped; every text a spreadsheet's text."""
    # backslashreplace: a note may quote a path that is not UTF-8, and no note may stop the class's grades
    with path.open("w", newline="", encoding="utf-8", errors="backslashreplace") as f:
        out = csv.writer(f)
        out.writerow(["student", "task", "name", "points", "max_points", "status", "note"])
        for student, grade in grades.items():
            for t in grade["tasks"]:
                out.writerow([cell(escape(student)), t["id"], cell(t["name"]), t["earned"], t["points"], t["status"],
                              cell(t["note"])])


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
    """The score distribution and the pass rate of each task graded here (one ungraded everywhere is left out, not
    drawn as 0%)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [1, 2]})
    left.hist([g["score"] for g in grades.values()], bins=20, color="#1f77b4")
    left.yaxis.set_major_locator(MaxNLocator(integer=True))  # a count of students
    left.set(xlabel="score", ylabel="students", title="Scores")
    ids, rates = [], []
    for t in lab.TASKS:
        statuses = [x["status"] for g in grades.values() for x in g["tasks"] if x["id"] == t.id]
        graded = [s for s in statuses if s != "needs GPU"]
        if graded:
            ids.append(t.id)
            rates.append(sum(s == "pass" for s in graded) / len(graded))
    right.bar(range(len(ids)), rates, color="#2ca02c")
    right.set_xticks(range(len(ids)), ids, rotation=90, fontsize=7)
    right.set(ylabel="pass rate", ylim=(0, 1), title="Each task's pass rate (of the submissions graded here)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def protection(timeout: float) -> str:
    """What protected the grades: the sandbox, its limits, the time limits."""
    return (f"{bwrap.describe()}\n- time: {sandbox.CALL_TIMEOUT_S:.0f} s per call of a student's code (its whole "
            f"answer, of at most {sandbox.ANSWER_BYTES >> 20} MiB more than the call's arguments), "
            f"{sandbox.BUILD_TIMEOUT_S} s per build, {timeout:.0f} s per submission's whole grade\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("submissions", type=Path, help="a folder of submissions, one folder per student")
    p.add_argument("--out", type=Path, default=ROOT / "gradebook", help="where the gradebook goes (replaced)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="submissions graded at once")
    p.add_argument("--level", type=int, help="grade one level's tasks only")
    p.add_argument("--task", help="grade one task only, e.g. 3.1")
    p.add_argument("--timeout", type=float, default=1800,
                   help="seconds for one submission's whole grade, the reading of its folder included")
    p.add_argument("--trust-submissions", action="store_true",
                   help="run the students' code without a sandbox, as this user: only for code you trust (your own)")
    args = p.parse_args(argv)
    if args.trust_submissions:
        os.environ[bwrap.TRUST_ENV] = "1"  # the grades' processes inherit it
    elif why := bwrap.problem():
        raise SystemExit(f"make gradebook: {why}")
    if not (tasks := lab.select(args.level, args.task)):
        raise SystemExit(f"no task matches; tasks are {', '.join(t.id for t in lab.TASKS)}")
    entries = students(args.submissions.resolve())
    if not entries:
        raise SystemExit(f"no submissions in {args.submissions}: one folder per student")
    out = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    for folder in ("json", "logs"):
        (out / folder).mkdir(parents=True)
    options = (*(["--level", str(args.level)] if args.level is not None else []),
               *(["--task", args.task] if args.task else []))
    with tempfile.TemporaryDirectory(prefix="gradebook-") as scratch:
        grading = Grading(Path(scratch) / "edition", Path(scratch) / "work", out, options, tuple(tasks), args.timeout)
        lab.write_edition(grading.edition, commit=False)
        grading.work.mkdir()
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # each reads its folder too, in its own time
            grades = dict(zip((e.name for e in entries), pool.map(lambda e: grade_student(e, grading), entries)))
        seconds = time.perf_counter() - start
    write_csv(grades, out / "grades.csv")
    text = (summary(grades) + f"\nGraded in {seconds:.0f} s, {args.jobs} at a time, on {os.cpu_count()} cores.\n\n"
            + protection(args.timeout))
    (out / "summary.md").write_text(text)
    plot(grades, out / "summary.png")
    print(text + f"\nwrote {out}/grades.csv, summary.md, summary.png and json/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
