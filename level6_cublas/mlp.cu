/* level6_cublas/mlp.cu - Level 6: the MLP in CUDA, with cuBLAS for the matrix products.
 *
 * What this level adds over level 5: the three matrix products (x @ w^T, dout^T @ x, dout @ w),
 * which take nearly all of a step's time, become cublasSgemm calls. cuBLAS's kernels keep tiles of
 * both operands in shared memory and registers and reuse each loaded float many times, where
 * level 5's threads each read a whole row and column from global memory. Nothing else changes:
 * the rest of the step, the device-resident data and the one-stream epoch are common/native/cuda_mlp.cuh,
 * shared with level 5, so diffing the two files shows only the products.
 * The new thing to get right is layout: cuBLAS is column-major, our arrays are row-major (below).
 *
 * Implements common/native/mlp.h. Build: `make level6` (links cuBLAS from the CUDA toolkit, or from the
 * nvidia-cublas wheel); test: `pytest -m level6`; on a GPU machine, `make test-gpu` builds levels
 * 4-6 and runs every test, GPU ones included.
 */
#include "cuda_mlp.cuh"

#include <cublas_v2.h>

/* After every cuBLAS call, like CUDA_CHECK: on failure, returns the status from the enclosing
 * function with "file:line: call: reason" as the message. */
