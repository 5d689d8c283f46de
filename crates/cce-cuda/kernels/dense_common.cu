// dense_common.cu: the shared device code of the row kernels of Strategy::ChunkedDense and
// Strategy::SplitDense (cce-core plan.rs); the kernels follow in forward.cu, rows.cu,
// classes.cu (split dense's class pass), dense_util.cu, sparse.cu and sparse_gather.cu, one
// NVRTC module in that order (src/dense/mod.rs `KERNEL_SOURCE`); products are cuBLAS GEMMs.
//
// Parameters (every kernel, details at each kernel):
//   L    f32 [rows, ld] logits of one row chunk (ld a multiple of 8), row-major; the backward
//        writes G over it in the gradient dtype with row stride ld·4/sizeof(G);
//   bias DT [V] or 0; targets i32 [rows] (class, −1 = ignored), chunk-relative like every
//        per-row array (lse, loss, entropy, argmax, kept, dropped, upstream gradients);
//   flags u32 [row tiles, class tiles] of the plan's tile grid (filter statistics).
// Tiling: one row per block (fwd, bwd) or per thread-block cluster (fused, CS blocks each
//   owning a contiguous slice of the row in shared memory); a row is streamed in steps of
//   THREADS·4·UNROLL columns.
// Thread mapping: thread t owns the float4 columns 4·t + k·4·THREADS of its row (coalesced
//   16-byte loads, UNROLL loads in flight); block reductions by warp shuffles then one warp,
//   in a fixed order (bitwise deterministic).
//
// Per row chunk of R rows:
//   (1) cuBLAS: L = E_r · Cᵀ, f32 [R, V] with row stride `ld`;
//   (2) cce_dense_fwd_*:   bias, softcap, online max / Σexp → lse, loss, entropy, argmax;
//   (3) cce_dense_bwd_*:   G = ∂loss/∂z (MATH.md "Backward") written IN PLACE over L in the
//                          gradient dtype, with the per-row filter threshold τ_i (filter.rs);
//       or cce_dense_fused_*: (2) and (3) in one pass, the row held in the shared memory of a
//                          thread-block cluster (one HBM read of L instead of two);
//   (4) cuBLAS: d_e_r = G · C, (5) cuBLAS: d_c += Gᵀ · E_r (f32 accumulator), d_bias by
//       cce_dense_colsum_*.
// Forward-only calls over class tiles (cce-core ClassForward) instead: cuBLAS L of all rows x a
// chunk of classes, then cce_cls_fwd_* folds it into a running per-row lse state, section (2').
//
// In-place G: row r of L occupies bytes [4·r·ld, 4·(r+1)·ld). G of row r is written at the
// start of the same byte range, element j at byte 4·r·ld + j·sizeof(G); as a matrix G has the
// row stride ld·4/sizeof(G) elements (2·ld for 16-bit G). Writing 16-bit G element j clobbers
// f32 element j/2 of the same row, so a block must have read every f32 element < j/2 + 1 of the
// row before writing G element j (see the barriers in cce_dense_bwd and the cluster barrier in
// cce_dense_fused). Nothing of another row is touched.
//
// dtypes: DT 0 = f32, 1 = f16, 2 = bf16. 16-bit values are carried as unsigned short and
// converted with cvt PTX (no CUDA headers needed by NVRTC). Kernel symbols carry the dtype.
// Optional pointers are 0 when absent. Indices into [R, V] matrices are 64-bit. The fused
// kernels need sm_90 (clusters, distributed shared memory) and are compiled only there.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define FULL_MASK 0xffffffffu
#define NEG_INF (__int_as_float(0xff800000))
#define N_BINS 65
#define FIXED_ONE 1073741824.0f /* 2^30, cce-core FIXED_POINT_ONE */
#define INACTIVE_ROW 0xffffffffu /* kept_out of a row with zero upstream gradient */

// ------------------------------------------------------------------------------------------
// Element conversion
// ------------------------------------------------------------------------------------------

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f32_to_bf16(float x) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
__device__ __forceinline__ u16 f32_to_f16(float x) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

