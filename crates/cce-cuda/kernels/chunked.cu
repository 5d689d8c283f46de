// chunked.cu: the row kernels of Strategy::ChunkedDense and Strategy::SplitDense (cce-core
// plan.rs; split dense's class pass: section "Split dense"); products are cuBLAS GEMMs.
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

// ------------------------------------------------------------------------------------------
// (2) Forward row kernel
// ------------------------------------------------------------------------------------------
// Parameters:
//   L        f32 [rows, ld] logits of the chunk (read only), row-major, 16-byte aligned rows;
//   bias     DT [V] or 0;  targets i32 [rows] (class or −1), chunk-relative;
//   lse, rest (1 − p_y, write_row_outputs), loss, entropy (f32 [rows]), argmax (i32 [rows])
//   outputs, chunk-relative; entropy and argmax may be 0. loss = per-row ℓ_i (0 at ignored
//   rows).
// Tiling: one block per row; the row is streamed in steps of FWD_THREADS·4·FWD_UNROLL columns.
// Thread mapping: thread t owns columns 4·t + k·4·FWD_THREADS (float4 loads, coalesced across
// the warp), FWD_UNROLL loads in flight per thread; the scalar tail (V mod 4) one per thread.
#define FWD_THREADS 256
#define FWD_UNROLL 4

template <int DT>
__device__ __forceinline__ void dense_fwd(const float* __restrict__ L, long long ld, int V,
                                          const void* __restrict__ bias, float softcap,
                                          const int* __restrict__ targets, float alpha,
                                          float lambda, float* lse_out, float* rest_out,
                                          float* loss_out, float* ent_out, int* am_out) {
    __shared__ RowAcc sh[32];
    const long long r = blockIdx.x;
    const float* Lr = L + r * ld;
    const float inv_cap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
    const int V4 = V & ~3;
    const int y = targets[r];
    RowAcc a;
    acc_init(a);
    for (int base = threadIdx.x * 4; base < V4; base += FWD_THREADS * 4 * FWD_UNROLL) {
        float4 xv[FWD_UNROLL];
#pragma unroll
        for (int u = 0; u < FWD_UNROLL; ++u) {
            int j = base + u * FWD_THREADS * 4;
            xv[u] = j < V4 ? gemm_logit4(__ldg((const float4*)(Lr + j)))
                           : make_float4(0.f, 0.f, 0.f, 0.f);
        }
        if (bias) {
#pragma unroll
            for (int u = 0; u < FWD_UNROLL; ++u) {
                int j = base + u * FWD_THREADS * 4;
                if (j < V4) {
                    float4 b = Elem<DT>::load4(bias, j);
                    xv[u].x += b.x; xv[u].y += b.y; xv[u].z += b.z; xv[u].w += b.w;
                }
            }
        }
        if (softcap > 0.0f) {
#pragma unroll
            for (int u = 0; u < FWD_UNROLL; ++u)
#pragma unroll
                for (int k = 0; k < 4; ++k) f4set(xv[u], k, cap_z(f4get(xv[u], k), softcap, inv_cap));
        }
        acc_push_batch<FWD_UNROLL>(a, xv, base, FWD_THREADS * 4, V4, y);
    }
    for (int j = V4 + threadIdx.x; j < V; j += FWD_THREADS) {
        float x = gemm_logit(Lr[j]);
        if (bias) x += Elem<DT>::load(bias, j);
        acc_push(a, cap_z(x, softcap, inv_cap), j, y);
    }
    a = block_acc(a, sh);
    if (threadIdx.x == 0) {
        float zy = 0.0f;
        if (y >= 0) {
            float x = Lr[y];
            if (bias) x += Elem<DT>::load(bias, y);
            zy = cap_z(x, softcap, inv_cap);
        }
        write_row_outputs(r, y, a.m, a.s, zy, a.zs, a.t, a.am, alpha, lambda, V, lse_out,
                          rest_out, loss_out, ent_out, am_out);
    }
}

#define FWD_PARAMS                                                                            \
    const float *__restrict__ L, long long ld, int V, const void *__restrict__ bias,         \
        float softcap, const int *__restrict__ targets, float alpha, float lambda,           \
        float *lse_out, float *rest_out, float *loss_out, float *ent_out, int *am_out
#define FWD_ARGS                                                                              \
    L, ld, V, bias, softcap, targets, alpha, lambda, lse_out, rest_out, loss_out, ent_out, am_out

extern "C" __global__ void __launch_bounds__(FWD_THREADS) cce_dense_fwd_f32(FWD_PARAMS) {
    dense_fwd<0>(FWD_ARGS);
}
extern "C" __global__ void __launch_bounds__(FWD_THREADS) cce_dense_fwd_f16(FWD_PARAMS) {
    dense_fwd<1>(FWD_ARGS);
}
extern "C" __global__ void __launch_bounds__(FWD_THREADS) cce_dense_fwd_bf16(FWD_PARAMS) {
    dense_fwd<2>(FWD_ARGS);
}

// ------------------------------------------------------------------------------------------
// (2') Forward over class tiles (cce-core ClassForward: forward-only calls)
// ------------------------------------------------------------------------------------------
// Parameters:
//   L        f32 [rows, ldk] logits of one tile: rows r0.., classes c0..c0+K, row-major
//            (ldk a multiple of 8, 32-byte aligned rows);
//   bias     DT [V] (full; read at c0 + j) or 0;  targets i32 [rows] (class or −1), tile-relative;
//   state    f32 [rows, 6] running (m, s, t, zs, argmax bits, target logit) per row (s without
//            the target's term, RowAcc),
//            tile-relative; written by the first tile of a row group (`first`), merged into
//            by the others in class order;
//   lse, rest, loss, entropy, argmax: as cce_dense_fwd (tile-relative), written by the last tile
//            (`last`) only; entropy and argmax may be 0.
// Tiling: the logits of a forward-only call come in tiles of ClassForward's rows x classes;
//   this kernel reduces one tile's rows over its K classes and folds them into `state`, so
//   the lse of a row is the online log-sum-exp over its class tiles (the paper's section 4.1
//   blockwise lse). The host alternates two tile buffers: this kernel reads one (on a second
//   stream) while cuBLAS writes the next.
// Thread mapping: one warp per row (CLS_ROWS rows per block); lane l owns the float4 columns
//   4·l + 128·k of its row, CLS_UNROLL loads in flight; warp shuffles merge the lanes in a
//   fixed order and lane 0 merges the row state (bitwise deterministic).
#define CLS_THREADS 256
#define CLS_ROWS (CLS_THREADS / 32)
#define CLS_UNROLL 4

template <int DT, int UNROLL>
__device__ __forceinline__ void cls_fwd_row(const float* __restrict__ L, long long ldk, int K,
                                            int c0, int V, long long r,
                                            const void* __restrict__ bias, float softcap,
                                            const int* __restrict__ targets, float alpha,
                                            float lambda, float* __restrict__ state, int first,
                                            int last, float* lse_out, float* rest_out,
                                            float* loss_out, float* ent_out, int* am_out) {
    const int lane = threadIdx.x & 31;
    const int y = targets[r];
    const float* Lr = L + r * ldk;
    const float inv_cap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
    const int K4 = K & ~3;
    RowAcc a;
    acc_init(a);
    for (int base = lane * 4; base < K4; base += 128 * UNROLL) {
        float4 xv[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            int j = base + u * 128;
            xv[u] = j < K4 ? gemm_logit4(__ldg((const float4*)(Lr + j)))
                           : make_float4(0.f, 0.f, 0.f, 0.f);
        }
        if (bias) {
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                int j = base + u * 128;
                if (j < K4) {
                    float4 b = Elem<DT>::load4(bias, c0 + j);
                    xv[u].x += b.x; xv[u].y += b.y; xv[u].z += b.z; xv[u].w += b.w;
                }
            }
        }
        if (softcap > 0.0f) {
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
#pragma unroll
                for (int k = 0; k < 4; ++k) f4set(xv[u], k, cap_z(f4get(xv[u], k), softcap, inv_cap));
        }
        acc_push_batch<UNROLL>(a, xv, c0 + base, 128, c0 + K4, y);
    }
    for (int j = K4 + lane; j < K; j += 32) {
        float x = gemm_logit(Lr[j]);
        if (bias) x += Elem<DT>::load(bias, c0 + j);
        acc_push(a, cap_z(x, softcap, inv_cap), c0 + j, y);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        RowAcc b = acc_shfl(a, o);
        acc_merge(a, b);
    }
    if (lane != 0) return;
    float* st = state + r * 6;
    float zy = first ? 0.0f : st[5];
    if (y >= c0 && y < c0 + K) {
        float x = Lr[y - c0];
        if (bias) x += Elem<DT>::load(bias, y);
        zy = cap_z(x, softcap, inv_cap);
    }
    if (!first) {
        // Earlier classes first: acc_merge keeps the lower argmax on ties.
        RowAcc p;
        p.m = st[0]; p.s = st[1]; p.t = st[2]; p.zs = st[3]; p.am = __float_as_int(st[4]);
        acc_merge(p, a);
        a = p;
    }
    if (!last) {
        st[0] = a.m; st[1] = a.s; st[2] = a.t; st[3] = a.zs; st[4] = __int_as_float(a.am);
        st[5] = zy;
        return;
    }
    write_row_outputs(r, y, a.m, a.s, zy, a.zs, a.t, a.am, alpha, lambda, V, lse_out, rest_out,
                      loss_out, ent_out, am_out);
}

#define CLS_PARAMS                                                                            \
    const float *__restrict__ L, long long ldk, int K, int c0, int V, int rows,               \
        const void *__restrict__ bias, float softcap, const int *__restrict__ targets,       \
        float alpha, float lambda, float *__restrict__ state, int first, int last,           \
        float *lse_out, float *rest_out, float *loss_out, float *ent_out, int *am_out

#define CLS_ROW_ARGS L, ldk, K, c0, V, r, bias, softcap, targets, alpha, lambda, state, first, \
    last, lse_out, rest_out, loss_out, ent_out, am_out
#define CLS_KERNELS(DTN, DT)                                                                  \
    extern "C" __global__ void __launch_bounds__(CLS_THREADS) cce_cls_fwd_##DTN(CLS_PARAMS) { \
        const long long r = (long long)blockIdx.x * CLS_ROWS + (threadIdx.x >> 5);            \
        if (r < rows) cls_fwd_row<DT, CLS_UNROLL>(CLS_ROW_ARGS);                              \
    }
