/* tests/lab_level5.cu - level 5's layer functions one at a time, for the lab's grader (tests/test_tasks.py).
 *
 * Each wrapper takes host arrays, copies them to the device, runs one layer function of level5_cuda_naive/mlp.cu
 * or common/native/cuda_mlp.cuh (its kernels) on a bare model that has only a stream, and copies the outputs back. So each
 * task is checked alone: a bug in one kernel cannot fail the check of another. Returns MLP_OK or the failure's
 * status (a student edition's stub: MLP_ERR_ARG, "lab 5.N: ... is not written yet"). Built on a GPU machine by
 * `make build/lab_level5.so`; the Python side reads the declarations between the cdef markers.
 */
#include "../level5_cuda_naive/lenet.cu" /* LeNet's kernels, and the MLP's through it (mlp.cu) */

#include <vector>

extern "C" {
/* cdef-begin */
int lab_linear_forward(float *out, const float *x, const float *w, int B, int n_in, int n_out);
int lab_linear_backward(float *dx, float *dw, const float *dout, const float *x, const float *w, int B, int n_in,
                        int n_out);
int lab_bias_forward(float *out, const float *b, int B, int n);
int lab_bias_backward(float *db, const float *dout, int B, int n);
int lab_relu_forward(float *a, const float *h, size_t n);
int lab_relu_backward(float *dh, const float *da, const float *h, size_t n);
int lab_softmax_xent_forward(float *loss, float *probs, const float *logits, const int *y, int B, int n_out);
int lab_softmax_xent_backward(float *dlogits, const float *probs, const int *y, int B, int n_out);
int lab_sgd_update(float *p, const float *dp, float lr, size_t n);
int lab_conv2d_forward(float *out, const float *x, const float *w, const float *b, int B, int C, int H, int F, int k,
                       int tiled);
/* cdef-end */
}

/* GUARD_BYTES of GUARD_BYTE after each device array. A kernel that writes past its array's end lands in them and
 * back() says so: without the guard such a write corrupts nothing the check reads, and the task would pass. A kernel
 * missing its bounds check on a partial tile writes up to TILE - 1 = 15 rows too many: 15 x 784 floats (47,040 bytes)
 * at the widest array the checks pass. */
#define GUARD_BYTES 65536
#define GUARD_BYTE 0xA5

/* The device arrays of one call: each a copy of a host array (or uninitialized, for an output) and its guard, freed
 * together. */
struct Device {
    void *arrays[8] = {};
    int count = 0;

    ~Device() {
        for (int i = 0; i < count; i++) cudaFree(arrays[i]);
    }

    /* *d = a device array of n elements, holding a copy of host[0 .. n) unless host is NULL. */
    template <typename T> int copy(T **d, const T *host, size_t n) {
        *d = NULL;
        CUDA_CHECK(cudaMalloc(d, sizeof(T) * n + GUARD_BYTES));
        arrays[count++] = *d;
        CUDA_CHECK(cudaMemset((char *)*d + sizeof(T) * n, GUARD_BYTE, GUARD_BYTES));
        if (host) CUDA_CHECK(cudaMemcpy(*d, host, sizeof(T) * n, cudaMemcpyHostToDevice));
        return MLP_OK;
    }
};

/* After the layer function's status: wait for its kernels, copy n elements of d back to host, and check that the
 * guard after them is untouched. */
template <typename T> static int back(int status, T *host, const T *d, size_t n) {
    if (status) return status;
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(host, d, sizeof(T) * n, cudaMemcpyDeviceToHost));
    std::vector<unsigned char> guard(GUARD_BYTES);
    CUDA_CHECK(cudaMemcpy(guard.data(), (const char *)d + sizeof(T) * n, GUARD_BYTES, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < GUARD_BYTES; i++)
        if (guard[i] != GUARD_BYTE)
            return FAIL(MLP_ERR_DEVICE, "a kernel wrote past the end of an output of %zu elements (%zu bytes after it): "
                        "a missing bounds check?", n, i);
    return MLP_OK;
}

int lab_linear_forward(float *out, const float *x, const float *w, int B, int n_in, int n_out) {
    Device d;
    mlp m{}; /* the layer functions use only its stream: here the default one */
    float *d_out = NULL, *d_x = NULL, *d_w = NULL;
    int status = d.copy(&d_out, (const float *)NULL, (size_t)B * n_out);
    if (!status) status = d.copy(&d_x, x, (size_t)B * n_in);
    if (!status) status = d.copy(&d_w, w, (size_t)n_out * n_in);
    if (!status) status = linear_forward(&m, d_out, d_x, d_w, B, n_in, n_out);
    return back(status, out, d_out, (size_t)B * n_out);
}

int lab_linear_backward(float *dx, float *dw, const float *dout, const float *x, const float *w, int B, int n_in,
                        int n_out) {
    Device d;
    mlp m{}; /* the layer functions use only its stream: here the default one */
    float *d_dx = NULL, *d_dw = NULL, *d_dout = NULL, *d_x = NULL, *d_w = NULL;
    int status = d.copy(&d_dw, (const float *)NULL, (size_t)n_out * n_in);
    if (!status && dx) status = d.copy(&d_dx, (const float *)NULL, (size_t)B * n_in);
    if (!status) status = d.copy(&d_dout, dout, (size_t)B * n_out);
    if (!status) status = d.copy(&d_x, x, (size_t)B * n_in);
    if (!status) status = d.copy(&d_w, w, (size_t)n_out * n_in);
    if (!status) status = linear_backward(&m, d_dx, d_dw, d_dout, d_x, d_w, B, n_in, n_out);
    status = back(status, dw, d_dw, (size_t)n_out * n_in);
    return dx ? back(status, dx, d_dx, (size_t)B * n_in) : status;
}

