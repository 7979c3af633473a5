/* level5_cuda_naive/mlp.cu - Level 5: the MLP in CUDA, with matrix products we wrote ourselves.
 *
 * What this level adds over level 4: the same step, moved to the GPU. Each loop nest of level 4
 * becomes a kernel in which one thread computes one output element, and thousands run at once.
 * The model lives in device memory: the training set is uploaded once (mlp_set_data), every
 * batch is gathered on the device, and a whole epoch is queued on one stream with no copy and no
 * wait per step; the per-step losses come back in one copy at the end.
 * Everything but the matrix products is shared with level 6, in common/native/cuda_mlp.cuh.
 *
 * The products come as three kernels, in teaching order (cuBLAS, level 6's, is kernel 0: the reference they are
 * measured against); mlp_set_matmul chooses one per model:
 *   kernel 1, naive (the default): each thread reads its whole row and column from global memory, with no reuse.
 *     Correct and simple, and level 6 shows how far from the hardware's speed it is.
 *   kernel 2, tiled: a block stages a tile of each operand in shared memory, and each float it reads from global
 *     memory serves SHARED_TILE threads.
 *   kernel 3, blocked: each thread computes a THREAD_TILE x THREAD_TILE block of outputs in registers, from tiles in
 *     shared memory: a float read from shared memory serves THREAD_TILE products.
 * Kernel 1 is here; kernels 2 and 3 are in matmul.cuh. All three add an output's terms in the same order, one after
 * another along the sum, so they give the same bits; none uses atomics, so reruns are bit-identical.
 * `python -m common.harness.matmul_kernels` times them against cuBLAS.
 *
 * Implements common/native/mlp.h. Build: `make level5`; test: `pytest -m level5`; on a GPU machine,
 * `make test-gpu` builds levels 4-6 and runs every test, GPU ones included.
 */
#include "cuda_mlp.cuh"

#define TILE 16          /* kernel 1: a block is TILE x TILE threads, each computing one output element */
#define MAX_GRID_Y 65535 /* CUDA's limit on gridDim.y */

/* The grid of blocks of side x side outputs that covers a (rows, cols) output: x runs along a row (so neighbouring
 * threads write neighbouring floats), y down the rows. */
static int grid_for(dim3 *grid, int rows, int cols, int side) {
    const int row_blocks = (rows + side - 1) / side;
    if (row_blocks > MAX_GRID_Y)
        return FAIL(MLP_ERR_ARG, "%d rows exceed this kernel's %d per matrix product (grid y <= %d blocks of %d)", rows,
                    MAX_GRID_Y * side, MAX_GRID_Y, side);
    *grid = dim3((cols + side - 1) / side, row_blocks);
    return MLP_OK;
}

#include "matmul.cuh" /* kernels 2 and 3, which launch on grid_for's grids */

/* ---- kernel 1, naive: one thread per output ---- */

/* out (B, n_out) = x (B, n_in) @ w^T, w (n_out, n_in): thread (r, o) takes the dot product of x's
 * row r and w's row o, the body of level 4's loop nest. */
__global__ void linear_forward_kernel(float *out, const float *x, const float *w, int B, int n_in, int n_out) {
    /* BEGIN LAB 5.1 linear_forward */
    const int o = blockIdx.x * blockDim.x + threadIdx.x;
    const int r = blockIdx.y * blockDim.y + threadIdx.y;
    if (r >= B || o >= n_out) return;
    const float *x_row = x + (size_t)r * n_in, *w_row = w + (size_t)o * n_in;
    float sum = 0.0f;
    for (int k = 0; k < n_in; k++) sum += x_row[k] * w_row[k];
    out[(size_t)r * n_out + o] = sum;
    /* END LAB */
}

