/* tests/lab_level7.cu - level 7's device functions one at a time, for the lab's grader (tests/test_tasks.py).
 *
 * grid_barrier (task 7.1) and owned_units (7.2) are device functions of level7_fused/mlp.cu. Each runs here in a
 * small kernel of its own, which records what it did, so that each is checked alone, outside the fused kernel.
 * Built on a GPU machine by `make build/lab_level7.so`; the Python side reads the declarations between the cdef
 * markers. A barrier that never opens hangs its kernel, so test_tasks.py calls lab_grid_barrier in a child process
 * that it ends after a deadline.
 */
#include "../level7_fused/mlp.cu"

extern "C" {
/* cdef-begin */
int lab_grid_barrier(int blocks, int rounds, int *late, int *launched);
int lab_owned_units(int hidden, int units, int *j0, int *owned);
/* cdef-end */
}

/* Round k: each block writes k into its slot, waits at the barrier, then reads every block's slot, and counts in
 * *late each slot that does not hold k yet - a block let through before the last one arrived. The slots of round
 * k are those of its parity, as level 7's exchange buffer: a block may write round k + 1's while others read. */
__global__ void barrier_kernel(unsigned *barrier, int *slots, int *late, int rounds) {
    const unsigned G = gridDim.x;
    for (int k = 1; k <= rounds; k++) {
        int *round = slots + (size_t)(k % 2) * G;
        if (threadIdx.x == 0) __stcg(round + blockIdx.x, k);
        grid_barrier(barrier, G);
        for (unsigned b = threadIdx.x; b < G; b += blockDim.x)
            if (__ldcg(round + b) != k) atomicAdd(late, 1);
    }
}

/* Every block of the largest grid that is resident at once (a cooperative launch, as level 7's); *launched says
 * how many that was. */
int lab_grid_barrier(int blocks, int rounds, int *late, int *launched) {
    int device = 0, sms = 0, per_sm = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, barrier_kernel, FUSED_THREADS, 0));
    const int G = blocks < sms * per_sm ? blocks : sms * per_sm;
    unsigned *barrier = NULL;
    int *slots = NULL, *d_late = NULL;
    cudaError_t err = cudaMalloc(&barrier, 2 * sizeof(unsigned));
    if (err == cudaSuccess) err = cudaMalloc(&slots, 2 * (size_t)G * sizeof(int));
    if (err == cudaSuccess) err = cudaMalloc(&d_late, sizeof(int));
    if (err == cudaSuccess) err = cudaMemset(barrier, 0, 2 * sizeof(unsigned));
    if (err == cudaSuccess) err = cudaMemset(slots, 0, 2 * (size_t)G * sizeof(int));
    if (err == cudaSuccess) err = cudaMemset(d_late, 0, sizeof(int));
    void *args[] = {&barrier, &slots, &d_late, &rounds};
    if (err == cudaSuccess)
        err = cudaLaunchCooperativeKernel(reinterpret_cast<void *>(barrier_kernel), G, FUSED_THREADS, args, 0, 0);
    if (err == cudaSuccess) err = cudaDeviceSynchronize();
    if (err == cudaSuccess) err = cudaMemcpy(late, d_late, sizeof(int), cudaMemcpyDeviceToHost);
    const cudaError_t freed = free_device({barrier, slots, d_late});
    CUDA_CHECK(err);
    CUDA_CHECK(freed);
    *launched = G;
    return MLP_OK;
}

/* Block g's owned_units, for every block of a grid that covers hidden in blocks of units. */
__global__ void owned_units_kernel(int hidden, int units, int *j0, int *owned) {
    if (threadIdx.x) return;
    const int2 own = owned_units(blockIdx.x, units, hidden);
    j0[blockIdx.x] = own.x, owned[blockIdx.x] = own.y;
}

/* j0 (G) and owned (G), G = ceil(hidden / units), as level 7's plan launches them. */
int lab_owned_units(int hidden, int units, int *j0, int *owned) {
    const int G = (hidden + units - 1) / units;
    int *d_j0 = NULL, *d_owned = NULL;
    cudaError_t err = cudaMalloc(&d_j0, sizeof(int) * G);
    if (err == cudaSuccess) err = cudaMalloc(&d_owned, sizeof(int) * G);
    if (err == cudaSuccess) {
        owned_units_kernel<<<G, WARP>>>(hidden, units, d_j0, d_owned);
        err = cudaGetLastError();
    }
    if (err == cudaSuccess) err = cudaMemcpy(j0, d_j0, sizeof(int) * G, cudaMemcpyDeviceToHost);
    if (err == cudaSuccess) err = cudaMemcpy(owned, d_owned, sizeof(int) * G, cudaMemcpyDeviceToHost);
    const cudaError_t freed = free_device({d_j0, d_owned});
    CUDA_CHECK(err);
    CUDA_CHECK(freed);
    return MLP_OK;
}