template <int DT> struct Elem;
template <> struct Elem<0> {
    static __device__ __forceinline__ float load(const void* p, long long i) {
        return ((const float*)p)[i];
    }
    // i is a multiple of 4 and the base is 16-byte aligned.
    static __device__ __forceinline__ float4 load4(const void* p, long long i) {
        return *(const float4*)((const float*)p + i);
    }
    static __device__ __forceinline__ void store(void* p, long long i, float x) {
        ((float*)p)[i] = x;
    }
    static __device__ __forceinline__ void store4(void* p, long long i, float4 v) {
        *(float4*)((float*)p + i) = v;
    }
};
template <int DT> struct Elem16 {
    static __device__ __forceinline__ float cvt_in(u16 h) {
        return DT == 1 ? f16_to_f32(h) : bf16_to_f32(h);
    }
    static __device__ __forceinline__ u16 cvt_out(float x) {
        return DT == 1 ? f32_to_f16(x) : f32_to_bf16(x);
    }
    static __device__ __forceinline__ float load(const void* p, long long i) {
        return cvt_in(((const u16*)p)[i]);
    }
    // i is a multiple of 4 and the base is 8-byte aligned.
    static __device__ __forceinline__ float4 load4(const void* p, long long i) {
        uint2 u = *(const uint2*)((const u16*)p + i);
        return make_float4(cvt_in((u16)(u.x & 0xffff)), cvt_in((u16)(u.x >> 16)),
                           cvt_in((u16)(u.y & 0xffff)), cvt_in((u16)(u.y >> 16)));
    }
    static __device__ __forceinline__ void store(void* p, long long i, float x) {
        ((u16*)p)[i] = cvt_out(x);
    }
    static __device__ __forceinline__ void store4(void* p, long long i, float4 v) {
        uint2 u;
        u.x = (u32)cvt_out(v.x) | ((u32)cvt_out(v.y) << 16);
        u.y = (u32)cvt_out(v.z) | ((u32)cvt_out(v.w) << 16);
        *(uint2*)((u16*)p + i) = u;
    }
};
template <> struct Elem<1> : Elem16<1> {};
template <> struct Elem<2> : Elem16<2> {};

__device__ __forceinline__ float f4get(const float4& v, int k) {
    return k == 0 ? v.x : (k == 1 ? v.y : (k == 2 ? v.z : v.w));
}
__device__ __forceinline__ void f4set(float4& v, int k, float x) {
    if (k == 0) v.x = x; else if (k == 1) v.y = x; else if (k == 2) v.z = x; else v.w = x;
}

// z = softcap(x + bias): the one definition every kernel uses, so that the forward, the
// histogram and G see the same bits.
// Only finite logits are capped: one that overflowed f32 stays infinite (or NaN), so the lse
// is not finite and the host reports the overflow (capped it would be a silent ±softcap).
// A −inf logit (a class masked by a −inf bias entry) stays −inf: p = 0, whatever the softcap.
__device__ __forceinline__ float cap_z(float x, float softcap, float inv_softcap) {
    return softcap > 0.0f && isfinite(x) ? softcap * tanhf(x * inv_softcap) : x;
}

// The softcap's derivative dz/dx = 1 − tanh²(u), u = x/s, as 4e/(1 + e)² with e = e^{−2|u|}:
// full relative accuracy for every u (1 − (z/s)² cancels once |z| is near s: at u = 10 it is
// 8e-9 and 1 − (z/s)² rounds to 0), 0 for an infinite x (a masked class).
__device__ __forceinline__ float cap_grad(float x, float inv_softcap) {
    const float e = expf(-2.0f * fabsf(x * inv_softcap));
    const float d = 1.0f + e;
    return __fdividef(4.0f * e, d * d);  // d² in [1, 4]: the fast division is exact to 2 ulp
}

// A logit that is not −inf: the one compare-and-select by which masked classes (−inf, e.g.
// from a −inf bias) drop out of Σz and get an exact 0 in G (a NaN stays in: it is an error).
__device__ __forceinline__ float unmasked(float z) { return z == NEG_INF ? 0.0f : z; }

