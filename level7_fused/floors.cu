/* level7_fused/floors.cu - what the hand-over of a step costs at the least, measured alone on this GPU.
 *
 * Each step of level 7's fused kernel hands the blocks' shares of the logits round and waits at a barrier. These
 * kernels do only that, round after round, with level 7's own barriers and share slots (so the numbers are floors of
 * the real thing): in a cluster, each block writes its share into every block's shared memory; in a grid, into
 * global memory, read back by every block. And one more: a ping-pong between two blocks of a cluster through their
 * shared memory, the latency of one distributed-shared-memory hop there and back. Driven by common/harness/level7_floors.py.
 */
#include "mlp.cu"

extern "C" {
/* cdef-begin */
int floor_exchange(int cluster, int blocks, int rounds, int shares, double *microseconds);
int floor_round_trip(int cluster_size, int rounds, double *microseconds);
/* cdef-end */
}

#define SHARE_ROWS 8 /* a share: the chapter's batch of 8 rows x 10 logits */
#define SHARE_OUT 10
#define SHARE (SHARE_ROWS * SHARE_OUT)
#define SHARE_UNITS 16 /* the units of a block, whose share it adds up */

/* Round k: the exchange of level 7's step with shares of the chapter's size (share_of_logits, exchange_barrier, then
 * every block's share read and added), or (shares == 0) the barrier alone: grid_barrier, or the cluster's barrier. */
