/* level7_fused/mlp.cu - Level 7: one fused, persistent kernel for all the steps of an epoch.
 *
 * What this level adds over level 6: at the chapter's sizes a step is 6.5 MFLOP, a fraction of a
 * microsecond of the GPU's arithmetic, yet level 6 spends tens of microseconds on it: ~19 kernel
 * launches, each waiting for the one before. Here the steps of an epoch run inside ONE launch:
 *   - G blocks, all resident at once (a cooperative launch guarantees it), each owning U consecutive
 *     hidden units: their rows of fc1.weight, their fc1.bias entries and their columns of fc2.weight
 *     stay in shared memory for the whole launch, and no other block ever touches them. Every block
 *     keeps its own copy of fc2.bias (10 numbers) and updates it identically.
 *   - Per step, each block computes its units' pre-activations for the batch and their share of the
 *     logits (partial logits: sum over its own units of a[r, j] * fc2.weight[o, j]) and writes it to
 *     the exchange buffer. One grid-wide barrier. Then every block sums the G shares in one fixed
 *     order, block 0 first, so all blocks hold bit-identical logits, softmax and dlogits, and each
 *     does the backward of its own units and the SGD update of the weights it owns.
 *   - The exchange buffer is double-buffered by the step's parity: a fast block may write step k+1's
 *     shares while a slow one still reads step k's, so one barrier per step suffices.
 * No atomics touch a number (only the barrier's counter), and every sum has one fixed order: reruns
 * are bit-identical. FP32 throughout, no TF32.
 *
 * For a large batch the G x B shares are too many for every block to read: then the blocks split the
 * rows, each reducing and soft-maxing its share of them, and a second barrier hands the dlogits round.
 * When a size does not fit on chip (units per block past 16, or shared memory), the epoch runs level
 * 6's queued kernels instead: correct, slower; mlp_fused_plan() says which, and the Python side warns.
 *
 * Everything else - forward(), loss_and_grads(), the data set, the parameters - is level 6's: this
 * file includes it and replaces only the steps of an epoch (train_steps in common/cuda_mlp.cuh).
 * Build: `make level7`; test: `pytest -m level7` (on a GPU machine: `make test-gpu`).
 * Tuning knob for measurements: MLP_FUSED_UNITS=n sets the units per block (default below).
 */
#define LEVEL_TRAINS_ITS_OWN_EPOCH
#include "../level6_cublas/mlp.cu"

#include <cstdio>
#include <cuda/atomic>
#include <cuda_pipeline.h>

#define FUSED_THREADS 512 /* threads per block: 16 warps */
#define MAX_UNITS 16      /* units per block the kernel is instantiated for (1, 2, 4, 8, 16) */
#define MIN_UNITS 8       /* fewer blocks with more units each: a cheaper barrier, still work for all */
#define TILE_ROWS 32      /* rows of x a block holds at once */

/* What one launch needs; passed by value. Pointers are device pointers. */
struct FusedArgs {
    float *w1, *b1, *w2, *b2;                    /* the parameters: read at the start, written at the end */
    const float *data_x;                         /* (n_data, n_in) the training set */
    const int *data_y, *order;                   /* (n_data) labels, (n_order) this epoch's rows */
    float *losses;                               /* (steps) each step's mean loss */
    float *exchange;                             /* (2, G, batch, n_out) partial logits, by step parity */
    float *dz_all, *row_loss;                    /* (batch, n_out), (batch): the two-barrier path's hand-over */
    unsigned *barrier;                           /* (2) arrivals, generation */
    int n_in, n_out, hidden, units;              /* units: hidden units per block (the last block may own fewer) */
    int n_order, batch, steps, tile_rows, x_stride, two_barriers;
    float lr;
};

