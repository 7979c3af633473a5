/* level7_fused/lenet.cu - Level 7 for LeNet-5: the forward pass as one fused kernel, for inference.
 *
 * What this adds over level 6: level 6's forward is eleven library calls, each a kernel that writes its layer to
 * global memory for the next one to read back. At batch 1 the whole forward is 0.56 MFLOP, a few microseconds of one
 * multiprocessor, and eleven launches in a row cost more than the arithmetic. Here one kernel does it all. Its blocks
 * are persistent, at most one per multiprocessor: each copies all the parameters (178 KB) into its shared memory once,
 * then takes groups of FUSED_IMAGES images through every layer without leaving the chip, in four phases:
 *   1. start copying the images and the weights into shared memory, without waiting (cp.async): the convolutions'
 *      weights first, the fully connected layers' (most of the 178 KB) after, arriving while phases 2 and 3 compute;
 *   2. conv1, ReLU and max-pool together: a thread per pooled output, its four convolution outputs computed from a
 *      6x6 patch of the image held in registers (the four 5x5 windows under one 2x2 pool window overlap in it);
 *   3. conv2, ReLU and max-pool, the same over conv1's six pooled channels;
 *   4. fc1, fc2 and fc3: a warp per UNITS_PER_WARP output units, its lanes splitting the inputs, so each weight is
 *      read once for all the group's images; a shuffle sums the lanes.
 * Only the forward of lenet_forward and lenet_infer_* is this kernel; training is level 6's, which this file
 * includes. Build: `make level7` (needs cuDNN, as level 6's LeNet does); test: `pytest -m "lenet and level7"`.
 * Tuning knobs: -DFUSED_IMAGES=n, the images of a group (1 to 7: what fits in a block's shared memory), and
 * -DFUSED_THREADS=n, a block's threads.
 */
#define LENET_FUSED_FORWARD
#include "../level6_cublas/lenet.cu"

#include <cuda_pipeline.h>

/* One image a group, 512 threads: of the variants measured on the H100 (1, 2, 4 or 7 images; 256 or 512 threads), the
 * fastest at batch 1 and within 10% of the fastest at batch 1,024. */
#ifndef FUSED_IMAGES
#define FUSED_IMAGES 1
#endif
#ifndef FUSED_THREADS
#define FUSED_THREADS 512
#endif
#define UNITS_PER_WARP 4  /* output units a warp sums at once in phase 4: more weight loads in flight */

/* Where the kernel writes every layer's output when asked to keep them (the per-layer check); all NULL otherwise. */
struct kept_layers {
    float *h1, *a1, *p1, *h2, *a2, *p2, *f1, *r3, *f2, *r4;
};

/* The four outputs of a 5x5 convolution under one 2x2 pool window at (py, px) of the pooled output: sums[2 dy + dx],
 * over the C input planes (H x H, in shared memory) and the filter w (C, 5, 5). */
template <int C, int H>
__device__ void conv_under_window(float sums[4], const float *in, const float *w, int py, int px) {
    for (int i = 0; i < 4; i++) sums[i] = 0.0f;
    for (int c = 0; c < C; c++) {
        float patch[K + 1][K + 1];
        const float *plane = in + c * H * H + (2 * py) * H + 2 * px;
#pragma unroll
        for (int r = 0; r < K + 1; r++)
#pragma unroll
            for (int q = 0; q < K + 1; q++) patch[r][q] = plane[r * H + q];
#pragma unroll
        for (int ky = 0; ky < K; ky++)
#pragma unroll
            for (int kx = 0; kx < K; kx++) {
                const float weight = w[c * K * K + ky * K + kx];
#pragma unroll
                for (int d = 0; d < 4; d++) sums[d] = fmaf(patch[ky + d / 2][kx + d % 2], weight, sums[d]);
            }
    }
}

/* Phases 2 and 3: a convolution with its bias, ReLU and 2x2 max-pool, for the block's images. in: (images, C, H, H)
 * in shared memory; w: (F, C, 5, 5) then the F biases; pooled: (images, F, H/2 - 2, H/2 - 2). row0: the first
 * image's row in the batch, for the kept layers h (before the ReLU) and a (after). */
