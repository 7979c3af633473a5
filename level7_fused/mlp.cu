/* level7_fused/mlp.cu - Level 7: one fused, persistent kernel runs every step of an epoch.
 *
 * Level 6 launches ~19 kernels per step, and at the chapter's size the launches are the time. Here one launch runs
 * all the steps. Each block owns a slice of the hidden units and keeps their weights on chip all launch (fc1's rows
 * in registers); per step it runs the phases of fused_epoch_kernel. The blocks meet once per step, to hand round
 * their shares of the logits: in one thread-block cluster, copied into each other's shared memory (small sizes), or
 * through global memory and a grid barrier (large ones). No atomics touch a number and every sum has one fixed order:
 * reruns are bit-identical. FP32 FMA, no TF32. It needs a Hopper GPU; elsewhere, or where a size does not fit, the
 * epoch runs level 6's kernels (mlp_fused_plan() says which). Everything but the epoch is level 6's, included here.
 * The chapter (level7_fused/chapter.ipynb) walks through the design. Build: make level7.
 * Knobs, for measurements: MLP_FUSED_UNITS=4|8|16, MLP_FUSED_EXCHANGE=cluster|grid.
 */
#define LEVEL_TRAINS_ITS_OWN_EPOCH
#include "../level6_cublas/mlp.cu"

#include <cooperative_groups.h>
#include <cstdio>
#include <cstring>
#include <cuda/atomic>

namespace cg = cooperative_groups;

#define GROUP_UNITS 4     /* hidden units whose fc1 rows one thread holds a part of */
#define GROUP_LANES 128   /* threads of a group: the float4 columns of the inputs are dealt among them */
#define COLUMNS 2         /* float4 columns a thread holds: inputs up to 4 x 128 x 2 = 1024 */
#define MAX_GROUPS 4      /* groups per block: 16 units, 512 threads */
#define FUSED_THREADS (MAX_GROUPS * GROUP_LANES) /* the most threads a block has */
#define ROW_TILE 8        /* rows of x a thread multiplies at once: its register tile is 8 rows x 4 units */
#define KEEP_ROWS 16      /* a batch up to this size is one tile of x, kept for the whole step */
#define STREAM_SLOTS 3    /* tiles of x in shared memory at once when the batch streams through, */
#define STREAM_ROWS 16    /* of 16 rows each (8 rows a tile measured 1.4x slower at batch 256: a cost per tile) */
#define MAX_CLUSTER 16    /* the largest thread-block cluster (16 is the H100's, beyond the portable 8) */
#define MAX_OUT WARP      /* outputs: one lane each in the softmax */
#define LABEL_ROWS 4      /* rows of a batch one thread reads ahead: a batch is at most 4 x the threads */
#define IMAGE_STEPS 4     /* steps whose image numbers are in shared memory: this one and the next three */

/* What one launch needs; passed by value. Pointers are device pointers. */
struct FusedArgs {
    float *w1, *b1, *w2, *b2;     /* the parameters: read at the start, written at the end */
    const float *data_x;          /* (n_data, n_in) the training set */
    const int *data_y, *order;    /* (n_data) labels, (n_order) this epoch's rows */
    float *losses;                /* (steps) each step's mean loss */
    float *exchange;              /* grid: (2, G, batch, n_out) shares by step parity, then the second barrier's */
                                  /* hand-over: (batch, n_out) dlogits and (batch) row losses */
    unsigned *barrier;            /* grid: (2) arrivals, generation */
    int n_in, n_out, hidden;
    int units;                    /* hidden units per block, a multiple of 4 (the last block may own fewer) */
    int n_order, batch, steps;
    int tile_rows, slots, keep;   /* rows of a tile of x (a multiple of 8), tiles held at once, 1: a step is one tile */
    int two_barriers;             /* grid: blocks split the softmax's rows and hand the dlogits round */
    float lr;
};

__host__ __device__ inline int round4(int n) { return (n + 3) / 4 * 4; }
__host__ __device__ inline int cdiv(int a, int b) { return (a + b - 1) / b; }

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
 * live in this block alone, so every unit must have exactly one owner. Returns (j0, owned). */
__device__ int2 owned_units(int g, int units, int hidden) {
    /* BEGIN LAB 7.2 owned_units */
    const int j0 = g * units;
    return make_int2(j0, min(units, hidden - j0));
    /* END LAB */
}

/* ---- Hopper's instructions: a barrier in shared memory (mbarrier), the bulk copy engine, the cluster ----
 * An mbarrier counts arrivals and, for copies, bytes; it completes a phase when both reach zero, then re-arms.
 * Waiting names the phase's parity. A bulk copy (cp.async.bulk) moves whole rows from global into shared memory
 * and adds their bytes to an mbarrier. */
#if __CUDA_ARCH__ >= 900
__device__ unsigned smem_address(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ void mbarrier_init(unsigned long long *bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(count) : "memory");
}

/* This block will receive `bytes` into the barrier's phase (and is its one local arrival). */
__device__ void mbarrier_expect_bytes(unsigned long long *bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(bar)), "r"(bytes)
                 : "memory");
}

/* Wait for the phase of this parity to complete (what the copies or stores it counted wrote is then visible). */
__device__ void mbarrier_wait(unsigned long long *bar, unsigned parity) {
    unsigned done = 0;
    while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;"
                     " selp.u32 %0, 1, 0, p; }"
                     : "=r"(done)
                     : "r"(smem_address(bar)), "r"(parity)
                     : "memory");
}

/* Copy `bytes` of global memory into this block's shared memory, counted by the barrier `bar` when they land. */
__device__ void bulk_copy(float *dst, const float *src, unsigned bytes, unsigned long long *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_address(dst)),
                 "l"(src), "r"(bytes), "r"(smem_address(bar))
                 : "memory");
}

/* Copy `bytes` of this block's shared memory to the same place in block `rank` of the cluster, the bytes counted by
 * that block's barrier at the place of `bar` when they land. What this block wrote there must be fenced first (the
 * copy engine reads through another path: fence.proxy.async). */
__device__ void bulk_copy_to_block(const float *src, unsigned bytes, unsigned long long *bar, unsigned rank) {
    unsigned remote_dst, remote_bar;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_dst) : "r"(smem_address(src)), "r"(rank));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_bar) : "r"(smem_address(bar)), "r"(rank));
    asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     remote_dst),
                 "r"(smem_address(src)), "r"(bytes), "r"(remote_bar)
                 : "memory");
}
#endif

/* Every block of the cluster arrives, and each waits for the others: arriving releases this block's writes, waiting
 * acquires the others'. make_plan never picks a cluster below compute capability 9.0. */
__device__ void cluster_barrier() {
#if __CUDA_ARCH__ >= 900
    cg::this_cluster().sync();
#else
    __trap();
#endif
}

/* ---- the block's shared memory ----
 * One layout, computed alike on the host (for the launch's size) and on the device (to carve it): offsets in floats,
 * each region a multiple of 16 bytes. Units per block U = groups x 4. */
