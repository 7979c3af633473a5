"""Where the measuring scripts (level 7's floors, phases and variants; the matrix-product kernels) keep what they
measured: results/<tag>/<name>."""

from __future__ import annotations

from pathlib import Path

from common.levels import ROOT


def write(tag: str, name: str, lines: list[str]) -> Path:
    """The lines, one per line of results/<tag>/<name>; its path."""
    folder = ROOT / "results" / tag
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("\n".join(lines) + "\n")
    return folder / name
