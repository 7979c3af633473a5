/* level6_cublas/lenet.cu - Level 6 for LeNet-5: the convolutions and the pools through cuDNN, the fully connected
 * layers through cuBLAS, and the training step captured once as a CUDA graph.
 *
 * What this adds over level5_cuda_naive/lenet.cu: the libraries. cuDNN computes each convolution, its two backward
 * products and each max-pool (level 5's kernels, replaced), and level 6's mlp.cu, included below, brings cuBLAS for
 * the fully connected layers. The model on the device and the step are common/native/cuda_lenet.cuh, as at level 5.
 *
 * Three choices make it verifiable (the tests catch the first two planted as bugs):
 *   - FP32 with FMA only (CUDNN_FMA_MATH): cuDNN's default math lets FP32 convolutions run on TF32 tensor cores,
 *     which round every input to 10 mantissa bits;
 *   - deterministic algorithms: forward IMPLICIT_PRECOMP_GEMM, backward data ALGO_1, backward filter FFT (ALGO_0
 *     adds with atomics, in whatever order threads arrive; ALGO_1 is deterministic too, but took 430 of an 818 us
 *     step at batch 256, measured), CUDNN_POOLING_MAX_DETERMINISTIC; so reruns are bit-identical. The verifier
 *     judges each choice: FFT's filter gradients are as close to float64 as ALGO_1's, WINOGRAD_NONFUSED's are not;
 *   - the legacy API (cudnnConvolutionForward and its kin): deprecated since cuDNN 9 in favour of the graph API,
 *     but it still works, names every step a student has already written by hand, and takes a fixed algorithm.
 * The workspace is sized once for the largest batch and every algorithm, and grows only with the batch. The bias
 * gradient of a convolution is ours (two small kernels): cuDNN's cudnnConvolutionBackwardBias took 171 us of that
 * 818 us step.
 *
 * Then the lesson: a step is about 50 small kernels (56 GPU operations at batch 16, measured), each launch costing
 * the CPU a few microseconds. The step is captured once (per batch size and learning rate) as a CUDA graph and
 * replayed: one launch per step.
 *
 * Implements common/native/lenet.h with common/native/cuda_lenet.cuh. Build: `make level6` (cuDNN from the CUDA toolkit or the
 * nvidia-cudnn-cu13 wheel); test: `pytest -m "lenet and level6"` on a GPU machine.
 */
#define LENET_TRAINS_ITS_OWN_STEPS
#include "mlp.cu"

#include "cuda_lenet.cuh"

#include <cudnn.h>

#include <cstring>

/* After every cuDNN call, like CUDA_CHECK. */
#define CUDNN_CHECK(call)                                                                                     \
    do {                                                                                                      \
        const cudnnStatus_t status_ = (call);                                                                 \
        if (status_ != CUDNN_STATUS_SUCCESS)                                                                  \
            return FAIL(status_ == CUDNN_STATUS_ALLOC_FAILED ? MLP_ERR_ALLOC : MLP_ERR_DEVICE, "%s: %s", #call, \
                        cudnnGetErrorString(status_));                                                        \
    } while (0)

static const cudnnConvolutionFwdAlgo_t FORWARD = CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM;
static const cudnnConvolutionBwdDataAlgo_t BACKWARD_DATA = CUDNN_CONVOLUTION_BWD_DATA_ALGO_1;
static const cudnnConvolutionBwdFilterAlgo_t BACKWARD_FILTER = CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT;
static const cudnnMathType_t MATH = CUDNN_FMA_MATH;

struct cudnn_state {
    cudnnHandle_t handle;
    /* The activations at the batch size last described: x (B, 1, 28, 28), conv1's output (B, 6, 24, 24), pool1's
     * (B, 6, 12, 12), conv2's (B, 16, 8, 8), pool2's (B, 16, 4, 4). Convolution l reads tensor 2l and writes 2l + 1;
     * pool l reads 2l + 1 and writes 2l + 2. */
    cudnnTensorDescriptor_t tensor[5];
    int described;                      /* the batch size they describe */
    cudnnTensorDescriptor_t bias[2];    /* (1, F, 1, 1) */
    cudnnFilterDescriptor_t filter[2];  /* (F, C, K, K) */
    cudnnConvolutionDescriptor_t convolution;
    cudnnPoolingDescriptor_t pool;
    void *workspace;                    /* device: the largest any algorithm asked for, at the largest batch */
    size_t workspace_bytes;
    float *plane_sums;                  /* device (rows, C2): each (image, filter) plane of a bias gradient, summed */
    /* The captured step, and what it was captured with: replayed only while every pointer it reads is the same. */
    cudaGraphExec_t step;
    int step_rows;
    float step_lr;
    const void *step_buffers[6];        /* m->batch, m->ints, m->data_x, m->data_y, workspace, plane_sums */
    int *step_order;                    /* device (step_rows): the rows of the step being replayed */
    float *step_loss;                   /* device (1): its loss */
};

