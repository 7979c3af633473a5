/* level7_fused/lenet.cu - Level 7 for LeNet-5: the forward pass as one fused kernel, for inference, and the training
 * step as two kernels of its own.
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
 * Training: level 6's step is about fifty library kernels, each a few microseconds of a mostly idle GPU. Here a step
 * is two kernels (the second half of this file):
 *   1. lenet_train_images: a block per image takes it forward and backward through every layer in shared memory, and
 *      writes the image's share of the convolutions' weight gradients, and what the fully connected layers' weight
 *      gradients are made of (their inputs and output gradients);
 *   2. lenet_train_update: a thread per parameter adds its gradient over the batch, in a fixed order, and takes its
 *      SGD step. No atomics anywhere, so reruns give the same bits.
 * Build: `make level7` (needs cuDNN: the rest of lenet.h is level 6's, included below); test: `pytest -m "lenet and
 * level7"`. Tuning knobs: -DFUSED_IMAGES=n, the images of a group (1 to 7: what fits in a block's shared memory),
 * -DFUSED_THREADS=n, a block's threads, -DTRAIN_THREADS=n, those of lenet_train_images, and -DUPDATE_RUNS=n, the
 * runs of rows lenet_train_update splits the batch into.
 */
/* Level 7 trains with its own kernels: it defines train_steps, the epoch's hook of common/native/cuda_lenet.cuh, and
 * the two calls of lenet.h that step forward and backward without an update (for the per-layer check). Those two are
 * defined at the end of this file; the shared header's, level 6's path, are renamed here and go unused. */
#define lenet_layers level6_lenet_layers
#define lenet_loss_and_grads level6_lenet_loss_and_grads
#define LENET_FUSED_STEP
#define LENET_FUSED_FORWARD
#include "../level6_cublas/lenet.cu"
#undef lenet_layers
#undef lenet_loss_and_grads

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

/* ==== Training: a step as two kernels ==== */

#ifndef TRAIN_THREADS
#define TRAIN_THREADS 512
#endif
enum { CONV_PARAMS = W3 }; /* conv1's and conv2's weights and biases: the front of the flat parameter buffer */

/* Every layer's buffer in global memory, (B, its size) each. The fully connected layers' inputs and output
 * gradients (p2, r3, r4, df1, df2, dlogits) are always written: lenet_train_update reads them. The others are written
 * only when kept (the per-layer check), NULL otherwise. */
struct train_layers {
    float *h1, *a1, *p1, *h2, *a2, *p2, *f1, *r3, *f2, *r4, *logits;
    float *dh1, *da1, *dp1, *dh2, *da2, *dp2, *df1, *dr3, *df2, *dr4, *dlogits;
};

struct train_images_args {
    const float *params;  /* (N_PARAMS) */
    const float *x;       /* images (n, 784): the batch's image b is row rows[b], or row b when rows is NULL */
    const int *y, *rows;  /* labels (n); rows (B) or NULL */
    int B;
    float *shares;        /* (B, CONV_PARAMS): each image's share of the convolutions' gradients */
    float *row_loss;      /* (B) each image's cross-entropy */
    train_layers out;
};

/* Write v to element i of image b's row of a (B, size) layer buffer, unless the buffer is not kept (NULL). */
__device__ void put(float *layer, int size, int b, int i, float v) {
    if (layer) layer[(size_t)b * size + i] = v;
}

/* A convolution of one image with its bias, its ReLU and its 2x2 max-pool, as the forward kernel's conv_relu_pool
 * (a thread per pooled output, its four convolution outputs from one patch of the input), keeping what the backward
 * pass needs: a (F, OH, OH), the ReLU's output, and each pool window's choice, 0..3 in row-major order, the first of
 * equal maxima (PyTorch's rule). in (C, H, H); w (F, C, 5, 5) then the F biases; pooled (F, OH/2, OH/2). Kept: h before
 * the ReLU, a after, and the pooled output. */
