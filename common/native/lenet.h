/* lenet.h - the native interface of LeNet-5 (common/nets/lenet.py), implemented by level4_c/lenet.c and
 * level5_cuda_naive/lenet.cu, and loaded by the same binding as mlp.h (common/native/__init__.py), which reads the declarations between the cdef markers below.
 *
 * One header per network, each the other's twin: the same calls with the same arguments, the same status codes and
 * mlp_last_error() (mlp_status.h). So mlp.h, which four levels implement, stays as it is, and a diff of the two
 * headers shows only what a second network changes: one flat buffer for its ten parameters, in the order of
 * common/nets/lenet.py's PARAM_NAMES and PyTorch's layouts, instead of four pointers; and lenet_layers, every layer's
 * output and gradient for the verifier's per-layer check.
 *
 * x (n, 784) row-major float32, read as (n, 1, 28, 28); y (n,) int32 labels in [0, 10).
 */
#ifndef LENET_H
#define LENET_H

#include "mlp.h"

#ifdef __cplusplus
extern "C" {
#endif

/* cdef-begin */
typedef struct lenet lenet; /* opaque: parameters, gradients, every layer's buffers, the data set */

#define LENET_PARAMS 44426      /* the floats of the flat parameter buffer */
#define LENET_ACTIVATIONS 10498 /* the floats of one image's layer outputs, conv1 to fc3 (common.nets.lenet.ACTIVATIONS) */
#define LENET_ROW_FLOATS 45780  /* the floats a batch's buffers take per image (at most MLP_MAX_ELEMENTS in all) */

/* A new model with zeroed parameters; *out is set on success. */
int lenet_create(lenet **out);
/* Frees everything the model owns; NULL is allowed. */
int lenet_destroy(lenet *m);

/* Copy the parameters in and out: params (LENET_PARAMS), PARAM_NAMES' order, PyTorch layouts. */
int lenet_set_params(lenet *m, const float *params);
int lenet_get_params(lenet *m, float *params);

/* How a level computes its convolutions; each level has LENET_DIRECT (the default) and one more, the lesson of its
 * level: level 4 LENET_IM2COL (patches as rows, then the MLP's matrix product), level 5 LENET_TILED (shared memory).
 * Another is refused with MLP_ERR_ARG. */
#define LENET_DIRECT 0
#define LENET_IM2COL 1
#define LENET_TILED 2
int lenet_set_convolution(lenet *m, int convolution);
/* The convolution the model computes with, read back from the model (*convolution: LENET_DIRECT, ...). */
int lenet_get_convolution(lenet *m, int *convolution);

/* logits (n, 10) = forward(x (n, 784)). */
int lenet_forward(lenet *m, float *logits, const float *x, int n);

/* Mean cross-entropy of one batch and its gradients, grads (LENET_PARAMS) like params; parameters unchanged. */
int lenet_loss_and_grads(lenet *m, float *loss, float *grads, const float *x, const int *y, int n);

/* Every layer's output for a batch, and the gradient of the mean loss with respect to it: outputs and grads
 * (n * LENET_ACTIVATIONS) hold layer after layer, each (n, its size). Parameters unchanged. */
int lenet_layers(lenet *m, float *outputs, float *grads, const float *x, const int *y, int n);

/* Inference as a server runs it: a batch loaded once, then its forward run again and again. The GPU levels keep the
 * batch on the device and replay its forward as one CUDA graph, captured on the batch's first run.
 * lenet_infer_load copies x (n, 784) into the model; lenet_infer_run runs its forward and returns when it is done,
 * copying the logits (n, 10) out unless logits is NULL; lenet_infer_layers gives every layer's output of the loaded
 * batch (n * LENET_ACTIVATIONS, lenet_layers' order). Other calls in between leave the loaded batch as it was. */
int lenet_infer_load(lenet *m, const float *x, int n);
int lenet_infer_run(lenet *m, float *logits);
int lenet_infer_layers(lenet *m, float *outputs);

/* Copy a training set into the model. */
int lenet_set_data(lenet *m, const float *x, const int *y, int n);

/* One epoch of SGD over the stored data set, visiting rows order[0..n_order) in batches of batch_size (a final
 * partial batch is a smaller step); losses (ceil(n_order / batch_size),) gets each step's loss before its update. */
int lenet_train_epoch(lenet *m, float *losses, const int *order, int n_order, int batch_size, float lr);
/* cdef-end */

#ifdef __cplusplus
}
#endif

/* For the levels' code: the network's sizes, where each parameter starts in the flat buffer, and one image's
 * layer outputs in lenet_layers' order (h: a layer's output before its ReLU, a: after, p: after pooling). */
enum { IMAGE = 28, K = 5, C1 = 6, S1 = 24, P1 = 12, C2 = 16, S2 = 8, P2 = 4, F1 = 120, F2 = 84, OUT = 10 };
enum { FLAT = C2 * P2 * P2 }; /* 256: pool2 flattened, channel, row, column */
enum {
    W1 = 0, B1 = W1 + C1 * K * K, W2 = B1 + C1, B2 = W2 + C2 * C1 * K * K, W3 = B2 + C2, B3 = W3 + F1 * FLAT,
    W4 = B3 + F1, B4 = W4 + F2 * F1, W5 = B4 + F2, B5 = W5 + OUT * F2, N_PARAMS = B5 + OUT
};
enum { H1 = C1 * S1 * S1, POOL1 = C1 * P1 * P1, H2 = C2 * S2 * S2, POOL2 = FLAT };
#ifdef __cplusplus
static_assert(N_PARAMS == LENET_PARAMS, "the parameter offsets add up to LENET_PARAMS");
static_assert(2 * H1 + POOL1 + 2 * H2 + POOL2 + 2 * F1 + 2 * F2 + OUT == LENET_ACTIVATIONS, "LENET_ACTIVATIONS");
#else
_Static_assert(N_PARAMS == LENET_PARAMS, "the parameter offsets add up to LENET_PARAMS");
_Static_assert(2 * H1 + POOL1 + 2 * H2 + POOL2 + 2 * F1 + 2 * F2 + OUT == LENET_ACTIVATIONS, "LENET_ACTIVATIONS");
#endif

#endif /* LENET_H */
