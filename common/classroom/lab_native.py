"""The lab's native functions, one call each: levels 4, 5 and 7 export their static functions through small libraries
(tests/lab_level4.c, lab_level5.cu, lab_level7.cu, built into build/*.so), and these classes give them level 3's
Python signatures. The lab's checks (tests/test_tasks.py) call them; so does the grader's sandboxed worker
(common/classroom/worker.py), which builds and loads a submission's libraries where the grader never loads them itself.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from common.levels import ROOT
from common.native import NativeError

LIBRARIES = {4: "lab_level4.c", 5: "lab_level5.cu", 7: "lab_level7.cu"}  # in tests/, built into build/*.so
C_TYPES = {np.float32: "float[]", np.int32: "int[]"}


def load(number: int, root: Path = ROOT):
    """(ffi, lib) of build/lab_level<number>.so under root, declared from its source's cdef markers."""
    from cffi import FFI

    path = root / "build" / f"lab_level{number}.so"
    ffi = FFI()
    source = (root / "tests" / LIBRARIES[number]).read_text()
    ffi.cdef(re.search(r"/\* cdef-begin \*/(.*)/\* cdef-end \*/", source, re.S).group(1)
             + "const char *mlp_last_error(void);")
    return ffi, ffi.dlopen(str(path))


class NativeLayers:
    """A native level's layer functions, one call each through its lab library, with level 3's signatures."""

    def __init__(self, ffi, lib):
        self.ffi, self.lib = ffi, lib

    def _call(self, function: str, *args) -> None:
        """Call lab_<function> with arrays passed as pointers; raise NativeError with the library's message."""
        pointers = [self.ffi.from_buffer(C_TYPES[a.dtype.type], a) if isinstance(a, np.ndarray) else a for a in args]
        if getattr(self.lib, f"lab_{function}")(*pointers):
            raise NativeError(self.ffi.string(self.lib.mlp_last_error()).decode())

    def linear_backward_into(self, dout, x, w, dx, dw, *extra):
        """The wrapper's arguments: outputs first, then inputs and sizes (the level's own order)."""
        B, n_out = dout.shape
        self._call("linear_backward", dx if dx is not None else self.ffi.NULL, dw, *extra, dout, x, w, B, x.shape[1],
                   n_out)

    def relu_forward(self, h):
        a = np.empty_like(h)
        self._call("relu_forward", a, h, h.size)
        return a

    def relu_backward(self, da, h):
        dh = np.empty_like(da)
        self._call("relu_backward", dh, da, h, da.size)
        return dh

    def softmax_xent_forward(self, logits, y):
        loss, probs = np.empty(1, np.float32), np.empty_like(logits)
        self._call("softmax_xent_forward", loss, probs, logits, y.astype(np.int32), *logits.shape)
        return loss[0], probs

    def softmax_xent_backward(self, probs, y):
        dlogits = np.empty_like(probs)
        self._call("softmax_xent_backward", dlogits, probs, y.astype(np.int32), *probs.shape)
        return dlogits

    def sgd_update(self, params, grads, lr):
        for name in grads:
            self._call("sgd_update", params[name], grads[name], lr, grads[name].size)

    def _conv2d_forward(self, x, w, b, *extra):
        """out (n, f, h - k + 1, h - k + 1) of x (n, c, h, h), w (f, c, k, k), b (f) through the library's
        lab_conv2d_forward; extra: level 5's choice of kernel (1: tiled)."""
        (n, c, h, _), (f, _, k, _) = x.shape, w.shape
        out = np.empty((n, f, h - k + 1, h - k + 1), np.float32)
        self._call("conv2d_forward", out, np.ascontiguousarray(x), w, b, n, c, h, f, k, *extra)
        return out


