/* level9_data_parallel/lenet.cu - Level 9 on GPUs for LeNet-5: level 6's step, its gradients summed across the GPUs.
 *
 * The MLP's twin (mlp.cu), one network over. Level 6's LeNet-5 keeps all ten gradients in one flat buffer
 * (m->grads), so the installed sum (gradient_sum.h) is handed one gradient of LENET_PARAMS floats: one all-reduce a
 * step. Each step is gather, forward and backward, the sum, then the update, queued on the model's stream.
 *
 * Level 6 replays each whole batch's step as a CUDA graph; this file leaves that out (LENET_FUSED_STEP, as level 7
 * does) and queues the steps one kernel after another, as level 5 does. The sum is a Python function (gpu.py) that
 * queues NCCL's all-reduce, and a graph replays only GPU work, never a call back into Python.
 *
 * Build: `make level9` (with cuDNN, as level 6's LeNet-5); test: `pytest -m level9` on a machine with two GPUs.
 */
#define LENET_FUSED_STEP /* level 6's captured step left out: train_steps below replaces it */
#define lenet_destroy level6_lenet_destroy /* renamed: lenet_destroy below frees the sum, then calls it */
#include "../level6_cublas/lenet.cu"
#undef lenet_destroy

#include "gradient_sum.h"

#include <cstdlib>

/* The installed sum and its context, kept in the model's m->base.epoch_state (which level 6's LeNet-5 leaves
 * unused). */
struct gradient_sum {
    mlp_gradient_sum sum;
    void *context;
};

static gradient_sum *installed(lenet *m) { return static_cast<gradient_sum *>(m->base.epoch_state); }

int lenet_set_gradient_sum(lenet *m, mlp_gradient_sum sum, void *context) {
    if (!m) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (!installed(m)) {
        m->base.epoch_state = calloc(1, sizeof(gradient_sum));
        if (!installed(m)) return FAIL(MLP_ERR_ALLOC, "out of memory for the gradient sum");
    }
    installed(m)->sum = sum, installed(m)->context = context;
    return MLP_OK;
}

extern "C" int lenet_destroy(lenet *m) {
    if (m) free(m->base.epoch_state), m->base.epoch_state = NULL;
    return level6_lenet_destroy(m);
}

/* Queue the sum of this step's gradients (its B rows) across the GPUs, on the model's stream. */
static int sum_gradients(lenet *m, int B) {
    const gradient_sum *g = installed(m);
    float *gradients[1] = {m->grads};
    const size_t counts[1] = {N_PARAMS};
    const int status = g->sum(g->context, gradients, counts, 1, B, m->base.stream);
    if (status == MLP_OK) return MLP_OK;
    return FAIL(status == MLP_ERR_ARG || status == MLP_ERR_ALLOC ? status : MLP_ERR_DEVICE,
                "the gradient sum (lenet_set_gradient_sum's function) failed with status %d", status);
}

/* The steps of an epoch, each its gather, forward and backward, the sum across GPUs (when one is installed), then
 * the update. */
static int train_steps(lenet *m, int n_order, int batch_size, float lr) {
    const bool summed = installed(m) && installed(m)->sum;
    for (int start = 0, step = 0; start < n_order; start += batch_size, step++) {
        const int B = n_order - start < batch_size ? n_order - start : batch_size;
        int status = gather(&m->base, m->x, m->y, m->data_x, m->data_y, m->order + start, B, IMAGE * IMAGE);
        if (!status) status = net_forward_backward(m, m->losses + step, m->x, m->y, B);
        if (!status && summed) status = sum_gradients(m, B);
        if (!status) status = sgd_update(&m->base, m->params, m->grads, lr, N_PARAMS);
        if (status) return status;
    }
    return MLP_OK;
}