template <int C, int H, int F>
__device__ void conv_relu_pool_forward(float *a, float *pooled, unsigned char *choice, const float *in, const float *w,
                                       float *kept_h, float *kept_a, float *kept_pooled, int b) {
    constexpr int OH = H - K + 1, PH = OH / 2;
    for (int i = threadIdx.x; i < F * PH * PH; i += blockDim.x) {
        const int f = i / (PH * PH), py = i / PH % PH, px = i % PH;
        float v[4];
        conv_under_window<C, H>(v, in, w + f * C * K * K, py, px);
        for (int d = 0; d < 4; d++) {
            const float h = v[d] + w[F * C * K * K + f];
            const int at = (f * OH + 2 * py + d / 2) * OH + 2 * px + d % 2;
            v[d] = a[at] = h > 0.0f ? h : 0.0f;
            put(kept_h, F * OH * OH, b, at, h);
            put(kept_a, F * OH * OH, b, at, v[d]);
        }
        int best = 0;
        for (int d = 1; d < 4; d++) best = v[d] > v[best] ? d : best;
        pooled[i] = v[best], choice[i] = (unsigned char)best;
        put(kept_pooled, F * PH * PH, b, i, v[best]);
    }
}

/* A fully connected layer of one image: z (N_OUT) = w (N_OUT, N_IN) @ in (N_IN) + bias, then the ReLU unless it is
 * the last layer, into out (shared). A warp per UNITS_PER_WARP units, its lanes splitting the inputs (coalesced
 * weight loads, all of a group's in flight at once), a shuffle adding the lanes. Kept: z; `after` (global, or NULL):
 * the output. */
template <int N_IN, int N_OUT>
__device__ void fc_forward(float *out, const float *in, const float *w, const float *bias, bool relu, float *kept_z,
                           float *after, int b) {
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, warps = blockDim.x / WARP;
    for (int first = warp * UNITS_PER_WARP; first < N_OUT; first += warps * UNITS_PER_WARP) {
        float sums[UNITS_PER_WARP] = {};
#pragma unroll
        for (int i = lane; i < N_IN; i += WARP)
#pragma unroll
            for (int u = 0; u < UNITS_PER_WARP; u++)
                if (first + u < N_OUT) sums[u] = fmaf(w[(first + u) * N_IN + i], in[i], sums[u]);
#pragma unroll
        for (int u = 0; u < UNITS_PER_WARP; u++) {
            const float sum = warp_sum(sums[u]);
            const int unit = first + u;
            if (lane || unit >= N_OUT) continue;
            const float z = sum + bias[unit];
            out[unit] = relu ? (z > 0.0f ? z : 0.0f) : z;
            put(kept_z, N_OUT, b, unit, z);
            put(after, N_OUT, b, unit, out[unit]);
        }
    }
}

/* The image's cross-entropy against its label, and dlogits = (softmax - onehot) / B, by the first warp, a logit per
 * lane (as softmax_xent_forward and softmax_xent_backward, one row). */
__device__ void softmax_xent(float *dlogits, const float *logits, int label, int B, float *row_loss,
                             float *all_dlogits, int b) {
    const int lane = threadIdx.x;
    if (lane >= WARP) return;
    const float z = lane < OUT ? logits[lane] : -INFINITY;
    const float max = warp_max(z);
    const float e = lane < OUT ? expf(z - max) : 0.0f;
    const float sum = warp_sum(e);
    if (lane < OUT) {
        dlogits[lane] = (e / sum - (lane == label ? 1.0f : 0.0f)) / (float)B;
        put(all_dlogits, OUT, b, lane, dlogits[lane]);
    }
    if (lane == 0) row_loss[b] = logf(sum) - (logits[label] - max);
}

/* Backward of fc_forward to its input: din (N_IN) = dout (N_OUT) @ w, a thread per input. With `relu_out` (the
 * previous layer's ReLU output, > 0 exactly where its input was), then the ReLU's backward. Kept: din before the
 * ReLU's backward; `after` (global, or NULL): the result. */