CLS_KERNELS(f32, 0)
CLS_KERNELS(f16, 1)
CLS_KERNELS(bf16, 2)

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
//   a fixed-order dot product, then the update).
#define TFIX_THREADS 256
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
    for (int k = lane; k < D; k += 32) {
        const long long i = r * D + k;
        const float add = res * Elem<DT>::load(c, (long long)y * D + k);
        if (out_kind == 0)
            Elem<0>::store(d_e, i, Elem<0>::load(d_e, i) + add);
        else if (out_kind == 1)
            Elem<1>::store(d_e, i, Elem<1>::load(d_e, i) + add);
        else
            Elem<2>::store(d_e, i, Elem<2>::load(d_e, i) + add);
    }
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
// Parameters: G (DT, [rows, ldg]); acc f32 [V] += scale · Σ_rows G (fixed row order:
//   deterministic; scale undoes a power-of-two scaling of G).
// Tiling: grid.x = ⌈V / COLSUM_THREADS⌉ column blocks.
// Thread mapping: one column per thread, rows in order; a warp reads 32 consecutive columns.
#define COLSUM_THREADS 256
template <int DT>
__device__ __forceinline__ void dense_colsum(const void* G, long long ldg, int rows, int V,
                                             float* acc, float scale) {
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
    acc[j] += ((s0 + s1) + (s2 + s3)) * scale;
}
#define COLSUM_PARAMS const void *G, long long ldg, int rows, int V, float *acc, float scale
extern "C" __global__ void __launch_bounds__(COLSUM_THREADS) cce_dense_colsum_f32(COLSUM_PARAMS) {
    dense_colsum<0>(G, ldg, rows, V, acc, scale);
}
extern "C" __global__ void __launch_bounds__(COLSUM_THREADS) cce_dense_colsum_f16(COLSUM_PARAMS) {
    dense_colsum<1>(G, ldg, rows, V, acc, scale);
}
extern "C" __global__ void __launch_bounds__(COLSUM_THREADS) cce_dense_colsum_bf16(COLSUM_PARAMS) {
    dense_colsum<2>(G, ldg, rows, V, acc, scale);
}

// ------------------------------------------------------------------------------------------
// Split dense (Strategy::SplitDense): the class pass
// ------------------------------------------------------------------------------------------
// The row pass is steps (1)-(4) above with tau_out set. The class pass, per chunk of K
// classes [k0, k0+K), over all N rows:
//   (a) cuBLAS: L = E · C[k0:k0+K]ᵀ, f32 [N, ldk];
//   (b) cce_split_gcols_*: G of those columns from the saved lse and τ_i, written in place,
//       scaled by 2^s into f16 (bf16/f16 inputs: 11-bit significand instead of bf16's 8, so
//       d_c is ~8x more exact than with bf16 G) or kept f32 (f32 inputs);
//   (c) cuBLAS: d_c[k0:k0+K] = 2^(k−s) · G'ᵀ · E' with E' = f16(2^−k · e) (cce_split_e_to_f16_*,
//       once per call; e itself for f16/f32 inputs), written in the gradient dtype;
//   (d) d_bias by cce_dense_colsum_* with scale 2^−s.
// The scales come from cce_split_scales_* (max |e| and max_i |coefficients of G_i|), read
// back once per call.

// Parameters: e DT [count]; targets i32 [N]; dl_rows f32 [N] or 0 (→ dl_scalar); dlse f32 [N]
//   or 0; lse, rest f32 [N]; out u32 [2] (zeroed by the caller) = bits of {max |e|, max_i
//   g_bound_i}, the bound of |G_ij| (g_coef, g_bound).
// Tiling: grid-stride over e, then over rows.
// Thread mapping: one element / row per thread per step; per-block max by warp shuffles, one
//   atomicMax per warp on the bit pattern (non-negative floats order like their bits: the
//   result does not depend on the order).
template <int DT>
__device__ __forceinline__ void split_scales(const void* e, long long count, const int* targets,
                                             const float* dl_rows, float dl_scalar,
                                             const float* dlse, const float* lse,
                                             const float* rest, float alpha, float lambda, int N,
                                             int V, u32* out) {
    float me = 0.0f, mc = 0.0f;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride)
        me = fmaxf(me, fabsf(Elem<DT>::load(e, i)));
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < N; i += stride) {
        const int y = targets[i];
        GCoef c = g_coef(y, i, dl_rows, dl_scalar, dlse, lse[i], alpha, lambda, V);
        mc = fmaxf(mc, g_bound(c, y, y >= 0 ? rest[i] : 0.0f));
    }
    me = warp_max(me);
    mc = warp_max(mc);
    if ((threadIdx.x & 31) == 0) {
        atomicMax(&out[0], __float_as_uint(me));
        atomicMax(&out[1], __float_as_uint(mc));
    }
}
#define SCALES_PARAMS                                                                         \
    const void *e, long long count, const int *targets, const float *dl_rows,                \
        float dl_scalar, const float *dlse, const float *lse, const float *rest, float alpha,  \
        float lambda, int N, int V, u32 *out
#define SCALES_ARGS                                                                           \
    e, count, targets, dl_rows, dl_scalar, dlse, lse, rest, alpha, lambda, N, V, out
extern "C" __global__ void __launch_bounds__(256) cce_split_scales_f32(SCALES_PARAMS) {
    split_scales<0>(SCALES_ARGS);
}
extern "C" __global__ void __launch_bounds__(256) cce_split_scales_f16(SCALES_PARAMS) {
    split_scales<1>(SCALES_ARGS);
}
extern "C" __global__ void __launch_bounds__(256) cce_split_scales_bf16(SCALES_PARAMS) {
    split_scales<2>(SCALES_ARGS);
}

// Parameters: src bf16 [count]; dst f16 [count] = f16(src · scale), scale a power of two that
//   keeps max |src · scale| ≤ 2^15 (exact for |src · scale| ≥ 2^−14: bf16's 8 significand bits
//   fit f16's 11). Used for e (class pass) and c (row pass with an f16 c).
// Tiling / thread mapping: grid-stride, one element per thread per step.
extern "C" __global__ void __launch_bounds__(256) cce_split_e_to_f16_bf16(const u16* src, u16* dst,
                                                                         long long count,
                                                                         float scale) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride)
        dst[i] = f32_to_f16(bf16_to_f32(src[i]) * scale);
}

// d_e rows from the f32 product of the row pass: d_e[r, k] = out(tmp[r, k] · rs[r] · cscale),
//   rs = row_scale (mode 2) or 0 (→ 1). tmp f32 [rows, D]; d_e OT [rows, D] (0 f32, 1 f16,
//   2 bf16). Tiling / thread mapping: grid-stride over rows·D, one element per thread.
template <int OT>
__device__ __forceinline__ void split_de_finish(const float* tmp, const float* rs, float cscale,
                                                void* de, long long rows, int D) {
    const long long n = rows * D;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float s = (rs ? rs[i / D] : 1.0f) * cscale;
        Elem<OT>::store(de, i, tmp[i] * s);
    }
}
#define DEF_PARAMS const float *tmp, const float *rs, float cscale, void *de, long long rows, int D
extern "C" __global__ void __launch_bounds__(256) cce_split_de_finish_f32(DEF_PARAMS) {
    split_de_finish<0>(tmp, rs, cscale, de, rows, D);
}
extern "C" __global__ void __launch_bounds__(256) cce_split_de_finish_f16(DEF_PARAMS) {
    split_de_finish<1>(tmp, rs, cscale, de, rows, D);
}
extern "C" __global__ void __launch_bounds__(256) cce_split_de_finish_bf16(DEF_PARAMS) {
    split_de_finish<2>(tmp, rs, cscale, de, rows, D);
}

// (b) G of one class chunk, in place.
// Parameters:
//   L      f32 [N, ld] logits of classes [k0, k0+K) (ld a multiple of 8, 16-byte aligned
//          rows), row-major; G is written over it in GT (0 = f32, 1 = f16) with row stride
//          ld·4/sizeof(GT);
//   bias   DT [V] or 0 (indexed k0 + j); targets i32 [N] (global class or −1); lse, rest
//          (1 − p_y), tau f32 [N] from the row pass; dl_rows / dl_scalar / dlse as in the backward row kernel;
//   g_scale the power of two G is multiplied by before it is stored.
// Tiling: GC_ROWS rows per block, one warp per row, the row streamed in steps of 128 columns.
// Thread mapping: lane l owns the float4 columns 4·l + 128·u of step u (one step loaded
//   ahead). An f16 store of step u's columns lands on f32 columns [64u, 64u + 64), which the
//   warp loaded at step ⌊u/2⌋ ≤ u: a __syncwarp between each step's loads and its stores keeps
//   every load ahead of the store that overwrites it; later steps read only columns past it.
//   Per value: one exp and the G formula of g_entry without its statistics (the class pass
//   reports none); the target column is fixed up by its one lane.
#define GC_THREADS 256
#define GC_ROWS (GC_THREADS / 32)
template <int DT, int GT>
__device__ __forceinline__ void split_gcols(float* L, long long ld, int K, int k0, int V,
                                            const void* bias, float softcap, const int* targets,
                                            const float* lse_in, const float* rest_in,
                                            const float* tau_in, const float* dl_rows,
                                            float dl_scalar,
                                            const float* dlse, float alpha, float lambda,
                                            float g_scale, int rows) {
    const long long r = (long long)blockIdx.x * GC_ROWS + (threadIdx.x >> 5);
    if (r >= rows) return;  // whole warps leave: no block barrier below
    const int lane = threadIdx.x & 31;
    float* Lr = L + r * ld;
    const int y = targets[r];
    const float lse = lse_in[r];
    const float rest = y >= k0 && y < k0 + K ? rest_in[r] : 0.0f;
    const GCoef c = g_coef(y, r, dl_rows, dl_scalar, dlse, lse, alpha, lambda, V);
    const float tau = c.active ? tau_in[r] : 0.0f;
    const float inv_cap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
    const float cp = c.cp, cc = c.cc;
    const int yc = (c.active && y >= k0 && y < k0 + K) ? y - k0 : -1;  // target column
    const int K4 = K & ~3;
    auto gval = [&](float x, int j) -> float {
        if (!c.active) return 0.0f;  // exact zeros, whatever the row's logits or lse
        float xb = x + (bias ? Elem<DT>::load(bias, (long long)k0 + j) : 0.0f);
        float z = cap_z(xb, softcap, inv_cap);
        float p = __expf(z - lse);
        float gv;
        if (j == yc) {
            gv = target_g0(rest, c.od) < tau ? -cc : g_target(c, rest);
        } else {
            gv = p < tau ? -cc : cp * p - cc;
        }
        if (softcap > 0.0f) gv *= cap_grad(xb, inv_cap);
        return xb == NEG_INF ? 0.0f : gv * g_scale;
    };
    float4 nx = 4 * lane < K4 ? *(const float4*)(Lr + 4 * lane) : make_float4(0.f, 0.f, 0.f, 0.f);
    for (int b = 0; b < K4; b += 128) {
        const int j = b + 4 * lane;
        const float4 x = nx;
        const int jn = j + 128;
        if (jn < K4) nx = *(const float4*)(Lr + jn);
        float4 g = make_float4(0.f, 0.f, 0.f, 0.f);
        if (j < K4) {
            g.x = gval(x.x, j);
            g.y = gval(x.y, j + 1);
            g.z = gval(x.z, j + 2);
            g.w = gval(x.w, j + 3);
        }
        __syncwarp();
        if (j < K4) Elem<GT>::store4(Lr, j, g);
    }
    // The tail (K mod 4 columns): loads of the whole tail, then its stores.
    float xt = 0.0f;
    const int jt = K4 + lane;
    if (jt < K) xt = Lr[jt];
    __syncwarp();
    if (jt < K) Elem<GT>::store(Lr, jt, gval(xt, jt));
}
#define GCOLS_PARAMS                                                                          \
    float *L, long long ld, int K, int k0, int V, const void *bias, float softcap,           \
        const int *targets, const float *lse_in, const float *rest_in, const float *tau_in,  \
        const float *dl_rows, float dl_scalar, const float *dlse, float alpha, float lambda,  \
        float g_scale, int rows
