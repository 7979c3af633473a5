/* level4_c/lenet.c - Level 4 for LeNet-5: the convolutions and the max-pooling in plain C, on the CPU.
 *
 * What this adds over mlp.c, whose layer functions it includes and reuses (linear_*, relu_*, softmax_xent_*,
 * sgd_update): the convolution, twice. Direct loops first, the form of its definition, ordered so that the innermost
 * loop walks a row of the image with stride 1; then im2col, which copies every 5x5 patch into a row and makes the
 * convolution one matrix product through mlp.c's linear_forward and linear_backward. lenet_set_convolution chooses;
 * both are checked, and measured against each other. Max-pooling keeps, for each 2x2 window, which element was the
 * maximum - the first of equal ones, as PyTorch does - and its gradient goes there alone.
 *
 * Implements common/native/lenet.h. Build: `make level4`; test: `pytest -m level4 -k lenet`.
 */
#include "lenet.h"

#include "mlp.c"

enum { CHUNK = 256 }; /* rows lenet_forward runs at a time: bounds the batch buffers (~47 MB) */

struct lenet {
    float *params, *grads; /* (N_PARAMS) each */
    int im2col;            /* 0: direct loops; 1: im2col and matrix products */
    int capacity;          /* rows the per-batch buffers below can hold */
    float *batch;          /* one block for all of them: */
    float *x;              /* (capacity, 784) the batch */
    float *h1, *a1, *p1, *h2, *a2, *p2, *f1, *r3, *f2, *r4, *logits; /* each layer's output (capacity, size) */
    float *dh1, *da1, *dp1, *dh2, *da2, *dp2, *df1, *dr3, *df2, *dr4, *dlogits; /* the gradients, same shapes */
    float *cols, *dcols;   /* im2col scratch: (capacity * 24 * 24, 25) and (capacity * 8 * 8, 150) */
    int *y;                /* (capacity) its labels */
    int *choice1, *choice2; /* (capacity, 6 * 12 * 12) and (capacity, 256): each pool window's maximum, 0..3 */
    float *data_x;         /* (n_data, 784) the training set, from lenet_set_data */
    int *data_y;           /* (n_data) */
    int n_data;
    float *infer_x;        /* (infer_rows, 784) the batch lenet_infer_load keeps, apart from the buffers above */
    int infer_rows;
};

/* ---- the convolution, direct: each forward followed by its backward ---- */

/* out (B, F, OH, OW) = x (B, C, H, W) correlated with w (F, C, k, k), + b (F); stride 1, no padding, OH = H - k + 1.
 * Each output row starts at its bias and gains one weight times one input row at a time: the inner loop walks both
 * rows with stride 1, and the order of the terms is fixed. */
static void conv2d_forward(float *out, const float *x, const float *w, const float *b, int B, int C, int H, int F,
                           int k) {
    /* BEGIN LAB 4.11 conv2d_forward */
    const int OH = H - k + 1;
    for (int n = 0; n < B; n++)
        for (int f = 0; f < F; f++) {
            float *o = out + ((size_t)n * F + f) * OH * OH;
            for (int i = 0; i < OH * OH; i++) o[i] = b[f];
            for (int c = 0; c < C; c++)
                for (int i = 0; i < k; i++)
                    for (int j = 0; j < k; j++) {
                        const float weight = w[(((size_t)f * C + c) * k + i) * k + j];
                        const float *in = x + ((size_t)n * C + c) * H * H + (size_t)i * H + j;
                        for (int oy = 0; oy < OH; oy++)
                            for (int ox = 0; ox < OH; ox++) o[oy * OH + ox] += weight * in[oy * H + ox];
                    }
        }
    /* END LAB */
}

/* Backward of conv2d_forward: given dout (B, F, OH, OW), the gradient with respect to its output, and its inputs x
 * and w, writes dw (F, C, k, k), db (F) and, unless NULL, dx (B, C, H, W): each output's gradient sent back to the
 * inputs and weights it was made from (a correlation of dout with the flipped kernel, for dx). */
