/* level5_cuda_naive/lenet.cu - Level 5 for LeNet-5: the convolutions and the max-pooling as CUDA kernels.
 *
 * What this adds over level4_c/lenet.c: each of its loop nests becomes a kernel with one thread per output, as the
 * MLP's did at this level; the fully connected layers, ReLU, softmax, the batch gather and SGD are the MLP's kernels
 * (mlp.cu and common/cuda_mlp.cuh, included below). The backward pass uses no atomics: dx is gathered, one thread
 * per input element summing the outputs it fed, and dw is one thread per weight summing its batch and positions in
 * a fixed order, so reruns are bit-identical.
 *
 * Then the lesson of the level, a tiled convolution: a block loads its tile of the input, with the halo of K - 1
 * rows and columns that the tile's outputs also read, and its filters into shared memory once; each thread then
 * keeps what it reads in registers and reuses it for several outputs. lenet_set_convolution chooses (LENET_DIRECT
 * or LENET_TILED); both are verified, and `python -m level5_cuda_naive.tiling` measures them against each other.
 *
 * Implements common/lenet.h. Build: `make level5`; test: `pytest -m level5 -k lenet` on a GPU machine.
 */
#include "lenet.h"

#include "mlp.cu"

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

struct lenet {
    mlp base;              /* what the MLP's layer functions read: the stream (and, at level 6, the cuBLAS handle) */
    int convolution;       /* LENET_DIRECT or LENET_TILED */
    /* Everything below is in device memory. */
    float *params, *grads; /* (N_PARAMS) each, in lenet.h's flat layout */
    int capacity;          /* rows the per-batch buffers below can hold */
    float *batch;          /* one block for all of them: */
    float *x;              /* (capacity, 784) the batch */
    float *h1, *a1, *p1, *h2, *a2, *p2, *f1, *r3, *f2, *r4, *logits; /* each layer's output (capacity, size) */
    float *dh1, *da1, *dp1, *dh2, *da2, *dp2, *df1, *dr3, *df2, *dr4, *dlogits; /* the gradients, same shapes */
    float *row_loss;       /* (capacity) each row's cross-entropy, before the mean */
    int *ints;             /* one block for: */
    int *y;                /* (capacity) the batch's labels */
    int *choice1, *choice2; /* (capacity, 6 * 12 * 12) and (capacity, 256): each pool window's maximum, 0..3 */
    float *data_x;         /* (n_data, 784) the training set, uploaded once by lenet_set_data */
    int *data_y;           /* (n_data) */
    int n_data;
    int *order;            /* (order_capacity) an epoch's visiting order */
    int order_capacity;
    float *losses;         /* (loss_capacity) an epoch's per-step losses */
    int loss_capacity;
};

/* ---- the convolution, direct: one thread per output; forward followed by backward ---- */

/* out (B, F, OH, OH) = x (B, C, H, H) correlated with w (F, C, k, k), + b (F); stride 1, no padding, OH = H - k + 1.
 * Thread (n, f, oy, ox) starts at the bias and adds the k x k window of every channel, in level 4's order. */
__global__ void conv2d_forward_kernel(float *out, const float *x, const float *w, const float *b, int B, int C, int H,
                                      int F, int k) {
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
}

