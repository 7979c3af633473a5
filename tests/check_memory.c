/* tests/check_memory.c - drives level 4's library through all of mlp.h, including its error paths,
 * so that `make check-memory` can run it under valgrind and under AddressSanitizer + UBSan:
 * no invalid read or write, no use of uninitialized memory, and no leak after a thousand models.
 * Exits 1 when a call returns an unexpected status (the sanitizers report memory errors themselves).
 */
#include "mlp.h"

#include <stdio.h>
#include <stdlib.h>

#define N_IN 784
#define N_OUT 10
#define N 37 /* data rows: not a multiple of the batch, so the last step is partial */

static int failures = 0;

static void expect(int status, int wanted, const char *what) {
    if (status != wanted) {
        printf("not ok: %s returned %d, wanted %d (%s)\n", what, status, wanted, mlp_last_error());
        failures++;
    }
}

/* One model through every call of the interface, with hidden units and batch size given. */
static void exercise(int hidden, int batch) {
    mlp *m = NULL;
    expect(mlp_create(&m, N_IN, hidden, N_OUT), MLP_OK, "create");
    if (!m) return;
    float *w1 = calloc((size_t)hidden * N_IN, sizeof(float)), *b1 = calloc((size_t)hidden, sizeof(float));
    float *w2 = calloc((size_t)N_OUT * hidden, sizeof(float)), *b2 = calloc(N_OUT, sizeof(float));
    float *x = malloc(sizeof(float) * N * N_IN), *logits = malloc(sizeof(float) * N * N_OUT);
    float losses[N], loss;
    int y[N], order[N];
    for (int i = 0; i < hidden * N_IN; i++) w1[i] = (float)((i * 7919) % 101 - 50) / 500.0f;
    for (int i = 0; i < N_OUT * hidden; i++) w2[i] = (float)((i * 104729) % 97 - 48) / 500.0f;
    for (int i = 0; i < N * N_IN; i++) x[i] = (float)(i % 255) / 255.0f;
    for (int i = 0; i < N; i++) y[i] = i % N_OUT, order[i] = (i * 5) % (N - 1);

    expect(mlp_set_params(m, w1, b1, w2, b2), MLP_OK, "set_params");
    expect(mlp_forward(m, logits, x, N), MLP_OK, "forward");
    expect(mlp_loss_and_grads(m, &loss, w1, b1, w2, b2, x, y, N), MLP_OK, "loss_and_grads");
    const size_t layer_floats = (size_t)N * (2 * hidden + N_OUT); /* fc1, its ReLU and fc2 of every row */
    float *outputs = malloc(sizeof(float) * layer_floats), *grads = malloc(sizeof(float) * layer_floats);
    expect(mlp_layers(m, outputs, grads, x, y, N), MLP_OK, "layers");
    expect(mlp_set_data(m, x, y, N), MLP_OK, "set_data");
    expect(mlp_set_data(m, x, y, N - 1), MLP_OK, "set_data again (replaces the first)");
    expect(mlp_train_epoch(m, losses, order, N - 1, batch, 0.01f), MLP_OK, "train_epoch");
    expect(mlp_get_params(m, w1, b1, w2, b2), MLP_OK, "get_params");

    /* Error paths: each must fail cleanly, with a status, and leave the model usable. */
    int bad_y[N];
    for (int i = 0; i < N; i++) bad_y[i] = y[i];
    bad_y[N - 1] = N_OUT;
    expect(mlp_loss_and_grads(m, &loss, w1, b1, w2, b2, x, bad_y, N), MLP_ERR_ARG, "a label out of range");
    expect(mlp_layers(m, outputs, grads, x, bad_y, N), MLP_ERR_ARG, "a label out of range, for the layers");
    expect(mlp_layers(m, outputs, NULL, x, y, N), MLP_ERR_ARG, "layers with a NULL output");
    expect(mlp_set_data(m, x, bad_y, N), MLP_ERR_ARG, "a label out of range in the data set");
    expect(mlp_use_device_data(m, x, y, N), MLP_ERR_ARG, "device arrays, on the CPU level");
    int matmul = -1;
    expect(mlp_set_matmul(m, MLP_MATMUL_LOOPS), MLP_OK, "set_matmul to level 4's own");
    expect(mlp_set_matmul(m, MLP_MATMUL_TILED), MLP_ERR_ARG, "a matrix product level 4 has not");
    expect(mlp_get_matmul(m, &matmul), MLP_OK, "get_matmul");
    if (matmul != MLP_MATMUL_LOOPS) {
        printf("not ok: get_matmul read back %d, wanted level 4's loops (%d)\n", matmul, MLP_MATMUL_LOOPS);
        failures++;
    }
    expect(mlp_get_matmul(m, NULL), MLP_ERR_ARG, "get_matmul with a NULL output");
    order[3] = N;
    expect(mlp_train_epoch(m, losses, order, N, batch, 0.01f), MLP_ERR_ARG, "an order index out of range");
    expect(mlp_train_epoch(m, losses, order, N, 0, 0.01f), MLP_ERR_ARG, "batch size 0");
    expect(mlp_forward(m, logits, x, 0), MLP_ERR_ARG, "forward of 0 rows");
    expect(mlp_forward(m, NULL, x, N), MLP_ERR_ARG, "a NULL output");
    expect(mlp_forward(m, logits, x, N), MLP_OK, "forward after the errors");

    expect(mlp_destroy(m), MLP_OK, "destroy");
    free(w1), free(b1), free(w2), free(b2), free(x), free(logits), free(outputs), free(grads);
}