static cudnn_state *state(lenet *m) { return static_cast<cudnn_state *>(m->level_state); }

/* cuDNN reads its alpha and beta from host memory, like cuBLAS: mlp.cu's `one` and `zero` serve both. */

/* Describe the five activation tensors for a batch of B rows (host-side bookkeeping, no GPU work). */
static int describe(lenet *m, int B) {
    cudnn_state *s = state(m);
    if (s->described == B) return MLP_OK;
    const int shapes[5][3] = {{1, IMAGE, IMAGE}, {C1, S1, S1}, {C1, P1, P1}, {C2, S2, S2}, {C2, P2, P2}};
    for (int t = 0; t < 5; t++)
        CUDNN_CHECK(cudnnSetTensor4dDescriptor(s->tensor[t], CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, B, shapes[t][0],
                                               shapes[t][1], shapes[t][2]));
    s->described = B;
    return MLP_OK;
}

/* ---- a convolution's bias gradient: db (F) = the sum of dout (B, F, P) over its images and positions ---- */

/* partial (planes) = the sum of each of dout's planes (planes, P): one warp per plane, its lanes striding over the
 * positions, then warp_sum's butterfly; a fixed order, so the same bits every run. */
__global__ void plane_sum_kernel(float *partial, const float *dout, int planes, int P) {
    const size_t plane = thread_index() / WARP;
    const int lane = threadIdx.x % WARP;
    if (plane >= (size_t)planes) return; /* THREADS is a whole number of warps: a warp leaves together */
    float sum = 0.0f;
    for (int p = lane; p < P; p += WARP) sum += dout[plane * P + p];
    sum = warp_sum(sum);
    if (lane == 0) partial[plane] = sum;
}

/* Then the sum over the images of partial (B, F), column by column: the fully connected layers' bias_backward. */
static int conv_bias_backward(lenet *m, float *db, const float *dout, int B, int F, int P) {
    float *partial = state(m)->plane_sums;
    plane_sum_kernel<<<blocks_for((size_t)B * F * WARP), THREADS, 0, m->base.stream>>>(partial, dout, B * F, P);
    CUDA_CHECK(cudaGetLastError());
    return bias_backward(&m->base, db, partial, B, F);
}

/* ---- the hooks of common/native/cuda_lenet.cuh ---- */

/* out = x correlated with w (cuDNN's CROSS_CORRELATION is PyTorch's Conv2d: no flip), then out += b. */
static int conv_layer(lenet *m, int layer, float *out, const float *x, const float *w, const float *b, int B) {
    cudnn_state *s = state(m);
    const int status = describe(m, B);
    if (status) return status;
    CUDNN_CHECK(cudnnConvolutionForward(s->handle, &one, s->tensor[2 * layer], x, s->filter[layer], w, s->convolution,
                                        FORWARD, s->workspace, s->workspace_bytes, &zero, s->tensor[2 * layer + 1],
                                        out));
    CUDNN_CHECK(cudnnAddTensor(s->handle, &one, s->bias[layer], b, &one, s->tensor[2 * layer + 1], out));
    return MLP_OK;
}

static int conv_layer_backward(lenet *m, int layer, float *dx, float *dw, float *db, const float *dout, const float *x,
                               const float *w, int B) {
    cudnn_state *s = state(m);
    const int status = describe(m, B);
    if (status) return status;
    cudnnTensorDescriptor_t in = s->tensor[2 * layer], out = s->tensor[2 * layer + 1];
    CUDNN_CHECK(cudnnConvolutionBackwardFilter(s->handle, &one, in, x, out, dout, s->convolution, BACKWARD_FILTER,
                                               s->workspace, s->workspace_bytes, &zero, s->filter[layer], dw));
    const int OH = CONV[layer].H - K + 1;
    const int bias_status = conv_bias_backward(m, db, dout, B, CONV[layer].F, OH * OH);
    if (bias_status) return bias_status;
    if (dx)
        CUDNN_CHECK(cudnnConvolutionBackwardData(s->handle, &one, s->filter[layer], w, out, dout, s->convolution,
                                                 BACKWARD_DATA, s->workspace, s->workspace_bytes, &zero, in, dx));
    return MLP_OK;
}

static int pool_layer(lenet *m, int layer, float *out, const float *a, int B) {
    cudnn_state *s = state(m);
    const int status = describe(m, B);
    if (status) return status;
    CUDNN_CHECK(cudnnPoolingForward(s->handle, s->pool, &one, s->tensor[2 * layer + 1], a, &zero,
                                    s->tensor[2 * layer + 2], out));
    return MLP_OK;
}

