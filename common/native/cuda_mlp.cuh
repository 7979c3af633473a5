/* common/native/cuda_mlp.cuh - everything the GPU levels share: the model on the device, the
 * element-wise kernels, the training step and the whole of mlp.h.
 *
 * Included by level5_cuda_naive/mlp.cu (hand-written matrix products) and level6_cublas/mlp.cu
 * (cuBLAS). Each of them defines, after the include, the hooks declared below:
 *   linear_forward, linear_backward - the matrix products, the one thing the two levels teach
 *   check_matmul                    - which of mlp.h's matrix products the level has
 *   level_create, level_destroy     - the level's own state (level 6: its cuBLAS handle) and its default product
 * so diffing the two levels shows only the matrix products. Level 7 (level7_fused/mlp.cu) is level 6
 * with its own epoch: it defines LEVEL_TRAINS_ITS_OWN_EPOCH and the hooks train_steps, free_epoch_state.
 *
 * The layer functions keep level 4's names, order and arguments (outputs, inputs, weights, sizes),
 * with the model first for its stream. Each one launches a kernel and checks the launch, so the
 * step below reads line for line like level4_c/mlp.c. All pointers in the layer functions are
 * device pointers; only the mlp.h functions at the bottom see host pointers.
 *
 * Every call is queued on the model's one stream, in order, and no layer function waits for the
 * GPU: a whole epoch is queued without a round trip, and each mlp.h function synchronizes once,
 * at its end, where errors of the queued work also surface.
 */
#ifndef CUDA_MLP_CUH
#define CUDA_MLP_CUH

#include "mlp.h"
#include "mlp_status.h"

#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>

#define FORWARD_CHUNK 1024 /* rows forward() processes at a time: bounds the activation buffers */
#define THREADS 256        /* threads per block of the 1-D kernels: a whole number of warps */
#define WARP 32

struct mlp {
    int n_in, hidden, n_out;
    cudaStream_t stream; /* all the model's work, in order */
    int matmul;          /* how the level computes its matrix products (mlp.h's MLP_MATMUL_*), set by level_create */
    void *level_state;   /* the level's own state: level 6's cuBLAS handle, NULL at level 5 */
    /* Everything below is in device memory. */
    float *w1, *b1, *w2, *b2;     /* parameters, PyTorch layouts: (hidden, n_in) (hidden) (n_out, hidden) (n_out) */
    float *dw1, *db1, *dw2, *db2; /* gradients, same shapes */
    int capacity;                 /* rows the per-batch buffers below can hold */
    float *x;                     /* (capacity, n_in) the batch, gathered from the data set */
    int *y;                       /* (capacity) its labels */
    float *h, *a, *dh, *da;       /* (capacity, hidden) pre-activation, activation and their gradients */
    float *logits, *dlogits;      /* (capacity, n_out) */
    float *row_loss;              /* (capacity) each row's cross-entropy, before the mean */
    /* The training set: uploaded once by mlp_set_data, or the caller's device arrays (mlp_use_device_data). */
    float *data_x;                /* (n_data, n_in) */
    int *data_y;                  /* (n_data) */
    int n_data;
    int owns_data;                /* data_x and data_y are the model's upload, to free (not the caller's arrays) */
    unsigned long long *found;    /* (2) what check_data found in the caller's arrays (check_data_kernel) */
    int *order;                   /* (order_capacity) an epoch's visiting order, uploaded once per epoch */
    int order_capacity;
    float *losses;                /* (loss_capacity) an epoch's per-step losses, copied back once per epoch */
    int loss_capacity;
    void *epoch_state;            /* the own state of a level that trains its own epoch (level 7); NULL otherwise */
};

/* A failed CUDA call: out of device memory is MLP_ERR_ALLOC, anything else MLP_ERR_DEVICE. */
static int cuda_fail(cudaError_t err, const char *call, const char *file, int line) {
    /* A failed runtime call is also kept as the thread's "last error"; clear it, or the launch check
     * of the next call would report this failure a second time. (A broken context stays broken.) */
    (void)cudaGetLastError();
    const int status = err == cudaErrorMemoryAllocation ? MLP_ERR_ALLOC : MLP_ERR_DEVICE;
    return fail(status, file, line, "%s: %s", call, cudaGetErrorString(err));
}

/* After every CUDA call, and as CUDA_CHECK(cudaGetLastError()) after every kernel launch (a launch
 * returns nothing: a bad grid or a missing kernel image is only reported there). On failure it
 * returns the status from the enclosing function, with "file:line: call: reason" as the message. */
