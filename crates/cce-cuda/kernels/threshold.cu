// threshold.cu: the filter's threshold pass (cce_core::FilterRule): a per-row histogram of
// g0 = |p − onehot| over the rule's bins, then the per-row threshold τ_i.
//
// Parameters
//   e, c, bias, classes, softcap, vec_ok: as in forward.cu. lse [N] f32 from the forward.
//   eps: the resolved filter_eps; rowc [5][N] f32: the row coefficients of backward.cu (a_i at
//   [i], b_i at [N + i]), whose ratio w_i = b_i / a_i (0 when a_i = 0) is the p at which the
//   target's G = a·p − b vanishes (cce-core filter.rs; 1 − α without z-loss and lse gradient);
//   edges [N_BINS] f32: the host's FilterRule::edge(k) table.
//   hist [N][N_BINS] u32 (in/out, zeroed by the caller): Σ ceil(g0·2^30) of the row's entries
//   with g0 < eps in each bin (integer atomics: exact and order independent).
//   cce_threshold: delta = max_dropped_mass; tau [N] f32 (out): the largest edge whose bins
//   below hold ≤ delta, 0 when none, 0 for ignored rows (classes = -1).
//
// Tiling
//   As forward.cu: grid = (row tiles, class splits); a block walks its class tiles and keeps a
//   128 x N_BINS histogram in shared memory, flushed to global memory once at the end.
//
// Thread mapping
//   See common.cuh; each thread bins its 8 x 8 entries with shared-memory integer atomics.

template <class Dt>
__device__ __forceinline__ void hist_impl(const typename Dt::T* __restrict__ e, const typename Dt::T* __restrict__ c,
                                          const typename Dt::T* __restrict__ bias, const int* __restrict__ classes,
                                          const float* __restrict__ lse, int N, int V, int D, int vec_ok,
                                          float softcap, float eps, const float* __restrict__ rowc,
                                          const float* __restrict__ edges,
                                          int tiles_per_split, u32* __restrict__ hist) {
    extern __shared__ __align__(16) u8 smem[];
    u32* hs = (u32*)(smem + LOGITS_SMEM_BYTES);
    float* es = (float*)(smem + LOGITS_SMEM_BYTES + TILE_M * N_BINS * 4);
    const Lane L;
    const int row0 = blockIdx.x * TILE_M;
    const int rows_valid = min(TILE_M, N - row0);
    const int n_ctiles = (V + TILE_N - 1) / TILE_N;
    const int t_begin = blockIdx.y * tiles_per_split;
    const int t_end = min(n_ctiles, t_begin + tiles_per_split);
    for (int k = threadIdx.x; k < TILE_M * N_BINS; k += NTHREADS) hs[k] = 0u;
    for (int k = threadIdx.x; k < N_BINS; k += NTHREADS) es[k] = edges[k];
    int y[8];
    float l[8];
    float w[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        int r = L.row_of(i);
        y[i] = r < rows_valid ? classes[row0 + r] : -1;
        l[i] = r < rows_valid ? lse[row0 + r] : 0.f;
        const float a = r < rows_valid ? rowc[row0 + r] : 0.f;
        w[i] = a != 0.f ? rowc[N + row0 + r] / a : 0.f;
    }
    __syncthreads();
    for (int tile = t_begin; tile < t_end; ++tile) {
        const int col0 = tile * TILE_N;
        const int cols_valid = min(TILE_N, V - col0);
        float acc[8][8];
        logits_tile<Dt>(e, row0, rows_valid, c, col0, cols_valid, D, vec_ok != 0, smem, acc, L);
        float bj[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            int cl = L.col_of(j);
            bj[j] = (bias != nullptr && cl < cols_valid) ? Dt::to_f(bias[col0 + cl]) : 0.f;
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            if (y[i] < 0) continue;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                int cl = L.col_of(j);
                if (cl >= cols_valid) continue;
                float z = apply_softcap(acc[i][j] + bj[j], softcap);
                float p = expf(z - l[i]);
                // p off the target, max(|1 − p|, |w − p|) at it, as backward.cu's grad_entry.
                float g0 = col0 + cl == y[i] ? fmaxf(fabsf(1.f - p), fabsf(w[i] - p)) : p;
                if (g0 < eps) {
                    u32 w = mass_to_fixed(g0);
                    if (w) atomicAdd(&hs[L.row_of(i) * N_BINS + filter_bin(g0, eps, es)], w);
                }
            }
        }
    }
    __syncthreads();
    for (int k = threadIdx.x; k < TILE_M * N_BINS; k += NTHREADS) {
        int r = k / N_BINS;
        u32 w = hs[k];
        if (w && r < rows_valid) atomicAdd(&hist[(i64)(row0 + r) * N_BINS + (k % N_BINS)], w);
    }
}

#define CCE_HIST(NAME, DT)                                                                             \
    extern "C" __global__ void __launch_bounds__(NTHREADS) NAME(                                       \
        const DT::T* __restrict__ e, const DT::T* __restrict__ c, const DT::T* __restrict__ bias,      \
        const int* __restrict__ classes, const float* __restrict__ lse, int N, int V, int D, int vec_ok, \
        float softcap, float eps, const float* __restrict__ rowc, const float* __restrict__ edges,     \
        int tiles_per_split, u32* __restrict__ hist) {                                                 \
        hist_impl<DT>(e, c, bias, classes, lse, N, V, D, vec_ok, softcap, eps, rowc, edges, tiles_per_split, hist); \
    }

CCE_HIST(cce_hist_f32, DtF32)
CCE_HIST(cce_hist_f16, DtF16)
CCE_HIST(cce_hist_bf16, DtBF16)

// One thread per row: τ_i from the histogram, as cce_core::FilterRule::threshold (masses read
// back from fixed point; ceil rounding over-estimates them, so τ never admits more than δ).
extern "C" __global__ void cce_threshold(const u32* __restrict__ hist, const int* __restrict__ classes, int N,
                                         float delta, const float* __restrict__ edges, float* __restrict__ tau) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N) return;
    if (classes[i] < 0) {
        tau[i] = 0.f;
        return;
    }
    double below = 0.0;
    int best = -1;
    for (int k = N_BINS - 1; k >= 0; --k) {
        below += (double)hist[(i64)i * N_BINS + k] * (1.0 / 1073741824.0);
        if (below <= (double)delta)
            best = k;
        else
            break;
    }
    tau[i] = best >= 0 ? edges[best] : 0.f;
}
