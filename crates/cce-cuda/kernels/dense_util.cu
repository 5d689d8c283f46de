// dense_util.cu: the dense engine's small kernels: f32 to 16-bit conversion, the loss
// reduction, the filter statistics, test data. Concatenated after classes.cu
// (src/dense/mod.rs `KERNEL_SOURCE`).
//
// Parameters: at each kernel (flat f32 / i32 / u32 arrays, 64-bit counts).
// Tiling: grid-stride, or one block of 1024 threads for the reductions.
// Thread mapping: one element per thread per step; block reductions in a fixed order.

// ------------------------------------------------------------------------------------------
// Small kernels: conversion, loss reduction, statistics, test data
// ------------------------------------------------------------------------------------------

// f32 [n] → DT [n]. Grid-stride, one element per thread per step.
template <int DT>
__device__ __forceinline__ void convert_from_f32(const float* src, void* dst, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        Elem<DT>::store(dst, i, src[i]);
}
extern "C" __global__ void cce_dense_convert_f16(const float* src, void* dst, long long n) {
    convert_from_f32<1>(src, dst, n);
}
extern "C" __global__ void cce_dense_convert_bf16(const float* src, void* dst, long long n) {
    convert_from_f32<2>(src, dst, n);
}

// Word of the backend's status that holds the sticky record's kind (src/backend/status.rs,
// kernels/prepare.cu): nonzero while a failed check is unread by the host.
#define SUM_ROWS_STATUS_KIND 32

// out[0] = scale · Σ_i x[i], f64 accumulation in a fixed order. With status (the backend's
// device status, u32 [64]): by_count divides by its first word (the valid rows; 0 when it is
// 0: the mean over no row), and a nonzero sticky record (a check of this call or an earlier one
// failed and the host has not read it: Checks::Deferred) makes the loss NaN. One block of
// 1024 threads.
extern "C" __global__ void __launch_bounds__(1024) cce_dense_sum_rows(const float* x, int n,
                                                                     double scale,
                                                                     const u32* status,
                                                                     int by_count,
                                                                     float* out) {
    __shared__ double sh[1024];
    double s = 0.0;
    for (int i = threadIdx.x; i < n; i += 1024) s += (double)x[i];
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int w = 512; w > 0; w >>= 1) {
        if (threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        float loss;
        if (status && status[SUM_ROWS_STATUS_KIND] != 0) {
            loss = __int_as_float(0x7FC00000);
        } else {
            if (status && by_count) scale = status[0] ? scale / (double)status[0] : 0.0;
            loss = (float)(sh[0] * scale);
        }
        out[0] = loss;
    }
}

// Filter statistics over rows: out (f64 [5]) = {Σ kept over active rows, Σ dropped over valid
// rows, max dropped over valid rows, kept tile flags, active rows}. kept[i] = INACTIVE_ROW marks
// a row with zero upstream gradient. One block of 1024 threads, fixed reduction order.
extern "C" __global__ void __launch_bounds__(1024) cce_dense_stats(const u32* kept,
                                                                  const float* dropped,
                                                                  const int* targets, int n,
                                                                  const u32* flags,
                                                                  long long n_flags,
                                                                  double* out) {
    __shared__ double sk[1024], sd[1024], sm[1024], sf[1024];
    __shared__ u32 sa[1024];
    double k = 0.0, d = 0.0, m = 0.0, f = 0.0;
    u32 a = 0;
    for (int i = threadIdx.x; i < n; i += 1024) {
        if (kept[i] != INACTIVE_ROW) {
            k += (double)kept[i];
            ++a;
        }
        if (targets[i] >= 0) {
            d += (double)dropped[i];
            m = fmax(m, (double)dropped[i]);
        }
    }
    for (long long i = threadIdx.x; i < n_flags; i += 1024) f += flags[i] ? 1.0 : 0.0;
    sk[threadIdx.x] = k; sd[threadIdx.x] = d; sm[threadIdx.x] = m; sf[threadIdx.x] = f;
    sa[threadIdx.x] = a;
    __syncthreads();
    for (int w = 512; w > 0; w >>= 1) {
        if (threadIdx.x < w) {
            sk[threadIdx.x] += sk[threadIdx.x + w];
            sd[threadIdx.x] += sd[threadIdx.x + w];
            sm[threadIdx.x] = fmax(sm[threadIdx.x], sm[threadIdx.x + w]);
            sf[threadIdx.x] += sf[threadIdx.x + w];
            sa[threadIdx.x] += sa[threadIdx.x + w];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        out[0] = sk[0]; out[1] = sd[0]; out[2] = sm[0]; out[3] = sf[0]; out[4] = (double)sa[0];
    }
}

// Counter-based normal samples for benches and tests: x[i] = mean + std·N(0,1) from a hash of
// (seed, i) (Box–Muller on two 24-bit uniforms). Grid-stride.
__device__ __forceinline__ u64 mix64(u64 z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
template <int DT>
__device__ __forceinline__ void fill_randn(void* x, long long n, u64 seed, float mean, float std) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        u64 h = mix64(seed * 0x2545f4914f6cdd1dull + (u64)i);
        float u1 = ((float)((h >> 40) & 0xffffff) + 1.0f) * (1.0f / 16777217.0f);
        float u2 = (float)((h >> 16) & 0xffffff) * (1.0f / 16777216.0f);
        float z = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
        Elem<DT>::store(x, i, mean + std * z);
    }
}
extern "C" __global__ void cce_dense_randn_f32(void* x, long long n, u64 seed, float mean, float std) {
    fill_randn<0>(x, n, seed, mean, std);
}
extern "C" __global__ void cce_dense_randn_f16(void* x, long long n, u64 seed, float mean, float std) {
    fill_randn<1>(x, n, seed, mean, std);
}
extern "C" __global__ void cce_dense_randn_bf16(void* x, long long n, u64 seed, float mean, float std) {
    fill_randn<2>(x, n, seed, mean, std);
}
// targets[i] = hash class in [0, V), or −1 with probability ignore_frac.
extern "C" __global__ void cce_dense_random_targets(int* t, int n, int V, u64 seed,
                                                    float ignore_frac) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    u64 h = mix64(seed * 0x9e3779b97f4a7c15ull + (u64)i);
    float u = (float)(h >> 40) * (1.0f / 16777216.0f);
    t[i] = u < ignore_frac ? -1 : (int)((h & 0xffffffffull) % (u64)V);
}

