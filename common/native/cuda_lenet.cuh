/* common/native/cuda_lenet.cuh - what the GPU levels share for LeNet-5: the model on the device, the step and the whole of
 * lenet.h. cuda_mlp.cuh's twin, one network over.
 *
 * Included by level5_cuda_naive/lenet.cu (our own convolution and pooling kernels) and level6_cublas/lenet.cu
 * (cuDNN's, and through it level7_fused/lenet.cu, whose inference forward is one fused kernel), each after its level's
 * mlp.cu, whose layer functions serve the fully connected layers, the ReLUs, the loss, the batch gather and SGD here
 * too (level 5's kernels, or level 6's cuBLAS). Each level then defines the hooks declared below, so diffing the two
 * levels shows only how a convolution and a pool are computed.
 */
#ifndef CUDA_LENET_CUH
#define CUDA_LENET_CUH

#include "lenet.h"

/* The two convolutions and the two pools: (C, H, F) of conv1 and conv2, (C, H) of pool1 and pool2. */
struct conv_shape {
    int C, H, F; /* input channels, input height (= width), filters; the kernel is K x K, stride 1, no padding */
};
static const conv_shape CONV[2] = {{1, IMAGE, C1}, {C1, P1, C2}};
struct pool_shape {
    int C, H; /* channels, input height (= width); 2 x 2 windows, stride 2 */
};
static const pool_shape POOL[2] = {{C1, S1}, {C2, S2}};

struct lenet {
    mlp base;              /* what the MLP's layer functions read: the stream (and, at level 6, the cuBLAS handle) */
    int convolution;       /* LENET_DIRECT, or the level's other one (level 5: LENET_TILED) */
    void *level_state;     /* the level's own state for its convolutions: level 6's cuDNN handle and descriptors */
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
    int *choice1, *choice2; /* (capacity, 6 * 12 * 12) and (capacity, 256): each pool window's maximum, 0..3 (level 5;
                             * level 6's cuDNN finds it again from the pool's input and output) */
    float *data_x;         /* (n_data, 784) the training set, uploaded once by lenet_set_data */
    int *data_y;           /* (n_data) */
    int n_data;
    int *order;            /* (order_capacity) an epoch's visiting order */
    int order_capacity;
    float *losses;         /* (loss_capacity) an epoch's per-step losses */
    int loss_capacity;
    unsigned moves;        /* counts reallocations of the buffers above: a graph captured before the last is stale */
    /* Inference (lenet_infer_*): */
    float *infer_block;    /* one block for: */
    float *infer_x;        /* (infer_rows, 784) the loaded batch */
    float *infer_logits;   /* (infer_rows, 10) its logits */
    int infer_rows, infer_capacity;
    cudaGraphExec_t forward_graph; /* the loaded batch's forward, captured for graph_rows rows at `moves` graph_moves */
    int graph_rows;
    unsigned graph_moves;
};

/* ---- the level's hooks, defined by level5_cuda_naive/lenet.cu and level6_cublas/lenet.cu ---- */

/* Convolution `layer` (0: conv1, 1: conv2) with its bias: out (B, F, OH, OH) from x (B, C, H, H), w (F, C, K, K). */
static int conv_layer(lenet *m, int layer, float *out, const float *x, const float *w, const float *b, int B);
/* Its backward from dout (B, F, OH, OH): dw, db and, unless NULL, dx (conv1 needs none). */
static int conv_layer_backward(lenet *m, int layer, float *dx, float *dw, float *db, const float *dout, const float *x,
                               const float *w, int B);
/* Max-pool `layer` (0: pool1, 1: pool2): out (B, C, H/2, H/2) from a (B, C, H, H); and its backward, da from dout. */
static int pool_layer(lenet *m, int layer, float *out, const float *a, int B);
static int pool_layer_backward(lenet *m, int layer, float *da, const float *dout, const float *out, const float *a,
                               int B);
/* The level's convolutions: whether it has this one (LENET_DIRECT, ...), its state, and that state made ready for
 * batches of up to `rows` rows (level 6: the workspace). level_state_destroy accepts a half-made model. */
static int check_convolution(int convolution);
static int level_state_create(lenet *m);
static int level_state_reserve(lenet *m, int rows);
static int level_state_destroy(lenet *m);
#ifdef LENET_FUSED_FORWARD
/* Level 7: the forward for inference (lenet_forward, lenet_infer_*) as one fused kernel; with `keep`, every layer's
 * output to its buffer as well, for the per-layer check. */
