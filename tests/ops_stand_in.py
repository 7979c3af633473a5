"""A stand-in for level 8's GPU library (common/native/ops.h) in NumPy, so that the GPU backend's Python side
(level8_framework/cuda.py: its arrays, views, transposed operands, pointer offsets, the calls it makes and their sizes)
is tested on any machine, CI included. Each function reads and writes the memory behind the pointers it is given,
through the sizes it is given, with level 3's layer functions where level 5's kernels would run: a call with a wrong
size or offset reads or writes the wrong values, and the tests see them. The CUDA kernels themselves are tested on a
GPU (tests marked gpu).
"""

from __future__ import annotations

import numpy as np
import pytest

from common.levels import level
from common.native import ffi
from level3_numpy import lenet as L3lenet
from level3_numpy import mlp as L3


def view(pointer, n: int, dtype=np.float32) -> np.ndarray:
    """The n values at a C pointer, as a writeable NumPy array on that memory."""
    return np.frombuffer(ffi.buffer(pointer, 4 * n), dtype=dtype)


class StandIn:
    """The library's functions, by their names in ops.h (and mlp.h's two it uses)."""

    MLP_OK = 0
    # What a CUDA stream capture refuses: waiting for the GPU, copies from or to host memory, the pool's memory.
    NOT_RECORDED = ("ops_upload", "ops_download", "ops_synchronize", "ops_alloc", "ops_free")

    def __init__(self):
        self.memory: dict[int, object] = {}
        self.error = "stand-in: no error"
        self.recording: list | None = None  # the calls made since ops_record_begin, as (function, arguments)
        self.graphs: dict[int, list] = {}  # each recorded graph's calls, by the handle ops_record_end gave
        self.graphs_made = 0  # so that no handle is given twice

    def __getattribute__(self, name: str):
        """While a step is recorded, a call of an operation is kept for the replays, not made, as CUDA's stream
        capture does; a call capture refuses fails, as it would."""
        function = object.__getattribute__(self, name)
        recording = object.__getattribute__(self, "recording")
        if recording is None or not name.startswith("ops_") or "record" in name:
            return function
        if name in StandIn.NOT_RECORDED:
            return lambda *args: self.fail(f"{name} while a step is recorded: operation not permitted when stream is "
                                           "capturing")
        return lambda *args: recording.append((function, args)) or 0

    def fail(self, message: str) -> int:
        self.error = message
        return 1

    def mlp_last_error(self):
        return ffi.new("char[]", self.error.encode())

    # ---- a step recorded and replayed ----

    def ops_record_begin(self, c) -> int:
        if self.recording is not None:
            return self.fail("the stream is already recording")
        self.recording = []
        return 0

    def ops_record_end(self, c, out) -> int:
        self.graphs_made += 1
        handle = self.graphs_made
        self.graphs[handle], self.recording = self.recording, None
        out[0] = ffi.cast("ops_graph *", handle)
        return 0

    def ops_record_abort(self, c) -> int:
        self.recording = None
        return 0

    def ops_replay(self, c, g) -> int:
        for function, args in self.graphs[int(ffi.cast("uintptr_t", g))]:
            if status := function(*args):
                return status
        return 0

    def ops_graph_destroy(self, g) -> int:
        del self.graphs[int(ffi.cast("uintptr_t", g))]
        return 0

    def mlp_device_buffers(self) -> int:
        return len(self.memory)

    def ops_create(self, out) -> int:
        out[0] = ffi.cast("ops *", 1)
        return 0

    # ---- memory ----

    def ops_alloc(self, c, p, nbytes: int) -> int:
        block = ffi.new("char[]", max(nbytes, 1))
        self.memory[int(ffi.cast("uintptr_t", block))] = block
        p[0] = ffi.cast("void *", block)
        return 0

    def ops_free(self, c, p) -> int:
        del self.memory[int(ffi.cast("uintptr_t", p))]
        return 0

    def ops_upload(self, c, dst, src, nbytes: int) -> int:
        ffi.memmove(dst, src, nbytes)
        return 0

    ops_download = ops_copy = ops_upload

    def ops_fill(self, c, x, value: float, n: int) -> int:
        view(x, n)[:] = value
        return 0

    # ---- products and shapes ----

    def ops_gemm(self, c, out, a, b, M, N, K, transpose_a, transpose_b) -> int:
        A = view(a, M * K).reshape(K, M).T if transpose_a else view(a, M * K).reshape(M, K)
        B = view(b, K * N).reshape(N, K).T if transpose_b else view(b, K * N).reshape(K, N)
        view(out, M * N)[:] = (A @ B).ravel()
        return 0

    def ops_linear_forward(self, c, out, x, w, B, n_in, n_out) -> int:
        view(out, B * n_out)[:] = (view(x, B * n_in).reshape(B, n_in) @ view(w, n_out * n_in).reshape(n_out, n_in).T
                                   ).ravel()
        return 0

    def ops_linear_backward(self, c, dx, dw, dout, x, w, B, n_in, n_out) -> int:
        g, W = view(dout, B * n_out).reshape(B, n_out), view(w, n_out * n_in).reshape(n_out, n_in)
        view(dw, n_out * n_in)[:] = (g.T @ view(x, B * n_in).reshape(B, n_in)).ravel()
        if dx != ffi.NULL:
            view(dx, B * n_in)[:] = (g @ W).ravel()
        return 0

    def ops_transpose(self, c, out, x, rows, cols) -> int:
        view(out, rows * cols)[:] = view(x, rows * cols).reshape(rows, cols).T.ravel()
        return 0

    # ---- element-wise ----

    def ops_add(self, c, out, a, b, n) -> int:
        view(out, n)[:] = view(a, n) + view(b, n)
        return 0

    def ops_bias_forward(self, c, out, b, rows, n) -> int:
        view(out, rows * n).reshape(rows, n)[:] += view(b, n)
        return 0

    def ops_bias_backward(self, c, db, dout, rows, n) -> int:
        view(db, n)[:] = view(dout, rows * n).reshape(rows, n).sum(axis=0)
        return 0

    def ops_relu_forward(self, c, a, h, n) -> int:
        view(a, n)[:] = L3.relu_forward(view(h, n))
        return 0

    def ops_relu_backward(self, c, dh, da, h, n) -> int:
        view(dh, n)[:] = L3.relu_backward(view(da, n), view(h, n))
        return 0

    def ops_sigmoid_forward(self, c, s, h, n) -> int:
        with np.errstate(over="ignore"):
            view(s, n)[:] = 1 / (1 + np.exp(-view(h, n)))
        return 0

    def ops_sigmoid_backward(self, c, dh, ds, s, n) -> int:
        view(dh, n)[:] = view(ds, n) * (1 - view(s, n)) * view(s, n)
        return 0

    # ---- losses and the mean ----

    def ops_softmax_xent_forward(self, c, loss, probs, row_loss, logits, y, B, n_out) -> int:
        value, p = L3.softmax_xent_forward(view(logits, B * n_out).reshape(B, n_out), view(y, B, np.int32))
        view(loss, 1)[0], view(probs, B * n_out)[:] = value, p.ravel()
        return 0

    def ops_softmax_xent_backward(self, c, dlogits, probs, y, dloss, B, n_out) -> int:
        d = L3.softmax_xent_backward(view(probs, B * n_out).reshape(B, n_out), view(y, B, np.int32))
        view(dlogits, B * n_out)[:] = (d * view(dloss, 1)[0]).ravel()
        return 0

    def ops_mse_forward(self, c, loss, squares, x, t, n) -> int:
        d = view(x, n) - view(t, n)
        view(loss, 1)[0] = np.mean(d.astype(np.float64) ** 2)
        return 0

    def ops_mse_backward(self, c, dx, x, t, dloss, n) -> int:
        view(dx, n)[:] = (view(x, n) - view(t, n)) * np.float32(2 / n) * view(dloss, 1)[0]
        return 0

    def ops_mean(self, c, out, x, n) -> int:
        view(out, 1)[0] = np.mean(view(x, n).astype(np.float64))
        return 0

    def ops_mean_backward(self, c, dx, dout, n) -> int:
        view(dx, n)[:] = view(dout, 1)[0] / np.float32(n)
        return 0

    # ---- convolution and pooling ----

    def ops_conv2d_forward(self, c, out, x, w, b, B, C, H, F, k) -> int:
        OH = H - k + 1
        view(out, B * F * OH * OH)[:] = L3lenet.conv2d_forward(view(x, B * C * H * H).reshape(B, C, H, H),
                                                               view(w, F * C * k * k).reshape(F, C, k, k),
                                                               view(b, F)).ravel()
        return 0

    def ops_conv2d_backward(self, c, dx, dw, db, dout, x, w, B, C, H, F, k) -> int:
        OH = H - k + 1
        dxv, dwv, dbv = L3lenet.conv2d_backward(view(dout, B * F * OH * OH).reshape(B, F, OH, OH),
                                                view(x, B * C * H * H).reshape(B, C, H, H),
                                                view(w, F * C * k * k).reshape(F, C, k, k), dx != ffi.NULL)
        view(dw, F * C * k * k)[:], view(db, F)[:] = dwv.ravel(), dbv
        if dx != ffi.NULL:
            view(dx, B * C * H * H)[:] = dxv.ravel()
        return 0

    def ops_maxpool_forward(self, c, out, choice, a, B, C, H) -> int:
        o, ch = L3lenet.maxpool_forward(view(a, B * C * H * H).reshape(B, C, H, H))
        view(out, o.size)[:], view(choice, ch.size, np.int32)[:] = o.ravel(), ch.ravel()
        return 0

    def ops_maxpool_backward(self, c, da, dout, choice, B, C, H) -> int:
        P = H // 2
        view(da, B * C * H * H)[:] = L3lenet.maxpool_backward(view(dout, B * C * P * P).reshape(B, C, P, P),
                                                              view(choice, B * C * P * P, np.int32).reshape(B, C, P, P)
                                                              ).ravel()
        return 0

    # ---- a batch, and the optimizers' updates ----

    def ops_gather(self, c, x, y, data_x, data_y, order, B, n_in) -> int:
        rows = view(order, B, np.int32)
        n = int(rows.max()) + 1  # the rows it reads: the data set is at least this long
        view(x, B * n_in)[:] = view(data_x, n * n_in).reshape(n, n_in)[rows].ravel()
        view(y, B, np.int32)[:] = view(data_y, n, np.int32)[rows]
        return 0

    def ops_sgd_update(self, c, p, dp, lr, n) -> int:
        L3.sgd_update({0: view(p, n)}, {0: view(dp, n)}, np.float32(lr))
        return 0

    def ops_sgd_momentum_update(self, c, p, dp, buf, lr, momentum, n) -> int:
        L3.sgd_momentum_update({0: view(p, n)}, {0: view(dp, n)}, {0: view(buf, n)}, np.float32(lr), momentum)
        return 0

    # the updates reading their numbers from memory when they run (in a replay: the numbers refilled before it)

    def ops_sgd_update_from(self, c, p, dp, numbers, n) -> int:
        return self.ops_sgd_update(c, p, dp, float(view(numbers, 1)[0]), n)

    def ops_sgd_momentum_update_from(self, c, p, dp, buf, numbers, n) -> int:
        return self.ops_sgd_momentum_update(c, p, dp, buf, *map(float, view(numbers, 2)), n)

    def ops_adam_update_from(self, c, p, dp, m, v, numbers, n) -> int:
        return self.ops_adam_update(c, p, dp, m, v, *map(float, view(numbers, 6)), n)

    def ops_adam_update(self, c, p, dp, m, v, weight1, beta2, weight2, step_size, bc2_sqrt, eps, n) -> int:
        P, g, M, V = view(p, n), view(dp, n), view(m, n), view(v, n)
        f = np.float32
        M += f(weight1) * (g - M)
        V *= f(beta2)
        V += f(weight2) * g * g
        P -= f(step_size) * M / (np.sqrt(V) / f(bc2_sqrt) + f(eps))
        return 0


def backend():
    """level8_framework.cuda's backend class over the stand-in."""
    from level8_framework import cuda

    instance = cuda.CudaBackend.__new__(cuda.CudaBackend)
    instance.lib = StandIn()
    out = ffi.new("ops **")
    instance.lib.ops_create(out)
    instance.context = out[0]
    return instance


DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
           pytest.param("stand-in", id="cuda-stand-in")]


def device_under_test(request, monkeypatch, stand_in) -> str:
    """The device of a `device` fixture: "cpu", "cuda" (skipped, or with --require-gpu failed, where level 8 cannot
    run on a GPU) or "cuda" over a stand-in (`stand_in()`: the GPU backend's Python side, on any machine)."""
    from conftest import require

    if request.param == "stand-in":
        from level8_framework import cuda

        monkeypatch.setattr(cuda, "_BACKEND", stand_in())
        return "cuda"
    require(level(8), request.param, request.config)
    return request.param


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch) -> str:
    """The device under test, over this stand-in where it is the stand-in (device_under_test)."""
    return device_under_test(request, monkeypatch, backend)