template <int C, int H, int F>
__device__ void conv_relu_pool(float *pooled, const float *in, const float *w, int images, int row0, float *h,
                               float *a) {
    constexpr int OH = H - K + 1, PH = OH / 2;
    for (int item = threadIdx.x; item < images * F * PH * PH; item += blockDim.x) {
        const int image = item / (F * PH * PH), f = item / (PH * PH) % F, py = item / PH % PH, px = item % PH;
        float sums[4];
        conv_under_window<C, H>(sums, in + image * C * H * H, w + f * C * K * K, py, px);
        float best = 0.0f; /* the max of the ReLUs: 0 when all four are <= 0 */
        for (int d = 0; d < 4; d++) {
            const float out = sums[d] + w[F * C * K * K + f];
            best = fmaxf(best, out);
            if (h) {
                const size_t at = (size_t)(row0 + image) * F * OH * OH + f * OH * OH + (2 * py + d / 2) * OH +
                                  2 * px + d % 2;
                h[at] = out, a[at] = fmaxf(out, 0.0f);
            }
        }
        pooled[item] = best;
    }
}

/* Phase 4: out (images, N_OUT) = in (images, N_IN) @ w^T + b, then the ReLU unless it is the last layer. A warp per
 * UNITS_PER_WARP units, each lane summing every 32nd input; kept: f before the ReLU, r after. */
template <int N_IN, int N_OUT>
__device__ void dense(float *out, const float *in, const float *w, const float *b, int images, bool relu, int row0,
                      float *f, float *r) {
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, warps = blockDim.x / WARP;
    for (int first = warp * UNITS_PER_WARP; first < N_OUT; first += warps * UNITS_PER_WARP) {
        float acc[UNITS_PER_WARP][FUSED_IMAGES] = {};
#pragma unroll
        for (int i = lane; i < N_IN; i += WARP) {
#pragma unroll
            for (int u = 0; u < UNITS_PER_WARP; u++) {
                const float weight = first + u < N_OUT ? w[(first + u) * N_IN + i] : 0.0f;
#pragma unroll
                for (int image = 0; image < FUSED_IMAGES; image++)
                    if (image < images) acc[u][image] = fmaf(in[image * N_IN + i], weight, acc[u][image]);
            }
        }
#pragma unroll
        for (int u = 0; u < UNITS_PER_WARP; u++)
#pragma unroll
            for (int image = 0; image < FUSED_IMAGES; image++) {
                if (image >= images) break; /* the same for the whole block: every lane takes the shuffles or none */
                const float sum = warp_sum(acc[u][image]);
                const int unit = first + u;
                if (lane != 0 || unit >= N_OUT) continue;
                const float z = sum + b[unit];
                out[image * N_OUT + unit] = relu ? fmaxf(z, 0.0f) : z;
                if (f) {
                    f[(size_t)(row0 + image) * N_OUT + unit] = z;
                    if (relu) r[(size_t)(row0 + image) * N_OUT + unit] = fmaxf(z, 0.0f);
                }
            }
    }
}

/* Copy floats [0, n) of src (global) to dst (shared) without waiting: 16 bytes per copy where both are 16-byte
 * aligned (the caller's offsets are multiples of 4 floats), the odd floats at the end one by one. */
__device__ void copy_async(float *dst, const float *src, int n) {
    for (int i = threadIdx.x; i < n / 4; i += blockDim.x) __pipeline_memcpy_async(dst + 4 * i, src + 4 * i, 16);
    for (int i = n / 4 * 4 + threadIdx.x; i < n; i += blockDim.x) __pipeline_memcpy_async(dst + i, src + i, 4);
}

/* The shared memory of a block: every parameter (178 KB, lenet.h's flat layout), then its images and pool1, each
 * starting on a 16-byte boundary for the 16-byte copies. */
enum { PARAM_FLOATS = (N_PARAMS + 3) / 4 * 4, SHARED_FLOATS = PARAM_FLOATS + FUSED_IMAGES * (IMAGE * IMAGE + POOL1) };
static_assert(FUSED_IMAGES >= 1 && SHARED_FLOATS * sizeof(float) <= 227 * 1024, "a block's shared memory holds it");

/* The whole forward of x (B, 784): logits (B, 10), and every layer when kept. Persistent blocks: each copies the
 * parameters into shared memory once, then takes groups of FUSED_IMAGES images until none is left. */