static int conv2d_forward(lenet *m, float *out, const float *x, const float *w, const float *b, int B, int C, int H,
                          int F, int k) {
    const size_t n = (size_t)B * F * (H - k + 1) * (H - k + 1);
    conv2d_forward_kernel<<<blocks_for(n), THREADS, 0, m->base.stream>>>(out, x, w, b, B, C, H, F, k);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
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
    const int v = (int)(i % k), u = (int)(i / k % k), c = (int)(i / ((size_t)k * k) % C), f = (int)(i / ((size_t)C * k * k));
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
 * bits. Block (images, tile, filter group) first copies, for CONV_IMAGES images, the tile's inputs - (CONV_TILE + K - 1)^2
 * per channel: the tile's positions and the halo that their windows reach past them - and CONV_FILTERS filters into
 * shared memory. Then each thread computes CONV_COLUMNS neighbouring outputs of one row for each of those filters:
 * an input row it has loaded into registers feeds up to K * CONV_COLUMNS * CONV_FILTERS multiply-adds, and a weight
 * CONV_COLUMNS. A direct thread loads two numbers for every multiply-add. */
static_assert(CONV_TILE % CONV_COLUMNS == 0, "a thread's outputs lie in one tile");
enum { IN = CONV_TILE + K - 1, ROW_THREADS = CONV_TILE / CONV_COLUMNS, IMAGE_THREADS = ROW_THREADS * CONV_TILE };

__global__ void conv2d_forward_tiled_kernel(float *out, const float *x, const float *w, const float *b, int B, int C,
                                            int H, int F) {
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
        for (int j = 0; j < CONV_COLUMNS && ox + j < OH; j++) out[((n * F + f0 + f) * OH + oy) * OH + ox + j] = sum[f][j];
}

static int conv2d_forward_tiled(lenet *m, float *out, const float *x, const float *w, const float *b, int B, int C,
                                int H, int F) {
    const int tiles = (H - K + CONV_TILE) / CONV_TILE;
    const dim3 grid((unsigned)((B + CONV_IMAGES - 1) / CONV_IMAGES * tiles * tiles), (F + CONV_FILTERS - 1) / CONV_FILTERS);
    const size_t shared = sizeof(float) * ((size_t)CONV_IMAGES * C * IN * IN + (size_t)CONV_FILTERS * C * K * K);
    conv2d_forward_tiled_kernel<<<grid, CONV_IMAGES * IMAGE_THREADS, shared, m->base.stream>>>(out, x, w, b, B, C, H, F);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
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
    maxpool_forward_kernel<<<blocks_for((size_t)B * C * (H / 2) * (H / 2)), THREADS, 0, m->base.stream>>>(out, choice, a,
                                                                                                        B, C, H);
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
    maxpool_backward_kernel<<<blocks_for((size_t)B * C * H * H), THREADS, 0, m->base.stream>>>(da, dout, choice, B, C, H);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
}

/* ---- the step: level 4's, line for line; each call queued on the stream ---- */

/* A convolution layer with its bias, by the model's chosen algorithm: out (B, F, OH, OH) from x (B, C, H, H). */
static int conv_layer(lenet *m, float *out, const float *x, const float *w, const float *b, int B, int C, int H,
                      int F) {
    return m->convolution == LENET_TILED ? conv2d_forward_tiled(m, out, x, w, b, B, C, H, F)
                                         : conv2d_forward(m, out, x, w, b, B, C, H, F, K);
}

/* A fully connected layer: out (B, n_out) = x (B, n_in) @ w^T + b, through the MLP's two kernels. */
static int fc_layer(lenet *m, float *out, const float *x, const float *w, const float *b, int B, int n_in, int n_out) {
    const int status = linear_forward(&m->base, out, x, w, B, n_in, n_out);
    return status ? status : bias_forward(&m->base, out, b, B, n_out);
}

/* Its backward: dw, db and dx from dout (B, n_out). */
static int fc_layer_backward(lenet *m, float *dx, float *dw, float *db, const float *dout, const float *x,
                             const float *w, int B, int n_in, int n_out) {
    const int status = linear_backward(&m->base, dx, dw, dout, x, w, B, n_in, n_out);
    return status ? status : bias_backward(&m->base, db, dout, B, n_out);
}

/* Forward of a batch x (B, 784) (device): every layer's output into the model's buffers. */
static int net_forward(lenet *m, const float *x, int B) {
    const float *p = m->params;
    mlp *base = &m->base;
    int status = conv_layer(m, m->h1, x, p + W1, p + B1, B, 1, IMAGE, C1);
    if (!status) status = relu_forward(base, m->a1, m->h1, (size_t)B * H1);
    if (!status) status = maxpool_forward(m, m->p1, m->choice1, m->a1, B, C1, S1);
    if (!status) status = conv_layer(m, m->h2, m->p1, p + W2, p + B2, B, C1, P1, C2);
    if (!status) status = relu_forward(base, m->a2, m->h2, (size_t)B * H2);
    if (!status) status = maxpool_forward(m, m->p2, m->choice2, m->a2, B, C2, S2);
    if (!status) status = fc_layer(m, m->f1, m->p2, p + W3, p + B3, B, FLAT, F1);
    if (!status) status = relu_forward(base, m->r3, m->f1, (size_t)B * F1);
    if (!status) status = fc_layer(m, m->f2, m->r3, p + W4, p + B4, B, F1, F2);
    if (!status) status = relu_forward(base, m->r4, m->f2, (size_t)B * F2);
    if (!status) status = fc_layer(m, m->logits, m->r4, p + W5, p + B5, B, F2, OUT);
    return status;
}

/* Forward and backward of one batch x (B, 784), y (B) (device): the mean loss to *loss (device), the gradients to
 * m->grads, every layer's output and gradient to its buffer. */
static int net_forward_backward(lenet *m, float *loss, const float *x, const int *y, int B) {
    const float *p = m->params;
    float *g = m->grads;
    mlp *base = &m->base;
    int status = net_forward(m, x, B);
    if (!status) status = softmax_xent_forward(base, loss, m->dlogits, m->row_loss, m->logits, y, B, OUT);
    if (!status) status = softmax_xent_backward(base, m->dlogits, m->dlogits, y, B, OUT);
    if (!status) status = fc_layer_backward(m, m->dr4, g + W5, g + B5, m->dlogits, m->r4, p + W5, B, F2, OUT);
    if (!status) status = relu_backward(base, m->df2, m->dr4, m->f2, (size_t)B * F2);
    if (!status) status = fc_layer_backward(m, m->dr3, g + W4, g + B4, m->df2, m->r3, p + W4, B, F1, F2);
    if (!status) status = relu_backward(base, m->df1, m->dr3, m->f1, (size_t)B * F1);
    if (!status) status = fc_layer_backward(m, m->dp2, g + W3, g + B3, m->df1, m->p2, p + W3, B, FLAT, F1);
    if (!status) status = maxpool_backward(m, m->da2, m->dp2, m->choice2, B, C2, S2);
    if (!status) status = relu_backward(base, m->dh2, m->da2, m->h2, (size_t)B * H2);
    if (!status) status = conv2d_backward(m, m->dp1, g + W2, g + B2, m->dh2, m->p1, p + W2, B, C1, P1, C2, K);
    if (!status) status = maxpool_backward(m, m->da1, m->dp1, m->choice1, B, C1, S1);
    if (!status) status = relu_backward(base, m->dh1, m->da1, m->h1, (size_t)B * H1);
    if (!status) status = conv2d_backward(m, NULL, g + W1, g + B1, m->dh1, x, p + W1, B, 1, IMAGE, C1, K);
    return status;
}

/* ---- memory: the model owns every buffer; the batch's grow only when a larger batch arrives ---- */

enum { GPU_ROW_FLOATS = IMAGE * IMAGE + 2 * LENET_ACTIVATIONS + 1, ROW_INTS = 1 + POOL1 + POOL2 };

static cudaError_t free_batch(lenet *m) {
    const cudaError_t err = free_device({m->batch, m->ints});
    m->batch = NULL, m->ints = NULL;
    m->capacity = 0;
    return err;
}

/* Make the per-batch buffers hold `rows` rows: one block of floats and one of ints, cut into the buffers. */
static int ensure_batch(lenet *m, int rows) {
    if (rows <= m->capacity) return MLP_OK;
    const int status = check_elements(rows, LENET_ROW_FLOATS); /* the binding's bound, the same at every level */
    if (status) return status;
    CUDA_CHECK(free_batch(m));
    const size_t R = (size_t)rows;
    CUDA_CHECK(cudaMalloc(&m->batch, sizeof(float) * R * GPU_ROW_FLOATS));
    CUDA_CHECK(cudaMalloc(&m->ints, sizeof(int) * R * ROW_INTS));
    float *next = m->batch;
    float **buffers[] = {&m->x, &m->h1, &m->a1, &m->p1, &m->h2, &m->a2, &m->p2, &m->f1, &m->r3, &m->f2, &m->r4,
                         &m->logits, &m->dh1, &m->da1, &m->dp1, &m->dh2, &m->da2, &m->dp2, &m->df1, &m->dr3, &m->df2,
                         &m->dr4, &m->dlogits, &m->row_loss};
    const int sizes[] = {IMAGE * IMAGE, H1, H1, POOL1, H2, H2, POOL2, F1, F1, F2, F2, OUT, H1, H1, POOL1, H2, H2,
                         POOL2, F1, F1, F2, F2, OUT, 1};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        *buffers[i] = next;
        next += R * sizes[i];
    }
    m->y = m->ints, m->choice1 = m->y + R, m->choice2 = m->choice1 + R * POOL1;
    m->capacity = rows;
    return MLP_OK;
}