struct Layout {
    int full;               /* (slots) mbarriers of the tiles of x: filled */
    int arrived;            /* cluster: (2) mbarriers of the shares, by step parity: every block's share has landed */
    int x;                  /* (slots, tile_rows, n_in) tiles of x */
    int part;               /* (2, tile_rows / 8, groups, 4, 32) each warp's sums in the forward, by tile parity */
    int h, dh;              /* (batch, U) pre-activations and their gradient */
    int dz;                 /* (batch, n_out) dlogits */
    int row_loss, labels;   /* (batch) */
    int images;             /* (IMAGE_STEPS, batch) the rows of data_x of this step's batch and the next ones' */
    int w2, gw2;            /* (n_out, U) this block's columns of fc2.weight, their gradient */
    int b1, gb1;            /* (U) */
    int b2, gb2;            /* (MAX_OUT) this block's copy of fc2.bias (every block updates its own identically) */
    int shares;             /* cluster: (2, blocks, batch x n_out rounded to 4) every block's share, by step parity */
    int sums;               /* grid: (warps, MAX_OUT) the softmax's partial sums of shares */
    int total;
};

__host__ __device__ inline int take(int &at, int floats) {
    const int here = at;
    at += round4(floats);
    return here;
}

__host__ __device__ inline Layout layout(const FusedArgs &a, int groups, int blocks, bool cluster) {
    const int U = groups * GROUP_UNITS, B = a.batch;
    Layout l;
    int at = 0;
    l.full = take(at, 2 * a.slots); /* an mbarrier is 8 bytes: 2 floats */
    l.arrived = take(at, cluster ? 2 * 2 : 0);
    l.x = take(at, a.slots * a.tile_rows * a.n_in);
    l.part = take(at, 2 * (a.tile_rows / ROW_TILE) * groups * 4 * WARP);
    l.h = take(at, B * U);
    l.dh = take(at, B * U);
    l.dz = take(at, B * a.n_out);
    l.row_loss = take(at, B);
    l.labels = take(at, B);
    l.images = take(at, IMAGE_STEPS * B);
    l.w2 = take(at, a.n_out * U);
    l.gw2 = take(at, a.n_out * U);
    l.b1 = take(at, U);
    l.gb1 = take(at, U);
    l.b2 = take(at, MAX_OUT);
    l.gb2 = take(at, MAX_OUT);
    l.shares = take(at, cluster ? 2 * blocks * round4(B * a.n_out) : 0);
    l.sums = take(at, cluster ? 0 : groups * 4 * MAX_OUT);
    l.total = at;
    return l;
}

struct Shared {
    unsigned long long *full, *arrived;
    float *x, *part, *h, *dh, *dz, *row_loss, *w2, *gw2, *b1, *gb1, *b2, *gb2, *shares, *sums;
    int *labels, *images;
};

__device__ Shared carve(float *smem, const Layout &l) {
    Shared s;
    s.full = reinterpret_cast<unsigned long long *>(smem + l.full);
    s.arrived = reinterpret_cast<unsigned long long *>(smem + l.arrived);
    s.x = smem + l.x, s.part = smem + l.part, s.h = smem + l.h, s.dh = smem + l.dh, s.dz = smem + l.dz;
    s.row_loss = smem + l.row_loss, s.labels = reinterpret_cast<int *>(smem + l.labels);
    s.images = reinterpret_cast<int *>(smem + l.images);
    s.w2 = smem + l.w2, s.gw2 = smem + l.gw2, s.b1 = smem + l.b1, s.gb1 = smem + l.gb1;
    s.b2 = smem + l.b2, s.gb2 = smem + l.gb2, s.shares = smem + l.shares, s.sums = smem + l.sums;
    return s;
}

/* Which part of fc1.weight this thread holds, in registers, for the whole launch: 4 units of the block (its group)
 * times the float4 columns lane, lane + 128 (those below n_in / 4). */
struct Thread {
    int group, lane, warp; /* the group; the thread's place in it, 0..127; the warp's in it, 0..3 */
    int columns;           /* float4 columns of the inputs: n_in / 4 */
};

__device__ Thread this_thread(const FusedArgs &a) {
    Thread t;
    t.group = threadIdx.x / GROUP_LANES;
    t.lane = threadIdx.x % GROUP_LANES;
    t.warp = t.lane / WARP;
    t.columns = a.n_in / 4;
    return t;
}

/* Which step this is, and its batch. */
struct Step {
    int index;
    int half;        /* which half of the exchange holds this step's shares: a block that runs ahead writes the */
                     /* next step's into the other half while slower ones still read this one's */
    int start, rows; /* the batch: rows order[start .. start + rows); the last batch may be partial */
    int tiles;       /* tiles of x in one pass over the batch */
};

__device__ Step step_at(const FusedArgs &a, int index) {
    Step st;
    st.index = index;
    st.half = index % 2;
    st.start = index * a.batch;
    st.rows = min(a.batch, a.n_order - st.start);
    st.tiles = a.keep ? 1 : cdiv(st.rows, a.tile_rows);
    return st;
}

/* ---- the tiles of x: a pipeline of bulk copies ----
 * The tiles come in one order for the whole launch: per step, the forward's tiles, then the same tiles again for dW1
 * (a kept step has one tile, read by both). Tile n is copied into slot n % slots; everyone waits on that slot's `full`
 * barrier; once the whole block is done with tile n (a __syncthreads), the block copies tile n + slots into its slot. */
struct Tile {
    int step, row0, rows; /* rows row0 .. row0 + rows - 1 of step `step`'s batch */
};

__device__ int tiles_per_step(const FusedArgs &a, const Step &st) { return a.keep ? 1 : 2 * st.tiles; }

__device__ int tile_count(const FusedArgs &a) {
    return (a.steps - 1) * tiles_per_step(a, step_at(a, 0)) + tiles_per_step(a, step_at(a, a.steps - 1));
}

/* The first row of the k-th tile a block reads in a pass over the step's batch. The blocks start at different
 * tiles, so that they do not all read the same rows of x at once. */
__device__ int tile_row0(const FusedArgs &a, const Step &st, int k) {
    return (k + blockIdx.x) % st.tiles * a.tile_rows;
}

__device__ Tile tile_at(const FusedArgs &a, int n) {
    const int per_step = tiles_per_step(a, step_at(a, 0));
    const int index = min(n / per_step, a.steps - 1); /* only the last step may have fewer tiles */
    const Step st = step_at(a, index);
    Tile tile;
    tile.step = index;
    tile.row0 = tile_row0(a, st, (n - index * per_step) % st.tiles);
    tile.rows = min(a.tile_rows, st.rows - tile.row0);
    return tile;
}

__device__ const float *tile_x(const Shared &s, const FusedArgs &a, int n) {
    return s.x + (size_t)(n % a.slots) * a.tile_rows * a.n_in;
}

/* Copy tile n (if there is one) into its slot: each row of data_x is one bulk copy, sent by lane 0 of a warp, the
 * warps taking turns (a lone warp sending every row stalled the block for about a microsecond a tile). The rows'
 * image numbers are in shared memory, read there steps ahead (next_rows). Thread 0's arrival tells the slot's
 * `full` barrier to expect the whole tile; a copy that lands before it only takes its bytes off the count. */