/* Sizes whose products overflow an int: hidden 100,000 x a batch of 21,476 rows is 2,147,600,000 elements per
 * buffer, past MLP_MAX_ELEMENTS. The library must refuse them with MLP_ERR_ARG before it allocates or writes
 * anything (the outputs here are deliberately tiny: a write would be out of bounds, and ASan would say so), and
 * without signed overflow on the way (UBSan would say so). */
static void huge_sizes(void) {
    enum { HIDDEN = 100000, ROWS = 21476 };
    mlp *m = NULL;
    expect(mlp_create(&m, N_IN, HIDDEN, N_OUT), MLP_OK, "create with hidden 100,000");
    if (!m) return;
    float *x = calloc((size_t)ROWS * N_IN, sizeof(float)), tiny[N_OUT], loss, losses[1];
    int *y = calloc(ROWS, sizeof(int)), *order = malloc(sizeof(int) * ROWS);
    if (x && y && order) {
        for (int i = 0; i < ROWS; i++) order[i] = i;
        expect(mlp_loss_and_grads(m, &loss, tiny, tiny, tiny, tiny, x, y, ROWS), MLP_ERR_ARG, "a batch too large");
        expect(mlp_set_data(m, x, y, ROWS), MLP_OK, "a data set of 21,476 rows");
        expect(mlp_train_epoch(m, losses, order, ROWS, ROWS, 0.01f), MLP_ERR_ARG, "an epoch with a batch too large");
        expect(mlp_train_epoch(m, losses, order, 1, 1, 0.0f), MLP_OK, "a step of one row after the refusals");
    }
    free(x), free(y), free(order);
    expect(mlp_destroy(m), MLP_OK, "destroy");
}

int main(void) {
    mlp *m = NULL;
    expect(mlp_create(&m, N_IN, 0, N_OUT), MLP_ERR_ARG, "create with hidden 0");
    expect(mlp_create(NULL, N_IN, 8, N_OUT), MLP_ERR_ARG, "create into NULL");
    expect(mlp_destroy(NULL), MLP_OK, "destroy NULL");
    float losses[4];
    int order[4] = {0, 1, 2, 3};
    expect(mlp_create(&m, N_IN, 8, N_OUT), MLP_OK, "create");
    expect(mlp_train_epoch(m, losses, order, 4, 2, 0.1f), MLP_ERR_ARG, "train before set_data");
    expect(mlp_destroy(m), MLP_OK, "destroy");

    exercise(37, 13);
    exercise(1, 1);
    exercise(256, 8);
    huge_sizes();
    for (int i = 0; i < 1000; i++) { /* a thousand models: any leak per model adds up */
        expect(mlp_create(&m, N_IN, 16, N_OUT), MLP_OK, "create in a loop");
        expect(mlp_destroy(m), MLP_OK, "destroy in a loop");
    }
    printf("%s: %d unexpected statuses\n", failures ? "FAILED" : "ok", failures);
    return failures ? 1 : 0;
}