#define GCOLS_ARGS                                                                            \
    L, ld, K, k0, V, bias, softcap, targets, lse_in, rest_in, tau_in, dl_rows, dl_scalar, dlse, \
        alpha, lambda, g_scale, rows
extern "C" __global__ void __launch_bounds__(GC_THREADS) cce_split_gcols_f32(GCOLS_PARAMS) {
    split_gcols<0, 0>(GCOLS_ARGS);
}
extern "C" __global__ void __launch_bounds__(GC_THREADS) cce_split_gcols_f16(GCOLS_PARAMS) {
    split_gcols<1, 1>(GCOLS_ARGS);
}
extern "C" __global__ void __launch_bounds__(GC_THREADS) cce_split_gcols_bf16(GCOLS_PARAMS) {
    split_gcols<2, 1>(GCOLS_ARGS);
}

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

// out[0] = scale · Σ_i x[i], f64 accumulation in a fixed order. One block of 1024 threads.
extern "C" __global__ void __launch_bounds__(1024) cce_dense_sum_rows(const float* x, int n,
                                                                     double scale, float* out) {
    __shared__ double sh[1024];
    double s = 0.0;
    for (int i = threadIdx.x; i < n; i += 1024) s += (double)x[i];
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int w = 512; w > 0; w >>= 1) {
        if (threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[0] = (float)(sh[0] * scale);
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

// ------------------------------------------------------------------------------------------
// Sparse backward (cce-core plan.rs SparseBackward; PERFORMANCE.md "Design space" 4)
// ------------------------------------------------------------------------------------------
// Per row chunk of R rows:
//   (1) cuBLAS logits, (2) cce_dense_fwd_* (forward calls that want entropy or argmax;
//       otherwise select's _fwd form computes lse and loss in its pass 1),
//   (3) cce_sparse_select_*: τ_i from the row's histogram of g0 (filter.rs), then the kept
//       entries (g0 ≥ τ_i) as 8-byte records (class | G bits << 32), packed per row at an
//       offset taken from a call-wide counter; record k lives at recs_end[−1 − k] (the records
//       grow down from the end of the scratch, the logits chunk sits at its start);
//   (4) cce_sparse_gather_* (rows): d_e_i = Σ_k G_ik · c[class_k]; on peaked data (the first
//       chunk predicts fewer than 2 pairs per class) one cce_sparse_gather_*_b32 over all rows
//       after the last chunk instead.
// After the row pass, for d_c: cce_sparse_count (pairs per class), cce_sparse_tile_sums +
// cce_sparse_scan_tiles (first pair of each class, the light and heavy class lists),
// cce_sparse_scatter (records regrouped by class as (row | G bits << 32), in
// increasing order from the start of the scratch), then cce_sparse_gather_*_l over the light
// classes (≤ LIGHT_MAX records; those without records too where most classes have some, else
// d_c is zeroed by a memset first) and cce_sparse_gather_*_h over the heavy ones:
// d_c_j = Σ_k G_kj · e[row_k], d_bias_j = Σ_k G_kj.
// Label smoothing's uniform term is absent (the plan takes no sparse backward with α > 0).

#define SEL_THREADS 512 /* select blocks (a 256-thread variant: cce_sparse_select_*_t256) */
#define SEL_UNROLL 2  /* float4 loads in flight per thread, pass 2 */
#define SEL_UNROLL1 4 /* and pass 1 (the pass every row makes) */
#define SEL_CAND 3072   /* pass-2 candidates a select block keeps in shared memory */
#define SEL_CAND_BIN 32 /* candidates: g0 ≥ edge(32) = eps·2^−8 (τ is higher on peaked rows) */
#define SPARSE_OVERFLOW 0xfffffffeu /* row_cnt of a row whose pairs did not fit */
#define GATHER_THREADS 128 /* count and scatter */
#define GATHER_WARPS 8     /* gather blocks: warps splitting a row's records */
#define LIGHT_WARPS 8      /* light d_c gather blocks: warps over a class's column slices */
#define LIGHT_MAX 128      /* records of a light class (held 4 per lane) */
#define SCAN_TILE 4096     /* classes per scan block */
#define SCAN_THREADS 256   /* scan blocks: 16 classes per thread */

// Histogram of g0 (fixed point) and of entry counts for the graded bins (g0 in
// [edge(64), eps)); entries below edge(64) add to the thread's underflow mass `under` (no
// shared atomic: on peaked rows that is nearly every entry), entries ≥ eps to `big` (never
// skipped). The underflow bin's count is not needed: a threshold never keeps that bin.
__device__ __forceinline__ void hist_add_count(u32* wmass, u32* wcnt, float g0, bool valid,
                                               const float* edges, float e_lo, float e_hi,
                                               u64& under, u32& big) {
    if (!valid) return;
    if (g0 < e_lo) {  // e_lo = edges[N_BINS − 1]
        // g0·2^30 < edge(64)·2^30 = eps·2^14: a u32 conversion (the u64 one is several
        // instructions, and this is the path of nearly every entry of a peaked row).
        under += (u32)ceilf(g0 * FIXED_ONE);
    } else if (g0 < e_hi) {  // e_hi = edges[0] = eps
        int b = filter_bin(g0, edges);
        u32 mass = (u32)ceilf(g0 * FIXED_ONE);
        if (b == N_BINS - 1) {
            under += mass;
        } else {
            atomicAdd(&wmass[b], mass);
            atomicAdd(&wcnt[b], 1u);
        }
    } else {
        ++big;
    }
}

// Inclusive warp scan of u32.
__device__ __forceinline__ u32 warp_incl_scan(u32 x) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        u32 y = __shfl_up_sync(FULL_MASK, x, o);
        if (lane >= o) x += y;
    }
    return x;
}

// Block exclusive scan of per-thread counts (blockDim.x = T); returns the thread's
// offset, `total` gets the block sum. `wsh` holds 33 u32. Ends with a barrier.
template <int T>
__device__ __forceinline__ u32 block_excl_scan(u32 c, u32* wsh, u32& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nw = T / 32;
    u32 incl = warp_incl_scan(c);
    if (lane == 31) wsh[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        u32 w = lane < nw ? wsh[lane] : 0u;
        u32 wi = warp_incl_scan(w);
        if (lane < nw) wsh[lane] = wi - w;
        if (lane == nw - 1) wsh[32] = wi;
    }
    __syncthreads();
    u32 off = wsh[warp] + incl - c;
    total = wsh[32];
    __syncthreads();
    return off;
}

// Floats as ints in the same order (for atomicMax), and back.
__device__ __forceinline__ int ordered_key(float f) {
    int i = __float_as_int(f);
    return i >= 0 ? i : i ^ 0x7fffffff;
}
__device__ __forceinline__ float ordered_float(int k) {
    return __int_as_float(k >= 0 ? k : k ^ 0x7fffffff);
}

// The 4 logits at columns j .. j+3 (j a multiple of 4; in select, thread t of T at step b0
// and unroll u takes j = b0 + u·T·4 + 4t), bias added, softcapped; a float4 load where all 4
// are in range.
template <int DT>
__device__ __forceinline__ float4 sel_load(const float* Lr, const void* bias, int j, int V,
                                           float softcap, float inv_cap) {
    float4 x;
    if (j + 3 < V) {
        x = gemm_logit4(*(const float4*)(Lr + j));
        if (bias) {
            float4 b = Elem<DT>::load4(bias, j);
            x.x += b.x; x.y += b.y; x.z += b.z; x.w += b.w;
        }
    } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            float v = 0.0f;
            if (j + k < V) {
                v = gemm_logit(Lr[j + k]);
                if (bias) v += Elem<DT>::load(bias, j + k);
            }
            f4set(x, k, v);
        }
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) f4set(x, k, cap_z(f4get(x, k), softcap, inv_cap));
    // Past the row: −inf (p = 0: no mass, never a candidate).
    if (j + 3 >= V) {
#pragma unroll
        for (int k = 0; k < 4; ++k)
            if (j + k >= V) f4set(x, k, NEG_INF);
    }
    return x;
}

// The logit of column j < V before the softcap (bias added): the softcap's factor of a kept
// entry (cap_grad), re-read for the few kept entries.
template <int DT>
__device__ __forceinline__ float sel_x(const float* Lr, const void* bias, int j) {
    return Lr[j] + (bias ? Elem<DT>::load(bias, j) : 0.0f);
}

