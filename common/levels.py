"""The one list of levels. The Makefile, the tests, the harness, the benchmark and the plots all read it.

Each entry says what the level needs, so a machine runs exactly the levels it can:
  "torch" - PyTorch importable;   "cc" - a C compiler built the library;
  "nvcc"  - nvcc built the library; "gpu" - an NVIDIA GPU is visible at run time.
Which networks each level implements, and in which library, is common/models.py's list.
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Level:
    number: int
    package: str
    title: str
    needs: tuple[str, ...]
    library: str | None = None  # the MLP's shared library built by `make levelN`, relative to the package
    trains: bool = True  # level 2 is theory: it derives the formulas, it does not train

    @property
    def name(self) -> str:
        """Short label used in tables and plots, e.g. 'level3'."""
        return f"level{self.number}"

    @property
    def library_path(self) -> Path | None:
        """Absolute path of the MLP's built shared library, if the level has one."""
        return ROOT / self.package / self.library if self.library else None

    def library_for(self, model: str = "mlp") -> Path | None:
        """Absolute path of the level's shared library for a network (common/models.py), if it has one."""
        from common.models import get

        name = get(model).library(self.number)
        return ROOT / self.package / name if name else None

    def load(self, model: str = "mlp"):
        """Import the level's package and return its class for a network (MLP, LeNet: common/models.py)."""
        from common.models import get

        return getattr(importlib.import_module(self.package), get(model).class_name)


LEVELS: tuple[Level, ...] = (
    Level(1, "level1_pytorch", "PyTorch, the gold standard", ("torch",)),
    Level(2, "level2_theory", "Backpropagation theory", ("torch",), trains=False),
    Level(3, "level3_numpy", "NumPy by hand", ()),
    Level(4, "level4_c", "Plain C through cffi", ("cc",), "libmlp.so"),
    Level(5, "level5_cuda_naive", "Naive CUDA kernels", ("nvcc", "gpu"), "libmlp.so"),
    Level(6, "level6_cublas", "cuBLAS GEMMs", ("nvcc", "gpu"), "libmlp.so"),
    Level(7, "level7_fused", "One fused persistent kernel", ("nvcc", "gpu"), "libmlp.so"),
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


def missing(lv: Level, device: str = "cpu", model: str = "mlp", built: bool = True) -> list[str]:
    """Why this machine cannot run the level on `device` for a network (empty when it can); level 1 runs on either.
    built: whether its library must be built here."""
    from common.models import get

    why = []
    if lv.number not in get(model).levels:
        why.append(f"level {lv.number} does not implement {get(model).title}")
    if "torch" in lv.needs and importlib.util.find_spec("torch") is None:
        why.append("PyTorch is not installed")
    if built and (path := lv.library_for(model)) and not path.exists():
        why.append(f"{path.relative_to(ROOT)} is not built: run `make level{lv.number}`")
    if ("gpu" in lv.needs or device == "cuda") and not gpu_available():
        why.append("no NVIDIA GPU is visible on this machine")
    return why
