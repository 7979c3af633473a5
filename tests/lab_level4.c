/* tests/lab_level4.c - level 4's layer functions one at a time, for the lab's grader (tests/test_tasks.py).
 *
 * level4_c/mlp.c and lenet.c keep their layer functions static, as a library should. Including lenet.c here (it
 * includes mlp.c) gives each one an exported wrapper with the same arguments, which returns MLP_OK or, when the
 * function is still a student edition's stub, its status (lab_status, common/native/mlp_status.h). So each task is checked alone: a bug in one
 * function cannot fail the check of another. Built by `make build/lab_level4.so`; the Python side reads the
 * declarations between the cdef markers.
 */
#include "../level4_c/lenet.c"

/* cdef-begin */
int lab_linear_forward(float *out, const float *x, const float *w, const float *b, int B, int n_in, int n_out);
int lab_linear_backward(float *dx, float *dw, float *db, const float *dout, const float *x, const float *w, int B,
                        int n_in, int n_out);
int lab_relu_forward(float *a, const float *h, size_t n);
int lab_relu_backward(float *dh, const float *da, const float *h, size_t n);
int lab_softmax_xent_forward(float *loss, float *probs, const float *logits, const int *y, int B, int n_out);
int lab_softmax_xent_backward(float *dlogits, const float *probs, const int *y, int B, int n_out);
int lab_sgd_update(float *p, const float *dp, float lr, size_t n);
int lab_conv2d_forward(float *out, const float *x, const float *w, const float *b, int B, int C, int H, int F, int k);
int lab_conv2d_backward(float *dx, float *dw, float *db, const float *dout, const float *x, const float *w, int B, int C,
                        int H, int F, int k);
int lab_maxpool_forward(float *out, int *choice, const float *a, int B, int C, int H);
int lab_maxpool_backward(float *da, const float *dout, const int *choice, int B, int C, int H);
/* cdef-end */

int lab_linear_forward(float *out, const float *x, const float *w, const float *b, int B, int n_in, int n_out) {
    linear_forward(out, x, w, b, B, n_in, n_out);
    return lab_status();
}

int lab_linear_backward(float *dx, float *dw, float *db, const float *dout, const float *x, const float *w, int B,
                        int n_in, int n_out) {
    linear_backward(dx, dw, db, dout, x, w, B, n_in, n_out);
    return lab_status();
}

int lab_relu_forward(float *a, const float *h, size_t n) {
    relu_forward(a, h, n);
    return lab_status();
}

int lab_relu_backward(float *dh, const float *da, const float *h, size_t n) {
    relu_backward(dh, da, h, n);
    return lab_status();
}

int lab_softmax_xent_forward(float *loss, float *probs, const float *logits, const int *y, int B, int n_out) {
    *loss = softmax_xent_forward(probs, logits, y, B, n_out);
    return lab_status();
}

int lab_softmax_xent_backward(float *dlogits, const float *probs, const int *y, int B, int n_out) {
    softmax_xent_backward(dlogits, probs, y, B, n_out);
    return lab_status();
}

int lab_sgd_update(float *p, const float *dp, float lr, size_t n) {
    sgd_update(p, dp, lr, n);
    return lab_status();
}

int lab_conv2d_forward(float *out, const float *x, const float *w, const float *b, int B, int C, int H, int F, int k) {
    conv2d_forward(out, x, w, b, B, C, H, F, k);
    return lab_status();
}

int lab_conv2d_backward(float *dx, float *dw, float *db, const float *dout, const float *x, const float *w, int B, int C,
                        int H, int F, int k) {
    conv2d_backward(dx, dw, db, dout, x, w, B, C, H, F, k);
    return lab_status();
}

int lab_maxpool_forward(float *out, int *choice, const float *a, int B, int C, int H) {
    maxpool_forward(out, choice, a, B, C, H);
    return lab_status();
}

int lab_maxpool_backward(float *da, const float *dout, const int *choice, int B, int C, int H) {
    maxpool_backward(da, dout, choice, B, C, H);
    return lab_status();
}