__device__ void issue_tile(const Shared &s, const FusedArgs &a, int n, int total) {
#if __CUDA_ARCH__ >= 900
    if (n >= total) return;
    const Tile tile = tile_at(a, n);
    const unsigned row_bytes = a.n_in * sizeof(float);
    unsigned long long *full = &s.full[n % a.slots];
    if (threadIdx.x == 0) mbarrier_expect_bytes(full, tile.rows * row_bytes);
    if (threadIdx.x % WARP) return;
    for (int r = threadIdx.x / WARP; r < tile.rows; r += blockDim.x / WARP) {
        float *row = const_cast<float *>(tile_x(s, a, n)) + r * a.n_in;
        bulk_copy(row, a.data_x + (size_t)s.images[tile.step % IMAGE_STEPS * a.batch + tile.row0 + r] * a.n_in, row_bytes,
                  full);
    }
#endif
}

__device__ void wait_tile(const Shared &s, const FusedArgs &a, int n) {
#if __CUDA_ARCH__ >= 900
    mbarrier_wait(&s.full[n % a.slots], (n / a.slots) % 2);
#endif
}

/* After the block's last read of tile n, behind a __syncthreads: its slot is free, for tile n + slots. The fence
 * orders the block's reads of the slot before the copy engine's writes (another proxy, in the PTX's words). */
__device__ void release_tile(const Shared &s, const FusedArgs &a, int n, int total) {
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    issue_tile(s, a, n + a.slots, total);
#endif
}

