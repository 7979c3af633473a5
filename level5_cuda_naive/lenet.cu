/* level5_cuda_naive/lenet.cu - Level 5 for LeNet-5: the convolutions and the max-pooling as CUDA kernels.
 *
 * What this adds over level4_c/lenet.c: each of its loop nests becomes a kernel with one thread per output, as the
 * MLP's did at this level; the fully connected layers, ReLU, softmax, the batch gather and SGD are the MLP's kernels
 * (mlp.cu, included below), and the model on the device and the step are common/native/cuda_lenet.cuh, shared with level 6.
 * The backward pass uses no atomics: dx is gathered, one thread
 * per input element summing the outputs it fed, and dw is one thread per weight summing its batch and positions in
 * a fixed order, so reruns are bit-identical.
 *
 * Then the lesson of the level, a tiled convolution: a block loads its tile of the input, with the halo of K - 1
 * rows and columns that the tile's outputs also read, and its filters into shared memory once; each thread then
 * keeps what it reads in registers and reuses it for several outputs. lenet_set_convolution chooses (LENET_DIRECT
 * or LENET_TILED); both are verified, and `python -m common.book.capture_tiling` measures them against each other.
 *
 * Implements common/native/lenet.h with common/native/cuda_lenet.cuh. Build: `make level5`; test: `pytest -m "lenet and level5"` on a
 * GPU machine.
 */
#include "mlp.cu"

#include "cuda_lenet.cuh"

/* The tiled convolution's shape (-D to try others): a block computes a CONV_TILE x CONV_TILE square of outputs of
 * CONV_IMAGES images for CONV_FILTERS filters, each thread CONV_COLUMNS of a row. */
#ifndef CONV_TILE
#define CONV_TILE 8
#endif
#ifndef CONV_IMAGES
#define CONV_IMAGES 4
#endif
#ifndef CONV_FILTERS
#define CONV_FILTERS 2
#endif
#ifndef CONV_COLUMNS
#define CONV_COLUMNS 2
#endif

/* ---- the convolution, direct: one thread per output; forward followed by backward ---- */

/* out (B, F, OH, OH) = x (B, C, H, H) correlated with w (F, C, k, k), + b (F); stride 1, no padding, OH = H - k + 1.
 * Thread (n, f, oy, ox) starts at the bias and adds the k x k window of every channel, in level 4's order. */
__global__ void conv2d_forward_kernel(float *out, const float *x, const float *w, const float *b, int B, int C, int H,
                                      int F, int k) {
    /* BEGIN LAB 5.11 conv2d_forward */
    const int OH = H - k + 1;
    const size_t i = thread_index();
    if (i >= (size_t)B * F * OH * OH) return;
    const int ox = (int)(i % OH), oy = (int)(i / OH % OH), f = (int)(i / ((size_t)OH * OH) % F);
    const size_t n = i / ((size_t)F * OH * OH);
    float sum = b[f];
    for (int c = 0; c < C; c++) {
        const float *in = x + ((n * C + c) * H + oy) * H + ox, *wk = w + ((size_t)f * C + c) * k * k;
        for (int u = 0; u < k; u++)
            for (int v = 0; v < k; v++) sum += wk[u * k + v] * in[u * H + v];
    }
    out[i] = sum;
    /* END LAB */
}

static int conv2d_forward(lenet *m, float *out, const float *x, const float *w, const float *b, int B, int C, int H,
                          int F, int k) {
    /* BEGIN LAB 5.11 conv2d_forward */
    const size_t n = (size_t)B * F * (H - k + 1) * (H - k + 1);
    conv2d_forward_kernel<<<blocks_for(n), THREADS, 0, m->base.stream>>>(out, x, w, b, B, C, H, F, k);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
    /* END LAB */
}

/* dx (B, C, H, H): thread (n, c, y, x) gathers every output its input fed, dout[n, f, y - u, x - v] * w[f, c, u, v]
 * over the filters f and the kernel positions (u, v) that stay inside the output; no two threads write one element. */