/* cuDNN finds each window's maximum again, from the pool's input a and output out. */
static int pool_layer_backward(lenet *m, int layer, float *da, const float *dout, const float *out, const float *a,
                               int B) {
    cudnn_state *s = state(m);
    const int status = describe(m, B);
    if (status) return status;
    cudnnTensorDescriptor_t in = s->tensor[2 * layer + 1], pooled = s->tensor[2 * layer + 2];
    CUDNN_CHECK(cudnnPoolingBackward(s->handle, s->pool, &one, pooled, out, pooled, dout, in, a, &zero, in, da));
    return MLP_OK;
}

static int check_convolution(int convolution) {
    if (convolution != LENET_DIRECT)
        return FAIL(MLP_ERR_ARG, "level 6's convolutions are direct (%d, cuDNN's), got %d", LENET_DIRECT, convolution);
    return MLP_OK;
}

/* The handle on the model's stream, and the descriptors that do not depend on the batch. */
static int level_state_create(lenet *m) {
    cudnn_state *s = static_cast<cudnn_state *>(calloc(1, sizeof(cudnn_state)));
    if (!s) return FAIL(MLP_ERR_ALLOC, "out of memory for cuDNN's state");
    m->level_state = s;
    CUDNN_CHECK(cudnnCreate(&s->handle));
    CUDNN_CHECK(cudnnSetStream(s->handle, m->base.stream));
    for (int t = 0; t < 5; t++) CUDNN_CHECK(cudnnCreateTensorDescriptor(&s->tensor[t]));
    for (int l = 0; l < 2; l++) {
        CUDNN_CHECK(cudnnCreateTensorDescriptor(&s->bias[l]));
        CUDNN_CHECK(cudnnSetTensor4dDescriptor(s->bias[l], CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 1, CONV[l].F, 1, 1));
        CUDNN_CHECK(cudnnCreateFilterDescriptor(&s->filter[l]));
        CUDNN_CHECK(cudnnSetFilter4dDescriptor(s->filter[l], CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, CONV[l].F, CONV[l].C,
                                               K, K));
    }
    CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&s->convolution));
    CUDNN_CHECK(cudnnSetConvolution2dDescriptor(s->convolution, 0, 0, 1, 1, 1, 1, CUDNN_CROSS_CORRELATION,
                                                CUDNN_DATA_FLOAT));
    CUDNN_CHECK(cudnnSetConvolutionMathType(s->convolution, MATH));
    CUDNN_CHECK(cudnnCreatePoolingDescriptor(&s->pool));
    CUDNN_CHECK(cudnnSetPooling2dDescriptor(s->pool, CUDNN_POOLING_MAX_DETERMINISTIC, CUDNN_NOT_PROPAGATE_NAN, 2, 2, 0,
                                            0, 2, 2));
    return MLP_OK;
}

/* For batches of up to `rows` rows: the bias gradients' scratch, and the workspace, the most that any of the three
 * algorithms asks for, either layer. */
static int level_state_reserve(lenet *m, int rows) {
    cudnn_state *s = state(m);
    int status = describe(m, rows);
    if (status) return status;
    size_t bytes = 0;
    for (int l = 0; l < 2; l++) {
        size_t need[3];
        cudnnTensorDescriptor_t in = s->tensor[2 * l], out = s->tensor[2 * l + 1];
        CUDNN_CHECK(cudnnGetConvolutionForwardWorkspaceSize(s->handle, in, s->filter[l], s->convolution, out, FORWARD,
                                                            &need[0]));
        CUDNN_CHECK(cudnnGetConvolutionBackwardDataWorkspaceSize(s->handle, s->filter[l], out, s->convolution, in,
                                                                 BACKWARD_DATA, &need[1]));
        CUDNN_CHECK(cudnnGetConvolutionBackwardFilterWorkspaceSize(s->handle, in, out, s->convolution, s->filter[l],
                                                                   BACKWARD_FILTER, &need[2]));
        for (size_t n : need) bytes = n > bytes ? n : bytes;
    }
    CUDA_CHECK(device_free(s->plane_sums));
    s->plane_sums = NULL;
    CUDA_CHECK(device_malloc(&s->plane_sums, sizeof(float) * (size_t)rows * C2));
    if (bytes <= s->workspace_bytes) return MLP_OK;
    CUDA_CHECK(device_free(s->workspace));
    s->workspace = NULL, s->workspace_bytes = 0;
    CUDA_CHECK(device_malloc(&s->workspace, bytes));
    s->workspace_bytes = bytes;
    return MLP_OK;
}

