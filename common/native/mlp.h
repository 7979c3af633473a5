/* mlp.h - the one native interface of the MLP, implemented by
 *   level4_c/mlp.c           (plain C, on the CPU)
 *   level5_cuda_naive/mlp.cu (hand-written CUDA kernels)
 *   level6_cublas/mlp.cu     (cuBLAS GEMMs)
 *   level7_fused/mlp.cu      (one fused kernel per epoch)
 * and loaded by one Python binding, common/native (cffi, ABI mode), which reads the
 * declarations between the cdef markers below, so Python and C cannot drift apart.
 *
 * Layouts are PyTorch's, row-major float32: fc1.weight (hidden, 784), fc1.bias (hidden,),
 * fc2.weight (10, hidden), fc2.bias (10,); x (n, 784); y (n,) int32 labels in [0, 10).
 * Pointers are host pointers; a GPU level copies in and out itself. The one exception is mlp_use_device_data's:
 * device pointers, which a GPU level reads in place.
 * Every function returns MLP_OK or an error status; mlp_last_error() then says what failed
 * (which call, file and line). Nothing prints, nothing exits.
 */
#ifndef MLP_H
#define MLP_H

#ifdef __cplusplus
extern "C" {
#endif

/* cdef-begin */
typedef struct mlp mlp; /* opaque: parameters, gradients, activations, the data set */

#define MLP_OK 0
#define MLP_ERR_ARG 1    /* a bad argument (NULL, a size out of range, a label out of range) */
#define MLP_ERR_ALLOC 2  /* out of memory, host or device */
#define MLP_ERR_DEVICE 3 /* a CUDA or cuBLAS call failed, or there is no GPU */

/* The most elements one per-batch buffer may hold (rows x 784, or rows x hidden): 2^31 - 1, 8 GiB of
 * float32. Sizes are computed in size_t throughout; this limit keeps every count a kernel's 32-bit
 * grid arithmetic or a C int can meet in range, and a larger batch is refused with MLP_ERR_ARG. */
#define MLP_MAX_ELEMENTS 2147483647

/* The message of the last failed call on this thread. */
const char *mlp_last_error(void);

/* A new model for 784 -> hidden -> 10 with zeroed parameters; *out is set on success. */
int mlp_create(mlp **out, int n_in, int hidden, int n_out);
/* Frees everything the model owns; NULL is allowed. */
int mlp_destroy(mlp *m);

/* Copy parameters in and out, PyTorch layouts. */
int mlp_set_params(mlp *m, const float *w1, const float *b1, const float *w2, const float *b2);
int mlp_get_params(mlp *m, float *w1, float *b1, float *w2, float *b2);

/* logits (n, 10) = forward(x (n, 784)). */
int mlp_forward(mlp *m, float *logits, const float *x, int n);

/* Mean cross-entropy of one batch and its gradients (PyTorch layouts); parameters unchanged. */
int mlp_loss_and_grads(mlp *m, float *loss, float *dw1, float *db1, float *dw2, float *db2,
                       const float *x, const int *y, int n);

/* Every layer's output for a batch, and the gradient of the mean loss with respect to it, for the verifier's
 * per-layer check: outputs and grads (n * (2 * hidden + 10)) hold fc1 (n, hidden), its ReLU (n, hidden) and fc2
 * (n, 10), one after the other (common.nets.mlp.ACTIVATIONS). Parameters unchanged. */
int mlp_layers(mlp *m, float *outputs, float *grads, const float *x, const int *y, int n);

/* How a level computes its matrix products, numbered as the kernels of level 5's lesson, cuBLAS first as the
 * reference they are measured against (common/harness/matmul_kernels.py). Each level has its own: level 4 loops in C,
 * level 5 kernels 1 to 3 (naive by default), levels 6 and 7 cuBLAS (level 7's fused epoch: its own, in its kernel).
 * One the level has not is refused with MLP_ERR_ARG. */
#define MLP_MATMUL_CUBLAS 0  /* kernel 0: cuBLAS's sgemm, the reference */
#define MLP_MATMUL_NAIVE 1   /* kernel 1: one thread per output, its row and column read from global memory */
#define MLP_MATMUL_TILED 2   /* kernel 2: a block stages tiles of both operands in shared memory */
#define MLP_MATMUL_BLOCKED 3 /* kernel 3: each thread a block of outputs, from registers fed by shared memory */
#define MLP_MATMUL_LOOPS 4   /* level 4's loops in C, on the CPU */
int mlp_set_matmul(mlp *m, int matmul);
/* The matrix product the model computes with, read back from the model (*matmul: MLP_MATMUL_NAIVE, ...). */
int mlp_get_matmul(mlp *m, int *matmul);

/* Copy a training set into the model (on a GPU: upload it once, for many epochs). */
int mlp_set_data(mlp *m, const float *x, const int *y, int n);

/* Train on the caller's device arrays x (n, 784) and y (n,) from now on, without a copy (the GPU levels): the model
 * keeps the two pointers and never frees them; they must live as long as it trains on them. It first waits for the
 * whole device (a writer on any stream has finished), then checks on the device that every label is in [0, 10) and
 * every x finite. Call it again after changing the arrays, before the next epoch: the labels index memory, and are
 * trusted only as checked here. x must be 16-byte aligned. Level 4, on the CPU, refuses with MLP_ERR_ARG. */
int mlp_use_device_data(mlp *m, const float *x, const int *y, int n);

/* One epoch of SGD over the stored data set, visiting rows order[0..n_order) in batches of
 * batch_size (a final partial batch is a smaller step). losses (ceil(n_order / batch_size),)
 * receives each step's mean loss, taken before that step's update. */
int mlp_train_epoch(mlp *m, float *losses, const int *order, int n_order, int batch_size, float lr);

/* The device buffers this library holds now, all its models together (0 on the CPU): a freed model gives back all. */
long long mlp_device_buffers(void);
/* cdef-end */

#ifdef __cplusplus
}
#endif

#endif /* MLP_H */
