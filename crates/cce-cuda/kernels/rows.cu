// rows.cu: the backward row kernels of the dense engine: (3) G in place over the logits with
// the per-row filter threshold, (2)+(3) fused in a thread-block cluster (sm_90), (4') the
// target's entry of a 16-bit G, and the column sums of G for d_bias. Concatenated after
// forward.cu (src/dense/mod.rs `KERNEL_SOURCE`).
//
// Parameters: L f32 [rows, ld] logits, overwritten by G in the gradient dtype (row stride
//   ld·4/sizeof(G)); lse, rest, upstream gradients, kept, dropped, tau chunk-relative; flags
//   u32 [row tiles, class tiles]; details at each kernel.
// Tiling: one block per row (bwd), a cluster of CS blocks per row (fused), one warp per row
//   (target fix), one column per thread (colsum).
// Thread mapping: float4 columns 4·t + k·4·THREADS of the row per thread; see each kernel.

// ------------------------------------------------------------------------------------------
// Histogram helper (filter pass)
// ------------------------------------------------------------------------------------------

// Add the fixed-point mass of g0 (when `valid` and g0 < eps) to the warp's histogram `whist`.
// All 32 lanes must call it (convergent): the underflow bin, where most entries of a peaked row
// land, is summed across the warp first (one atomic instead of 32 on one address).
__device__ __forceinline__ void hist_add(u32* whist, float g0, bool valid, const float* edges) {
    u32 mass = 0;
    int b = N_BINS - 1;
    if (valid && g0 < edges[0]) {
        b = filter_bin(g0, edges);
        mass = (u32)ceilf(g0 * FIXED_ONE);
    }
    u32 under = __reduce_add_sync(FULL_MASK, b == N_BINS - 1 ? mass : 0u);
    if ((threadIdx.x & 31) == 0 && under != 0) atomicAdd(&whist[N_BINS - 1], under);
    if (b != N_BINS - 1 && mass != 0) atomicAdd(&whist[b], mass);
}

// ------------------------------------------------------------------------------------------
// (3) Backward row kernel: G in place over L, per-row filter threshold
// ------------------------------------------------------------------------------------------
// Parameters:
//   L        f32 [rows, ld] logits of the chunk; G (DT, row stride ld·4/sizeof(DT)) is written
//            over it (module comment);
//   bias DT [V] or 0; targets i32 [rows]; lse, rest f32 [rows] (saved by the forward: the
//            log-sum-exp and 1 − p_y);
//   dl_rows  f32 [rows] per-row upstream loss gradient, or 0 → dl_scalar for every valid row;
//   dlse     f32 [rows] upstream lse gradient, or 0;
//   filter_on, edges f32 [65] (edge(k)), delta_fixed = floor(δ·2^30);
//   kept u32 [rows], dropped f32 [rows] per-row statistics (written when filter_on);
//   flags u32 [row tiles, n_ctiles] "tile kept an entry" (global row index row0 + r);
//   tau_out  f32 [rows] the row's threshold τ_i (0: nothing skipped), or 0 (split dense's
//            class pass reads it back);
//   row_scale    f32 [rows] 2^−s_i (mode 2 only, else 0). Modes: see GStore below.
// Tiling: one block per row. Pass 1 (filter on, active row): histogram of g0 in shared memory,
//   one private histogram per warp; τ by thread 0. Pass 2: G.
// Thread mapping: step s covers columns [s·STEP, (s+1)·STEP), STEP = BWD_THREADS·4·BWD_UNROLL;
//   thread t owns the float4 columns s·STEP + u·BWD_THREADS·4 + 4t (coalesced, BWD_UNROLL
//   loads in flight). Trip counts are uniform over the block (barriers, warp intrinsics).
//   In pass 2 every step reads its columns into registers, then a barrier, then writes G: the
//   writes of step s clobber f32 columns < (s+1)·STEP/2, all read by then.
#define BWD_THREADS 512
#define BWD_UNROLL 2

// G storage modes of the backward row kernel (template GM):
//   0: G in the input dtype DT, in place (chunked dense; split dense with f32 inputs);
//   2: f16 G scaled per row by 2^s_i (max |2^s_i G_ij| ≤ 2^14), in place, and
//      row_scale[r] = 2^−s_i (split dense with an f16 c).
template <int GM> struct GStore;
template <> struct GStore<2> {
    static __device__ __forceinline__ void put4(char* Gr, int j, float4 g, float sc) {
        Elem<1>::store4(Gr, j, make_float4(g.x * sc, g.y * sc, g.z * sc, g.w * sc));
    }
    static __device__ __forceinline__ void put(char* Gr, int j, float g, float sc) {
        Elem<1>::store(Gr, j, g * sc);
    }
};
template <int DT> struct GStoreDT {
    static __device__ __forceinline__ void put4(char* Gr, int j, float4 g, float) {
        Elem<DT>::store4(Gr, j, g);
    }
    static __device__ __forceinline__ void put(char* Gr, int j, float g, float) {
        Elem<DT>::store(Gr, j, g);
    }
};