// A logit e_i·c_j of −inf (before the bias) means −inf in e or c, or an overflow: invalid
// input (only the bias may mask a class), so the forward kernels turn it into NaN, which makes
// the row's lse NaN and the host's check_finite report the input instead of a silent mask.
__device__ __forceinline__ float gemm_logit(float l) {
    return l == NEG_INF ? __int_as_float(0x7fc00000) : l;
}
__device__ __forceinline__ float4 gemm_logit4(float4 v) {
    return make_float4(gemm_logit(v.x), gemm_logit(v.y), gemm_logit(v.z), gemm_logit(v.w));
}

// ------------------------------------------------------------------------------------------
// Reductions (fixed shuffle / shared-memory trees: bitwise deterministic)
// ------------------------------------------------------------------------------------------

// Online log-sum-exp state: m = max (over every column, the target's included), s = Σ exp(z − m)
// over the columns other than the row's target y (the target's term is added at the end, so
// that 1 − p_y = s / (s + e^{z_y − m}) keeps its relative accuracy on confident rows), t = Σ
// exp(z − m)·z over every column, am = argmax (lowest index on ties), zs = Σ z over the
// unmasked columns (z > −inf). Masked columns (z = −inf) add 0 to s, t and zs.
struct RowAcc {
    float m, s, t, zs;
    int am;
};

__device__ __forceinline__ void acc_init(RowAcc& a) {
    a.m = NEG_INF; a.s = 0.0f; a.t = 0.0f; a.zs = 0.0f; a.am = 0x7fffffff;
}

__device__ __forceinline__ void acc_merge(RowAcc& a, const RowAcc& b) {
    float M = fmaxf(a.m, b.m);
    int am;
    if (b.m > a.m || (b.m == a.m && b.am < a.am)) am = b.am; else am = a.am;
    if (M != NEG_INF) {
        float ea = __expf(a.m - M), eb = __expf(b.m - M);
        a.s = a.s * ea + b.s * eb;
        a.t = a.t * ea + b.t * eb;
    } else {
        a.s = a.s + b.s;
        a.t = a.t + b.t;
    }
    a.m = M;
    a.am = am;
    a.zs += b.zs;
}

__device__ __forceinline__ RowAcc acc_shfl(const RowAcc& a, int o) {
    RowAcc b;
    b.m = __shfl_xor_sync(FULL_MASK, a.m, o);
    b.s = __shfl_xor_sync(FULL_MASK, a.s, o);
    b.t = __shfl_xor_sync(FULL_MASK, a.t, o);
    b.zs = __shfl_xor_sync(FULL_MASK, a.zs, o);
    b.am = __shfl_xor_sync(FULL_MASK, a.am, o);
    return b;
}

// Add one value z at column j (columns visited in increasing order per thread); y is the row's
// target column (−1: none), whose term s leaves out.
__device__ __forceinline__ void acc_push(RowAcc& a, float z, int j, int y) {
    if (z > a.m) {
        float e = __expf(a.m - z);  // exp(-inf) = 0 for the first value
        a.s = a.s * e + (j == y ? 0.0f : 1.0f);
        a.t = a.t * e + z;
        a.m = z;
        a.am = j;
    } else if (a.m != NEG_INF || z != z) {  // NaN z makes s NaN (lse non-finite)
        float e = __expf(z - a.m);
        if (j != y) a.s += e;
        a.t += e * unmasked(z);
    }
    a.zs += unmasked(z);
}

