"""What every level shares, in rooms, each importing only the rooms below it (pyproject.toml's import-linter contract):

    nets/       each network's definition, the one list of networks, and the one list of optimizers
    levels.py   the one list of levels
    contract/   the checks of every input, the same at every level; arrays on the device
    native/     the one cffi binding of the C and CUDA levels, their headers and shared CUDA code
    harness/    data, training every level side by side, verifying, timing, serving
    classroom/  the student edition, its grade, a class's gradebook and the sandbox its code runs in
    book/       the chapters' helpers and figures, and making the chapters
"""

from pathlib import Path as _Path


def _check_edition() -> None:
    """Inside a student edition (a folder holding LAB_EDITION, made by `make lab`), refuse to be imported from
    anywhere but that edition: code run there must be the student's, not another copy of the course."""
    root = _Path(__file__).resolve().parent.parent
    here = _Path.cwd().resolve()
    edition = next((folder for folder in (here, *here.parents) if (folder / "LAB_EDITION").is_file()), None)
    if edition is not None and edition != root:
        raise ImportError(
            f"this is the student edition in {edition}, but Python imported the course's `common` from {root}, "
            f"whose code is not the edition's. Use the edition's own environment: `make venv` in {edition} (make "
            f"grade makes it too), then {edition}/.venv/bin/python, or `make notebooks` there for the chapters.")


_check_edition()