static void conv2d_backward(float *dx, float *dw, float *db, const float *dout, const float *x, const float *w, int B,
                            int C, int H, int F, int k) {
    /* BEGIN LAB 4.12 conv2d_backward */
    const int OH = H - k + 1;
    memset(dw, 0, sizeof(float) * (size_t)F * C * k * k);
    memset(db, 0, sizeof(float) * (size_t)F);
    if (dx) memset(dx, 0, sizeof(float) * (size_t)B * C * H * H);
    for (int n = 0; n < B; n++)
        for (int f = 0; f < F; f++) {
            const float *g = dout + ((size_t)n * F + f) * OH * OH;
            for (int i = 0; i < OH * OH; i++) db[f] += g[i];
            for (int c = 0; c < C; c++)
                for (int i = 0; i < k; i++)
                    for (int j = 0; j < k; j++) {
                        const size_t wi = (((size_t)f * C + c) * k + i) * k + j, at = ((size_t)n * C + c) * H * H;
                        const float *in = x + at + (size_t)i * H + j;
                        float sum = 0.0f;
                        for (int oy = 0; oy < OH; oy++)
                            for (int ox = 0; ox < OH; ox++) sum += g[oy * OH + ox] * in[oy * H + ox];
                        dw[wi] += sum;
                        if (!dx) continue;
                        float *back = dx + at + (size_t)i * H + j;
                        for (int oy = 0; oy < OH; oy++)
                            for (int ox = 0; ox < OH; ox++) back[oy * H + ox] += w[wi] * g[oy * OH + ox];
                    }
        }
    /* END LAB */
}

/* ---- the convolution as im2col and a matrix product ---- */

/* cols (B * OH * OW, C * k * k): row (n, oy, ox) holds the k x k patch of every channel at (oy, ox), in a weight's
 * (C, k, k) order; the convolution is then cols @ w^T, one linear_forward. */
static void im2col(float *cols, const float *x, int B, int C, int H, int k) {
    const int OH = H - k + 1;
    for (int n = 0; n < B; n++)
        for (int oy = 0; oy < OH; oy++)
            for (int ox = 0; ox < OH; ox++) {
                float *row = cols + (((size_t)n * OH + oy) * OH + ox) * C * k * k;
                for (int c = 0; c < C; c++)
                    for (int i = 0; i < k; i++)
                        memcpy(row + ((size_t)c * k + i) * k, x + (((size_t)n * C + c) * H + oy + i) * H + ox,
                               sizeof(float) * (size_t)k);
            }
}

/* The adjoint of im2col: each row of dcols added back into dx (B, C, H, W) where its patch came from. */
static void col2im(float *dx, const float *dcols, int B, int C, int H, int k) {
    const int OH = H - k + 1;
    memset(dx, 0, sizeof(float) * (size_t)B * C * H * H);
    for (int n = 0; n < B; n++)
        for (int oy = 0; oy < OH; oy++)
            for (int ox = 0; ox < OH; ox++) {
                const float *row = dcols + (((size_t)n * OH + oy) * OH + ox) * C * k * k;
                for (int c = 0; c < C; c++)
                    for (int i = 0; i < k; i++)
                        for (int j = 0; j < k; j++)
                            dx[(((size_t)n * C + c) * H + oy + i) * H + ox + j] += row[((size_t)c * k + i) * k + j];
            }
}

/* (B, P, F) <-> (B, F, P): matrix products give an output per position, the layout wants a plane per channel. */
static void transpose_planes(float *out, const float *in, int B, int rows, int cols) {
    for (int n = 0; n < B; n++)
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < cols; c++)
                out[((size_t)n * cols + c) * rows + r] = in[((size_t)n * rows + r) * cols + c];
}

/* ---- max-pooling ---- */

/* out (B, C, H/2, W/2) = the maximum of each 2x2 window of a (B, C, H, W); choice gets its position 0..3 in the
 * window (row-major), the first of equal maxima as in PyTorch. */
static void maxpool_forward(float *out, int *choice, const float *a, int B, int C, int H) {
    /* BEGIN LAB 4.13 maxpool_forward */
    const int P = H / 2;
    for (size_t plane = 0; plane < (size_t)B * C; plane++)
        for (int py = 0; py < P; py++)
            for (int px = 0; px < P; px++) {
                const float *win = a + plane * H * H + (size_t)2 * py * H + 2 * px;
                const float v[4] = {win[0], win[1], win[H], win[H + 1]};
                int best = 0;
                for (int i = 1; i < 4; i++) best = v[i] > v[best] ? i : best;
                out[plane * P * P + (size_t)py * P + px] = v[best];
                choice[plane * P * P + (size_t)py * P + px] = best;
            }
    /* END LAB */
}