static int inference_forward(lenet *m, float *logits, const float *x, int B, bool keep);
#endif

/* ---- the step: level 4's, line for line; each call queued on the stream ---- */

/* A fully connected layer: out (B, n_out) = x (B, n_in) @ w^T + b, through the MLP's layer functions. */
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

/* Forward of a batch x (B, 784) (device): every layer's output into the model's buffers, the last into logits. */
static int net_forward(lenet *m, float *logits, const float *x, int B) {
    const float *p = m->params;
    mlp *base = &m->base;
    int status = conv_layer(m, 0, m->h1, x, p + W1, p + B1, B);
    if (!status) status = relu_forward(base, m->a1, m->h1, (size_t)B * H1);
    if (!status) status = pool_layer(m, 0, m->p1, m->a1, B);
    if (!status) status = conv_layer(m, 1, m->h2, m->p1, p + W2, p + B2, B);
    if (!status) status = relu_forward(base, m->a2, m->h2, (size_t)B * H2);
    if (!status) status = pool_layer(m, 1, m->p2, m->a2, B);
    if (!status) status = fc_layer(m, m->f1, m->p2, p + W3, p + B3, B, FLAT, F1);
    if (!status) status = relu_forward(base, m->r3, m->f1, (size_t)B * F1);
    if (!status) status = fc_layer(m, m->f2, m->r3, p + W4, p + B4, B, F1, F2);
    if (!status) status = relu_forward(base, m->r4, m->f2, (size_t)B * F2);
    if (!status) status = fc_layer(m, logits, m->r4, p + W5, p + B5, B, F2, OUT);
    return status;
}

#ifndef LENET_FUSED_FORWARD
/* The forward for inference: net_forward, which keeps every layer's output anyway. */
static int inference_forward(lenet *m, float *logits, const float *x, int B, bool keep) {
    (void)keep;
    return net_forward(m, logits, x, B);
}
#endif

/* Forward and backward of one batch x (B, 784), y (B) (device): the mean loss to *loss (device), the gradients to
 * m->grads, every layer's output and gradient to its buffer. */
static int net_forward_backward(lenet *m, float *loss, const float *x, const int *y, int B) {
    const float *p = m->params;
    float *g = m->grads;
    mlp *base = &m->base;
    int status = net_forward(m, m->logits, x, B);
    if (!status) status = softmax_xent_forward(base, loss, m->dlogits, m->row_loss, m->logits, y, B, OUT);
    if (!status) status = softmax_xent_backward(base, m->dlogits, m->dlogits, y, B, OUT);
    if (!status) status = fc_layer_backward(m, m->dr4, g + W5, g + B5, m->dlogits, m->r4, p + W5, B, F2, OUT);
    if (!status) status = relu_backward(base, m->df2, m->dr4, m->f2, (size_t)B * F2);
    if (!status) status = fc_layer_backward(m, m->dr3, g + W4, g + B4, m->df2, m->r3, p + W4, B, F1, F2);
    if (!status) status = relu_backward(base, m->df1, m->dr3, m->f1, (size_t)B * F1);
    if (!status) status = fc_layer_backward(m, m->dp2, g + W3, g + B3, m->df1, m->p2, p + W3, B, FLAT, F1);
    if (!status) status = pool_layer_backward(m, 1, m->da2, m->dp2, m->p2, m->a2, B);
    if (!status) status = relu_backward(base, m->dh2, m->da2, m->h2, (size_t)B * H2);
    if (!status) status = conv_layer_backward(m, 1, m->dp1, g + W2, g + B2, m->dh2, m->p1, p + W2, B);
    if (!status) status = pool_layer_backward(m, 0, m->da1, m->dp1, m->p1, m->a1, B);
    if (!status) status = relu_backward(base, m->dh1, m->da1, m->h1, (size_t)B * H1);
    if (!status) status = conv_layer_backward(m, 0, NULL, g + W1, g + B1, m->dh1, x, p + W1, B);
    return status;
}

/* ---- memory: the model owns every buffer; the batch's grow only when a larger batch arrives ---- */

/* Each buffer cut from the batch's block starts on a 256-byte boundary, as cudaMalloc's own do: cuDNN's kernels read
 * with 16-byte vector loads and fail on a misaligned tensor (an odd batch of 37 rows x 10 logits ends misaligned). */