template <int N_IN, int N_OUT>
__device__ void fc_backward_input(float *din, const float *dout, const float *w, const float *relu_out, float *kept,
                                  float *after, int b) {
    for (int i = threadIdx.x; i < N_IN; i += blockDim.x) {
        float sum = 0.0f;
#pragma unroll 12 /* a dozen weight loads in flight, not one after the other */
        for (int u = 0; u < N_OUT; u++) sum = fmaf(dout[u], w[u * N_IN + i], sum);
        put(kept, N_IN, b, i, sum);
        din[i] = relu_out && !(relu_out[i] > 0.0f) ? 0.0f : sum;
        put(after, N_IN, b, i, din[i]);
    }
}

/* Backward of the max-pool, then of the ReLU before it, in place: a (C, H, H), the ReLU's output, becomes dh. Each
 * position gets its window's gradient dout (C, H/2, H/2) if the pool chose it (da), then 0 where a is 0. */
template <int C, int H>
__device__ void pool_relu_backward(float *a_then_dh, const unsigned char *choice, const float *dout, float *kept_da,
                                   float *kept_dh, int b) {
    constexpr int PH = H / 2;
    for (int j = threadIdx.x; j < C * H * H; j += blockDim.x) {
        const int c = j / (H * H), row = j / H % H, col = j % H;
        const int window = (c * PH + row / 2) * PH + col / 2;
        const float da = choice[window] == (row % 2) * 2 + col % 2 ? dout[window] : 0.0f;
        const float dh = a_then_dh[j] > 0.0f ? da : 0.0f;
        a_then_dh[j] = dh;
        put(kept_da, C * H * H, b, j, da);
        put(kept_dh, C * H * H, b, j, dh);
    }
}

/* Item i of a convolution's gradient from one image: i < F*C*K*K/ROW a row of ROW weights (f, c, ky, kx0 ..), then the
 * F biases. Each weight's share is the sum over the output positions (oy, ox in order, as level 5) of dh (F, OH, OH)
 * times the input under the weight, in (C, H, H); a row's weights share the loads of dh. conv2 takes rows of five
 * (fewer loads), conv1 single weights (more threads for its 576 terms). */
template <int C, int H, int F, int ROW>
__device__ void conv_weight_share(float *share, const float *dh, const float *in, int i) {
    constexpr int OH = H - K + 1, ROWS = F * C * K * K / ROW;
    static_assert(K % ROW == 0, "a row is a whole part of the filter's row");
    if (i >= ROWS) {
        float sum = 0.0f;
        for (int p = 0; p < OH * OH; p++) sum += dh[(i - ROWS) * OH * OH + p];
        share[F * C * K * K + i - ROWS] = sum;
        return;
    }
    const int first = i * ROW, f = first / (C * K * K), c = first / (K * K) % C, ky = first / K % K, kx0 = first % K;
    const float *g = dh + f * OH * OH, *x = in + (c * H + ky) * H + kx0;
    float sums[ROW] = {};
    for (int oy = 0; oy < OH; oy++)
#pragma unroll /* a row's loads issued together: only the additions wait on each other */
        for (int ox = 0; ox < OH; ox++) {
            const float d = g[oy * OH + ox];
#pragma unroll
            for (int kx = 0; kx < ROW; kx++) sums[kx] = fmaf(d, x[oy * H + ox + kx], sums[kx]);
        }
    for (int kx = 0; kx < ROW; kx++) share[first + kx] = sums[kx];
}

/* Item i of a convolution's input gradient din (C, H, H): a 2x2 block of inputs, each the sum of dh (F, OH, OH) over
 * the outputs that read it, times the weight that read it (f, then ky, kx in order). As the forward's
 * conv_under_window, the block's four share the loads of a 6x6 patch of dh (zeros beyond its edges). */