#define CUBLAS_CHECK(call)                                                                             \
    do {                                                                                               \
        const cublasStatus_t status_ = (call);                                                         \
        if (status_ != CUBLAS_STATUS_SUCCESS)                                                          \
            return FAIL(status_ == CUBLAS_STATUS_ALLOC_FAILED ? MLP_ERR_ALLOC : MLP_ERR_DEVICE, "%s: %s", \
                        #call, cublasGetStatusString(status_));                                        \
    } while (0)

static cublasHandle_t cublas(mlp *m) { return static_cast<cublasHandle_t>(m->level_state); }

/* alpha and beta of the products below: cuBLAS reads them from host memory (its default pointer mode).
 * (Unused in `make lab`'s student edition until its products are written.) */
[[maybe_unused]] static const float one = 1.0f, zero = 0.0f;

/* Row-major arrays, column-major cuBLAS.
 *
 * cublasSgemm(handle, opA, opB, m, n, k, &alpha, A, lda, B, ldb, &beta, C, ldc) computes, all
 * column-major, C (m, n) = alpha * opA(A) (m, k) @ opB(B) (k, n) + beta * C, where op is N (as
 * stored) or T (transposed), and ld ("leading dimension") is the distance in floats from one column
 * to the next of the array as stored.
 *
 * The key fact: the same floats read row-major as (R, C) read column-major as (C, R), the
 * transpose, with ld = C. So every row-major array M we hand to cuBLAS is seen as M^T, and ld is
 * always its row-major width. To get a row-major product P = X @ Y, ask cuBLAS for the column-major
 * P^T = Y^T @ X^T: swap the two operands, keep each one's N or T, set m = P's columns, n = P's rows,
 * k = the summed dimension, and ld of each array = its row-major width. (In the table, B in a size
 * is the batch; the A, B, C columns are cuBLAS's operands.)
 *
 *   row-major product              = column-major       opA opB  m     n     k     A    lda   B     ldb    C    ldc
 *   out (B, n_out) = x @ w^T       out^T = w @ x^T       T   N   n_out B     n_in  w    n_in  x     n_in   out  n_out
 *   dw (n_out, n_in) = dout^T @ x  dw^T = x^T @ dout     N   T   n_in  n_out B     x    n_in  dout  n_out  dw   n_in
 *   dx (B, n_in) = dout @ w        dx^T = w^T @ dout^T   N   N   n_in  B     n_out w    n_in  dout  n_out  dx   n_in
 *
 * Check the first row against cuBLAS's own rules (A as stored is m x k for N or k x m for T, with
 * lda >= its number of rows; B likewise, k x n or n x k): cuBLAS sees w as the column-major
 * (n_in, n_out) = k x m, so T turns it into the w we want, lda = n_in; it sees x as (n_in, B) =
 * k x n, already the x^T we want, so N, ldb = n_in; it writes out as (n_out, B) = m x n, ldc = n_out.
 * A wrong ld does not crash: it silently reads the wrong floats, so the tests compare with PyTorch. */

/* out (B, n_out) = x (B, n_in) @ w^T, w (n_out, n_in): first row of the table. beta = 0 overwrites out. */
static int linear_forward(mlp *m, float *out, const float *x, const float *w, int B, int n_in, int n_out) {
    /* BEGIN LAB 6.1 out = x @ w^T */
    CUBLAS_CHECK(cublasSgemm(cublas(m), CUBLAS_OP_T, CUBLAS_OP_N, n_out, B, n_in, &one, w, n_in, x, n_in, &zero, out,
                             n_out));
    return MLP_OK;
    /* END LAB */
}

/* Backward of out = x @ w^T, given dout (B, n_out), x (B, n_in): dw (n_out, n_in) = dout^T @ x, the second row of
 * the table. */
static int linear_backward_dw(mlp *m, float *dw, const float *dout, const float *x, int B, int n_in, int n_out) {
    /* BEGIN LAB 6.2 dw = dout^T @ x */
    CUBLAS_CHECK(cublasSgemm(cublas(m), CUBLAS_OP_N, CUBLAS_OP_T, n_in, n_out, B, &one, x, n_in, dout, n_out, &zero, dw,
                             n_in));
    return MLP_OK;
    /* END LAB */
}

/* dx (B, n_in) = dout (B, n_out) @ w (n_out, n_in), the third row. */
static int linear_backward_dx(mlp *m, float *dx, const float *dout, const float *w, int B, int n_in, int n_out) {
    /* BEGIN LAB 6.3 dx = dout @ w */
    CUBLAS_CHECK(cublasSgemm(cublas(m), CUBLAS_OP_N, CUBLAS_OP_N, n_in, B, n_out, &one, w, n_in, dout, n_out, &zero, dx,
                             n_in));
    return MLP_OK;
    /* END LAB */
}

/* Backward of out = x @ w^T: dw, and dx unless it is NULL (the first layer needs none). */
static int linear_backward(mlp *m, float *dx, float *dw, const float *dout, const float *x, const float *w, int B,
                           int n_in, int n_out) {
    const int status = linear_backward_dw(m, dw, dout, x, B, n_in, n_out);
    if (status || !dx) return status;
    return linear_backward_dx(m, dx, dout, w, B, n_in, n_out);
}

/* Levels 6 and 7 (which includes this file) compute every product with cuBLAS: they have nothing to choose. */
static int check_matmul(int matmul) {
    if (matmul != MLP_MATMUL_CUBLAS)
        return FAIL(MLP_ERR_ARG, "levels 6 and 7 compute their matrix products with cuBLAS (%d), got %d",
                    MLP_MATMUL_CUBLAS, matmul);
    return MLP_OK;
}

/* One cuBLAS handle per model, queuing its work on the model's stream, so the GEMMs stay in order
 * with the shared kernels and an epoch still needs no synchronization per step.
 * Math mode: CUBLAS_DEFAULT_MATH computes float products in float. TF32 tensor cores
 * (CUBLAS_TF32_TENSOR_OP_MATH) would round every input to 10 mantissa bits: faster, but the
 * losses would drift from PyTorch's, which keeps TF32 off for matmuls by default. We set the mode
 * explicitly rather than rely on the default. */
static int level_create(mlp *m) {
    cublasHandle_t handle = NULL;
    CUBLAS_CHECK(cublasCreate(&handle));
    m->level_state = handle;
    CUBLAS_CHECK(cublasSetStream(handle, m->stream));
    CUBLAS_CHECK(cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH));
    m->matmul = MLP_MATMUL_CUBLAS;
    return MLP_OK;
}

static int level_destroy(mlp *m) {
    if (!m->level_state) return MLP_OK;
    cublasHandle_t handle = cublas(m);
    m->level_state = NULL;
    CUBLAS_CHECK(cublasDestroy(handle));
    return MLP_OK;
}
