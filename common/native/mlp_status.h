/* mlp_status.h - how every implementation of mlp.h reports failure, written once for C and CUDA:
 * a status code returned, and a message kept per thread for mlp_last_error(), with the file and
 * line that failed. Also the checks of host data that every level makes before it trusts it.
 * Included by level4_c/mlp.c and common/native/cuda_mlp.cuh (once per library).
 */
#ifndef MLP_STATUS_H
#define MLP_STATUS_H

#include "mlp.h"

#include <stdarg.h>
#include <stdio.h>

#ifdef __cplusplus
#define MLP_THREAD_LOCAL thread_local
#else
#define MLP_THREAD_LOCAL _Thread_local
#endif

static MLP_THREAD_LOCAL char last_error[512];

const char *mlp_last_error(void) { return last_error; }

static int fail(int status, const char *file, int line, const char *fmt, ...) {
    va_list args;
    const int len = snprintf(last_error, sizeof last_error, "%s:%d: ", file, line);
    if (len < 0 || (size_t)len >= sizeof last_error) return status; /* the location alone filled the buffer */
    va_start(args, fmt);
    vsnprintf(last_error + len, sizeof last_error - (size_t)len, fmt, args);
    va_end(args);
    return status;
}
/* return FAIL(MLP_ERR_ARG, "n must be >= 1, got %d", n); records where and why, returns the status. */
#define FAIL(status, ...) fail(status, __FILE__, __LINE__, __VA_ARGS__)

/* The labs (LABS.md): `make lab` replaces each function a student writes by a stub that fails clearly. A stub
 * that returns a status returns FAIL(MLP_ERR_ARG, "lab 4.2: linear_backward is not written yet"); one in a void
 * function calls LAB_TODO with that message instead, and the mlp.h function it ran under returns the error through
 * lab_status(). A stub of a device function, which cannot report, defines LAB_TODO_DEVICE to its message, for the
 * host code that launches it (level 7's train_steps). In the complete code nothing is pending: lab_status() is
 * MLP_OK. */
static MLP_THREAD_LOCAL int lab_todo;
#define LAB_TODO(message) (lab_todo = FAIL(MLP_ERR_ARG, "%s", message))

/* MLP_ERR_ARG when a stub ran since the last call (mlp_last_error() names it), else MLP_OK; then clears it. */
static inline int lab_status(void) {
    const int status = lab_todo;
    lab_todo = MLP_OK;
    return status;
}

/* A per-batch buffer of rows x width elements must stay within MLP_MAX_ELEMENTS (mlp.h). */
static inline int check_elements(int rows, int width) {
    if ((size_t)rows * (size_t)width > (size_t)MLP_MAX_ELEMENTS)
        return FAIL(MLP_ERR_ARG, "a batch of %d rows x %d values is %zu elements, more than the %d a buffer may hold",
                    rows, width, (size_t)rows * (size_t)width, MLP_MAX_ELEMENTS);
    return MLP_OK;
}

/* Labels y (n) must be classes in [0, n_out): an out-of-range label would index past a row. */
static inline int check_labels(const int *y, int n, int n_out) {
    for (int i = 0; i < n; i++)
        if (y[i] < 0 || y[i] >= n_out) return FAIL(MLP_ERR_ARG, "label y[%d] = %d is outside [0, %d)", i, y[i], n_out);
    return MLP_OK;
}

/* An epoch's arguments: a data set to train on, sizes >= 1, and an order (n_order) whose every
 * entry indexes a row of the data set (n_data). */
static inline int check_epoch(const int *order, int n_order, int batch_size, int n_data) {
    if (n_data < 1) return FAIL(MLP_ERR_ARG, "no data set: call mlp_set_data first");
    if (n_order < 1 || batch_size < 1)
        return FAIL(MLP_ERR_ARG, "n_order and batch_size must be >= 1, got %d and %d", n_order, batch_size);
    for (int i = 0; i < n_order; i++)
        if (order[i] < 0 || order[i] >= n_data)
            return FAIL(MLP_ERR_ARG, "order[%d] = %d is outside [0, %d)", i, order[i], n_data);
    return MLP_OK;
}

#endif /* MLP_STATUS_H */
