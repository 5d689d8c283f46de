// util.cu: device-side data generators for tests and benchmarks (not part of the loss).
//
// Parameters
//   cce_fill_randn_*: out [n] in the dtype, out[i] = mean + std · N(0, 1), from a counter-based
//   hash of (seed, i) (splitmix64) and Box-Muller, so the data depend only on seed and index.
//   cce_fill_targets: out [n] i64 uniform in [0, V), or ignore_index with probability
//   ignore_permille / 1000.
//
// Tiling
//   Grid-stride loops, one element per thread per step.
//
// Thread mapping
//   Thread k of the grid writes elements k, k + gridDim·blockDim, ...

__device__ __forceinline__ u64 splitmix64(u64 x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

__device__ __forceinline__ float randn_at(u64 seed, i64 i) {
    u64 h = splitmix64(seed * 0x2545F4914F6CDD1Dull + (u64)i);
    float u1 = ((float)(h >> 40) + 1.0f) * (1.0f / 16777216.0f); // (0, 1]
    float u2 = (float)((h >> 16) & 0xffffffull) * (1.0f / 16777216.0f);
    return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}

template <class Dt>
__device__ __forceinline__ void fill_randn_impl(typename Dt::T* out, i64 n, u64 seed, float mean, float std) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        out[i] = Dt::from_f(mean + std * randn_at(seed, i));
}

extern "C" __global__ void cce_fill_randn_f32(float* out, i64 n, u64 seed, float mean, float std) {
    fill_randn_impl<DtF32>(out, n, seed, mean, std);
}
extern "C" __global__ void cce_fill_randn_f16(u16* out, i64 n, u64 seed, float mean, float std) {
    fill_randn_impl<DtF16>(out, n, seed, mean, std);
}
extern "C" __global__ void cce_fill_randn_bf16(u16* out, i64 n, u64 seed, float mean, float std) {
    fill_randn_impl<DtBF16>(out, n, seed, mean, std);
}

extern "C" __global__ void cce_fill_targets(i64* out, i64 n, u64 seed, int V, int ignore_permille, i64 ignore_index) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        u64 h = splitmix64(seed * 0x9E3779B97F4A7C15ull + (u64)i);
        if ((int)((h >> 54) % 1000ull) < ignore_permille)
            out[i] = ignore_index;
        else
            out[i] = (i64)((h & 0xffffffffull) % (u64)V);
    }
}