template <int DT, int GM> struct GSel { typedef GStore<GM> T; };
template <int DT> struct GSel<DT, 0> { typedef GStoreDT<DT> T; };

// Power of two 2^s with max |2^s · G| ≤ 2^14 for a row whose |G_ij| ≤ bound (1 when 0).
__device__ __forceinline__ float g_row_scale(float bound) {
    if (!(bound > 0.0f) || !isfinite(bound)) return 1.0f;
    int s = 14 - (int)ceilf(log2f(bound));
    s = max(-100, min(100, s));
    return exp2f((float)s);
}

template <int DT, int GM>
__device__ __forceinline__ void dense_bwd(float* L, long long ld, int V, const void* bias,
                                          float softcap, const int* targets, const float* lse_in,
                                          const float* rest_in, const float* dl_rows,
                                          float dl_scalar,
                                          const float* dlse, float alpha, float lambda,
                                          int filter_on, const float* edges_g, u64 delta_fixed,
                                          u32* kept_out, float* dropped_out, u32* flags,
                                          long long row0, int tile_rows, int tile_classes,
                                          int n_ctiles, float* tau_out, float* row_scale) {
    typedef typename GSel<DT, GM>::T GS;
    __shared__ u32 hist[BWD_THREADS / 32][N_BINS];
    __shared__ u32 tot[N_BINS];
    __shared__ float edges[N_BINS];
    __shared__ float shf[64];
    __shared__ u32 shu[32];
    __shared__ float tau_sh;
    const int STEP = BWD_THREADS * 4 * BWD_UNROLL;
    const long long r = blockIdx.x;
    float* Lr = L + r * ld;
    char* Gr = (char*)Lr;
    const float inv_cap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
    const int V4 = V & ~3;
    const int y = targets[r];
    const float lse = lse_in[r];
    const float rest = rest_in[r];
    const GCoef c = g_coef(y, r, dl_rows, dl_scalar, dlse, lse, alpha, lambda, V);
    const int warp = threadIdx.x >> 5;
    const bool filt = filter_on && c.active;
    float tau = 0.0f;
    if (filt) {
        for (int k = threadIdx.x; k < (BWD_THREADS / 32) * N_BINS; k += BWD_THREADS)
            (&hist[0][0])[k] = 0;
        if (threadIdx.x < N_BINS) edges[threadIdx.x] = edges_g[threadIdx.x];
        __syncthreads();
        for (int b0 = 0; b0 < V4; b0 += STEP) {
            float4 xv[BWD_UNROLL];
#pragma unroll
            for (int u = 0; u < BWD_UNROLL; ++u) {
                int j = b0 + u * BWD_THREADS * 4 + threadIdx.x * 4;
                xv[u] = j < V4 ? *(const float4*)(Lr + j) : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int u = 0; u < BWD_UNROLL; ++u) {
                int j = b0 + u * BWD_THREADS * 4 + threadIdx.x * 4;
                bool ok = j < V4;
                float4 b = (bias && ok) ? Elem<DT>::load4(bias, j) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    float z = cap_z(f4get(xv[u], k) + f4get(b, k), softcap, inv_cap);
                    float g0 = (j + k == y) ? target_g0(rest, c.od) : __expf(z - lse);
                    hist_add(hist[warp], g0, ok, edges);
                }
            }
        }
        for (int b0 = V4; b0 < V; b0 += BWD_THREADS) {
            int j = b0 + threadIdx.x;
            bool ok = j < V;
            float g0 = 0.0f;
            if (ok) {
                float x = Lr[j];
                if (bias) x += Elem<DT>::load(bias, j);
                float z = cap_z(x, softcap, inv_cap);
                g0 = (j == y) ? target_g0(rest, c.od) : __expf(z - lse);
            }
            hist_add(hist[warp], g0, ok, edges);
        }
        __syncthreads();
        if (threadIdx.x < N_BINS) {
            u32 s = 0;
            for (int w = 0; w < BWD_THREADS / 32; ++w) s += hist[w][threadIdx.x];
            tot[threadIdx.x] = s;
        }
        __syncthreads();
        if (threadIdx.x == 0) tau_sh = filter_threshold(tot, delta_fixed, edges);
        __syncthreads();
        tau = tau_sh;
    }
    if (tau_out && threadIdx.x == 0) tau_out[r] = tau;
    const float gsc = GM == 2 ? g_row_scale(g_bound(c, y, rest)) : 1.0f;
    if (GM == 2 && threadIdx.x == 0) row_scale[r] = 1.0f / gsc;
    u32 kept = 0;
    float dropped = 0.0f;
    const long long flag_row = (row0 + r) / tile_rows;
    // One step loaded ahead: step b0's 16-bit stores land on f32 columns [b0/2, (b0 + STEP)/2),
    // read at or before step b0 (the barrier orders them), while the loads in flight are of
    // step b0 + STEP, past every column written so far; the barrier no longer drains them.
    float4 nx[BWD_UNROLL];