/* Before the first tile: the barriers (the shares' too, in a cluster), made visible to the cluster; the first copies. */
template <bool CLUSTER>
__device__ void start_tiles(const Shared &s, const FusedArgs &a, int total) {
#if __CUDA_ARCH__ >= 900
    if (threadIdx.x == 0) {
        for (int slot = 0; slot < a.slots; slot++) mbarrier_init(&s.full[slot], 1);
        if (CLUSTER)
            for (int half = 0; half < 2; half++) mbarrier_init(&s.arrived[half], 1); /* its own arrival, and bytes */
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    if (CLUSTER) cluster_barrier(); /* every block has started before any copies into another */
    else __syncthreads();
    for (int n = 0; n < a.slots; n++) issue_tile(s, a, n, total);
#endif
}

/* Scaffolding: the stress and measuring builds below add calls to the kernel, each line marked "scaffold", which the
 * chapter's listings leave out (common/book/chapter.py). The default build compiles them to nothing. */
#ifdef FUSED_STRESS
/* A testing build (tests/test_levels.py): each block pauses for a different time at each step, now and then for
 * long, at the places where blocks hand each other data: before writing its share, before reading the others', and
 * before freeing a tile. A block that runs ahead then writes while another still reads, so an exchange that is not
 * safe shows as wrong numbers instead of passing by luck. */
__device__ void stress_pause(const Step &st, int where) {
    if (threadIdx.x == 0) {
        const unsigned k = (unsigned)st.index * 2654435761u ^ (blockIdx.x + 1) * 40503u ^ (unsigned)where * 977u;
        __nanosleep(k % 8 == 0 ? 20000 : (k >> 4) % 4 * 1000);
    }
    __syncthreads();
}
#else
__device__ void stress_pause(const Step &, int) {}
#endif

/* The measuring build (common/harness/level7_phases.py, not the default) times each phase of block 0 with clock64(),
 * after a __syncthreads (so a phase ends when the whole block is done with it), in registers; added up at the launch's
 * end. */
struct PhaseClock {
    long long mark, total[8];
};
#ifdef FUSED_PROFILE
__device__ unsigned long long fused_cycles[8];
__device__ void phase_done(PhaseClock &clock, int phase) {
    __syncthreads();
    const long long now = clock64();
    clock.total[phase] += now - clock.mark;
    clock.mark = now;
}
__device__ void phases_recorded(const PhaseClock &clock) {
    if (threadIdx.x == 0 && blockIdx.x == 0)
        for (int phase = 0; phase < 8; phase++) fused_cycles[phase] += clock.total[phase];
}
#else
__device__ void phase_done(PhaseClock &, int) {}
__device__ void phases_recorded(const PhaseClock &) {}
#endif

/* ---- what the block owns: loaded at the start, written back at the end ---- */

/* fc1's rows of this thread's 4 units, its float4 columns; padding units and columns hold zeros, which stay zero. */
__device__ void load_owned(float4 (&w)[COLUMNS][GROUP_UNITS], const Shared &s, const FusedArgs &a, const Thread &t,
                           int2 own, int U) {
#pragma unroll
    for (int c = 0; c < COLUMNS; c++) {
        const int column = t.lane + c * GROUP_LANES;
#pragma unroll
        for (int u = 0; u < GROUP_UNITS; u++) {
            const int unit = t.group * GROUP_UNITS + u;
            w[c][u] = column < t.columns && unit < own.y
                          ? reinterpret_cast<const float4 *>(a.w1 + (size_t)(own.x + unit) * a.n_in)[column]
                          : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    }
    for (int i = threadIdx.x; i < a.n_out * U; i += blockDim.x) {
        const int o = i / U, u = i % U;
        s.w2[i] = u < own.y ? a.w2[(size_t)o * a.hidden + own.x + u] : 0.0f;
    }
    for (int u = threadIdx.x; u < U; u += blockDim.x) s.b1[u] = u < own.y ? a.b1[own.x + u] : 0.0f;
    for (int o = threadIdx.x; o < MAX_OUT; o += blockDim.x) s.b2[o] = o < a.n_out ? a.b2[o] : 0.0f;
}

/* The same back to the parameters; fc2.bias, identical in every block, from block 0. */
__device__ void store_owned(const float4 (&w)[COLUMNS][GROUP_UNITS], const Shared &s, const FusedArgs &a,
                            const Thread &t, int2 own, int U) {
#pragma unroll
    for (int c = 0; c < COLUMNS; c++) {
        const int column = t.lane + c * GROUP_LANES;
#pragma unroll
        for (int u = 0; u < GROUP_UNITS; u++) {
            const int unit = t.group * GROUP_UNITS + u;
            if (column < t.columns && unit < own.y)
                reinterpret_cast<float4 *>(a.w1 + (size_t)(own.x + unit) * a.n_in)[column] = w[c][u];
        }
    }
    for (int i = threadIdx.x; i < a.n_out * own.y; i += blockDim.x) {
        const int o = i / own.y, u = i % own.y;
        a.w2[(size_t)o * a.hidden + own.x + u] = s.w2[o * U + u];
    }
    for (int u = threadIdx.x; u < own.y; u += blockDim.x) a.b1[own.x + u] = s.b1[u];
    if (blockIdx.x == 0)
        for (int o = threadIdx.x; o < a.n_out; o += blockDim.x) a.b2[o] = s.b2[o];
}

/* ---- the phases of a step ---- */

/* The batch's rows, read ahead, so that no read of global memory (about a microsecond each) stands in a step's way:
 * the image numbers of a step (its rows of data_x) three steps ahead, into shared memory, where issue_tile finds
 * them; the labels one step ahead, in registers. Thread t keeps rows t, t + threads, ... of every batch. */
struct Rows {
    int label[LABEL_ROWS]; /* of the next step's rows */
    int image[LABEL_ROWS]; /* of the rows of the step three ahead */
};

__device__ int image_of(const FusedArgs &a, int step, int r) {
    return step < a.steps && r < min(a.batch, a.n_order - step * a.batch) ? __ldg(a.order + step * a.batch + r) : -1;
}

/* Before the first step: the image numbers of steps 0, 1 and 2 in shared memory (a __syncthreads must follow), the
 * labels of step 0 and the image numbers of step 3 in registers. */
__device__ Rows start_rows(const Shared &s, const FusedArgs &a) {
    Rows l;
#pragma unroll
    for (int j = 0; j < LABEL_ROWS; j++) {
        const int r = threadIdx.x + j * blockDim.x;
        if (r >= a.batch) continue;
        for (int step = 0; step < IMAGE_STEPS - 1; step++) s.images[step * a.batch + r] = image_of(a, step, r);
        l.label[j] = s.images[r] >= 0 ? __ldg(a.data_y + s.images[r]) : 0;
        l.image[j] = image_of(a, IMAGE_STEPS - 1, r);
    }
    return l;
}

/* At the start of step k: its labels into shared memory; the labels of step k + 1 read (their image numbers are in
 * shared memory); the image numbers of step k + 3 stored, and those of step k + 4 read. */
__device__ void next_rows(const Shared &s, const FusedArgs &a, const Step &st, Rows &l) {
#pragma unroll
    for (int j = 0; j < LABEL_ROWS; j++) {
        const int r = threadIdx.x + j * blockDim.x;
        if (r >= a.batch) continue;
        if (r < st.rows) s.labels[r] = l.label[j];
        const int next = s.images[(st.index + 1) % IMAGE_STEPS * a.batch + r];
        l.label[j] = next >= 0 ? __ldg(a.data_y + next) : 0;
        s.images[(st.index + IMAGE_STEPS - 1) % IMAGE_STEPS * a.batch + r] = l.image[j];
        l.image[j] = image_of(a, st.index + IMAGE_STEPS, r);
    }
}

/* 8 rows of x (stride n_in) times this thread's weights: acc[r * 4 + u] = the sum over its columns of x[r] . w[u].
 * Every x read from shared memory feeds 16 multiply-adds; the weights come from registers. */
__device__ void tile_products(float (&acc)[ROW_TILE * GROUP_UNITS], const float *x, int n_in,
                              const float4 (&w)[COLUMNS][GROUP_UNITS], const Thread &t) {
#pragma unroll
    for (int i = 0; i < ROW_TILE * GROUP_UNITS; i++) acc[i] = 0.0f;
#pragma unroll
    for (int c = 0; c < COLUMNS; c++) {
        const int column = t.lane + c * GROUP_LANES;
        if (column >= t.columns) continue;
#pragma unroll
        for (int r = 0; r < ROW_TILE; r++) {
            const float4 xv = reinterpret_cast<const float4 *>(x + r * n_in)[column];
#pragma unroll
            for (int u = 0; u < GROUP_UNITS; u++) {
                float v = acc[r * GROUP_UNITS + u];
                v = fmaf(xv.x, w[c][u].x, v);
                v = fmaf(xv.y, w[c][u].y, v);
                v = fmaf(xv.z, w[c][u].z, v);
                v = fmaf(xv.w, w[c][u].w, v);
                acc[r * GROUP_UNITS + u] = v;
            }
        }
    }
}

/* The warp's 32 lanes each hold 32 partial sums; afterwards lane l holds the sum over the lanes of sum number l.
 * Five rounds (HALF = 16, 8, 4, 2, 1): in each, a lane keeps half its sums and receives its partner's other half,
 * a fixed tree (the same bits on every run), so a warp reduces 32 sums with 31 shuffles a lane. */
template <int HALF = WARP / 2>
__device__ float reduce_scatter(float (&v)[WARP], int lane) {
    const bool upper = lane & HALF;
#pragma unroll
    for (int i = 0; i < HALF; i++) {
        const float low = v[i], high = v[i + HALF]; /* chosen by value: an address chosen would put v in memory */
        const float send = upper ? low : high, keep = upper ? high : low;
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, HALF);
    }
    if constexpr (HALF > 1) return reduce_scatter<HALF / 2>(v, lane);
    return v[0];
}

/* Forward: h (rows, U) = x W1^T + b1 for this block's units. Per tile of x, each thread multiplies 8 rows at a time by
 * its part of the weights, each warp adds its lanes' sums (reduce_scatter), and the sums of a group's 4 warps, in
 * warp order, plus the bias, are h. n: the step's first tile; past its forward tiles on return (a kept tile stays). */
template <int GROUPS>
__device__ void forward(const Shared &s, const FusedArgs &a, const Step &st, const float4 (&w)[COLUMNS][GROUP_UNITS],
                        const Thread &t, int &n, int total) {
    constexpr int U = GROUPS * GROUP_UNITS;
    const int groups_of_rows = a.tile_rows / ROW_TILE, lane = threadIdx.x % WARP;
    for (int k = 0; k < st.tiles; k++) {
        const int tile = n + k, row0 = tile_row0(a, st, k), rows = min(a.tile_rows, st.rows - row0);
        wait_tile(s, a, tile);
        const float *x = tile_x(s, a, tile);
        float *part = s.part + (tile % 2) * groups_of_rows * GROUPS * 4 * WARP;
        for (int rg = 0; rg * ROW_TILE < rows; rg++) {
            float acc[ROW_TILE * GROUP_UNITS];
            tile_products(acc, x + rg * ROW_TILE * a.n_in, a.n_in, w, t);
            part[((rg * GROUPS + t.group) * 4 + t.warp) * WARP + lane] = reduce_scatter(acc, lane);
        }
        __syncthreads();
        if (!a.keep) release_tile(s, a, tile, total);
        for (int i = threadIdx.x; i < rows * U; i += blockDim.x) { /* lane l of a warp summed row l / 4, unit l % 4 */
            const int r = i / U, u = i % U;
            const float *p = part + (((r / ROW_TILE) * GROUPS + u / GROUP_UNITS) * 4) * WARP +
                             (r % ROW_TILE) * GROUP_UNITS + u % GROUP_UNITS;
            s.h[(row0 + r) * U + u] = p[0] + p[WARP] + p[2 * WARP] + p[3 * WARP] + s.b1[u];
        }
    }
    if (!a.keep) n += st.tiles;
    __syncthreads();
}

/* Where this block's share of the logits goes in block `to`'s exchange (cluster), or in global memory (grid). */
template <bool CLUSTER>
__device__ float *share_slot(const Shared &s, const FusedArgs &a, int half, int from) {
    if constexpr (CLUSTER) return s.shares + ((size_t)half * gridDim.x + from) * round4(a.batch * a.n_out);
    return a.exchange + ((size_t)half * gridDim.x + from) * a.batch * a.n_out;
}

/* This block's share of the logits: sum over its units of relu(h[r, u]) * fc2.weight[o, u], element r * n_out + o,
 * written to its own slot. Cluster: then copied, whole, into the same slot of every other block (a bulk copy each,
 * sent by a lane of warp 0), each landing counted by the receiver's `arrived` barrier, which expects the shares of
 * all the others. Grid: the slot is in global memory. */
template <bool CLUSTER, int U>
__device__ void share_of_logits(const Shared &s, const FusedArgs &a, const Step &st) {
    const int items = st.rows * a.n_out;
    float *mine = share_slot<CLUSTER>(s, a, st.half, blockIdx.x);
    for (int item = threadIdx.x; item < items; item += blockDim.x) {
        const int r = item / a.n_out, o = item % a.n_out;
        float z = 0.0f;
#pragma unroll
        for (int u = 0; u < U; u++) z = fmaf(fmaxf(s.h[r * U + u], 0.0f), s.w2[o * U + u], z);
        mine[item] = z;
    }
#if __CUDA_ARCH__ >= 900
    if constexpr (CLUSTER) {
        const unsigned bytes = round4(items) * sizeof(float), others = gridDim.x - 1;
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); /* our writes, before the copy engine reads */
        __syncthreads();
        if (threadIdx.x == 0) mbarrier_expect_bytes(&s.arrived[st.half], others * bytes);
        if (threadIdx.x < gridDim.x && threadIdx.x != blockIdx.x)
            bulk_copy_to_block(mine, bytes, &s.arrived[st.half], threadIdx.x);
    }
#endif
}