/* The stream, the level's state, and zeroed parameters and gradients on the device. */
static int init_model(lenet *m) {
    CUDA_CHECK(cudaStreamCreateWithFlags(&m->base.stream, cudaStreamNonBlocking));
    const int status = level_create(&m->base);
    if (status) return status;
    CUDA_CHECK(cudaMalloc(&m->params, sizeof(float) * N_PARAMS));
    CUDA_CHECK(cudaMalloc(&m->grads, sizeof(float) * N_PARAMS));
    CUDA_CHECK(cudaMemsetAsync(m->params, 0, sizeof(float) * N_PARAMS, m->base.stream));
    CUDA_CHECK(cudaMemsetAsync(m->grads, 0, sizeof(float) * N_PARAMS, m->base.stream));
    CUDA_CHECK(cudaStreamSynchronize(m->base.stream));
    return MLP_OK;
}

/* ---- the interface of lenet.h: host arrays in and out, each function synchronizing once, at its end ---- */

int lenet_create(lenet **out) {
    if (!out) return FAIL(MLP_ERR_ARG, "out is NULL");
    *out = NULL;
    int devices = 0;
    const cudaError_t err = cudaGetDeviceCount(&devices);
    if (err != cudaSuccess || devices == 0) {
        (void)cudaGetLastError();
        return FAIL(MLP_ERR_DEVICE, "no CUDA device: %s",
                    err != cudaSuccess ? cudaGetErrorString(err) : "cudaGetDeviceCount found none");
    }
    lenet *m = static_cast<lenet *>(calloc(1, sizeof *m));
    if (!m) return FAIL(MLP_ERR_ALLOC, "out of memory for the model");
    const int status = init_model(m);
    if (status) {
        lenet_destroy(m);
        return status;
    }
    *out = m;
    return MLP_OK;
}