// Add the U float4 groups xv[u] at columns j0 + u·ustride + k (k = 0..3), the groups with
// j0 + u·ustride < lim only (whole float4s; columns increase with u, then k). Same result as
// acc_push over them in column order but for rounding: one max over the batch, at most one
// rescale, then per value one exp and three adds (acc_push branches and may rescale per
// value; the row kernels were instruction-bound on it, docs/perf-log.md "Session 5").
template <int U>
__device__ __forceinline__ void acc_push_batch(RowAcc& a, const float4 (&xv)[U], int j0,
                                               int ustride, int lim, int y) {
    float bm = NEG_INF;
#pragma unroll
    for (int u = 0; u < U; ++u)
        if (j0 + u * ustride < lim)
            bm = fmaxf(fmaxf(bm, fmaxf(xv[u].x, xv[u].y)), fmaxf(xv[u].z, xv[u].w));
    if (bm > a.m) {
        // The first column holding the new maximum (NaN never compares equal).
        int am = a.am;
#pragma unroll
        for (int u = U - 1; u >= 0; --u)
            if (j0 + u * ustride < lim)
#pragma unroll
                for (int k = 3; k >= 0; --k)
                    if (f4get(xv[u], k) == bm) am = j0 + u * ustride + k;
        float e = __expf(a.m - bm);  // 0 for the first values
        a.s *= e;
        a.t *= e;
        a.m = bm;
        a.am = am;
    }
    // m = −inf only while every value so far is −inf or NaN: exp(z − 0) is then 0 or NaN
    // (a NaN z makes s NaN, as in acc_push).
    const float m = a.m == NEG_INF ? 0.0f : a.m;
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if (j0 + u * ustride < lim) {
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                float z = f4get(xv[u], k);
                float e = __expf(z - m);
                a.s += j0 + u * ustride + k == y ? 0.0f : e;
                a.t = fmaf(e, unmasked(z), a.t);
                a.zs += unmasked(z);
            }
        }
    }
}

// Block-wide merge; the result is valid in thread 0. `sh` holds 32 RowAcc.
__device__ __forceinline__ RowAcc block_acc(RowAcc a, RowAcc* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        RowAcc b = acc_shfl(a, o);
        acc_merge(a, b);
    }
    if (lane == 0) sh[warp] = a;
    __syncthreads();
    if (warp == 0) {
        if (lane < nw) a = sh[lane]; else acc_init(a);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            RowAcc b = acc_shfl(a, o);
            acc_merge(a, b);
        }
    }
    __syncthreads();
    return a;
}

// The forward outputs of row r from its reduced state (MATH.md "Forward"): m the row's max (or
// the max of the other columns: a z_y above it becomes the reference), s_rest = Σ_{j≠y}
// e^{z_j − m} (every column at an ignored row, y < 0), z_y the target's logit,
// zs = Σz over the unmasked columns, t = Σ e^{z − m}·z. Writes lse = m + log(s_rest + e^{z_y − m}),
// rest = s_rest / (s_rest + e^{z_y − m}) = 1 − p_y without cancellation (0 at ignored rows;
// rest_out may be 0), the loss ℓ = (1−α)·(lse − z_y) + α·(lse − Σz/V) + λ·lse² with
// lse − z_y = log1p(s_rest / e^{z_y − m}) (exact on confident rows; 0 at ignored rows), the
// entropy lse − t/(s_rest + e^{z_y − m}) (ent_out may be 0) and the argmax (am_out may be 0; 0
// for a row of NaNs). A row whose target is masked (z_y = −inf) has rest = 1 and an infinite
// loss; the host rejects it before (CceError::TargetMasked).
__device__ __forceinline__ void write_row_outputs(long long r, int y, float m, float s_rest,
                                                  float zy, float zs, float t, int am,
                                                  float alpha, float lambda, int V,
                                                  float* lse_out, float* rest_out,
                                                  float* loss_out, float* ent_out, int* am_out) {
    if (y >= 0 && zy > m) {  // m = −inf (no other unmasked column) gives s_rest = t = 0
        const float f = __expf(m - zy);
        s_rest *= f;
        t *= f;
        m = zy;
    }
    const float ey = (y >= 0 && zy != NEG_INF) ? __expf(zy - m) : 0.0f;
    const float S = s_rest + ey;
    const float lse = m + logf(S);
    float loss = 0.0f;
    float rest = 0.0f;
    if (y >= 0) {
        rest = s_rest / S;
        // lse − z_y: log1p(s_rest / e_y) keeps a confident row's ~rest-sized loss exact;
        // (m − z_y) + log(S) where e_y underflows.
        const float ce = ey > 1e-30f ? log1pf(s_rest / ey) : (m - zy) + logf(S);
        loss = (1.0f - alpha) * ce + lambda * lse * lse;
        if (alpha != 0.0f) loss += alpha * (lse - zs / (float)V);
    }
    lse_out[r] = lse;
    if (rest_out) rest_out[r] = rest;
    loss_out[r] = loss;
    if (ent_out) ent_out[r] = lse - t / S;
    if (am_out) am_out[r] = am == 0x7fffffff ? 0 : am;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}
