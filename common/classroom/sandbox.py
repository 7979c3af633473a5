"""The trusted side of a teacher's grade: a submission's code runs only in a sandboxed worker process.

A teacher's grade (common/classroom/gradebook.py, or `python -m common.classroom.grade --submission DIR`) runs the checks here, in the
grader's own process, with the held-out ones. Wherever a check would run the submission's code, it asks the worker
instead (common/classroom/worker.py): a process started in a copy of the submission, with limits on time, memory and file
size, and - where the machine allows a user namespace (`unshare`) - no network and the grader's repository, the
other submissions and the grade's output hidden behind empty mounts. The worker answers with outputs only (arrays,
numbers, text; no code), and the checks here compute every verdict from them. So a submission cannot write its own
score, edit the checks or read the held-out ones; what it can still do is said in LABS.md.

In the student's own `make grade` (no --submission) nothing here is used: the checks call the code directly.
"""

from __future__ import annotations

import json
import os
import resource
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from common.levels import ROOT

ENV = "LAB_SUBMISSION"  # set by the grade to the submission's sandbox folder: the checks then call the worker
HIDE_ENV = "LAB_HIDE"  # further folders the worker must not see (the gradebook's submissions and output), by os.pathsep
CALL_TIMEOUT_S = float(os.environ.get("LAB_CALL_TIMEOUT_S", 120))  # one call: a hang becomes a failed check
MEMORY_BYTES = 6 << 30  # address space of a CPU worker (not set for a GPU one: the CUDA driver maps far more)
FILE_BYTES = 1 << 30  # the largest file a worker may write
ARRAY_KINDS = "biuf"  # what an answer's arrays may hold: numbers only


class WorkerError(RuntimeError):
    """The submission's code raised, crashed, hung, or answered something that is not an answer."""


# ---- the codec: JSON for the structure, the arrays' raw bytes after it (no pickles) ----


def encode(message: Any) -> bytes:
    """A message of dicts, lists, tuples, numbers, strings, None and numeric arrays, as bytes that hold no code."""
    arrays: list[np.ndarray] = []
    offset = 0  # of the next array in the body

    def walk(value):
        nonlocal offset
        if isinstance(value, np.ndarray | np.generic):
            array = np.asarray(value)  # tobytes() below writes it in C order, whatever its strides
            if array.dtype.kind not in ARRAY_KINDS:
                raise TypeError(f"cannot send an array of {array.dtype}")
            arrays.append(array)
            offset += array.nbytes
            return {"__array__": offset - array.nbytes, "dtype": array.dtype.str, "shape": list(array.shape),
                    "scalar": isinstance(value, np.generic)}
        if isinstance(value, dict):
            return {"__dict__": [[str(k), walk(v)] for k, v in value.items()]}
        if isinstance(value, list | tuple):
            return {"__list__": [walk(v) for v in value], "tuple": isinstance(value, tuple)}
        if value is None or isinstance(value, bool | int | float | str):
            return value
        raise TypeError(f"cannot send a {type(value).__name__}")

    head = json.dumps(walk(message)).encode()
    return struct.pack("<Q", len(head)) + head + b"".join(a.tobytes() for a in arrays)


