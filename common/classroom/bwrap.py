"""The sandbox that every piece of a student's code runs in during a teacher's grade: bubblewrap (`bwrap`, Debian's
and Ubuntu's `bubblewrap` package), the maintained tool that Flatpak's applications run in.

    run(argv, folder, BUILD, timeout=600)            a program in its sandbox, to its end: exit status and output
    Sandbox(argv, folder, WORKER, worker=True)       one that lives on: the grade's worker (common/classroom/sandbox.py)

A sandbox is a new root holding, read-only, the system's programs and libraries (/usr and a few files of /etc), the
interpreter without any installed package, the packages a lab task may use (NumPy and cffi; on a GPU also the CUDA
libraries of the nvidia wheels) under /lab-python, and one folder at /lab (writable for a build only). Its /tmp and
/dev/shm are empty and small. It has no network, its own process, IPC and host-name namespaces, no capability and a
cleared environment; memory, processes, file sizes and time are limited. When its first process ends, the kernel
ends every other process of it: nothing it starts outlives it. PyTorch, JAX, SciPy, a BLAS: none is there to import.

Inside, a bootstrap of a few lines (BOOT) sets the limits and, where the grade runs as root, leaves root for an
unprivileged user of its own (the kernel's process limit does not apply to root, and counts a user's processes in
all sandboxes at once) before any student code runs. A worker also cannot start processes at all: a seccomp filter
lets it start threads only. With --trust-submissions (a teacher grading their own code), the same commands run
without the sandbox (TRUST_ENV).
"""

from __future__ import annotations

import errno
import functools
import glob
import importlib.util
import json
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

TRUST_ENV = "LAB_TRUST_SUBMISSIONS"  # "1": run the students' code without the sandbox (their own code, the teacher's)
FOLDER = "/lab"  # where the sandbox sees the folder it works in
PACKAGES = "/lab-python"  # where it sees the Python packages a task may use
USERS = 1 << 30  # where the grade runs as root, each sandbox runs a student's code as a user of its own from here on
VERDICT_ENV = "LAB_VERDICT_FD"  # the descriptor on which a checking program writes its verdict (run(verdict=True))
INSTALL = ("the classroom's grade runs students' code only inside bubblewrap: install it (Debian and Ubuntu: "
           "`sudo apt-get install bubblewrap`; Fedora: `sudo dnf install bubblewrap`), or, to grade code you trust "
           "(your own), pass --trust-submissions")


@dataclass(frozen=True)
class Limits:
    """What one sandbox may use."""

    memory: int | None  # bytes of address space; None where ASan's or the CUDA driver's reservations need more
    processes: int  # processes and threads of its user (RLIMIT_NPROC)
    file: int  # bytes: the largest file it may write
    disk: int  # bytes of its /tmp (and of its /dev/shm)
    spawn: bool = True  # whether it may start processes (a worker may start threads only)
    student: bool = True  # it runs a student's code: never as root

    def describe(self) -> str:
        memory = f"{self.memory >> 30} GiB of memory" if self.memory else "no memory limit of its own"
        spawn = f"{self.processes} threads and no process" if not self.spawn else f"{self.processes} processes"
        return f"{memory}, {spawn}, files up to {self.file >> 20} MiB, {self.disk >> 20} MiB of /tmp"


WORKER = Limits(memory=6 << 30, processes=64, file=64 << 20, disk=256 << 20, spawn=False)
GPU_WORKER = Limits(memory=None, processes=64, file=64 << 20, disk=256 << 20, spawn=False)  # the driver maps more
PROGRAM = Limits(memory=None, processes=64, file=64 << 20, disk=256 << 20)  # the memory check: ASan reserves terabytes
BUILD = Limits(memory=16 << 30, processes=512, file=256 << 20, disk=2 << 30, student=False)  # compilers only
READER = Limits(memory=2 << 30, processes=16, file=64 << 20, disk=64 << 20, student=False)  # git, on a submission