/* ---- the grid barrier ----
 * Every block's thread 0 arrives by incrementing one counter; the last to arrive resets it and opens the
 * next generation, for which the others spin. The memory orders say what crosses the barrier: arriving is a
 * release (after __syncthreads, it publishes every write the block made, its share of the logits first),
 * leaving is an acquire (every block's writes are then visible to this one). Reads of other blocks' writes
 * still bypass the L1 cache (__ldcg), which could hold an old copy of the exchange buffer. The co-residency
 * of all blocks, which a spinning barrier needs, is guaranteed by the cooperative launch. */
__device__ void grid_barrier(unsigned *barrier, unsigned blocks) {
    /* BEGIN LAB 7.1 grid_barrier */
    __syncthreads(); /* the whole block is done with this phase */
    if (threadIdx.x == 0) {
        cuda::atomic_ref<unsigned, cuda::thread_scope_device> arrived(barrier[0]), generation(barrier[1]);
        const unsigned current = generation.load(cuda::memory_order_relaxed); /* cannot move before we arrive */
        if (arrived.fetch_add(1, cuda::memory_order_acq_rel) == blocks - 1) {
            arrived.store(0, cuda::memory_order_relaxed); /* reset before anyone leaves: the next barrier starts at 0 */
            generation.store(current + 1, cuda::memory_order_release);
        } else {
            while (generation.load(cuda::memory_order_acquire) == current) {
            }
        }
    }
    __syncthreads();
    /* END LAB */
}

/* ---- ownership ----
 * Block g owns `units` consecutive hidden units, j0 .. j0 + owned - 1 (the last block may own fewer): their weights
 * live in its shared memory alone, so every unit must have exactly one owner. Returns (j0, owned). */
__device__ int2 owned_units(int g, int units, int hidden) {
    /* BEGIN LAB 7.2 owned_units */
    const int j0 = g * units;
    return make_int2(j0, min(units, hidden - j0));
    /* END LAB */
}

/* Start copying rows [row0, row0 + rows) of the batch that begins at order[start] into xs (rows, x_stride):
 * cp.async, 16 bytes per thread per copy, neighbouring threads copying neighbouring floats of a row. The copy
 * runs while the block computes; __pipeline_wait_prior then __syncthreads make it visible. */
__device__ void issue_tile(float *xs, const FusedArgs &a, int start, int row0, int rows) {
    const int nf = a.n_in / 4;
    for (int i = threadIdx.x; i < rows * nf; i += FUSED_THREADS) {
        const int r = i / nf, f = i % nf;
        const int image = __ldg(a.order + start + row0 + r);
        __pipeline_memcpy_async(xs + (size_t)r * a.x_stride + 4 * f, a.data_x + (size_t)image * a.n_in + 4 * f, 16);
    }
    __pipeline_commit();
}

#ifdef FUSED_PROFILE /* a measuring build (not the default): cycles of each phase, block 0 */
__device__ unsigned long long fused_cycles[8];
#define PHASE(i)                                                                                         \
    do {                                                                                                 \
        __syncthreads();                                                                                 \
        if (t == 0 && g == 0) {                                                                          \
            const long long now = clock64();                                                             \
            fused_cycles[i] += now - mark;                                                               \
            mark = now;                                                                                  \
        }                                                                                                \
    } while (0)
#else
#define PHASE(i)
#endif

