/* level9_data_parallel/gradient_sum.h - what level 9's GPU library adds to mlp.h: a function that the model calls
 * between each step's backward pass and its update, to sum the gradients across GPUs.
 *
 * Implemented by level9_data_parallel/mlp.cu (level 6's MLP, whose epoch it runs with this call added) and loaded by
 * level9_data_parallel/gpu.py through the course's cffi binding, which reads the declarations between the markers.
 */
#ifndef GRADIENT_SUM_H
#define GRADIENT_SUM_H

#include <stddef.h>

#include "mlp.h"

#ifdef __cplusplus
extern "C" {
#endif

/* cdef-begin */
/* Called once per step of mlp_train_epoch, after the backward pass and before the update, with the step's
 * n_gradients (4) gradients - device pointers to dw1, db1, dw2, db2 and their counts of floats - its rows, and the
 * model's cudaStream_t. It queues the sum on that stream, never waits for it, and returns MLP_OK or an error status. */
typedef int (*mlp_gradient_sum)(void *context, float **gradients, const size_t *counts, int n_gradients, int rows,
                                void *stream);
/* Install sum (with the context it is called with) for the model's epochs; NULL: level 6's step, on one GPU. */
int mlp_set_gradient_sum(mlp *m, mlp_gradient_sum sum, void *context);
/* cdef-end */

#ifdef __cplusplus
}
#endif

#endif /* GRADIENT_SUM_H */
