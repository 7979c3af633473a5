/* lenet.h - the native interface of LeNet-5 (common/lenet.py), implemented by level4_c/lenet.c and loaded by the
 * same binding as mlp.h (common/native.py), which reads the declarations between the cdef markers below.
 *
 * One header per network, each the other's twin: the same calls with the same arguments, the same status codes and
 * mlp_last_error() (mlp_status.h). So mlp.h, which four levels implement, stays as it is, and a diff of the two
 * headers shows only what a second network changes: one flat buffer for its ten parameters, in the order of
 * common/lenet.py's PARAM_NAMES and PyTorch's layouts, instead of four pointers; and lenet_layers, every layer's
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
#define LENET_ACTIVATIONS 10498 /* the floats of one image's layer outputs, conv1 to fc3 (common.lenet.ACTIVATIONS) */
#define LENET_ROW_FLOATS 45780  /* the floats a batch's buffers take per image (at most MLP_MAX_ELEMENTS in all) */

/* A new model with zeroed parameters; *out is set on success. */
int lenet_create(lenet **out);
/* Frees everything the model owns; NULL is allowed. */
int lenet_destroy(lenet *m);

/* Copy the parameters in and out: params (LENET_PARAMS), PARAM_NAMES' order, PyTorch layouts. */
int lenet_set_params(lenet *m, const float *params);
int lenet_get_params(lenet *m, float *params);

/* 0: the convolutions as direct loops (the default); 1: as im2col and the MLP's matrix-product loops. */
int lenet_set_convolution(lenet *m, int im2col);

/* logits (n, 10) = forward(x (n, 784)). */
int lenet_forward(lenet *m, float *logits, const float *x, int n);

/* Mean cross-entropy of one batch and its gradients, grads (LENET_PARAMS) like params; parameters unchanged. */
int lenet_loss_and_grads(lenet *m, float *loss, float *grads, const float *x, const int *y, int n);

/* Every layer's output for a batch, and the gradient of the mean loss with respect to it: outputs and grads
 * (n * LENET_ACTIVATIONS) hold layer after layer, each (n, its size). Parameters unchanged. */
int lenet_layers(lenet *m, float *outputs, float *grads, const float *x, const int *y, int n);

/* Copy a training set into the model. */
int lenet_set_data(lenet *m, const float *x, const int *y, int n);

/* One epoch of SGD over the stored data set, visiting rows order[0..n_order) in batches of batch_size (a final
 * partial batch is a smaller step); losses (ceil(n_order / batch_size),) gets each step's loss before its update. */
int lenet_train_epoch(lenet *m, float *losses, const int *order, int n_order, int batch_size, float lr);
/* cdef-end */

#ifdef __cplusplus
}
#endif

#endif /* LENET_H */
