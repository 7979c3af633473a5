"""The classroom's sandbox, piece by piece (common/classroom/bwrap.py, common/classroom/sandbox.py, common/classroom/gradebook.py's intake, the rules
of common/classroom/lab.py for a task's C and CUDA code): what a sandbox holds and what it refuses, that nothing outlives it, the
limits of the worker's protocol, a memory check's verdict that the checked program cannot forge, submissions taken
without following anything. tests/test_labs.py grades a whole class of hostile submissions with all of it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from common.classroom import bwrap, gradebook, lab, sandbox
from common.levels import ROOT

pytestmark = [pytest.mark.lab,
              pytest.mark.skipif(bwrap.problem() is not None, reason=str(bwrap.problem()))]

# Run in a worker's sandbox: everything it tries, and what came of it.
PROBE = r"""
import ctypes, json, os, socket, sys, threading
sys.path[:0] = ["/lab-python", *sys.argv[1:]]
tried = {}
def attempt(name, action):
    try:
        tried[name] = str(action())
    except BaseException as e:
        tried[name] = type(e).__name__
def fill(folder):
    for i in range(8):
        with open(f"{folder}/fill{i}", "wb") as f:
            for _ in range(60):
                f.write(bytes(1 << 20))
attempt("repository", lambda: os.listdir(sys.argv[1]))
attempt("torch", lambda: __import__("torch"))
attempt("numpy", lambda: __import__("numpy").ones(2).sum())
attempt("write its folder", lambda: open("/lab/planted", "w"))
attempt("write the system", lambda: open("/usr/planted", "w"))
attempt("a large file", lambda: open("/tmp/large", "wb").write(bytes(100 << 20)))
attempt("fill /tmp", lambda: fill("/tmp"))
attempt("network", lambda: socket.create_connection(("1.1.1.1", 53), timeout=2))
attempt("unmount", lambda: ctypes.CDLL(None, use_errno=True).umount2(b"/lab", 2) or ctypes.get_errno())
attempt("fork", os.fork)
attempt("thread", lambda: (lambda t: (t.start(), t.join()))(threading.Thread(target=print)))
tried["uid"], tried["pid"], tried["environment"] = os.getuid(), os.getpid(), sorted(os.environ)
print(json.dumps(tried))
"""


def test_a_sandbox_holds_only_what_it_is_given(tmp_path, monkeypatch):
    """A worker's sandbox: its folder read-only, NumPy but no PyTorch (not even from the paths where it is installed),
    none of this repository, a small /tmp and small files, no network, no unmounting, no process of its own but
    threads, none of the grader's environment, and, where the grade runs as root, a user of its own."""
    monkeypatch.setenv("LAB_PROBE_SECRET", "1")
    tmp_path.chmod(0o755)  # the sandbox's user is not its owner
    site = [str(Path(np.__file__).parent.parent), "/usr/lib/python3/dist-packages"]
    ran = bwrap.run([str(bwrap.interpreter()), "-I", "-S", "-c", PROBE, str(ROOT), *site], tmp_path, bwrap.WORKER, 60)
    assert ran.status == 0, ran.text()
    tried = json.loads(ran.text().splitlines()[-1])
    assert tried["repository"] == "FileNotFoundError" and tried["torch"] == "ModuleNotFoundError", tried
    assert tried["numpy"] == "2.0"
    assert {tried["write its folder"], tried["write the system"]} <= {"OSError", "PermissionError"}, tried
    assert tried["fill /tmp"] == "OSError" and tried["a large file"] == "OSError", tried  # 256 MiB, 64 MiB a file
    assert tried["network"] == "OSError" and tried["unmount"] != "0", tried
    assert tried["fork"] == "PermissionError" and tried["thread"] != "RuntimeError", tried
    assert "LAB_PROBE_SECRET" not in tried["environment"] and tried["pid"] < 10, tried
    assert os.geteuid() != 0 or tried["uid"] >= bwrap.USERS, tried
    assert not (tmp_path / "planted").exists()


def test_nothing_outlives_its_sandbox():
    """A process that leaves its session and ignores SIGTERM ends with its sandbox: stop() ends the PID namespace."""
    box = bwrap.Sandbox(["sh", "-c", "setsid sh -c 'trap \"\" TERM HUP; exec sleep 987651' & echo started; "
                         "exec sleep 987652"], None, bwrap.PROGRAM)
    assert box.output.readline() == b"started\n"
    time.sleep(0.5)

    def sleepers() -> list[int]:
        return [pid for pid in bwrap._pids()
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sleep\x0098765")
                and bwrap._namespace(pid) is not None]

    assert len(sleepers()) == 2 and all(bwrap._namespace(pid) == box.namespace for pid in sleepers())
    box.stop()
    assert not sleepers()