def trusted() -> bool:
    """Whether this grade runs the students' code without the sandbox (--trust-submissions)."""
    return os.environ.get(TRUST_ENV) == "1"


@functools.cache
def version() -> str | None:
    """bubblewrap's version ("bubblewrap 0.8.0"), or None where it is not installed."""
    if not shutil.which("bwrap"):
        return None
    run = subprocess.run(["bwrap", "--version"], capture_output=True, text=True)
    return run.stdout.strip() or None


@functools.cache
def problem() -> str | None:
    """Why the sandbox cannot run here (None when it can): not installed, or refused by this machine."""
    if version() is None:
        return f"bubblewrap (bwrap) is not installed: {INSTALL}"
    trial = run(["true"], None, WORKER, timeout=60)  # every part of it: namespaces, seccomp, leaving root
    if trial.status != 0:
        return f"bubblewrap is installed but cannot make a sandbox here ({trial.text()[-300:].strip()}): {INSTALL}"
    return None


def describe() -> str:
    """What protects a grade, in a line per kind of sandbox (the gradebook's summary says it)."""
    if trusted():
        return ("No sandbox (--trust-submissions): the code ran as this user, with its files and network, "
                "and the bans were static checks only.")
    return "\n".join([
        f"Each submission's code ran in {version()} (bwrap): no network, its own processes, a read-only system "
        "without PyTorch or other installed packages, none of this repository's files, no other submission, no "
        "capability" + (", and an unprivileged user of each sandbox's own." if os.geteuid() == 0 else "."),
        f"- its worker: {WORKER.describe()} (on a GPU: {GPU_WORKER.describe()})",
        f"- a build: {BUILD.describe()}; the memory check: {PROGRAM.describe()}",
    ])


# ---- the bootstrap, the first code to run inside ----

# argv: -c CONFIG then the program and its arguments, or the worker's descriptors. Trusted code: it comes from here,
# not from any file the sandbox sees.
BOOT = """
import json, os, resource, sys
config = json.loads(sys.argv[1])
for name, value in config["limits"].items():
    resource.setrlimit(getattr(resource, name), (value, value))
if config["leave_root"] and os.getuid() == 0:
    os.setgroups(config["groups"])
    os.setgid(config["user"])
    os.setuid(config["user"])
    try:
        os.setuid(0)
    except PermissionError:
        pass
    else:
        sys.exit("the sandbox could not leave root: nothing runs")
os.umask(0o022)
os.chdir(config["chdir"])
if config["worker"]:
    sys.path[:0] = config["path"]
    from common.classroom.worker import main
    main(sys.argv[2:])
else:
    os.execvp(sys.argv[2], sys.argv[2:])
"""


def interpreter() -> Path:
    """This Python's own executable (a virtual environment's is a link to it, and the sandbox has no environment)."""
    return Path(getattr(sys, "_base_executable", sys.executable)).resolve()


def packages(cuda: bool) -> dict[str, Path]:
    """The Python packages a lab task may use, by name, and where each is: NumPy, cffi (and the libraries their
    wheels bundle), and on a GPU the nvidia wheels (cuBLAS, cuDNN) where they are installed."""
    names = ["numpy", "cffi", "_cffi_backend", "pycparser"] + (["nvidia"] if cuda else [])
    found = {}
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None:
            continue
        if spec.submodule_search_locations:
            path = Path(list(spec.submodule_search_locations)[0]).resolve()
        else:
            path = Path(spec.origin).resolve()
        found[path.name] = path
        for bundled in (path.parent / f"{name}.libs", path.parent / f".{name}.libs"):  # the wheels' own libraries
            if bundled.is_dir():
                found[bundled.name] = bundled.resolve()
    return found


def _site_packages() -> list[Path]:
    """Every folder of installed Python packages that the sandbox's system folders would otherwise show."""
    roots = {Path(sys.base_prefix).resolve(), Path("/usr"), Path("/usr/local")}
    found = set()
    for root in roots:
        for pattern in ("lib*/python3*/site-packages", "lib*/python3*/dist-packages", "lib/python3/dist-packages"):
            found.update(Path(p).resolve() for p in glob.glob(str(root / pattern)))
    return sorted(p for p in found if p.is_dir())


