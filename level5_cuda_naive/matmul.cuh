/* level5_cuda_naive/matmul.cuh - level 5's faster matrix products: kernels 2 and 3, one kernel each for the three
 * products of a step, c (M, N) = a (M, K) @ b (K, N):
 *   out = x @ w^T:     a = stored(x),        b = transposed(w)
 *   dw = dout^T @ x:   a = transposed(dout), b = stored(x)
 *   dx = dout @ w:     a = stored(dout),     b = stored(w)
 * Kernel 2 (tiled) stages a tile of each operand in shared memory; kernel 3 (blocked) also keeps a block of outputs per
 * thread in registers. Both add an output's terms in kernel 1's order, so the three give the same bits.
 *
 * Included by level5_cuda_naive/mlp.cu, after grid_for, on whose grids these kernels launch; mlp.cu's products call
 * matmul where the model is set to one of them (mlp_set_matmul).
 */
#ifndef MATMUL_CUH
#define MATMUL_CUH

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

/* Whether the model computes its products with kernel 2 or 3 (matmul, at the end), rather than kernel 1. */
static bool staged(const mlp *m) { return m->matmul == MLP_MATMUL_TILED || m->matmul == MLP_MATMUL_BLOCKED; }

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

/* c (a.rows, b.cols) = a @ b, row-major, by the model's kernel: 2 or 3. */
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

#endif /* MATMUL_CUH */
