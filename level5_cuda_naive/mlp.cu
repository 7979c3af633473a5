/* level5_cuda_naive/mlp.cu - Level 5: the MLP in CUDA, with matrix products we wrote ourselves.
 *
 * What this level adds over level 4: the same step, moved to the GPU. Each loop nest of level 4
 * becomes a kernel in which one thread computes one output element, and thousands run at once.
 * The model lives in device memory: the training set is uploaded once (mlp_set_data), every
 * batch is gathered on the device, and a whole epoch is queued on one stream with no copy and no
 * wait per step; the per-step losses come back in one copy at the end.
 * Everything but the matrix products is shared with level 6, in common/native/cuda_mlp.cuh.
 *
 * The products here are deliberately naive: each thread reads its whole row and column from
 * global memory, with no reuse through shared memory or registers. They are correct and simple,
 * and level 6 (cuBLAS) shows how far from the hardware's speed they are.
 *
 * Implements common/native/mlp.h. Build: `make level5`; test: `pytest -m level5`; on a GPU machine,
 * `make test-gpu` builds levels 4-6 and runs every test, GPU ones included.
 */
#include "cuda_mlp.cuh"

#define TILE 16          /* a block is TILE x TILE threads, each computing one output element */
#define MAX_GRID_Y 65535 /* CUDA's limit on gridDim.y */

/* The grid for one thread per element of a (rows, cols) output: x runs along a row (so neighbouring
 * threads write neighbouring floats), y down the rows. (Unused in `make lab`'s edition until 5.1 is written.) */
[[maybe_unused]] static int grid_for(dim3 *grid, int rows, int cols) {
    const int row_blocks = (rows + TILE - 1) / TILE;
    if (row_blocks > MAX_GRID_Y)
        return FAIL(MLP_ERR_ARG, "%d rows exceed this level's %d per matrix product (grid y <= %d blocks of %d)", rows,
                    MAX_GRID_Y * TILE, MAX_GRID_Y, TILE);
    *grid = dim3((cols + TILE - 1) / TILE, row_blocks);
    return MLP_OK;
}

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

static int linear_forward(mlp *m, float *out, const float *x, const float *w, int B, int n_in, int n_out) {
    /* BEGIN LAB 5.1 linear_forward */
    dim3 grid;
    const int status = grid_for(&grid, B, n_out);
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

static int linear_backward(mlp *m, float *dx, float *dw, const float *dout, const float *x, const float *w, int B,
                           int n_in, int n_out) {
    /* BEGIN LAB 5.2 linear_backward */
    dim3 grid;
    int status = grid_for(&grid, n_out, n_in);
    if (status) return status;
    linear_backward_dw_kernel<<<grid, dim3(TILE, TILE), 0, m->stream>>>(dw, dout, x, B, n_in, n_out);
    CUDA_CHECK(cudaGetLastError());
    if (!dx) return MLP_OK;
    status = grid_for(&grid, B, n_in);
    if (status) return status;
    linear_backward_dx_kernel<<<grid, dim3(TILE, TILE), 0, m->stream>>>(dx, dout, w, B, n_in, n_out);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
    /* END LAB */
}

/* Level 5 keeps no state of its own: its kernels need only the model's stream. */
static int level_create(mlp *) { return MLP_OK; }

static int level_destroy(mlp *) { return MLP_OK; }
