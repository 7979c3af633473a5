"""The one list of levels. The Makefile, pytest's markers, the grader, the harness, the benchmark and the plots read it.

Each entry says what the level needs, so a machine runs exactly the levels it can:
  "torch" - PyTorch importable;   "cc" - a C compiler built the library;
  "nvcc"  - nvcc built the library; "gpu" - an NVIDIA GPU is visible at run time.
Which networks each level implements, and in which library, is common/nets' list; which optimizers, its optimizers.py.
The Makefile asks for its targets:

    python3 -m common.levels targets cc|nvcc       # the levels a C compiler (nvcc) builds: level4 | level5 level6 ...
    python3 -m common.levels lab-libraries cc|nvcc # the lab's libraries for their tasks
    python3 -m common.levels markers gpu           # a pytest -m expression of the levels that need a GPU
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from common.nets import Network, get
from common.nets.optimizers import SGD, Optimizer

ROOT = Path(__file__).resolve().parent.parent
THE_MLP = get("mlp")  # the network a level is asked about when none is named


@dataclass(frozen=True)
class Level:
    number: int
    package: str
    title: str
    needs: tuple[str, ...]
    trains: bool = True  # level 2 is theory: it derives the formulas, it does not train
    lab_libraries: tuple[str, ...] = ()  # what the lab's grade builds for this level's tasks (make targets)
    gpu_library: str | None = None  # a level that runs on the CPU and, through this library (`make levelN`), on a GPU

    @property
    def takes_device(self) -> bool:
        """Whether its classes take device="cpu" or "cuda": level 1, and a level with a GPU library."""
        return self.number == 1 or self.gpu_library is not None

    @property
    def name(self) -> str:
        """Short label used in tables and plots, e.g. 'level3'."""
        return f"level{self.number}"

    def library_for(self, network: Network = THE_MLP) -> Path | None:
        """Absolute path of the level's shared library for a network (common/nets), if it has one."""
        name = network.library(self.number)
        return ROOT / self.package / name if name else None

    def load(self, network: Network = THE_MLP):
        """Import the level's package and return its class for a network (MLP, LeNet: common/nets)."""
        return getattr(importlib.import_module(self.package), network.class_name)


LEVELS: tuple[Level, ...] = (
    Level(1, "level1_pytorch", "PyTorch, the gold standard", ("torch",)),
    Level(2, "level2_theory", "Backpropagation theory", ("torch",), trains=False),
    Level(3, "level3_numpy", "NumPy by hand", ()),
    Level(4, "level4_c", "Plain C through cffi", ("cc",), lab_libraries=("build/lab_level4.so", "build/lab_memory")),
    Level(5, "level5_cuda_naive", "Naive CUDA kernels", ("nvcc", "gpu"), lab_libraries=("build/lab_level5.so",)),
    Level(6, "level6_cublas", "cuBLAS GEMMs", ("nvcc", "gpu")),
    Level(7, "level7_fused", "One fused persistent kernel", ("nvcc", "gpu"), lab_libraries=("build/lab_level7.so",)),
    Level(8, "level8_framework", "A framework of your own", (), gpu_library="libops.so"),
    Level(9, "level9_data_parallel", "Data parallel on two workers", ("torch",)),
)


def level(number: int) -> Level:
    """The level with this number."""
    for lv in LEVELS:
        if lv.number == number:
            return lv
    raise KeyError(f"no level {number}; levels are {[lv.number for lv in LEVELS]}")


@cache
def gpu_available() -> bool:
    """True when an NVIDIA GPU is usable (asked through PyTorch, else nvidia-smi)."""
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        smi = shutil.which("nvidia-smi")
        return bool(smi) and subprocess.run([smi, "-L"], capture_output=True).returncode == 0


def machine_tag() -> str:
    """The name of this machine's results folder (results/<tag>/): its GPU's model as the driver names it, the first
    word with a digit ("NVIDIA H100 80GB HBM3" -> h100, "NVIDIA H200" -> h200, "NVIDIA GeForce RTX 4090" -> 4090), else
    cpu. Read from the machine, so that a result is filed under the GPU that measured it."""
    if not gpu_available():
        return "cpu"
    import torch

    return gpu_tag(torch.cuda.get_device_name())


def gpu_tag(name: str) -> str:
    """A GPU's name as machine_tag files it: the letters and digits that begin its first word with a digit (the model:
    "A100-SXM4-80GB" -> a100), lower case; else those of its last word."""
    words = name.lower().split() or ["gpu"]
    model = next((word for word in words if any(c.isdigit() for c in word)), words[-1])
    return (re.findall(r"[a-z0-9]+", model) or ["gpu"])[0]


def missing(lv: Level, device: str = "cpu", network: Network = THE_MLP, optimizer: Optimizer = SGD,
            built: bool = True) -> list[str]:
    """Why this machine cannot run the level on `device` for a network and an optimizer (empty when it can); levels
    that take a device (1, 8) run on either. built: whether its libraries must be built here (a submission's are built
    in its sandbox)."""
    why = []
    if lv.number not in network.levels:
        why.append(f"level {lv.number} does not implement {network.title}")
    if lv.trains and lv.number not in optimizer.levels:
        why.append(f"level {lv.number} trains with {SGD.title} only, not {optimizer.title}")
    if "torch" in lv.needs and importlib.util.find_spec("torch") is None:
        why.append("PyTorch is not installed")
    if built and (path := lv.library_for(network)) and not path.exists():
        why.append(f"{path.relative_to(ROOT)} is not built: run `make level{lv.number}`")
    if built and device == "cuda" and lv.gpu_library and not (ROOT / lv.package / lv.gpu_library).exists():
        why.append(f"{lv.package}/{lv.gpu_library} is not built: run `make level{lv.number}`")
    if ("gpu" in lv.needs or device == "cuda") and not gpu_available():
        why.append("no NVIDIA GPU is visible on this machine")
    return why


def built_by(compiler: str) -> list[Level]:
    """The native levels a compiler builds ("cc": a C compiler; "nvcc": the CUDA toolkit's, a GPU library too)."""
    return [lv for lv in LEVELS if compiler in lv.needs or (compiler == "nvcc" and lv.gpu_library)]


def main(argv: list[str]) -> int:
    """The Makefile's questions (the module's docstring)."""
    what, tool = argv
    if what == "targets":
        print(" ".join(lv.name for lv in built_by(tool)))
    elif what == "lab-libraries":
        print(" ".join(target for lv in built_by(tool) for target in lv.lab_libraries))
    elif what == "markers":  # a level that runs on either device: its GPU tests only
        print(" or ".join(lv.name if tool in lv.needs else f"({lv.name} and gpu)" for lv in LEVELS
                          if tool in lv.needs or (tool == "gpu" and lv.gpu_library)))
    else:
        raise SystemExit(f"python -m common.levels: unknown question {what!r} (targets, lab-libraries, markers)")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
