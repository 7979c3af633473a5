/* level8_framework/ops.cu - Level 8's GPU backend: the framework's operations (common/native/ops.h) as this course's kernels.
 *
 * What this file adds over levels 5 and 6: almost no kernel of its own. Level 5's lenet.cu brings, with its mlp.cu and
 * common/native/cuda_mlp.cuh, every kernel of the naive CUDA level and the layer function that launches it (bias, ReLU,
 * softmax cross-entropy, the mean in double, the batch gather, SGD, the direct convolution, max-pooling); level 6's
 * mlp.cu brings the cuBLAS products. Both levels define the MLP's product hooks (linear_forward, level_create, ...)
 * under the same names, so level 6's file is included inside a namespace of its own, cublas_level. Written here: the
 * kernels the networks of levels 5 and 6 never needed (sigmoid, MSE, the mean's backward, momentum, Adam, a transpose),
 * the strided copy that makes any view contiguous, MiniTorch's three kernels of every other operation (map, zip and
 * reduce), one general product (one cublasSgemm, level 6's layout rules) and the memory of tensors: a pool of the
 * context's, given and taken back in stream order, so that a tensor freed by Python never waits for the GPU.
 *
 * Each function checks its arguments, queues its work on the context's stream and returns a status; the layer
 * functions it calls check every launch and cuBLAS call (CUDA_CHECK, CUBLAS_CHECK).
 *
 * Implements common/native/ops.h. Build: `make level8`; test: `pytest -m level8` on a GPU machine.
 */
/* Level 5's backward halves take level 6's names and argument types; inside level 6's namespace a call to one would
 * match both (C++ also looks in the namespace of its argument, struct mlp), so level 5's are renamed here. */
#define linear_backward_dw naive_linear_backward_dw
#define linear_backward_dx naive_linear_backward_dx
#include "../level5_cuda_naive/lenet.cu"
#undef linear_backward_dw
#undef linear_backward_dx

#include <cublas_v2.h> /* first, so that level 6's own include of it, inside the namespace, adds nothing there */
namespace cublas_level {
#include "../level6_cublas/mlp.cu"
}

#include "ops.h"

#include <cstdint>

struct ops {
    lenet net;          /* what level 5's and level 6's layer functions read: net.base.stream, and in
                           net.base.level_state level 6's cuBLAS handle (level 5's pooling takes the lenet) */
    cudaMemPool_t pool; /* the tensors' memory */
};

static cudaStream_t stream(ops *c) { return c->net.base.stream; }

/* The checks that open every function: a context, no NULL among the named pointers, every size at least 1. Each
 * returns the failure from the enclosing function, with the caller's file and line. */
#define CHECK_CONTEXT(c)                                                        \
    do {                                                                        \
        if (!(c)) return FAIL(MLP_ERR_ARG, "the context is NULL");              \
    } while (0)