/* Backward of maxpool_forward: da (B, C, H, W) gets each window's gradient dout at the position it chose, 0 elsewhere. */
static void maxpool_backward(float *da, const float *dout, const int *choice, int B, int C, int H) {
    /* BEGIN LAB 4.14 maxpool_backward */
    const int P = H / 2;
    memset(da, 0, sizeof(float) * (size_t)B * C * H * H);
    for (size_t plane = 0; plane < (size_t)B * C; plane++)
        for (int py = 0; py < P; py++)
            for (int px = 0; px < P; px++) {
                const size_t i = plane * P * P + (size_t)py * P + px;
                da[plane * H * H + (size_t)(2 * py + choice[i] / 2) * H + 2 * px + choice[i] % 2] = dout[i];
            }
    /* END LAB */
}

/* ---- the step ---- */

/* A convolution layer, by the model's chosen algorithm: out (B, F, OH, OH) from x (B, C, H, H). */
static void conv_layer(lenet *m, float *out, const float *x, const float *w, const float *b, int B, int C, int H,
                       int F) {
    if (!m->im2col) {
        conv2d_forward(out, x, w, b, B, C, H, F, K);
        return;
    }
    const int OH = H - K + 1;
    im2col(m->cols, x, B, C, H, K);
    linear_forward(m->dcols, m->cols, w, b, B * OH * OH, C * K * K, F); /* dcols as scratch: (B * OH * OH, F) */
    transpose_planes(out, m->dcols, B, OH * OH, F);
}

/* Its backward: dw, db and, unless dx is NULL, dx; dout (B, F, OH, OH) is the gradient of its output. */
static void conv_layer_backward(lenet *m, float *dx, float *dw, float *db, const float *dout, const float *x,
                                const float *w, int B, int C, int H, int F) {
    if (!m->im2col) {
        conv2d_backward(dx, dw, db, dout, x, w, B, C, H, F, K);
        return;
    }
    const int OH = H - K + 1;
    /* A gradient row per patch: conv2's fit in cols after its patches (conv1's larger ones sized cols); conv1, which
     * needs no dx, leaves dcols free for them. */
    float *dflat = dx ? m->cols + (size_t)B * OH * OH * C * K * K : m->dcols;
    im2col(m->cols, x, B, C, H, K);
    transpose_planes(dflat, dout, B, F, OH * OH); /* (B, F, P) -> (B, P, F): a gradient row per patch */
    linear_backward(dx ? m->dcols : NULL, dw, db, dflat, m->cols, w, B * OH * OH, C * K * K, F);
    if (dx) col2im(dx, m->dcols, B, C, H, K);
}

/* Forward of a batch x (B, 784): every layer's output into the model's buffers. */
static void net_forward(lenet *m, const float *x, int B) {
    const float *p = m->params;
    conv_layer(m, m->h1, x, p + W1, p + B1, B, 1, IMAGE, C1);
    relu_forward(m->a1, m->h1, (size_t)B * H1);
    maxpool_forward(m->p1, m->choice1, m->a1, B, C1, S1);
    conv_layer(m, m->h2, m->p1, p + W2, p + B2, B, C1, P1, C2);
    relu_forward(m->a2, m->h2, (size_t)B * H2);
    maxpool_forward(m->p2, m->choice2, m->a2, B, C2, S2);
    linear_forward(m->f1, m->p2, p + W3, p + B3, B, FLAT, F1);
    relu_forward(m->r3, m->f1, (size_t)B * F1);
    linear_forward(m->f2, m->r3, p + W4, p + B4, B, F1, F2);
    relu_forward(m->r4, m->f2, (size_t)B * F2);
    linear_forward(m->logits, m->r4, p + W5, p + B5, B, F2, OUT);
}