template <int UP> /* UP: units per block, padded to a power of two; padding units have zero weights */
__global__ void __launch_bounds__(FUSED_THREADS, 1) fused_epoch_kernel(const FusedArgs a) {
    extern __shared__ float4 smem4[];
    float *smem = reinterpret_cast<float *>(smem4);
    const int t = threadIdx.x, G = gridDim.x, g = blockIdx.x, lane = t % WARP, warp = t / WARP;
    const int2 own = owned_units(g, a.units, a.hidden);
    const int j0 = own.x, owned = own.y; /* this block's hidden units */
    const int nf = a.n_in / 4, B = a.batch, O = a.n_out, TR = a.tile_rows;
    /* Shared memory (smem_floats on the host adds it up), the float4-read regions first. */
    float *w1s = smem;                              /* (UP, n_in) this block's rows of fc1.weight */
    float *x0 = w1s + UP * a.n_in, *x1 = x0 + TR * a.x_stride; /* (TR, x_stride) rows of x, twice */
    float *part = x1 + TR * a.x_stride;             /* (FUSED_THREADS, UP) partial sums of the forward */
    float *hs = part + FUSED_THREADS * UP;          /* (B, UP) pre-activations */
    float *dhs = hs + B * UP;                       /* (B, UP) their gradients dh */
    float *dz = dhs + B * UP;                       /* (B, 32) dlogits, row stride 32 */
    float *rl = dz + B * 32;                        /* (B rounded to 4) each row's loss */
    float *w2s = rl + (B + 3) / 4 * 4;              /* (32, UP) this block's columns of fc2.weight */
    float *gw2 = w2s + 32 * UP;                     /* (32, UP) their gradient */
    float *b1s = gw2 + 32 * UP;                     /* (UP) */
    float *gb1 = b1s + UP;                          /* (UP) */
    float *b2s = gb1 + UP;                          /* (32) this block's copy of fc2.bias */
    float *gb2 = b2s + 32;                          /* (32) */
    int *labels = reinterpret_cast<int *>(gb2 + 32); /* (B) this step's labels */
#ifdef FUSED_PROFILE
    long long mark = clock64();
#endif

    /* Load what this block owns; padding units get zeros, which keep them at zero all along. */
    for (int i = t; i < UP * a.n_in; i += FUSED_THREADS) {
        const int u = i / a.n_in, k = i % a.n_in;
        w1s[i] = u < owned ? a.w1[(size_t)(j0 + u) * a.n_in + k] : 0.0f;
    }
    for (int i = t; i < 32 * UP; i += FUSED_THREADS) {
        const int o = i / UP, u = i % UP;
        w2s[i] = (o < O && u < owned) ? a.w2[(size_t)o * a.hidden + j0 + u] : 0.0f;
    }
    for (int u = t; u < UP; u += FUSED_THREADS) b1s[u] = u < owned ? a.b1[j0 + u] : 0.0f;
    for (int o = t; o < 32; o += FUSED_THREADS) b2s[o] = o < O ? a.b2[o] : 0.0f;
    int xb = 0; /* which buffer (x0 or x1) holds, or is receiving, the next tile of x */
    issue_tile(x0, a, 0, 0, min(TR, min(B, a.n_order)));

    /* The forward's thread layout: row (t % tp) of a tile, slice (t / tp) of the n_in inputs, for all UP units
     * (each loaded x reused UP times). Slices of one row within a warp are added by shuffles, then the
     * warps' sums in warp order. */
    int tp = 1;
    while (tp < TR) tp *= 2;
    const int slices = FUSED_THREADS / tp, r_t = t % tp, slice = t / tp;
    const int f0 = slice * nf / slices, f1 = (slice + 1) * nf / slices;

    for (int step = 0; step < a.steps; step++) {
        const int start = step * B, rows = min(B, a.n_order - start); /* the last batch may be partial */
        const int tiles = (rows + TR - 1) / TR;
        const bool more = step + 1 < a.steps;
        const int next_rows = more ? min(TR, min(B, a.n_order - start - B)) : 0;
        for (int r = t; r < rows; r += FUSED_THREADS) labels[r] = __ldg(a.data_y + __ldg(a.order + start + r));
        PHASE(0);

        /* ---- forward: h = x W1^T + b1 for this block's units, tile by tile, the next tile copied meanwhile ---- */
        for (int tile = 0; tile < tiles; tile++) {
            const int row0 = tile * TR, tile_n = min(TR, rows - row0);
            const float *xs = xb ? x1 : x0;
            if (tile + 1 < tiles) issue_tile(xb ? x0 : x1, a, start, row0 + TR, min(TR, rows - row0 - TR));
            __pipeline_wait_prior(tile + 1 < tiles ? 1 : 0);
            __syncthreads();
            float acc[UP];
#pragma unroll
            for (int u = 0; u < UP; u++) acc[u] = 0.0f;
            if (r_t < tile_n) {
                const float4 *x_row = reinterpret_cast<const float4 *>(xs + (size_t)r_t * a.x_stride);
                for (int f = f0; f < f1; f++) {
                    const float4 x = x_row[f];
#pragma unroll
                    for (int u = 0; u < UP; u++) {
                        const float4 w = reinterpret_cast<const float4 *>(w1s + u * a.n_in)[f];
                        acc[u] += x.x * w.x + x.y * w.y + x.z * w.z + x.w * w.w;
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < UP; u++)
                for (int offset = tp; offset < WARP; offset *= 2) acc[u] += __shfl_xor_sync(0xffffffffu, acc[u], offset);
            if (lane < tp)
#pragma unroll
                for (int u = 0; u < UP; u++) part[(warp * tp + lane) * UP + u] = acc[u];
            __syncthreads();
            for (int i = t; i < tile_n * UP; i += FUSED_THREADS) {
                const int r = i / UP, u = i % UP;
                float h = 0.0f;
                for (int w = 0; w < FUSED_THREADS / WARP; w++) h += part[(w * tp + r) * UP + u];
                hs[(row0 + r) * UP + u] = h + b1s[u];
            }
            if (tile + 1 < tiles) xb ^= 1;
        }
        /* One tile holds the whole batch: it stays for the backward, and the next step's batch is copied into
         * the other buffer from now on, through the barrier and the backward. */
        if (tiles == 1 && more) issue_tile(xb ? x0 : x1, a, start + B, 0, next_rows);
        __syncthreads();
        PHASE(1);

        /* ---- this block's share of the logits, to the exchange buffer (by step parity) ---- */
        float *share = a.exchange + ((size_t)(step % 2) * G + g) * B * O;
        for (int i = t; i < rows * O; i += FUSED_THREADS) {
            const int r = i / O, o = i % O;
            float z = 0.0f;
#pragma unroll
            for (int u = 0; u < UP; u++) z += fmaxf(hs[r * UP + u], 0.0f) * w2s[o * UP + u];
            share[(size_t)r * O + o] = z;
        }
        PHASE(2);
        grid_barrier(a.barrier, G);
        PHASE(3);

        /* ---- softmax and dlogits: one warp per row ----
         * logit o = b2[o] + the G shares, in block order: the same bits in every block. The shares are split
         * among 32 / O groups of O lanes (3 groups of 10 here), each adding its run of blocks with sixteen loads
         * in flight; lane o then adds the groups' sums in group order. With two barriers, block g does rows
         * g, g + G, ... and hands them round; with one, every block does every row. */
        const float *shares = a.exchange + (size_t)(step % 2) * G * B * O;
        const int groups = WARP / O, group = lane / O, o = lane % O;
        const int first = a.two_barriers ? g : 0, stride = a.two_barriers ? G : 1;
        for (int r = first + warp * stride; r < rows; r += stride * (FUSED_THREADS / WARP)) {
            float sum_part = 0.0f;
            if (group < groups) {
                const float *column = shares + (size_t)r * O + o;
                const size_t next = (size_t)B * O; /* from one block's share to the next */
                const int s1 = (group + 1) * G / groups;
                for (int s = group * G / groups; s < s1; s += 16) { /* sixteen loads in flight, added in order */
                    float v[16];
#pragma unroll
                    for (int q = 0; q < 16; q++) v[q] = __ldcg(column + min(s + q, s1 - 1) * next); /* no branch */
#pragma unroll
                    for (int q = 0; q < 16; q++) v[q] = s + q < s1 ? v[q] : 0.0f;
#pragma unroll
                    for (int q = 0; q < 16; q++) sum_part += v[q];
                }
            }
            float z = lane < O ? b2s[lane] : -INFINITY;
            for (int k = 0; k < groups; k++) {
                const float from_group = __shfl_sync(0xffffffffu, sum_part, k * O + o);
                if (lane < O) z += from_group;
            }
            const float top = warp_max(z);
            const float e = lane < O ? expf(z - top) : 0.0f;
            const float sum = warp_sum(e);
            const int label = labels[r];
            const float z_label = __shfl_sync(0xffffffffu, z, label);
            const float dlogit = lane < O ? (e / sum - (lane == label ? 1.0f : 0.0f)) / (float)rows : 0.0f;
            if (a.two_barriers) {
                if (lane < O) a.dz_all[(size_t)r * O + lane] = dlogit;
                if (lane == 0) a.row_loss[r] = logf(sum) - (z_label - top);
            } else {
                if (lane < O) dz[r * 32 + lane] = dlogit;
                if (lane == 0) rl[r] = logf(sum) - (z_label - top);
            }
        }
        if (a.two_barriers) {
            grid_barrier(a.barrier, G);
            for (int i = t; i < rows * O; i += FUSED_THREADS) dz[(i / O) * 32 + i % O] = __ldcg(a.dz_all + i);
            if (g == 0)
                for (int r = t; r < rows; r += FUSED_THREADS) rl[r] = __ldcg(a.row_loss + r);
        }
        __syncthreads();
        if (g == 0 && t == 0) { /* the mean loss, in double and in row order, as common/cuda_mlp.cuh's */
            double total = 0.0;
            for (int r = 0; r < rows; r++) total += rl[r];
            a.losses[step] = (float)(total / rows);
        }
        PHASE(4);

        /* ---- backward ---- */
        /* One pass, three independent products (each thread takes its items in turn):
         *   dW2 (o, u) = sum over rows of dlogits[r, o] * a[r, u];  db2 (o) = sum over rows of dlogits[r, o];
         *   da = dlogits W2 (the weights before this step's update), dh = da where h > 0: the ReLU's mask. */
        for (int i = t; i < O * UP + O + rows * UP; i += FUSED_THREADS) {
            if (i < O * UP) {
                const int oo = i / UP, u = i % UP;
                float sum = 0.0f;
                for (int r = 0; r < rows; r++) sum += dz[r * 32 + oo] * fmaxf(hs[r * UP + u], 0.0f);
                gw2[oo * UP + u] = sum;
            } else if (i < O * UP + O) {
                const int oo = i - O * UP;
                float sum = 0.0f;
                for (int r = 0; r < rows; r++) sum += dz[r * 32 + oo];
                gb2[oo] = sum;
            } else {
                const int r = (i - O * UP - O) / UP, u = (i - O * UP - O) % UP;
                float da = 0.0f;
                for (int oo = 0; oo < O; oo++) da += dz[r * 32 + oo] * w2s[oo * UP + u];
                dhs[r * UP + u] = hs[r * UP + u] > 0.0f ? da : 0.0f;
            }
        }
        __syncthreads();
        for (int u = t; u < UP; u += FUSED_THREADS) {
            float sum = 0.0f;
            for (int r = 0; r < rows; r++) sum += dhs[r * UP + u];
            gb1[u] = sum;
        }
        PHASE(5);
        /* dW1 (u, k) = sum over rows of dh[r, u] * x[r, k], and the update of this block's rows of W1.
         * Item = (a float4 column f of the inputs, a group of up to 4 units); at most two items per thread,
         * each summing every row into registers. One tile: it is still in xs. More: the tiles again, from the
         * last (still in xs) down to the first, the one below copied meanwhile. */
        constexpr int GROUP = UP < 4 ? UP : 4, GROUPS = UP / GROUP;
        float4 acc[2][GROUP];
#pragma unroll
        for (int it = 0; it < 2; it++)
#pragma unroll
            for (int q = 0; q < GROUP; q++) acc[it][q] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int tile = tiles - 1; tile >= 0; tile--) {
            const int row0 = tile * TR, tile_n = min(TR, rows - row0);
            const float *xs = xb ? x1 : x0;
            if (tiles > 1) { /* this tile arrived (the copy issued one iteration ago); the one below starts */
                if (tile > 0) issue_tile(xb ? x0 : x1, a, start, row0 - TR, TR);
                __pipeline_wait_prior(tile > 0 ? 1 : 0);
                __syncthreads();
            }
#pragma unroll
            for (int it = 0; it < 2; it++) {
                const int item = t + it * FUSED_THREADS;
                if (item >= nf * GROUPS) continue;
                const int f = item % nf, u0 = (item / nf) * GROUP;
                for (int r = 0; r < tile_n; r++) {
                    const float4 x = reinterpret_cast<const float4 *>(xs + (size_t)r * a.x_stride)[f];
#pragma unroll
                    for (int q = 0; q < GROUP; q++) {
                        const float d = dhs[(row0 + r) * UP + u0 + q];
                        acc[it][q].x += d * x.x, acc[it][q].y += d * x.y, acc[it][q].z += d * x.z, acc[it][q].w += d * x.w;
                    }
                }
            }
            if (tile > 0) {
                __syncthreads(); /* everyone is done with this tile before the next copy reuses its buffer */
                xb ^= 1;
            }
        }
#pragma unroll
        for (int it = 0; it < 2; it++) {
            const int item = t + it * FUSED_THREADS;
            if (item >= nf * GROUPS) continue;
            const int f = item % nf, u0 = (item / nf) * GROUP;
#pragma unroll
            for (int q = 0; q < GROUP; q++) {
                float4 *w = reinterpret_cast<float4 *>(w1s + (u0 + q) * a.n_in) + f;
                float4 v = *w;
                v.x -= a.lr * acc[it][q].x, v.y -= a.lr * acc[it][q].y, v.z -= a.lr * acc[it][q].z, v.w -= a.lr * acc[it][q].w;
                *w = v;
            }
        }
        __syncthreads(); /* gb1, gw2, gb2 are complete; the tiles' buffers are free */
        if (tiles == 1) {
            xb ^= 1; /* the next step's batch was copied into the other buffer during this step */
        } else if (more) {
            issue_tile(xb ? x0 : x1, a, start + B, 0, next_rows);
            xb ^= 1;
        }
        for (int u = t; u < UP; u += FUSED_THREADS) b1s[u] -= a.lr * gb1[u];
        for (int i = t; i < O * UP; i += FUSED_THREADS) w2s[i] -= a.lr * gw2[i];
        for (int oo = t; oo < O; oo += FUSED_THREADS) b2s[oo] -= a.lr * gb2[oo];
        __syncthreads();
        PHASE(6);
    }
    __pipeline_wait_prior(0); /* no copy may outlive the launch */

    /* Write back what this block owns; fc2.bias, identical in every block, from block 0. */
    for (int i = t; i < owned * a.n_in; i += FUSED_THREADS) a.w1[(size_t)j0 * a.n_in + i] = w1s[i];
    for (int i = t; i < O * owned; i += FUSED_THREADS) {
        const int oo = i / owned, u = i % owned;
        a.w2[(size_t)oo * a.hidden + j0 + u] = w2s[oo * UP + u];
    }
    for (int u = t; u < owned; u += FUSED_THREADS) a.b1[j0 + u] = b1s[u];
    if (g == 0)
        for (int oo = t; oo < O; oo += FUSED_THREADS) a.b2[oo] = b2s[oo];
}

/* ---- the plan: how a batch size is run, fused or not ---- */

struct FusedPlan {
    int fused;                  /* 1: the fused kernel; 0: level 6's queued kernels */
    int blocks, units, padded;  /* G, U, U rounded up to a power of two */
    int tile_rows, x_stride, two_barriers;
    size_t smem;                /* bytes of dynamic shared memory per block */
    char why[160];              /* for mlp_fused_plan */
};

/* Floats of shared memory the kernel lays out above, each region a whole number of float4s. */
static size_t smem_floats(int up, int n_in, int tile_rows, int x_stride, int batch) {
    return (size_t)up * n_in + 2 * (size_t)tile_rows * x_stride + (size_t)FUSED_THREADS * up + 2 * (size_t)batch * up +
           (size_t)batch * 32 + (size_t)(batch + 3) / 4 * 4 + 2 * 32 * (size_t)up + 2 * (size_t)up + 64 + batch;
}

static int round_up_pow2(int n) {
    int p = 1;
    while (p < n) p *= 2;
    return p;
}

/* The kernel instantiated for up units per block (a power of two up to MAX_UNITS). */
static const void *kernel_for(int up) {
    switch (up) {
    case 1: return reinterpret_cast<const void *>(fused_epoch_kernel<1>);
    case 2: return reinterpret_cast<const void *>(fused_epoch_kernel<2>);
    case 4: return reinterpret_cast<const void *>(fused_epoch_kernel<4>);
    case 8: return reinterpret_cast<const void *>(fused_epoch_kernel<8>);
    default: return reinterpret_cast<const void *>(fused_epoch_kernel<16>);
    }
}

static int make_plan(mlp *m, int batch, FusedPlan *plan) {
    *plan = FusedPlan{};
    int device = 0, sms = 0, optin = 0, cooperative = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    CUDA_CHECK(cudaDeviceGetAttribute(&cooperative, cudaDevAttrCooperativeLaunch, device));
    int units = (m->hidden + sms - 1) / sms;
    if (units < MIN_UNITS) units = MIN_UNITS;
    if (const char *knob = getenv("MLP_FUSED_UNITS")) units = atoi(knob) > 0 ? atoi(knob) : units;
    if (units > m->hidden) units = m->hidden;
    plan->units = units;
    plan->padded = round_up_pow2(units);
    plan->blocks = (m->hidden + units - 1) / units;
    plan->tile_rows = batch < TILE_ROWS ? batch : TILE_ROWS;
    int stride = (m->n_in + 3) / 4 * 4; /* rows of xs: a multiple of 4 floats that is 4, 12, 20 or 28 mod 32, so */
    while (stride % 8 != 4) stride += 4; /* that the float4 reads of 8 neighbouring rows hit 8 disjoint bank groups */
    plan->x_stride = stride;
    plan->smem = sizeof(float) * smem_floats(plan->padded, m->n_in, plan->tile_rows, stride, batch);
    while (plan->smem > (size_t)optin && plan->tile_rows > 8) { /* smaller tiles of x before giving up */
        plan->tile_rows /= 2;
        plan->smem = sizeof(float) * smem_floats(plan->padded, m->n_in, plan->tile_rows, stride, batch);
    }
    plan->two_barriers = (size_t)plan->blocks * batch > 4096; /* every block reading G x B shares costs too much */
    const char *no = NULL;
    if (!cooperative) no = "this GPU cannot launch cooperatively";
    else if (m->n_in % 4 || m->n_out > 32) no = "inputs not a multiple of 4, or more than 32 outputs";
    else if (plan->padded > MAX_UNITS) no = "more than 16 hidden units per block (hidden too large for one wave)";
    else if (plan->smem > (size_t)optin) no = "the batch and the units do not fit in shared memory";
    if (!no) {
        int per_sm = 0;
        const void *kernel = kernel_for(plan->padded);
        CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)plan->smem));
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, FUSED_THREADS, plan->smem));
        if ((long)per_sm * sms < plan->blocks) no = "the blocks do not all fit on the GPU at once";
    }
    plan->fused = !no;
    if (no)
        snprintf(plan->why, sizeof plan->why, "level 6's queued kernels (not fused: %s; hidden %d, batch %d)", no,
                 m->hidden, batch);
    else
        snprintf(plan->why, sizeof plan->why, "fused: %d blocks x %d units, %s per step, %zu bytes of shared memory",
                 plan->blocks, plan->units, plan->two_barriers ? "two barriers" : "one barrier", plan->smem);
    return MLP_OK;
}