/* A share, from this block's shared memory (cluster) or from global memory, past the L1 cache, which could hold an
 * old copy of the exchange buffer (grid). */
template <bool CLUSTER>
__device__ float read_share(const float *p) {
    if constexpr (CLUSTER) return *p;
    return __ldcg(p);
}

/* z + the shares of blocks q0 .. q1 - 1 for element `item`, added in block order; eight reads in flight at a time. */
template <bool CLUSTER>
__device__ float add_shares(float z, const Shared &s, const FusedArgs &a, int half, int item, int q0, int q1) {
    for (int q = q0; q < q1; q += 8) {
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = q + j < q1 ? read_share<CLUSTER>(share_slot<CLUSTER>(s, a, half, q + j) + item) : 0.0f;
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (q + j < q1) z += v[j];
    }
    return z;
}

/* The end of the exchange. Cluster: wait until every block's share has landed here (the step's `arrived` barrier;
 * each half is used every other step, hence the parity). Grid: every block waits for all at grid_barrier. */
template <bool CLUSTER>
__device__ void exchange_barrier(const Shared &s, const FusedArgs &a, const Step &st) {
#if __CUDA_ARCH__ >= 900
    if constexpr (CLUSTER) {
        mbarrier_wait(&s.arrived[st.half], st.index / 2 % 2);
        return;
    }
#endif
    grid_barrier(a.barrier, gridDim.x);
}

/* Softmax of one row's logits z (lane o holds z[o]; lanes past n_out hold -inf), its loss and its dlogits. */
__device__ void softmax_row(float z, int label, int rows, int n_out, float *dz_row, float *loss) {
    const int lane = threadIdx.x % WARP;
    const float top = warp_max(z);
    const float e = lane < n_out ? expf(z - top) : 0.0f;
    const float sum = warp_sum(e);
    const float z_label = __shfl_sync(0xffffffffu, z, label);
    if (lane < n_out) dz_row[lane] = (e / sum - (lane == label ? 1.0f : 0.0f)) / (float)rows;
    if (lane == 0) *loss = logf(sum) - (z_label - top);
}

/* Softmax, loss and dlogits. Logit o = fc2.bias[o] + the G shares, added in block order: the same bits in every
 * block. Cluster, or a grid with one barrier: every block does every row, a warp a row. A grid with two barriers:
 * block g does rows g, g + G, ..., its warps splitting the shares of a row into runs, and hands its rows round
 * through global memory; after the second barrier every block reads all of them. */
template <bool CLUSTER>
__device__ void softmax_and_dlogits(const Shared &s, const FusedArgs &a, const Step &st) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    const int G = gridDim.x, O = a.n_out;
    if (CLUSTER || !a.two_barriers) {
        for (int r = warp; r < st.rows; r += warps) {
            float z = -INFINITY;
            if (lane < O) z = add_shares<CLUSTER>(s.b2[lane], s, a, st.half, r * O + lane, 0, G);
            softmax_row(z, s.labels[r], st.rows, O, s.dz + r * O, s.row_loss + r);
        }
        __syncthreads();
        return;
    }
    float *dz_all = a.exchange + 2 * (size_t)G * a.batch * O, *loss_all = dz_all + (size_t)a.batch * O;
    const int mine = st.rows > blockIdx.x ? cdiv(st.rows - blockIdx.x, G) : 0; /* rows of this block */
    for (int first = 0; first < mine; first += warps) {
        const int here = min(warps, mine - first), runs = warps / here; /* runs of blocks per row */
        const int j = warp / runs, run = warp % runs;
        if (j < here) {
            const int r = blockIdx.x + (first + j) * G;
            s.sums[warp * MAX_OUT + lane] =
                lane < O ? add_shares<false>(0.0f, s, a, st.half, r * O + lane, run * G / runs, (run + 1) * G / runs) : 0.0f;
        }
        __syncthreads();
        if (warp < here) {
            const int r = blockIdx.x + (first + warp) * G;
            float z = -INFINITY;
            if (lane < O) {
                z = s.b2[lane];
                for (int run = 0; run < runs; run++) z += s.sums[(warp * runs + run) * MAX_OUT + lane];
            }
            softmax_row(z, s.labels[r], st.rows, O, dz_all + r * O, loss_all + r);
        }
        __syncthreads();
    }
    grid_barrier(a.barrier, G);
    for (int i = threadIdx.x; i < st.rows * O; i += blockDim.x) s.dz[i] = __ldcg(dz_all + i);
    if (blockIdx.x == 0)
        for (int r = threadIdx.x; r < st.rows; r += blockDim.x) s.row_loss[r] = __ldcg(loss_all + r);
    __syncthreads();
}

/* The step's mean loss (block 0, its first warp): row losses added in double, lane l taking rows l, l + 32, ..., then
 * the lanes by a fixed tree. */
__device__ void record_loss(const Shared &s, const FusedArgs &a, const Step &st) {
    if (blockIdx.x != 0 || threadIdx.x >= WARP) return;
    double total = 0.0;
    for (int r = threadIdx.x; r < st.rows; r += WARP) total += s.row_loss[r];
    for (int offset = WARP / 2; offset > 0; offset /= 2) total += __shfl_xor_sync(0xffffffffu, total, offset);
    if (threadIdx.x == 0) a.losses[st.index] = (float)(total / st.rows);
}