def _toolkit() -> Path | None:
    """The CUDA toolkit's folder (that of nvcc), or None."""
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc is None:
        return None
    text = Path(nvcc).read_bytes()[:4096]
    if text.startswith(b"#!"):  # a wrapper script, as /usr/local/bin/nvcc is on some machines: the real one it runs
        words = [w for w in text.decode(errors="replace").split() if w.endswith("/nvcc")]
        nvcc = words[0] if words else nvcc
    return Path(nvcc).resolve().parent.parent


# ---- the command line ----


class _Args:
    """bwrap's arguments, with the folders above each mount point made world-readable (bwrap would copy their
    host modes, and /root is not readable by the user a student's code runs as)."""

    def __init__(self):
        self.args: list[str] = []
        self.made = {Path("/")}

    def parents(self, target: Path) -> None:
        for parent in reversed(target.parents):
            if parent not in self.made:
                self.args += ["--perms", "0755", "--dir", str(parent)]
                self.made.add(parent)

    def bind(self, source: Path, target: Path, option: str = "--ro-bind") -> None:
        self.parents(target)
        self.args += [option, str(source), str(target)]
        self.made.add(target)


def _system(args: _Args, devices: bool, toolkit: bool) -> None:
    """The system's programs and libraries, read-only; without any installed Python package."""
    args.bind(Path("/usr"), Path("/usr"))
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = Path("/") / name
        if path.is_symlink():
            args.args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args.bind(path, path)
    for name in ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives"):  # libraries' and compilers' links
        if (path := Path("/etc") / name).exists():
            args.bind(path.resolve(), path)
    python = Path(sys.base_prefix).resolve()
    if not python.is_relative_to("/usr"):
        args.bind(python, python)
    cuda = _toolkit() if toolkit else None
    if cuda and not any(cuda.is_relative_to(p) for p in (Path("/usr"), python)):
        args.bind(cuda, cuda)
    for folder in _site_packages():  # an empty, read-only folder over each
        args.args += ["--tmpfs", str(folder), "--remount-ro", str(folder)]
    args.args += ["--proc", "/proc", "--dev", "/dev"]
    if devices:  # the GPU: its device files, the driver's view of the machine, the driver where it is elsewhere
        for device in sorted(glob.glob("/dev/nvidia*")):
            args.args += ["--dev-bind", device, device]
        args.bind(Path("/sys"), Path("/sys"))
        for folder in _driver_folders():
            if not any(Path(folder).resolve().is_relative_to(p) for p in ("/usr", "/lib", "/lib64")):
                args.bind(Path(folder).resolve(), Path(folder))


def _seccomp_threads_only() -> bytes:
    """A seccomp program (classic BPF, as bwrap --seccomp reads it): clone may start a thread (CLONE_THREAD) and no
    process; fork and vfork fail with EPERM, clone3 (whose flags a filter cannot read) with ENOSYS, so that the C
    library starts its threads with clone; unshare fails with EPERM. Any other architecture or ABI is killed."""
    load, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, kill, eperm, enosys = 0x7FFF0000, 0x80000000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    clone_thread = 0x00010000
    arches = [  # (AUDIT_ARCH_*, x86-64's x32 ABI to refuse, {syscall: action}, clone's number)
        (0xC000003E, True, {57: eperm, 58: eperm, 435: enosys, 272: eperm}, 56),  # x86-64
        (0xC00000B7, False, {435: enosys, 97: eperm}, 220),  # aarch64
    ]
    program = [(load, 0, 0, 4)]  # seccomp_data.arch
    for arch, x32, calls, clone in arches:
        block = [(load, 0, 0, 0)]  # seccomp_data.nr
        if x32:
            block += [(jge, 0, 1, 0x40000000), (ret, 0, 0, kill)]
        for number, action in calls.items():
            block += [(jeq, 0, 1, number), (ret, 0, 0, action)]
        block += [(jeq, 0, 3, clone), (load, 0, 0, 16), (jset, 1, 0, clone_thread), (ret, 0, 0, eperm)]
        block += [(ret, 0, 0, allow)]
        program += [(jeq, 0, len(block), arch)] + block
    program += [(ret, 0, 0, kill)]
    return b"".join(struct.pack("<HBBI", *instruction) for instruction in program)


