/* level4_c/mlp.c - Level 4: the MLP in plain C, on the CPU.
 *
 * What this level adds over level 3: nothing is hidden in a library call any more. Every matrix
 * product is a loop nest we wrote, every buffer is one we allocated, and the steps of an epoch run
 * inside a call from Python (common/native/__init__.py, cffi) - a few calls per epoch, each of ~50 ms of
 * steps, so that Ctrl-C is answered in between - so Python's per-call overhead is paid once per
 * call instead of a few dozen times per step as in NumPy.
 * The loops are ordered for the cache: the innermost loop always walks both arrays with stride 1,
 * and each weight row is loaded once per batch and used for every row of the batch.
 *
 * Implements common/native/mlp.h. Build: `make level4`; test: `pytest -m level4`.
 * No BLAS, no threads, no intrinsics: only the compiler's -O3 -march=native auto-vectorizer.
 */
#include "mlp.h"
#include "mlp_status.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define FORWARD_CHUNK 1024 /* rows forward() processes at a time: bounds the activation buffers */

struct mlp {
    int n_in, hidden, n_out;
    float *w1, *b1, *w2, *b2;     /* parameters, PyTorch layouts: (hidden, n_in) (hidden) (n_out, hidden) (n_out) */
    float *dw1, *db1, *dw2, *db2; /* gradients, same shapes */
    int capacity;                 /* rows the per-batch buffers below can hold */
    float *x;                     /* (capacity, n_in) the batch, gathered from the data set */
    int *y;                       /* (capacity) its labels */
    float *h, *a, *dh, *da;       /* (capacity, hidden) pre-activation, activation and their gradients */
    float *logits, *dlogits;      /* (capacity, n_out) */
    float *data_x;                /* (n_data, n_in) the training set, from mlp_set_data */
    int *data_y;                  /* (n_data) */
    int n_data;
};

/* ---- the layers: each forward followed by its backward ---- */

/* Sixteen partial sums are sixteen independent SIMD lanes (one AVX-512 register, or two AVX2 ones):
 * without them each addition would wait for the one before it, and the compiler may not reorder a
 * float sum on its own. */
static inline float dot(const float *u, const float *v, int n) {
    float lanes[16] = {0};
    int k = 0;
    for (; k + 16 <= n; k += 16)
        for (int l = 0; l < 16; l++) lanes[l] += u[k + l] * v[k + l];
    float sum = 0.0f;
    for (; k < n; k++) sum += u[k] * v[k];
    for (int l = 0; l < 16; l++) sum += lanes[l];
    return sum;
}

/* out (B, n_out) = x (B, n_in) @ w^T + b, with w (n_out, n_in), b (n_out).
 * Weight row o outside, batch row r inside: the row is read from memory once and reused B times.
 * Every offset into an array is computed in size_t: B * n_out may exceed an int (mlp.h, MLP_MAX_ELEMENTS). */
static void linear_forward(float *out, const float *x, const float *w, const float *b, int B, int n_in, int n_out) {
    /* BEGIN LAB 4.1 linear_forward */
    for (int o = 0; o < n_out; o++)
        for (int r = 0; r < B; r++)
            out[(size_t)r * n_out + o] = b[o] + dot(x + (size_t)r * n_in, w + (size_t)o * n_in, n_in);
    /* END LAB */
}

/* Backward of linear_forward: given dout (B, n_out), the gradient with respect to its output, and its inputs
 * x (B, n_in) and w (n_out, n_in), writes the gradients dw (n_out, n_in), db (n_out) and dx (B, n_in).
 * For speed, order each product's loops so that the inner one is "row += scalar * row" (stride 1 in both).
 * dx may be NULL: the first layer needs no gradient for the pixels. */