enum { ALIGN_FLOATS = 64 };
static size_t aligned(size_t floats) { return (floats + ALIGN_FLOATS - 1) / ALIGN_FLOATS * ALIGN_FLOATS; }

/* The floats of one image in the float block, in the order it is cut: x, every layer's output, their gradients,
 * the row's loss; and the ints: its label and the two pools' choices. */
static const int ROW_SIZES[] = {IMAGE * IMAGE, H1, H1, POOL1, H2, H2, POOL2, F1, F1, F2, F2, OUT, H1, H1, POOL1, H2,
                                H2, POOL2, F1, F1, F2, F2, OUT, 1};
static const int ROW_INT_SIZES[] = {1, POOL1, POOL2};

static cudaError_t free_batch(lenet *m) {
    const cudaError_t err = free_device({m->batch, m->ints});
    m->batch = NULL, m->ints = NULL;
    m->capacity = 0;
    return err;
}

/* Make the per-batch buffers hold `rows` rows: one block of floats and one of ints, cut into the buffers. */
static int ensure_batch(lenet *m, int rows) {
    if (rows <= m->capacity) return MLP_OK;
    int status = check_elements(rows, LENET_ROW_FLOATS); /* the binding's bound, the same at every level */
    if (status) return status;
    CUDA_CHECK(free_batch(m));
    const size_t R = (size_t)rows;
    size_t floats = 0, ints = 0;
    for (int size : ROW_SIZES) floats += aligned(R * size);
    for (int size : ROW_INT_SIZES) ints += aligned(R * size);
    CUDA_CHECK(device_malloc(&m->batch, sizeof(float) * floats));
    CUDA_CHECK(device_malloc(&m->ints, sizeof(int) * ints));
    float **buffers[] = {&m->x, &m->h1, &m->a1, &m->p1, &m->h2, &m->a2, &m->p2, &m->f1, &m->r3, &m->f2, &m->r4,
                         &m->logits, &m->dh1, &m->da1, &m->dp1, &m->dh2, &m->da2, &m->dp2, &m->df1, &m->dr3, &m->df2,
                         &m->dr4, &m->dlogits, &m->row_loss};
    static_assert(sizeof buffers / sizeof buffers[0] == sizeof ROW_SIZES / sizeof ROW_SIZES[0], "a size per buffer");
    float *next = m->batch;
    for (size_t i = 0; i < sizeof ROW_SIZES / sizeof ROW_SIZES[0]; i++) {
        *buffers[i] = next;
        next += aligned(R * ROW_SIZES[i]);
    }
    int **int_buffers[] = {&m->y, &m->choice1, &m->choice2};
    int *next_int = m->ints;
    for (size_t i = 0; i < 3; i++) {
        *int_buffers[i] = next_int;
        next_int += aligned(R * ROW_INT_SIZES[i]);
    }
    m->moves++;
    status = level_state_reserve(m, rows);
    if (status) return status;
    m->capacity = rows;
    return MLP_OK;
}

/* The stream, the level's state, and zeroed parameters and gradients on the device. */
static int init_model(lenet *m) {
    CUDA_CHECK(cudaStreamCreateWithFlags(&m->base.stream, cudaStreamNonBlocking));
    int status = level_create(&m->base);
    if (!status) status = level_state_create(m);
    if (status) return status;
    CUDA_CHECK(device_malloc(&m->params, sizeof(float) * N_PARAMS));
    CUDA_CHECK(device_malloc(&m->grads, sizeof(float) * N_PARAMS));
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
    int status = level_state_destroy(m);
    const int mlp_status = level_destroy(&m->base);
    if (!status) status = mlp_status;
    cudaError_t err = free_device({m->params, m->grads, m->data_x, m->data_y, m->order, m->losses, m->infer_block});
    if (m->forward_graph) {
        const cudaError_t graph_err = cudaGraphExecDestroy(m->forward_graph);
        if (err == cudaSuccess) err = graph_err;
    }
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
    const int status = check_convolution(convolution);
    if (status) return status;
    m->convolution = convolution;
    return MLP_OK;
}