#pragma unroll
    for (int u = 0; u < BWD_UNROLL; ++u) {
        int j = u * BWD_THREADS * 4 + threadIdx.x * 4;
        nx[u] = j < V4 ? *(const float4*)(Lr + j) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    for (int b0 = 0; b0 < V4; b0 += STEP) {
        float4 xv[BWD_UNROLL];
#pragma unroll
        for (int u = 0; u < BWD_UNROLL; ++u) {
            xv[u] = nx[u];
            int j = b0 + STEP + u * BWD_THREADS * 4 + threadIdx.x * 4;
            if (j < V4) nx[u] = *(const float4*)(Lr + j);
        }
        __syncthreads();  // every read of this step before any write of it (in-place G)
#pragma unroll
        for (int u = 0; u < BWD_UNROLL; ++u) {
            int j = b0 + u * BWD_THREADS * 4 + threadIdx.x * 4;
            bool any_kept = false;
            if (j < V4) {
                float4 b = bias ? Elem<DT>::load4(bias, j) : make_float4(0.f, 0.f, 0.f, 0.f);
                float4 gv;
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    float x = f4get(xv[u], k) + f4get(b, k);
                    float z = cap_z(x, softcap, inv_cap);
                    f4set(gv, k, g_entry(x, z, j + k, y, lse, rest, c, tau, softcap, inv_cap,
                                         kept, dropped, any_kept));
                }
                GS::put4(Gr, j, gv, gsc);
            }
            if (filt) flag_tile(flags, flag_row, n_ctiles, tile_classes, j, any_kept);
        }
    }
    // Scalar tail (V mod 4 < BWD_THREADS columns): read, barrier, write.
    {
        int j = V4 + threadIdx.x;
        float x = 0.0f;
        if (j < V) {
            x = Lr[j];
            if (bias) x += Elem<DT>::load(bias, j);
        }
        __syncthreads();
        if (j < V) {
            bool any_kept = false;
            float z = cap_z(x, softcap, inv_cap);
            float gv = g_entry(x, z, j, y, lse, rest, c, tau, softcap, inv_cap, kept, dropped,
                               any_kept);
            GS::put(Gr, j, gv, gsc);
            if (filt && any_kept) atomicOr(&flags[flag_row * n_ctiles + j / tile_classes], 1u);
        }
    }
    if (filter_on) {
        float unused = 0.0f;
        block_sum2u(dropped, unused, kept, shf, shu);
        if (threadIdx.x == 0) {
            kept_out[r] = c.active ? kept : INACTIVE_ROW;
            dropped_out[r] = c.active ? dropped : 0.0f;
        }
    }
}

#define BWD_PARAMS                                                                            \
    float *L, long long ld, int V, const void *bias, float softcap, const int *targets,      \
        const float *lse_in, const float *rest_in, const float *dl_rows, float dl_scalar,    \
        const float *dlse,                                                                    \
        float alpha, float lambda, int filter_on, const float *edges_g, u64 delta_fixed,     \
        u32 *kept_out, float *dropped_out, u32 *flags, long long row0, int tile_rows,        \
        int tile_classes, int n_ctiles, float *tau_out, float *row_scale
#define BWD_ARGS                                                                              \
    L, ld, V, bias, softcap, targets, lse_in, rest_in, dl_rows, dl_scalar, dlse, alpha, lambda, \
        filter_on, edges_g, delta_fixed, kept_out, dropped_out, flags, row0, tile_rows,       \
        tile_classes, n_ctiles, tau_out, row_scale

extern "C" __global__ void __launch_bounds__(BWD_THREADS) cce_dense_bwd_f32(BWD_PARAMS) {
    dense_bwd<0, 0>(BWD_ARGS);
}
extern "C" __global__ void __launch_bounds__(BWD_THREADS) cce_dense_bwd_f16(BWD_PARAMS) {
    dense_bwd<1, 0>(BWD_ARGS);
}
extern "C" __global__ void __launch_bounds__(BWD_THREADS) cce_dense_bwd_f16s_f16(BWD_PARAMS) {
    dense_bwd<1, 2>(BWD_ARGS);
}
extern "C" __global__ void __launch_bounds__(BWD_THREADS) cce_dense_bwd_f16s_bf16(BWD_PARAMS) {
    dense_bwd<2, 2>(BWD_ARGS);
}

