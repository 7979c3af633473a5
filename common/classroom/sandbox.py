"""The trusted side of a teacher's grade: a submission's code runs only in its sandboxed worker process.

A teacher's grade (common/classroom/gradebook.py, or `python -m common.classroom.grade --submission DIR`) runs the checks here, in the
grader's own process, with the held-out ones. Wherever a check would run the submission's code, it asks the worker
instead (common/classroom/worker.py): a process in a bubblewrap sandbox (common/classroom/bwrap.py) that sees the submission's copy
read-only, the system, NumPy and cffi, and nothing else of this machine. The worker answers with outputs only
(arrays, numbers, text; no code), and the checks here compute every verdict from them. Its builds and the memory
check run in sandboxes of their own. Every answer has a deadline and a size limit, both checked here: a worker that
passes either is ended with its whole sandbox, and that check fails. What this does and does not protect against
is said in LABS.md.

In the student's own `make grade` (no --submission) nothing here is used: the checks call the code directly.
"""

from __future__ import annotations

import json
import os
import select
import struct
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from common.classroom import bwrap

ENV = "LAB_SUBMISSION"  # set by the grade to the submission's sandbox folder: the checks then call the worker
CALL_TIMEOUT_S = float(os.environ.get("LAB_CALL_TIMEOUT_S", 120))  # one call, its whole answer included
BUILD_TIMEOUT_S = 600  # one `make` of a level's libraries
ANSWER_BYTES = 64 << 20  # an answer may hold this much more than its request (which it sends back: arguments change)
LOG_BYTES = 64 << 10  # the end of what a worker printed that is kept, to show with its failures
ARRAY_KINDS = "biuf"  # what an answer's arrays may hold: numbers only
# The memory check's sanitizers: LeakSanitizer on, and the program ended where it holds more than 2 GiB.
ASAN_OPTIONS = "detect_leaks=1:hard_rss_limit_mb=2048"


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
    try:
        return _decode(data)
    except WorkerError:
        raise
    except Exception as e:  # malformed in any way (truncated, not JSON, nested past the recursion limit)
        raise WorkerError(f"an answer that is not one ({type(e).__name__})") from None


def _decode(data: bytes) -> Any:
    """decode()'s work: the JSON structure, then each array from the body behind it."""
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise WorkerError("an answer's header is longer than the answer")
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


class _Late(Exception):
    """The worker did not complete its answer (or read its request) before the deadline."""


class Worker:
    """The sandboxed process that runs a submission's code: started on first use, and again after it dies."""

    def __init__(self, folder: Path, gpu: bool = False):
        self.folder, self.gpu = Path(folder), gpu
        self.sandbox: bwrap.Sandbox | None = None
        self.late: dict[str, str] = {}  # calls that passed their deadline, and why: they are not made again
        self._log = bytearray()

    def _start(self) -> None:
        requests, to_worker = os.pipe()
        from_worker, answers = os.pipe()
        try:
            self.sandbox = bwrap.Sandbox([str(requests), str(answers)], self.folder,
                                         bwrap.GPU_WORKER if self.gpu else bwrap.WORKER, gpu=self.gpu, worker=True,
                                         pass_fds=(requests, answers))
        except BaseException:
            os.close(to_worker), os.close(from_worker)
            raise
        finally:
            os.close(requests), os.close(answers)
        self.writer, self.reader = to_worker, from_worker
        os.set_blocking(self.writer, False)
        os.set_blocking(self.reader, False)
        self._log = bytearray()
        self._logger = threading.Thread(target=self._keep_log, args=(self.sandbox.output.fileno(), self._log),
                                        daemon=True)
        self._logger.start()

    @staticmethod
    def _keep_log(fd: int, log: bytearray) -> None:
        """Read what the worker prints as it comes (a worker never waits on a full pipe), keeping the end of it; until
        the end of the pipe, which comes when every process of the sandbox has ended."""
        while chunk := os.read(fd, 1 << 16):
            log += chunk
            del log[:-LOG_BYTES]

    def request(self, op: str, timeout: float = CALL_TIMEOUT_S, what: str = "", **fields) -> Any:
        """Send one request and wait for its whole answer until the deadline; the submission's exceptions come back
        as WorkerError. `what` names the call: once one passes its deadline, it is not made again in this grade (its
        task has failed, and each further try would cost a deadline)."""
        if what in self.late:
            raise WorkerError(f"{self.late[what]} (an earlier call of it; not called again)")
        if self.sandbox is None or self.sandbox.process.poll() is not None:
            self.stop()
            self._start()
        data = encode({"op": op, **fields})
        deadline = time.monotonic() + timeout
        try:
            self._write(struct.pack("<Q", len(data)) + data, deadline)
            answer = decode(self._read_answer(deadline, len(data) + ANSWER_BYTES))
        except _Late:
            self.stop()
            why = f"no complete answer after {timeout:.0f} s: an endless loop, or a barrier that never opens?"
            if what:
                self.late[what] = why
            raise WorkerError(f"{why} (the submission's process was ended){self._log_tail()}") from None
        except EOFError:
            code = self.stop(grace=5)
            raise WorkerError(f"the submission's process ended (exit status {code}){self._log_tail()}") from None
        except (OSError, WorkerError) as e:
            self.stop()
            raise WorkerError(f"the submission's process broke off: {e}{self._log_tail()}") from None
        if not isinstance(answer, dict) or ("ok" not in answer and "error" not in answer):
            self.stop()
            raise WorkerError("the submission's process answered something that is not an answer")
        if "error" in answer:
            raise WorkerError(str(answer["error"]))
        return answer["ok"]

    def _write(self, data: bytes, deadline: float) -> None:
        """All of data to the worker, never waiting past the deadline on one that stopped reading."""
        view = memoryview(data)
        while view:
            if not select.select([], [self.writer], [], max(deadline - time.monotonic(), 0))[1]:
                raise _Late()
            try:
                view = view[os.write(self.writer, view[:1 << 20]):]
            except BlockingIOError:
                continue
            except BrokenPipeError:
                raise EOFError() from None

    def _read(self, n: int, deadline: float) -> bytearray:
        """Exactly n bytes of the answer, before the deadline."""
        data = bytearray()
        while len(data) < n:
            if not select.select([self.reader], [], [], max(deadline - time.monotonic(), 0))[0]:
                raise _Late()
            try:
                chunk = os.read(self.reader, min(n - len(data), 1 << 20))
            except BlockingIOError:
                continue
            if not chunk:
                raise EOFError()
            data += chunk
        return data

    def _read_answer(self, deadline: float, limit: int) -> bytes:
        """One answer: its length first, checked against the limit before any of it is read."""
        (n,) = struct.unpack("<Q", self._read(8, deadline))
        if n > limit:
            raise WorkerError(f"it announced an answer of {n:,} bytes, more than the {limit:,} an answer to this "
                              "request may hold")
        return bytes(self._read(n, deadline))

    def _log_tail(self) -> str:
        """The end of what the worker printed (the submission's text: shown, never interpreted)."""
        text = bytes(self._log[-600:]).decode(errors="replace").strip()
        return f"; it printed: ...{text[-300:]}" if text else ""

    def stop(self, grace: float = 0) -> int | None:
        """End the worker and every process of its sandbox (after grace seconds to end by itself); its exit status."""
        if self.sandbox is None:
            return None
        code = self.sandbox.stop(close=False, grace=grace)
        self._logger.join()  # the pipe has ended: every process that could write to it has
        self.sandbox.output.close()
        for fd in (self.writer, self.reader):
            os.close(fd)
        self.sandbox = None
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