def decode(data: bytes) -> Any:
    """A message from encode(); refuses anything else (an array of objects included: nothing is ever unpickled)."""
    (n,) = struct.unpack("<Q", data[:8])
    body = memoryview(data)[8 + n :]

    def array(value: dict) -> np.ndarray:
        try:
            offset = int(value["__array__"])
            dtype, shape = np.dtype(value["dtype"]), tuple(int(d) for d in value["shape"])
        except (TypeError, ValueError, KeyError):
            raise WorkerError("an answer held an array of no numeric type") from None
        if dtype.kind not in ARRAY_KINDS or dtype.hasobject or any(d < 0 for d in shape):
            raise WorkerError(f"an answer held an array of {dtype}")
        size = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        if offset < 0 or offset + size > len(body):
            raise WorkerError("an answer's array lies outside it")
        return np.frombuffer(body, dtype, offset=offset, count=size // dtype.itemsize).reshape(shape).copy()

    def build(value):
        if isinstance(value, dict) and "__array__" in value:
            result = array(value)
            return result[()] if value.get("scalar") else result
        if isinstance(value, dict) and "__dict__" in value:
            return {str(k): build(v) for k, v in value["__dict__"]}
        if isinstance(value, dict) and "__list__" in value:
            items = [build(v) for v in value["__list__"]]
            return tuple(items) if value.get("tuple") else items
        if value is None or isinstance(value, bool | int | float | str):
            return value
        raise WorkerError(f"an answer held a {type(value).__name__}")

    return build(json.loads(data[8 : 8 + n]))


def send(stream, message: Any) -> None:
    """One length-prefixed message."""
    data = encode(message)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def receive(stream) -> Any | None:
    """One message, or None at the end of the stream."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    return decode(stream.read(struct.unpack("<Q", head)[0]))


# ---- the worker process ----


def namespaces_work() -> bool:
    """Whether this machine lets an unprivileged process make a user, mount and network namespace (`unshare -rmn`)."""
    unshare = shutil.which("unshare")
    return bool(unshare) and subprocess.run([unshare, "-rmn", "true"], capture_output=True).returncode == 0


def _limits(gpu: bool) -> None:
    """In the worker, before it starts: its own process group (to end all of it at once), and its limits."""
    os.setsid()
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_BYTES, FILE_BYTES))
    if not gpu:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))


class Worker:
    """The sandboxed process that runs a submission's code: started on first use, and again after it dies."""

    def __init__(self, folder: Path, gpu: bool = False):
        self.folder, self.gpu = Path(folder), gpu
        self.process: subprocess.Popen | None = None
        self.isolated = namespaces_work()
        self._spare = ""  # mount points, while the worker runs, for what it keeps seeing

    def _start(self) -> None:
        to_worker, from_grader = os.pipe()
        to_grader, from_worker = os.pipe()
        self._spare = tempfile.mkdtemp(prefix="lab-worker-")
        worker = self._sandboxed([sys.executable, "-m", "common.classroom.worker", str(to_worker), str(from_worker)])
        log = open(self.folder / "worker.log", "ab")
        self.process = subprocess.Popen(worker, cwd=self.folder, env=self._env(), stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=log, pass_fds=(to_worker, from_worker),
                                        preexec_fn=lambda: _limits(self.gpu))
        os.close(to_worker), os.close(from_worker), log.close()
        self.writer, self.reader = os.fdopen(from_grader, "wb"), os.fdopen(to_grader, "rb")

    def _sandboxed(self, command: list[str]) -> list[str]:
        """The command, run inside the namespaces with the hidden folders hidden (where the machine allows it)."""
        if not self.isolated:
            return command
        return ["unshare", "-rmn", "--", "sh", "-c", self._hiding_script(), "sh", *command]

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in (ENV, HIDE_ENV)}
        # The submission's modules first; the caller's other paths after them (where cffi may live), never this
        # repository's, whose modules are the grader's.
        inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                     if p and not Path(p).resolve().is_relative_to(ROOT)]
        env.update(PYTHONPATH=os.pathsep.join([str(self.folder), *inherited]), HOME=str(self.folder),
                   PYTHONDONTWRITEBYTECODE="1")
        return env

    def run_program(self, argv: list[str], timeout: float) -> tuple[int, str]:
        """A program of the sandbox, in a sandboxed process of its own (no memory limit: AddressSanitizer reserves
        terabytes of address space): (exit status, the end of its output)."""
        spare = self._spare
        self._spare = tempfile.mkdtemp(prefix="lab-program-")
        try:
            process = subprocess.Popen(self._sandboxed(argv), cwd=self.folder, env=self._env(),
                                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       preexec_fn=lambda: _limits(gpu=True))
            try:
                output = process.communicate(timeout=timeout)[0]
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                raise WorkerError(f"{argv[0]} did not finish in {timeout:.0f} s and was ended") from None
            return process.returncode, output[-65536:].decode(errors="replace")
        finally:
            shutil.rmtree(self._spare, ignore_errors=True)
            self._spare = spare

    def _hiding_script(self) -> str:
        """Inside the namespaces: empty mounts over what the worker must not see (the grader's repository, and the
        folders the gradebook names: other submissions, the grades), then its own folder and the Python it runs put
        back where they were, the Python read-only."""
        hidden = [ROOT, *(Path(p) for p in os.environ.get(HIDE_ENV, "").split(os.pathsep) if p)]
        hidden = [h.resolve() for h in hidden if h.is_dir()]
        # The interpreter as the worker will name it (sys.executable): a virtual environment may be a link.
        keep = [(Path(sys.prefix).absolute(), "ro"), (self.folder.resolve(), "rw")]
        keep = [(path, mode) for path, mode in keep if any(path.is_relative_to(h) for h in hidden)]
        saved = [Path(tempfile.mkdtemp(prefix="keep-", dir=self._spare)) for _ in keep]
        lines = ["set -e"]
        lines += [f"mount --bind '{path}' '{spare}'" for (path, _), spare in zip(keep, saved)]
        lines += [f"mkdir -p '{folder}' && mount -t tmpfs -o size=1m tmpfs '{folder}'" for folder in hidden]
        for (path, mode), spare in zip(keep, saved):
            lines += [f"mkdir -p '{path}'", f"mount --bind '{spare}' '{path}'"]
            lines += [f"mount -o remount,bind,ro '{path}'"] if mode == "ro" else []
        return "\n".join(lines + ['exec "$@"'])

    def request(self, op: str, timeout: float = CALL_TIMEOUT_S, **fields) -> Any:
        """Send one request and wait for its answer; the submission's exceptions come back as WorkerError."""
        if self.process is None or self.process.poll() is not None:
            self._start()
        try:
            send(self.writer, {"op": op, **fields})
            ready, _, _ = select.select([self.reader], [], [], timeout)
            if not ready:
                self.stop()
                raise WorkerError(f"no answer after {timeout:.0f} s: an endless loop, or a barrier that never opens? "
                                  "(the submission's process was ended)")
            answer = receive(self.reader)
        except (BrokenPipeError, OSError, struct.error, ValueError, json.JSONDecodeError) as e:
            self.stop()
            raise WorkerError(f"the submission's process died ({type(e).__name__}){self._log_tail()}") from None
        if answer is None:
            code = self.stop()
            raise WorkerError(f"the submission's process ended (exit status {code}){self._log_tail()}")
        if not isinstance(answer, dict) or ("ok" not in answer and "error" not in answer):
            self.stop()
            raise WorkerError("the submission's process answered something that is not an answer")
        if "error" in answer:
            raise WorkerError(str(answer["error"]))
        return answer["ok"]

    def _log_tail(self) -> str:
        """The end of what the worker printed (the submission's text: shown, never interpreted)."""
        log = self.folder / "worker.log"
        text = log.read_bytes()[-600:].decode(errors="replace").strip() if log.exists() else ""
        return f"; it printed: ...{text[-300:]}" if text else ""

    def stop(self) -> int | None:
        """End the worker and everything it started."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        code = self.process.wait()
        shutil.rmtree(self._spare, ignore_errors=True)
        for stream in (self.writer, self.reader):
            try:
                stream.close()
            except OSError:
                pass
        self.process = None
        return code


_WORKERS: dict[bool, Worker] = {}


def submission() -> Path | None:
    """The sandbox folder of the submission under grade, or None in a student's own grade."""
    return Path(os.environ[ENV]) if os.environ.get(ENV) else None