int lenet_destroy(lenet *m) {
    if (!m) return MLP_OK;
    int status = level_destroy(&m->base);
    cudaError_t err = free_device({m->params, m->grads, m->data_x, m->data_y, m->order, m->losses});
    const cudaError_t batch_err = free_batch(m);
    if (err == cudaSuccess) err = batch_err;
    if (m->base.stream) {
        const cudaError_t stream_err = cudaStreamDestroy(m->base.stream);
        if (err == cudaSuccess) err = stream_err;
    }
    free(m);
    if (!status && err != cudaSuccess) status = cuda_fail(err, "cudaFree / cudaStreamDestroy", __FILE__, __LINE__);
    return status;
}

int lenet_set_params(lenet *m, const float *params) {
    if (!m || !params) return FAIL(MLP_ERR_ARG, "NULL argument");
    CUDA_CHECK(cudaMemcpyAsync(m->params, params, sizeof(float) * N_PARAMS, cudaMemcpyHostToDevice, m->base.stream));
    CUDA_CHECK(cudaStreamSynchronize(m->base.stream));
    return MLP_OK;
}

int lenet_get_params(lenet *m, float *params) {
    if (!m || !params) return FAIL(MLP_ERR_ARG, "NULL argument");
    CUDA_CHECK(cudaMemcpyAsync(params, m->params, sizeof(float) * N_PARAMS, cudaMemcpyDeviceToHost, m->base.stream));
    CUDA_CHECK(cudaStreamSynchronize(m->base.stream));
    return MLP_OK;
}