extern "C" __global__ void __launch_bounds__(BWD_THREADS) cce_dense_bwd_bf16(BWD_PARAMS) {
    dense_bwd<2, 0>(BWD_ARGS);
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
// ------------------------------------------------------------------------------------------
// (2)+(3) fused: one row per thread-block cluster, the row resident in shared memory
// ------------------------------------------------------------------------------------------
// Parameters: the union of the forward's and the backward's (lse, rest, loss, entropy, argmax
//   are outputs here), plus `slice` = columns per block (a multiple of 4; CS·slice ≥ V).
// Tiling: a cluster of CS blocks owns one row; block `rank` owns columns
//   [rank·slice, min((rank+1)·slice, V)) and keeps their x + bias in dynamic shared memory
//   (slice·4 bytes; z = cap_z of it where needed, the softcap's factor needs x). The row is read from HBM once; max, Σexp, the histogram and
//   G are computed from shared memory. Cluster-wide values are combined through distributed
//   shared memory: lanes q < CS of warp 0 read block q's partial, lane 0 combines them in rank
//   order (identical in every block, bitwise deterministic).
// Thread mapping: FUSED_THREADS threads; float4 columns 4·t + s·4·FUSED_THREADS of the slice.
// Ordering: G is written only after the first cluster barrier, when every block of the
//   cluster has read its slice of L (in-place G clobbers the first half of the row's bytes);
//   the last cluster barrier keeps every block's shared memory alive until peers have read it.
#define FUSED_THREADS 512

__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ void cluster_sync_all() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\t"
                 "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u64 a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (u32)a;
}
// Read the 32-bit word at local shared address `addr` of block `rank` of the cluster.
__device__ __forceinline__ u32 dsmem_ld_u32(u32 addr, u32 rank) {
    u32 remote, v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(remote));
    return v;
}
__device__ __forceinline__ float dsmem_ld_f32(u32 addr, u32 rank) {
    return __uint_as_float(dsmem_ld_u32(addr, rank));
}

struct FusedShared {
    RowAcc acc[32];
    float m1, zs1, s2, t2, dropped4;  // this block's partials (read by peers)
    int am1;
    u32 kept4;
    float M, ZS, S, T, EY, tau;  // cluster-wide values, broadcast to the block (S: no target)
    int AM;
    u32 hist[FUSED_THREADS / 32][N_BINS];
    u32 tot[N_BINS];   // this block's histogram (read by peers)
    u32 tot2[N_BINS];  // the cluster's histogram
    float edges[N_BINS];
    float shf[64];
    u32 shu[32];
};

