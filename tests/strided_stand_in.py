"""ops_stand_in.py's stand-in for level 8's GPU library, with the rest of common/native/ops.h: the strided copy of
views, and map, zip and reduce. Each reads and writes the memory behind its pointers through the sizes and strides it
is given, as the kernels do, so a wrong stride, offset or size from level8_framework/cuda.py shows in the values. The
`device` fixture here is ops_stand_in's (cpu, cuda, cuda over a stand-in) with this stand-in.
"""

from __future__ import annotations

import numpy as np
import pytest

import ops_stand_in
from common.native import ffi
from ops_stand_in import view


def reach(shape, strides) -> int:
    """How many values a layout reads from its first: its last position + 1 (0 for no values)."""
    if not all(shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, strides))


def strided(pointer, shape, strides) -> np.ndarray:
    """The values at a pointer read through a shape and strides (in values), as a writeable NumPy view."""
    return np.lib.stride_tricks.as_strided(view(pointer, reach(shape, strides)), tuple(shape),
                                           tuple(4 * s for s in strides))


HEADER = ffi.dlopen(None)  # the constants ops.h defines (OPS_ADD, ...), which cffi gives every library it opens


class StandIn(ops_stand_in.StandIn):
    """The library's functions, by their names in ops.h, and its constants."""

    def __getattr__(self, name: str):
        if name.startswith("OPS_"):
            return getattr(HEADER, name)
        raise AttributeError(name)

    def ops_strided_copy(self, c, out, out_strides, x, x_strides, shape, ndim) -> int:
        assert ndim == len(shape) == len(out_strides) == len(x_strides) and 1 <= ndim <= self.OPS_MAX_DIMS
        if all(shape):
            strided(out, shape, out_strides)[...] = strided(x, shape, x_strides)
        return 0

    def ops_map(self, c, out, x, f, k, n) -> int:
        functions = {self.OPS_NEG: np.negative, self.OPS_EXP: np.exp, self.OPS_LOG: np.log, self.OPS_TANH: np.tanh,
                     self.OPS_POW: lambda v: v ** np.float32(k)}
        view(out, n)[:] = functions[f](view(x, n))
        return 0

    def ops_zip(self, c, out, a, b, op, n) -> int:
        operations = {self.OPS_ADD: np.add, self.OPS_SUB: np.subtract, self.OPS_MUL: np.multiply,
                      self.OPS_DIV: np.divide, self.OPS_EQ: lambda u, v: (u == v).astype(np.float32)}
        view(out, n)[:] = operations[op](view(a, n), view(b, n))
        return 0

    def ops_reduce(self, c, out, x, outer, n, inner, op) -> int:
        values = view(x, outer * n * inner).reshape(outer, n, inner)
        reduced = values.astype(np.float64).sum(axis=1) if op == self.OPS_SUM else values.max(axis=1)
        view(out, outer * inner)[:] = reduced.ravel()
        return 0


def backend():
    """level8_framework.cuda's backend class over this stand-in."""
    instance = ops_stand_in.backend()
    instance.lib = StandIn()
    return instance


@pytest.fixture(params=ops_stand_in.DEVICES)
def device(request, monkeypatch) -> str:
    """The device under test, over this stand-in where it is the stand-in (ops_stand_in.device_under_test)."""
    return ops_stand_in.device_under_test(request, monkeypatch, backend)