/* The backward's sums over the step's rows, in a fixed order, for output o < n_out, or (o == n_out) db1:
 *   o < n_out:  dW2 (o, u) = sum of dlogits[r, o] * relu(h[r, u]) for every unit u, and db2 (o) = sum of dlogits[r, o];
 *   o == n_out: db1 (u) = sum of dh[r, u].
 * A warp an o: lane l takes unit l % U of rows l / U, l / U + 32 / U, ..., so the warp reads 32 neighbouring floats
 * of h (a bank each: lanes striding over rows of h would queue on the same banks), then adds the rows' lanes by a
 * fixed tree. Returns lane l's sum for unit l (lanes below U); *bias gets db2 (o). */
template <int U>
__device__ float sum_over_rows(const Shared &s, const FusedArgs &a, int rows, int o, float *bias) {
    static_assert(WARP % U == 0, "a warp holds whole rows of units");
    const int lane = threadIdx.x % WARP, u = lane % U, O = a.n_out;
    float sum = 0.0f, dz_sum = 0.0f;
#pragma unroll 4
    for (int r = lane / U; r < rows; r += WARP / U) {
        if (o < O) {
            const float dz = s.dz[r * O + o];
            sum = fmaf(dz, fmaxf(s.h[r * U + u], 0.0f), sum);
            dz_sum += dz;
        } else {
            sum += s.dh[r * U + u];
        }
    }
#pragma unroll
    for (int offset = U; offset < WARP; offset *= 2) {
        sum += __shfl_xor_sync(0xffffffffu, sum, offset);
        dz_sum += __shfl_xor_sync(0xffffffffu, dz_sum, offset);
    }
    *bias = dz_sum;
    return sum;
}

/* The backward's small products, then the update of what is small (the weights before it fed dh):
 *   dW2 (o, u) = sum over rows of dlogits[r, o] * relu(h[r, u]);  db2 (o) = sum over rows of dlogits[r, o];
 *   dh (r, u) = (dlogits W2)[r, u] where h > 0, else 0;  db1 (u) = sum over rows of dh[r, u]. */
template <int U>
__device__ void backward_small(const Shared &s, const FusedArgs &a, const Step &st) {
    const int O = a.n_out, lane = threadIdx.x % WARP, warps = blockDim.x / WARP;
    for (int o = threadIdx.x / WARP; o < O; o += warps) {
        float db2;
        const float dw2 = sum_over_rows<U>(s, a, st.rows, o, &db2);
        if (lane < U) s.gw2[o * U + lane] = dw2;
        if (lane == 0) s.gb2[o] = db2;
    }
    for (int i = threadIdx.x; i < st.rows * U; i += blockDim.x) {
        const int r = i / U, u = i % U;
        float da = 0.0f;
#pragma unroll 4
        for (int o = 0; o < O; o++) da = fmaf(s.dz[r * O + o], s.w2[o * U + u], da);
        s.dh[i] = s.h[i] > 0.0f ? da : 0.0f;
    }
    __syncthreads();
    if (threadIdx.x / WARP == O % warps) { /* db1: the warp after the last dW2's, often idle until now */
        float unused;
        const float db1 = sum_over_rows<U>(s, a, st.rows, O, &unused);
        if (lane < U) s.b1[lane] = fmaf(-a.lr, db1, s.b1[lane]);
    }
    for (int i = threadIdx.x; i < O * U; i += blockDim.x) s.w2[i] = fmaf(-a.lr, s.gw2[i], s.w2[i]);
    for (int o = threadIdx.x; o < O; o += blockDim.x) s.b2[o] = fmaf(-a.lr, s.gb2[o], s.b2[o]);
}

/* dW1 (u, k) = sum over rows of dh[r, u] * x[r, k], for this thread's 4 units and columns, in registers, tile by tile
 * of x (a kept tile is still there); then W1 -= lr dW1, in registers. n: past the step's tiles on return. */
template <int GROUPS>
__device__ void dw1_and_update(const Shared &s, const FusedArgs &a, const Step &st, float4 (&w)[COLUMNS][GROUP_UNITS],
                               const Thread &t, int &n, int total) {
    constexpr int U = GROUPS * GROUP_UNITS;
    float4 grad[COLUMNS][GROUP_UNITS];
#pragma unroll
    for (int c = 0; c < COLUMNS; c++)
#pragma unroll
        for (int u = 0; u < GROUP_UNITS; u++) grad[c][u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int k = 0; k < st.tiles; k++) {
        const int tile = n + k, row0 = tile_row0(a, st, k), rows = min(a.tile_rows, st.rows - row0);
        if (!a.keep) wait_tile(s, a, tile);
        const float *x = tile_x(s, a, tile);
        for (int r = 0; r < rows; r++) {
            const float4 d = reinterpret_cast<const float4 *>(s.dh + (row0 + r) * U)[t.group];
            const float dr[GROUP_UNITS] = {d.x, d.y, d.z, d.w};
#pragma unroll
            for (int c = 0; c < COLUMNS; c++) {
                const int column = t.lane + c * GROUP_LANES;
                if (column >= t.columns) continue;
                const float4 xv = reinterpret_cast<const float4 *>(x + r * a.n_in)[column];
#pragma unroll
                for (int u = 0; u < GROUP_UNITS; u++) {
                    grad[c][u].x = fmaf(dr[u], xv.x, grad[c][u].x);
                    grad[c][u].y = fmaf(dr[u], xv.y, grad[c][u].y);
                    grad[c][u].z = fmaf(dr[u], xv.z, grad[c][u].z);
                    grad[c][u].w = fmaf(dr[u], xv.w, grad[c][u].w);
                }
            }
        }
        stress_pause(st, 2); /* scaffold */
        __syncthreads(); /* the whole block is done with the tile */
        release_tile(s, a, tile, total);
    }
    n += st.tiles;
#pragma unroll
    for (int c = 0; c < COLUMNS; c++)
#pragma unroll
        for (int u = 0; u < GROUP_UNITS; u++) {
            w[c][u].x = fmaf(-a.lr, grad[c][u].x, w[c][u].x);
            w[c][u].y = fmaf(-a.lr, grad[c][u].y, w[c][u].y);
            w[c][u].z = fmaf(-a.lr, grad[c][u].z, w[c][u].z);
            w[c][u].w = fmaf(-a.lr, grad[c][u].w, w[c][u].w);
        }
}

/* ---- the kernel: the phases of every step, in order ----
 * GROUPS: groups of 4 units per block (U = 4 GROUPS units, 128 GROUPS threads). CLUSTER: how the shares travel. */