// (3) Parameters:
//   L f32 [rows, ld] logits of the chunk (read only); bias DT [V] or 0; softcap (0: off);
//   targets i32 [rows], lse and rest (1 − p_y) f32 [rows], dl_rows f32 [rows] or 0
//   (→ dl_scalar), dlse f32 [rows] or 0, lambda: as cce_dense_bwd (chunk-relative per-row
//   arrays);
//   edges f32 [65], delta_fixed = floor(δ·2^30): the filter grid;
//   cap: pairs the buffers hold; counter u64 [1]: pairs allocated so far (call-wide);
//   overflow u32 [1]: set to 1 when a row's pairs did not fit;
//   row_off, row_cnt u32 [rows]: first pair and pair count of each row (SPARSE_OVERFLOW);
//   recs_end: one past the last of `cap` u64 records (record k at recs_end[−1 − k]);
//   kept, dropped, tau_out [rows]: filter statistics and τ_i; flags: tile statistics
//   (global row row0 + r, as cce_dense_bwd).
//   FWD (the _fwd kernels): lse_io, rest_io and loss_out f32 [rows] are outputs, the forward's
//   lse, 1 − p_y and per-row loss (no label smoothing, entropy or argmax); pass 1 also folds each value into
//   an online log-sum-exp and takes as candidates the values within −ln(e_c) + 1/16 nats of its
//   warp's running max (a superset: lse ≥ that max); once lse is known, candidates with
//   g0 < e_c are "demoted" (their mass joins the one below the cut and they are skipped).
// Tiling: one block per row. Pass 1 (no block barrier: each warp appends its candidates,
//   g0 ≥ edge(SEL_CAND_BIN), to its own SEL_CAND / warps slots of shared memory, in its
//   column-step order) and the fixed-point mass below them; when that mass is ≤ δ (peaked
//   rows) and every warp's candidates fit, the histogram of the candidates alone gives τ_i
//   (≥ that edge), else a second read of the row builds the full histogram (one per warp).
//   A warp owns columns 128w .. 128w + 127 of every 4·T, so its share of a row's candidates is
//   even unless they crowd into a few ids (then the full read, slower but exact). Then τ_i and the row's pair count k_i (thread
//   0), one atomic on the counter for the row's offset. Pass 2: the pairs, from the
//   candidates (warp by warp, in slot order) or from a full re-read (compacted by a block
//   scan per step); either order is fixed (deterministic within the row).
// Thread mapping: as cce_dense_bwd (columns 4t + u·SEL_THREADS·4 of each step); trip counts
//   uniform over the block.
template <int DT, int T, bool FWD>
__device__ __forceinline__ void sparse_select(
    const float* L, long long ld, int V, const void* bias, float softcap, const int* targets,
    float* lse_io, float* rest_io, const float* dl_rows, float dl_scalar, const float* dlse,
    float lambda,
    const float* edges_g, u64 delta_fixed, u64 cap, u64* counter, u32* overflow, u32* row_off,
    u32* row_cnt, u64* recs_end, u32* kept_out, float* dropped_out,
    float* tau_out, u32* flags, long long row0, int tile_rows, int tile_classes, int n_ctiles,
    float* loss_out, u32* gap_hist, int use_gap) {
    __shared__ u32 hm[T / 32][N_BINS];
    __shared__ u32 hc[T / 32][N_BINS];
    __shared__ u64 tot[N_BINS];
    __shared__ u64 under_sh[T / 32];
    __shared__ u64 under_tot;
    __shared__ float edges[N_BINS];
    __shared__ float shf[64];
    __shared__ u32 shu[33];
    __shared__ u32 k_sh;
    __shared__ u64 base_sh;
    __shared__ int cand_col[SEL_CAND];
    __shared__ float cand_z[SEL_CAND];
    __shared__ u32 wcnt_sh[T / 32];   // candidates per warp (pass 1)
    __shared__ u32 wkept_sh[T / 32];  // kept candidates per warp (pass 2)
    __shared__ float tau_sh;
    __shared__ float wm_sh[T / 32], ws_sh[T / 32];  // FWD: each warp's (running max, Σ exp)
    __shared__ float zy_sh;                         // FWD: the target logit
    __shared__ float est_sh;                        // FWD: the lse − max estimate
    __shared__ int bmax_sh;                         // FWD: the block's running max (ordered)
    const int STEP = T * 4 * SEL_UNROLL;    // pass 2 (full re-read)
    const int STEP1 = T * 4 * SEL_UNROLL1;  // pass 1
    const long long r = blockIdx.x;
    const float* Lr = L + r * ld;
    const float inv_cap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
    const int y = targets[r];
    const int warp = threadIdx.x >> 5;
    // FWD: lse and the coefficients come after pass 1 (which computes lse).
    float lse = 0.0f;
    float rest = 0.0f;
    GCoef c;
    if constexpr (!FWD) {
        lse = lse_io[r];
        rest = rest_io[r];
        c = g_coef(y, r, dl_rows, dl_scalar, dlse, lse, 0.0f, lambda, V);
        if (!c.active) {
            if (threadIdx.x == 0) {
                row_off[r] = 0;
                row_cnt[r] = 0;
                kept_out[r] = INACTIVE_ROW;
                dropped_out[r] = 0.0f;
                tau_out[r] = 0.0f;
            }
            return;
        }
    }
    for (int k = threadIdx.x; k < (T / 32) * N_BINS; k += T) {
        (&hm[0][0])[k] = 0;
        (&hc[0][0])[k] = 0;
    }
    if (threadIdx.x < N_BINS) edges[threadIdx.x] = edges_g[threadIdx.x];
    if (FWD && warp == 0) {
        // lse − max of the probe's rows (gap_hist: 32 bins of 1/4 nat): the estimate is the
        // lower edge of the bin below which at most 1/16 of them lie (0 in the probe itself).
        float est = 0.0f;
        if (use_gap) {
            const int lane0 = threadIdx.x & 31;
            u32 incl = warp_incl_scan(gap_hist[lane0]);
            u32 tot = __shfl_sync(FULL_MASK, incl, 31);
            u32 over = __ballot_sync(FULL_MASK, incl > tot / 16);
            if (tot > 0 && over != 0u) est = (float)(__ffs(over) - 1) * 0.25f;
        }
        if (threadIdx.x == 0) {
            est_sh = est;
            bmax_sh = ordered_key(NEG_INF);
        }
    }
    __syncthreads();
    u32 big = 0;
    u64 under = 0;         // fixed-point mass (ceil per entry) below edge(SEL_CAND_BIN)
    float d_under = 0.0f;  // Σ g0 below edge(SEL_CAND_BIN): dropped whenever τ ≥ that edge
    const int lane = threadIdx.x & 31;
    constexpr int WC = SEL_CAND / (T / 32);  // candidate slots per warp
    int* const wcol = cand_col + warp * WC;  // this warp's slots
    float* const wz = cand_z + warp * WC;
    u32 wn = 0;  // this warp's candidates so far (warp-uniform; may exceed WC: overflow)
    const float e_lo = edges[N_BINS - 1], e_hi = edges[0], e_c = edges[SEL_CAND_BIN];
    // The target's step and slot (q = u·4 + k) in its owner thread; −1 elsewhere.
    int y_b0 = -1, y_q = -1;
    if (y >= 0 && y < V) {
        int yr = y % STEP1;
        if (((yr % (T * 4)) >> 2) == threadIdx.x) {
            y_b0 = y - yr;
            y_q = (yr / (T * 4)) * 4 + (yr & 3);
        }
    }
    // FWD: the online log-sum-exp of the row (each thread's sums relative to its warp's
    // running max f_m), and the sum and count of the values that cannot be candidates
    // (z < b − f_off, b the block's running max ≤ the row max M, ⇒ p = exp(z − lse) < e_c
    // when est ≤ lse − M): after pass 1 their fixed-point mass is bounded from f_su (see
    // below); candidates against the running max are a superset, those with g0 < e_c once lse
    // is known are "demoted" (counted below the cut, then skipped).
    float f_m = NEG_INF, f_s = 0.0f, f_su = 0.0f;
    u32 f_nu = 0;
    // The cut sits f_off below the running max: −ln(e_c) + 1/16 nats, less the estimate of
    // lse − max (rows where lse − max turns out below it take the full pass: see gap_ok).
    const float f_off = FWD ? -logf(e_c) + 0.0625f - est_sh : 0.0f;
    // Pass 1 (light): the candidates into shared memory, the mass below them in registers.
    // No histogram yet: when that mass is within δ (τ ≥ edge(SEL_CAND_BIN)), the bins above
    // come from the candidates alone; otherwise a full histogram pass follows. Per value: one
    // exp, one compare, the fixed-point add; the target column is handled apart (its g0 is
    // not p), and columns past the row load as −inf (sel_load).
    for (int b0 = 0; b0 < V; b0 += STEP1) {
        u32 cb = 0;
        float4 zz[SEL_UNROLL1];
#pragma unroll
        for (int u = 0; u < SEL_UNROLL1; ++u)
            zz[u] = sel_load<DT>(Lr, bias, b0 + u * T * 4 + threadIdx.x * 4, V, softcap, inv_cap);
        const int yq = b0 == y_b0 ? y_q : -1;
        float thr = NEG_INF;  // FWD: the cut of this step
        if constexpr (FWD) {
            // The warp's running max over the row so far, this step included (warp-uniform).
            float bm = NEG_INF;
#pragma unroll
            for (int u = 0; u < SEL_UNROLL1; ++u)
                bm = fmaxf(fmaxf(bm, fmaxf(zz[u].x, zz[u].y)), fmaxf(zz[u].z, zz[u].w));
            bm = warp_max(bm);
            // The block's running max (a lower bound of the row max, whatever the other
            // warps have reached): the cut follows it, the sums stay on this warp's own max.
            int bk = 0;
            if (lane == 0) bk = max(atomicMax(&bmax_sh, ordered_key(bm)), ordered_key(bm));
            const float bmx = ordered_float(__shfl_sync(FULL_MASK, bk, 0));
            if (bm > f_m) {
                const float sc = __expf(f_m - bm);  // 0 for the first finite values
                f_s *= sc;
                f_su *= sc;
                f_m = bm;
            }
            const float mref = f_m == NEG_INF ? 0.0f : f_m;
            thr = fmaxf(f_m, bmx) - f_off;
            float zt = 0.0f;
            if (yq >= 0) {
#pragma unroll
                for (int q = 0; q < SEL_UNROLL1 * 4; ++q)
                    if (q == yq) {
                        zt = f4get(zz[q / 4], q % 4);
                        f4set(zz[q / 4], q % 4, NEG_INF);
                    }
            }
#pragma unroll
            for (int u = 0; u < SEL_UNROLL1; ++u) {
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const float z = f4get(zz[u], k);
                    const float e = __expf(z - mref);
                    f_s += e;
                    if (z < thr) {
                        f_su += e;
                        ++f_nu;
                    } else if (z > NEG_INF || z != z) {
                        cb |= 1u << (u * 4 + k);  // NaN too (never skipped)
                    }
                }
            }
            if (yq >= 0) {
                // The target is always a candidate (its g0 is near 1 where p is small); its
                // term stays out of f_s (added at the merge: rest = 1 − p_y without
                // cancellation).
                cb |= 1u << yq;
                zy_sh = zt;
#pragma unroll
                for (int q = 0; q < SEL_UNROLL1 * 4; ++q)
                    if (q == yq) f4set(zz[q / 4], q % 4, zt);
            }
        } else {
            float zt = 0.0f;
            if (yq >= 0) {
#pragma unroll
                for (int q = 0; q < SEL_UNROLL1 * 4; ++q)
                    if (q == yq) {
                        zt = f4get(zz[q / 4], q % 4);
                        f4set(zz[q / 4], q % 4, NEG_INF);
                    }
            }
            u32 ub = 0;
#pragma unroll
            for (int u = 0; u < SEL_UNROLL1; ++u) {
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    float g0 = __expf(f4get(zz[u], k) - lse);
                    if (g0 < e_c) {
                        // g0·2^30 < eps·2^22 ≤ 2^22: u32, 16 of them per step too.
                        ub += __float2uint_ru(g0 * FIXED_ONE);
                        d_under += g0;
                    } else {
                        cb |= 1u << (u * 4 + k);  // NaN too (never skipped)
                    }
                }
            }
            if (yq >= 0) {
                float g0 = target_g0(rest, c.od);
                if (g0 < e_c) {
                    ub += __float2uint_ru(g0 * FIXED_ONE);
                    d_under += g0;
                } else {
                    cb |= 1u << yq;
                }
#pragma unroll
                for (int q = 0; q < SEL_UNROLL1 * 4; ++q)
                    if (q == yq) f4set(zz[q / 4], q % 4, zt);
            }
            under += ub;
        }
        // Candidates, in this warp's slots in (step, lane, slot) order, while they fit.
        if (__any_sync(FULL_MASK, cb != 0u)) {
            u32 nb = (u32)__popc(cb);
            u32 incl = warp_incl_scan(nb);
            if constexpr (FWD) {
                const u32 n_step = __shfl_sync(FULL_MASK, incl, 31);
                if (wn <= (u32)WC && wn + n_step > (u32)WC) {
                    // Slots full: drop the earlier candidates that the risen running max puts
                    // below this step's cut (their mass joins f_su), keep the target; in
                    // place, in order (a lane writes at or below the slot it read).
                    const float mref = f_m == NEG_INF ? 0.0f : f_m;
                    u32 kept_n = 0;
                    for (u32 q0 = 0; q0 < wn; q0 += 32) {
                        const u32 q = q0 + lane;
                        int jc = 0;
                        float zc = 0.0f;
                        bool keep = false;
                        if (q < wn) {
                            jc = wcol[q];
                            zc = wz[q];
                            keep = !(zc < thr) || jc == y;
                            if (!keep) {
                                f_su += __expf(zc - mref);
                                ++f_nu;
                            }
                        }
                        const u32 bal = __ballot_sync(FULL_MASK, keep);
                        __syncwarp();
                        if (keep) {
                            const u32 pos = kept_n + (u32)__popc(bal & ((1u << lane) - 1u));
                            wcol[pos] = jc;
                            wz[pos] = zc;
                        }
                        kept_n += (u32)__popc(bal);
                        __syncwarp();
                    }
                    wn = kept_n;
                }
            }
            if (wn < WC) {
                u32 pos = wn + incl - nb;
#pragma unroll
                for (int q = 0; q < SEL_UNROLL1 * 4; ++q) {
                    if (cb & (1u << q)) {
                        if (pos < WC) {
                            wcol[pos] = b0 + (q / 4) * T * 4 + threadIdx.x * 4 + (q % 4);
                            wz[pos] = f4get(zz[q / 4], q % 4);
                        }
                        ++pos;
                    }
                }
            }
            wn += __shfl_sync(FULL_MASK, incl, 31);
        }
    }
    if (lane == 0) wcnt_sh[warp] = wn;
    bool gap_ok = true;  // FWD: every cut of pass 1 was below lse − ln(1/e_c)
    if constexpr (FWD) {
        // The row's lse from the warps' (max, Σ exp), merged in a fixed order (the same value
        // in every thread), and the forward outputs (MATH.md "Forward"; as cce_dense_fwd).
        const float ws = warp_sum(f_s);
        if (lane == 0) {
            wm_sh[warp] = f_m;
            ws_sh[warp] = ws;
        }
        __syncthreads();
        float M = NEG_INF;
#pragma unroll
        for (int w = 0; w < T / 32; ++w) M = fmaxf(M, wm_sh[w]);
        float S = 0.0f;
#pragma unroll
        for (int w = 0; w < T / 32; ++w)
            S += M == NEG_INF ? ws_sh[w] : ws_sh[w] * __expf(wm_sh[w] - M);
        // As write_row_outputs: S leaves the target out.
        const float ey = (y >= 0 && zy_sh != NEG_INF) ? __expf(zy_sh - M) : 0.0f;
        lse = M + logf(S + ey);
        rest = y >= 0 ? S / (S + ey) : 0.0f;
        if (!use_gap && threadIdx.x == 0 && isfinite(lse))
            atomicAdd(&gap_hist[min(31, max(0, (int)((lse - M) * 4.0f)))], 1u);
        // The cuts were at most M + est − ln(1/e_c) − 1/16: below lse − ln(1/e_c) if est ≤ lse − M.
        gap_ok = est_sh <= lse - M;
        if (threadIdx.x == 0)
            write_row_outputs(r, y, M, S, y >= 0 ? zy_sh : 0.0f, 0.0f, 0.0f, 0x7fffffff, 0.0f,
                              lambda, V, lse_io, rest_io, loss_out, nullptr, nullptr);
        c = g_coef(y, r, dl_rows, dl_scalar, dlse, lse, 0.0f, lambda, V);
        if (!c.active) {  // block-uniform
            if (threadIdx.x == 0) {
                row_off[r] = 0;
                row_cnt[r] = 0;
                kept_out[r] = INACTIVE_ROW;
                dropped_out[r] = 0.0f;
                tau_out[r] = 0.0f;
            }
            return;
        }
        // Mass below the cut, in fixed point. The values below it hold
        // f_su·exp(f_m − lse) (per thread; the f32 sums' relative error is far below 2^−12),
        // and Σ ceil(g0·2^30) adds at most one unit per value: the bound below is ≥ what the
        // per-value sum of the second kernel form gives. Demoted candidates add their own
        // ceil(g0·2^30) and g0.
        const float scale = f_m == NEG_INF ? 0.0f : __expf(f_m - lse);
        d_under = f_su * scale;
        const float su_w = warp_sum(f_su);
        const u32 nu_w = warp_sum_u32(f_nu);
        u64 dem = 0;
        if (wn <= (u32)WC) {
            for (u32 q = lane; q < wn; q += 32) {
                float p = __expf(wz[q] - lse);
                float g0 = wcol[q] == y ? target_g0(rest, c.od) : p;
                if (g0 < e_c) {
                    dem += (u64)ceilf(g0 * FIXED_ONE);
                    d_under += g0;
                }
            }
        }
        under = dem;
        if (lane == 0)
            under += (u64)ceilf(su_w * scale * (FIXED_ONE * (1.0f + 1.0f / 4096.0f))) + nu_w;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) under += __shfl_down_sync(FULL_MASK, under, o);
    if ((threadIdx.x & 31) == 0) under_sh[warp] = under;
    __syncthreads();
    bool fits = true;
