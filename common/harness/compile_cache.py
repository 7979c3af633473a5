"""One compilation cache for a run and its lockstep processes: XLA compiles and autotunes the JAX peer's step once.

    with compile_cache.shared():
        ...  # the timed runs, then the lockstep in worker processes, which inherit the cache

Every lockstep process that makes the JAX peer compiles its step again, and XLA autotunes each matrix product of it
on the GPU: at batch 256, hidden 1,024, minutes per process when several do it at once. With JAX's persistent cache
(its own, documented mechanism) in a folder of this run, the first compilation of a step and its autotuning are
written there and the others read them: the workers run the very programs, autotuned choices included, that the
timed run ran. torch.compile keeps its own cache in /tmp already, on by default.

The folder is private to the run (JAX runs what the cache holds: a cache others can write is code they can run)
and removed at the end. A cache the user set up (JAX_COMPILATION_CACHE_DIR) is left as it is.
"""

from __future__ import annotations

import os
import sys
import tempfile
from contextlib import contextmanager

from common.environment import environment

FOLDER = "JAX_COMPILATION_CACHE_DIR"


def settings(folder: str) -> dict[str, str]:
    """JAX's environment for a cache in `folder`: every program kept (none is too small or too quick to compile), and
    the autotuner's results kept with them."""
    return {FOLDER: folder,
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES": "xla_gpu_per_fusion_autotune_cache_dir"}


@contextmanager
def shared():
    """A private cache folder for JAX, for this process and the processes it starts inside the block."""
    if os.environ.get(FOLDER):
        yield
        return
    with tempfile.TemporaryDirectory(prefix="course-xla-cache-") as folder:  # mode 0700: this user's alone
        values = settings(folder)
        with environment(values) as before:  # read by JAX where it is imported after this: the workers
            _configure_imported_jax(values)  # ... and where this process imported it already
            try:
                yield
            finally:
                _configure_imported_jax({name: value or "" for name, value in before.items()})


def _configure_imported_jax(environment: dict[str, str]) -> None:
    """The same settings in this process's JAX, if it is imported (from the cache's next use on)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()  # forget a cache already opened, or one found missing: the next compile looks again
    folder = environment[FOLDER] or None
    jax.config.update("jax_compilation_cache_dir", folder)
    if folder:
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