#define CHECK_POINTERS(...)                                                                     \
    do {                                                                                        \
        for (const void *p_ : std::initializer_list<const void *>{__VA_ARGS__})                 \
            if (!p_) return FAIL(MLP_ERR_ARG, "NULL among the pointers %s", #__VA_ARGS__);      \
    } while (0)
#define CHECK_SIZES(...)                                                                        \
    do {                                                                                        \
        for (long long n_ : std::initializer_list<long long>{__VA_ARGS__})                      \
            if (n_ < 1) return FAIL(MLP_ERR_ARG, "the sizes %s must be >= 1, one is %lld", #__VA_ARGS__, n_); \
    } while (0)

/* ---- the context ---- */

static int init_context(ops *c) {
    CUDA_CHECK(cudaStreamCreateWithFlags(&c->net.base.stream, cudaStreamNonBlocking));
    const int status = cublas_level::level_create(&c->net.base);
    if (status) return status;
    int device = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    cudaMemPoolProps props = {};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    CUDA_CHECK(cudaMemPoolCreate(&c->pool, &props));
    /* Memory a tensor gives back stays in the pool for the next (the caching PyTorch does): without a threshold, the
     * pool would return it to the driver at every synchronization, and take it again at the next allocation. */
    uint64_t keep = UINT64_MAX;
    CUDA_CHECK(cudaMemPoolSetAttribute(c->pool, cudaMemPoolAttrReleaseThreshold, &keep));
    return MLP_OK;
}

int ops_create(ops **out) {
    if (!out) return FAIL(MLP_ERR_ARG, "out is NULL");
    *out = NULL;
    int devices = 0;
    const cudaError_t err = cudaGetDeviceCount(&devices);
    if (err != cudaSuccess || devices == 0) {
        (void)cudaGetLastError();
        return FAIL(MLP_ERR_DEVICE, "no CUDA device: %s",
                    err != cudaSuccess ? cudaGetErrorString(err) : "cudaGetDeviceCount found none");
    }
    ops *c = static_cast<ops *>(calloc(1, sizeof *c));
    if (!c) return FAIL(MLP_ERR_ALLOC, "out of memory for the context");
    const int status = init_context(c);
    if (status) {
        ops_destroy(c);
        return status;
    }
    *out = c;
    return MLP_OK;
}

int ops_destroy(ops *c) {
    if (!c) return MLP_OK;
    cudaError_t err = c->net.base.stream ? cudaStreamSynchronize(c->net.base.stream) : cudaSuccess;
    int status = cublas_level::level_destroy(&c->net.base); /* first: the handle is bound to the stream */
    if (c->pool) {
        const cudaError_t pool_err = cudaMemPoolDestroy(c->pool);
        if (err == cudaSuccess) err = pool_err;
    }
    if (c->net.base.stream) {
        const cudaError_t stream_err = cudaStreamDestroy(c->net.base.stream);
        if (err == cudaSuccess) err = stream_err;
    }
    free(c);
    if (!status && err != cudaSuccess) status = cuda_fail(err, "ops_destroy", __FILE__, __LINE__);
    return status;
}

/* ---- memory ---- */

/* Counted in cuda_mlp.cuh's live_buffers, as every device buffer of the course's libraries: mlp_device_buffers(). */
int ops_alloc(ops *c, void **p, size_t bytes) {
    CHECK_CONTEXT(c);
    if (!p) return FAIL(MLP_ERR_ARG, "p is NULL");
    *p = NULL;
    CUDA_CHECK(cudaMallocFromPoolAsync(p, bytes ? bytes : 1, c->pool, stream(c)));
    live_buffers++;
    return MLP_OK;
}

int ops_free(ops *c, void *p) {
    CHECK_CONTEXT(c);
    if (!p) return MLP_OK;
    CUDA_CHECK(cudaFreeAsync(p, stream(c))); /* after the work queued before it: nothing still reads it */
    live_buffers--;
    return MLP_OK;
}

int ops_upload(ops *c, void *dst, const void *src, size_t bytes) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(dst, src);
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream(c)));
    return MLP_OK;
}

int ops_download(ops *c, void *dst, const void *src, size_t bytes) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(dst, src);
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream(c)));
    CUDA_CHECK(cudaStreamSynchronize(stream(c)));
    return MLP_OK;
}

int ops_copy(ops *c, void *dst, const void *src, size_t bytes) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(dst, src);
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream(c)));
    return MLP_OK;
}

__global__ void fill_kernel(float *x, float value, size_t n) {
    const size_t i = thread_index();
    if (i < n) x[i] = value;
}

int ops_fill(ops *c, float *x, float value, size_t n) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(x);
    fill_kernel<<<blocks_for(n), THREADS, 0, stream(c)>>>(x, value, n);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
}

int ops_synchronize(ops *c) {
    CHECK_CONTEXT(c);
    CUDA_CHECK(cudaStreamSynchronize(stream(c)));
    return MLP_OK;
}

/* ---- products and shapes ---- */

/* Row-major out = op(a) @ op(b) is column-major out^T = op(b)^T @ op(a)^T, and cuBLAS reads a row-major array as its
 * transpose (level6_cublas/mlp.cu, whose table is three of these four cases). So op(b)^T is b as stored when b is
 * not transposed (N, ld = its row-major width N), and b as stored, transposed, when it is (T, ld = K); likewise a. */
int ops_gemm(ops *c, float *out, const float *a, const float *b, int M, int N, int K, int transpose_a,
             int transpose_b) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(out, a, b);
    CHECK_SIZES(M, N, K);
    CUBLAS_CHECK(cublasSgemm(cublas_level::cublas(&c->net.base), transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                             transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &cublas_level::one, b,
                             transpose_b ? K : N, a, transpose_a ? M : K, &cublas_level::zero, out, N));
    return MLP_OK;
}