template <bool CLUSTER>
__global__ void exchange_kernel(float *global_shares, unsigned *barrier, int rounds, int shares, float *sink) {
    __shared__ float own[2 * MAX_CLUSTER * SHARE], h[SHARE_ROWS * SHARE_UNITS], w2[SHARE_OUT * SHARE_UNITS];
    __shared__ unsigned long long arrived[2];
    FusedArgs a{};
    a.exchange = global_shares, a.barrier = barrier, a.batch = SHARE_ROWS, a.n_out = SHARE_OUT;
    Shared s{};
    s.shares = own, s.h = h, s.w2 = w2, s.arrived = arrived;
    for (int i = threadIdx.x; i < SHARE_ROWS * SHARE_UNITS; i += blockDim.x) h[i] = 0.5f;
    for (int i = threadIdx.x; i < SHARE_OUT * SHARE_UNITS; i += blockDim.x) w2[i] = 0.25f;
#if __CUDA_ARCH__ >= 900
    if (CLUSTER && threadIdx.x == 0) {
        mbarrier_init(&arrived[0], 1);
        mbarrier_init(&arrived[1], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
#endif
    if constexpr (CLUSTER) cluster_barrier();
    else __syncthreads();
    float total = 0.0f;
    for (int k = 0; k < rounds; k++) {
        Step st{};
        st.index = k, st.half = k % 2, st.rows = SHARE_ROWS;
        if (shares) {
            share_of_logits<CLUSTER, SHARE_UNITS>(s, a, st);
            exchange_barrier<CLUSTER>(s, a, st);
            if (threadIdx.x < SHARE) total = add_shares<CLUSTER>(total, s, a, st.half, threadIdx.x, 0, gridDim.x);
        } else if (CLUSTER) {
            cluster_barrier();
        } else {
            grid_barrier(barrier, gridDim.x);
        }
    }
    if constexpr (CLUSTER) cluster_barrier();
    if (total == -1.0f) *sink = total; /* never true: keeps the reads */
}

/* Block 0 and the cluster's last block pass a counter back and forth through each other's shared memory. */
__global__ void round_trip_kernel(int rounds) {
#if __CUDA_ARCH__ >= 900
    __shared__ int mailbox_memory;
    volatile int &mailbox = mailbox_memory;
    cg::cluster_group cluster = cg::this_cluster();
    const unsigned me = cluster.block_rank(), last = cluster.num_blocks() - 1;
    if (threadIdx.x == 0) mailbox = -1;
    cluster.sync();
    if (threadIdx.x == 0 && (me == 0 || me == last)) {
        volatile int *theirs = cluster.map_shared_rank(&mailbox_memory, me == 0 ? last : 0);
        for (int k = 0; k < rounds; k++) {
            if (me == 0) {
                *theirs = k;
                while (mailbox != k) {
                }
            } else {
                while (mailbox != k) {
                }
                *theirs = k;
            }
        }
    }
    cluster.sync();
#endif
}

/* Milliseconds of one launch of `launch`, timed with events on the default stream. */
template <typename Launch>
static int time_ms(Launch launch, float *ms) {
    cudaEvent_t start, stop;
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
    CUDA_CHECK(cudaEventRecord(start));
    const int status = launch();
    CUDA_CHECK(cudaEventRecord(stop));
    CUDA_CHECK(cudaEventSynchronize(stop));
    CUDA_CHECK(cudaEventElapsedTime(ms, start, stop));
    CUDA_CHECK(cudaEventDestroy(start));
    CUDA_CHECK(cudaEventDestroy(stop));
    return status;
}

/* The launch of `kernel` on `blocks` blocks of FUSED_THREADS as one cluster of them all, or as a cooperative grid. */
static int launch(const void *kernel, bool cluster, int blocks, void **params) {
    FusedPlan plan{};
    plan.cluster = cluster, plan.blocks = blocks, plan.units = FUSED_THREADS / GROUP_LANES * GROUP_UNITS;
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    cudaLaunchAttribute attributes[1];
    const cudaLaunchConfig_t config = launch_config(plan, 0, attributes);
    CUDA_CHECK(cudaLaunchKernelExC(&config, kernel, params));
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
}

/* Microseconds per round: (time of 2R rounds - time of R rounds) / R, which cancels the launch. */
template <typename Run>
static int per_round(Run run, int rounds, double *microseconds) {
    float short_ms = 0.0f, long_ms = 0.0f;
    int status = time_ms([&] { return run(rounds); }, &short_ms); /* also the warm-up */
    if (!status) status = time_ms([&] { return run(rounds); }, &short_ms);
    if (!status) status = time_ms([&] { return run(2 * rounds); }, &long_ms);
    *microseconds = 1e3 * (long_ms - short_ms) / rounds;
    return status;
}

int floor_exchange(int cluster, int blocks, int rounds, int shares, double *microseconds) {
    if (blocks < 1 || rounds < 1 || !microseconds || (cluster && blocks > MAX_CLUSTER))
        return FAIL(MLP_ERR_ARG, "bad arguments");
    float *global_shares = NULL, *sink = NULL;
    unsigned *barrier = NULL;
    CUDA_CHECK(cudaMalloc(&global_shares, sizeof(float) * 2 * SHARE * blocks));
    CUDA_CHECK(cudaMalloc(&sink, sizeof(float)));
    CUDA_CHECK(cudaMalloc(&barrier, 2 * sizeof(unsigned)));
    CUDA_CHECK(cudaMemset(barrier, 0, 2 * sizeof(unsigned)));
    const void *kernel = cluster ? reinterpret_cast<const void *>(exchange_kernel<true>)
                                 : reinterpret_cast<const void *>(exchange_kernel<false>);
    const int status = per_round([&](int n) {
        void *params[] = {&global_shares, &barrier, &n, &shares, &sink};
        return launch(kernel, cluster, blocks, params);
    }, rounds, microseconds);
    CUDA_CHECK(cudaFree(global_shares));
    CUDA_CHECK(cudaFree(sink));
    CUDA_CHECK(cudaFree(barrier));
    return status;
}

int floor_round_trip(int cluster_size, int rounds, double *microseconds) {
    if (cluster_size < 2 || cluster_size > MAX_CLUSTER || rounds < 1 || !microseconds)
        return FAIL(MLP_ERR_ARG, "bad arguments");
    return per_round([&](int n) {
        void *params[] = {&n};
        return launch(reinterpret_cast<const void *>(round_trip_kernel), true, cluster_size, params);
    }, rounds, microseconds);
}
