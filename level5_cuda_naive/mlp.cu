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
 * All three add an output's terms in the same order, one after another along the sum, so they give the same bits;
 * none uses atomics, so reruns are bit-identical. `python -m common.harness.matmul_kernels` times them against cuBLAS.
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

/* A matrix as kernels 2 and 3 read it: element (i, j) of its (rows, cols) is p[i * row + j * col]. A row-major array
 * has row = its width and col = 1; its transpose is the same floats read with the two strides swapped, no copy. */
struct matrix {
    const float *p;
    int rows, cols;
    int row, col; /* strides, in floats */
    __device__ float at(int i, int j) const { return p[(size_t)i * row + (size_t)j * col]; }
};

/* The row-major (rows, cols) array at p, as stored; and its transpose, (cols, rows). */
static matrix stored(const float *p, int rows, int cols) { return {p, rows, cols, cols, 1}; }
static matrix transposed(const float *p, int rows, int cols) { return {p, cols, rows, 1, cols}; }

/* c (a.rows, b.cols) = a @ b by kernel 2 or 3, and whether the model computes with one of them (below). */
static int matmul(mlp *m, float *c, matrix a, matrix b);
static bool staged(const mlp *m) { return m->matmul == MLP_MATMUL_TILED || m->matmul == MLP_MATMUL_BLOCKED; }

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

/* ---- kernels 2 and 3: one kernel each for all three products, c (M, N) = a (M, K) @ b (K, N) ----
 *   out = x @ w^T:     a = stored(x),        b = transposed(w)
 *   dw = dout^T @ x:   a = transposed(dout), b = stored(x)
 *   dx = dout @ w:     a = stored(dout),     b = stored(w)                                              */

#define SHARED_TILE 16 /* kernel 2: a block is SHARED_TILE x SHARED_TILE threads, one output each */
#define BLOCK_TILE 64  /* kernel 3: a block computes BLOCK_TILE x BLOCK_TILE outputs, */
#define THREAD_TILE 4  /* each of its threads THREAD_TILE x THREAD_TILE of them, */
#define DEPTH 16       /* from tiles DEPTH terms deep along the sum */
#define BLOCK_SIDE (BLOCK_TILE / THREAD_TILE) /* so a block is 16 x 16 threads */

/* The block copies the (rows, cols) tile of a whose corner is (i0, j0) into shared memory, its element (r, c) to
 * tile[r * r_stride + c * c_stride]: 0 where the tile reaches past a's edge. Past the end of a sum those zeros meet
 * the other operand's zeros, and add nothing to an output that is kept. Consecutive threads take consecutive elements
 * along a's contiguous side, so a warp reads neighbouring floats (coalesced) whichever way a is laid out. */
__device__ void stage_tile(float *tile, int r_stride, int c_stride, matrix a, int i0, int j0, int rows, int cols) {
    const int threads = blockDim.x * blockDim.y, first = threadIdx.y * blockDim.x + threadIdx.x;
    const bool along_rows = a.col == 1; /* a's rows lie contiguous in memory (else its columns do) */
    for (int e = first; e < rows * cols; e += threads) {
        const int r = along_rows ? e / cols : e % rows, c = along_rows ? e % cols : e / rows;
        const int i = i0 + r, j = j0 + c;
        tile[r * r_stride + c * c_stride] = i < a.rows && j < a.cols ? a.at(i, j) : 0.0f;
    }
}

/* Kernel 2, tiled. Block (bx, by) computes the SHARED_TILE x SHARED_TILE outputs whose corner is (by, bx) x
 * SHARED_TILE; thread (tx, ty) the one in row ty, column tx of them. Along the sum, SHARED_TILE terms at a time, the
 * block stages the tile of a beside its outputs and the tile of b above them, and each thread adds its terms from
 * shared memory. A float read once from global memory serves SHARED_TILE threads. (Each tile row is padded by one
 * float: a column of the tile then spans 16 memory banks, not one, when it is written along a's columns.) */