#pragma unroll
    for (int w = 0; w < T / 32; ++w) fits = fits && wcnt_sh[w] <= WC;
    if (threadIdx.x == 0) {
        u64 s0 = 0;
        for (int w = 0; w < T / 32; ++w) s0 += under_sh[w];
        under_tot = s0;
    }
    __syncthreads();
    // Block-uniform. FWD: a row whose lse is not finite takes the full pass (as it would
    // with the lse given: every g0 is NaN there, so nothing is skipped).
    const bool light = fits && under_tot <= delta_fixed && (!FWD || (isfinite(lse) && gap_ok));
    if (light) {
        // Histogram of the candidates (bins < SEL_CAND_BIN, or g0 ≥ eps); everything below
        // is one mass, `under_tot`, at bin SEL_CAND_BIN: the threshold scan below reaches that
        // bin with the same cumulative mass as over the full histogram, so τ is the same.
        for (u32 q = lane; q < wn; q += 32) {
            float p = __expf(wz[q] - lse);
            float g0 = wcol[q] == y ? target_g0(rest, c.od) : p;
            if (g0 < e_c) {
                // A demoted candidate (FWD): already in under_tot.
            } else if (g0 < e_hi) {
                int b = filter_bin(g0, edges);
                atomicAdd(&hm[0][b], (u32)ceilf(g0 * FIXED_ONE));
                atomicAdd(&hc[0][b], 1u);
            } else {
                ++big;
            }
        }
    } else {
        // Full histogram: the row again (flat rows, or more candidates than fit).
        u64 under2 = 0;
        for (int b0 = 0; b0 < V; b0 += STEP1) {
            float4 zz[SEL_UNROLL1];
#pragma unroll
            for (int u = 0; u < SEL_UNROLL1; ++u)
                zz[u] = sel_load<DT>(Lr, bias, b0 + u * T * 4 + threadIdx.x * 4, V, softcap,
                                     inv_cap);
#pragma unroll
            for (int u = 0; u < SEL_UNROLL1; ++u) {
                int j = b0 + u * T * 4 + threadIdx.x * 4;
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    float p = __expf(f4get(zz[u], k) - lse);
                    float g0 = (j + k == y) ? target_g0(rest, c.od) : p;
                    hist_add_count(hm[warp], hc[warp], g0, j + k < V, edges, e_lo, e_hi, under2,
                                   big);
                }
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) under2 += __shfl_down_sync(FULL_MASK, under2, o);
        if ((threadIdx.x & 31) == 0) under_sh[warp] = under2;
    }
    {
        float unused_a = 0.0f, unused_b = 0.0f;
        block_sum2u(unused_a, unused_b, big, shf, shu);
    }
    if (threadIdx.x < N_BINS) {
        u64 s = 0;
        for (int w = 0; w < T / 32; ++w) s += hm[w][threadIdx.x];
        if (light && threadIdx.x == SEL_CAND_BIN) s += under_tot;
        if (!light && threadIdx.x == N_BINS - 1)
            for (int w = 0; w < T / 32; ++w) s += under_sh[w];
        tot[threadIdx.x] = s;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 below = 0;
        int best = -1;
        for (int k = N_BINS - 1; k >= 0; --k) {
            below += tot[k];
            if (below <= delta_fixed) best = k; else break;
        }
        u32 k_row = (u32)V;
        if (best >= 0) {
            k_row = big;
            for (int b = 0; b < best; ++b)
                for (int w = 0; w < T / 32; ++w) k_row += hc[w][b];
        }
        float tau = best >= 0 ? edges[best] : 0.0f;
        u64 base = k_row > 0 ? atomicAdd(counter, (u64)k_row) : 0ull;
        if (base + k_row > cap) {
            atomicOr(overflow, 1u);
            k_row = SPARSE_OVERFLOW;
        }
        k_sh = k_row;
        base_sh = base;
        tau_sh = tau;
        tau_out[r] = tau;
    }
    __syncthreads();
    const u32 k_row = k_sh;
    const float tau = tau_sh;
    if (k_row == SPARSE_OVERFLOW) {
        if (threadIdx.x == 0) {
            row_off[r] = 0;
            row_cnt[r] = SPARSE_OVERFLOW;
            kept_out[r] = 0;
            dropped_out[r] = 0.0f;
        }
        return;
    }
    const u64 base = base_sh;
    const long long flag_row = (row0 + r) / tile_rows;
    u32 run = 0;  // pairs written so far (block-uniform)
    float dropped = 0.0f;
    // Pass 2 from the candidates when they all fit and τ ≥ edge(SEL_CAND_BIN) (every kept
    // entry has g0 ≥ τ, so it is a candidate): no second read of the row.
    const bool from_cand = light;
    if (from_cand) {
        // Warp by warp: count the kept candidates, then write them after the earlier warps'.
        dropped = d_under;
        u32 wk = 0;
        for (u32 q0 = 0; q0 < wn; q0 += 32) {
            u32 q = q0 + lane;
            bool keep = false;
            if (q < wn) {
                float p = __expf(wz[q] - lse);
                float g0 = wcol[q] == y ? target_g0(rest, c.od) : p;
                // g0 < e_c ≤ τ: a demoted candidate (FWD), already in d_under.
                if (g0 < e_c) {
                } else if (g0 < tau) {
                    dropped += g0;
                } else {
                    keep = true;
                }
            }
            wk += (u32)__popc(__ballot_sync(FULL_MASK, keep));
        }
        if (lane == 0) wkept_sh[warp] = wk;
        __syncthreads();
        u32 pos0 = 0;
        for (int w = 0; w < T / 32; ++w) {
            if (w < warp) pos0 += wkept_sh[w];
            run += wkept_sh[w];
        }
        for (u32 q0 = 0; q0 < wn; q0 += 32) {
            u32 q = q0 + lane;
            bool keep = false;
            int j = 0;
            float g = 0.0f;
            if (q < wn) {
                j = wcol[q];
                float zk = wz[q];
                float p = __expf(zk - lse);
                bool tgt = (j == y);
                float g0 = tgt ? target_g0(rest, c.od) : p;
                if (!(g0 < tau) && !(g0 < e_c)) {
                    keep = true;
                    g = tgt ? g_target(c, rest) : c.cp * p;
                    if (softcap > 0.0f) g *= cap_grad(sel_x<DT>(Lr, bias, j), inv_cap);
                }
            }
            if (__any_sync(FULL_MASK, keep)) flag_tile(flags, flag_row, n_ctiles, tile_classes, j, keep);
            u32 bal = __ballot_sync(FULL_MASK, keep);
            u32 pos = pos0 + (u32)__popc(bal & ((1u << lane) - 1u));
            if (keep && pos < k_row)
                recs_end[-1 - (long long)(base + pos)] =
                    (u64)(u32)j | ((u64)__float_as_uint(g) << 32);
            pos0 += (u32)__popc(bal);
        }
    }
    if (!from_cand && threadIdx.x == 0) atomicAdd(overflow + 1, 1u);  // profile: full pass 2
    for (int b0 = 0; b0 < (from_cand ? 0 : V); b0 += STEP) {
        float gv[SEL_UNROLL * 4];
        u32 bits = 0;
#pragma unroll
        for (int u = 0; u < SEL_UNROLL; ++u) {
            int j = b0 + u * T * 4 + threadIdx.x * 4;
            float4 z = sel_load<DT>(Lr, bias, j, V, softcap, inv_cap);
            bool any_kept = false;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                float zk = f4get(z, k);
                float p = __expf(zk - lse);
                bool tgt = (j + k == y);
                float g0 = tgt ? target_g0(rest, c.od) : p;
                float g = 0.0f;
                if (j + k < V) {
                    if (g0 < tau) {
                        dropped += g0;
                    } else {
                        bits |= 1u << (u * 4 + k);
                        any_kept = true;
                        g = tgt ? g_target(c, rest) : c.cp * p;
                        if (softcap > 0.0f) g *= cap_grad(sel_x<DT>(Lr, bias, j + k), inv_cap);
                        if (zk == NEG_INF) g = 0.0f;
                    }
                }
                gv[u * 4 + k] = g;
            }
            if (__any_sync(FULL_MASK, any_kept))
                flag_tile(flags, flag_row, n_ctiles, tile_classes, j, any_kept);
        }
        // Most steps of a peaked row keep nothing: one barrier decides whether to scan.
        if (!__syncthreads_or(bits != 0u)) continue;
        u32 step_tot;
        u32 pos = run + block_excl_scan<T>((u32)__popc(bits), shu, step_tot);