template <int GROUPS, bool CLUSTER>
__global__ void __launch_bounds__(GROUPS *GROUP_LANES, 1) fused_epoch_kernel(const FusedArgs a) {
#if __CUDA_ARCH__ >= 900
    constexpr int U = GROUPS * GROUP_UNITS;
    extern __shared__ float4 smem4[];
    const Shared s = carve(reinterpret_cast<float *>(smem4), layout(a, GROUPS, gridDim.x, CLUSTER));
    const Thread t = this_thread(a);
    const int2 own = owned_units(blockIdx.x, a.units, a.hidden);
    float4 w[COLUMNS][GROUP_UNITS]; /* this thread's part of fc1.weight, for the whole launch */
    load_owned(w, s, a, t, own, U);
    const int total = tile_count(a);
    Rows rows = start_rows(s, a); /* before the first copies, which read the image numbers */
    start_tiles<CLUSTER>(s, a, total);
    int n = 0; /* the next tile of x to read */
    PhaseClock clock{clock64(), {}}; /* scaffold */
    for (int index = 0; index < a.steps; index++) {
        const Step st = step_at(a, index);
        next_rows(s, a, st, rows);
        phase_done(clock, 0); /* scaffold */
        forward<GROUPS>(s, a, st, w, t, n, total);
        phase_done(clock, 1); /* scaffold */
        stress_pause(st, 0); /* scaffold */
        share_of_logits<CLUSTER, U>(s, a, st);
        phase_done(clock, 2); /* scaffold */
        exchange_barrier<CLUSTER>(s, a, st);
        phase_done(clock, 3); /* scaffold */
        stress_pause(st, 1); /* scaffold */
        softmax_and_dlogits<CLUSTER>(s, a, st);
        record_loss(s, a, st);
        phase_done(clock, 4); /* scaffold */
        backward_small<U>(s, a, st);
        phase_done(clock, 5); /* scaffold */
        dw1_and_update<GROUPS>(s, a, st, w, t, n, total);
        phase_done(clock, 6); /* scaffold */
    }
    store_owned(w, s, a, t, own, U);
    phases_recorded(clock); /* scaffold */
    if (CLUSTER) cluster_barrier(); /* no block leaves while another may still write into its memory */
#else
    __trap(); /* make_plan fuses on compute capability 9.0 and up only */
#endif
}

/* ---- the plan: how a batch size is run, fused or not ---- */

struct FusedPlan {
    int fused;         /* 1: the fused kernel; 0: level 6's queued kernels */
    int cluster;       /* 1: one thread-block cluster; 0: a cooperative grid */
    int blocks, units; /* G blocks of U units (4 x groups) */
    int tile_rows, slots, keep, two_barriers;
    size_t smem;       /* bytes of dynamic shared memory per block */
    char why[200];     /* for mlp_fused_plan */
};

/* The kernel for `units` per block (4, 8 or 16) and the plan's exchange. */
template <bool CLUSTER>
static const void *kernel_for(int units) {
    switch (units) {
    case 4: return reinterpret_cast<const void *>(fused_epoch_kernel<1, CLUSTER>);
    case 8: return reinterpret_cast<const void *>(fused_epoch_kernel<2, CLUSTER>);
    default: return reinterpret_cast<const void *>(fused_epoch_kernel<4, CLUSTER>);
    }
}

static const void *kernel_for(const FusedPlan &plan) {
    return plan.cluster ? kernel_for<true>(plan.units) : kernel_for<false>(plan.units);
}

/* The launch of the plan's kernel: one cluster of all the blocks, or a cooperative grid. */
static cudaLaunchConfig_t launch_config(const FusedPlan &plan, cudaStream_t stream, cudaLaunchAttribute *attributes) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(plan.blocks);
    config.blockDim = dim3(plan.units / GROUP_UNITS * GROUP_LANES);
    config.dynamicSmemBytes = plan.smem;
    config.stream = stream;
    config.attrs = attributes;
    if (plan.cluster) {
        attributes[config.numAttrs].id = cudaLaunchAttributeClusterDimension;
        attributes[config.numAttrs++].val.clusterDim = {(unsigned)plan.blocks, 1, 1};
    } else {
        attributes[config.numAttrs].id = cudaLaunchAttributeCooperative;
        attributes[config.numAttrs++].val.cooperative = 1;
    }
    return config;
}

/* Does the plan's launch fit on this GPU at once? Sets *why when not. */
static int fits(const FusedPlan &plan, cudaStream_t stream, int sms, const char **why) {
    const void *kernel = kernel_for(plan);
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)plan.smem));
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    cudaLaunchAttribute attributes[1];
    const cudaLaunchConfig_t config = launch_config(plan, stream, attributes);
    if (plan.cluster) {
        int clusters = 0;
        const cudaError_t err = cudaOccupancyMaxActiveClusters(&clusters, kernel, &config);
        if (err != cudaSuccess) (void)cudaGetLastError(); /* a size this GPU refuses: not a failure, a "no" */
        if (err != cudaSuccess || clusters < 1) *why = "its cluster does not fit on the GPU";
    } else {
        int per_sm = 0;
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, (int)config.blockDim.x, plan.smem));
        if ((long)per_sm * sms < plan.blocks) *why = "its blocks do not all fit on the GPU at once";
    }
    return MLP_OK;
}

static int knob(const char *name, int otherwise) {
    const char *value = getenv(name);
    return value && atoi(value) > 0 ? atoi(value) : otherwise;
}

/* Sizes, tiles and shared memory of a plan of `units` per block, in one cluster or a grid. */
static void lay_out(FusedPlan *plan, const mlp *m, int batch, int units, int cluster) {
    plan->cluster = cluster;
    plan->units = units;
    plan->blocks = cdiv(m->hidden, units);
    plan->keep = batch <= KEEP_ROWS;
    plan->tile_rows = plan->keep ? cdiv(batch, ROW_TILE) * ROW_TILE : STREAM_ROWS;
    plan->slots = plan->keep ? 2 : STREAM_SLOTS;
    plan->two_barriers = !cluster && (size_t)plan->blocks * batch > 4096; /* all blocks reading G x B shares: too many */
    FusedArgs sizes{};
    sizes.n_in = m->n_in, sizes.n_out = m->n_out, sizes.batch = batch;
    sizes.tile_rows = plan->tile_rows, sizes.slots = plan->slots;
    plan->smem = sizeof(float) * layout(sizes, units / GROUP_UNITS, plan->blocks, cluster).total;
}

/* Lays out a plan and says why it cannot run (NULL: it can). */
static int try_plan(FusedPlan *plan, mlp *m, int batch, int units, int cluster, int sms, int optin, const char **no) {
    *no = NULL;
    lay_out(plan, m, batch, units, cluster);
    if (plan->smem > (size_t)optin) *no = "the batch does not fit in shared memory";
    else if (batch > LABEL_ROWS * units / GROUP_UNITS * GROUP_LANES) *no = "the batch is more than 4 rows a thread";
    else return fits(*plan, m->stream, sms, no);
    return MLP_OK;
}