__global__ void conv2d_backward_dx_kernel(float *dx, const float *dout, const float *w, int B, int C, int H, int F,
                                          int k) {
    const int OH = H - k + 1;
    const size_t i = thread_index();
    if (i >= (size_t)B * C * H * H) return;
    const int col = (int)(i % H), row = (int)(i / H % H), c = (int)(i / ((size_t)H * H) % C);
    const size_t n = i / ((size_t)C * H * H);
    float sum = 0.0f;
    for (int f = 0; f < F; f++)
        for (int u = row - OH + 1 > 0 ? row - OH + 1 : 0; u < k && u <= row; u++)
            for (int v = col - OH + 1 > 0 ? col - OH + 1 : 0; v < k && v <= col; v++)
                sum += dout[((n * F + f) * OH + row - u) * OH + col - v] * w[(((size_t)f * C + c) * k + u) * k + v];
    dx[i] = sum;
}

/* dw (F, C, k, k): thread (f, c, u, v) sums dout[n, f, oy, ox] * x[n, c, oy + u, ox + v] over the positions of each
 * image, then adds the images in order (as level 4). db (F): thread f sums dout over the same. */
__global__ void conv2d_backward_dw_kernel(float *dw, const float *dout, const float *x, int B, int C, int H, int F,
                                          int k) {
    const int OH = H - k + 1;
    const size_t i = thread_index();
    if (i >= (size_t)F * C * k * k) return;
    const int v = (int)(i % k), u = (int)(i / k % k), c = (int)(i / ((size_t)k * k) % C);
    const int f = (int)(i / ((size_t)C * k * k));
    float total = 0.0f;
    for (size_t n = 0; n < (size_t)B; n++) {
        const float *g = dout + (n * F + f) * OH * OH, *in = x + ((n * C + c) * H + u) * H + v;
        float sum = 0.0f;
        for (int oy = 0; oy < OH; oy++)
            for (int ox = 0; ox < OH; ox++) sum += g[oy * OH + ox] * in[oy * H + ox];
        total += sum;
    }
    dw[i] = total;
}

__global__ void conv2d_backward_db_kernel(float *db, const float *dout, int B, int F, int OH) {
    const size_t f = thread_index();
    if (f >= (size_t)F) return;
    float total = 0.0f;
    for (size_t n = 0; n < (size_t)B; n++) {
        const float *g = dout + (n * F + f) * OH * OH;
        float sum = 0.0f;
        for (int p = 0; p < OH * OH; p++) sum += g[p];
        total += sum;
    }
    db[f] = total;
}

/* Backward of conv2d_forward: given dout (B, F, OH, OH), writes dw (F, C, k, k), db (F) and, unless NULL,
 * dx (B, C, H, H) (the first layer needs none). */
static int conv2d_backward(lenet *m, float *dx, float *dw, float *db, const float *dout, const float *x, const float *w,
                           int B, int C, int H, int F, int k) {
    const cudaStream_t s = m->base.stream;
    conv2d_backward_dw_kernel<<<blocks_for((size_t)F * C * k * k), THREADS, 0, s>>>(dw, dout, x, B, C, H, F, k);
    CUDA_CHECK(cudaGetLastError());
    conv2d_backward_db_kernel<<<blocks_for(F), THREADS, 0, s>>>(db, dout, B, F, H - k + 1);
    CUDA_CHECK(cudaGetLastError());
    if (!dx) return MLP_OK;
    conv2d_backward_dx_kernel<<<blocks_for((size_t)B * C * H * H), THREADS, 0, s>>>(dx, dout, w, B, C, H, F, k);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
}

/* ---- the convolution, tiled: inputs read once per block into shared memory, then reused from registers ---- */

/* The forward of conv2d_forward_kernel for LeNet's 5 x 5 kernels (K), the same sums in the same order, so the same
 * bits. Block (images, tile, filter group) first copies, for CONV_IMAGES images, the tile's inputs -
 * (CONV_TILE + K - 1)^2 per channel: the tile's positions and the halo that their windows reach past them - and
 * CONV_FILTERS filters into shared memory. Then each thread computes CONV_COLUMNS neighbouring outputs of one row for each of those filters:
 * an input row it has loaded into registers feeds up to K * CONV_COLUMNS * CONV_FILTERS multiply-adds, and a weight
 * CONV_COLUMNS. A direct thread loads two numbers for every multiply-add. */
static_assert(CONV_TILE % CONV_COLUMNS == 0, "a thread's outputs lie in one tile");
enum { IN = CONV_TILE + K - 1, ROW_THREADS = CONV_TILE / CONV_COLUMNS, IMAGE_THREADS = ROW_THREADS * CONV_TILE };

