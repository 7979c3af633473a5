/* tests/lab_memory.c - level 4's memory functions, lab tasks 4.8 and 4.9, for the lab's grader (tests/test_tasks.py).
 *
 *     build/lab_memory batch    ensure_capacity and free_batch_buffers (4.8)
 *     build/lab_memory model    mlp_create and mlp_destroy (4.9)
 *
 * Built with AddressSanitizer + UBSan (`make build/lab_memory`): every buffer is written to its full size, so one
 * allocated too small is reported, and LeakSanitizer reports whatever was not freed. Each part builds its model by
 * hand where it can, so that it checks its own task's functions only. Prints one line per wrong result and exits 1
 * (the sanitizers stop the program themselves). Its verdict, "lab_memory <part>: ok", goes where LAB_VERDICT_FD
 * says (a teacher's grade gives it a pipe of its own): the code under check never writes there, so nothing it
 * prints can pass for the verdict.
 */
#define _POSIX_C_SOURCE 200809L /* dprintf */
#include "../level4_c/mlp.c"

#include <sanitizer/lsan_interface.h>
#include <stdio.h>
#include <stdlib.h>

static int failures = 0;

static void expect(int ok, const char *what) {
    if (!ok) {
        printf("%s\n", what);
        failures++;
    }
}

/* Write n floats (or ints): out of bounds, ASan stops the program and says where. */
static void fill(float *p, size_t n) {
    for (size_t i = 0; i < n; i++) p[i] = 1.0f;
}

static void fill_int(int *p, size_t n) {
    for (size_t i = 0; i < n; i++) p[i] = 1;
}

static int all_zero(const float *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != 0.0f) return 0;
    return 1;
}

/* 4.8: the batch buffers hold the rows asked for, grow only when a larger batch arrives, and are all freed. */
static void batch_buffers(void) {
    mlp m = {0};
    m.n_in = 784, m.hidden = 37, m.n_out = 10;
    const int rows[] = {1, 13, 5, 1030, 64};
    for (size_t i = 0; i < sizeof rows / sizeof *rows; i++) {
        const int r = rows[i];
        const float *before = m.x;
        const int grew = r > m.capacity;
        if (ensure_capacity(&m, r) != MLP_OK || lab_status() != MLP_OK) {
            printf("ensure_capacity(%d rows) failed: %s\n", r, mlp_last_error());
            failures++;
            break;
        }
        expect(m.capacity >= r, "ensure_capacity left a capacity below the rows asked for");
        expect(grew || m.x == before, "ensure_capacity reallocated for a batch that fitted: buffers only grow");
        fill(m.x, (size_t)r * m.n_in), fill_int(m.y, (size_t)r);
        fill(m.h, (size_t)r * m.hidden), fill(m.a, (size_t)r * m.hidden);
        fill(m.dh, (size_t)r * m.hidden), fill(m.da, (size_t)r * m.hidden);
        fill(m.logits, (size_t)r * m.n_out), fill(m.dlogits, (size_t)r * m.n_out);
    }
    free_batch_buffers(&m);
    expect(lab_status() == MLP_OK, mlp_last_error());
    expect(!m.x && !m.y && !m.h && !m.a && !m.dh && !m.da && !m.logits && !m.dlogits,
           "free_batch_buffers left a pointer that is not NULL");
    expect(m.capacity == 0, "free_batch_buffers left a capacity");
    m.hidden = 100000; /* 21,476 rows of it are past MLP_MAX_ELEMENTS: refused before anything is allocated */
    expect(ensure_capacity(&m, 21476) == MLP_ERR_ARG, "ensure_capacity did not refuse a batch past MLP_MAX_ELEMENTS");
    expect(m.capacity == 0 && !m.x, "ensure_capacity allocated for a refused batch");
    free_batch_buffers(&m);
}

/* 4.9: a model holds its sizes and zeroed parameters and gradients of the full sizes, and mlp_destroy frees it all. */
static void model(void) {
    const int hidden[] = {1, 37, 256};
    for (size_t i = 0; i < sizeof hidden / sizeof *hidden; i++) {
        const int H = hidden[i];
        mlp *m = NULL;
        if (mlp_create(&m, 784, H, 10) != MLP_OK || !m) {
            printf("mlp_create(hidden %d) failed: %s\n", H, mlp_last_error());
            failures++;
            return;
        }
        expect(m->n_in == 784 && m->hidden == H && m->n_out == 10, "mlp_create did not record the sizes");
        const size_t n_w1 = (size_t)H * 784, n_w2 = (size_t)10 * H;
        expect(all_zero(m->w1, n_w1) && all_zero(m->b1, H) && all_zero(m->w2, n_w2) && all_zero(m->b2, 10),
               "mlp_create's parameters are not zero");
        expect(all_zero(m->dw1, n_w1) && all_zero(m->db1, H) && all_zero(m->dw2, n_w2) && all_zero(m->db2, 10),
               "mlp_create's gradients are not zero");
        fill(m->w1, n_w1), fill(m->b1, H), fill(m->w2, n_w2), fill(m->b2, 10);
        fill(m->dw1, n_w1), fill(m->db1, H), fill(m->dw2, n_w2), fill(m->db2, 10);
        expect(m->capacity == 0 && !m->x && !m->data_x, "mlp_create made batch buffers or a data set: they come later");
        float x[2 * 784] = {0};
        const int y[2] = {3, 7};
        expect(mlp_set_data(m, x, y, 2) == MLP_OK, "mlp_set_data failed on a new model");
        m->x = malloc(sizeof(float) * 784), m->capacity = 1; /* batch buffers, as ensure_capacity would leave them */
        expect(mlp_destroy(m) == MLP_OK, mlp_last_error());
    }
}

int main(int argc, char **argv) {
    if (argc != 2 || (strcmp(argv[1], "batch") && strcmp(argv[1], "model"))) {
        printf("usage: %s batch|model\n", argv[0]);
        return 2;
    }
    if (!strcmp(argv[1], "batch")) batch_buffers();
    else model();
    /* LeakSanitizer's check now, not at exit: its result is part of the verdict */
    const int leaked = __lsan_do_recoverable_leak_check();
    printf("%s: %d unexpected results%s\n", argv[1], failures, leaked ? ", and memory leaked" : "");
    const char *verdict = getenv("LAB_VERDICT_FD");
    if (verdict && !failures && !leaked) dprintf(atoi(verdict), "lab_memory %s: ok\n", argv[1]);
    return failures || leaked ? 1 : 0;
}
