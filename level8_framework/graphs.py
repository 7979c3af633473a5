"""Level 8's training step recorded once on the GPU and replayed: a CUDA graph, as torch.cuda.CUDAGraph makes one.

An eager step is Python calling the backend once per operation, and each call launching a kernel: at the chapter's
size the GPU waits for the next launch longer than it computes. CUDA's stream capture records the kernels a step
queues into a graph instead of running them; a replay then launches the whole graph at once, with no Python and no
launch between its kernels. What that asks of the step is what PyTorch's graphs ask:

- **Static memory.** A replay runs the recorded kernels on the recorded pointers. Every array the step makes while it
  is recorded comes from one arena, an allocation made before, and keeps its place for every replay: the batch is
  copied into the step's input buffers before a replay, and its loss read from the same output after.
- **No host work inside.** Nothing waits for the GPU or copies from host memory while the step is recorded. The numbers
  an optimizer's update changes from step to step (Adam's step count in its bias corrections, a learning rate changed
  between epochs) are read by its kernels from device memory, which the graph refills before each replay
  (StepGraph.refilled).
- **State made before.** Adam's moments and momentum's buffer exist before the step is recorded: the first step runs
  eagerly, as PyTorch's warm-up does (and it makes cuBLAS's workspace).

While a step is recorded, the backend takes every array's memory from the arena (cuda.py's Memory) and holds back the
memory Python gives back meanwhile (an array of an earlier step collected): given back in the graph, it would be given
back again at each replay. An array on the arena keeps the arena alive, so no array can outlive its memory.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from common.native import ffi
from level8_framework.cuda import Memory
from level8_framework.tensor import Tensor

ALIGNMENT = 256  # bytes between the starts of two arrays on the arena, as cudaMalloc's
FIRST_ARENA = 1 << 20  # bytes; doubled and the step recorded again until its arrays fit
LARGEST_ARENA = 1 << 36


class ArenaFull(MemoryError):
    """The step made more arrays than its arena holds (StepGraph records it again on a larger one)."""


class Arena:
    """Device memory for the arrays a recorded step makes: one allocation from the pool, handed out front to back and
    never given back piece by piece (all of it goes back when the last array on it is collected)."""

    def __init__(self, backend, nbytes: int):
        self.memory, self.nbytes, self.used = Memory(backend, nbytes), nbytes, 0

    def take(self, nbytes: int):
        """The pointer to the next `nbytes` of the arena."""
        start = -(-self.used // ALIGNMENT) * ALIGNMENT
        if start + nbytes > self.nbytes:
            raise ArenaFull(f"the recorded step needs more than its arena's {self.nbytes:,} bytes")
        self.used = start + nbytes
        return ffi.cast("char *", self.memory.pointer) + start


class StepGraph:
    """A step recorded once as a CUDA graph, and replayed: step() runs once, recorded (its kernels not run), and
    replay() runs its kernels again on the same memory, the loss it returned at `loss`."""

    def __init__(self, backend, step: Callable[[], Tensor]):
        nbytes = FIRST_ARENA
        while True:
            try:
                self._record(backend, step, nbytes)
                return
            except ArenaFull:
                if nbytes >= LARGEST_ARENA:
                    raise
                nbytes *= 2

    def _record(self, backend, step: Callable[[], Tensor], nbytes: int) -> None:
        self.backend, self.arena, self._refills = backend, Arena(backend, nbytes), []
        with backend.recording_into(self):  # sets self.executable
            self.loss = step().data  # on the arena: each replay writes its step's loss there

    def refilled(self, shape: tuple[int, ...], numbers: Callable[[], np.ndarray]):
        """An array of `shape` on the device that numbers() (host float32 values) fills before each replay: the
        numbers of an optimizer's update that change from step to step, read by its kernels when they run."""
        array = self.backend.empty(shape)
        self._refills.append((array, numbers))
        return array

    def replay(self) -> None:
        """Queue the recorded step once more (nothing waits for it): its numbers refilled first."""
        for array, numbers in self._refills:
            self.backend.assign(array, numbers())
        self.backend.replay(self.executable)