int ops_linear_forward(ops *c, float *out, const float *x, const float *w, int B, int n_in, int n_out) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(out, x, w);
    CHECK_SIZES(B, n_in, n_out);
    return cublas_level::linear_forward(&c->net.base, out, x, w, B, n_in, n_out);
}

int ops_linear_backward(ops *c, float *dx, float *dw, const float *dout, const float *x, const float *w, int B,
                        int n_in, int n_out) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(dw, dout, x, w);
    CHECK_SIZES(B, n_in, n_out);
    return cublas_level::linear_backward(&c->net.base, dx, dw, dout, x, w, B, n_in, n_out);
}

/* out (cols, rows) = x (rows, cols)^T: one thread per element, reading x along its rows. */
__global__ void transpose_kernel(float *out, const float *x, int rows, int cols) {
    const size_t i = thread_index();
    if (i >= (size_t)rows * cols) return;
    const size_t r = i / cols, k = i % cols;
    out[k * rows + r] = x[i];
}

int ops_transpose(ops *c, float *out, const float *x, int rows, int cols) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(out, x);
    CHECK_SIZES(rows, cols);
    transpose_kernel<<<blocks_for((size_t)rows * cols), THREADS, 0, stream(c)>>>(out, x, rows, cols);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
}

/* ---- views: storage, shape and strides ---- */

/* A shape and two layouts of it, passed to the kernel by value (no device copy of the host arrays). */
struct strided_layout {
    int ndim;
    int shape[OPS_MAX_DIMS], out_strides[OPS_MAX_DIMS], x_strides[OPS_MAX_DIMS];
};

/* One thread per value: its index [i0, i1, ...] from its row-major number, last axis first, then its position in
 * each layout, index times strides (strides.py's index_to_position). */
__global__ void strided_copy_kernel(float *out, const float *x, strided_layout l, size_t n) {
    size_t i = thread_index();
    if (i >= n) return;
    long long to = 0, from = 0;
    for (int d = l.ndim - 1; d >= 0; d--) {
        const long long k = (long long)(i % (size_t)l.shape[d]);
        i /= (size_t)l.shape[d];
        to += k * l.out_strides[d];
        from += k * l.x_strides[d];
    }
    out[to] = x[from];
}

int ops_strided_copy(ops *c, float *out, const int *out_strides, const float *x, const int *x_strides,
                     const int *shape, int ndim) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(out, out_strides, x, x_strides, shape);
    if (ndim < 1 || ndim > OPS_MAX_DIMS)
        return FAIL(MLP_ERR_ARG, "ndim must be in [1, %d], got %d", OPS_MAX_DIMS, ndim);
    strided_layout l = {};
    l.ndim = ndim;
    size_t n = 1;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0 || out_strides[d] < 0 || x_strides[d] < 0)
            return FAIL(MLP_ERR_ARG, "axis %d: size %d, strides %d and %d; none may be negative", d, shape[d],
                        out_strides[d], x_strides[d]);
        l.shape[d] = shape[d];
        l.out_strides[d] = out_strides[d];
        l.x_strides[d] = x_strides[d];
        n *= (size_t)shape[d];
    }
    if (n == 0) return MLP_OK;
    strided_copy_kernel<<<blocks_for(n), THREADS, 0, stream(c)>>>(out, x, l, n);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
}

/* ---- element-wise ---- */

/* map: out = f(x), one thread per value. powf(v, 2) is v * v exactly, as PyTorch's x ** 2. */
__global__ void map_kernel(float *out, const float *x, int f, float k, size_t n) {
    const size_t i = thread_index();
    if (i >= n) return;
    const float v = x[i];
    switch (f) {
    case OPS_NEG: out[i] = -v; break;
    case OPS_EXP: out[i] = expf(v); break;
    case OPS_LOG: out[i] = logf(v); break;
    case OPS_TANH: out[i] = tanhf(v); break;
    default: out[i] = powf(v, k); break;
    }
}

int ops_map(ops *c, float *out, const float *x, int f, float k, size_t n) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(out, x);
    if (f < OPS_NEG || f > OPS_POW) return FAIL(MLP_ERR_ARG, "no function %d in ops_map", f);
    map_kernel<<<blocks_for(n), THREADS, 0, stream(c)>>>(out, x, f, k, n);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
}