__device__ __forceinline__ u32 warp_sum_u32(u32 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Block sums of (float, float, u32); result valid in every thread. `shf` holds 64 floats,
// `shu` 32 u32.
__device__ __forceinline__ void block_sum2u(float& a, float& b, u32& c, float* shf, u32* shu) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    a = warp_sum(a); b = warp_sum(b); c = warp_sum_u32(c);
    __syncthreads();
    if (lane == 0) { shf[warp] = a; shf[32 + warp] = b; shu[warp] = c; }
    __syncthreads();
    a = 0.0f; b = 0.0f; c = 0;
    for (int w = 0; w < nw; ++w) { a += shf[w]; b += shf[32 + w]; c += shu[w]; }
    __syncthreads();
}

// ------------------------------------------------------------------------------------------
// Filter helpers (cce-core filter.rs): bins of g0 = |p − onehot| below eps, 4 per octave.
// ------------------------------------------------------------------------------------------

// Bin of g0 < edges[0] (= eps), using the host-computed edges (edges[k] = eps·2^(−k/4)), with
// the same guard loops as FilterRule::bin, so bins match the CPU reference exactly.
__device__ __forceinline__ int filter_bin(float g0, const float* edges) {
    if (g0 <= 0.0f) return N_BINS - 1;
    // A first guess from the fast intrinsics (MUFU: no IEEE division or log2), made exact by
    // the comparisons with the edges below (it is off by at most one bin at a boundary).
    float k = floorf(-4.0f * __log2f(__fdividef(g0, edges[0])));
    int b = (int)fminf(fmaxf(k, 0.0f), (float)(N_BINS - 1));
    while (b > 0 && g0 >= edges[b]) --b;
    while (b < N_BINS - 1 && g0 < edges[b + 1]) ++b;
    return b;
}

// Threshold from a fixed-point histogram (2^30 per unit mass, ceil-rounded per entry): the
// largest edge whose below-mass is ≤ delta_fixed, or 0. Called by one thread.
__device__ __forceinline__ float filter_threshold(const u32* hist, u64 delta_fixed,
                                                  const float* edges) {
    u64 below = 0;
    int best = -1;
    for (int k = N_BINS - 1; k >= 0; --k) {
        below += hist[k];
        if (below <= delta_fixed) best = k; else break;
    }
    return best >= 0 ? edges[best] : 0.0f;
}

// Row coefficients of G (MATH.md "Backward"): G = cp·p − cy·[j = y] − cc, times the softcap
// factor. g = upstream loss gradient of the row (0 when ignored), h = upstream lse gradient.
// The target's entry cp·p_y − cy − cc = cd − cp·rest − cc, with rest = 1 − p_y (saved by the
// forward without cancellation) and cd = cp − cy = g·(α + 2λ·lse) + h formed directly: on a
// confident row (rest below the f32 lse's resolution) p_y − 1 from e^{z_y − lse} would be 0.
struct GCoef {
    float cp, cy, cc;
    float cd;  // cp − cy without cancellation
    float od;  // cd / cp (1 when cp = 0): the target's G vanishes at rest = od
    bool active;
};