@dataclass
class _Config:
    """How one sandbox is made."""

    argv: list[str]
    folder: Path | None  # seen at /lab; None: no folder (an empty /lab)
    limits: Limits
    writable: bool = False  # the folder: a build writes there
    gpu: bool = False  # the GPU's devices
    cuda: bool = False  # the CUDA toolkit and libraries (a build for levels 5-7 needs them without the devices)
    env: dict[str, str] | None = None
    worker: bool = False  # argv are the worker's descriptors: the bootstrap imports common.classroom.worker
    mounts: tuple[tuple[Path, str], ...] = ()  # further read-only folders: (where it is, where the sandbox sees it)


def _python_path(config: _Config) -> list[str]:
    """Where the worker imports from: the folder's modules first, then the allowed packages."""
    if trusted():
        return [str(config.folder), *sorted({str(p.parent) for p in packages(config.cuda or config.gpu).values()})]
    return [FOLDER, PACKAGES]


def _inner(config: _Config, leave_root: bool) -> list[str]:
    """The bootstrap's command line."""
    limits = {"RLIMIT_NPROC": config.limits.processes, "RLIMIT_FSIZE": config.limits.file, "RLIMIT_CORE": 0,
              "RLIMIT_NOFILE": 1024}
    if config.limits.memory:
        limits["RLIMIT_AS"] = config.limits.memory
    chdir = (str(config.folder) if config.folder else "/") if trusted() else FOLDER
    boot = {"limits": limits, "leave_root": leave_root, "user": _a_user(), "chdir": chdir, "worker": config.worker,
            "path": _python_path(config), "groups": _device_groups() if config.gpu else []}
    return [str(interpreter()), "-I", "-S", "-B", "-c", BOOT, json.dumps(boot), *config.argv]


_made = 0  # sandboxes this process has made


def _a_user() -> int:
    """A user id of the sandbox's own, which no other sandbox running at the same time has: by this process's id and
    a count of its sandboxes (a sandbox ends before 256 more have started)."""
    global _made
    _made += 1
    return USERS + ((os.getpid() & 0x3FFFFF) << 8) + _made % 256


def _device_groups() -> list[int]:
    """The groups of the GPU's device files that others may not open (a machine may keep them to a group, `video`):
    a sandbox's user belongs to those groups only."""
    groups = {os.stat(device).st_gid for device in glob.glob("/dev/nvidia*") if not os.stat(device).st_mode & 0o006}
    return sorted(groups)


def _driver_folders() -> list[str]:
    """The folders of this process's LD_LIBRARY_PATH that hold the CUDA driver (libcuda), where a container may put
    it instead of a system folder."""
    return [f for f in os.environ.get("LD_LIBRARY_PATH", "").split(":")
            if f.startswith("/") and glob.glob(f"{f}/libcuda.so*")]


