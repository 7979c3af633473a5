"""Environment variables set for a block and put back after it: how a job hands settings to the processes it starts
(they inherit the environment), e.g. BLAS on one thread in the lockstep's workers, or JAX's cache folder."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def environment(values: dict[str, str]) -> Iterator[dict[str, str | None]]:
    """os.environ with `values` inside the block; after it, each variable as it was (unset where it was). Yields the
    values before."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield before
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
