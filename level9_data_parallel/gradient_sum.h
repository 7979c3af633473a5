/* level9_data_parallel/gradient_sum.h - what level 9's GPU libraries add to mlp.h and lenet.h: a function that the
 * model calls between each step's backward pass and its update, to sum the gradients across GPUs.
 *
 * Implemented by level9_data_parallel/mlp.cu and lenet.cu (level 6's MLP and LeNet-5, whose epochs they run with this
 * call added) and loaded by level9_data_parallel/gpu.py through the course's cffi binding, which reads the
 * declarations between the markers.
 */
#ifndef GRADIENT_SUM_H
#define GRADIENT_SUM_H

#include <stddef.h>

#include "lenet.h"
#include "mlp.h"

#ifdef __cplusplus
extern "C" {
#endif

/* cdef-begin */
/* Called once per step of mlp_train_epoch (lenet_train_epoch), after the backward pass and before the update, with
 * the step's n_gradients gradients - device pointers and their counts of floats: the MLP's dw1, db1, dw2 and db2,
 * LeNet-5's one flat buffer of LENET_PARAMS - its rows, and the model's cudaStream_t. It queues the sum on that
 * stream, never waits for it, and returns MLP_OK or an error status. */
typedef int (*mlp_gradient_sum)(void *context, float **gradients, const size_t *counts, int n_gradients, int rows,
                                void *stream);
/* Install sum (with the context it is called with) for the model's epochs; NULL: level 6's step on one GPU (for
 * LeNet-5, without level 6's graph). */
int mlp_set_gradient_sum(mlp *m, mlp_gradient_sum sum, void *context);
int lenet_set_gradient_sum(lenet *m, mlp_gradient_sum sum, void *context);
/* cdef-end */

#ifdef __cplusplus
}
#endif

#endif /* GRADIENT_SUM_H */