# The functions a student writes that update arguments in place, and which (by position and by name): only those come
# back from the worker. Any other change the submission makes to an argument stays in the worker, so that no function
# can change the inputs its check computes the right answer from.
IN_PLACE = {"sgd_update": {0: "params"}, "sgd_momentum_update": {0: "params", 2: "velocity"},
            "adam_update": {0: "params", 2: "exp_avg", 3: "exp_avg_sq"}}


def _call(target: Worker, op: str, args, kwargs, timeout: float = CALL_TIMEOUT_S, what: str = "", **fields):
    answer = target.request(op, timeout, what, args=list(args), kwargs=dict(kwargs), **fields)
    updated = IN_PLACE.get(fields["name"], {})
    remote_args, remote_kwargs = answer["args"], answer["kwargs"]
    for i, name in updated.items():
        if i < len(args) and isinstance(remote_args, list) and i < len(remote_args):
            _copy_back(args[i], remote_args[i])
        if name in kwargs and isinstance(remote_kwargs, dict) and name in remote_kwargs:
            _copy_back(kwargs[name], remote_kwargs[name])
    return answer["result"]


def remote_function(module: str, name: str, gpu: bool = False, timeout: float = CALL_TIMEOUT_S):
    """A stand-in for the submission's module.name, run by the worker (a call that takes longer than timeout fails)."""

    def function(*args, **kwargs):
        return _call(worker(gpu), "call", args, kwargs, timeout, f"{module}.{name}", module=module, name=name)

    function.__name__ = name
    return function


class RemoteObject:
    """A stand-in for an object the worker makes (factory "module:function" called with args); methods are calls."""

    def __init__(self, factory: str, *args, gpu: bool = False):
        self._worker = worker(gpu)
        # What it is, for the calls' names: the factory and its leading plain arguments (a level, a device).
        self._what = f"{factory}{tuple(a for a in args[:2] if isinstance(a, int | str))}"
        self._handle = self._worker.request("new", CALL_TIMEOUT_S, self._what, factory=factory, args=list(args))

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: _call(self._worker, "method", args, kwargs, CALL_TIMEOUT_S,
                                             f"{self._what}.{name}", handle=self._handle, name=name)


def build(targets: tuple[str, ...], gpu: bool = False) -> str | None:
    """`make -s targets` in a sandbox of its own, the only one that may write in the submission's folder (the compilers
    run there, none of the submission's code): None when it builds, else the first error."""
    from common.classroom import lab

    ran = bwrap.run(["make", "-s", *targets, f"PYTHON={bwrap.interpreter()}"], submission(), bwrap.BUILD,
                    BUILD_TIMEOUT_S, writable=True, cuda=gpu, env={"PYTHONPATH": bwrap.PACKAGES})
    if ran.status is None:
        return f"the build did not finish in {BUILD_TIMEOUT_S} s and was ended"
    return None if ran.status == 0 else lab.first_error(ran.text())


def memory_check(part: str, timeout: float = 120) -> tuple[bool, str]:
    """Level 4's memory check (build/lab_memory part, under AddressSanitizer and LeakSanitizer) in a sandbox of its
    own: (passed, its report). It passes only on the verdict that the checking program writes on a pipe of its own,
    after the sanitizers' leak check, with exit status 0: what the code under check prints is shown, never believed."""
    ran = bwrap.run(["build/lab_memory", part], submission(), bwrap.PROGRAM, timeout, verdict=True,
                    env={"ASAN_OPTIONS": ASAN_OPTIONS, "UBSAN_OPTIONS": "print_stacktrace=1"})
    if ran.status is None:
        return False, f"build/lab_memory {part} did not finish in {timeout:.0f} s and was ended"
    passed = ran.status == 0 and ran.verdict.decode(errors="replace") == f"lab_memory {part}: ok\n"
    return passed, ran.text()[-65536:]


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
