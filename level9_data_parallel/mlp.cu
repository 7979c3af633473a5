/* level9_data_parallel/mlp.cu - Level 9 on GPUs: level 6's step, its gradients summed across the GPUs.
 *
 * Each worker process of level 9 (mlp.py) drives one GPU through this library: level 6's MLP (cuBLAS), unchanged,
 * but for its epoch. Level 6's epoch queues, for every step, gather, forward, backward and update on the model's
 * stream. This one queues one more call between the backward pass and the update: the function installed by
 * mlp_set_gradient_sum (gradient_sum.h), which queues NCCL's all-reduce of the four gradients on the same stream
 * (level9_data_parallel/nccl.py). The stream keeps the order: the sum starts once the backward pass has written the
 * gradients, and the update reads the sum. The host never waits inside an epoch, as at level 6.
 *
 * Build: `make level9`; test: `pytest -m level9` (the GPU tests on a machine with two GPUs).
 */
#define LEVEL_TRAINS_ITS_OWN_EPOCH /* train_steps and free_epoch_state below */
#include "../level6_cublas/mlp.cu"

#include "gradient_sum.h"

#include <cstdlib>

/* The installed sum and its context, kept in the model's m->epoch_state. */
struct gradient_sum {
    mlp_gradient_sum sum;
    void *context;
};

static gradient_sum *installed(mlp *m) { return static_cast<gradient_sum *>(m->epoch_state); }

int mlp_set_gradient_sum(mlp *m, mlp_gradient_sum sum, void *context) {
    if (!m) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (!m->epoch_state) {
        m->epoch_state = calloc(1, sizeof(gradient_sum));
        if (!m->epoch_state) return FAIL(MLP_ERR_ALLOC, "out of memory for the gradient sum");
    }
    installed(m)->sum = sum, installed(m)->context = context;
    return MLP_OK;
}

/* Queue the sum of this step's gradients (its B rows) across the GPUs, on the model's stream. */
static int sum_gradients(mlp *m, int B) {
    gradient_sum *g = installed(m);
    float *gradients[4] = {m->dw1, m->db1, m->dw2, m->db2};
    const size_t counts[4] = {(size_t)m->hidden * m->n_in, (size_t)m->hidden, (size_t)m->n_out * m->hidden,
                              (size_t)m->n_out};
    const int status = g->sum(g->context, gradients, counts, 4, B, m->stream);
    if (status == MLP_OK) return MLP_OK;
    return FAIL(status == MLP_ERR_ARG || status == MLP_ERR_ALLOC ? status : MLP_ERR_DEVICE,
                "the gradient sum (mlp_set_gradient_sum's function) failed with status %d", status);
}

/* The steps of an epoch: level 6's (queue_steps) when no sum is installed; else each step's gather, forward and
 * backward, the sum across GPUs, then the update. */
static int train_steps(mlp *m, int n_order, int batch_size, float lr) {
    if (!installed(m) || !installed(m)->sum) return queue_steps(m, n_order, batch_size, lr);
    for (int start = 0, step = 0; start < n_order; start += batch_size, step++) {
        const int B = n_order - start < batch_size ? n_order - start : batch_size;
        int status = gather(m, m->x, m->y, m->data_x, m->data_y, m->order + start, B, m->n_in);
        if (!status) status = forward_backward(m, m->losses + step, m->x, m->y, B);
        if (!status) status = sum_gradients(m, B);
        if (!status) status = sgd_update(m, m->w1, m->dw1, lr, (size_t)m->hidden * m->n_in);
        if (!status) status = sgd_update(m, m->b1, m->db1, lr, (size_t)m->hidden);
        if (!status) status = sgd_update(m, m->w2, m->dw2, lr, (size_t)m->n_out * m->hidden);
        if (!status) status = sgd_update(m, m->b2, m->db2, lr, (size_t)m->n_out);
        if (status) return status;
    }
    return MLP_OK;
}

static int free_epoch_state(mlp *m) {
    free(m->epoch_state);
    m->epoch_state = NULL;
    return MLP_OK;
}