/* zip: out = a op b, one thread per value (a broadcast operand was made full-size by ops_strided_copy). */
__global__ void zip_kernel(float *out, const float *a, const float *b, int op, size_t n) {
    const size_t i = thread_index();
    if (i >= n) return;
    const float x = a[i], y = b[i];
    switch (op) {
    case OPS_ADD: out[i] = x + y; break;
    case OPS_SUB: out[i] = x - y; break;
    case OPS_MUL: out[i] = x * y; break;
    case OPS_DIV: out[i] = x / y; break;
    default: out[i] = x == y ? 1.0f : 0.0f; break;
    }
}

int ops_zip(ops *c, float *out, const float *a, const float *b, int op, size_t n) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(out, a, b);
    if (op < OPS_ADD || op > OPS_EQ) return FAIL(MLP_ERR_ARG, "no operation %d in ops_zip", op);
    zip_kernel<<<blocks_for(n), THREADS, 0, stream(c)>>>(out, a, b, op, n);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
}

int ops_add(ops *c, float *out, const float *a, const float *b, size_t n) { return ops_zip(c, out, a, b, OPS_ADD, n); }

/* reduce: one thread per output value, walking the n values of its column of x (outer, n, inner) in order. The sum
 * runs in double (as level 5's mean); the max keeps a NaN once it meets one, as PyTorch's. */
__global__ void reduce_kernel(float *out, const float *x, int outer, int n, int inner, int op) {
    const size_t i = thread_index();
    if (i >= (size_t)outer * inner) return;
    const float *column = x + (i / inner) * (size_t)n * inner + i % inner;
    if (op == OPS_SUM) {
        double sum = 0.0;
        for (int j = 0; j < n; j++) sum += column[(size_t)j * inner];
        out[i] = (float)sum;
        return;
    }
    float best = column[0];
    for (int j = 1; j < n; j++) {
        const float v = column[(size_t)j * inner];
        if (v > best || v != v) best = v;
    }
    out[i] = best;
}

int ops_reduce(ops *c, float *out, const float *x, int outer, int n, int inner, int op) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(out, x);
    CHECK_SIZES(outer, n, inner);
    if (op != OPS_SUM && op != OPS_MAX) return FAIL(MLP_ERR_ARG, "no reduction %d in ops_reduce", op);
    reduce_kernel<<<blocks_for((size_t)outer * inner), THREADS, 0, stream(c)>>>(out, x, outer, n, inner, op);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
}

int ops_bias_forward(ops *c, float *out, const float *b, int rows, int n) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(out, b);
    CHECK_SIZES(rows, n);
    return bias_forward(&c->net.base, out, b, rows, n);
}

int ops_bias_backward(ops *c, float *db, const float *dout, int rows, int n) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(db, dout);
    CHECK_SIZES(rows, n);
    return bias_backward(&c->net.base, db, dout, rows, n);
}

int ops_relu_forward(ops *c, float *a, const float *h, size_t n) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(a, h);
    return relu_forward(&c->net.base, a, h, n);
}

int ops_relu_backward(ops *c, float *dh, const float *da, const float *h, size_t n) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(dh, da, h);
    return relu_backward(&c->net.base, dh, da, h, n);
}

/* s = 1 / (1 + exp(-h)): for h far below 0, exp(-h) is inf and s is 0, never NaN. */
__global__ void sigmoid_forward_kernel(float *s, const float *h, size_t n) {
    const size_t i = thread_index();
    if (i < n) s[i] = 1.0f / (1.0f + expf(-h[i]));
}

/* Backward of s = sigmoid(h), from the output: dh = ds (1 - s) s, PyTorch's order. */
__global__ void sigmoid_backward_kernel(float *dh, const float *ds, const float *s, size_t n) {
    const size_t i = thread_index();
    if (i < n) dh[i] = ds[i] * (1.0f - s[i]) * s[i];
}

int ops_sigmoid_forward(ops *c, float *s, const float *h, size_t n) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(s, h);
    sigmoid_forward_kernel<<<blocks_for(n), THREADS, 0, stream(c)>>>(s, h, n);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
}