HOSTILE_MODULE = """
import os, struct, sys, time
def fine(x):
    return x + 1
def stall():
    for fd in range(3, 64):
        try:
            os.write(fd, struct.pack("<Q", 1 << 20))
        except OSError:
            pass
    time.sleep(3600)
def oversized():
    for fd in range(3, 64):
        try:
            os.write(fd, struct.pack("<Q", 3 << 30))
        except OSError:
            pass
    time.sleep(3600)
def stop_reading():
    sys.modules["common.classroom.sandbox"].receive = lambda stream: time.sleep(3600)
    return 0
def linear_forward(x, w, b):  # zeroes its inputs: right, if its check computed the answer from them afterwards
    x[:], w[:] = 0, 0
    return b + 0 * x[:, :1]
def sgd_update(params, grads, lr):
    for name in params:
        params[name] -= lr * grads[name]
        grads[name][:] = 0
"""


@pytest.fixture
def hostile_worker(tmp_path):
    """A worker of a folder that holds the grader's common/ and a hostile module; stopped afterwards."""
    tmp_path.chmod(0o755)  # the sandbox's user is not its owner
    shutil.copytree(ROOT / "common", tmp_path / "common", ignore=shutil.ignore_patterns("__pycache__", "figures"))
    (tmp_path / "hostile.py").write_text(HOSTILE_MODULE)
    worker = sandbox.Worker(tmp_path)
    yield worker
    worker.stop()


def call(worker: sandbox.Worker, name: str, *args, timeout: float = 5) -> tuple[object, float]:
    """hostile.name(*args) in the worker: (its result or the WorkerError, seconds)."""
    start = time.perf_counter()
    try:
        result = worker.request("call", timeout, f"hostile.{name}", module="hostile", name=name, args=list(args),
                                kwargs={})["result"]
    except sandbox.WorkerError as e:
        result = e
    return result, time.perf_counter() - start


def test_an_answer_has_a_deadline_and_a_size(hostile_worker):
    """A stalled answer costs one deadline (the whole answer counts, not its first byte), and its function is not
    called again; an answer announced larger than allowed ends the worker before a byte of it is read; a worker that
    stops reading cannot hold the grader's write past the deadline; after each, the next call gets a fresh worker."""
    assert call(hostile_worker, "fine", 1)[0] == 2
    stalled, seconds = call(hostile_worker, "stall")
    assert "no complete answer after 5 s" in str(stalled) and seconds < 8
    again, seconds = call(hostile_worker, "stall")
    assert "not called again" in str(again) and seconds < 1
    assert call(hostile_worker, "fine", 2)[0] == 3
    oversized, seconds = call(hostile_worker, "oversized")
    assert "announced an answer of 3,221,225,472 bytes" in str(oversized) and seconds < 3
    assert call(hostile_worker, "stop_reading")[0] == 0
    blocked, seconds = call(hostile_worker, "fine", np.zeros(16 << 20, np.float32))  # 64 MiB to write
    assert "no complete answer after 5 s" in str(blocked) and seconds < 8
    namespace = hostile_worker.sandbox.namespace if hostile_worker.sandbox else None
    hostile_worker.stop()
    assert namespace is None or not [pid for pid in bwrap._pids() if bwrap._namespace(pid) == namespace]


def test_a_call_changes_only_the_arguments_its_task_updates(hostile_worker):
    """What a function does to its arguments stays in the worker, but the updates its task is for (sgd_update's
    params): a function cannot change the inputs its check computes the right answer from."""
    x, w, b = np.ones((2, 3), np.float32), np.ones((4, 3), np.float32), np.ones(4, np.float32)
    out = sandbox._call(hostile_worker, "call", (x, w, b), {}, 5, module="hostile", name="linear_forward")
    assert out.shape == (2, 4) and x.sum() == 6 and w.sum() == 12
    params, grads = {"w": np.ones(3, np.float32)}, {"w": np.ones(3, np.float32)}
    sandbox._call(hostile_worker, "call", (params, grads, np.float32(0.5)), {}, 5, module="hostile", name="sgd_update")
    assert params["w"].tolist() == [0.5] * 3 and grads["w"].tolist() == [1] * 3