template <int C, int H, int F>
__device__ void conv_input_grad(float *din, const float *dh, const float *w, int i) {
    constexpr int OH = H - K + 1, BH = H / 2;
    const int c = i / (BH * BH), by = i / BH % BH, bx = i % BH;
    float sums[4] = {};
    for (int f = 0; f < F; f++) {
        float patch[K + 1][K + 1]; /* dh's rows 2 by - 4 .. 2 by + 1, columns 2 bx - 4 .. 2 bx + 1 */
#pragma unroll
        for (int r = 0; r < K + 1; r++)
#pragma unroll
            for (int q = 0; q < K + 1; q++) {
                const int oy = 2 * by + r - (K - 1), ox = 2 * bx + q - (K - 1);
                patch[r][q] = oy >= 0 && oy < OH && ox >= 0 && ox < OH ? dh[(f * OH + oy) * OH + ox] : 0.0f;
            }
#pragma unroll
        for (int ky = 0; ky < K; ky++)
#pragma unroll
            for (int kx = 0; kx < K; kx++) {
                const float weight = w[((f * C + c) * K + ky) * K + kx];
#pragma unroll
                for (int d = 0; d < 4; d++)
                    sums[d] = fmaf(patch[d / 2 - ky + K - 1][d % 2 - kx + K - 1], weight, sums[d]);
            }
    }
    for (int d = 0; d < 4; d++) din[(c * H + 2 * by + d / 2) * H + 2 * bx + d % 2] = sums[d];
}

/* Kernel 1: block b takes image b forward and backward, every layer in shared memory (about 43 KB). Writes the image's
 * shares of conv1's and conv2's gradients, the fully connected layers' inputs and output gradients, its loss, and
 * every kept layer. The weights are read where they are: the convolutions' (10 KB) copied to shared memory, the fully
 * connected layers' (168 KB) from global memory, where every block reads the same ones (the L2 cache holds them). */
__global__ void __launch_bounds__(TRAIN_THREADS) lenet_train_images(train_images_args a) {
    __shared__ float conv[CONV_PARAMS], x[IMAGE * IMAGE], a1[H1], p1[POOL1], a2[H2], p2[FLAT], r3[F1], r4[F2];
    __shared__ float logits[OUT], dlogits[OUT], df2[F2], df1[F1], dp2[FLAT], dp1[POOL1];
    __shared__ unsigned char choice1[POOL1], choice2[FLAT];
    const int b = blockIdx.x, row = a.rows ? a.rows[b] : b;
    const float *p = a.params;
    const train_layers &o = a.out;
    for (int i = threadIdx.x; i < CONV_PARAMS; i += blockDim.x) conv[i] = p[i];
    for (int i = threadIdx.x; i < IMAGE * IMAGE; i += blockDim.x) x[i] = a.x[(size_t)row * IMAGE * IMAGE + i];
    __syncthreads();
    /* forward */
    conv_relu_pool_forward<1, IMAGE, C1>(a1, p1, choice1, x, conv + W1, o.h1, o.a1, o.p1, b);
    __syncthreads();
    conv_relu_pool_forward<C1, P1, C2>(a2, p2, choice2, p1, conv + W2, o.h2, o.a2, o.p2, b);
    __syncthreads();
    fc_forward<FLAT, F1>(r3, p2, p + W3, p + B3, true, o.f1, o.r3, b);
    __syncthreads();
    fc_forward<F1, F2>(r4, r3, p + W4, p + B4, true, o.f2, o.r4, b);
    __syncthreads();
    fc_forward<F2, OUT>(logits, r4, p + W5, p + B5, false, NULL, o.logits, b);
    __syncthreads();
    /* backward: each line undoes the forward line above it, from the last up */
    softmax_xent(dlogits, logits, a.y[row], a.B, a.row_loss, o.dlogits, b);
    __syncthreads();
    fc_backward_input<F2, OUT>(df2, dlogits, p + W5, r4, o.dr4, o.df2, b);
    __syncthreads();
    fc_backward_input<F1, F2>(df1, df2, p + W4, r3, o.dr3, o.df1, b);
    __syncthreads();
    fc_backward_input<FLAT, F1>(dp2, df1, p + W3, NULL, o.dp2, NULL, b);
    __syncthreads();
    pool_relu_backward<C2, S2>(a2, choice2, dp2, o.da2, o.dh2, b); /* a2 becomes dh2 */
    __syncthreads();
    float *share = a.shares + (size_t)b * CONV_PARAMS;
    constexpr int DP1_ITEMS = POOL1 / 4, CONV2_ITEMS = C2 * C1 * K + C2; /* 2x2 blocks; rows of five, then biases */
    for (int i = threadIdx.x; i < DP1_ITEMS + CONV2_ITEMS; i += blockDim.x)
        if (i < DP1_ITEMS)
            conv_input_grad<C1, P1, C2>(dp1, a2, conv + W2, i);
        else
            conv_weight_share<C1, P1, C2, K>(share + W2, a2, p1, i - DP1_ITEMS);
    __syncthreads();
    for (int i = threadIdx.x; o.dp1 && i < POOL1; i += blockDim.x) put(o.dp1, POOL1, b, i, dp1[i]);
    pool_relu_backward<C1, S1>(a1, choice1, dp1, o.da1, o.dh1, b); /* a1 becomes dh1 */
    __syncthreads();
    for (int i = threadIdx.x; i < W2; i += blockDim.x) conv_weight_share<1, IMAGE, C1, 1>(share + W1, a1, x, i);
}

