/* ops.h - the GPU backend of level 8's framework: tensor operations on device pointers, implemented by
 *   level8_framework/ops.cu (level 5's kernels and level 6's cuBLAS, included from their files)
 * and loaded by the one Python binding, common/native/__init__.py (cffi, ABI mode, the declarations between the cdef markers),
 * which level8_framework/cuda.py uses.
 *
 * Unlike mlp.h and lenet.h, which hold a whole network, these are the framework's kernels, one call per operation:
 * every pointer below is device memory (but ops_upload's and ops_download's host side, and the shapes and strides of
 * ops_strided_copy), row-major float32 (int for labels and pool choices), of the shape its comment gives. Every call is
 * queued on the context's one stream and returns at once, but ops_download and ops_synchronize, which wait for the
 * stream. Every function returns MLP_OK or an error status (mlp.h's); mlp_last_error() says what failed, with the file
 * and line. Nothing prints, nothing exits.
 */
#ifndef OPS_H
#define OPS_H

#include <stddef.h>

#include "mlp.h"

#ifdef __cplusplus
extern "C" {
#endif

/* cdef-begin */
typedef struct ops ops; /* opaque: the stream, the cuBLAS handle and the memory pool */

/* A context on the current device: its stream, cuBLAS handle (float32 math, no TF32) and memory pool. */
int ops_create(ops **out);
/* Waits for the stream, then frees the context; NULL is allowed. */
int ops_destroy(ops *c);

/* ---- memory: the tensors' storage, from the context's pool, in stream order ---- */

/* *p = bytes (at least 1) of device memory, counted by mlp_device_buffers() until ops_free. */
int ops_alloc(ops *c, void **p, size_t bytes);
/* Give p back once the work queued before it is done (NULL is allowed). */
int ops_free(ops *c, void *p);
/* Host src -> device dst, bytes; the host memory may change as soon as it returns. */
int ops_upload(ops *c, void *dst, const void *src, size_t bytes);
/* Device src -> host dst, bytes; waits for the stream (every queued operation's errors surface here). */
int ops_download(ops *c, void *dst, const void *src, size_t bytes);
/* Device src -> device dst, bytes. */
int ops_copy(ops *c, void *dst, const void *src, size_t bytes);
/* x (n) = value. */
int ops_fill(ops *c, float *x, float value, size_t n);
/* Wait for every operation queued on the context. */
int ops_synchronize(ops *c);

/* ---- products and shapes ---- */

/* out (M, N) = op(a) @ op(b), op(a) (M, K) and op(b) (K, N), where a transposed operand is stored as its transpose:
 * a (K, M) when transpose_a, b (N, K) when transpose_b (a view w.T of a row-major w). One cublasSgemm. */
int ops_gemm(ops *c, float *out, const float *a, const float *b, int M, int N, int K, int transpose_a,
             int transpose_b);
/* Level 6's linear layer products: out (B, n_out) = x (B, n_in) @ w^T, w (n_out, n_in); its backward
 * dx (B, n_in) = dout @ w (skipped when dx is NULL) and dw (n_out, n_in) = dout^T @ x. */
int ops_linear_forward(ops *c, float *out, const float *x, const float *w, int B, int n_in, int n_out);
int ops_linear_backward(ops *c, float *dx, float *dw, const float *dout, const float *x, const float *w, int B,
                        int n_in, int n_out);
/* out (cols, rows) = x (rows, cols) transposed: a transposed view made contiguous. */
int ops_transpose(ops *c, float *out, const float *x, int rows, int cols);

/* ---- views: storage, shape and strides (level8_framework/strides.py) ---- */

#define OPS_MAX_DIMS 8
/* out = x, value by value, over a shape of ndim (<= OPS_MAX_DIMS) axes: value [i0, i1, ...] of x at
 * x[i0 x_strides[0] + i1 x_strides[1] + ...], of out at out[i0 out_strides[0] + ...] (strides in values, 0 along a
 * broadcast axis; each pointer at its first value). shape and both strides are host arrays. A view made contiguous
 * (out_strides row-major), or a gradient written into a view (x row-major); out's positions must not repeat. */
int ops_strided_copy(ops *c, float *out, const int *out_strides, const float *x, const int *x_strides,
                     const int *shape, int ndim);

/* ---- map, zip and reduce: the kernels of every other operation (level8_framework/tensor.py) ---- */

#define OPS_NEG 0
#define OPS_EXP 1
#define OPS_LOG 2
#define OPS_TANH 3
#define OPS_POW 4
/* out (n) = f(x (n)), f one of the above: -x, exp x, log x, tanh x, x^k (k is read by OPS_POW only). */
int ops_map(ops *c, float *out, const float *x, int f, float k, size_t n);

#define OPS_ADD 0
#define OPS_SUB 1
#define OPS_MUL 2
#define OPS_DIV 3
#define OPS_EQ 4
/* out (n) = a (n) op b (n), op one of the above: +, -, *, /, and 1 where a == b else 0. */
int ops_zip(ops *c, float *out, const float *a, const float *b, int op, size_t n);

#define OPS_SUM 0
#define OPS_MAX 1
/* out (outer, inner) = the sum (in double) or the max of x (outer, n, inner) over its middle axis. */
int ops_reduce(ops *c, float *out, const float *x, int outer, int n, int inner, int op);

/* ---- element-wise ---- */

/* out (n) = a (n) + b (n): ops_zip's OPS_ADD. */
int ops_add(ops *c, float *out, const float *a, const float *b, size_t n);
/* Level 5's bias: out (rows, n) += b (n), in place; and its backward, the column sums db (n) = sum of dout's rows. */
int ops_bias_forward(ops *c, float *out, const float *b, int rows, int n);
int ops_bias_backward(ops *c, float *db, const float *dout, int rows, int n);
/* Level 5's ReLU: a (n) = max(h, 0); dh (n) = da where h > 0, else 0. */
int ops_relu_forward(ops *c, float *a, const float *h, size_t n);
int ops_relu_backward(ops *c, float *dh, const float *da, const float *h, size_t n);
/* s (n) = 1 / (1 + exp(-h)); dh (n) = ds (1 - s) s. */
int ops_sigmoid_forward(ops *c, float *s, const float *h, size_t n);
int ops_sigmoid_backward(ops *c, float *dh, const float *ds, const float *s, size_t n);

/* ---- losses and the mean: each one value, on the device ---- */

/* Level 5's softmax cross-entropy of logits (B, n_out) against labels y (B) in [0, n_out): the mean loss (1),
 * softmax into probs (B, n_out), row_loss (B) scratch. Its backward: dlogits (B, n_out) = dloss (1) (probs - onehot)/B
 * (in place over probs is allowed). */
int ops_softmax_xent_forward(ops *c, float *loss, float *probs, float *row_loss, const float *logits, const int *y,
                             int B, int n_out);
int ops_softmax_xent_backward(ops *c, float *dlogits, const float *probs, const int *y, const float *dloss, int B,
                              int n_out);
/* loss (1) = mean over n of (x - t)^2, squares (n) scratch; dx (n) = (x - t) (2 / n) dloss (1). */
int ops_mse_forward(ops *c, float *loss, float *squares, const float *x, const float *t, int n);
int ops_mse_backward(ops *c, float *dx, const float *x, const float *t, const float *dloss, int n);
/* out (1) = the mean of x (n), summed in double in a fixed order (level 5's); dx (n) = dout (1) / n. */
int ops_mean(ops *c, float *out, const float *x, int n);
int ops_mean_backward(ops *c, float *dx, const float *dout, int n);

/* ---- convolution and pooling: level 5's kernels, square images ---- */

/* out (B, F, H-k+1, H-k+1) = x (B, C, H, H) correlated with w (F, C, k, k), + b (F); stride 1, no padding. Its
 * backward: dw (F, C, k, k), db (F) and, unless dx is NULL, dx (B, C, H, H), from dout. */
int ops_conv2d_forward(ops *c, float *out, const float *x, const float *w, const float *b, int B, int C, int H, int F,
                       int k);
int ops_conv2d_backward(ops *c, float *dx, float *dw, float *db, const float *dout, const float *x, const float *w,
                        int B, int C, int H, int F, int k);
/* 2 x 2 max-pooling, stride 2: out (B, C, H/2, H/2) and choice (B, C, H/2, H/2), the position 0..3 of each window's
 * maximum (the first of equal ones), from a (B, C, H, H), H even; its backward da (B, C, H, H) from dout. */
int ops_maxpool_forward(ops *c, float *out, int *choice, const float *a, int B, int C, int H);
int ops_maxpool_backward(ops *c, float *da, const float *dout, const int *choice, int B, int C, int H);

/* ---- a batch, and the optimizers' updates (in place) ---- */

/* Level 5's gather: x (B, n_in) and y (B) = rows order (B) of data_x (n, n_in) and data_y (n). */
int ops_gather(ops *c, float *x, int *y, const float *data_x, const int *data_y, const int *order, int B, int n_in);
/* Level 5's SGD: p (n) -= lr dp. */
int ops_sgd_update(ops *c, float *p, const float *dp, float lr, size_t n);
/* SGD with momentum, PyTorch's: buf (n) = momentum buf + dp, then p (n) -= lr buf. */
int ops_sgd_momentum_update(ops *c, float *p, const float *dp, float *buf, float lr, float momentum, size_t n);
/* Adam, PyTorch's order: m = m + weight1 (dp - m); v = beta2 v + weight2 dp dp;
 * p -= step_size m / (sqrt(v) / bias_correction2_sqrt + eps); all n long. The caller computes, in double as PyTorch's
 * Python does: weight1 = 1 - beta1, weight2 = 1 - beta2, step_size = lr / (1 - beta1^step) and
 * bias_correction2_sqrt = sqrt(1 - beta2^step). */
int ops_adam_update(ops *c, float *p, const float *dp, float *m, float *v, float weight1, float beta2, float weight2,
                    float step_size, float bias_correction2_sqrt, float eps, size_t n);
/* ---- a step recorded once and replayed: CUDA graphs ---- */

typedef struct ops_graph ops_graph; /* opaque: a recorded graph, ready to replay */

/* From here until ops_record_end, the operations queued on the stream are recorded, not run (CUDA's stream capture):
 * nothing may wait for the stream (ops_download and ops_synchronize fail), copy from host memory or take memory from
 * the pool meanwhile; the operations work on memory taken before. */
int ops_record_begin(ops *c);
/* The operations recorded since ops_record_begin, as a graph ready to replay: *out. */
int ops_record_end(ops *c, ops_graph **out);
/* Stop a recording after a failure, keeping nothing (a stream not recording is left as it is). */
int ops_record_abort(ops *c);
/* Queue one replay of g: every recorded operation again, in order, on the memory it was recorded with. */
int ops_replay(ops *c, ops_graph *g);
/* Free g (a replay already queued still runs); NULL is allowed. */
int ops_graph_destroy(ops_graph *g);

/* The three updates above, their numbers read from device memory when they run, as a replayed step needs (its
 * kernels' arguments are recorded once; its numbers change with each step): lr (1); lr, momentum (2); weight1, beta2,
 * weight2, step_size, bias_correction2_sqrt, eps (6). The same arithmetic, the same bits. */
int ops_sgd_update_from(ops *c, float *p, const float *dp, const float *numbers, size_t n);
int ops_sgd_momentum_update_from(ops *c, float *p, const float *dp, float *buf, const float *numbers, size_t n);
int ops_adam_update_from(ops *c, float *p, const float *dp, float *m, float *v, const float *numbers, size_t n);
/* cdef-end */

#ifdef __cplusplus
}
#endif

#endif /* OPS_H */