class Level4Layers(NativeLayers):
    """Level 4 (tests/lab_level4.c): the linear layer adds its bias itself."""

    def linear_forward(self, x, w, b):
        out = np.empty((len(x), len(w)), np.float32)
        self._call("linear_forward", out, x, w, b, len(x), x.shape[1], len(w))
        return out

    def linear_backward(self, dout, x, w):
        dx = np.empty_like(x) if w is not None else None
        dw, db = np.empty((dout.shape[1], x.shape[1]), np.float32), np.empty(dout.shape[1], np.float32)
        self.linear_backward_into(dout, x, w if w is not None else np.empty_like(dw), dx, dw, db)
        return dx, dw, db

    def conv2d_forward(self, x, w, b):
        return self._conv2d_forward(x, w, b)

    def conv2d_backward(self, dout, x, w, need_dx=True):
        n, c, h, _ = x.shape
        f, k = w.shape[0], w.shape[2]
        dx = np.empty_like(x) if need_dx else None
        dw, db = np.empty_like(w), np.empty(f, np.float32)
        self._call("conv2d_backward", dx if need_dx else self.ffi.NULL, dw, db, np.ascontiguousarray(dout),
                   np.ascontiguousarray(x), w, n, c, h, f, k)
        return dx, dw, db

    def maxpool_forward(self, a):
        n, c, h, _ = a.shape
        out, choice = np.empty((n, c, h // 2, h // 2), np.float32), np.empty((n, c, h // 2, h // 2), np.int32)
        self._call("maxpool_forward", out, choice, np.ascontiguousarray(a), n, c, h)
        return out, choice

    def maxpool_backward(self, dout, choice):
        n, c, p, _ = dout.shape
        da = np.empty((n, c, 2 * p, 2 * p), np.float32)
        self._call("maxpool_backward", da, np.ascontiguousarray(dout), np.ascontiguousarray(choice, np.int32), n, c,
                   2 * p)
        return da


class Level5Layers(NativeLayers):
    """Level 5 (tests/lab_level5.cu): the products only; the bias has kernels of its own (bias_forward, _backward)."""

    def linear_forward(self, x, w, b):
        out = np.empty((len(x), len(w)), np.float32)
        self._call("linear_forward", out, x, w, len(x), x.shape[1], len(w))
        return out + b  # added here: bias_forward is a task of its own

    def linear_backward(self, dout, x, w):
        dx = np.empty_like(x) if w is not None else None
        dw = np.empty((dout.shape[1], x.shape[1]), np.float32)
        self.linear_backward_into(dout, x, w if w is not None else np.empty_like(dw), dx, dw)
        return dx, dw, None  # db is bias_backward's

    def bias_forward(self, out, b):
        out = out.copy()
        self._call("bias_forward", out, b, *out.shape)
        return out

    def bias_backward(self, dout):
        db = np.empty(dout.shape[1], np.float32)
        self._call("bias_backward", db, dout, *dout.shape)
        return db

    def conv2d_forward(self, x, w, b):
        return self._conv2d_forward(x, w, b, 0)

    def conv2d_forward_tiled(self, x, w, b):
        return self._conv2d_forward(x, w, b, 1)


def layers(number: int, root: Path = ROOT):
    """The layer functions of native level 4 or 5, from its lab library under root."""
    return {4: Level4Layers, 5: Level5Layers}[number](*load(number, root))


def model(number: int, device: str, params: dict, options: dict | None = None):
    """A whole level's model (its row of the grade): level number's class on device, from params, with the options of
    one of its variants (level 5's matrix product)."""
    from common.levels import level

    cls = level(number).load()
    return cls(params, device=device) if number == 1 else cls(params, **(options or {}))


def owned_units(hidden: int, units: int, root: Path = ROOT) -> tuple[np.ndarray, np.ndarray]:
    """Level 7's owned_units for every block: (first unit, number of units) per block."""
    ffi, lib = load(7, root)
    blocks = -(-hidden // units)
    j0, owned = np.empty(blocks, np.int32), np.empty(blocks, np.int32)
    if lib.lab_owned_units(hidden, units, ffi.from_buffer("int[]", j0), ffi.from_buffer("int[]", owned)):
        raise NativeError(ffi.string(lib.mlp_last_error()).decode())
    return j0, owned


def grid_barrier(blocks: int, rounds: int, root: Path = ROOT) -> tuple[int, int, int, str]:
    """Level 7's grid barrier, `rounds` times over `blocks` blocks: (status, late reads, blocks launched, message)."""
    ffi, lib = load(7, root)
    late, launched = ffi.new("int *"), ffi.new("int *")
    status = lib.lab_grid_barrier(blocks, rounds, late, launched)
    return status, late[0], launched[0], ffi.string(lib.mlp_last_error()).decode()