/* Kernel 2: a thread per parameter adds its gradient over the batch and takes its SGD step. A block holds 32
 * parameters (a lane each) and its UPDATE_RUNS warps split the batch into as many runs of rows; the runs' sums are
 * then added in order: a fixed order, the same bits at every run. Its last block computes the mean loss. */
#ifndef UPDATE_RUNS
#define UPDATE_RUNS 8
#endif
enum { RUNS = UPDATE_RUNS, UPDATE_THREADS = RUNS * WARP };
static_assert(UPDATE_THREADS <= 1024 && (UPDATE_THREADS & (UPDATE_THREADS - 1)) == 0, "a block, halved to one thread");

struct train_update_args {
    float *params, *grads;         /* (N_PARAMS) each */
    const float *shares;           /* (B, CONV_PARAMS) */
    const float *p2, *r3, *r4;     /* the fully connected layers' inputs (B, 256), (B, 120), (B, 84) */
    const float *df1, *df2, *dlogits; /* their output gradients (B, 120), (B, 84), (B, 10) */
    const float *row_loss;         /* (B) */
    float *loss;                   /* (1) the mean */
    int B;
    float lr;
    bool update;                   /* take the SGD step (training), or only write the gradients */
};

/* Row b's term of parameter p's gradient, as (g, x), the term being g * x: a share of a convolution's (x = 1), or
 * dout * input for a fully connected layer's weight, dout for its bias. */
__device__ float2 gradient_term(const train_update_args &a, int p, int b) {
    const size_t r = (size_t)b;
    if (p < W3) return {a.shares[r * CONV_PARAMS + p], 1.0f};
    if (p < B3) return {a.df1[r * F1 + (p - W3) / FLAT], a.p2[r * FLAT + (p - W3) % FLAT]};
    if (p < W4) return {a.df1[r * F1 + p - B3], 1.0f};
    if (p < B4) return {a.df2[r * F2 + (p - W4) / F1], a.r3[r * F1 + (p - W4) % F1]};
    if (p < W5) return {a.df2[r * F2 + p - B4], 1.0f};
    if (p < B5) return {a.dlogits[r * OUT + (p - W5) / F2], a.r4[r * F2 + (p - W5) % F2]};
    return {a.dlogits[r * OUT + p - B5], 1.0f};
}