#pragma unroll
        for (int q = 0; q < SEL_UNROLL * 4; ++q) {
            if (bits & (1u << q)) {
                if (pos < k_row) {
                    int j = b0 + (q / 4) * T * 4 + threadIdx.x * 4 + (q % 4);
                    recs_end[-1 - (long long)(base + pos)] =
                        (u64)(u32)j | ((u64)__float_as_uint(gv[q]) << 32);
                }
                ++pos;
            }
        }
        run += step_tot;
    }
    float unused = 0.0f;
    u32 unused_u = 0;
    block_sum2u(dropped, unused, unused_u, shf, shu);
    if (threadIdx.x == 0) {
        u32 n_w = run < k_row ? run : k_row;
        row_off[r] = (u32)base;
        row_cnt[r] = n_w;
        kept_out[r] = n_w;
        dropped_out[r] = dropped;
    }
}

#define SEL_PARAMS                                                                            \
    const float *L, long long ld, int V, const void *bias, float softcap, const int *targets,\
        float *lse_io, float *rest_io, const float *dl_rows, float dl_scalar,                \
        const float *dlse,                                                                    \
        float lambda, const float *edges_g, u64 delta_fixed, u64 cap, u64 *counter,          \
        u32 *overflow, u32 *row_off, u32 *row_cnt, u64 *recs_end, u32 *kept_out,             \
        float *dropped_out, float *tau_out, u32 *flags, long long row0, int tile_rows,       \
        int tile_classes, int n_ctiles, float *loss_out, u32 *gap_hist, int use_gap
#define SEL_ARGS                                                                              \
    L, ld, V, bias, softcap, targets, lse_io, rest_io, dl_rows, dl_scalar, dlse, lambda,    \
        edges_g,                                                                              \
        delta_fixed, cap, counter, overflow, row_off, row_cnt, recs_end, kept_out,           \
        dropped_out, tau_out, flags, row0, tile_rows, tile_classes, n_ctiles, loss_out,       \
        gap_hist, use_gap
// cce_sparse_select_*: lse_io and rest_io are the saved lse and 1 − p_y (read), loss_out,
// gap_hist, use_gap unused; _fwd: lse_io, rest_io and loss_out are the forward outputs (written: no forward row kernel before
// it); gap_hist u32 [32] the probe's histogram of lse − max, written when use_gap = 0 (the
// probe) and read otherwise.
#define SEL_KERNELS(DTN, DT)                                                                  \
    extern "C" __global__ void __launch_bounds__(512, 2) cce_sparse_select_##DTN(SEL_PARAMS) {  \
        sparse_select<DT, 512, false>(SEL_ARGS);                                              \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(256, 4)                                      \
        cce_sparse_select_##DTN##_t256(SEL_PARAMS) {                                          \
        sparse_select<DT, 256, false>(SEL_ARGS);                                              \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(512, 2)                                      \
        cce_sparse_select_fwd_##DTN(SEL_PARAMS) {                                             \
        sparse_select<DT, 512, true>(SEL_ARGS);                                               \
    }
SEL_KERNELS(f32, 0)
SEL_KERNELS(f16, 1)
SEL_KERNELS(bf16, 2)

// gather_row (d_e per chunk: cce_sparse_gather_*, a block per (row, slice); d_c's heavy
// classes: the _h kernels): out_r = Σ_k G_k · src[idx_k, :] over the
// records k = s .. s + n − 1, record k = recs[step·k] (idx | G bits << 32), in the gradient
// dtype OT; sum_out[r] = Σ_k G_k (d_bias) when sum_out ≠ 0. src DT [*, D]; out OT [R, D].
// Tiling: block (x, y) owns columns [y·32·VEC, (y+1)·32·VEC) of its row. The block's
//   GATHER_WARPS warps split the row's records (warp w: records w + k·GATHER_WARPS), each
//   lane holding partial sums of its VEC columns, then warp 0 adds the warps' partials in a
//   fixed order (deterministic for a given record order). Splitting keeps a row with many
//   records (frequent classes) from serializing on one long chain of loads. d_c's light
//   classes (the _l kernels) and deferred d_e (the _b32 kernels) take warp-per-row forms.
// Thread mapping: lane l owns VEC consecutive columns (16-byte loads: VEC = 8 for 16-bit
//   inputs, 4 for f32, when D is a multiple; else VEC = 1), coalesced across the warp.
// VEC consecutive elements of src at element i (VEC = 4: i a multiple of 4, aligned base).
template <int DT, int VEC>
__device__ __forceinline__ void load_vec(const void* src, long long i, float* x) {
    if (VEC == 8 && DT != 0) {
        uint4 u = *(const uint4*)((const u16*)src + i);
        u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            x[2 * q] = Elem16<DT>::cvt_in((u16)(w[q] & 0xffff));
            x[2 * q + 1] = Elem16<DT>::cvt_in((u16)(w[q] >> 16));
        }
    } else if (VEC == 4) {
        float4 v = Elem<DT>::load4(src, i);
        x[0] = v.x; x[1] = v.y; x[2] = v.z; x[3] = v.w;
    } else {
#pragma unroll
        for (int q = 0; q < VEC; ++q) x[q] = Elem<DT>::load(src, i + q);
    }
}
template <int OT, int VEC>
__device__ __forceinline__ void store_vec(void* dst, long long i, const float* x) {
    if (VEC == 8) {
        Elem<OT>::store4(dst, i, make_float4(x[0], x[1], x[2], x[3]));
        Elem<OT>::store4(dst, i + 4, make_float4(x[4], x[5], x[6], x[7]));
    } else if (VEC == 4) {
        Elem<OT>::store4(dst, i, make_float4(x[0], x[1], x[2], x[3]));
    } else {
#pragma unroll
        for (int q = 0; q < VEC; ++q) Elem<OT>::store(dst, i + q, x[q]);
    }
}

template <int DT, int OT, int VEC>
__device__ __forceinline__ void gather_row(long long r, u32 s, u32 n,
                                           const u64* __restrict__ recs, long long step,
                                           const void* __restrict__ src, long long D,
                                           void* __restrict__ out, void* __restrict__ sum_out,
                                           float (*part)[32 * VEC], float* gpart) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long d0 = ((long long)blockIdx.y * 32 + lane) * VEC;
    const bool ok = d0 < D;
    float acc[VEC];
#pragma unroll
    for (int q = 0; q < VEC; ++q) acc[q] = 0.0f;
    float gsum = 0.0f;
    // Warp w takes records w, w + GATHER_WARPS, ...: a long row's chain of dependent loads is
    // split GATHER_WARPS ways; 4 records (4 gathered rows) in flight per lane.
    u32 k = warp;
    for (; k + 3 * GATHER_WARPS < n; k += 4 * GATHER_WARPS) {
        u32 i[4];
        float g[4];
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            u64 rec = recs[step * (long long)(s + k + a * GATHER_WARPS)];
            i[a] = (u32)rec;
            g[a] = __uint_as_float((u32)(rec >> 32));
        }
        if (ok) {
            float x[4][VEC];
#pragma unroll
            for (int a = 0; a < 4; ++a) load_vec<DT, VEC>(src, (long long)i[a] * D + d0, x[a]);
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int q = 0; q < VEC; ++q) acc[q] = fmaf(g[a], x[a][q], acc[q]);
        }
        gsum += (g[0] + g[1]) + (g[2] + g[3]);
    }
    for (; k < n; k += GATHER_WARPS) {
        const u64 rec = recs[step * (long long)(s + k)];
        const u32 i = (u32)rec;
        const float g = __uint_as_float((u32)(rec >> 32));
        if (ok) {
            float x[VEC];
            load_vec<DT, VEC>(src, (long long)i * D + d0, x);
#pragma unroll
            for (int q = 0; q < VEC; ++q) acc[q] = fmaf(g, x[q], acc[q]);
        }
        gsum += g;
    }
    // Fixed-order sum of the warps' partial rows (deterministic).