static void linear_backward(float *dx, float *dw, float *db, const float *dout, const float *x, const float *w, int B,
                            int n_in, int n_out) {
    /* BEGIN LAB 4.2 linear_backward */
    for (int o = 0; o < n_out; o++) {
        float *dw_row = dw + (size_t)o * n_in;
        memset(dw_row, 0, sizeof(float) * (size_t)n_in);
        db[o] = 0.0f;
        for (int r = 0; r < B; r++) {
            const float g = dout[(size_t)r * n_out + o];
            const float *x_row = x + (size_t)r * n_in;
            db[o] += g;
            for (int k = 0; k < n_in; k++) dw_row[k] += g * x_row[k];
        }
    }
    if (!dx) return;
    memset(dx, 0, sizeof(float) * (size_t)B * n_in);
    for (int r = 0; r < B; r++)
        for (int o = 0; o < n_out; o++) {
            const float g = dout[(size_t)r * n_out + o];
            const float *w_row = w + (size_t)o * n_in;
            for (int k = 0; k < n_in; k++) dx[(size_t)r * n_in + k] += g * w_row[k];
        }
    /* END LAB */
}

/* ReLU, elementwise: a = max(h, 0), n elements. */
static void relu_forward(float *a, const float *h, size_t n) {
    /* BEGIN LAB 4.3 relu_forward */
    for (size_t i = 0; i < n; i++) a[i] = h[i] > 0.0f ? h[i] : 0.0f;
    /* END LAB */
}

/* Backward of relu_forward: given da, the gradient with respect to its output, and h, its input (n elements
 * each), writes dh, the gradient with respect to h; 0 where h is exactly 0, as in PyTorch. */
static void relu_backward(float *dh, const float *da, const float *h, size_t n) {
    /* BEGIN LAB 4.4 relu_backward */
    for (size_t i = 0; i < n; i++) dh[i] = h[i] > 0.0f ? da[i] : 0.0f;
    /* END LAB */
}

/* The mean softmax cross-entropy of logits (B, n_out) against labels y (B), returned; the softmax
 * probabilities are written to probs (B, n_out). Both finite for any finite logits, however large.
 * The rows' losses are summed in double: a float running sum over a large batch drifts (2.8 million
 * equal rows gave 2.3443 for 2.3026), and the mean must not depend on the batch size. */
static float softmax_xent_forward(float *probs, const float *logits, const int *y, int B, int n_out) {
    /* BEGIN LAB 4.5 softmax_xent_forward */
    double total = 0.0;
    for (int r = 0; r < B; r++) {
        const float *row = logits + (size_t)r * n_out;
        float *p = probs + (size_t)r * n_out;
        float max = row[0];
        for (int o = 1; o < n_out; o++) max = row[o] > max ? row[o] : max;
        float sum = 0.0f;
        for (int o = 0; o < n_out; o++) {
            p[o] = expf(row[o] - max);
            sum += p[o];
        }
        for (int o = 0; o < n_out; o++) p[o] /= sum;
        total += logf(sum) - (row[y[r]] - max);
    }
    return (float)(total / B);
    /* END LAB */
}

/* Backward of softmax_xent_forward: given its probabilities probs (B, n_out) and the labels y (B), writes
 * dlogits (B, n_out), the gradient of the mean loss with respect to the logits. dlogits may be probs. */
static void softmax_xent_backward(float *dlogits, const float *probs, const int *y, int B, int n_out) {
    /* BEGIN LAB 4.6 softmax_xent_backward */
    for (int r = 0; r < B; r++)
        for (int o = 0; o < n_out; o++) {
            const size_t i = (size_t)r * n_out + o;
            const float onehot = (o == y[r]) ? 1.0f : 0.0f;
            dlogits[i] = (probs[i] - onehot) / (float)B;
        }
    /* END LAB */
}

/* One plain SGD step, in place: p -= lr * dp, n elements. */
static void sgd_update(float *p, const float *dp, float lr, size_t n) {
    /* BEGIN LAB 4.7 sgd_update */
    for (size_t i = 0; i < n; i++) p[i] -= lr * dp[i];
    /* END LAB */
}

/* ---- the step ---- */