__global__ void __launch_bounds__(FUSED_THREADS) lenet_fused_forward(const float *__restrict__ params,
                                                                    const float *__restrict__ x,
                                                                    float *__restrict__ logits, int B, kept_layers kept) {
    extern __shared__ __align__(16) float shared[];
    float *p = shared, *images_in = p + PARAM_FLOATS, *pool1 = images_in + FUSED_IMAGES * IMAGE * IMAGE;
    float *pool2 = images_in, *fc1 = pool2 + FUSED_IMAGES * FLAT, *fc2 = fc1 + FUSED_IMAGES * F1; /* where the images
                                                                                                   * were, once read */
    static_assert(FLAT + F1 + F2 <= IMAGE * IMAGE, "pool2, fc1 and fc2 fit where the images were");
    static_assert(W3 % 4 == 0 && (IMAGE * IMAGE) % 4 == 0, "16-byte copies");

    for (int group = blockIdx.x; group * FUSED_IMAGES < B; group += gridDim.x) {
        const int row0 = group * FUSED_IMAGES, images = min(FUSED_IMAGES, B - row0);
        /* 1. load, without waiting: the images (and, the first time, the convolutions' weights); then, the first
         * time, the fully connected layers' weights, which arrive while the convolutions compute */
        __syncthreads(); /* the previous group is done with the images' space */
        copy_async(images_in, x + (size_t)row0 * IMAGE * IMAGE, images * IMAGE * IMAGE);
        const bool first = group == (int)blockIdx.x;
        if (first) copy_async(p, params, W3);
        __pipeline_commit();
        if (first) copy_async(p + W3, params + W3, N_PARAMS - W3);
        __pipeline_commit();
        __pipeline_wait_prior(1); /* this thread's images and convolution weights are in */
        __syncthreads();          /* and everyone's */
        /* 2. conv1, ReLU, pool1 */
        conv_relu_pool<1, IMAGE, C1>(pool1, images_in, p + W1, images, row0, kept.h1, kept.a1);
        __syncthreads();
        /* 3. conv2, ReLU, pool2 (into the images' space, free now) */
        conv_relu_pool<C1, P1, C2>(pool2, pool1, p + W2, images, row0, kept.h2, kept.a2);
        __pipeline_wait_prior(0); /* the fully connected weights */
        __syncthreads();
        /* 4. the fully connected layers */
        for (int i = threadIdx.x; kept.p1 && i < images * POOL1; i += blockDim.x)
            kept.p1[(size_t)row0 * POOL1 + i] = pool1[i];
        for (int i = threadIdx.x; kept.p2 && i < images * FLAT; i += blockDim.x)
            kept.p2[(size_t)row0 * FLAT + i] = pool2[i];
        dense<FLAT, F1>(fc1, pool2, p + W3, p + B3, images, true, row0, kept.f1, kept.r3);
        __syncthreads();
        dense<F1, F2>(fc2, fc1, p + W4, p + B4, images, true, row0, kept.f2, kept.r4);
        __syncthreads();
        dense<F2, OUT>(logits + (size_t)row0 * OUT, fc2, p + W5, p + B5, images, false, row0, NULL, NULL);
    }
}

/* As many blocks as there are groups of images, at most one per multiprocessor (a block's shared memory fills one). */
static int inference_forward(lenet *m, float *logits, const float *x, int B, bool keep) {
    static int multiprocessors = 0; /* of device 0, the one every level uses; asked once */
    const size_t shared_bytes = sizeof(float) * SHARED_FLOATS;
    if (!multiprocessors) {
        CUDA_CHECK(cudaFuncSetAttribute(lenet_fused_forward, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)shared_bytes));
        CUDA_CHECK(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, 0));
    }
    const kept_layers kept = keep ? kept_layers{m->h1, m->a1, m->p1, m->h2, m->a2, m->p2, m->f1, m->r3, m->f2, m->r4}
                                  : kept_layers{};
    const int groups = (B + FUSED_IMAGES - 1) / FUSED_IMAGES;
    lenet_fused_forward<<<groups < multiprocessors ? groups : multiprocessors, FUSED_THREADS, shared_bytes,
                          m->base.stream>>>(m->params, x, logits, B, kept);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
}