#pragma unroll
    for (int q = 0; q < VEC; ++q) part[warp][lane * VEC + q] = acc[q];
    if (lane == 0) gpart[warp] = gsum;
    __syncthreads();
    if (warp == 0) {
        float tot[VEC];
#pragma unroll
        for (int q = 0; q < VEC; ++q) {
            float t = 0.0f;
            for (int w = 0; w < GATHER_WARPS; ++w) t += part[w][lane * VEC + q];
            tot[q] = t;
        }
        if (ok) store_vec<OT, VEC>(out, r * D + d0, tot);
        if (sum_out && blockIdx.y == 0 && lane == 0) {
            float t = 0.0f;
            for (int w = 0; w < GATHER_WARPS; ++w) t += gpart[w];
            Elem<OT>::store(sum_out, r, t);
        }
    }
}

// Record range of output row r.
__device__ __forceinline__ u32 gather_count(const u32* __restrict__ off,
                                            const u32* __restrict__ cnt, long long r, u32 s) {
    if (cnt) {
        u32 n = cnt[r];
        return n == SPARSE_OVERFLOW ? 0u : n;
    }
    return off[r + 1] - s;
}

// A block per output row (grid.x = R).
template <int DT, int OT, int VEC>
__device__ __forceinline__ void sparse_gather(const u32* __restrict__ off,
                                              const u32* __restrict__ cnt,
                                              const u64* __restrict__ recs, long long step,
                                              const void* __restrict__ src, long long D,
                                              void* __restrict__ out, void* __restrict__ sum_out) {
    __shared__ float part[GATHER_WARPS][32 * VEC];
    __shared__ float gpart[GATHER_WARPS];
    const long long r = blockIdx.x;
    const u32 s = off[r];
    gather_row<DT, OT, VEC>(r, s, gather_count(off, cnt, r, s), recs, step, src, D, out,
                            sum_out, part, gpart);
}

#define GATHER_PARAMS                                                                         \
    const u32 *off, const u32 *cnt, const u64 *recs, long long step, const void *src,        \
        long long D, void *out, void *sum_out, long long R
#define GATHER_KERNEL(NAME, DT, OT, VEC)                                                      \
    extern "C" __global__ void __launch_bounds__(GATHER_WARPS * 32) NAME(GATHER_PARAMS) {      \
        sparse_gather<DT, OT, VEC>(off, cnt, recs, step, src, D, out, sum_out);               \
    }
GATHER_KERNEL(cce_sparse_gather_f32_f32_v4, 0, 0, 4)
GATHER_KERNEL(cce_sparse_gather_f32_f32_v1, 0, 0, 1)
GATHER_KERNEL(cce_sparse_gather_f16_f16_v8, 1, 1, 8)
GATHER_KERNEL(cce_sparse_gather_f16_f16_v1, 1, 1, 1)
GATHER_KERNEL(cce_sparse_gather_f16_f32_v8, 1, 0, 8)
GATHER_KERNEL(cce_sparse_gather_f16_f32_v1, 1, 0, 1)
GATHER_KERNEL(cce_sparse_gather_bf16_bf16_v8, 2, 2, 8)
GATHER_KERNEL(cce_sparse_gather_bf16_bf16_v1, 2, 2, 1)
GATHER_KERNEL(cce_sparse_gather_bf16_f32_v8, 2, 0, 8)
GATHER_KERNEL(cce_sparse_gather_bf16_f32_v1, 2, 0, 1)

// d_e after the row pass, over all rows, on peaked data (the per-chunk gather_row form
// otherwise): d_e_r = Σ_k G_k · c[idx_k] over the row's records
// k < cnt_r (SPARSE_OVERFLOW counts as 0), record k at recs_end[−1 − (off_r + k)].
// Parameters: off, cnt u32 [R] (the select kernels'); recs_end; src DT [V, D] (c); out OT
//   [R, D] (d_e); R = N.
// Tiling: block (x, y) owns the column band y of SUB·VEC columns; its LIGHT_WARPS warps stride
//   over the rows, a row per warp (one launch instead of one per chunk, few tasks per row).
// Thread mapping: lane l = q·SUB + sl owns columns d0 = (y·SUB + sl)·VEC; the 32/SUB lane
//   groups q split each batch of 32 records (lane l loads record l of the batch; group q
//   takes records q, q + 32/SUB, ..), up to 4 (VEC = 8) or 8 gathered rows in flight per
//   lane; the groups' partial sums are added by a fixed xor-shuffle tree, group 0 stores.
template <int DT, int OT, int VEC, int SUB>
__device__ __forceinline__ void sparse_gather_rows_banded(const u32* __restrict__ off,
                                                          const u32* __restrict__ cnt,
                                                          const u64* __restrict__ recs_end,
                                                          const void* __restrict__ src,
                                                          long long D, void* __restrict__ out,
                                                          long long R) {
    constexpr int GRP = 32 / SUB;
    constexpr int LOOK0 = VEC >= 8 ? 4 : 8;
    constexpr int LOOK = LOOK0 < SUB ? LOOK0 : SUB;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int q = lane / SUB, sl = lane % SUB;
    const long long d0 = ((long long)blockIdx.y * SUB + sl) * VEC;
    const bool ok = d0 < D;
    for (long long r = (long long)blockIdx.x * LIGHT_WARPS + warp; r < R;
         r += (long long)gridDim.x * LIGHT_WARPS) {
        u32 n = cnt[r];
        if (n == SPARSE_OVERFLOW) n = 0;
        const u32 s = off[r];
        float acc[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] = 0.0f;
        for (u32 k0 = 0; k0 < n; k0 += 32) {
            const u32 m = min(32u, n - k0);
            const u64 rec = (u32)lane < m ? recs_end[-1 - (long long)(s + k0 + lane)] : 0ull;
            const u32 idx = (u32)rec;
            const float g = __uint_as_float((u32)(rec >> 32));  // 0 past m
#pragma unroll
            for (int u0 = 0; u0 < SUB; u0 += LOOK) {
                if ((u32)(u0 * GRP) >= m) break;  // warp-uniform
                float x[LOOK][VEC];
                float gg[LOOK];
#pragma unroll
                for (int b = 0; b < LOOK; ++b) {
                    const int kk = (u0 + b) * GRP + q;  // < 32
                    const u32 i = __shfl_sync(FULL_MASK, idx, kk);
                    gg[b] = __shfl_sync(FULL_MASK, g, kk);
                    if (ok && (u32)kk < m) {
                        load_vec<DT, VEC>(src, (long long)i * D + d0, x[b]);
                    } else {
#pragma unroll
                        for (int e = 0; e < VEC; ++e) x[b][e] = 0.0f;
                    }
                }
#pragma unroll
                for (int b = 0; b < LOOK; ++b)
#pragma unroll
                    for (int e = 0; e < VEC; ++e) acc[e] = fmaf(gg[b], x[b][e], acc[e]);
            }
        }
#pragma unroll
        for (int o = SUB; o < 32; o <<= 1)
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[e] += __shfl_xor_sync(FULL_MASK, acc[e], o);
        if (q == 0 && ok) store_vec<OT, VEC>(out, r * D + d0, acc);
    }
}

#define ROWS_GATHER_PARAMS                                                                    \
    const u32 *off, const u32 *cnt, const u64 *recs_end, const void *src, long long D,       \
        void *out, long long R
#define ROWS_GATHER_KERNEL(NAME, DT, OT, VEC, SUB)                                            \
    extern "C" __global__ void __launch_bounds__(LIGHT_WARPS * 32, 3)                         \
        NAME##_b##SUB(ROWS_GATHER_PARAMS) {                                                   \
        sparse_gather_rows_banded<DT, OT, VEC, SUB>(off, cnt, recs_end, src, D, out, R);     \
    }
// Instantiated with SUB = 32 (a warp per row and 32·VEC columns): the deferred gather runs on
// peaked data only (fewer than 2 pairs per class), where a narrow band has nothing to serve.
// Narrower bands on c/8 at the seed (SUB = 4, so that V x 32 columns fit in L2) took 34.7 ms
// against the per-chunk kernel's 23.2 (session 6, run 4): latency-bound on the record loads.
ROWS_GATHER_KERNEL(cce_sparse_gather_f32_f32_v4, 0, 0, 4, 32)
ROWS_GATHER_KERNEL(cce_sparse_gather_f32_f32_v1, 0, 0, 1, 32)
ROWS_GATHER_KERNEL(cce_sparse_gather_f16_f16_v8, 1, 1, 8, 32)
ROWS_GATHER_KERNEL(cce_sparse_gather_f16_f16_v1, 1, 1, 1, 32)
ROWS_GATHER_KERNEL(cce_sparse_gather_f16_f32_v8, 1, 0, 8, 32)
ROWS_GATHER_KERNEL(cce_sparse_gather_f16_f32_v1, 1, 0, 1, 32)
ROWS_GATHER_KERNEL(cce_sparse_gather_bf16_bf16_v8, 2, 2, 8, 32)
ROWS_GATHER_KERNEL(cce_sparse_gather_bf16_bf16_v1, 2, 2, 1, 32)
ROWS_GATHER_KERNEL(cce_sparse_gather_bf16_f32_v8, 2, 0, 8, 32)
ROWS_GATHER_KERNEL(cce_sparse_gather_bf16_f32_v1, 2, 0, 1, 32)

// Regrouping by class. Parameters: row_off, row_cnt u32 [N] (cce_sparse_select's), recs_end
// (the row records, record k at recs_end[−1 − k]); counts u32 [V] (zeroed before
// cce_sparse_count); ctr u32 [2 + ceil(V / SCAN_TILE)] (light and heavy class counts, zeroed
// with counts; then the tile sums); starts u32 [V + 1]; list u32 [V] (the class lists);
// csc u64 [pairs] the class records (row | G << 32), grouped by class (order within a class:
// arrival, not deterministic).
// Tiling: count and scatter: one block per row, threads stride over its pairs; the scan: see
//   cce_sparse_tile_sums.
extern "C" __global__ void __launch_bounds__(GATHER_THREADS) cce_sparse_count(
    const u32* row_off, const u32* row_cnt, const u64* recs_end, u32* counts) {
    const long long r = blockIdx.x;
    u32 n = row_cnt[r];
    if (n == SPARSE_OVERFLOW) return;
    const u32 s = row_off[r];
    for (u32 k = threadIdx.x; k < n; k += GATHER_THREADS)
        atomicAdd(&counts[(u32)recs_end[-1 - (long long)(s + k)]], 1u);
}