# Level 4 with a leak, and code that runs at load and at exit to pass the memory check anyway: it prints the verdict
# and a clean sanitizer summary, then ends with status 0 before LeakSanitizer's check.
FORGE = """
#include <stdio.h>
#include <unistd.h>
static void forge(void) {
    printf("lab_memory batch: ok\\nSUMMARY: AddressSanitizer: no leaks\\n");
    fflush(stdout);
    _exit(0);
}
__attribute__((constructor)) static void plant(void) { atexit(forge); }
"""


@pytest.mark.skipif(not shutil.which("cc"), reason="the memory check is built with a C compiler")
def test_the_memory_checks_verdict_is_not_what_the_program_prints(tmp_path, monkeypatch):
    """The verdict is the checker's, on a pipe of its own, after LeakSanitizer's check: a leaking submission whose
    code (outside its tasks, which the gradebook would not even take) forges the output and the exit status fails;
    the same code without the leak passes."""
    lab.write_edition(tmp_path / "copy", commit=False)
    monkeypatch.setenv(sandbox.ENV, str(tmp_path / "copy"))
    mlp = (ROOT / "level4_c" / "mlp.c").read_text()
    for leak, passes in ((True, False), (False, True)):
        leaking = mlp.replace("    free(m->x), free(m->y),", "    free(m->y),", 1) if leak else mlp
        (tmp_path / "copy" / "level4_c" / "mlp.c").write_text(leaking + FORGE)
        assert sandbox.build(("build/lab_memory",)) is None
        passed, report = sandbox.memory_check("batch")
        assert passed == passes, report
        assert "lab_memory batch: ok" in report  # what the program printed, not believed
        if leak:
            assert "LeakSanitizer" in report


def test_a_submissions_files_are_taken_without_following_anything(tmp_path):
    """A plain file is taken, and so is one whose hard links are all in the folder; a link, a file in a linked
    folder, a hard link to a file outside the folder, a pipe (which would block a reader) and a file past the size
    limit are not, each with the reason."""
    student = tmp_path / "student"
    (student / "level3_numpy").mkdir(parents=True)
    (student / "level3_numpy" / "mlp.py").write_text("mine")
    (student / "level3_numpy" / "lenet.py").symlink_to(ROOT / "level3_numpy" / "lenet.py")
    (student / "level4_c").symlink_to(ROOT / "level4_c")
    (student / "backup").mkdir()
    os.link(student / "level3_numpy" / "mlp.py", student / "backup" / "mlp.py")
    (student / "linked").symlink_to(tmp_path)  # a name found through it would be outside: it is not followed
    os.link(student / "level3_numpy" / "mlp.py", tmp_path / "elsewhere")
    (student / "level2_theory").mkdir()
    os.mkfifo(student / "level2_theory" / "backprop.py")
    (student / "common" / "native").mkdir(parents=True)
    (student / "common" / "native" / "cuda_mlp.cuh").write_bytes(b"x" * (gradebook.MAX_FILE_BYTES + 1))
    assert "hard link with a name outside its folder" in gradebook.plain_file(student, "level3_numpy/mlp.py")
    os.unlink(tmp_path / "elsewhere")
    assert os.stat(student / "level3_numpy" / "mlp.py").st_nlink == 2
    assert gradebook.plain_file(student, "level3_numpy/mlp.py") == b"mine"
    assert "link" in gradebook.plain_file(student, "level3_numpy/lenet.py")
    assert "linked folder" in gradebook.plain_file(student, "level4_c/mlp.c")
    assert "not a plain file" in gradebook.plain_file(student, "level2_theory/backprop.py")
    assert "larger than" in gradebook.plain_file(student, "common/native/cuda_mlp.cuh")
    assert gradebook.plain_file(student, "level5_cuda_naive/mlp.cu") is None


def git(folder: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=s", "-c", "user.email=s@s", *args], cwd=folder, check=True,
                   capture_output=True)