int ops_sigmoid_backward(ops *c, float *dh, const float *ds, const float *s, size_t n) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(dh, ds, s);
    sigmoid_backward_kernel<<<blocks_for(n), THREADS, 0, stream(c)>>>(dh, ds, s, n);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
}

/* ---- losses and the mean ---- */

/* x (n) *= *scale (one value on the device): a loss's backward times the gradient that reaches the loss (1 when the
 * loss is the output, and then exactly x). */
__global__ void scale_kernel(float *x, const float *scale, size_t n) {
    const size_t i = thread_index();
    if (i < n) x[i] *= *scale;
}

int ops_softmax_xent_forward(ops *c, float *loss, float *probs, float *row_loss, const float *logits, const int *y,
                             int B, int n_out) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(loss, probs, row_loss, logits, y);
    CHECK_SIZES(B, n_out);
    return softmax_xent_forward(&c->net.base, loss, probs, row_loss, logits, y, B, n_out);
}

int ops_softmax_xent_backward(ops *c, float *dlogits, const float *probs, const int *y, const float *dloss, int B,
                              int n_out) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(dlogits, probs, y, dloss);
    CHECK_SIZES(B, n_out);
    const int status = softmax_xent_backward(&c->net.base, dlogits, probs, y, B, n_out); /* (probs - onehot) / B */
    if (status) return status;
    scale_kernel<<<blocks_for((size_t)B * n_out), THREADS, 0, stream(c)>>>(dlogits, dloss, (size_t)B * n_out);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
}

__global__ void squares_kernel(float *squares, const float *x, const float *t, size_t n) {
    const size_t i = thread_index();
    if (i >= n) return;
    const float d = x[i] - t[i];
    squares[i] = d * d;
}

/* dx = (x - t) (2 / n) dloss, PyTorch's order. */
__global__ void mse_backward_kernel(float *dx, const float *x, const float *t, const float *dloss, int n) {
    const size_t i = thread_index();
    if (i < (size_t)n) dx[i] = (x[i] - t[i]) * (2.0f / (float)n) * *dloss;
}

int ops_mse_forward(ops *c, float *loss, float *squares, const float *x, const float *t, int n) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(loss, squares, x, t);
    CHECK_SIZES(n);
    squares_kernel<<<blocks_for(n), THREADS, 0, stream(c)>>>(squares, x, t, n);
    CUDA_CHECK(cudaGetLastError());
    mean_loss_kernel<<<1, THREADS, 0, stream(c)>>>(loss, squares, n); /* level 5's mean, in double */
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
}

int ops_mse_backward(ops *c, float *dx, const float *x, const float *t, const float *dloss, int n) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(dx, x, t, dloss);
    CHECK_SIZES(n);
    mse_backward_kernel<<<blocks_for(n), THREADS, 0, stream(c)>>>(dx, x, t, dloss, n);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
}

int ops_mean(ops *c, float *out, const float *x, int n) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(out, x);
    CHECK_SIZES(n);
    mean_loss_kernel<<<1, THREADS, 0, stream(c)>>>(out, x, n);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
}

__global__ void mean_backward_kernel(float *dx, const float *dout, int n) {
    const size_t i = thread_index();
    if (i < (size_t)n) dx[i] = *dout / (float)n;
}

int ops_mean_backward(ops *c, float *dx, const float *dout, int n) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(dx, dout);
    CHECK_SIZES(n);
    mean_backward_kernel<<<blocks_for(n), THREADS, 0, stream(c)>>>(dx, dout, n);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
}

/* ---- convolution and pooling: level 5's ---- */

int ops_conv2d_forward(ops *c, float *out, const float *x, const float *w, const float *b, int B, int C, int H, int F,
                       int k) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(out, x, w, b);
    CHECK_SIZES(B, C, H, F, k, H - k + 1);
    return conv2d_forward(&c->net, out, x, w, b, B, C, H, F, k);
}

int ops_conv2d_backward(ops *c, float *dx, float *dw, float *db, const float *dout, const float *x, const float *w,
                        int B, int C, int H, int F, int k) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(dw, db, dout, x, w);
    CHECK_SIZES(B, C, H, F, k, H - k + 1);
    return conv2d_backward(&c->net, dx, dw, db, dout, x, w, B, C, H, F, k);
}