/* Forward and backward of one batch x (B, 784), y (B): returns the mean loss, fills m->grads and every buffer. */
static float net_forward_backward(lenet *m, const float *x, const int *y, int B) {
    const float *p = m->params;
    float *g = m->grads;
    net_forward(m, x, B);
    const float loss = softmax_xent_forward(m->dlogits, m->logits, y, B, OUT);
    softmax_xent_backward(m->dlogits, m->dlogits, y, B, OUT);
    linear_backward(m->dr4, g + W5, g + B5, m->dlogits, m->r4, p + W5, B, F2, OUT);
    relu_backward(m->df2, m->dr4, m->f2, (size_t)B * F2);
    linear_backward(m->dr3, g + W4, g + B4, m->df2, m->r3, p + W4, B, F1, F2);
    relu_backward(m->df1, m->dr3, m->f1, (size_t)B * F1);
    linear_backward(m->dp2, g + W3, g + B3, m->df1, m->p2, p + W3, B, FLAT, F1);
    maxpool_backward(m->da2, m->dp2, m->choice2, B, C2, S2);
    relu_backward(m->dh2, m->da2, m->h2, (size_t)B * H2);
    conv_layer_backward(m, m->dp1, g + W2, g + B2, m->dh2, m->p1, p + W2, B, C1, P1, C2);
    maxpool_backward(m->da1, m->dp1, m->choice1, B, C1, S1);
    relu_backward(m->dh1, m->da1, m->h1, (size_t)B * H1);
    conv_layer_backward(m, NULL, g + W1, g + B1, m->dh1, x, p + W1, B, 1, IMAGE, C1);
    return loss;
}

/* ---- memory: the model owns every buffer; the batch's grow only when a larger batch arrives ---- */

/* The floats of one image in the batch block: x, the outputs and their gradients, and the im2col scratch
 * (conv1's patches, 24 * 24 * 25, hold conv2's patches and its gradient rows too). */
enum { ROW_FLOATS = IMAGE * IMAGE + 2 * LENET_ACTIVATIONS + S1 * S1 * K * K + S2 * S2 * C1 * K * K };
_Static_assert(ROW_FLOATS == LENET_ROW_FLOATS, "lenet.h's count");

static void free_batch(lenet *m) {
    free(m->batch), free(m->y), free(m->choice1), free(m->choice2);
    m->batch = NULL, m->y = m->choice1 = m->choice2 = NULL;
    m->capacity = 0;
}

/* Make the per-batch buffers hold `rows` rows: one block of floats cut into the buffers, and the int buffers. */
static int ensure_batch(lenet *m, int rows) {
    if (rows <= m->capacity) return MLP_OK;
    int status = check_elements(rows, ROW_FLOATS);
    if (status) return status;
    free_batch(m);
    const size_t R = (size_t)rows;
    m->batch = malloc(sizeof(float) * R * ROW_FLOATS);
    m->y = malloc(sizeof(int) * R), m->choice1 = malloc(sizeof(int) * R * POOL1);
    m->choice2 = malloc(sizeof(int) * R * POOL2);
    if (!m->batch || !m->y || !m->choice1 || !m->choice2) {
        free_batch(m);
        return FAIL(MLP_ERR_ALLOC, "out of memory for a batch of %d rows", rows);
    }
    float *next = m->batch;
    float **buffers[] = {&m->x, &m->h1, &m->a1, &m->p1, &m->h2, &m->a2, &m->p2, &m->f1, &m->r3, &m->f2, &m->r4,
                         &m->logits, &m->dh1, &m->da1, &m->dp1, &m->dh2, &m->da2, &m->dp2, &m->df1, &m->dr3, &m->df2,
                         &m->dr4, &m->dlogits, &m->cols, &m->dcols};
    const int sizes[] = {IMAGE * IMAGE, H1, H1, POOL1, H2, H2, POOL2, F1, F1, F2, F2, OUT, H1, H1, POOL1, H2, H2,
                         POOL2, F1, F1, F2, F2, OUT, S1 * S1 * K * K, S2 * S2 * C1 * K * K};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        *buffers[i] = next;
        next += R * sizes[i];
    }
    m->capacity = rows;
    return MLP_OK;
}

/* ---- the interface of lenet.h ---- */

int lenet_create(lenet **out) {
    if (!out) return FAIL(MLP_ERR_ARG, "out is NULL");
    *out = NULL;
    lenet *m = calloc(1, sizeof *m);
    if (!m) return FAIL(MLP_ERR_ALLOC, "out of memory for the model");
    m->params = calloc(N_PARAMS, sizeof(float)), m->grads = calloc(N_PARAMS, sizeof(float));
    if (!m->params || !m->grads) {
        lenet_destroy(m);
        return FAIL(MLP_ERR_ALLOC, "out of memory for the parameters");
    }
    *out = m;
    return MLP_OK;
}

