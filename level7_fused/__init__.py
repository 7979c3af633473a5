"""Level 7: one fused, persistent CUDA kernel for the steps of an epoch (mlp.cu), and for LeNet-5 one fused kernel for
its forward (lenet.cu: inference) and two for its training step (a block per image, then a thread per parameter),
through the shared cffi binding.

Build with `make level7`. Where a size does not fit on chip, an epoch runs level 6's queued kernels instead
(correct, slower); `MLP(params).plan(batch_size)` says which path a batch size takes, and train_epoch warns,
once per batch size, when it is not the fused one.
"""

import warnings

import numpy as np

from common.levels import level
from common.native import ffi, lazy_lenet, native_level

__all__ = ["MLP", "LeNet"]
ffi.cdef("const char *mlp_fused_plan(mlp *m, int batch_size);")  # level 7's one function beyond mlp.h


class MLP(native_level(level(7))):
    """The level contract, its epochs in one fused kernel."""

    __module__ = __name__

    def __init__(self, params: dict[str, np.ndarray], matmul: str | None = None):
        super().__init__(params, matmul)
        self._warned: set[int] = set()
        self._last_plan = "no epoch yet"

    def plan(self, batch_size: int) -> str:
        """How an epoch with this batch size runs here: "fused: a cluster of G blocks x U units, ..." or why not."""
        with self._lock:
            return self._plan(batch_size)

    def _plan(self, batch_size: int) -> str:
        return ffi.string(self.lib.mlp_fused_plan(self._handle(), int(batch_size))).decode()

    def variant(self) -> dict[str, str]:
        """The device, and how the last epoch ran: the fused kernel's plan, or level 6's kernels and why."""
        return {**super().variant(), "epoch": self._last_plan}

    def _epoch_done(self, batch_size: int) -> None:
        """Warn, once per batch size, where the epoch ran level 6's kernels (it holds the model's lock)."""
        self._last_plan = plan = self._plan(batch_size)
        if batch_size not in self._warned and not plan.startswith("fused"):
            self._warned.add(batch_size)
            warnings.warn(f"level 7 runs this epoch with {plan}", RuntimeWarning, stacklevel=3)  # the caller's line


__getattr__ = lazy_lenet(level(7), globals())