int lenet_get_convolution(lenet *m, int *convolution) {
    if (!m || !convolution) return FAIL(MLP_ERR_ARG, "NULL argument");
    *convolution = m->convolution;
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
        status = inference_forward(m, m->logits, m->x, B, false);
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

/* ---- inference: the loaded batch's forward as one CUDA graph ---- */

/* What queue() puts on the model's stream, captured as a CUDA graph and made ready to launch into *exec. */
template <typename Queue>
static int capture_graph(lenet *m, cudaGraphExec_t *exec, Queue queue) {
    cudaGraph_t graph = NULL;
    CUDA_CHECK(cudaStreamBeginCapture(m->base.stream, cudaStreamCaptureModeRelaxed));
    int status = queue();
    const cudaError_t ended = cudaStreamEndCapture(m->base.stream, &graph); /* ended even if queue() failed */
    if (!status && ended != cudaSuccess) status = cuda_fail(ended, "cudaStreamEndCapture", __FILE__, __LINE__);
    if (!status) {
        const cudaError_t made = cudaGraphInstantiate(exec, graph, 0);
        if (made != cudaSuccess) status = cuda_fail(made, "cudaGraphInstantiate", __FILE__, __LINE__);
    }
    if (graph) cudaGraphDestroy(graph);
    return status;
}

/* The loaded batch's forward, FORWARD_CHUNK rows at a time, its logits to m->infer_logits; queued on the stream.
 * With `outputs` (host), every layer's output is copied there too (lenet_infer_layers). */
static int queue_inference(lenet *m, float *outputs) {
    const int n = m->infer_rows;
    for (int start = 0; start < n; start += FORWARD_CHUNK) {
        const int B = n - start < FORWARD_CHUNK ? n - start : FORWARD_CHUNK;
        const int status = inference_forward(m, m->infer_logits + (size_t)start * OUT,
                                             m->infer_x + (size_t)start * IMAGE * IMAGE, B, outputs != NULL);
        if (status) return status;
        if (!outputs) continue;
        const float *out[] = {m->h1, m->a1, m->p1, m->h2, m->a2, m->p2, m->f1, m->r3, m->f2, m->r4,
                              m->infer_logits + (size_t)start * OUT};
        const int sizes[] = {H1, H1, POOL1, H2, H2, POOL2, F1, F1, F2, F2, OUT};
        float *layer = outputs;
        for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
            CUDA_CHECK(cudaMemcpyAsync(layer + (size_t)start * sizes[i], out[i], sizeof(float) * (size_t)B * sizes[i],
                                       cudaMemcpyDeviceToHost, m->base.stream));
            layer += (size_t)n * sizes[i];
        }
    }
    return MLP_OK;
}

/* The forward graph of the loaded batch, captured unless the one we have still fits: a graph keeps the pointers it
 * was captured with, so another batch size or a buffer moved since (a larger batch loaded or trained) means a new
 * one. One run outside the capture first: cuBLAS and cuDNN set themselves up on first use, which a capture forbids. */
static int ensure_forward_graph(lenet *m) {
    int status = ensure_batch(m, m->infer_rows < FORWARD_CHUNK ? m->infer_rows : FORWARD_CHUNK);
    if (status) return status;
    if (m->forward_graph && m->graph_rows == m->infer_rows && m->graph_moves == m->moves) return MLP_OK;
    if (m->forward_graph) CUDA_CHECK(cudaGraphExecDestroy(m->forward_graph));
    m->forward_graph = NULL;
    status = queue_inference(m, NULL);
    if (!status) status = capture_graph(m, &m->forward_graph, [m] { return queue_inference(m, NULL); });
    if (status) return status;
    m->graph_rows = m->infer_rows, m->graph_moves = m->moves;
    return MLP_OK;
}

int lenet_infer_load(lenet *m, const float *x, int n) {
    if (!m || !x) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (n < 1) return FAIL(MLP_ERR_ARG, "n must be >= 1, got %d", n);
    const int status = check_elements(n, IMAGE * IMAGE);
    if (status) return status;
    if (n > m->infer_capacity) {
        m->infer_rows = 0, m->infer_capacity = 0; /* no batch until the new one is complete */
        CUDA_CHECK(free_device({m->infer_block}));
        m->infer_block = NULL;
        m->moves++;
        const size_t image_floats = aligned((size_t)n * IMAGE * IMAGE);
        CUDA_CHECK(device_malloc(&m->infer_block, sizeof(float) * (image_floats + aligned((size_t)n * OUT))));
        m->infer_x = m->infer_block, m->infer_logits = m->infer_block + image_floats;
        m->infer_capacity = n;
    }
    CUDA_CHECK(cudaMemcpyAsync(m->infer_x, x, sizeof(float) * (size_t)n * IMAGE * IMAGE, cudaMemcpyHostToDevice,
                               m->base.stream));
    CUDA_CHECK(cudaStreamSynchronize(m->base.stream));
    m->infer_rows = n;
    return MLP_OK;
}