/* The forward product by the model's kernel: out = x @ w^T, the first of a step's three products. */
static int linear_forward(mlp *m, float *out, const float *x, const float *w, int B, int n_in, int n_out) {
    if (staged(m)) return matmul(m, out, stored(x, B, n_in), transposed(w, n_out, n_in));
    /* BEGIN LAB 5.1 linear_forward */
    dim3 grid;
    const int status = grid_for(&grid, B, n_out, TILE);
    if (status) return status;
    linear_forward_kernel<<<grid, dim3(TILE, TILE), 0, m->stream>>>(out, x, w, B, n_in, n_out);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
    /* END LAB */
}

/* Backward of out = x @ w^T, first product: dw (n_out, n_in) = dout^T (n_out, B) @ x (B, n_in).
 * Thread (o, k) sums dout[r, o] * x[r, k] over the batch rows r. */
__global__ void linear_backward_dw_kernel(float *dw, const float *dout, const float *x, int B, int n_in, int n_out) {
    /* BEGIN LAB 5.2 linear_backward */
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    const int o = blockIdx.y * blockDim.y + threadIdx.y;
    if (o >= n_out || k >= n_in) return;
    float sum = 0.0f;
    for (int r = 0; r < B; r++) sum += dout[(size_t)r * n_out + o] * x[(size_t)r * n_in + k];
    dw[(size_t)o * n_in + k] = sum;
    /* END LAB */
}

/* Second product: dx (B, n_in) = dout (B, n_out) @ w (n_out, n_in).
 * Thread (r, k) sums dout[r, o] * w[o, k] over the layer's outputs o. */
__global__ void linear_backward_dx_kernel(float *dx, const float *dout, const float *w, int B, int n_in, int n_out) {
    /* BEGIN LAB 5.2 linear_backward */
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    const int r = blockIdx.y * blockDim.y + threadIdx.y;
    if (r >= B || k >= n_in) return;
    const float *dout_row = dout + (size_t)r * n_out;
    float sum = 0.0f;
    for (int o = 0; o < n_out; o++) sum += dout_row[o] * w[(size_t)o * n_in + k];
    dx[(size_t)r * n_in + k] = sum;
    /* END LAB */
}

/* dw = dout^T @ x by the model's kernel. */
static int linear_backward_dw(mlp *m, float *dw, const float *dout, const float *x, int B, int n_in, int n_out) {
    if (staged(m)) return matmul(m, dw, transposed(dout, B, n_out), stored(x, B, n_in));
    /* BEGIN LAB 5.2 linear_backward */
    dim3 grid;
    const int status = grid_for(&grid, n_out, n_in, TILE);
    if (status) return status;
    linear_backward_dw_kernel<<<grid, dim3(TILE, TILE), 0, m->stream>>>(dw, dout, x, B, n_in, n_out);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
    /* END LAB */
}

/* dx = dout @ w by the model's kernel. */
static int linear_backward_dx(mlp *m, float *dx, const float *dout, const float *w, int B, int n_in, int n_out) {
    if (staged(m)) return matmul(m, dx, stored(dout, B, n_out), stored(w, n_out, n_in));
    /* BEGIN LAB 5.2 linear_backward */
    dim3 grid;
    const int status = grid_for(&grid, B, n_in, TILE);
    if (status) return status;
    linear_backward_dx_kernel<<<grid, dim3(TILE, TILE), 0, m->stream>>>(dx, dout, w, B, n_in, n_out);
    CUDA_CHECK(cudaGetLastError());
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

/* ---- the level's state: none but its matrix product ---- */

static int check_matmul(int matmul) {
    if (matmul != MLP_MATMUL_NAIVE && matmul != MLP_MATMUL_TILED && matmul != MLP_MATMUL_BLOCKED)
        return FAIL(MLP_ERR_ARG, "level 5's matrix products are naive, tiled and blocked (%d, %d and %d), got %d",
                    MLP_MATMUL_NAIVE, MLP_MATMUL_TILED, MLP_MATMUL_BLOCKED, matmul);
    return MLP_OK;
}

/* Level 5 keeps no state of its own: its kernels need only the model's stream, and its choice of kernel. */
static int level_create(mlp *m) {
    m->matmul = MLP_MATMUL_NAIVE;
    return MLP_OK;
}

static int level_destroy(mlp *) { return MLP_OK; }