int ops_maxpool_forward(ops *c, float *out, int *choice, const float *a, int B, int C, int H) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(out, choice, a);
    CHECK_SIZES(B, C, H);
    if (H % 2) return FAIL(MLP_ERR_ARG, "max-pooling 2 x 2 needs an even height, got %d", H);
    return maxpool_forward(&c->net, out, choice, a, B, C, H);
}

int ops_maxpool_backward(ops *c, float *da, const float *dout, const int *choice, int B, int C, int H) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(da, dout, choice);
    CHECK_SIZES(B, C, H);
    if (H % 2) return FAIL(MLP_ERR_ARG, "max-pooling 2 x 2 needs an even height, got %d", H);
    return maxpool_backward(&c->net, da, dout, choice, B, C, H);
}

/* ---- a batch, and the optimizers' updates ---- */

int ops_gather(ops *c, float *x, int *y, const float *data_x, const int *data_y, const int *order, int B, int n_in) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(x, y, data_x, data_y, order);
    CHECK_SIZES(B, n_in);
    return gather(&c->net.base, x, y, data_x, data_y, order, B, n_in);
}

int ops_sgd_update(ops *c, float *p, const float *dp, float lr, size_t n) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(p, dp);
    return sgd_update(&c->net.base, p, dp, lr, n);
}

/* buf = momentum buf + dp, the product rounded on its own (PyTorch's buf.mul_(momentum).add_(dp) is two kernels);
 * then p -= lr buf. */
__device__ __forceinline__ void sgd_momentum_element(float *p, const float *dp, float *buf, float lr, float momentum,
                                                     size_t i) {
    const float b = __fmul_rn(momentum, buf[i]) + dp[i];
    buf[i] = b;
    p[i] -= lr * b;
}

__global__ void sgd_momentum_update_kernel(float *p, const float *dp, float *buf, float lr, float momentum, size_t n) {
    const size_t i = thread_index();
    if (i < n) sgd_momentum_element(p, dp, buf, lr, momentum, i);
}

int ops_sgd_momentum_update(ops *c, float *p, const float *dp, float *buf, float lr, float momentum, size_t n) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(p, dp, buf);
    sgd_momentum_update_kernel<<<blocks_for(n), THREADS, 0, stream(c)>>>(p, dp, buf, lr, momentum, n);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
}

/* PyTorch's Adam, one thread per element: m.lerp_(g, weight1); v.mul_(beta2).addcmul_(g, g, weight2);
 * p.addcdiv_(m, sqrt(v) / bias_correction2_sqrt + eps, -step_size). eps is added outside the square root. */
__device__ __forceinline__ void adam_element(float *p, const float *dp, float *m, float *v, float weight1, float beta2,
                                             float weight2, float step_size, float bias_correction2_sqrt, float eps,
                                             size_t i) {
    const float g = dp[i];
    const float m_new = m[i] + weight1 * (g - m[i]);
    const float v_new = __fmul_rn(v[i], beta2) + weight2 * g * g;
    const float denom = sqrtf(v_new) / bias_correction2_sqrt + eps;
    m[i] = m_new;
    v[i] = v_new;
    p[i] -= step_size * m_new / denom;
}

__global__ void adam_update_kernel(float *p, const float *dp, float *m, float *v, float weight1, float beta2,
                                   float weight2, float step_size, float bias_correction2_sqrt, float eps, size_t n) {
    const size_t i = thread_index();
    if (i < n) adam_element(p, dp, m, v, weight1, beta2, weight2, step_size, bias_correction2_sqrt, eps, i);
}

int ops_adam_update(ops *c, float *p, const float *dp, float *m, float *v, float weight1, float beta2, float weight2,
                    float step_size, float bias_correction2_sqrt, float eps, size_t n) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(p, dp, m, v);
    if (!(bias_correction2_sqrt > 0.0f)) return FAIL(MLP_ERR_ARG, "bias_correction2_sqrt must be > 0");
    adam_update_kernel<<<blocks_for(n), THREADS, 0, stream(c)>>>(p, dp, m, v, weight1, beta2, weight2, step_size,
                                                                 bias_correction2_sqrt, eps, n);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
}

/* ---- the updates reading their numbers from device memory, for a replayed step ---- */