def test_a_repositorys_last_commit_is_read_in_a_sandbox(tmp_path):
    """Where the working tree lacks a file, the last commit's is taken: read by git in a sandbox that holds that
    repository alone, so that its configuration runs nothing here; a committed link is not taken, and a .git that is
    a file (which can name any repository) is not read."""
    student = tmp_path / "student"
    (student / "level3_numpy").mkdir(parents=True)
    (student / "level3_numpy" / "mlp.py").write_text("committed")
    (student / "level3_numpy" / "lenet.py").symlink_to(ROOT / "level3_numpy" / "lenet.py")
    git(student, "init", "-q")
    git(student, "add", "-A")
    git(student, "commit", "-q", "-m", "mine")
    git(student, "config", "core.fsmonitor", f"touch {tmp_path / 'ran'}")
    shutil.rmtree(student / "level3_numpy")
    files, notes = gradebook.student_files(student, time.monotonic() + 120)
    assert files == {"level3_numpy/mlp.py": b"committed"} and not notes, (files, notes)
    assert not (tmp_path / "ran").exists()
    (tmp_path / "redirect").mkdir()
    (tmp_path / "redirect" / ".git").write_text(f"gitdir: {student / '.git'}\n")
    files, notes = gradebook.student_files(tmp_path / "redirect", time.monotonic() + 120)
    assert not files and "a file or a link" in notes["level3_numpy/mlp.py"]


def test_a_repository_that_would_make_git_wait_is_not_read(tmp_path, monkeypatch):
    """A pipe where .git/HEAD should be, which git would wait on forever: it is refused before git runs; and where
    nothing refused it, git's read stops at the submission's deadline."""
    student = tmp_path / "student"
    (student / ".git").mkdir(parents=True)
    os.mkfifo(student / ".git" / "HEAD")
    start = time.monotonic()
    assert "holds HEAD, which is not a plain file" in gradebook.committed_files(student, start + 120)
    assert time.monotonic() - start < 5
    monkeypatch.setattr(gradebook, "special_file", lambda folder: None)
    start = time.monotonic()
    assert "did not read its last commit within 3 s" in gradebook.committed_files(student, start + 3)
    assert time.monotonic() - start < 30  # the deadline, and the sandbox's start and end


def test_a_folders_name_is_data_never_a_path():
    """A plain name names the student's files as it is; any other (255 bytes, not UTF-8, a formula, a line break) by a
    short plain key that no plain name has, one per name. In grades.csv a name comes back exactly, escaped, and a
    spreadsheet reads it as text."""
    names = ["alice", "b" * 255, "b" * 254 + "c", os.fsdecode(b"caf\xe9"), "café", "caf\\xe9", "=1+2", "'=1+2",
             "a\nb", "bob~0123456789ab"]
    keys = [gradebook.key(name) for name in names]
    assert keys[0] == "alice" and len(set(keys)) == len(names)
    assert all(re.fullmatch(r"[A-Za-z0-9._~-]{1,64}", k) for k in keys), keys
    assert all("~" in k for k in keys[1:])
    escaped = [gradebook.cell(gradebook.escape(name)) for name in names]
    assert escaped[3:] == ["caf\\xe9", "café", "caf\\\\xe9", "'=1+2", "''=1+2", "a\\u000ab", "bob~0123456789ab"]
    assert gradebook.cell("-1 (a note)") == "'-1 (a note)" and gradebook.cell("@SUM(A1)") == "'@SUM(A1)"


def test_whatever_goes_wrong_with_a_folder_is_its_own_row(tmp_path):
    """An error of the gradebook's own while it grades one folder is that student's grade of zero, which says what
    happened; an entry that is not a folder gets one too, and is not followed."""
    tasks = tuple(lab.select(task_id="3.1"))
    grading = gradebook.Grading(tmp_path / "no edition", tmp_path / "work", tmp_path / "book", ("--task", "3.1"),
                                tasks, 60)
    (tmp_path / "class" / "alice").mkdir(parents=True)
    (tmp_path / "class" / "bob").symlink_to(tmp_path / "class" / "alice")
    grade = gradebook.grade_student(tmp_path / "class" / "alice", grading)
    assert grade["score"] == 0 and "could not grade this folder (FileNotFoundError" in grade["tasks"][0]["note"]
    grade = gradebook.grade_student(tmp_path / "class" / "bob", grading)
    assert [t["id"] for t in grade["tasks"]] == ["3.1"] and "a link, not a folder" in grade["tasks"][0]["note"]


def test_only_the_code_between_the_markers_is_taken():
    """A submitted file's code outside its tasks (an import, a changed helper) is the edition's again; a region it
    lacks stays a stub, and says so; a file whose markers are out of place gives nothing."""
    given = lab.strip((ROOT / "level3_numpy" / "mlp.py").read_text(), "python")
    mine = (ROOT / "level3_numpy" / "mlp.py").read_text()
    start = mine.index("    # BEGIN LAB 3.3 relu_forward\n")
    without = mine[:start] + mine[mine.index("    # END LAB\n", start) + len("    # END LAB\n"):]
    spliced, missing = lab.splice("import torch\n" + without, given, "python")
    assert "import torch" not in spliced and spliced.count("return x @ w.T + b") == 1
    assert [m for m in missing if "3.3" in m] and 'raise NotImplementedError("lab 3.3' in spliced
    broken, missing = lab.splice(mine.replace("    # BEGIN LAB 3.3 relu_forward\n", "", 1), given, "python")
    assert broken == given and "out of place" in missing[0]