/* Forward and backward of one batch x (B, n_in), y (B): returns the mean loss, fills m->dw1..db2. */
static float forward_backward(mlp *m, const float *x, const int *y, int B) {
    const int H = m->hidden, O = m->n_out;
    linear_forward(m->h, x, m->w1, m->b1, B, m->n_in, H);
    relu_forward(m->a, m->h, (size_t)B * H);
    linear_forward(m->logits, m->a, m->w2, m->b2, B, H, O);
    const float loss = softmax_xent_forward(m->dlogits, m->logits, y, B, O);
    softmax_xent_backward(m->dlogits, m->dlogits, y, B, O);
    linear_backward(m->da, m->dw2, m->db2, m->dlogits, m->a, m->w2, B, H, O);
    relu_backward(m->dh, m->da, m->h, (size_t)B * H);
    linear_backward(NULL, m->dw1, m->db1, m->dh, x, m->w1, B, m->n_in, H);
    return loss;
}

/* ---- memory: the model owns every buffer; they grow only when a larger batch arrives ---- */

/* Free the per-batch buffers: every pointer NULL again, capacity 0. */
static void free_batch_buffers(mlp *m) {
    /* BEGIN LAB 4.8 batch buffers */
    free(m->x), free(m->y), free(m->h), free(m->a), free(m->dh), free(m->da), free(m->logits), free(m->dlogits);
    m->x = m->h = m->a = m->dh = m->da = m->logits = m->dlogits = NULL;
    m->y = NULL;
    m->capacity = 0;
    /* END LAB */
}

/* Make the per-batch buffers (struct mlp) hold `rows` rows. They only grow; a batch past MLP_MAX_ELEMENTS is
 * refused (check_elements) before anything is freed; out of memory leaves none allocated. */
static int ensure_capacity(mlp *m, int rows) {
    /* BEGIN LAB 4.8 batch buffers */
    if (rows <= m->capacity) return MLP_OK;
    int status = check_elements(rows, m->n_in > m->hidden ? m->n_in : m->hidden);
    if (status) return status;
    free_batch_buffers(m);
    const size_t R = (size_t)rows;
    m->x = malloc(sizeof(float) * R * m->n_in);
    m->y = malloc(sizeof(int) * R);
    m->h = malloc(sizeof(float) * R * m->hidden);
    m->a = malloc(sizeof(float) * R * m->hidden);
    m->dh = malloc(sizeof(float) * R * m->hidden);
    m->da = malloc(sizeof(float) * R * m->hidden);
    m->logits = malloc(sizeof(float) * R * m->n_out);
    m->dlogits = malloc(sizeof(float) * R * m->n_out);
    if (!m->x || !m->y || !m->h || !m->a || !m->dh || !m->da || !m->logits || !m->dlogits) {
        free_batch_buffers(m);
        return FAIL(MLP_ERR_ALLOC, "out of memory for a batch of %d rows", rows);
    }
    m->capacity = rows;
    return MLP_OK;
    /* END LAB */
}

/* ---- the interface of mlp.h ---- */

int mlp_create(mlp **out, int n_in, int hidden, int n_out) {
    if (!out) return FAIL(MLP_ERR_ARG, "out is NULL");
    *out = NULL;
    if (n_in < 1 || hidden < 1 || n_out < 1)
        return FAIL(MLP_ERR_ARG, "sizes must be >= 1, got n_in=%d hidden=%d n_out=%d", n_in, hidden, n_out);
    /* BEGIN LAB 4.9 the model */
    mlp *m = calloc(1, sizeof *m);
    if (!m) return FAIL(MLP_ERR_ALLOC, "out of memory for the model");
    m->n_in = n_in, m->hidden = hidden, m->n_out = n_out;
    const size_t n_w1 = (size_t)hidden * n_in, n_w2 = (size_t)n_out * hidden;
    m->w1 = calloc(n_w1, sizeof(float)), m->dw1 = calloc(n_w1, sizeof(float));
    m->b1 = calloc((size_t)hidden, sizeof(float)), m->db1 = calloc((size_t)hidden, sizeof(float));
    m->w2 = calloc(n_w2, sizeof(float)), m->dw2 = calloc(n_w2, sizeof(float));
    m->b2 = calloc((size_t)n_out, sizeof(float)), m->db2 = calloc((size_t)n_out, sizeof(float));
    if (!m->w1 || !m->dw1 || !m->b1 || !m->db1 || !m->w2 || !m->dw2 || !m->b2 || !m->db2) {
        mlp_destroy(m);
        return FAIL(MLP_ERR_ALLOC, "out of memory for the parameters (hidden=%d)", hidden);
    }
    *out = m;
    return MLP_OK;
    /* END LAB */
}