/* The hook of common/cuda_mlp.cuh: the steps of this call, fused when they fit. */
static int train_steps(mlp *m, int n_order, int batch_size, float lr) {
#ifdef LAB_TODO_DEVICE /* the student edition: a device function above is still its stub (mlp_status.h) */
    return FAIL(MLP_ERR_ARG, "%s", LAB_TODO_DEVICE);
#endif
    FusedPlan plan;
    int status = make_plan(m, batch_size, &plan);
    if (status) return status;
    if (!plan.fused) return queue_steps(m, n_order, batch_size, lr);
    const size_t exchange = 2 * (size_t)plan.blocks * batch_size * m->n_out + (size_t)batch_size * (m->n_out + 1);
    if (exchange > (size_t)MLP_MAX_ELEMENTS) return FAIL(MLP_ERR_ARG, "exchange buffer of %zu floats", exchange);
    status = ensure_buffer(&m->exchange, &m->exchange_capacity, (int)exchange);
    if (status) return status;
    if (!m->barrier) {
        CUDA_CHECK(device_malloc(&m->barrier, 2 * sizeof(unsigned)));
        CUDA_CHECK(cudaMemsetAsync(m->barrier, 0, 2 * sizeof(unsigned), m->stream));
    }
    FusedArgs args{};
    args.w1 = m->w1, args.b1 = m->b1, args.w2 = m->w2, args.b2 = m->b2;
    args.data_x = m->data_x, args.data_y = m->data_y, args.order = m->order;
    args.losses = m->losses, args.barrier = m->barrier;
    args.exchange = m->exchange;
    args.dz_all = m->exchange + 2 * (size_t)plan.blocks * batch_size * m->n_out;
    args.row_loss = args.dz_all + (size_t)batch_size * m->n_out;
    args.n_in = m->n_in, args.n_out = m->n_out, args.hidden = m->hidden, args.units = plan.units;
    args.n_order = n_order, args.batch = batch_size, args.steps = n_order / batch_size + (n_order % batch_size != 0);
    args.tile_rows = plan.tile_rows, args.x_stride = plan.x_stride, args.two_barriers = plan.two_barriers;
    args.lr = lr;
    void *params[] = {&args};
    CUDA_CHECK(cudaLaunchCooperativeKernel(kernel_for(plan.padded), plan.blocks, FUSED_THREADS, params, plan.smem,
                                           m->stream));
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
}

#ifdef FUSED_PROFILE
/* The measuring build's cycles per phase of block 0, summed over the steps since the last call; then reset. */
extern "C" int mlp_fused_cycles(unsigned long long *out) {
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpyFromSymbol(out, fused_cycles, sizeof(unsigned long long) * 8));
    const unsigned long long zeros[8] = {0};
    CUDA_CHECK(cudaMemcpyToSymbol(fused_cycles, zeros, sizeof zeros));
    return MLP_OK;
}
#endif

/* How an epoch with this batch size runs on this model and GPU: "fused: ..." or why not (level 7 only;
 * the Python side warns when it is not fused). The text lives in a buffer of the calling thread. */
extern "C" const char *mlp_fused_plan(mlp *m, int batch_size) {
    static MLP_THREAD_LOCAL FusedPlan plan;
    if (!m || batch_size < 1 || make_plan(m, batch_size, &plan)) return "no plan: bad arguments or a CUDA error";
    return plan.why;
}
