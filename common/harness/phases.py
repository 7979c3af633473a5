"""Where a job's wall time goes, phase by phase: make bench and make compare print this table at the end.

    clock = Phases()
    with clock("data"):
        ...
    print(clock.table())

A phase entered several times adds up (e.g. each round of a row's timed epochs).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager


class Phases:
    """Seconds of wall time per named phase, in the order the phases were first entered."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        """Count time measured elsewhere (a worker process's) under a phase."""
        self.seconds[name] += seconds

    def merge(self, other: dict[str, float], prefix: str = "") -> None:
        """Add another clock's phases (its `seconds`), each name prefixed."""
        for name, seconds in other.items():
            self.seconds[prefix + name] += seconds

    def table(self, total: float, title: str = "", rest: str = "the rest (setup, checks, tables)") -> str:
        """The phases as a text table, seconds and share of `total` (the whole job's wall time), the rest last."""
        rows = {**self.seconds, **({rest: max(total - sum(self.seconds.values()), 0.0)} if rest else {})}
        title = title or f"where the {total:.0f} s went"
        width = max([len(name) for name in rows] + [len(title)])
        lines = [f"{title:<{width}}  {'seconds':>8}  {'share':>6}", "-" * (width + 18)]
        return "\n".join(lines + [f"{name:<{width}}  {s:8.1f}  {s / max(total, 1e-9):6.1%}" for name, s in rows.items()])