int mlp_destroy(mlp *m) {
    if (!m) return MLP_OK;
    /* BEGIN LAB 4.9 the model */
    free(m->w1), free(m->b1), free(m->w2), free(m->b2);
    free(m->dw1), free(m->db1), free(m->dw2), free(m->db2);
    /* END LAB */
    free_batch_buffers(m);
    free(m->data_x), free(m->data_y);
    free(m);
    return MLP_OK;
}

int mlp_set_params(mlp *m, const float *w1, const float *b1, const float *w2, const float *b2) {
    if (!m || !w1 || !b1 || !w2 || !b2) return FAIL(MLP_ERR_ARG, "NULL argument");
    memcpy(m->w1, w1, sizeof(float) * (size_t)m->hidden * m->n_in);
    memcpy(m->b1, b1, sizeof(float) * (size_t)m->hidden);
    memcpy(m->w2, w2, sizeof(float) * (size_t)m->n_out * m->hidden);
    memcpy(m->b2, b2, sizeof(float) * (size_t)m->n_out);
    return MLP_OK;
}

int mlp_get_params(mlp *m, float *w1, float *b1, float *w2, float *b2) {
    if (!m || !w1 || !b1 || !w2 || !b2) return FAIL(MLP_ERR_ARG, "NULL argument");
    memcpy(w1, m->w1, sizeof(float) * (size_t)m->hidden * m->n_in);
    memcpy(b1, m->b1, sizeof(float) * (size_t)m->hidden);
    memcpy(w2, m->w2, sizeof(float) * (size_t)m->n_out * m->hidden);
    memcpy(b2, m->b2, sizeof(float) * (size_t)m->n_out);
    return MLP_OK;
}

int mlp_forward(mlp *m, float *logits, const float *x, int n) {
    if (!m || !logits || !x) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (n < 1) return FAIL(MLP_ERR_ARG, "n must be >= 1, got %d", n);
    int status = ensure_capacity(m, n < FORWARD_CHUNK ? n : FORWARD_CHUNK);
    if (status) return status;
    for (int start = 0; start < n; start += FORWARD_CHUNK) {
        const int B = n - start < FORWARD_CHUNK ? n - start : FORWARD_CHUNK;
        linear_forward(m->h, x + (size_t)start * m->n_in, m->w1, m->b1, B, m->n_in, m->hidden);
        relu_forward(m->a, m->h, (size_t)B * m->hidden);
        linear_forward(logits + (size_t)start * m->n_out, m->a, m->w2, m->b2, B, m->hidden, m->n_out);
    }
    return lab_status();
}

int mlp_loss_and_grads(mlp *m, float *loss, float *dw1, float *db1, float *dw2, float *db2, const float *x,
                       const int *y, int n) {
    if (!m || !loss || !dw1 || !db1 || !dw2 || !db2 || !x || !y) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (n < 1) return FAIL(MLP_ERR_ARG, "n must be >= 1, got %d", n);
    int status = check_labels(y, n, m->n_out);
    if (!status) status = ensure_capacity(m, n);
    if (status) return status;
    *loss = forward_backward(m, x, y, n);
    status = lab_status();
    if (status) return status;
    memcpy(dw1, m->dw1, sizeof(float) * (size_t)m->hidden * m->n_in);
    memcpy(db1, m->db1, sizeof(float) * (size_t)m->hidden);
    memcpy(dw2, m->dw2, sizeof(float) * (size_t)m->n_out * m->hidden);
    memcpy(db2, m->db2, sizeof(float) * (size_t)m->n_out);
    return MLP_OK;
}

