/* common/harness/matmul_kernels.cu - a level's matrix products alone, for common/harness/matmul_kernels.py.
 *
 * Built once with each level's mlp.cu (make build/matmul_level5.so, build/matmul_level6.so: the level's folder is on
 * the include path), so it runs the very functions a step calls - linear_forward, linear_backward_dw,
 * linear_backward_dx - with the kernel a model is set to (mlp_set_matmul): level 5's kernels 1 to 3, or level 6's
 * cuBLAS, kernel 0. A product is computed once, for the caller to check, and only then timed with CUDA events: its
 * launches are captured as one CUDA graph (so the time is the GPU's, not the CPU's rate of launching), the graph is
 * replayed once to warm up, then timed replay by replay.
 */
#include "mlp.cu"

extern "C" {
/* cdef-begin */
#define PRODUCT_FORWARD 0 /* out (B, n_out) = x (B, n_in) @ w^T, w (n_out, n_in): linear_forward */
#define PRODUCT_DW 1      /* dw (n_out, n_in) = dout^T @ x, dout (B, n_out): linear_backward_dw */
#define PRODUCT_DX 2      /* dx (B, n_in) = dout @ w: linear_backward_dx */
/* One product of x, w and dout (host arrays) by the level's matrix product `matmul` (mlp.h's MLP_MATMUL_*): its
 * output into result (host), then `repeats` timed replays of `launches` launches, milliseconds per launch into ms. */
int product_run(int matmul, int product, const float *x, const float *w, const float *dout, int B, int n_in,
                int n_out, float *result, int launches, int repeats, float *ms);
/* cdef-end */
}

/* Queue one product on the model's stream, by the level's own function for it. */
static int queue_product(mlp *m, int product, float *out, const float *x, const float *w, const float *dout, int B,
                         int n_in, int n_out) {
    switch (product) {
    case PRODUCT_FORWARD: return linear_forward(m, out, x, w, B, n_in, n_out);
    case PRODUCT_DW: return linear_backward_dw(m, out, dout, x, B, n_in, n_out);
    case PRODUCT_DX: return linear_backward_dx(m, out, dout, w, B, n_in, n_out);
    }
    return FAIL(MLP_ERR_ARG, "product must be PRODUCT_FORWARD, PRODUCT_DW or PRODUCT_DX (0, 1, 2), got %d", product);
}

/* What one measurement holds: a model (for its stream, its choice of kernel and, at level 6, its cuBLAS handle), the
 * device arrays, the graph and the events. The destructor frees them all whatever happened; by then the measurement
 * has its status, and a failure to free has no one left to report to. */
struct Measurement {
    mlp *m = NULL;
    float *x = NULL, *w = NULL, *dout = NULL, *out = NULL;
    cudaGraph_t graph = NULL;
    cudaGraphExec_t replay = NULL;
    cudaEvent_t start = NULL, stop = NULL;

    ~Measurement() {
        if (replay) (void)cudaGraphExecDestroy(replay);
        if (graph) (void)cudaGraphDestroy(graph);
        if (start) (void)cudaEventDestroy(start);
        if (stop) (void)cudaEventDestroy(stop);
        (void)free_device({x, w, dout, out});
        (void)mlp_destroy(m);
    }
};

/* `launches` launches of the product, captured from the model's stream into one graph, ready to replay. */
static int capture(Measurement &s, int product, int B, int n_in, int n_out, int launches) {
    CUDA_CHECK(cudaStreamBeginCapture(s.m->stream, cudaStreamCaptureModeThreadLocal));
    int status = MLP_OK;
    for (int i = 0; i < launches && !status; i++)
        status = queue_product(s.m, product, s.out, s.x, s.w, s.dout, B, n_in, n_out);
    const cudaError_t ended = cudaStreamEndCapture(s.m->stream, &s.graph); /* ends the capture whatever happened */
    if (status) return status;
    CUDA_CHECK(ended);
    CUDA_CHECK(cudaGraphInstantiate(&s.replay, s.graph, 0));
    return MLP_OK;
}

int product_run(int matmul, int product, const float *x, const float *w, const float *dout, int B, int n_in,
                int n_out, float *result, int launches, int repeats, float *ms) {
    if (!x || !w || !dout || !result || !ms) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (B < 1 || n_in < 1 || n_out < 1 || launches < 1 || repeats < 1)
        return FAIL(MLP_ERR_ARG, "sizes, launches and repeats must be >= 1, got B=%d n_in=%d n_out=%d, %d and %d", B,
                    n_in, n_out, launches, repeats);
    Measurement s;
    int status = mlp_create(&s.m, n_in, 1, n_out);
    if (!status) status = mlp_set_matmul(s.m, matmul);
    if (status) return status;
    const size_t n_x = (size_t)B * n_in, n_w = (size_t)n_out * n_in, n_dout = (size_t)B * n_out;
    const size_t n_result = product == PRODUCT_FORWARD ? n_dout : product == PRODUCT_DW ? n_w : n_x;
    const cudaStream_t stream = s.m->stream;
    CUDA_CHECK(device_malloc(&s.x, sizeof(float) * n_x));
    CUDA_CHECK(device_malloc(&s.w, sizeof(float) * n_w));
    CUDA_CHECK(device_malloc(&s.dout, sizeof(float) * n_dout));
    CUDA_CHECK(device_malloc(&s.out, sizeof(float) * n_result));
    CUDA_CHECK(cudaMemcpyAsync(s.x, x, sizeof(float) * n_x, cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaMemcpyAsync(s.w, w, sizeof(float) * n_w, cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaMemcpyAsync(s.dout, dout, sizeof(float) * n_dout, cudaMemcpyHostToDevice, stream));
    status = queue_product(s.m, product, s.out, s.x, s.w, s.dout, B, n_in, n_out); /* once, for the check */
    if (status) return status;
    CUDA_CHECK(cudaMemcpyAsync(result, s.out, sizeof(float) * n_result, cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    status = capture(s, product, B, n_in, n_out, launches);
    if (status) return status;
    CUDA_CHECK(cudaEventCreate(&s.start));
    CUDA_CHECK(cudaEventCreate(&s.stop));
    CUDA_CHECK(cudaGraphLaunch(s.replay, stream)); /* warm-up: the first replay uploads the graph */
    for (int r = 0; r < repeats; r++) {
        float elapsed = 0.0f;
        CUDA_CHECK(cudaEventRecord(s.start, stream));
        CUDA_CHECK(cudaGraphLaunch(s.replay, stream));
        CUDA_CHECK(cudaEventRecord(s.stop, stream));
        CUDA_CHECK(cudaEventSynchronize(s.stop));
        CUDA_CHECK(cudaEventElapsedTime(&elapsed, s.start, s.stop));
        ms[r] = elapsed / (float)launches;
    }
    return MLP_OK;
}