#define CUDA_CHECK(call)                                                                   \
    do {                                                                                   \
        const cudaError_t err_ = (call);                                                   \
        if (err_ != cudaSuccess) return cuda_fail(err_, #call, __FILE__, __LINE__);        \
    } while (0)

/* Blocks of THREADS threads that cover n items; the last block may be partly idle, hence the
 * bounds check that opens every kernel. A kernel's index is a size_t, computed as one: with up to
 * MLP_MAX_ELEMENTS items (mlp.h), blockIdx.x * blockDim.x would overflow an int near the end. */
static unsigned blocks_for(size_t n) { return (unsigned)((n + THREADS - 1) / THREADS); }

/* This thread's index in a 1-D grid. */
__device__ size_t thread_index() { return (size_t)blockIdx.x * blockDim.x + threadIdx.x; }

/* ---- the level's hooks, defined by level5_cuda_naive/mlp.cu and level6_cublas/mlp.cu ---- */

/* out (B, n_out) = x (B, n_in) @ w^T, with w (n_out, n_in). The bias is added by bias_forward. */
static int linear_forward(mlp *m, float *out, const float *x, const float *w, int B, int n_in, int n_out);
/* Backward of out = x @ w^T, given dout (B, n_out):
 *   dw (n_out, n_in) = dout^T @ x,  dx (B, n_in) = dout @ w  (dx may be NULL: the first layer needs none).
 * The bias gradient is bias_backward's. */
static int linear_backward(mlp *m, float *dx, float *dw, const float *dout, const float *x, const float *w, int B,
                           int n_in, int n_out);
/* Whether the level has this matrix product (mlp.h's MLP_MATMUL_*): MLP_OK, or MLP_ERR_ARG naming the ones it has. */
static int check_matmul(int matmul);
/* Set up and free the level's own state, m->level_state, and set m->matmul to the level's default product;
 * level_destroy accepts a half-made model. */
static int level_create(mlp *m);
static int level_destroy(mlp *m);

/* The steps of an epoch (queue_steps below, unless a level defines LEVEL_TRAINS_ITS_OWN_EPOCH and trains them its
 * own way, as level 7's one fused kernel, keeping what it needs in m->epoch_state, which free_epoch_state frees). */
static int train_steps(mlp *m, int n_order, int batch_size, float lr);
static int free_epoch_state(mlp *m);

/* ---- the kernels, each next to the layer function that launches it; forward followed by backward ---- */

/* Determinism: the two sums over rows below (bias_backward, and the mean in softmax_xent_forward)
 * add in one fixed order, never with atomicAdd. Float addition is not associative, and atomics
 * add in whatever order the threads happen to arrive, so the last bits of a loss would change from
 * run to run. With fixed orders, the same inputs give bit-identical losses on every run. */

/* The batch: x (B, n_in) and y (B) are rows order (B) of data_x (n_data, n_in) and data_y (n_data).
 * One thread per element of x, so neighbouring threads copy neighbouring floats of a row. */
__global__ void gather_kernel(float *x, int *y, const float *data_x, const int *data_y, const int *order, int B,
                              int n_in) {
    const size_t i = thread_index();
    if (i >= (size_t)B * n_in) return;
    const int r = (int)(i / n_in), k = (int)(i % n_in);
    x[i] = data_x[(size_t)order[r] * n_in + k];
    if (k == 0) y[r] = data_y[order[r]];
}

static int gather(mlp *m, float *x, int *y, const float *data_x, const int *data_y, const int *order, int B, int n_in) {
    gather_kernel<<<blocks_for((size_t)B * n_in), THREADS, 0, m->stream>>>(x, y, data_x, data_y, order, B, n_in);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
}

/* out (B, n) += b (n), broadcast over the rows: the "+ b" of a linear layer. One thread per element. */
__global__ void bias_forward_kernel(float *out, const float *b, int B, int n) {
    /* BEGIN LAB 5.3 bias_forward */
    const size_t i = thread_index();
    if (i >= (size_t)B * n) return;
    out[i] += b[i % n];
    /* END LAB */
}

static int bias_forward(mlp *m, float *out, const float *b, int B, int n) {
    /* BEGIN LAB 5.3 bias_forward */
    bias_forward_kernel<<<blocks_for((size_t)B * n), THREADS, 0, m->stream>>>(out, b, B, n);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
    /* END LAB */
}

/* Backward of out += b: db (n) = sum over the rows of dout (B, n). One thread per column, adding
 * the rows in order (see "Determinism" above); neighbouring threads read neighbouring floats. */
__global__ void bias_backward_kernel(float *db, const float *dout, int B, int n) {
    /* BEGIN LAB 5.4 bias_backward */
    const size_t o = thread_index();
    if (o >= (size_t)n) return;
    float sum = 0.0f;
    for (int r = 0; r < B; r++) sum += dout[(size_t)r * n + o];
    db[o] = sum;
    /* END LAB */
}

static int bias_backward(mlp *m, float *db, const float *dout, int B, int n) {
    /* BEGIN LAB 5.4 bias_backward */
    bias_backward_kernel<<<blocks_for(n), THREADS, 0, m->stream>>>(db, dout, B, n);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
    /* END LAB */
}

/* a = max(h, 0), n elements. */
__global__ void relu_forward_kernel(float *a, const float *h, size_t n) {
    /* BEGIN LAB 5.5 relu_forward */
    const size_t i = thread_index();
    if (i >= n) return;
    a[i] = h[i] > 0.0f ? h[i] : 0.0f;
    /* END LAB */
}

static int relu_forward(mlp *m, float *a, const float *h, size_t n) {
    /* BEGIN LAB 5.5 relu_forward */
    relu_forward_kernel<<<blocks_for(n), THREADS, 0, m->stream>>>(a, h, n);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
    /* END LAB */
}

/* Backward of a = max(h, 0): dh = da where h > 0, else 0. The mask comes from h, the ReLU's input. */
__global__ void relu_backward_kernel(float *dh, const float *da, const float *h, size_t n) {
    /* BEGIN LAB 5.6 relu_backward */
    const size_t i = thread_index();
    if (i >= n) return;
    dh[i] = h[i] > 0.0f ? da[i] : 0.0f;
    /* END LAB */
}

static int relu_backward(mlp *m, float *dh, const float *da, const float *h, size_t n) {
    /* BEGIN LAB 5.6 relu_backward */
    relu_backward_kernel<<<blocks_for(n), THREADS, 0, m->stream>>>(dh, da, h, n);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
    /* END LAB */
}

/* The max and the sum of v over the 32 lanes of a warp, in every lane. The butterfly pairs lane i
 * with lane i ^ offset; both add the same two numbers, so every lane ends with the same bits. */
__device__ float warp_max(float v) {
    for (int offset = WARP / 2; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

__device__ float warp_sum(float v) {
    for (int offset = WARP / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

/* Each row's cross-entropy of logits (B, n_out) against labels y (B) into row_loss (B); softmax(logits)
 * into probs (B, n_out). One warp per row, lane l taking columns l, l + 32, ...
 * Subtracting the row max before exp() keeps it finite for any logits; log-sum-exp gives the loss. */
__global__ void softmax_xent_forward_kernel(float *probs, float *row_loss, const float *logits, const int *y, int B,
                                            int n_out) {
    /* BEGIN LAB 5.7 softmax_xent_forward */
    const size_t r = thread_index() / WARP;
    const int lane = threadIdx.x % WARP;
    /* THREADS is a whole number of warps, so a warp leaves here all together or not at all, and the
     * shuffles below always have all 32 lanes. */
    if (r >= (size_t)B) return;
    const float *row = logits + (size_t)r * n_out;
    float *p = probs + (size_t)r * n_out;
    float max = -INFINITY;
    for (int o = lane; o < n_out; o += WARP) max = fmaxf(max, row[o]);
    max = warp_max(max);
    float sum = 0.0f;
    for (int o = lane; o < n_out; o += WARP) {
        p[o] = expf(row[o] - max);
        sum += p[o];
    }
    sum = warp_sum(sum);
    for (int o = lane; o < n_out; o += WARP) p[o] /= sum;
    if (lane == 0) row_loss[r] = logf(sum) - (row[y[r]] - max);
    /* END LAB */
}

/* loss (1) = mean of row_loss (B). One block of THREADS threads, one fixed order (see "Determinism"):
 * thread t adds rows t, t + THREADS, ... in turn, then the block halves its partial sums pairwise.
 * In double, as level 4: a float running sum over a large batch drifts, and the mean must not. */
__global__ void mean_loss_kernel(float *loss, const float *row_loss, int B) {
    /* BEGIN LAB 5.7 softmax_xent_forward */
    __shared__ double partial[THREADS];
    const int t = threadIdx.x;
    double sum = 0.0;
    for (int r = t; r < B; r += THREADS) sum += row_loss[r];
    partial[t] = sum;
    __syncthreads();
    for (int half = THREADS / 2; half > 0; half /= 2) {
        if (t < half) partial[t] += partial[t + half];
        __syncthreads();
    }
    if (t == 0) *loss = (float)(partial[0] / B);
    /* END LAB */
}

/* loss (1, on the device) = mean cross-entropy of logits (B, n_out) against y (B); also leaves
 * softmax(logits) in probs (B, n_out). row_loss (B) is scratch. The loss stays on the device: an
 * epoch collects its steps' losses there and copies them back once. */
static int softmax_xent_forward(mlp *m, float *loss, float *probs, float *row_loss, const float *logits, const int *y,
                                int B, int n_out) {
    /* BEGIN LAB 5.7 softmax_xent_forward */
    softmax_xent_forward_kernel<<<blocks_for((size_t)B * WARP), THREADS, 0, m->stream>>>(probs, row_loss, logits, y, B,
                                                                                        n_out);
    CUDA_CHECK(cudaGetLastError());
    mean_loss_kernel<<<1, THREADS, 0, m->stream>>>(loss, row_loss, B);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
    /* END LAB */
}

/* Backward of the mean cross-entropy: dlogits = (softmax - onehot(y)) / B, one thread per element.
 * In place over probs is fine: each thread reads and then writes only its own element. */
__global__ void softmax_xent_backward_kernel(float *dlogits, const float *probs, const int *y, int B, int n_out) {
    /* BEGIN LAB 5.8 softmax_xent_backward */
    const size_t i = thread_index();
    if (i >= (size_t)B * n_out) return;
    const int r = (int)(i / n_out), o = (int)(i % n_out);
    const float onehot = (o == y[r]) ? 1.0f : 0.0f;
    dlogits[i] = (probs[i] - onehot) / (float)B;
    /* END LAB */
}

static int softmax_xent_backward(mlp *m, float *dlogits, const float *probs, const int *y, int B, int n_out) {
    /* BEGIN LAB 5.8 softmax_xent_backward */
    softmax_xent_backward_kernel<<<blocks_for((size_t)B * n_out), THREADS, 0, m->stream>>>(dlogits, probs, y, B, n_out);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
    /* END LAB */
}

/* p -= lr * dp, n elements. */
__global__ void sgd_update_kernel(float *p, const float *dp, float lr, size_t n) {
    /* BEGIN LAB 5.9 sgd_update */
    const size_t i = thread_index();
    if (i >= n) return;
    p[i] -= lr * dp[i];
    /* END LAB */
}

static int sgd_update(mlp *m, float *p, const float *dp, float lr, size_t n) {
    /* BEGIN LAB 5.9 sgd_update */
    sgd_update_kernel<<<blocks_for(n), THREADS, 0, m->stream>>>(p, dp, lr, n);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
    /* END LAB */
}

/* ---- the step ---- */

/* Forward and backward of one batch x (B, n_in), y (B) (device): writes the mean loss to the device
 * float *loss and fills m->dw1..db2. Only queues work; nothing waits for the GPU. */
static int forward_backward(mlp *m, float *loss, const float *x, const int *y, int B) {
    const int H = m->hidden, O = m->n_out;
    int status = linear_forward(m, m->h, x, m->w1, B, m->n_in, H);
    if (!status) status = bias_forward(m, m->h, m->b1, B, H);
    if (!status) status = relu_forward(m, m->a, m->h, (size_t)B * H);
    if (!status) status = linear_forward(m, m->logits, m->a, m->w2, B, H, O);
    if (!status) status = bias_forward(m, m->logits, m->b2, B, O);
    if (!status) status = softmax_xent_forward(m, loss, m->dlogits, m->row_loss, m->logits, y, B, O);
    if (!status) status = softmax_xent_backward(m, m->dlogits, m->dlogits, y, B, O);
    if (!status) status = linear_backward(m, m->da, m->dw2, m->dlogits, m->a, m->w2, B, H, O);
    if (!status) status = bias_backward(m, m->db2, m->dlogits, B, O);
    if (!status) status = relu_backward(m, m->dh, m->da, m->h, (size_t)B * H);
    if (!status) status = linear_backward(m, NULL, m->dw1, m->dh, x, m->w1, B, m->n_in, H);
    if (!status) status = bias_backward(m, m->db1, m->dh, B, H);
    return status;
}

/* ---- memory: the model owns every buffer; they grow only when a larger batch arrives ---- */

/* Every device buffer of the library is taken and given back through these two, which count the live ones: the tests
 * read the count (mlp_device_buffers) to see that each model gives back exactly what it took, whatever else runs on
 * the GPU. */
static std::atomic<long long> live_buffers{0};

template <typename T>
static cudaError_t device_malloc(T **p, size_t bytes) {
    const cudaError_t err = cudaMalloc(p, bytes);
    if (err == cudaSuccess) live_buffers++;
    return err;
}

static cudaError_t device_free(void *p) {
    if (!p) return cudaSuccess;
    const cudaError_t err = cudaFree(p);
    if (err == cudaSuccess) live_buffers--;
    return err;
}

long long mlp_device_buffers(void) { return live_buffers.load(); }

/* device_free each pointer (NULL is fine), going on past a failure so nothing else leaks; returns the first failure. */
static cudaError_t free_device(std::initializer_list<void *> pointers) {
    cudaError_t first = cudaSuccess;
    for (void *p : pointers) {
        const cudaError_t err = device_free(p);
        if (first == cudaSuccess) first = err;
    }
    return first;
}

/* No data set any more: the model's upload is freed, the caller's arrays are only let go. */
static cudaError_t forget_data(mlp *m) {
    const cudaError_t err = m->owns_data ? free_device({m->data_x, m->data_y}) : cudaSuccess;
    m->data_x = NULL, m->data_y = NULL;
    m->n_data = 0, m->owns_data = 0;
    return err;
}

static cudaError_t free_batch_buffers(mlp *m) {
    const cudaError_t err = free_device({m->x, m->y, m->h, m->a, m->dh, m->da, m->logits, m->dlogits, m->row_loss});
    m->x = m->h = m->a = m->dh = m->da = m->logits = m->dlogits = m->row_loss = NULL;
    m->y = NULL;
    m->capacity = 0;
    return err;
}

/* A failure half way leaves capacity 0 and some buffers allocated: the next call, or mlp_destroy, frees them. */
static int ensure_capacity(mlp *m, int rows) {
    if (rows <= m->capacity) return MLP_OK;
    const int status = check_elements(rows, m->n_in > m->hidden ? m->n_in : m->hidden);
    if (status) return status;
    CUDA_CHECK(free_batch_buffers(m));
    const size_t R = (size_t)rows;
    CUDA_CHECK(device_malloc(&m->x, sizeof(float) * R * m->n_in));
    CUDA_CHECK(device_malloc(&m->y, sizeof(int) * R));
    CUDA_CHECK(device_malloc(&m->h, sizeof(float) * R * m->hidden));
    CUDA_CHECK(device_malloc(&m->a, sizeof(float) * R * m->hidden));
    CUDA_CHECK(device_malloc(&m->dh, sizeof(float) * R * m->hidden));
    CUDA_CHECK(device_malloc(&m->da, sizeof(float) * R * m->hidden));
    CUDA_CHECK(device_malloc(&m->logits, sizeof(float) * R * m->n_out));
    CUDA_CHECK(device_malloc(&m->dlogits, sizeof(float) * R * m->n_out));
    CUDA_CHECK(device_malloc(&m->row_loss, sizeof(float) * R));
    m->capacity = rows;
    return MLP_OK;
}

/* Make the device array *p hold at least n elements; like the batch buffers, it only grows. */
template <typename T>
static int ensure_buffer(T **p, int *capacity, int n) {
    if (n <= *capacity) return MLP_OK;
    CUDA_CHECK(device_free(*p));
    *p = NULL, *capacity = 0;
    CUDA_CHECK(device_malloc(p, sizeof(T) * (size_t)n));
    *capacity = n;
    return MLP_OK;
}

/* The stream, the level's state, and zeroed parameters and gradients on the device. */
static int init_model(mlp *m) {
    /* Non-blocking: our stream never waits for work on the legacy default stream (PyTorch's, say). */
    CUDA_CHECK(cudaStreamCreateWithFlags(&m->stream, cudaStreamNonBlocking));
    const int status = level_create(m);
    if (status) return status;
    const size_t n_w1 = (size_t)m->hidden * m->n_in, n_w2 = (size_t)m->n_out * m->hidden;
    CUDA_CHECK(device_malloc(&m->w1, sizeof(float) * n_w1));
    CUDA_CHECK(device_malloc(&m->dw1, sizeof(float) * n_w1));
    CUDA_CHECK(device_malloc(&m->b1, sizeof(float) * m->hidden));
    CUDA_CHECK(device_malloc(&m->db1, sizeof(float) * m->hidden));
    CUDA_CHECK(device_malloc(&m->w2, sizeof(float) * n_w2));
    CUDA_CHECK(device_malloc(&m->dw2, sizeof(float) * n_w2));
    CUDA_CHECK(device_malloc(&m->b2, sizeof(float) * m->n_out));
    CUDA_CHECK(device_malloc(&m->db2, sizeof(float) * m->n_out));
    CUDA_CHECK(device_malloc(&m->found, 2 * sizeof(unsigned long long)));
    CUDA_CHECK(cudaMemsetAsync(m->w1, 0, sizeof(float) * n_w1, m->stream));
    CUDA_CHECK(cudaMemsetAsync(m->dw1, 0, sizeof(float) * n_w1, m->stream));
    CUDA_CHECK(cudaMemsetAsync(m->b1, 0, sizeof(float) * m->hidden, m->stream));
    CUDA_CHECK(cudaMemsetAsync(m->db1, 0, sizeof(float) * m->hidden, m->stream));
    CUDA_CHECK(cudaMemsetAsync(m->w2, 0, sizeof(float) * n_w2, m->stream));
    CUDA_CHECK(cudaMemsetAsync(m->dw2, 0, sizeof(float) * n_w2, m->stream));
    CUDA_CHECK(cudaMemsetAsync(m->b2, 0, sizeof(float) * m->n_out, m->stream));
    CUDA_CHECK(cudaMemsetAsync(m->db2, 0, sizeof(float) * m->n_out, m->stream));
    CUDA_CHECK(cudaStreamSynchronize(m->stream));
    return MLP_OK;
}

/* ---- the interface of mlp.h ----
 * Host arrays are copied with cudaMemcpyAsync on the model's stream, and every function ends with
 * cudaStreamSynchronize: when it returns, the caller's arrays are free to change, and any error of
 * the queued work has been checked. */

int mlp_create(mlp **out, int n_in, int hidden, int n_out) {
    if (!out) return FAIL(MLP_ERR_ARG, "out is NULL");
    *out = NULL;
    if (n_in < 1 || hidden < 1 || n_out < 1)
        return FAIL(MLP_ERR_ARG, "sizes must be >= 1, got n_in=%d hidden=%d n_out=%d", n_in, hidden, n_out);
    /* Loading the library never touches the GPU; this is the first call that does, so a machine
     * without one gets an error here, not a crash at import. */
    int devices = 0;
    const cudaError_t err = cudaGetDeviceCount(&devices);
    if (err != cudaSuccess || devices == 0) {
        (void)cudaGetLastError();
        return FAIL(MLP_ERR_DEVICE, "no CUDA device: %s",
                    err != cudaSuccess ? cudaGetErrorString(err) : "cudaGetDeviceCount found none");
    }
    mlp *m = static_cast<mlp *>(calloc(1, sizeof *m));
    if (!m) return FAIL(MLP_ERR_ALLOC, "out of memory for the model");
    m->n_in = n_in, m->hidden = hidden, m->n_out = n_out;
    const int status = init_model(m);
    if (status) {
        mlp_destroy(m);
        return status;
    }
    *out = m;
    return MLP_OK;
}

int mlp_destroy(mlp *m) {
    if (!m) return MLP_OK;
    int status = level_destroy(m); /* first: level 6's cuBLAS handle is bound to the stream */
    const int epoch_status = free_epoch_state(m);
    if (!status) status = epoch_status;
    cudaError_t err = forget_data(m);
    const cudaError_t own_err = free_device({m->w1, m->b1, m->w2, m->b2, m->dw1, m->db1, m->dw2, m->db2, m->found,
                                             m->order, m->losses});
    if (err == cudaSuccess) err = own_err;
    const cudaError_t batch_err = free_batch_buffers(m);
    if (err == cudaSuccess) err = batch_err;
    if (m->stream) {
        const cudaError_t stream_err = cudaStreamDestroy(m->stream);
        if (err == cudaSuccess) err = stream_err;
    }
    free(m);
    if (!status && err != cudaSuccess) status = cuda_fail(err, "cudaFree / cudaStreamDestroy", __FILE__, __LINE__);
    return status;
}

int mlp_set_params(mlp *m, const float *w1, const float *b1, const float *w2, const float *b2) {
    if (!m || !w1 || !b1 || !w2 || !b2) return FAIL(MLP_ERR_ARG, "NULL argument");
    const cudaMemcpyKind up = cudaMemcpyHostToDevice;
    CUDA_CHECK(cudaMemcpyAsync(m->w1, w1, sizeof(float) * (size_t)m->hidden * m->n_in, up, m->stream));
    CUDA_CHECK(cudaMemcpyAsync(m->b1, b1, sizeof(float) * (size_t)m->hidden, up, m->stream));
    CUDA_CHECK(cudaMemcpyAsync(m->w2, w2, sizeof(float) * (size_t)m->n_out * m->hidden, up, m->stream));
    CUDA_CHECK(cudaMemcpyAsync(m->b2, b2, sizeof(float) * (size_t)m->n_out, up, m->stream));
    CUDA_CHECK(cudaStreamSynchronize(m->stream));
    return MLP_OK;
}

int mlp_get_params(mlp *m, float *w1, float *b1, float *w2, float *b2) {
    if (!m || !w1 || !b1 || !w2 || !b2) return FAIL(MLP_ERR_ARG, "NULL argument");
    const cudaMemcpyKind down = cudaMemcpyDeviceToHost;
    CUDA_CHECK(cudaMemcpyAsync(w1, m->w1, sizeof(float) * (size_t)m->hidden * m->n_in, down, m->stream));
    CUDA_CHECK(cudaMemcpyAsync(b1, m->b1, sizeof(float) * (size_t)m->hidden, down, m->stream));
    CUDA_CHECK(cudaMemcpyAsync(w2, m->w2, sizeof(float) * (size_t)m->n_out * m->hidden, down, m->stream));
    CUDA_CHECK(cudaMemcpyAsync(b2, m->b2, sizeof(float) * (size_t)m->n_out, down, m->stream));
    CUDA_CHECK(cudaStreamSynchronize(m->stream));
    return MLP_OK;
}

int mlp_forward(mlp *m, float *logits, const float *x, int n) {
    if (!m || !logits || !x) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (n < 1) return FAIL(MLP_ERR_ARG, "n must be >= 1, got %d", n);
    int status = ensure_capacity(m, n < FORWARD_CHUNK ? n : FORWARD_CHUNK);
    if (status) return status;
    for (int start = 0; start < n; start += FORWARD_CHUNK) {
        const int B = n - start < FORWARD_CHUNK ? n - start : FORWARD_CHUNK;
        CUDA_CHECK(cudaMemcpyAsync(m->x, x + (size_t)start * m->n_in, sizeof(float) * (size_t)B * m->n_in,
                                   cudaMemcpyHostToDevice, m->stream));
        status = linear_forward(m, m->h, m->x, m->w1, B, m->n_in, m->hidden);
        if (!status) status = bias_forward(m, m->h, m->b1, B, m->hidden);
        if (!status) status = relu_forward(m, m->a, m->h, (size_t)B * m->hidden);
        if (!status) status = linear_forward(m, m->logits, m->a, m->w2, B, m->hidden, m->n_out);
        if (!status) status = bias_forward(m, m->logits, m->b2, B, m->n_out);
        if (status) return status;
        CUDA_CHECK(cudaMemcpyAsync(logits + (size_t)start * m->n_out, m->logits, sizeof(float) * (size_t)B * m->n_out,
                                   cudaMemcpyDeviceToHost, m->stream));
    }
    CUDA_CHECK(cudaStreamSynchronize(m->stream));
    return MLP_OK;
}

int mlp_loss_and_grads(mlp *m, float *loss, float *dw1, float *db1, float *dw2, float *db2, const float *x,
                       const int *y, int n) {
    if (!m || !loss || !dw1 || !db1 || !dw2 || !db2 || !x || !y) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (n < 1) return FAIL(MLP_ERR_ARG, "n must be >= 1, got %d", n);
    int status = check_labels(y, n, m->n_out);
    if (!status) status = ensure_capacity(m, n);
    if (!status) status = ensure_buffer(&m->losses, &m->loss_capacity, 1);
    if (status) return status;
    CUDA_CHECK(cudaMemcpyAsync(m->x, x, sizeof(float) * (size_t)n * m->n_in, cudaMemcpyHostToDevice, m->stream));
    CUDA_CHECK(cudaMemcpyAsync(m->y, y, sizeof(int) * (size_t)n, cudaMemcpyHostToDevice, m->stream));
    status = forward_backward(m, m->losses, m->x, m->y, n);
    if (status) return status;
    const cudaMemcpyKind down = cudaMemcpyDeviceToHost;
    CUDA_CHECK(cudaMemcpyAsync(loss, m->losses, sizeof(float), down, m->stream));
    CUDA_CHECK(cudaMemcpyAsync(dw1, m->dw1, sizeof(float) * (size_t)m->hidden * m->n_in, down, m->stream));
    CUDA_CHECK(cudaMemcpyAsync(db1, m->db1, sizeof(float) * (size_t)m->hidden, down, m->stream));
    CUDA_CHECK(cudaMemcpyAsync(dw2, m->dw2, sizeof(float) * (size_t)m->n_out * m->hidden, down, m->stream));
    CUDA_CHECK(cudaMemcpyAsync(db2, m->db2, sizeof(float) * (size_t)m->n_out, down, m->stream));
    CUDA_CHECK(cudaStreamSynchronize(m->stream));
    return MLP_OK;
}

/* The layers of forward_backward: the device buffers h, a, logits and their gradients, copied out. (Level 7 keeps
 * these on chip in its fused epoch; its layers are those of level 6's kernels, which it runs outside that epoch.) */
int mlp_layers(mlp *m, float *outputs, float *grads, const float *x, const int *y, int n) {
    if (!m || !outputs || !grads || !x || !y) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (n < 1) return FAIL(MLP_ERR_ARG, "n must be >= 1, got %d", n);
    int status = check_labels(y, n, m->n_out);
    if (!status) status = ensure_capacity(m, n);
    if (!status) status = ensure_buffer(&m->losses, &m->loss_capacity, 1);
    if (status) return status;
    CUDA_CHECK(cudaMemcpyAsync(m->x, x, sizeof(float) * (size_t)n * m->n_in, cudaMemcpyHostToDevice, m->stream));
    CUDA_CHECK(cudaMemcpyAsync(m->y, y, sizeof(int) * (size_t)n, cudaMemcpyHostToDevice, m->stream));
    status = forward_backward(m, m->losses, m->x, m->y, n);
    if (status) return status;
    const size_t hidden = (size_t)n * m->hidden, out = (size_t)n * m->n_out;
    const float *layers[3][2] = {{m->h, m->dh}, {m->a, m->da}, {m->logits, m->dlogits}}; /* (output, gradient) */
    const size_t offsets[3] = {0, hidden, 2 * hidden}, sizes[3] = {hidden, hidden, out};
    const cudaMemcpyKind down = cudaMemcpyDeviceToHost;
    for (int i = 0; i < 3; i++) {
        CUDA_CHECK(cudaMemcpyAsync(outputs + offsets[i], layers[i][0], sizeof(float) * sizes[i], down, m->stream));
        CUDA_CHECK(cudaMemcpyAsync(grads + offsets[i], layers[i][1], sizeof(float) * sizes[i], down, m->stream));
    }
    CUDA_CHECK(cudaStreamSynchronize(m->stream));
    return MLP_OK;
}

int mlp_set_matmul(mlp *m, int matmul) {
    if (!m) return FAIL(MLP_ERR_ARG, "NULL argument");
    const int status = check_matmul(matmul);
    if (status) return status;
    m->matmul = matmul;
    return MLP_OK;
}

int mlp_get_matmul(mlp *m, int *matmul) {
    if (!m || !matmul) return FAIL(MLP_ERR_ARG, "NULL argument");
    *matmul = m->matmul;
    return MLP_OK;
}

/* One upload, then every epoch gathers its batches on the device: the training set never crosses
 * the PCIe bus again. */
int mlp_set_data(mlp *m, const float *x, const int *y, int n) {
    if (!m || !x || !y) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (n < 1) return FAIL(MLP_ERR_ARG, "n must be >= 1, got %d", n);
    const int status = check_labels(y, n, m->n_out);
    if (status) return status;
    CUDA_CHECK(forget_data(m)); /* no data set until the new one is complete */
    m->owns_data = 1;           /* what is allocated below is the model's, to free */
    CUDA_CHECK(device_malloc(&m->data_x, sizeof(float) * (size_t)n * m->n_in));
    CUDA_CHECK(device_malloc(&m->data_y, sizeof(int) * (size_t)n));
    CUDA_CHECK(cudaMemcpyAsync(m->data_x, x, sizeof(float) * (size_t)n * m->n_in, cudaMemcpyHostToDevice, m->stream));
    CUDA_CHECK(cudaMemcpyAsync(m->data_y, y, sizeof(int) * (size_t)n, cudaMemcpyHostToDevice, m->stream));
    CUDA_CHECK(cudaStreamSynchronize(m->stream));
    m->n_data = n;
    return MLP_OK;
}

/* bytes at p must be memory of the current device (or managed memory): a host pointer, or another GPU's, is refused
 * here rather than found by a kernel's fault. A range cannot be asked about, so its first and last byte are. */
static int check_device_memory(const void *p, size_t bytes, const char *name) {
    int device = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    const char *first = static_cast<const char *>(p);
    for (const char *byte : {first, first + bytes - 1}) {
        cudaPointerAttributes where;
        CUDA_CHECK(cudaPointerGetAttributes(&where, byte));
        const bool on_a_device = where.type == cudaMemoryTypeDevice || where.type == cudaMemoryTypeManaged;
        if (!on_a_device || where.device != device)
            return FAIL(MLP_ERR_ARG, "%s (%zu bytes at %p) is not memory of the current CUDA device, %d", name, bytes,
                        p, device);
    }
    return MLP_OK;
}

#define NOT_FOUND 0xffffffffffffffffull
#define CHECK_BLOCKS 1024 /* blocks of the data check: enough to fill a GPU; each thread strides over the rest */

/* The check of the caller's data set x (n, n_in), y (n): found[0] becomes the first row whose label is outside
 * [0, n_out), found[1] the first element of x that is NaN or infinite, each left at NOT_FOUND where there is none.
 * atomicMin keeps the first, whatever order the threads run in. */
__global__ void check_data_kernel(unsigned long long *found, const float *x, const int *y, int n, int n_in,
                                  int n_out) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = thread_index(); i < (size_t)n; i += stride)
        if (y[i] < 0 || y[i] >= n_out) atomicMin(&found[0], (unsigned long long)i);
    for (size_t i = thread_index(); i < (size_t)n * n_in; i += stride)
        if (!isfinite(x[i])) atomicMin(&found[1], (unsigned long long)i);
}

/* check_labels (mlp_status.h) and check_X's finiteness (Python's), for arrays on the device: one kernel, one wait. */
static int check_data(mlp *m, const float *x, const int *y, int n) {
    unsigned long long found[2];
    const size_t values = (size_t)n * m->n_in;
    CUDA_CHECK(cudaMemsetAsync(m->found, 0xff, sizeof found, m->stream)); /* NOT_FOUND, both */
    check_data_kernel<<<blocks_for(values) < CHECK_BLOCKS ? blocks_for(values) : CHECK_BLOCKS, THREADS, 0,
                        m->stream>>>(m->found, x, y, n, m->n_in, m->n_out);
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaMemcpyAsync(found, m->found, sizeof found, cudaMemcpyDeviceToHost, m->stream));
    CUDA_CHECK(cudaStreamSynchronize(m->stream));
    if (found[0] != NOT_FOUND) {
        int label = 0;
        CUDA_CHECK(cudaMemcpyAsync(&label, y + found[0], sizeof label, cudaMemcpyDeviceToHost, m->stream));
        CUDA_CHECK(cudaStreamSynchronize(m->stream));
        return FAIL(MLP_ERR_ARG, "label y[%llu] = %d is outside [0, %d) (checked on the device)", found[0], label,
                    m->n_out);
    }
    if (found[1] != NOT_FOUND)
        return FAIL(MLP_ERR_ARG, "x[%llu, %llu] is NaN or infinity (checked on the device)", found[1] / m->n_in,
                    found[1] % m->n_in);
    return MLP_OK;
}

/* No upload: every epoch gathers its batches from the caller's arrays, until the next mlp_set_data or
 * mlp_use_device_data. Everything is checked here, at every call (native.py calls it once per epoch): where the
 * memory is, its alignment, and, on the device, every label and every value. */
int mlp_use_device_data(mlp *m, const float *x, const int *y, int n) {
    if (!m || !x || !y) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (n < 1) return FAIL(MLP_ERR_ARG, "n must be >= 1, got %d", n);
    CUDA_CHECK(forget_data(m)); /* no data set until the new one is checked */
    if ((uintptr_t)x % 16 != 0 || (uintptr_t)y % sizeof(int) != 0)
        return FAIL(MLP_ERR_ARG, "x must start at a multiple of 16 bytes (level 7 copies rows 16 bytes at a time) and "
                    "y at a multiple of 4, got %p and %p: pass copies (PyTorch: X.clone())", (const void *)x,
                    (const void *)y);
    int status = check_device_memory(x, sizeof(float) * (size_t)n * m->n_in, "x");
    if (!status) status = check_device_memory(y, sizeof(int) * (size_t)n, "y");
    if (status) return status;
    /* The caller's writes may be queued on any stream (CAI v2 names none), and ours waits for none: wait for all. */
    CUDA_CHECK(cudaDeviceSynchronize());
    status = check_data(m, x, y, n);
    if (status) return status;
    m->data_x = const_cast<float *>(x), m->data_y = const_cast<int *>(y); /* only ever read */
    m->n_data = n;
    return MLP_OK;
}

/* The steps of an epoch over the rows m->order[0 .. n_order), each step's loss to m->losses[step], all
 * queued on the stream without waiting: for each step, gather, forward, backward and update. */
static int queue_steps(mlp *m, int n_order, int batch_size, float lr) {
    for (int start = 0, step = 0; start < n_order; start += batch_size, step++) {
        const int B = n_order - start < batch_size ? n_order - start : batch_size;
        int status = gather(m, m->x, m->y, m->data_x, m->data_y, m->order + start, B, m->n_in);
        if (!status) status = forward_backward(m, m->losses + step, m->x, m->y, B);
        if (!status) status = sgd_update(m, m->w1, m->dw1, lr, (size_t)m->hidden * m->n_in);
        if (!status) status = sgd_update(m, m->b1, m->db1, lr, (size_t)m->hidden);
        if (!status) status = sgd_update(m, m->w2, m->dw2, lr, (size_t)m->n_out * m->hidden);
        if (!status) status = sgd_update(m, m->b2, m->db2, lr, (size_t)m->n_out);
        if (status) return status;
    }
    return MLP_OK;
}

#ifndef LEVEL_TRAINS_ITS_OWN_EPOCH /* the steps queued one kernel after another, and no state of the epoch's own */
static int train_steps(mlp *m, int n_order, int batch_size, float lr) { return queue_steps(m, n_order, batch_size, lr); }
static int free_epoch_state(mlp *) { return MLP_OK; }
#endif

/* The whole epoch runs on the stream without waiting: the host uploads the order once, then the steps
 * are queued (train_steps), each step's loss going to m->losses[step] on the device. One copy brings
 * all the losses back, and one synchronization ends the epoch. */
int mlp_train_epoch(mlp *m, float *losses, const int *order, int n_order, int batch_size, float lr) {
    if (!m || !losses || !order) return FAIL(MLP_ERR_ARG, "NULL argument");
    int status = check_epoch(order, n_order, batch_size, m->n_data);
    if (status) return status;
    const int steps = n_order / batch_size + (n_order % batch_size != 0);
    status = ensure_capacity(m, batch_size < n_order ? batch_size : n_order);
    if (!status) status = ensure_buffer(&m->order, &m->order_capacity, n_order);
    if (!status) status = ensure_buffer(&m->losses, &m->loss_capacity, steps);
    if (status) return status;
    CUDA_CHECK(cudaMemcpyAsync(m->order, order, sizeof(int) * (size_t)n_order, cudaMemcpyHostToDevice, m->stream));
    status = train_steps(m, n_order, batch_size, lr);
    if (status) return status;
    CUDA_CHECK(cudaMemcpyAsync(losses, m->losses, sizeof(float) * (size_t)steps, cudaMemcpyDeviceToHost, m->stream));
    CUDA_CHECK(cudaStreamSynchronize(m->stream));
    return MLP_OK;
}

#endif /* CUDA_MLP_CUH */