static int level_state_destroy(lenet *m) {
    cudnn_state *s = state(m);
    if (!s) return MLP_OK;
    m->level_state = NULL;
    /* Everything is released, going on past a failure; the first failure is reported. */
    int status = MLP_OK;
    const auto keep = [&status](int failed) { status = status ? status : failed; };
    if (s->step && cudaGraphExecDestroy(s->step) != cudaSuccess) keep(FAIL(MLP_ERR_DEVICE, "cudaGraphExecDestroy"));
    if (free_device({s->workspace, s->plane_sums, s->step_order, s->step_loss}) != cudaSuccess)
        keep(FAIL(MLP_ERR_DEVICE, "cudaFree"));
    for (cudnnTensorDescriptor_t t : s->tensor) cudnnDestroyTensorDescriptor(t);
    for (int l = 0; l < 2; l++) cudnnDestroyTensorDescriptor(s->bias[l]), cudnnDestroyFilterDescriptor(s->filter[l]);
    cudnnDestroyConvolutionDescriptor(s->convolution);
    cudnnDestroyPoolingDescriptor(s->pool);
    if (s->handle && cudnnDestroy(s->handle) != CUDNN_STATUS_SUCCESS) keep(FAIL(MLP_ERR_DEVICE, "cudnnDestroy"));
    free(s);
    return status;
}

/* ---- the step as a CUDA graph ---- */

#ifndef LENET_FUSED_STEP /* level 7 includes this file, and trains with its own two kernels instead */

/* The graph of one_step (common/native/cuda_lenet.cuh) for B rows and this learning rate, captured unless the one we have
 * still fits: a graph keeps the pointers it was captured with, so a buffer reallocated since (a larger batch, a new
 * data set) means a new one. */
static int ensure_graph(lenet *m, int B, float lr) {
    cudnn_state *s = state(m);
    const void *buffers[6] = {m->batch, m->ints, m->data_x, m->data_y, s->workspace, s->plane_sums};
    if (s->step && s->step_rows == B && s->step_lr == lr && !memcmp(buffers, s->step_buffers, sizeof buffers))
        return MLP_OK;
    if (s->step) CUDA_CHECK(cudaGraphExecDestroy(s->step));
    s->step = NULL;
    CUDA_CHECK(free_device({s->step_order, s->step_loss}));
    s->step_order = NULL, s->step_loss = NULL;
    CUDA_CHECK(device_malloc(&s->step_order, sizeof(int) * (size_t)B));
    CUDA_CHECK(device_malloc(&s->step_loss, sizeof(float)));
    CUDA_CHECK(cudaMemcpyAsync(s->step_order, m->order, sizeof(int) * (size_t)B, cudaMemcpyDeviceToDevice,
                               m->base.stream));
    /* One step outside the capture first, without its update: cuBLAS and cuDNN set themselves up on first use, and
     * that setup (allocations, a synchronization) must not happen inside a capture. */
    int status = describe(m, B);
    if (!status) status = gather(&m->base, m->x, m->y, m->data_x, m->data_y, s->step_order, B, IMAGE * IMAGE);
    if (!status) status = net_forward_backward(m, s->step_loss, m->x, m->y, B);
    if (status) return status;
    status = capture_graph(m, &s->step, [&] { return one_step(m, s->step_order, B, lr, s->step_loss); });
    if (status) return status;
    s->step_rows = B, s->step_lr = lr;
    memcpy(s->step_buffers, buffers, sizeof buffers);
    return MLP_OK;
}

/* Every whole batch replays the graph: its rows copied to where the graph reads them, one launch, its loss copied to
 * its place. A final partial batch is one step queued as at level 5. */
static int train_steps(lenet *m, int n_order, int batch_size, float lr) {
    cudnn_state *s = state(m);
    const int whole = n_order / batch_size;
    const cudaStream_t stream = m->base.stream;
    if (whole) {
        const int status = ensure_graph(m, batch_size, lr);
        if (status) return status;
    }
    for (int step = 0; step < whole; step++) {
        CUDA_CHECK(cudaMemcpyAsync(s->step_order, m->order + (size_t)step * batch_size, sizeof(int) * batch_size,
                                   cudaMemcpyDeviceToDevice, stream));
        CUDA_CHECK(cudaGraphLaunch(s->step, stream));
        CUDA_CHECK(cudaMemcpyAsync(m->losses + step, s->step_loss, sizeof(float), cudaMemcpyDeviceToDevice, stream));
    }
    if (whole * batch_size == n_order) return MLP_OK;
    const int rest = n_order - whole * batch_size;
    return one_step(m, m->order + (size_t)whole * batch_size, rest, lr, m->losses + whole);
}
#endif /* LENET_FUSED_STEP */