int lab_bias_forward(float *out, const float *b, int B, int n) {
    Device d;
    mlp m{}; /* the layer functions use only its stream: here the default one */
    float *d_out = NULL, *d_b = NULL;
    int status = d.copy(&d_out, out, (size_t)B * n);
    if (!status) status = d.copy(&d_b, b, (size_t)n);
    if (!status) status = bias_forward(&m, d_out, d_b, B, n);
    return back(status, out, d_out, (size_t)B * n);
}

int lab_bias_backward(float *db, const float *dout, int B, int n) {
    Device d;
    mlp m{}; /* the layer functions use only its stream: here the default one */
    float *d_db = NULL, *d_dout = NULL;
    int status = d.copy(&d_db, (const float *)NULL, (size_t)n);
    if (!status) status = d.copy(&d_dout, dout, (size_t)B * n);
    if (!status) status = bias_backward(&m, d_db, d_dout, B, n);
    return back(status, db, d_db, (size_t)n);
}

int lab_relu_forward(float *a, const float *h, size_t n) {
    Device d;
    mlp m{}; /* the layer functions use only its stream: here the default one */
    float *d_a = NULL, *d_h = NULL;
    int status = d.copy(&d_a, (const float *)NULL, n);
    if (!status) status = d.copy(&d_h, h, n);
    if (!status) status = relu_forward(&m, d_a, d_h, n);
    return back(status, a, d_a, n);
}

int lab_relu_backward(float *dh, const float *da, const float *h, size_t n) {
    Device d;
    mlp m{}; /* the layer functions use only its stream: here the default one */
    float *d_dh = NULL, *d_da = NULL, *d_h = NULL;
    int status = d.copy(&d_dh, (const float *)NULL, n);
    if (!status) status = d.copy(&d_da, da, n);
    if (!status) status = d.copy(&d_h, h, n);
    if (!status) status = relu_backward(&m, d_dh, d_da, d_h, n);
    return back(status, dh, d_dh, n);
}

int lab_softmax_xent_forward(float *loss, float *probs, const float *logits, const int *y, int B, int n_out) {
    Device d;
    mlp m{}; /* the layer functions use only its stream: here the default one */
    float *d_loss = NULL, *d_probs = NULL, *d_row_loss = NULL, *d_logits = NULL;
    int *d_y = NULL;
    int status = d.copy(&d_loss, (const float *)NULL, 1);
    if (!status) status = d.copy(&d_probs, (const float *)NULL, (size_t)B * n_out);
    if (!status) status = d.copy(&d_row_loss, (const float *)NULL, (size_t)B);
    if (!status) status = d.copy(&d_logits, logits, (size_t)B * n_out);
    if (!status) status = d.copy(&d_y, y, (size_t)B);
    if (!status) status = softmax_xent_forward(&m, d_loss, d_probs, d_row_loss, d_logits, d_y, B, n_out);
    status = back(status, loss, d_loss, 1);
    return back(status, probs, d_probs, (size_t)B * n_out);
}

int lab_softmax_xent_backward(float *dlogits, const float *probs, const int *y, int B, int n_out) {
    Device d;
    mlp m{}; /* the layer functions use only its stream: here the default one */
    float *d_dlogits = NULL, *d_probs = NULL;
    int *d_y = NULL;
    int status = d.copy(&d_dlogits, (const float *)NULL, (size_t)B * n_out);
    if (!status) status = d.copy(&d_probs, probs, (size_t)B * n_out);
    if (!status) status = d.copy(&d_y, y, (size_t)B);
    if (!status) status = softmax_xent_backward(&m, d_dlogits, d_probs, d_y, B, n_out);
    return back(status, dlogits, d_dlogits, (size_t)B * n_out);
}

int lab_sgd_update(float *p, const float *dp, float lr, size_t n) {
    Device d;
    mlp m{}; /* the layer functions use only its stream: here the default one */
    float *d_p = NULL, *d_dp = NULL;
    int status = d.copy(&d_p, p, n);
    if (!status) status = d.copy(&d_dp, dp, n);
    if (!status) status = sgd_update(&m, d_p, d_dp, lr, n);
    return back(status, p, d_p, n);
}

/* LeNet's convolution, direct (conv2d_forward) or tiled (conv2d_forward_tiled: 5 x 5 filters only). */
int lab_conv2d_forward(float *out, const float *x, const float *w, const float *b, int B, int C, int H, int F, int k,
                       int tiled) {
    if (tiled && k != K) return FAIL(MLP_ERR_ARG, "the tiled convolution takes %d x %d filters, got %d", K, K, k);
    Device d;
    lenet m{}; /* the convolutions use only its stream: here the default one */
    const size_t outputs = (size_t)B * F * (H - k + 1) * (H - k + 1);
    float *d_out = NULL, *d_x = NULL, *d_w = NULL, *d_b = NULL;
    int status = d.copy(&d_out, (const float *)NULL, outputs);
    if (!status) status = d.copy(&d_x, x, (size_t)B * C * H * H);
    if (!status) status = d.copy(&d_w, w, (size_t)F * C * k * k);
    if (!status) status = d.copy(&d_b, b, (size_t)F);
    if (!status)
        status = tiled ? conv2d_forward_tiled(&m, d_out, d_x, d_w, d_b, B, C, H, F)
                       : conv2d_forward(&m, d_out, d_x, d_w, d_b, B, C, H, F, k);
    return back(status, out, d_out, outputs);
}