def _environment(config: _Config) -> dict[str, str]:
    """The sandbox's whole environment: nothing of the grader's but the GPU's selection."""
    toolkit = _toolkit() if config.cuda else None
    path = ([str(toolkit / "bin")] if toolkit else []) + ["/usr/local/bin", "/usr/bin", "/bin"]
    env = {"PATH": ":".join(path), "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
           "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}  # one thread each: the grades run side by side
    if config.gpu:
        env.update({k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER") if k in os.environ})
        if folders := _driver_folders():
            env["LD_LIBRARY_PATH"] = ":".join(folders)
    return {**env, **(config.env or {})}


def _command(config: _Config, info_fd: int, seccomp_fd: int | None) -> list[str]:
    """bwrap's command line for a sandbox."""
    root = os.geteuid() == 0
    # As root, every namespace but the user's: without one, the bootstrap can become an unprivileged user whom the
    # kernel's process limit binds (in a user namespace of root's, it would stay root). Otherwise bwrap needs one.
    spaces = (["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"] if root
              else ["--unshare-all"])
    caps = ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if root and config.limits.student else []
    args = _Args()
    args.args += ["bwrap", *spaces, "--hostname", "lab", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
                  *caps, "--clearenv", "--info-fd", str(info_fd)]
    for key, value in _environment(config).items():
        args.args += ["--setenv", key, value]
    if seccomp_fd is not None:
        args.args += ["--seccomp", str(seccomp_fd)]
    _system(args, config.gpu, config.cuda or config.gpu)
    for name, path in packages(config.cuda or config.gpu).items():
        args.bind(path, Path(PACKAGES) / name)
    for source, target in config.mounts:
        args.bind(source, Path(target))
    if config.folder is not None:
        args.bind(config.folder.resolve(), Path(FOLDER), "--bind" if config.writable else "--ro-bind")
    else:
        args.args += ["--perms", "0755", "--dir", FOLDER]
    size = str(config.limits.disk)
    args.args += ["--perms", "1777", "--size", size, "--tmpfs", "/tmp",
                  "--perms", "1777", "--size", size, "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
                  "--remount-ro", "/", "--chdir", FOLDER, "--"]
    return args.args + _inner(config, leave_root=root and config.limits.student)


# ---- a sandbox, running ----


class Sandbox:
    """A program running in its sandbox: its output on one pipe (self.output), and stop() ends it with every process
    of its PID namespace. Where the grade runs as root, the student's code runs as another user: its folder must be
    readable by all."""

    def __init__(self, argv: list[str], folder: Path | None, limits: Limits, *, writable: bool = False,
                 gpu: bool = False, cuda: bool = False, env: dict[str, str] | None = None, worker: bool = False,
                 pass_fds: tuple[int, ...] = (), mounts: tuple[tuple[Path, str], ...] = (), stderr: bool = True):
        config = _Config(list(argv), folder, limits, writable, gpu, cuda, env, worker, mounts)
        self.child: int | None = None  # the host's pid of the namespace's first process
        self.namespace: int | None = None  # its PID namespace
        info_read, info_write = os.pipe()
        seccomp = None if limits.spawn or trusted() else _memory_file(_seccomp_threads_only())
        try:
            if trusted():
                command, env, keep = _inner(config, leave_root=False), _environment(config), pass_fds
                env["PATH"] = os.environ.get("PATH", env["PATH"])
            else:
                command, env = _command(config, info_write, seccomp), {"PATH": os.environ.get("PATH", "")}
                keep = (*pass_fds, info_write) + ((seccomp,) if seccomp is not None else ())
            self.process = subprocess.Popen(command, cwd=folder if trusted() else None, env=env,
                                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT if stderr else subprocess.DEVNULL,
                                            pass_fds=keep, start_new_session=True)
        finally:
            os.close(info_write)
            if seccomp is not None:
                os.close(seccomp)
        self.output = self.process.stdout
        self._read_info(info_read)

    def _read_info(self, fd: int) -> None:
        """bwrap's report of the namespaces it made (nothing in the trusted mode)."""
        data, deadline = b"", time.monotonic() + 30
        try:
            while time.monotonic() < deadline and select.select([fd], [], [], deadline - time.monotonic())[0]:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                data += chunk
        finally:
            os.close(fd)
        try:
            info = json.loads(data) if data else {}
        except json.JSONDecodeError:
            info = {}
        self.child, self.namespace = info.get("child-pid"), info.get("pid-namespace")

    def stop(self, close: bool = True, grace: float = 0) -> int | None:
        """End it and every process it started, after grace seconds for it to end by itself; its exit status (None
        when it had to be ended). close: its output pipe too (a reader of its own closes it after reading it all)."""
        try:
            code = self.process.wait(timeout=grace) if grace else self.process.poll()
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            _kill(self.child or self.process.pid)  # the namespace's first process: the kernel ends all the others
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _kill(self.process.pid)
                self.process.wait()
        self._end_namespace()
        if close:
            self.output.close()
        return code

    def _end_namespace(self) -> None:
        """Make sure that no process of its PID namespace is left (on the host's side: by the namespace, not by a
        process group, which a process can leave)."""
        if self.namespace is None:
            return
        for _ in range(100):
            left = [pid for pid in _pids() if _namespace(pid) == self.namespace]
            if not left:
                return
            for pid in left:
                _kill(pid)
            time.sleep(0.05)
        raise RuntimeError(f"processes {left} of a sandbox could not be ended")


def _memory_file(data: bytes) -> int:
    """A descriptor to read data from (bwrap reads its seccomp program from one)."""
    fd = os.memfd_create("lab-seccomp")
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _namespace(pid: int) -> int | None:
    """A live process's PID namespace (the number bwrap reports), or None once it has ended (a zombie has)."""
    try:
        if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z":
            return None
        return int(os.readlink(f"/proc/{pid}/ns/pid").removeprefix("pid:[").removesuffix("]"))
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class Ran:
    """A program's run in its sandbox."""

    status: int | None  # exit status; None when it ran out of time and was ended
    output: bytes  # the first bytes of its output (stdout and stderr), up to the run's limit
    verdict: bytes  # what it wrote on its verdict descriptor (VERDICT_ENV), up to 4 KiB
    overflowed: bool  # it wrote more output than was kept

    def text(self) -> str:
        return self.output.decode(errors="replace")


def run(argv: list[str], folder: Path | None, limits: Limits, timeout: float, *, writable: bool = False,
        gpu: bool = False, cuda: bool = False, env: dict[str, str] | None = None, verdict: bool = False,
        limit: int = 1 << 20, mounts: tuple[tuple[Path, str], ...] = (), stderr: bool = True) -> Ran:
    """Run a program in a sandbox to its end, or until timeout (then end it and all it started). Its output (stdout,
    and stderr unless not wanted) is read as it comes, the first `limit` bytes kept; with verdict, it gets a pipe of its
    own whose descriptor is in VERDICT_ENV (a checker's verdict, apart from what the code it checks may print)."""
    verdict_read, verdict_write = os.pipe() if verdict else (None, None)
    extra = {VERDICT_ENV: str(verdict_write)} if verdict else {}
    try:
        sandbox = Sandbox(argv, folder, limits, writable=writable, gpu=gpu, cuda=cuda, env={**(env or {}), **extra},
                          pass_fds=(verdict_write,) if verdict else (), mounts=mounts, stderr=stderr)
    finally:
        if verdict:
            os.close(verdict_write)
    output = sandbox.output.fileno()
    streams = {output: bytearray()} | ({verdict_read: bytearray()} if verdict else {})
    limits_of = {output: limit, verdict_read: 4096}
    overflowed, deadline = False, time.monotonic() + timeout
    try:
        open_fds = list(streams)
        while open_fds and (left := deadline - time.monotonic()) > 0:
            for fd in select.select(open_fds, [], [], left)[0]:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    open_fds.remove(fd)
                    continue
                room = limits_of[fd] - len(streams[fd])
                streams[fd] += chunk[:max(room, 0)]
                overflowed |= len(chunk) > room and fd == output
        finished = not open_fds
        if finished:
            try:
                sandbox.process.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                finished = False
        status = sandbox.stop()
    finally:
        if verdict:
            os.close(verdict_read)
    return Ran(status if finished else None, bytes(streams[output]),
               bytes(streams[verdict_read]) if verdict else b"", overflowed)