int lenet_destroy(lenet *m) {
    if (!m) return MLP_OK;
    free(m->params), free(m->grads);
    free_batch(m);
    free(m->data_x), free(m->data_y), free(m->infer_x);
    free(m);
    return MLP_OK;
}

int lenet_set_params(lenet *m, const float *params) {
    if (!m || !params) return FAIL(MLP_ERR_ARG, "NULL argument");
    memcpy(m->params, params, sizeof(float) * N_PARAMS);
    return MLP_OK;
}

int lenet_get_params(lenet *m, float *params) {
    if (!m || !params) return FAIL(MLP_ERR_ARG, "NULL argument");
    memcpy(params, m->params, sizeof(float) * N_PARAMS);
    return MLP_OK;
}

int lenet_set_convolution(lenet *m, int convolution) {
    if (!m) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (convolution != LENET_DIRECT && convolution != LENET_IM2COL)
        return FAIL(MLP_ERR_ARG, "level 4's convolutions are direct and im2col (%d and %d), got %d", LENET_DIRECT,
                    LENET_IM2COL, convolution);
    m->im2col = convolution == LENET_IM2COL;
    return MLP_OK;
}

int lenet_get_convolution(lenet *m, int *convolution) {
    if (!m || !convolution) return FAIL(MLP_ERR_ARG, "NULL argument");
    *convolution = m->im2col ? LENET_IM2COL : LENET_DIRECT;
    return MLP_OK;
}

int lenet_forward(lenet *m, float *logits, const float *x, int n) {
    if (!m || !logits || !x) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (n < 1) return FAIL(MLP_ERR_ARG, "n must be >= 1, got %d", n);
    int status = ensure_batch(m, n < CHUNK ? n : CHUNK);
    if (status) return status;
    for (int start = 0; start < n; start += CHUNK) {
        const int B = n - start < CHUNK ? n - start : CHUNK;
        net_forward(m, x + (size_t)start * IMAGE * IMAGE, B);
        memcpy(logits + (size_t)start * OUT, m->logits, sizeof(float) * (size_t)B * OUT);
    }
    return lab_status();
}

int lenet_loss_and_grads(lenet *m, float *loss, float *grads, const float *x, const int *y, int n) {
    if (!m || !loss || !grads || !x || !y) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (n < 1) return FAIL(MLP_ERR_ARG, "n must be >= 1, got %d", n);
    int status = check_labels(y, n, OUT);
    if (!status) status = ensure_batch(m, n);
    if (status) return status;
    *loss = net_forward_backward(m, x, y, n);
    memcpy(grads, m->grads, sizeof(float) * N_PARAMS);
    return lab_status();
}

/* Every layer's output of the last forward of n rows, layer after layer, and, unless grads is NULL, its gradient. */
static void copy_layers(const lenet *m, float *outputs, float *grads, int n) {
    const float *out[] = {m->h1, m->a1, m->p1, m->h2, m->a2, m->p2, m->f1, m->r3, m->f2, m->r4, m->logits};
    const float *grad[] = {m->dh1, m->da1, m->dp1, m->dh2, m->da2, m->dp2, m->df1, m->dr3, m->df2, m->dr4, m->dlogits};
    const int sizes[] = {H1, H1, POOL1, H2, H2, POOL2, F1, F1, F2, F2, OUT};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        memcpy(outputs, out[i], sizeof(float) * (size_t)n * sizes[i]);
        outputs += (size_t)n * sizes[i];
        if (grads) {
            memcpy(grads, grad[i], sizeof(float) * (size_t)n * sizes[i]);
            grads += (size_t)n * sizes[i];
        }
    }
}

int lenet_layers(lenet *m, float *outputs, float *grads, const float *x, const int *y, int n) {
    if (!m || !outputs || !grads || !x || !y) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (n < 1) return FAIL(MLP_ERR_ARG, "n must be >= 1, got %d", n);
    int status = check_labels(y, n, OUT);
    if (!status) status = ensure_batch(m, n);
    if (status) return status;
    net_forward_backward(m, x, y, n);
    copy_layers(m, outputs, grads, n);
    return lab_status();
}