__device__ __forceinline__ GCoef g_coef(int y, long long row, const float* dl_rows,
                                        float dl_scalar, const float* dlse, float lse,
                                        float alpha, float lambda, int V) {
    GCoef c;
    float g = y >= 0 ? (dl_rows ? dl_rows[row] : dl_scalar) : 0.0f;
    float h = dlse ? dlse[row] : 0.0f;
    c.cp = g * (1.0f + 2.0f * lambda * lse) + h;
    c.cy = g * (1.0f - alpha);
    c.cc = g * alpha / (float)V;
    c.cd = g * (alpha + 2.0f * lambda * lse) + h;
    // α without z-loss or an lse gradient; 1 without a loss gradient. With z-loss the
    // target's G = cd − cp·rest stays ≈ g·(α + 2λ·lse) as rest → 0, so rest alone would let a
    // large entry be skipped: in units of |cp| (those of every other entry, |G| = |cp|·p) the
    // target's size is |rest − cd/cp|.
    c.od = c.cp != 0.0f ? c.cd / c.cp : 1.0f;
    c.active = (g != 0.0f) || (h != 0.0f);
    return c;
}

// Filter magnitude of the target entry from rest = 1 − p_y: max(rest, |rest − od|)
// (GCoef::od: α without z-loss and lse gradient, 1 for a row with only an lse gradient). The
// first term keeps the contract's rule (skippable only if |p − 1| < eps); the second the
// entry's real size |G| / |cp|, so a target with p → 1 is never skipped under label smoothing
// or z-loss, nor in a row whose G at the target is h·p.
__device__ __forceinline__ float target_g0(float rest, float od) {
    return fmaxf(rest, fabsf(rest - od));
}

// The target's entry of G (before the softcap factor): cd − cp·rest − cc.
__device__ __forceinline__ float g_target(const GCoef& c, float rest) {
    return c.cd - c.cp * rest - c.cc;
}

// A bound of |G_ij| over the row (before the softcap factor, which is ≤ 1): every other entry
// is cp·p_j − cc with p_j ≤ rest (≤ 1 at an ignored row, y < 0), the target's g_target. Tight
// on confident rows (all of G is ~rest there), so the power-of-two scales of f16 G do not
// flush their entries to zero.
__device__ __forceinline__ float g_bound(const GCoef& c, int y, float rest) {
    const float pmax = y >= 0 ? rest : 1.0f;
    const float other = fabsf(c.cp) * pmax + fabsf(c.cc);
    return y >= 0 ? fmaxf(other, fabsf(g_target(c, rest))) : other;
}

// One entry of G at column j from its logit x (bias added, before the softcap) and z =
// cap_z(x); rest = 1 − p_y of the row. Returns G (exactly 0 for a masked class, x = −inf);
// adds to kept / dropped.
__device__ __forceinline__ float g_entry(float x, float z, int j, int y, float lse, float rest,
                                         const GCoef& c, float tau, float softcap,
                                         float inv_softcap, u32& kept, float& dropped,
                                         bool& any_kept) {
    bool tgt = (j == y);
    float p = tgt ? 1.0f - rest : __expf(z - lse);
    float g0 = tgt ? target_g0(rest, c.od) : p;
    float gv;
    if (g0 < tau) {  // skipped (tau = 0 when the filter is off or the row inactive)
        dropped += g0;
        gv = -c.cc;
    } else {
        ++kept;
        any_kept = true;
        gv = tgt ? g_target(c, rest) : c.cp * p - c.cc;
    }
    if (softcap > 0.0f) gv *= cap_grad(x, inv_softcap);
    return x == NEG_INF ? 0.0f : gv;
}

// Warp-aggregated "this (row tile, class tile) kept an entry" flag. All 32 lanes must call it
// (convergent); `j` is the lane's column (any value when !valid).
__device__ __forceinline__ void flag_tile(u32* flags, long long flag_row, int n_ctiles,
                                          int tile_classes, int j, bool kept_any) {
    int t = j / tile_classes;
    u32 grp = __match_any_sync(FULL_MASK, t);
    u32 any = __ballot_sync(FULL_MASK, kept_any) & grp;
    int lane = threadIdx.x & 31;
    if (any != 0 && lane == __ffs(grp) - 1) atomicOr(&flags[flag_row * n_ctiles + t], 1u);
}