__global__ void __launch_bounds__(UPDATE_THREADS) lenet_train_update(train_update_args a) {
    __shared__ double losses[UPDATE_THREADS];
    __shared__ float runs[RUNS][WARP];
    const int t = threadIdx.x;
    if (blockIdx.x == gridDim.x - 1) { /* the mean loss, in double, as mean_loss_kernel */
        double sum = 0.0;
        for (int r = t; r < a.B; r += UPDATE_THREADS) sum += a.row_loss[r];
        losses[t] = sum;
        __syncthreads();
        for (int half = UPDATE_THREADS / 2; half > 0; half /= 2) {
            if (t < half) losses[t] += losses[t + half];
            __syncthreads();
        }
        if (t == 0) *a.loss = (float)(losses[0] / a.B);
        return;
    }
    const int lane = t % WARP, run = t / WARP, p = blockIdx.x * WARP + lane;
    const int per_run = (a.B + RUNS - 1) / RUNS, first = run * per_run, last = min(a.B, first + per_run);
    float sum = 0.0f;
#pragma unroll 8 /* eight rows' loads in flight */
    for (int b = first; p < N_PARAMS && b < last; b++) {
        const float2 term = gradient_term(a, p, b);
        sum = fmaf(term.x, term.y, sum);
    }
    runs[run][lane] = sum;
    __syncthreads();
    if (run || p >= N_PARAMS) return;
    float g = 0.0f;
    for (int r = 0; r < RUNS; r++) g += runs[r][lane];
    a.grads[p] = g;
    if (a.update) a.params[p] -= a.lr * g;
}

/* Forward, backward and (with update) the SGD step of a batch of B images: x's rows `rows` (device; NULL: its first
 * B rows) and their labels y; the mean loss to *loss (device). shares: (B, CONV_PARAMS) of scratch. */
static int fused_step(lenet *m, float *loss, const float *x, const int *y, const int *rows, int B, float lr,
                      bool update, bool keep, float *shares) {
    const train_layers kept = keep ? train_layers{m->h1, m->a1, m->p1, m->h2, m->a2, m->p2, m->f1, m->r3, m->f2,
                                                  m->r4, m->logits, m->dh1, m->da1, m->dp1, m->dh2, m->da2, m->dp2,
                                                  m->df1, m->dr3, m->df2, m->dr4, m->dlogits}
                                   : train_layers{NULL, NULL, NULL, NULL, NULL, m->p2, NULL, m->r3, NULL, m->r4, NULL,
                                                  NULL, NULL, NULL, NULL, NULL, NULL, m->df1, NULL, m->df2, NULL,
                                                  m->dlogits};
    lenet_train_images<<<B, TRAIN_THREADS, 0, m->base.stream>>>({m->params, x, y, rows, B, shares, m->row_loss, kept});
    CUDA_CHECK(cudaGetLastError());
    const train_update_args args{m->params, m->grads, shares,     m->p2, m->r3, m->r4, m->df1, m->df2, m->dlogits,
                                 m->row_loss, loss,   B,         lr,    update};
    lenet_train_update<<<(N_PARAMS + WARP - 1) / WARP + 1, UPDATE_THREADS, 0, m->base.stream>>>(args);
    CUDA_CHECK(cudaGetLastError());
    return MLP_OK;
}

/* run(shares) with scratch for the shares of `rows` images, taken from the stream's memory pool and given back after. */
template <typename Run>
static int with_shares(lenet *m, int rows, Run run) {
    float *shares = NULL;
    CUDA_CHECK(cudaMallocAsync(&shares, sizeof(float) * (size_t)rows * CONV_PARAMS, m->base.stream));
    const int status = run(shares);
    const cudaError_t freed = cudaFreeAsync(shares, m->base.stream);
    if (!status && freed != cudaSuccess) return cuda_fail(freed, "cudaFreeAsync", __FILE__, __LINE__);
    return status;
}

/* The steps of an epoch over m->order[0 .. n_order), each step's loss to m->losses[step]: two launches a step, queued
 * without a wait (lenet_train_epoch, common/native/cuda_lenet.cuh, waits once at the end). */
