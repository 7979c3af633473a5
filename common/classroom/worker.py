"""The untrusted side of a teacher's grade: runs a submission's code, in its sandbox, on inputs the grader sends.

Started by common.classroom.sandbox.Worker inside a bubblewrap sandbox (common/classroom/bwrap.py), never by hand: the sandbox's
bootstrap calls main() with the descriptors of its two pipes. It answers requests one at a time: call a function of
one of the submission's modules, or make an object (a native level's layers or a whole model) and call its methods.
Every answer holds outputs only: arrays, numbers and text in common.classroom.sandbox's codec, which carries no code. The
grader computes every verdict from those outputs itself. Here the tasks compute by hand: the libraries that would do
their work (PyTorch, JAX, TensorFlow, SciPy, scikit-learn) are not in the sandbox, so there is nothing to import.
"""

from __future__ import annotations

import importlib
import os
import traceback

from common.classroom.lab import LIBRARIES


def main(argv: list[str]) -> None:
    """Answer the grader's requests on the two descriptors in argv (read, write) until it closes the first."""
    serve(int(argv[0]), int(argv[1]))


def serve(read_fd: int, write_fd: int) -> None:
    """Answer requests until the grader closes the pipe."""
    from common.classroom import sandbox

    objects: dict[int, object] = {}
    reader, writer = os.fdopen(read_fd, "rb"), os.fdopen(write_fd, "wb")
    while (request := sandbox.receive(reader)) is not None:
        try:
            answer = {"ok": handle(request, objects)}
        except BaseException as e:  # the grader reports it: a student's code may raise anything
            answer = {"error": why(e), "where": "".join(traceback.format_exception(e)[-3:])[-2000:]}
        sandbox.send(writer, answer)


def why(e: BaseException) -> str:
    """What went wrong, in a line: a library that is not there says why."""
    if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] in LIBRARIES:
        return f"a lab task computes by hand: {e.name.split('.')[0]} is not available to it"
    return f"{type(e).__name__}: {e}"[:2000]


def handle(request: dict, objects: dict[int, object]):
    """One request: its answer."""
    op = request["op"]
    if op == "call":
        function = getattr(importlib.import_module(request["module"]), request["name"])
        return called(function, request)
    if op == "new":
        module, name = request["factory"].split(":")
        objects[len(objects)] = getattr(importlib.import_module(module), name)(*request["args"])
        return len(objects) - 1
    if op == "method":
        return called(getattr(objects[request["handle"]], request["name"]), request)
    raise ValueError(f"unknown request {op!r}")


def called(function, request: dict) -> dict:
    """The result of a call, and its array arguments afterwards (a function may write into them, as sgd_update does)."""
    args, kwargs = request["args"], request["kwargs"]
    return {"result": function(*args, **kwargs), "args": args, "kwargs": kwargs}