@pytest.mark.parametrize("code, why", [
    ('system ("touch /tmp/x");', "calls system"),
    ("atexit(free);", "calls atexit"),
    ('printf("SUMMARY: AddressSanitizer");', "calls printf"),
    ("return 0;\n}\n__attribute__((constructor)) static void f(void) {\n", "does not close its own bracket"),
    ("#include <cblas.h>\n", "preprocessor"),
    ("%:include <cblas.h>\n", "digraph"),
    ("??=include <cblas.h>\n", "trigraph"),
    ("a = 1; \\\n b = 2;", "backslash"),
    ("cblas_sgemm();", "cblas_sgemm"),
    ('asm("syscall");', "uses asm"),
    ("__lsan_disable();", "reserved"),
    ("void (*p)(int) = _exit; p(0);", "through a pointer"),
    ("void *p = (void *)system;", "names system"),
    ("m->x = (float *)&atexit;", "names atexit"),
    ("((void (*)(void))0x401000)();", "through a pointer"),
    ("m->x(1);", "through a pointer"),
    ("table[0](1);", "through a pointer"),
    ("{ int x = 1;", "open"),
])
def test_a_c_tasks_code_stays_a_function_body(code, why):
    """Level 4's task code may call the level's own functions and C's memory and math functions only, and stays inside
    its function: nothing runs at load or exit, nothing prints a verdict, nothing leaves the process; a banned
    function is refused where it is only named, its address taken."""
    problem = lab.c_problem(code, lab.given_calls("level4_c/mlp.c"))
    assert problem and why in problem, problem
    assert lab.c_problem("m->x = calloc((size_t)R * n, sizeof(float)); if (!m->x) return FAIL(MLP_ERR_ARG, \"x\");"
                         " out[i] = (float)(a * b) + expf(z);", lab.given_calls("level4_c/mlp.c")) is None


def test_cuda_task_code_may_not_end_signal_or_leave_its_process():
    """CUDA's rules: the same body, `#pragma unroll` allowed, no function that ends, signals, starts or loads, not even
    by its address (a host callback would call it)."""
    for code in ('system ("x");', "exit(0);", "std::exit(0);", "::exit(0);", 'dlopen("libcublas.so", 2);',
                 "cudaLaunchHostFunc(0, (cudaHostFn_t)system, 0);", "void *p = (void *)&abort;"):
        assert lab.c_problem(code, None), code
    assert lab.c_problem("#pragma unroll\n    for (int j = 0; j < 4; j++) sum += atomicAdd(p, 1);", None) is None


def test_the_gradebook_refuses_to_run_without_bubblewrap_unless_trusted(tmp_path):
    """Without bwrap, `make gradebook` says how to install it and stops; with --trust-submissions it grades anyway
    (a teacher's own code), and says that no sandbox protected it."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "git").symlink_to(shutil.which("git"))
    student = tmp_path / "subs" / "mine"
    (student / "level3_numpy").mkdir(parents=True)
    shutil.copy(ROOT / "level3_numpy" / "mlp.py", student / "level3_numpy" / "mlp.py")
    # the course's packages as this test finds them (on a machine whose packages live on PYTHONPATH, there too)
    env = {**os.environ, "PATH": str(tmp_path / "bin"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "common.classroom.gradebook", str(tmp_path / "subs"), "--out", str(tmp_path / "book"),
               "--level", "3"]
    refused = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode != 0 and "apt-get install bubblewrap" in refused.stderr, refused.stderr
    assert "--trust-submissions" in refused.stderr and not (tmp_path / "book").exists()
    trusted = subprocess.run(command + ["--trust-submissions"], cwd=ROOT, capture_output=True, text=True, env=env,
                             timeout=600)
    assert trusted.returncode == 0, trusted.stdout[-3000:] + trusted.stderr[-3000:]
    assert "No sandbox (--trust-submissions)" in trusted.stdout
    grade = json.loads((tmp_path / "book" / "json" / "mine.json").read_text())
    assert {t["id"] for t in grade["tasks"] if t["status"] == "pass"} == {
        t.id for t in lab.TASKS if t.path == "level3_numpy/mlp.py"} | {"3.8"}