static int train_steps(lenet *m, int n_order, int batch_size, float lr) {
    return with_shares(m, batch_size < n_order ? batch_size : n_order, [&](float *shares) {
        for (int start = 0, step = 0; start < n_order; start += batch_size, step++) {
            const int B = n_order - start < batch_size ? n_order - start : batch_size;
            const int status = fused_step(m, m->losses + step, m->data_x, m->data_y, m->order + start, B, lr, true,
                                          false, shares);
            if (status) return status;
        }
        return MLP_OK;
    });
}

/* The batch x (n, 784), y (n) uploaded, then forward and backward through the two kernels, every layer kept, the
 * parameters unchanged: what lenet_loss_and_grads and lenet_layers read. */
static int fused_forward_backward(lenet *m, const float *x, const int *y, int n) {
    int status = check_labels(y, n, OUT);
    if (!status) status = ensure_batch(m, n);
    if (!status) status = ensure_buffer(&m->losses, &m->loss_capacity, 1);
    if (status) return status;
    CUDA_CHECK(cudaMemcpyAsync(m->x, x, sizeof(float) * (size_t)n * IMAGE * IMAGE, cudaMemcpyHostToDevice,
                               m->base.stream));
    CUDA_CHECK(cudaMemcpyAsync(m->y, y, sizeof(int) * (size_t)n, cudaMemcpyHostToDevice, m->base.stream));
    return with_shares(m, n, [&](float *shares) {
        return fused_step(m, m->losses, m->x, m->y, NULL, n, 0.0f, false, true, shares);
    });
}

extern "C" int lenet_loss_and_grads(lenet *m, float *loss, float *grads, const float *x, const int *y, int n) {
    if (!m || !loss || !grads || !x || !y) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (n < 1) return FAIL(MLP_ERR_ARG, "n must be >= 1, got %d", n);
    const int status = fused_forward_backward(m, x, y, n);
    if (status) return status;
    CUDA_CHECK(cudaMemcpyAsync(loss, m->losses, sizeof(float), cudaMemcpyDeviceToHost, m->base.stream));
    CUDA_CHECK(cudaMemcpyAsync(grads, m->grads, sizeof(float) * N_PARAMS, cudaMemcpyDeviceToHost, m->base.stream));
    CUDA_CHECK(cudaStreamSynchronize(m->base.stream));
    return MLP_OK;
}

extern "C" int lenet_layers(lenet *m, float *outputs, float *grads, const float *x, const int *y, int n) {
    if (!m || !outputs || !grads || !x || !y) return FAIL(MLP_ERR_ARG, "NULL argument");
    if (n < 1) return FAIL(MLP_ERR_ARG, "n must be >= 1, got %d", n);
    const int status = fused_forward_backward(m, x, y, n);
    if (status) return status;
    const float *out[] = {m->h1, m->a1, m->p1, m->h2, m->a2, m->p2, m->f1, m->r3, m->f2, m->r4, m->logits};
    const float *grad[] = {m->dh1, m->da1, m->dp1, m->dh2, m->da2, m->dp2, m->df1, m->dr3, m->df2, m->dr4, m->dlogits};
    const int sizes[] = {H1, H1, POOL1, H2, H2, POOL2, F1, F1, F2, F2, OUT};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        const size_t bytes = sizeof(float) * (size_t)n * sizes[i];
        CUDA_CHECK(cudaMemcpyAsync(outputs, out[i], bytes, cudaMemcpyDeviceToHost, m->base.stream));
        CUDA_CHECK(cudaMemcpyAsync(grads, grad[i], bytes, cudaMemcpyDeviceToHost, m->base.stream));
        outputs += (size_t)n * sizes[i], grads += (size_t)n * sizes[i];
    }
    CUDA_CHECK(cudaStreamSynchronize(m->base.stream));
    return MLP_OK;
}
