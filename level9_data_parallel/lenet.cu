/* level9_data_parallel/lenet.cu - Level 9 on GPUs for LeNet-5: level 6's step, its gradients summed across the GPUs.
 *
 * The MLP's twin (mlp.cu), one network over. Level 6's LeNet-5 keeps all ten gradients in one flat buffer
 * (m->grads), so the installed sum (gradient_sum.h) is handed one gradient of LENET_PARAMS floats: one all-reduce a
 * step. Each step is gather, forward and backward, the sum, then the update, queued on the model's stream.
 *
 * Level 6 replays each whole batch's step as a CUDA graph. So does this file, with the sum inside: the installed sum
 * queues NCCL's all-reduce, and NCCL's calls can be captured into a graph like kernels. NCCL asks one thing of it:
 * every rank captures its all-reduce at the same step, and replays it at the same steps. So the graph is captured
 * afresh at each call (level 9's workers make the same calls, gpu.py), never on one rank alone; and a replay runs the
 * sum's scale it was captured with, which is this call's.
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

/* One whole step on the rows `order` (device, B of them): gather, forward and backward, the sum across GPUs, then
 * the update; the loss to *loss (device). */
static int summed_step(lenet *m, const int *order, int B, float lr, float *loss) {
    int status = gather(&m->base, m->x, m->y, m->data_x, m->data_y, order, B, IMAGE * IMAGE);
    if (!status) status = net_forward_backward(m, loss, m->x, m->y, B);
    if (!status) status = sum_gradients(m, B);
    if (!status) status = sgd_update(&m->base, m->params, m->grads, lr, N_PARAMS);
    return status;
}

/* summed_step for B rows read from s->step_order, captured as a graph into s->step (level 6's fields, remade here at
 * every call; s->step_rows: the rows s->step_order holds). One step runs first outside the capture, all but its
 * update: cuBLAS, cuDNN and NCCL set themselves up on first use, which a capture forbids. */
static int capture_summed_step(lenet *m, const int *order, int B, float lr) {
    cudnn_state *s = state(m);
    if (s->step) CUDA_CHECK(cudaGraphExecDestroy(s->step));
    s->step = NULL;
    if (s->step_rows < B) {
        CUDA_CHECK(free_device({s->step_order}));
        s->step_order = NULL, s->step_rows = 0;
        CUDA_CHECK(device_malloc(&s->step_order, sizeof(int) * (size_t)B));
        s->step_rows = B;
    }
    if (!s->step_loss) CUDA_CHECK(device_malloc(&s->step_loss, sizeof(float)));
    int status = describe(m, B);
    if (!status) status = gather(&m->base, m->x, m->y, m->data_x, m->data_y, order, B, IMAGE * IMAGE);
    if (!status) status = net_forward_backward(m, s->step_loss, m->x, m->y, B);
    if (!status) status = sum_gradients(m, B);
    if (status) return status;
    return capture_graph(m, &s->step, [&] { return summed_step(m, s->step_order, B, lr, s->step_loss); });
}

/* The steps of an epoch. With a sum installed and at least two whole batches, the whole batches replay one captured
 * summed_step: each its rows copied to where the graph reads them, one launch, its loss copied to its place. The rest
 * are queued kernel by kernel: a single whole batch (a capture would cost more than it saves), a final partial batch,
 * and every step when no sum is installed (level 6's step on one GPU, without its graph). */
static int train_steps(lenet *m, int n_order, int batch_size, float lr) {
    if (!installed(m) || !installed(m)->sum) return queue_steps(m, n_order, batch_size, lr);
    const int whole = n_order / batch_size;
    int done = 0;
    if (whole >= 2) {
        cudnn_state *s = state(m);
        const int status = capture_summed_step(m, m->order, batch_size, lr);
        if (status) return status;
        for (; done < whole; done++) {
            CUDA_CHECK(cudaMemcpyAsync(s->step_order, m->order + (size_t)done * batch_size, sizeof(int) * batch_size,
                                       cudaMemcpyDeviceToDevice, m->base.stream));
            CUDA_CHECK(cudaGraphLaunch(s->step, m->base.stream));
            CUDA_CHECK(cudaMemcpyAsync(m->losses + done, s->step_loss, sizeof(float), cudaMemcpyDeviceToDevice,
                                       m->base.stream));
        }
    }
    for (int start = done * batch_size; start < n_order; start += batch_size, done++) {
        const int B = n_order - start < batch_size ? n_order - start : batch_size;
        const int status = summed_step(m, m->order + start, B, lr, m->losses + done);
        if (status) return status;
    }
    return MLP_OK;
}