int mlp_layers(mlp *m, float *outputs, float *grads, const float *x, const int *y, int n) {
    if (!m || !outputs || !grads || !x || !y) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (n < 1) return FAIL(MLP_ERR_ARG, "n must be >= 1, got %d", n);
    int status = check_labels(y, n, m->n_out);
    if (!status) status = ensure_capacity(m, n);
    if (status) return status;
    forward_backward(m, x, y, n); /* keeps h, a, logits and their gradients dh, da, dlogits */
    status = lab_status();
    if (status) return status;
    const size_t hidden = (size_t)n * m->hidden, out = (size_t)n * m->n_out;
    const float *layers[3][2] = {{m->h, m->dh}, {m->a, m->da}, {m->logits, m->dlogits}}; /* (output, gradient) */
    const size_t offsets[3] = {0, hidden, 2 * hidden}, sizes[3] = {hidden, hidden, out};
    for (int i = 0; i < 3; i++) {
        memcpy(outputs + offsets[i], layers[i][0], sizeof(float) * sizes[i]);
        memcpy(grads + offsets[i], layers[i][1], sizeof(float) * sizes[i]);
    }
    return MLP_OK;
}

int mlp_set_data(mlp *m, const float *x, const int *y, int n) {
    if (!m || !x || !y) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (n < 1) return FAIL(MLP_ERR_ARG, "n must be >= 1, got %d", n);
    int status = check_labels(y, n, m->n_out);
    if (status) return status;
    free(m->data_x), free(m->data_y);
    m->data_x = malloc(sizeof(float) * (size_t)n * m->n_in);
    m->data_y = malloc(sizeof(int) * (size_t)n);
    m->n_data = 0;
    if (!m->data_x || !m->data_y) {
        free(m->data_x), free(m->data_y);
        m->data_x = NULL, m->data_y = NULL;
        return FAIL(MLP_ERR_ALLOC, "out of memory for a data set of %d rows", n);
    }
    memcpy(m->data_x, x, sizeof(float) * (size_t)n * m->n_in);
    memcpy(m->data_y, y, sizeof(int) * (size_t)n);
    m->n_data = n;
    return MLP_OK;
}

/* Level 4 has one matrix product, its loops (mlp.h's MLP_MATMUL_LOOPS); level 5 brings kernels to choose from. */
int mlp_set_matmul(mlp *m, int matmul) {
    if (!m) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (matmul != MLP_MATMUL_LOOPS)
        return FAIL(MLP_ERR_ARG, "level 4's matrix product is its loops in C (%d), got %d", MLP_MATMUL_LOOPS, matmul);
    return MLP_OK;
}

int mlp_get_matmul(mlp *m, int *matmul) {
    if (!m || !matmul) return FAIL(MLP_ERR_ARG, "NULL argument");
    *matmul = MLP_MATMUL_LOOPS;
    return MLP_OK;
}

/* The CPU has no device memory to read: device arrays are for the GPU levels (mlp.h). */
int mlp_use_device_data(mlp *m, const float *x, const int *y, int n) {
    (void)m, (void)x, (void)y, (void)n;
    return FAIL(MLP_ERR_ARG, "level 4 runs on the CPU: hand it NumPy arrays (only the GPU levels read device arrays)");
}

int mlp_train_epoch(mlp *m, float *losses, const int *order, int n_order, int batch_size, float lr) {
    if (!m || !losses || !order) return FAIL(MLP_ERR_ARG, "NULL argument");
    int status = check_epoch(order, n_order, batch_size, m->n_data);
    if (status) return status;
    status = ensure_capacity(m, batch_size < n_order ? batch_size : n_order);
    if (status) return status;
    for (int start = 0, step = 0; start < n_order; start += batch_size, step++) {
        const int B = n_order - start < batch_size ? n_order - start : batch_size;
        for (int r = 0; r < B; r++) { /* gather the batch: rows of the data set in the visiting order */
            memcpy(m->x + (size_t)r * m->n_in, m->data_x + (size_t)order[start + r] * m->n_in,
                   sizeof(float) * (size_t)m->n_in);
            m->y[r] = m->data_y[order[start + r]];
        }
        losses[step] = forward_backward(m, m->x, m->y, B);
        sgd_update(m->w1, m->dw1, lr, (size_t)m->hidden * m->n_in);
        sgd_update(m->b1, m->db1, lr, (size_t)m->hidden);
        sgd_update(m->w2, m->dw2, lr, (size_t)m->n_out * m->hidden);
        sgd_update(m->b2, m->db2, lr, (size_t)m->n_out);
    }
    return lab_status();
}

long long mlp_device_buffers(void) { return 0; } /* the CPU level holds none */