/* One graph launch and one wait: what the latency table times (logits NULL). */
int lenet_infer_run(lenet *m, float *logits) {
    if (!m) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (m->infer_rows < 1) return FAIL(MLP_ERR_ARG, "no batch loaded: call lenet_infer_load first");
    const int status = ensure_forward_graph(m);
    if (status) return status;
    CUDA_CHECK(cudaGraphLaunch(m->forward_graph, m->base.stream));
    if (logits)
        CUDA_CHECK(cudaMemcpyAsync(logits, m->infer_logits, sizeof(float) * (size_t)m->infer_rows * OUT,
                                   cudaMemcpyDeviceToHost, m->base.stream));
    CUDA_CHECK(cudaStreamSynchronize(m->base.stream));
    return MLP_OK;
}

int lenet_infer_layers(lenet *m, float *outputs) {
    if (!m || !outputs) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (m->infer_rows < 1) return FAIL(MLP_ERR_ARG, "no batch loaded: call lenet_infer_load first");
    int status = ensure_batch(m, m->infer_rows < FORWARD_CHUNK ? m->infer_rows : FORWARD_CHUNK);
    if (!status) status = queue_inference(m, outputs);
    if (status) return status;
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
    CUDA_CHECK(device_malloc(&m->data_x, sizeof(float) * (size_t)n * IMAGE * IMAGE));
    CUDA_CHECK(device_malloc(&m->data_y, sizeof(int) * (size_t)n));
    CUDA_CHECK(cudaMemcpyAsync(m->data_x, x, sizeof(float) * (size_t)n * IMAGE * IMAGE, cudaMemcpyHostToDevice,
                               m->base.stream));
    CUDA_CHECK(cudaMemcpyAsync(m->data_y, y, sizeof(int) * (size_t)n, cudaMemcpyHostToDevice, m->base.stream));
    CUDA_CHECK(cudaStreamSynchronize(m->base.stream));
    m->n_data = n;
    return MLP_OK;
}

/* One whole step on the rows `order` (device, B of them): gather, forward and backward, the loss to *loss (device),
 * one SGD update of the flat parameter buffer. */
static int one_step(lenet *m, const int *order, int B, float lr, float *loss) {
    int status = gather(&m->base, m->x, m->y, m->data_x, m->data_y, order, B, IMAGE * IMAGE);
    if (!status) status = net_forward_backward(m, loss, m->x, m->y, B);
    if (!status) status = sgd_update(&m->base, m->params, m->grads, lr, N_PARAMS);
    return status;
}

/* The steps of an epoch over the rows m->order[0 .. n_order), each step's loss to m->losses[step], all queued on the
 * stream without waiting. */
static int queue_steps(lenet *m, int n_order, int batch_size, float lr) {
    for (int start = 0, step = 0; start < n_order; start += batch_size, step++) {
        const int B = n_order - start < batch_size ? n_order - start : batch_size;
        const int status = one_step(m, m->order + start, B, lr, m->losses + step);
        if (status) return status;
    }
    return MLP_OK;
}

#ifdef LENET_TRAINS_ITS_OWN_STEPS
/* Level 6 replays a captured step (a CUDA graph), with queue_steps as its fallback. */
static int train_steps(lenet *m, int n_order, int batch_size, float lr);
#else
static int train_steps(lenet *m, int n_order, int batch_size, float lr) {
    return queue_steps(m, n_order, batch_size, lr);
}
#endif

/* The whole epoch on the stream without a wait (train_steps); the losses come back in one copy at the end. */
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
    status = train_steps(m, n_order, batch_size, lr);
    if (status) return status;
    CUDA_CHECK(cudaMemcpyAsync(losses, m->losses, sizeof(float) * (size_t)steps, cudaMemcpyDeviceToHost,
                               m->base.stream));
    CUDA_CHECK(cudaStreamSynchronize(m->base.stream));
    return MLP_OK;
}

#endif /* CUDA_LENET_CUH */