template <int DT, int CS>
__device__ __forceinline__ void dense_fused(float* L, long long ld, int V, int slice,
                                            const void* bias, float softcap, const int* targets,
                                            float alpha, float lambda, const float* dl_rows,
                                            float dl_scalar, const float* dlse, int filter_on,
                                            const float* edges_g, u64 delta_fixed,
                                            float* lse_out, float* rest_out, float* loss_out,
                                            float* ent_out,
                                            int* am_out, u32* kept_out, float* dropped_out,
                                            u32* flags, long long row0, int tile_rows,
                                            int tile_classes, int n_ctiles) {
    extern __shared__ float4 zbuf4[];
    float* zbuf = (float*)zbuf4;
    __shared__ FusedShared sh;
    const u32 rank = CS > 1 ? cluster_rank() : 0;
    const long long r = blockIdx.x / CS;
    float* Lr = L + r * ld;
    char* Gr = (char*)Lr;
    const float inv_cap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
    const int c0 = (int)rank * slice;
    const int c1 = min(c0 + slice, V);
    const int cnt = max(c1 - c0, 0);
    const int cnt4 = cnt & ~3;
    const int y = targets[r];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    // Load the slice: z into shared memory; thread-local max (first index), Σz.
    float m = NEG_INF, zs = 0.0f;
    int am = 0x7fffffff;
    for (int base = threadIdx.x * 4; base < cnt4; base += FUSED_THREADS * 4 * 4) {
        float4 xv[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            int jj = base + u * FUSED_THREADS * 4;
            xv[u] = jj < cnt4 ? gemm_logit4(*(const float4*)(Lr + c0 + jj))
                              : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            int jj = base + u * FUSED_THREADS * 4;
            if (jj < cnt4) {
                float4 b = bias ? Elem<DT>::load4(bias, c0 + jj) : make_float4(0.f, 0.f, 0.f, 0.f);
                float4 zv;
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    float x = f4get(xv[u], k) + f4get(b, k);
                    float z = cap_z(x, softcap, inv_cap);
                    f4set(zv, k, x);
                    if (z > m) { m = z; am = c0 + jj + k; }
                    zs += unmasked(z);
                }
                *(float4*)(zbuf + jj) = zv;
            }
        }
    }
    for (int jj = cnt4 + threadIdx.x; jj < cnt; jj += FUSED_THREADS) {
        float x = gemm_logit(Lr[c0 + jj]);
        if (bias) x += Elem<DT>::load(bias, c0 + jj);
        float z = cap_z(x, softcap, inv_cap);
        zbuf[jj] = x;
        if (z > m) { m = z; am = c0 + jj; }
        zs += unmasked(z);
    }
    // Stage 1: block then cluster max / argmax / Σz.
    {
        RowAcc a;
        a.m = m; a.s = 0.0f; a.t = 0.0f; a.zs = zs; a.am = am;
        a = block_acc(a, sh.acc);
        if (threadIdx.x == 0) { sh.m1 = a.m; sh.am1 = a.am; sh.zs1 = a.zs; }
    }
    if (CS > 1) cluster_sync_all(); else __syncthreads();
    // From here on the whole row of L has been read by the cluster: G may be written.
    if (warp == 0) {
        float mq = NEG_INF, zq = 0.0f;
        int amq = 0x7fffffff;
        if (lane < CS) {
            if (CS > 1) {
                mq = dsmem_ld_f32(smem_addr(&sh.m1), lane);
                amq = (int)dsmem_ld_u32(smem_addr(&sh.am1), lane);
                zq = dsmem_ld_f32(smem_addr(&sh.zs1), lane);
            } else {
                mq = sh.m1; amq = sh.am1; zq = sh.zs1;
            }
        }
        float M = NEG_INF, ZS = 0.0f;
        int AM = 0x7fffffff;
        for (int q = 0; q < CS; ++q) {
            float a = __shfl_sync(FULL_MASK, mq, q);
            int b = __shfl_sync(FULL_MASK, amq, q);
            float z = __shfl_sync(FULL_MASK, zq, q);
            if (a > M || (a == M && b < AM)) AM = b;
            M = fmaxf(M, a);
            ZS += z;
        }
        if (lane == 0) { sh.M = M; sh.AM = AM; sh.ZS = ZS; }
    }
    __syncthreads();
    const float M = sh.M;
    // Stage 2: Σ_{j≠y} exp(z − M), Σ exp(z − M)·z from shared memory.
    float s = 0.0f, t = 0.0f;
    if (M != NEG_INF) {
        for (int jj = threadIdx.x * 4; jj < cnt4; jj += FUSED_THREADS * 4) {
            float4 zv = *(const float4*)(zbuf + jj);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                float z = cap_z(f4get(zv, k), softcap, inv_cap);
                float e = __expf(z - M);
                s += c0 + jj + k == y ? 0.0f : e;
                t += e * unmasked(z);
            }
        }
        for (int jj = cnt4 + threadIdx.x; jj < cnt; jj += FUSED_THREADS) {
            float z = cap_z(zbuf[jj], softcap, inv_cap);
            float e = __expf(z - M);
            s += c0 + jj == y ? 0.0f : e;
            t += e * unmasked(z);
        }
    }
    {
        u32 unused = 0;
        block_sum2u(s, t, unused, sh.shf, sh.shu);
        if (threadIdx.x == 0) { sh.s2 = s; sh.t2 = t; }
    }
    if (CS > 1) cluster_sync_all(); else __syncthreads();
    if (warp == 0) {
        float sq = 0.0f, tq = 0.0f;
        if (lane < CS) {
            if (CS > 1) {
                sq = dsmem_ld_f32(smem_addr(&sh.s2), lane);
                tq = dsmem_ld_f32(smem_addr(&sh.t2), lane);
            } else {
                sq = sh.s2; tq = sh.t2;
            }
        }
        float S = 0.0f, T = 0.0f;
        for (int q = 0; q < CS; ++q) {
            S += __shfl_sync(FULL_MASK, sq, q);
            T += __shfl_sync(FULL_MASK, tq, q);
        }
        if (lane == 0) {
            float zy = 0.0f;
            if (y >= 0) {
                // z_y from the shared memory of the block owning column y (every block reads
                // it: the last cluster barrier keeps the owner's shared memory alive).
                u32 owner = (u32)(y / slice);
                int off = y - (int)owner * slice;
                zy = cap_z(CS > 1 ? dsmem_ld_f32(smem_addr(zbuf + off), owner) : zbuf[off],
                           softcap, inv_cap);
            }
            sh.S = S;
            sh.T = T;
            sh.EY = (y >= 0 && zy != NEG_INF) ? __expf(zy - M) : 0.0f;
            if (rank == 0)
                write_row_outputs(r, y, M, S, zy, sh.ZS, T, sh.AM, alpha, lambda, V, lse_out,
                                  rest_out, loss_out, ent_out, am_out);
        }
    }
    __syncthreads();
    // As write_row_outputs.
    const float lse = M + logf(sh.S + sh.EY);
    const float rest = y >= 0 ? sh.S / (sh.S + sh.EY) : 0.0f;
    const GCoef c = g_coef(y, r, dl_rows, dl_scalar, dlse, lse, alpha, lambda, V);
    // filt is uniform over the cluster (one row): every block takes the barrier below or none.
    const bool filt = filter_on && c.active;
    // Stage 3 (filter): histogram of g0, cluster-wide threshold.
    float tau = 0.0f;
    if (filt) {
        for (int k = threadIdx.x; k < (FUSED_THREADS / 32) * N_BINS; k += FUSED_THREADS)
            (&sh.hist[0][0])[k] = 0;
        if (threadIdx.x < N_BINS) sh.edges[threadIdx.x] = edges_g[threadIdx.x];
        __syncthreads();
        for (int b0 = 0; b0 < cnt; b0 += FUSED_THREADS) {
            int jj = b0 + threadIdx.x;
            bool ok = jj < cnt;
            float g0 = 0.0f;
            if (ok) {
                g0 = (c0 + jj == y) ? target_g0(rest, c.od)
                                    : __expf(cap_z(zbuf[jj], softcap, inv_cap) - lse);
            }
            hist_add(sh.hist[warp], g0, ok, sh.edges);
        }
        __syncthreads();
        if (threadIdx.x < N_BINS) {
            u32 v = 0;
            for (int w = 0; w < FUSED_THREADS / 32; ++w) v += sh.hist[w][threadIdx.x];
            sh.tot[threadIdx.x] = v;
        }
        if (CS > 1) cluster_sync_all(); else __syncthreads();
        if (threadIdx.x < N_BINS) {
            u32 v = 0;
            for (int q = 0; q < CS; ++q)
                v += CS > 1 ? dsmem_ld_u32(smem_addr(&sh.tot[threadIdx.x]), (u32)q)
                            : sh.tot[threadIdx.x];
            sh.tot2[threadIdx.x] = v;
        }
        __syncthreads();
        if (threadIdx.x == 0) sh.tau = filter_threshold(sh.tot2, delta_fixed, sh.edges);
        __syncthreads();
        tau = sh.tau;
    }
    // Stage 4: G from shared memory, written over the row's first bytes.
    u32 kept = 0;
    float dropped = 0.0f;
    const long long flag_row = (row0 + r) / tile_rows;
    for (int b0 = 0; b0 < cnt4; b0 += FUSED_THREADS * 4) {
        int jj = b0 + threadIdx.x * 4;
        bool any_kept = false;
        if (jj < cnt4) {
            float4 xv = *(const float4*)(zbuf + jj);
            float4 gv;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                float x = f4get(xv, k);
                f4set(gv, k, g_entry(x, cap_z(x, softcap, inv_cap), c0 + jj + k, y, lse, rest, c,
                                     tau, softcap, inv_cap, kept, dropped, any_kept));
            }
            Elem<DT>::store4(Gr, c0 + jj, gv);
        }
        if (filt) flag_tile(flags, flag_row, n_ctiles, tile_classes, c0 + jj, any_kept);
    }
    for (int jj = cnt4 + threadIdx.x; jj < cnt; jj += FUSED_THREADS) {
        bool any_kept = false;
        float x = zbuf[jj];
        float gv = g_entry(x, cap_z(x, softcap, inv_cap), c0 + jj, y, lse, rest, c, tau, softcap,
                           inv_cap, kept, dropped, any_kept);
        Elem<DT>::store(Gr, c0 + jj, gv);
        if (filt && any_kept) atomicOr(&flags[flag_row * n_ctiles + (c0 + jj) / tile_classes], 1u);
    }
    if (filter_on) {
        float unused = 0.0f;
        block_sum2u(dropped, unused, kept, sh.shf, sh.shu);
        if (threadIdx.x == 0) { sh.dropped4 = dropped; sh.kept4 = kept; }
    }
    // Peers read z_y, the stage partials and (below) the statistics from this block's shared
    // memory: keep it alive until they have (and publish the statistics).
    if (CS > 1) cluster_sync_all(); else __syncthreads();
    if (filter_on && rank == 0 && warp == 0) {
        float dq = 0.0f;
        u32 kq = 0;
        if (lane < CS) {
            dq = CS > 1 ? dsmem_ld_f32(smem_addr(&sh.dropped4), lane) : sh.dropped4;
            kq = CS > 1 ? dsmem_ld_u32(smem_addr(&sh.kept4), lane) : sh.kept4;
        }
        float dsum = 0.0f;
        u32 ksum = 0;
        for (int q = 0; q < CS; ++q) {
            dsum += __shfl_sync(FULL_MASK, dq, q);
            ksum += __shfl_sync(FULL_MASK, kq, q);
        }
        if (lane == 0) {
            kept_out[r] = c.active ? ksum : INACTIVE_ROW;
            dropped_out[r] = c.active ? dsum : 0.0f;
        }
    }
    if (filter_on && CS > 1) cluster_sync_all();
}