/* level 5's sgd_update_kernel, lr read from memory: the same expression, so the same bits. */
__global__ void sgd_update_from_kernel(float *p, const float *dp, const float *numbers, size_t n) {
    const size_t i = thread_index();
    if (i >= n) return;
    const float lr = numbers[0];
    p[i] -= lr * dp[i];
}

__global__ void sgd_momentum_update_from_kernel(float *p, const float *dp, float *buf, const float *numbers, size_t n) {
    const size_t i = thread_index();
    if (i < n) sgd_momentum_element(p, dp, buf, numbers[0], numbers[1], i);
}

__global__ void adam_update_from_kernel(float *p, const float *dp, float *m, float *v, const float *numbers, size_t n) {
    const size_t i = thread_index();
    if (i < n)
        adam_element(p, dp, m, v, numbers[0], numbers[1], numbers[2], numbers[3], numbers[4], numbers[5], i);
}

int ops_sgd_update_from(ops *c, float *p, const float *dp, const float *numbers, size_t n) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(p, dp, numbers);
    sgd_update_from_kernel<<<blocks_for(n), THREADS, 0, stream(c)>>>(p, dp, numbers, n);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
}

int ops_sgd_momentum_update_from(ops *c, float *p, const float *dp, float *buf, const float *numbers, size_t n) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(p, dp, buf, numbers);
    sgd_momentum_update_from_kernel<<<blocks_for(n), THREADS, 0, stream(c)>>>(p, dp, buf, numbers, n);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
}

int ops_adam_update_from(ops *c, float *p, const float *dp, float *m, float *v, const float *numbers, size_t n) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(p, dp, m, v, numbers);
    adam_update_from_kernel<<<blocks_for(n), THREADS, 0, stream(c)>>>(p, dp, m, v, numbers, n);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
}

/* ---- a step recorded once and replayed ---- */

struct ops_graph {
    cudaGraphExec_t exec;
};

/* Thread-local capture: only this thread's calls that would wait for the GPU or take pool memory fail meanwhile. */
int ops_record_begin(ops *c) {
    CHECK_CONTEXT(c);
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(stream(c), &capturing));
    if (capturing != cudaStreamCaptureStatusNone) return FAIL(MLP_ERR_ARG, "the stream is already recording");
    CUDA_CHECK(cudaStreamBeginCapture(stream(c), cudaStreamCaptureModeThreadLocal));
    return MLP_OK;
}

int ops_record_end(ops *c, ops_graph **out) {
    CHECK_CONTEXT(c);
    if (!out) return FAIL(MLP_ERR_ARG, "out is NULL");
    *out = NULL;
    cudaGraph_t graph = NULL;
    CUDA_CHECK(cudaStreamEndCapture(stream(c), &graph));
    ops_graph *g = static_cast<ops_graph *>(calloc(1, sizeof *g));
    cudaError_t err = g ? cudaGraphInstantiate(&g->exec, graph, 0) : cudaErrorMemoryAllocation;
    (void)cudaGraphDestroy(graph); /* the instantiated graph is independent of it */
    if (err != cudaSuccess) {
        free(g);
        return cuda_fail(err, "cudaGraphInstantiate", __FILE__, __LINE__);
    }
    *out = g;
    return MLP_OK;
}

int ops_record_abort(ops *c) {
    CHECK_CONTEXT(c);
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(stream(c), &capturing));
    if (capturing == cudaStreamCaptureStatusNone) return MLP_OK;
    cudaGraph_t graph = NULL;
    (void)cudaStreamEndCapture(stream(c), &graph); /* fails for a recording a failed call invalidated: nothing kept */
    if (graph) (void)cudaGraphDestroy(graph);
    (void)cudaGetLastError();
    return MLP_OK;
}

int ops_replay(ops *c, ops_graph *g) {
    CHECK_CONTEXT(c);
    CHECK_POINTERS(g);
    CUDA_CHECK(cudaGraphLaunch(g->exec, stream(c)));
    return MLP_OK;
}

int ops_graph_destroy(ops_graph *g) {
    if (!g) return MLP_OK;
    const cudaError_t err = cudaGraphExecDestroy(g->exec);
    free(g);
    if (err != cudaSuccess) return cuda_fail(err, "cudaGraphExecDestroy", __FILE__, __LINE__);
    return MLP_OK;
}