__global__ void conv2d_forward_tiled_kernel(float *out, const float *x, const float *w, const float *b, int B, int C,
                                            int H, int F) {
    /* BEGIN LAB 5.12 conv2d_forward_tiled */
    extern __shared__ float shared[];
    const int OH = H - K + 1, tiles = (OH + CONV_TILE - 1) / CONV_TILE;
    const int tile = blockIdx.x % (tiles * tiles), oy0 = tile / tiles * CONV_TILE, ox0 = tile % tiles * CONV_TILE;
    const int n0 = blockIdx.x / (tiles * tiles) * CONV_IMAGES, f0 = blockIdx.y * CONV_FILTERS;
    const int filters = F - f0 < CONV_FILTERS ? F - f0 : CONV_FILTERS;
    float *inputs = shared, *weights = shared + CONV_IMAGES * C * IN * IN; /* (images, C, IN, IN), (filters, C, K, K) */
    for (int e = threadIdx.x; e < CONV_IMAGES * C * IN * IN; e += blockDim.x) {
        const int n = n0 + e / (C * IN * IN), c = e / (IN * IN) % C, row = oy0 + e / IN % IN, col = ox0 + e % IN;
        const bool inside = n < B && row < H && col < H; /* past an edge: never read for an output we write */
        inputs[e] = inside ? x[(((size_t)n * C + c) * H + row) * H + col] : 0.0f;
    }
    for (int e = threadIdx.x; e < CONV_FILTERS * C * K * K; e += blockDim.x)
        weights[e] = e < filters * C * K * K ? w[(size_t)f0 * C * K * K + e] : 0.0f;
    __syncthreads(); /* every input and weight is in shared memory before anyone reads one */
    const int image = threadIdx.x / IMAGE_THREADS, r = threadIdx.x / ROW_THREADS % CONV_TILE;
    const int c0 = threadIdx.x % ROW_THREADS * CONV_COLUMNS; /* this thread's first column in the tile */
    const size_t n = (size_t)n0 + image;
    const int oy = oy0 + r, ox = ox0 + c0;
    if (n >= (size_t)B || oy >= OH || ox >= OH) return;
    float sum[CONV_FILTERS][CONV_COLUMNS];
    for (int f = 0; f < CONV_FILTERS; f++)
        for (int j = 0; j < CONV_COLUMNS; j++) sum[f][j] = f < filters ? b[f0 + f] : 0.0f;
    for (int c = 0; c < C; c++)
        for (int u = 0; u < K; u++) {
            const float *from = inputs + ((image * C + c) * IN + r + u) * IN + c0;
            float row[CONV_COLUMNS + K - 1]; /* the inputs of this kernel row for all of the thread's outputs */
#pragma unroll
            for (int j = 0; j < CONV_COLUMNS + K - 1; j++) row[j] = from[j];
#pragma unroll
            for (int v = 0; v < K; v++)
#pragma unroll
                for (int f = 0; f < CONV_FILTERS; f++) {
                    const float weight = weights[((f * C + c) * K + u) * K + v];
#pragma unroll
                    for (int j = 0; j < CONV_COLUMNS; j++) sum[f][j] += weight * row[j + v];
                }
        }
    for (int f = 0; f < filters; f++)
        for (int j = 0; j < CONV_COLUMNS && ox + j < OH; j++)
            out[((n * F + f0 + f) * OH + oy) * OH + ox + j] = sum[f][j];
    /* END LAB */
}

static int conv2d_forward_tiled(lenet *m, float *out, const float *x, const float *w, const float *b, int B, int C,
                                int H, int F) {
    /* BEGIN LAB 5.12 conv2d_forward_tiled */
    const int tiles = (H - K + CONV_TILE) / CONV_TILE;
    const dim3 grid((unsigned)((B + CONV_IMAGES - 1) / CONV_IMAGES * tiles * tiles),
                    (F + CONV_FILTERS - 1) / CONV_FILTERS);
    const size_t shared = sizeof(float) * ((size_t)CONV_IMAGES * C * IN * IN + (size_t)CONV_FILTERS * C * K * K);
    conv2d_forward_tiled_kernel<<<grid, CONV_IMAGES * IMAGE_THREADS, shared, m->base.stream>>>(out, x, w, b, B, C, H,
                                                                                                F);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
    /* END LAB */
}

