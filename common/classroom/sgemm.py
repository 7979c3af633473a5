"""cublasSgemm's layout rules, emulated in NumPy on flat float32 buffers, the way level6_cublas/mlp.cu hands cuBLAS
its row-major arrays. The level 6 chapter shows the layout table with it; the lab's grader checks level 6's three
calls with it where there is no GPU (tests/test_tasks.py).
"""

from __future__ import annotations

import numpy as np


def sgemm(op_a: str, op_b: str, m: int, n: int, k: int, alpha: float, A: np.ndarray, lda: int, B: np.ndarray,
          ldb: int, beta: float, C: np.ndarray, ldc: int) -> None:
    """C (m, n) = alpha op_a(A) (m, k) @ op_b(B) (k, n) + beta C, in place, every array a flat buffer read column-major.

    cublasSgemm's arguments, in its order (less the handle; alpha and beta by value). op is "N" (as stored) or "T"
    (transposed). Element (i, j) of a column-major array with leading dimension ld is float i + j * ld. Like cuBLAS,
    an ld smaller than the array's rows as stored is refused (ValueError, cuBLAS's CUBLAS_STATUS_INVALID_VALUE);
    reading or writing past the end of a buffer raises IndexError, where a GPU would use whatever lies there.
    """

    def at(buf: np.ndarray, rows: int, cols: int, ld: int, name: str) -> np.ndarray:
        """The flat indices of a column-major (rows, cols) array with leading dimension ld."""
        if ld < max(1, rows):
            raise ValueError(f"CUBLAS_STATUS_INVALID_VALUE: ld{name} = {ld} < {rows} rows of {name} as stored")
        index = np.arange(rows)[:, None] + np.arange(cols)[None, :] * ld
        if index.size and index.max() >= buf.size:
            raise IndexError(f"touches float {index.max()} of {name}, which holds {buf.size}: on a GPU, any float")
        return index

    a = A[at(A, k, m, lda, "a")].T if op_a == "T" else A[at(A, m, k, lda, "a")]
    b = B[at(B, n, k, ldb, "b")].T if op_b == "T" else B[at(B, k, n, ldb, "b")]
    c = at(C, m, n, ldc, "c")
    C[c] = alpha * (a.astype(np.float64) @ b) + beta * C[c]
