"""The untrusted side of a teacher's grade: runs a submission's code, in its sandbox, on inputs the grader sends.

    python -m common.classroom.worker READ_FD WRITE_FD      (started by common.classroom.sandbox.Worker, never by hand)

It answers requests one at a time: call a function of one of the submission's modules, make an object (a native
level's layers or a whole model) and call its methods, or build native targets. Every answer holds
outputs only: arrays, numbers and text in common.classroom.sandbox's codec, which carries no code. The grader computes every
verdict from those outputs itself. Here the tasks compute by hand, so the libraries that would do their work
(PyTorch, JAX, TensorFlow, SciPy, scikit-learn) cannot be imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import os
import sys
import traceback
from pathlib import Path

from common.classroom.lab import LIBRARIES, make


class NoLibraries(importlib.abc.MetaPathFinder):
    """Refuses the libraries a lab task must not call, with the reason."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in LIBRARIES:
            raise ImportError(f"a lab task computes by hand: {name.split('.')[0]} is not available to it")
        return None


def serve(read_fd: int, write_fd: int) -> None:
    """Answer requests until the grader closes the pipe."""
    from common.classroom import sandbox

    objects: dict[int, object] = {}
    reader, writer = os.fdopen(read_fd, "rb"), os.fdopen(write_fd, "wb")
    while (request := sandbox.receive(reader)) is not None:
        try:
            answer = {"ok": handle(request, objects)}
        except BaseException as e:  # the grader reports it: a student's code may raise anything
            answer = {"error": f"{type(e).__name__}: {e}"[:2000],
                      "where": "".join(traceback.format_exception(e)[-3:])[-2000:]}
        sandbox.send(writer, answer)


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
    if op == "build":
        return make(request["targets"], Path.cwd())
    raise ValueError(f"unknown request {op!r}")


def called(function, request: dict) -> dict:
    """The result of a call, and its array arguments afterwards (a function may write into them, as sgd_update does)."""
    args, kwargs = request["args"], request["kwargs"]
    return {"result": function(*args, **kwargs), "args": args, "kwargs": kwargs}


if __name__ == "__main__":
    sys.meta_path.insert(0, NoLibraries())
    serve(int(sys.argv[1]), int(sys.argv[2]))