#define FUSED_PARAMS                                                                          \
    float *L, long long ld, int V, int slice, const void *bias, float softcap,                \
        const int *targets, float alpha, float lambda, const float *dl_rows, float dl_scalar, \
        const float *dlse, int filter_on, const float *edges_g, u64 delta_fixed,             \
        float *lse_out, float *rest_out, float *loss_out, float *ent_out, int *am_out,        \
        u32 *kept_out,                                                                        \
        float *dropped_out, u32 *flags, long long row0, int tile_rows, int tile_classes,      \
        int n_ctiles
#define FUSED_ARGS                                                                            \
    L, ld, V, slice, bias, softcap, targets, alpha, lambda, dl_rows, dl_scalar, dlse,         \
        filter_on, edges_g, delta_fixed, lse_out, rest_out, loss_out, ent_out, am_out,        \
        kept_out,                                                                             \
        dropped_out, flags, row0, tile_rows, tile_classes, n_ctiles

#define FUSED_KERNEL(NAME, DT, CS)                                                            \
    extern "C" __global__ void __cluster_dims__(CS, 1, 1) __launch_bounds__(FUSED_THREADS, 1) \
        NAME(FUSED_PARAMS) {                                                                  \
        dense_fused<DT, CS>(FUSED_ARGS);                                                      \
    }