int lenet_set_convolution(lenet *m, int convolution) {
    if (!m) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (convolution != LENET_DIRECT && convolution != LENET_TILED)
        return FAIL(MLP_ERR_ARG, "level 5's convolutions are direct and tiled (%d and %d), got %d", LENET_DIRECT,
                    LENET_TILED, convolution);
    m->convolution = convolution;
    return MLP_OK;
}

int lenet_forward(lenet *m, float *logits, const float *x, int n) {
    if (!m || !logits || !x) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (n < 1) return FAIL(MLP_ERR_ARG, "n must be >= 1, got %d", n);
    int status = ensure_batch(m, n < FORWARD_CHUNK ? n : FORWARD_CHUNK);
    if (status) return status;
    for (int start = 0; start < n; start += FORWARD_CHUNK) {
        const int B = n - start < FORWARD_CHUNK ? n - start : FORWARD_CHUNK;
        CUDA_CHECK(cudaMemcpyAsync(m->x, x + (size_t)start * IMAGE * IMAGE, sizeof(float) * (size_t)B * IMAGE * IMAGE,
                                   cudaMemcpyHostToDevice, m->base.stream));
        status = net_forward(m, m->x, B);
        if (status) return status;
        CUDA_CHECK(cudaMemcpyAsync(logits + (size_t)start * OUT, m->logits, sizeof(float) * (size_t)B * OUT,
                                   cudaMemcpyDeviceToHost, m->base.stream));
    }
    CUDA_CHECK(cudaStreamSynchronize(m->base.stream));
    return MLP_OK;
}

/* The batch x (n, 784), y (n) uploaded and stepped forward and backward: the start of loss_and_grads and layers. */
static int forward_backward_batch(lenet *m, const float *x, const int *y, int n) {
    int status = check_labels(y, n, OUT);
    if (!status) status = ensure_batch(m, n);
    if (!status) status = ensure_buffer(&m->losses, &m->loss_capacity, 1);
    if (status) return status;
    CUDA_CHECK(cudaMemcpyAsync(m->x, x, sizeof(float) * (size_t)n * IMAGE * IMAGE, cudaMemcpyHostToDevice,
                               m->base.stream));
    CUDA_CHECK(cudaMemcpyAsync(m->y, y, sizeof(int) * (size_t)n, cudaMemcpyHostToDevice, m->base.stream));
    return net_forward_backward(m, m->losses, m->x, m->y, n);
}

int lenet_loss_and_grads(lenet *m, float *loss, float *grads, const float *x, const int *y, int n) {
    if (!m || !loss || !grads || !x || !y) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (n < 1) return FAIL(MLP_ERR_ARG, "n must be >= 1, got %d", n);
    const int status = forward_backward_batch(m, x, y, n);
    if (status) return status;
    CUDA_CHECK(cudaMemcpyAsync(loss, m->losses, sizeof(float), cudaMemcpyDeviceToHost, m->base.stream));
    CUDA_CHECK(cudaMemcpyAsync(grads, m->grads, sizeof(float) * N_PARAMS, cudaMemcpyDeviceToHost, m->base.stream));
    CUDA_CHECK(cudaStreamSynchronize(m->base.stream));
    return MLP_OK;
}

