"""Shared by every level: the list of levels, data, initial weights, input checks, the native binding and the harness."""

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