FUSED_KERNEL(cce_dense_fused_f32_c1, 0, 1)
FUSED_KERNEL(cce_dense_fused_f32_c2, 0, 2)
FUSED_KERNEL(cce_dense_fused_f32_c4, 0, 4)
FUSED_KERNEL(cce_dense_fused_f32_c8, 0, 8)
FUSED_KERNEL(cce_dense_fused_f32_c16, 0, 16)
FUSED_KERNEL(cce_dense_fused_f16_c1, 1, 1)
FUSED_KERNEL(cce_dense_fused_f16_c2, 1, 2)
FUSED_KERNEL(cce_dense_fused_f16_c4, 1, 4)
FUSED_KERNEL(cce_dense_fused_f16_c8, 1, 8)
FUSED_KERNEL(cce_dense_fused_f16_c16, 1, 16)
FUSED_KERNEL(cce_dense_fused_bf16_c1, 2, 1)
FUSED_KERNEL(cce_dense_fused_bf16_c2, 2, 2)
FUSED_KERNEL(cce_dense_fused_bf16_c4, 2, 4)
FUSED_KERNEL(cce_dense_fused_bf16_c8, 2, 8)
FUSED_KERNEL(cce_dense_fused_bf16_c16, 2, 16)

#endif  // __CUDA_ARCH__ >= 900

// ------------------------------------------------------------------------------------------
// (4') The target's entry of a 16-bit G, exact in d_e
// ------------------------------------------------------------------------------------------
// Parameters: G u16 [rows, ldg] the chunk's G as the d_e GEMM read it (g16: 1 f16, 2 bf16),
//   row_scale f32 [rows] (G stored times 1 / row_scale: split dense's f16 G) or 0; targets,
//   lse, rest, dl_rows (or dl_scalar), dlse (or 0): chunk-relative as cce_dense_bwd; α, λ, V,
//   softcap, bias DT [V] or 0; e DT [rows, D] (the chunk's rows), c DT [V, D]; d_e [rows, D]
//   in out_kind (0 f32, 1 f16, 2 bf16), updated in place: d_e_i += r_i · c_{y_i}, r_i = (the
//   target's G in f32) − (its 16-bit value in G). The target's entry is a row's largest, and on
//   a confident row (1 − p_y ≪ 1) nearly its whole d_e: rounded to bf16 it would carry 2⁻⁹ of
//   it; corrected, d_e's error is that of the other, smaller entries.
// Tiling: one warp per row, TFIX_THREADS / 32 rows per block.
// Thread mapping: lane l owns the columns l + 32·k of D (the softcap's x_y = e_i·c_y + bias_y as
//   a fixed-order dot product, then the update, TFIX_UNROLL columns per step).
#define TFIX_THREADS 256
// d_e[row + k] += res · c[cy + k] over k < D, lane l the columns l + 32·j: TFIX_UNROLL columns'
// loads issued before their stores (d_e and c may alias as far as the compiler knows, so
// without the grouping each column's loads wait for the previous column's store).
#define TFIX_UNROLL 8
template <int DT, int OUT>
__device__ __forceinline__ void target_fix_add(void* d_e, const void* c, long long row,
                                               long long cy, int D, int lane, float res) {
    for (int k0 = lane; k0 < D; k0 += 32 * TFIX_UNROLL) {
        float v[TFIX_UNROLL];
#pragma unroll
        for (int u = 0; u < TFIX_UNROLL; ++u) {
            const int k = k0 + 32 * u;
            v[u] = k < D ? Elem<OUT>::load(d_e, row + k) + res * Elem<DT>::load(c, cy + k) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < TFIX_UNROLL; ++u) {
            const int k = k0 + 32 * u;
            if (k < D) Elem<OUT>::store(d_e, row + k, v[u]);
        }
    }
}
template <int DT>
__device__ __forceinline__ void target_fix(const u16* G, long long ldg, int g16,
                                           const float* row_scale, const int* targets,
                                           const float* lse, const float* rest,
                                           const float* dl_rows, float dl_scalar,
                                           const float* dlse, float alpha, float lambda, int V,
                                           float softcap, const void* bias, const void* e,
                                           const void* c, int D, void* d_e, int out_kind,
                                           int rows) {
    const long long r = (long long)blockIdx.x * (TFIX_THREADS / 32) + (threadIdx.x >> 5);
    if (r >= rows) return;  // whole warps
    const int lane = threadIdx.x & 31;
    const int y = targets[r];
    if (y < 0) return;
    const GCoef cf = g_coef(y, r, dl_rows, dl_scalar, dlse, lse[r], alpha, lambda, V);
    if (!cf.active) return;
    float g = g_target(cf, rest[r]);
    if (softcap > 0.0f) {
        float x = 0.0f;
        for (int k = lane; k < D; k += 32)
            x = fmaf(Elem<DT>::load(e, r * D + k), Elem<DT>::load(c, (long long)y * D + k), x);
        x = warp_sum(x);
        if (bias) x += Elem<DT>::load(bias, y);
        g *= cap_grad(x, 1.0f / softcap);
    }
    const u16 h = G[r * ldg + y];
    float stored = g16 == 1 ? f16_to_f32(h) : bf16_to_f32(h);
    if (row_scale) stored *= row_scale[r];
    const float res = g - stored;
    if (res == 0.0f || !isfinite(res)) return;  // warp-uniform
    if (out_kind == 0)
        target_fix_add<DT, 0>(d_e, c, r * D, (long long)y * D, D, lane, res);
    else if (out_kind == 1)
        target_fix_add<DT, 1>(d_e, c, r * D, (long long)y * D, D, lane, res);
    else
        target_fix_add<DT, 2>(d_e, c, r * D, (long long)y * D, D, lane, res);
}
#define TFIX_PARAMS                                                                           \
    const u16 *G, long long ldg, int g16, const float *row_scale, const int *targets,        \
        const float *lse, const float *rest, const float *dl_rows, float dl_scalar,          \
        const float *dlse, float alpha, float lambda, int V, float softcap, const void *bias, \
        const void *e, const void *c, int D, void *d_e, int out_kind, int rows