/* Inference on the CPU: the loaded batch is kept in its own buffer; a run is lenet_forward's loop over it. */
int lenet_infer_load(lenet *m, const float *x, int n) {
    if (!m || !x) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (n < 1) return FAIL(MLP_ERR_ARG, "n must be >= 1, got %d", n);
    int status = check_elements(n, IMAGE * IMAGE);
    if (status) return status;
    free(m->infer_x);
    m->infer_rows = 0;
    m->infer_x = malloc(sizeof(float) * (size_t)n * IMAGE * IMAGE);
    if (!m->infer_x) return FAIL(MLP_ERR_ALLOC, "out of memory for a batch of %d rows", n);
    memcpy(m->infer_x, x, sizeof(float) * (size_t)n * IMAGE * IMAGE);
    m->infer_rows = n;
    return MLP_OK;
}

int lenet_infer_run(lenet *m, float *logits) {
    if (!m) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (m->infer_rows < 1) return FAIL(MLP_ERR_ARG, "no batch loaded: call lenet_infer_load first");
    const int n = m->infer_rows;
    const int status = ensure_batch(m, n < CHUNK ? n : CHUNK);
    if (status) return status;
    for (int start = 0; start < n; start += CHUNK) {
        const int B = n - start < CHUNK ? n - start : CHUNK;
        net_forward(m, m->infer_x + (size_t)start * IMAGE * IMAGE, B);
        if (logits) memcpy(logits + (size_t)start * OUT, m->logits, sizeof(float) * (size_t)B * OUT);
    }
    return lab_status();
}

int lenet_infer_layers(lenet *m, float *outputs) {
    if (!m || !outputs) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (m->infer_rows < 1) return FAIL(MLP_ERR_ARG, "no batch loaded: call lenet_infer_load first");
    const int status = ensure_batch(m, m->infer_rows);
    if (status) return status;
    net_forward(m, m->infer_x, m->infer_rows);
    copy_layers(m, outputs, NULL, m->infer_rows);
    return lab_status();
}

int lenet_set_data(lenet *m, const float *x, const int *y, int n) {
    if (!m || !x || !y) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (n < 1) return FAIL(MLP_ERR_ARG, "n must be >= 1, got %d", n);
    int status = check_labels(y, n, OUT);
    if (status) return status;
    free(m->data_x), free(m->data_y);
    m->data_x = malloc(sizeof(float) * (size_t)n * IMAGE * IMAGE);
    m->data_y = malloc(sizeof(int) * (size_t)n);
    m->n_data = 0;
    if (!m->data_x || !m->data_y) {
        free(m->data_x), free(m->data_y);
        m->data_x = NULL, m->data_y = NULL;
        return FAIL(MLP_ERR_ALLOC, "out of memory for a data set of %d rows", n);
    }
    memcpy(m->data_x, x, sizeof(float) * (size_t)n * IMAGE * IMAGE);
    memcpy(m->data_y, y, sizeof(int) * (size_t)n);
    m->n_data = n;
    return MLP_OK;
}

int lenet_train_epoch(lenet *m, float *losses, const int *order, int n_order, int batch_size, float lr) {
    if (!m || !losses || !order) return FAIL(MLP_ERR_ARG, "NULL argument");
    int status = check_epoch(order, n_order, batch_size, m->n_data);
    if (status) return status;
    status = ensure_batch(m, batch_size < n_order ? batch_size : n_order);
    if (status) return status;
    for (int start = 0, step = 0; start < n_order; start += batch_size, step++) {
        const int B = n_order - start < batch_size ? n_order - start : batch_size;
        for (int r = 0; r < B; r++) { /* gather the batch: rows of the data set in the visiting order */
            memcpy(m->x + (size_t)r * IMAGE * IMAGE, m->data_x + (size_t)order[start + r] * IMAGE * IMAGE,
                   sizeof(float) * IMAGE * IMAGE);
            m->y[r] = m->data_y[order[start + r]];
        }
        losses[step] = net_forward_backward(m, m->x, m->y, B);
        sgd_update(m->params, m->grads, lr, N_PARAMS);
    }
    return lab_status();
}