int lenet_layers(lenet *m, float *outputs, float *grads, const float *x, const int *y, int n) {
    if (!m || !outputs || !grads || !x || !y) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (n < 1) return FAIL(MLP_ERR_ARG, "n must be >= 1, got %d", n);
    const int status = forward_backward_batch(m, x, y, n);
    if (status) return status;
    const float *out[] = {m->h1, m->a1, m->p1, m->h2, m->a2, m->p2, m->f1, m->r3, m->f2, m->r4, m->logits};
    const float *grad[] = {m->dh1, m->da1, m->dp1, m->dh2, m->da2, m->dp2, m->df1, m->dr3, m->df2, m->dr4, m->dlogits};
    const int sizes[] = {H1, H1, POOL1, H2, H2, POOL2, F1, F1, F2, F2, OUT};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        const size_t bytes = sizeof(float) * (size_t)n * sizes[i];
        CUDA_CHECK(cudaMemcpyAsync(outputs, out[i], bytes, cudaMemcpyDeviceToHost, m->base.stream));
        CUDA_CHECK(cudaMemcpyAsync(grads, grad[i], bytes, cudaMemcpyDeviceToHost, m->base.stream));
        outputs += (size_t)n * sizes[i], grads += (size_t)n * sizes[i];
    }
    CUDA_CHECK(cudaStreamSynchronize(m->base.stream));
    return MLP_OK;
}

/* One upload; every epoch then gathers its batches on the device. */
int lenet_set_data(lenet *m, const float *x, const int *y, int n) {
    if (!m || !x || !y) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (n < 1) return FAIL(MLP_ERR_ARG, "n must be >= 1, got %d", n);
    const int status = check_labels(y, n, OUT);
    if (status) return status;
    m->n_data = 0; /* no data set until the new one is complete */
    CUDA_CHECK(free_device({m->data_x, m->data_y}));
    m->data_x = NULL, m->data_y = NULL;
    CUDA_CHECK(cudaMalloc(&m->data_x, sizeof(float) * (size_t)n * IMAGE * IMAGE));
    CUDA_CHECK(cudaMalloc(&m->data_y, sizeof(int) * (size_t)n));
    CUDA_CHECK(cudaMemcpyAsync(m->data_x, x, sizeof(float) * (size_t)n * IMAGE * IMAGE, cudaMemcpyHostToDevice,
                               m->base.stream));
    CUDA_CHECK(cudaMemcpyAsync(m->data_y, y, sizeof(int) * (size_t)n, cudaMemcpyHostToDevice, m->base.stream));
    CUDA_CHECK(cudaStreamSynchronize(m->base.stream));
    m->n_data = n;
    return MLP_OK;
}

/* The whole epoch queued on the stream without a wait: per step, gather, forward and backward, one SGD update of
 * the flat parameter buffer; the losses come back in one copy at the end. */
int lenet_train_epoch(lenet *m, float *losses, const int *order, int n_order, int batch_size, float lr) {
    if (!m || !losses || !order) return FAIL(MLP_ERR_ARG, "NULL argument");
    int status = check_epoch(order, n_order, batch_size, m->n_data);
    if (status) return status;
    const int steps = n_order / batch_size + (n_order % batch_size != 0);
    status = ensure_batch(m, batch_size < n_order ? batch_size : n_order);
    if (!status) status = ensure_buffer(&m->order, &m->order_capacity, n_order);
    if (!status) status = ensure_buffer(&m->losses, &m->loss_capacity, steps);
    if (status) return status;
    CUDA_CHECK(cudaMemcpyAsync(m->order, order, sizeof(int) * (size_t)n_order, cudaMemcpyHostToDevice, m->base.stream));
    for (int start = 0, step = 0; start < n_order; start += batch_size, step++) {
        const int B = n_order - start < batch_size ? n_order - start : batch_size;
        status = gather(&m->base, m->x, m->y, m->data_x, m->data_y, m->order + start, B, IMAGE * IMAGE);
        if (!status) status = net_forward_backward(m, m->losses + step, m->x, m->y, B);
        if (!status) status = sgd_update(&m->base, m->params, m->grads, lr, N_PARAMS);
        if (status) return status;
    }
    CUDA_CHECK(cudaMemcpyAsync(losses, m->losses, sizeof(float) * (size_t)steps, cudaMemcpyDeviceToHost,
                               m->base.stream));
    CUDA_CHECK(cudaStreamSynchronize(m->base.stream));
    return MLP_OK;
}