__global__ void matmul_tiled_kernel(float *c, matrix a, matrix b) {
    __shared__ float a_tile[SHARED_TILE][SHARED_TILE + 1], b_tile[SHARED_TILE][SHARED_TILE + 1];
    const int row0 = blockIdx.y * SHARED_TILE, col0 = blockIdx.x * SHARED_TILE;
    float sum = 0.0f;
    for (int k0 = 0; k0 < a.cols; k0 += SHARED_TILE) {
        stage_tile(&a_tile[0][0], SHARED_TILE + 1, 1, a, row0, k0, SHARED_TILE, SHARED_TILE);
        stage_tile(&b_tile[0][0], SHARED_TILE + 1, 1, b, k0, col0, SHARED_TILE, SHARED_TILE);
        __syncthreads(); /* both tiles are whole before any thread reads them */
        for (int k = 0; k < SHARED_TILE; k++) sum += a_tile[threadIdx.y][k] * b_tile[k][threadIdx.x];
        __syncthreads(); /* every thread is done with these tiles before the next ones are staged over them */
    }
    const int row = row0 + threadIdx.y, col = col0 + threadIdx.x;
    if (row < a.rows && col < b.cols) c[(size_t)row * b.cols + col] = sum;
}

/* Kernel 3, register blocking. Block (bx, by) computes the BLOCK_TILE x BLOCK_TILE outputs whose corner is (by, bx) x
 * BLOCK_TILE; thread (tx, ty) the THREAD_TILE x THREAD_TILE of them in rows ty, ty + BLOCK_SIDE, ... and columns tx,
 * tx + BLOCK_SIDE, ... (spread out, so that a warp's reads of shared memory and writes of c are neighbouring floats),
 * their sums in registers. For each term k of a tile, a thread reads THREAD_TILE floats of a's column k and THREAD_TILE
 * of b's row k from shared memory and makes all their products: 8 reads for 16 multiply-adds, where kernel 2 makes 2
 * reads for 1. a's tile is kept transposed, k first, so that a column of a is a row of shared memory. */
__global__ void matmul_blocked_kernel(float *c, matrix a, matrix b) {
    __shared__ float a_tile[DEPTH][BLOCK_TILE + 1], b_tile[DEPTH][BLOCK_TILE + 1]; /* a_tile[k][i] = a(row0 + i, k) */
    const int row0 = blockIdx.y * BLOCK_TILE, col0 = blockIdx.x * BLOCK_TILE;
    float sum[THREAD_TILE][THREAD_TILE] = {};
    for (int k0 = 0; k0 < a.cols; k0 += DEPTH) {
        stage_tile(&a_tile[0][0], 1, BLOCK_TILE + 1, a, row0, k0, BLOCK_TILE, DEPTH);
        stage_tile(&b_tile[0][0], BLOCK_TILE + 1, 1, b, k0, col0, DEPTH, BLOCK_TILE);
        __syncthreads(); /* both tiles are whole before any thread reads them */
#pragma unroll
        for (int k = 0; k < DEPTH; k++) {
            float a_k[THREAD_TILE], b_k[THREAD_TILE];
#pragma unroll
            for (int i = 0; i < THREAD_TILE; i++) a_k[i] = a_tile[k][threadIdx.y + i * BLOCK_SIDE];
#pragma unroll
            for (int j = 0; j < THREAD_TILE; j++) b_k[j] = b_tile[k][threadIdx.x + j * BLOCK_SIDE];
#pragma unroll
            for (int i = 0; i < THREAD_TILE; i++)
#pragma unroll
                for (int j = 0; j < THREAD_TILE; j++) sum[i][j] += a_k[i] * b_k[j];
        }
        __syncthreads(); /* every thread is done with these tiles before the next ones are staged over them */
    }
#pragma unroll
    for (int i = 0; i < THREAD_TILE; i++)
#pragma unroll
        for (int j = 0; j < THREAD_TILE; j++) {
            const int row = row0 + threadIdx.y + i * BLOCK_SIDE, col = col0 + threadIdx.x + j * BLOCK_SIDE;
            if (row < a.rows && col < b.cols) c[(size_t)row * b.cols + col] = sum[i][j];
        }
}

static int matmul(mlp *m, float *c, matrix a, matrix b) {
    const bool tiled = m->matmul == MLP_MATMUL_TILED;
    dim3 grid;
    const int status = grid_for(&grid, a.rows, b.cols, tiled ? SHARED_TILE : BLOCK_TILE);
    if (status) return status;
    if (tiled)
        matmul_tiled_kernel<<<grid, dim3(SHARED_TILE, SHARED_TILE), 0, m->stream>>>(c, a, b);
    else
        matmul_blocked_kernel<<<grid, dim3(BLOCK_SIDE, BLOCK_SIDE), 0, m->stream>>>(c, a, b);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
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