/* ---- max-pooling ---- */

/* out (B, C, H/2, H/2) = the maximum of each 2x2 window of a (B, C, H, H); choice gets its position 0..3 in the
 * window (row-major), the first of equal maxima as in PyTorch. One thread per window. */
__global__ void maxpool_forward_kernel(float *out, int *choice, const float *a, int B, int C, int H) {
    const int P = H / 2;
    const size_t i = thread_index();
    if (i >= (size_t)B * C * P * P) return;
    const size_t plane = i / ((size_t)P * P);
    const int py = (int)(i / P % P), px = (int)(i % P);
    const float *win = a + plane * H * H + (size_t)2 * py * H + 2 * px;
    const float v[4] = {win[0], win[1], win[H], win[H + 1]};
    int best = 0;
    for (int j = 1; j < 4; j++) best = v[j] > v[best] ? j : best;
    out[i] = v[best];
    choice[i] = best;
}

static int maxpool_forward(lenet *m, float *out, int *choice, const float *a, int B, int C, int H) {
    const size_t windows = (size_t)B * C * (H / 2) * (H / 2);
    maxpool_forward_kernel<<<blocks_for(windows), THREADS, 0, m->base.stream>>>(out, choice, a, B, C, H);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
}

/* Backward: one thread per element of da (B, C, H, H), which gets its window's dout if it was the window's choice,
 * else 0 - a gather, so every element is written once and nothing needs zeroing first. */
__global__ void maxpool_backward_kernel(float *da, const float *dout, const int *choice, int B, int C, int H) {
    const int P = H / 2;
    const size_t i = thread_index();
    if (i >= (size_t)B * C * H * H) return;
    const int col = (int)(i % H), row = (int)(i / H % H);
    const size_t window = i / ((size_t)H * H) * P * P + (size_t)(row / 2) * P + col / 2;
    da[i] = choice[window] == (row % 2) * 2 + col % 2 ? dout[window] : 0.0f;
}

static int maxpool_backward(lenet *m, float *da, const float *dout, const int *choice, int B, int C, int H) {
    const size_t n = (size_t)B * C * H * H;
    maxpool_backward_kernel<<<blocks_for(n), THREADS, 0, m->base.stream>>>(da, dout, choice, B, C, H);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
}

/* ---- the hooks of common/native/cuda_lenet.cuh ---- */

static int conv_layer(lenet *m, int layer, float *out, const float *x, const float *w, const float *b, int B) {
    const conv_shape s = CONV[layer];
    return m->convolution == LENET_TILED ? conv2d_forward_tiled(m, out, x, w, b, B, s.C, s.H, s.F)
                                         : conv2d_forward(m, out, x, w, b, B, s.C, s.H, s.F, K);
}

static int conv_layer_backward(lenet *m, int layer, float *dx, float *dw, float *db, const float *dout, const float *x,
                               const float *w, int B) {
    const conv_shape s = CONV[layer];
    return conv2d_backward(m, dx, dw, db, dout, x, w, B, s.C, s.H, s.F, K);
}

static int pool_layer(lenet *m, int layer, float *out, const float *a, int B) {
    return maxpool_forward(m, out, layer ? m->choice2 : m->choice1, a, B, POOL[layer].C, POOL[layer].H);
}

static int pool_layer_backward(lenet *m, int layer, float *da, const float *dout, const float *, const float *, int B) {
    return maxpool_backward(m, da, dout, layer ? m->choice2 : m->choice1, B, POOL[layer].C, POOL[layer].H);
}

static int check_convolution(int convolution) {
    if (convolution != LENET_DIRECT && convolution != LENET_TILED)
        return FAIL(MLP_ERR_ARG, "level 5's convolutions are direct and tiled (%d and %d), got %d", LENET_DIRECT,
                    LENET_TILED, convolution);
    return MLP_OK;
}

/* Level 5's kernels need nothing but the model's stream and buffers. */
static int level_state_create(lenet *) { return MLP_OK; }
static int level_state_reserve(lenet *, int) { return MLP_OK; }
static int level_state_destroy(lenet *) { return MLP_OK; }