def worker(gpu: bool = False) -> Worker:
    """This grade's worker (one for CPU checks, one for GPU checks, each started on first use)."""
    if gpu not in _WORKERS:
        _WORKERS[gpu] = Worker(submission(), gpu)
    return _WORKERS[gpu]


def stop_workers() -> None:
    for w in _WORKERS.values():
        w.stop()


# ---- what the checks hold instead of the submission's code ----


def _copy_back(local, remote) -> None:
    """Write the worker's arrays into the caller's (a function that updates in place must be seen to have done it)."""
    if isinstance(local, np.ndarray) and isinstance(remote, np.ndarray) and local.flags.writeable:
        if remote.shape != local.shape:
            raise WorkerError(f"an argument of shape {local.shape} came back as {remote.shape}")
        np.copyto(local, remote, casting="unsafe")
    elif isinstance(local, dict) and isinstance(remote, dict):
        for key in local:
            if key in remote:
                _copy_back(local[key], remote[key])
    elif isinstance(local, list | tuple) and isinstance(remote, list | tuple):
        for a, b in zip(local, remote):
            _copy_back(a, b)


def _call(target: Worker, op: str, args, kwargs, timeout: float = CALL_TIMEOUT_S, **fields):
    answer = target.request(op, timeout, args=list(args), kwargs=dict(kwargs), **fields)
    _copy_back(list(args), answer["args"])
    _copy_back(dict(kwargs), answer["kwargs"])
    return answer["result"]


def remote_function(module: str, name: str, gpu: bool = False, timeout: float = CALL_TIMEOUT_S):
    """A stand-in for the submission's module.name, run by the worker (a call that takes longer than timeout fails)."""

    def function(*args, **kwargs):
        return _call(worker(gpu), "call", args, kwargs, timeout, module=module, name=name)

    function.__name__ = name
    return function


class RemoteObject:
    """A stand-in for an object the worker makes (factory "module:function" called with args); methods are calls."""

    def __init__(self, factory: str, *args, gpu: bool = False):
        self._worker = worker(gpu)
        self._handle = self._worker.request("new", factory=factory, args=list(args))

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: _call(self._worker, "method", args, kwargs, handle=self._handle, name=name)


def build(targets: tuple[str, ...], gpu: bool = False) -> str | None:
    """`make -s targets` in the submission's sandbox: None when it builds, else the first error."""
    return worker(gpu).request("build", timeout=600, targets=list(targets))


def run(argv: list[str], timeout: float, gpu: bool = False) -> tuple[int, str]:
    """A program of the sandbox, run there in a process of its own: (exit status, the end of its output)."""
    return worker(gpu).run_program(argv, timeout)


def stand_in_for_python_tasks() -> None:
    """In this process, replace each Python function a student writes (common/classroom/lab.py's marked regions) by a stand-in
    that runs the submission's: the given code around it (level 3's MLP class, level 2's mlp_loss_and_grads) and the
    checks' own helpers stay the grader's."""
    import importlib

    from common.classroom import lab

    for path in sorted({t.path for t in lab.TASKS if t.path and t.path.endswith(".py")}):
        name = path.removesuffix(".py").replace("/", ".")
        module = importlib.import_module(name)
        for function in sorted({r.function for r in lab.regions(path)}):
            setattr(module, function, remote_function(name, function))


def model_factory(number: int, device: str, options: dict[str, str] | None = None):
    """params -> a stand-in for the submission's model of a level (its row of the grade), made by the worker, with
    the options of one of the level's variants (level 5's matrix product)."""
    return lambda params: RemoteObject("common.classroom.lab_native:model", number, device, params, options or {},
                                       gpu=device == "cuda")