#define TFIX_ARGS                                                                             \
    G, ldg, g16, row_scale, targets, lse, rest, dl_rows, dl_scalar, dlse, alpha, lambda, V,  \
        softcap, bias, e, c, D, d_e, out_kind, rows
extern "C" __global__ void __launch_bounds__(TFIX_THREADS) cce_dense_target_fix_f16(TFIX_PARAMS) {
    target_fix<1>(TFIX_ARGS);
}
extern "C" __global__ void __launch_bounds__(TFIX_THREADS) cce_dense_target_fix_bf16(TFIX_PARAMS) {
    target_fix<2>(TFIX_ARGS);
}

// ------------------------------------------------------------------------------------------
// d_bias: column sums of G
// ------------------------------------------------------------------------------------------
// Parameters: G (DT, [rows, ldg]); acc f32 [V] += *scale · Σ_rows G (fixed row order:
//   deterministic); scale f32 (device: a power of two undoing the scaling of split dense's
//   f16 G) or null (→ 1, chunked dense).
// Tiling: grid.x = ⌈V / COLSUM_THREADS⌉ column blocks.
// Thread mapping: one column per thread, rows in order; a warp reads 32 consecutive columns;
//   the scale loaded once per thread.
#define COLSUM_THREADS 256
template <int DT>
__device__ __forceinline__ void dense_colsum(const void* G, long long ldg, int rows, int V,
                                             float* acc, const float* scale) {
    int j = blockIdx.x * COLSUM_THREADS + threadIdx.x;
    if (j >= V) return;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
    int i = 0;
    for (; i + 4 <= rows; i += 4) {
        s0 += Elem<DT>::load(G, (long long)i * ldg + j);
        s1 += Elem<DT>::load(G, (long long)(i + 1) * ldg + j);
        s2 += Elem<DT>::load(G, (long long)(i + 2) * ldg + j);
        s3 += Elem<DT>::load(G, (long long)(i + 3) * ldg + j);
    }
    for (; i < rows; ++i) s0 += Elem<DT>::load(G, (long long)i * ldg + j);
    acc[j] += ((s0 + s1) + (s2 + s3)) * (scale ? *scale : 1.0f);
}
#define COLSUM_PARAMS                                                                         \
    const void *G, long long ldg, int rows, int V, float *acc, const float *scale
extern "C" __global__ void __launch_bounds__(COLSUM_THREADS) cce_dense_colsum_f32(COLSUM_PARAMS) {
    dense_colsum<0>(G, ldg, rows, V, acc, scale);
}
extern "C" __global__ void __launch_bounds__(COLSUM_THREADS) cce_dense_colsum_f16(COLSUM_PARAMS) {
    dense_colsum<1>(G, ldg, rows, V, acc, scale);
}
extern "C" __global__ void __launch_bounds__(COLSUM_THREADS) cce_dense_colsum_bf16(COLSUM_PARAMS) {
    dense_colsum<2>(G, ldg, rows, V, acc, scale);
}