// The scan over classes, in two launches of SCAN_TILE-class tiles (one block of SCAN_THREADS
// per tile, thread t owning the tile's 16 consecutive classes 16t .. 16t + 15):
// cce_sparse_tile_sums writes tile b's record count to ctr[2 + b]; cce_sparse_scan_tiles adds
// the earlier tiles' sums to its block scan, writes starts, zeroes counts (the fill counter
// of cce_sparse_scatter) and lists the classes for the d_c gathers: those with at most
// LIGHT_MAX records from the front of `list` (ctr[0] of them; classes without records too
// when list_empty ≠ 0, else the host zeroes d_c and d_bias), the rest from its back
// (ctr[1]), one atomic per block and list (order between blocks: arrival; each class's
// gradient is computed alone, so the order changes no value). ctr[0], ctr[1] are zeroed with
// counts before cce_sparse_count.
extern "C" __global__ void __launch_bounds__(SCAN_THREADS) cce_sparse_tile_sums(
    const u32* __restrict__ counts, u32* __restrict__ ctr, int V) {
    __shared__ u32 wsh[33];
    const long long j0 = (long long)blockIdx.x * SCAN_TILE;
    u32 s = 0;
    for (int k = threadIdx.x; k < SCAN_TILE; k += SCAN_THREADS)
        if (j0 + k < V) s += counts[j0 + k];
    u32 total;
    block_excl_scan<SCAN_THREADS>(s, wsh, total);
    if (threadIdx.x == 0) ctr[2 + blockIdx.x] = total;
}

extern "C" __global__ void __launch_bounds__(SCAN_THREADS) cce_sparse_scan_tiles(
    u32* __restrict__ counts, u32* __restrict__ ctr, u32* __restrict__ starts,
    u32* __restrict__ list, int V, int list_empty) {
    __shared__ u32 wsh[33];
    __shared__ u32 base_sh[2];
    u32 pre = 0, total;
    for (u32 k = threadIdx.x; k < blockIdx.x; k += SCAN_THREADS) pre += ctr[2 + k];
    block_excl_scan<SCAN_THREADS>(pre, wsh, total);
    pre = total;  // Σ of the earlier tiles
    const long long j0 = (long long)blockIdx.x * SCAN_TILE + threadIdx.x * 16;
    u32 x[16];
    u32 local = 0, nl = 0, nh = 0;
#pragma unroll
    for (int q = 0; q < 16; ++q) {
        const bool in = j0 + q < V;
        x[q] = in ? counts[j0 + q] : 0u;
        local += x[q];
        // Past V: no class, not listed; a class without records only when list_empty.
        nl += (in && x[q] <= LIGHT_MAX && (x[q] != 0u || list_empty)) ? 1u : 0u;
        nh += x[q] > LIGHT_MAX ? 1u : 0u;
    }
    u32 run = pre + block_excl_scan<SCAN_THREADS>(local, wsh, total);
    // Light and heavy list offsets in one scan: at most SCAN_TILE of each per block, < 2^16.
    u32 lh_tot;
    const u32 lh = block_excl_scan<SCAN_THREADS>(nl | (nh << 16), wsh, lh_tot);
    if (threadIdx.x == 0) {
        base_sh[0] = atomicAdd(&ctr[0], lh_tot & 0xffffu);
        base_sh[1] = atomicAdd(&ctr[1], lh_tot >> 16);
    }
    __syncthreads();
    u32 pl = base_sh[0] + (lh & 0xffffu), ph = base_sh[1] + (lh >> 16);
#pragma unroll
    for (int q = 0; q < 16; ++q) {
        const long long j = j0 + q;
        if (j < V) {
            starts[j] = run;
            run += x[q];
            counts[j] = 0u;
            if (x[q] <= LIGHT_MAX && (x[q] != 0u || list_empty)) list[pl++] = (u32)j;
            if (x[q] > LIGHT_MAX) list[V - 1 - ph++] = (u32)j;
            if (j == V - 1) starts[V] = run;
        }
    }
}

// d_c of the light classes (0 .. LIGHT_MAX records). Parameters: starts, csc (recs), list,
// ctr as above; src DT [N, D] (e); out OT [V, D] (d_c); sum_out OT [V] (d_bias) or 0; R = V.
// Tiling: block (x, y) owns the column slice y (32·VEC columns); its LIGHT_WARPS warps stride
//   over list[0 .. ctr[0]), a class per warp. Slice-major launch order (x fastest) keeps the
//   resident blocks on one column band of e (N · 32·VEC elements: 16 MB at N = 32768, D-slice
//   256 bf16), which stays in L2 while every class gathers from it.
// Thread mapping: per class, lane l holds records l, l + 32, .. (idx, G) in registers and the
//   VEC columns d0 = (y·32 + l)·VEC; the warp runs the class's records in order, LOOK (4 for
//   VEC = 8, else 8) gathered rows in flight per lane (no shared memory, no barrier; the sum order is the
//   record order); a class without records is written as zeros. Slice 0 writes d_bias from a
//   fixed shuffle tree. Heavy classes (> LIGHT_MAX records) take the _h kernel.
template <int DT, int OT, int VEC>
__device__ __forceinline__ void sparse_gather_light(const u32* __restrict__ starts,
                                                    const u64* __restrict__ recs,
                                                    const void* __restrict__ src, long long D,
                                                    void* __restrict__ out,
                                                    void* __restrict__ sum_out,
                                                    const u32* __restrict__ list,
                                                    const u32* __restrict__ ctr) {
    constexpr int LOOK = VEC >= 8 ? 4 : 8;
    constexpr int REGS = LIGHT_MAX / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 L = ctr[0];
    const long long d0 = ((long long)blockIdx.y * 32 + lane) * VEC;
    const bool ok = d0 < D;
    for (u32 t = blockIdx.x * LIGHT_WARPS + warp; t < L; t += gridDim.x * LIGHT_WARPS) {
        const u32 r = list[t];
        const u32 s = starts[r], n = starts[r + 1] - s;
        u32 idx[REGS];
        float g[REGS];
#pragma unroll
        for (int a = 0; a < REGS; ++a) {
            const u32 k = lane + 32u * a;
            u64 rec = k < n ? recs[s + k] : 0ull;
            idx[a] = (u32)rec;
            g[a] = __uint_as_float((u32)(rec >> 32));  // 0 past n
        }
        if (blockIdx.y == 0 && sum_out) {
            float gs = 0.0f;
#pragma unroll
            for (int a = 0; a < REGS; ++a) gs += g[a];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) gs += __shfl_xor_sync(FULL_MASK, gs, o);
            if (lane == 0) Elem<OT>::store(sum_out, r, gs);
        }
        float acc[VEC];
#pragma unroll
        for (int q = 0; q < VEC; ++q) acc[q] = 0.0f;
#pragma unroll
        for (int a = 0; a < REGS; ++a) {
            if (32u * a >= n) break;  // warp-uniform
            const u32 m = min(32u, n - 32u * a);
            for (u32 k0 = 0; k0 < m; k0 += LOOK) {
                float x[LOOK][VEC];
                float gg[LOOK];
#pragma unroll
                for (int b = 0; b < LOOK; ++b) {
                    const u32 i = __shfl_sync(FULL_MASK, idx[a], (k0 + b) & 31);
                    gg[b] = __shfl_sync(FULL_MASK, g[a], (k0 + b) & 31);
                    if (ok && k0 + b < m) {
                        load_vec<DT, VEC>(src, (long long)i * D + d0, x[b]);
                    } else {
#pragma unroll
                        for (int q = 0; q < VEC; ++q) x[b][q] = 0.0f;
                    }
                }
#pragma unroll
                for (int b = 0; b < LOOK; ++b)
#pragma unroll
                    for (int q = 0; q < VEC; ++q) acc[q] = fmaf(gg[b], x[b][q], acc[q]);
            }
        }
        if (ok) store_vec<OT, VEC>(out, (long long)r * D + d0, acc);
    }
}

// d_c of the heavy classes (list[V − 1 − t], t < ctr[1]): gather_row's warp split, row blocks
// striding over the list.
template <int DT, int OT, int VEC>
__device__ __forceinline__ void sparse_gather_heavy(const u32* __restrict__ starts,
                                                    const u64* __restrict__ recs,
                                                    const void* __restrict__ src, long long D,
                                                    void* __restrict__ out,
                                                    void* __restrict__ sum_out,
                                                    const u32* __restrict__ list,
                                                    const u32* __restrict__ ctr, long long R) {
    __shared__ float part[GATHER_WARPS][32 * VEC];
    __shared__ float gpart[GATHER_WARPS];
    const u32 H = ctr[1];
    for (u32 t = blockIdx.x; t < H; t += gridDim.x) {
        const long long r = list[R - 1 - t];
        const u32 s = starts[r];
        gather_row<DT, OT, VEC>(r, s, starts[r + 1] - s, recs, 1, src, D, out, sum_out, part,
                                gpart);
        __syncthreads();  // warp 0 has read `part` before the next class writes it
    }
}

#define CLASS_GATHER_PARAMS                                                                   \
    const u32 *starts, const u64 *recs, const void *src, long long D, void *out,             \
        void *sum_out, const u32 *list, const u32 *ctr, long long R
#define CLASS_GATHER_KERNEL(NAME, DT, OT, VEC)                                                \
    extern "C" __global__ void __launch_bounds__(LIGHT_WARPS * 32, 3)                         \
        NAME##_l(CLASS_GATHER_PARAMS) {                                                       \
        sparse_gather_light<DT, OT, VEC>(starts, recs, src, D, out, sum_out, list, ctr);      \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(GATHER_WARPS * 32) NAME##_h(CLASS_GATHER_PARAMS) { \
        sparse_gather_heavy<DT, OT, VEC>(starts, recs, src, D, out, sum_out, list, ctr, R);  \
    }
CLASS_GATHER_KERNEL(cce_sparse_gather_f32_f32_v4, 0, 0, 4)
CLASS_GATHER_KERNEL(cce_sparse_gather_f32_f32_v1, 0, 0, 1)
CLASS_GATHER_KERNEL(cce_sparse_gather_f16_f16_v8, 1, 1, 8)
CLASS_GATHER_KERNEL(cce_sparse_gather_f16_f16_v1, 1, 1, 1)
CLASS_GATHER_KERNEL(cce_sparse_gather_f16_f32_v8, 1, 0, 8)
CLASS_GATHER_KERNEL(cce_sparse_gather_f16_f32_v1, 1, 0, 1)
CLASS_GATHER_KERNEL(cce_sparse_gather_bf16_bf16_v8, 2, 2, 8)
CLASS_GATHER_KERNEL(cce_sparse_gather_bf16_bf16_v1, 2, 2, 1)
CLASS_GATHER_KERNEL(cce_sparse_gather_bf16_f32_v8, 2, 0, 8)
CLASS_GATHER_KERNEL(cce_sparse_gather_bf16_f32_v1, 2, 0, 1)

extern "C" __global__ void __launch_bounds__(GATHER_THREADS) cce_sparse_scatter(
    const u32* row_off, const u32* row_cnt, const u64* recs_end, const u32* starts, u32* fill,
    u64* csc) {
    const long long r = blockIdx.x;
    u32 n = row_cnt[r];
    if (n == SPARSE_OVERFLOW) return;
    const u32 s = row_off[r];
    for (u32 k = threadIdx.x; k < n; k += GATHER_THREADS) {
        u64 rec = recs_end[-1 - (long long)(s + k)];
        u32 j = (u32)rec;
        u32 pos = starts[j] + atomicAdd(&fill[j], 1u);
        csc[pos] = (u64)(u32)r | (rec & 0xffffffff00000000ull);
    }
}