static int make_plan(mlp *m, int batch, FusedPlan *plan) {
    *plan = FusedPlan{};
    int device = 0, sms = 0, optin = 0, major = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    const char *exchange = getenv("MLP_FUSED_EXCHANGE");
    int units = knob("MLP_FUSED_UNITS", 0);
    if (units != 4 && units != 8 && units != 16) units = 0;
    const char *no = NULL;
    int status = MLP_OK;
    if (major < 9) no = "it needs a Hopper GPU, compute capability 9.0 (thread-block clusters, bulk copies)";
    else if (m->n_in % 4 || m->n_in > 4 * GROUP_LANES * COLUMNS || m->n_out > MAX_OUT)
        no = "inputs not a multiple of 4 or more than 1,024 of them, or more than 32 outputs";
    /* One cluster where the batch is small and the blocks fit in one: the step is then latency, which the cluster's
     * barrier and its writes into shared memory cut. Else a cooperative grid, a block per SM or so. */
    bool done = no != NULL;
    if (!done && !(exchange && !strcmp(exchange, "grid")) && batch <= KEEP_ROWS &&
        cdiv(m->hidden, units ? units : 16) <= MAX_CLUSTER) {
        status = try_plan(plan, m, batch, units ? units : 16, 1, sms, optin, &no);
        done = !no;
    }
    if (!done && !status) {
        const int grid_units = units ? units : (cdiv(m->hidden, 8) <= sms ? 8 : 16);
        status = try_plan(plan, m, batch, grid_units, 0, sms, optin, &no);
    }
    if (status) return status;
    plan->fused = !no;
    if (no)
        snprintf(plan->why, sizeof plan->why, "level 6's queued kernels (not fused: %s; hidden %d, batch %d)", no,
                 m->hidden, batch);
    else if (plan->cluster)
        snprintf(plan->why, sizeof plan->why,
                 "fused: a cluster of %d blocks x %d units, one barrier per step, %zu bytes of shared memory",
                 plan->blocks, plan->units, plan->smem);
    else
        snprintf(plan->why, sizeof plan->why,
                 "fused: a grid of %d blocks x %d units, %s per step, %zu bytes of shared memory", plan->blocks,
                 plan->units, plan->two_barriers ? "two barriers" : "one barrier", plan->smem);
    return MLP_OK;
}

/* ---- level 7's own state: the last plan, and the grid's exchange buffer and barrier, made at the first grid launch ---- */

struct FusedState {
    FusedPlan plan;    /* the plan of the last epoch: made again when the batch size or a knob changes */
    int plan_batch;
    char plan_knobs[128];
    float *exchange;   /* (exchange_capacity) what the blocks of a grid hand each other */
    int exchange_capacity;
    unsigned *barrier; /* (2) the grid barrier: arrivals, generation */
};

static int free_epoch_state(mlp *m) {
    FusedState *state = static_cast<FusedState *>(m->epoch_state);
    if (!state) return MLP_OK;
    const cudaError_t err = free_device({state->exchange, state->barrier});
    free(state);
    m->epoch_state = NULL;
    CUDA_CHECK(err);
    return MLP_OK;
}

/* The knobs as they are now, one string. */
static void knob_values(char *out, size_t size) {
    const char *names[] = {"MLP_FUSED_UNITS", "MLP_FUSED_EXCHANGE"};
    out[0] = 0;
    for (const char *name : names) {
        const char *value = getenv(name);
        snprintf(out + strlen(out), size - strlen(out), "%s|", value ? value : "");
    }
}

/* The state, made at the first epoch, and the plan for this batch size (made once per batch size and knobs: asking
 * the GPU what fits takes longer than a short epoch's steps). */
static int plan_for(mlp *m, int batch_size, FusedState **out) {
    if (!m->epoch_state) {
        m->epoch_state = calloc(1, sizeof(FusedState));
        if (!m->epoch_state) return FAIL(MLP_ERR_ALLOC, "out of memory for level 7's state");
    }
    FusedState *state = static_cast<FusedState *>(m->epoch_state);
    char knobs[sizeof state->plan_knobs];
    knob_values(knobs, sizeof knobs);
    if (state->plan_batch != batch_size || strcmp(knobs, state->plan_knobs)) {
        state->plan_batch = 0;
        const int status = make_plan(m, batch_size, &state->plan);
        if (status) return status;
        state->plan_batch = batch_size;
        strcpy(state->plan_knobs, knobs);
    }
    *out = state;
    return MLP_OK;
}

/* The grid's exchange buffer and barrier, grown to this plan's size. */
static int grid_buffers(mlp *m, FusedState *state, int batch_size) {
    const size_t exchange = 2 * (size_t)state->plan.blocks * batch_size * m->n_out + (size_t)batch_size * (m->n_out + 1);
    if (exchange > (size_t)MLP_MAX_ELEMENTS) return FAIL(MLP_ERR_ARG, "exchange buffer of %zu floats", exchange);
    const int status = ensure_buffer(&state->exchange, &state->exchange_capacity, (int)exchange);
    if (status) return status;
    if (!state->barrier) {
        CUDA_CHECK(device_malloc(&state->barrier, 2 * sizeof(unsigned)));
        CUDA_CHECK(cudaMemsetAsync(state->barrier, 0, 2 * sizeof(unsigned), m->stream));
    }
    return MLP_OK;
}

/* The hook of common/native/cuda_mlp.cuh: the steps of this call, fused when they fit. */
static int train_steps(mlp *m, int n_order, int batch_size, float lr) {
#ifdef LAB_TODO_DEVICE /* the student edition: a device function above is still its stub (mlp_status.h) */
    return FAIL(MLP_ERR_ARG, "%s", LAB_TODO_DEVICE);
#endif
    FusedState *state = NULL;
    int status = plan_for(m, batch_size, &state);
    if (status) return status;
    const FusedPlan &plan = state->plan;
    if (!plan.fused) return queue_steps(m, n_order, batch_size, lr);
    FusedArgs args{};
    if (!plan.cluster) {
        status = grid_buffers(m, state, batch_size);
        if (status) return status;
        args.exchange = state->exchange, args.barrier = state->barrier;
    }
    args.w1 = m->w1, args.b1 = m->b1, args.w2 = m->w2, args.b2 = m->b2;
    args.data_x = m->data_x, args.data_y = m->data_y, args.order = m->order;
    args.losses = m->losses;
    args.n_in = m->n_in, args.n_out = m->n_out, args.hidden = m->hidden, args.units = plan.units;
    args.n_order = n_order, args.batch = batch_size, args.steps = cdiv(n_order, batch_size);
    args.tile_rows = plan.tile_rows, args.slots = plan.slots, args.keep = plan.keep;
    args.two_barriers = plan.two_barriers;
    args.lr = lr;
    void *params[] = {&args};
    cudaLaunchAttribute attributes[1];
    const cudaLaunchConfig_t config = launch_config(plan, m->stream, attributes);
    /* The kernel's shared memory allowance is the GPU's, not the model's: another model's plan may have set it since. */
    CUDA_CHECK(cudaFuncSetAttribute(kernel_for(plan), cudaFuncAttributeMaxDynamicSharedMemorySize, (int)plan.smem));
    CUDA_CHECK(cudaLaunchKernelExC(&config, kernel_for(plan), params));
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
 * the Python side warns when it is not fused). The plan is the one train_steps uses (plan_for: made once per batch
 * size and knobs); its text is copied into a buffer of the calling thread. */
extern "C" const char *mlp_fused_plan(mlp *m, int batch_size) {
    static MLP_THREAD_LOCAL char why[sizeof FusedPlan{}.why];
    FusedState *state = NULL;
    if (!m || batch_size < 1 || plan_for(m, batch_size, &state)) return "no plan: bad arguments or a CUDA error";
    memcpy(why, state->plan.why, sizeof why);
    return why;
}
