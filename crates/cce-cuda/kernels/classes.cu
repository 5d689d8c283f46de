// classes.cu: split dense's class pass (Strategy::SplitDense): the scales, the f16 copy of e,
// the finishing pass of f16-G d_e rows, and G of one class chunk in place. Concatenated after
// rows.cu (src/dense/mod.rs `KERNEL_SOURCE`).
//
// Parameters: L f32 [N, ldk] logits of a class chunk (G written over them); lse, rest, tau,
//   targets and upstream gradients f32 / i32 [N]; the power-of-two factors as device pointers
//   to f32 (a scale set of the workspace's `scales` region, written by
//   cce_split_scales_finish; null means 1); details at each kernel.
// Tiling: grid-stride (scales, conversions); one thread (scales_finish); GC_ROWS rows per
//   block (gcols).
// Thread mapping: one element / row per thread per step, a factor loaded once per thread
//   before its loop; one warp per row in gcols.

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
// The scales come from cce_split_scales_* (max |e| and max_i |coefficients of G_i|) and
// cce_split_scales_finish, which turns them into the factors 2^−k, 2^s, 2^(k−s), 2^−s in
// device memory; every consumer reads its factor there (the d_c GEMM its alpha through
// cuBLAS's device pointer mode), so the scales cost no host sync.

// Parameters: e DT [count]; targets i32 [N]; dl_rows f32 [N] or 0 (→ dl_scalar); dlse f32 [N]
//   or 0; lse, rest f32 [N]; out u32 [2] (words 0, 1 of a scale set, zeroed by the caller) =
//   bits of {max |e|, max_i g_bound_i}, the bound of |G_ij| (g_coef, g_bound).
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

// The exponent k (clamped to ±100) with max · 2^k ≤ 2^top, from the bits u of a max: top −
// ceil(log2 max), exactly (integer exponent and significand, subnormals included); 0 for a
// zero, negative or non-finite max. Mirrors scales.rs `pow2_to`, its reference.
__device__ __forceinline__ int pow2_to_bits(u32 u, int top) {
    const int ex = (int)((u >> 23) & 0xffu);
    const u32 m = u & 0x7fffffu;
    if ((u >> 31) != 0u || ex == 0xff || u == 0u) return 0;
    const int c = ex != 0 ? ex - 127 + (m != 0u ? 1 : 0)
                          : (31 - __clz((int)m)) - 149 + ((m & (m - 1u)) != 0u ? 1 : 0);
    return min(max(top - c, -100), 100);
}
// 2^k as f32, exact where representable (subnormals included), +inf above 2^127, 0 below
// 2^−149. Mirrors scales.rs `pow2f`.
__device__ __forceinline__ float pow2f(int k) {
    if (k > 127) return __int_as_float(0x7f800000);
    if (k >= -126) return __int_as_float((k + 127) << 23);
    if (k >= -149) return __int_as_float(1 << (k + 149));
    return 0.0f;
}

// Parameters: set u32 / f32 [9], one scale set of the workspace's `scales` region (scales.rs
//   `ScaleSet`): reads words 0, 1 (the bits of max |x| and max |G coefficient| that
//   cce_split_scales_* wrote before it, stream order), writes the f32 factors 2 = 2^kx,
//   3 = 2^−kx, 4 = 2^kg, 5 = 2^−kg, 6 = 2^(−kx−kg), 7 = 0.0 and 8 = 1.0 (cuBLAS's device-mode
//   beta: overwrite, accumulate), with kx = pow2_to(max |x|, top_x), kg = pow2_to(max |G|, top_g).
// Tiling / thread mapping: one block of one thread.
extern "C" __global__ void __launch_bounds__(1) cce_split_scales_finish(u32* set, int top_x,
                                                                       int top_g) {
    const int kx = pow2_to_bits(set[0], top_x);
    const int kg = pow2_to_bits(set[1], top_g);
    float* f = (float*)set;
    f[2] = pow2f(kx);
    f[3] = pow2f(-kx);
    f[4] = pow2f(kg);
    f[5] = pow2f(-kg);
    f[6] = pow2f(-kx - kg);
    f[7] = 0.0f;
    f[8] = 1.0f;
}

// Parameters: src bf16 [count]; dst f16 [count] = f16(src · *scale), *scale (f32, device; null
//   = 1) a power of two that keeps max |src · scale| ≤ 2^15 (exact for |src · scale| ≥ 2^−14:
//   bf16's 8 significand bits fit f16's 11). Used for e (class pass) and c (row pass with an
//   f16 c).
// Tiling / thread mapping: grid-stride, one element per thread per step; the scale loaded once
//   per thread.
extern "C" __global__ void __launch_bounds__(256) cce_split_e_to_f16_bf16(const u16* src, u16* dst,
                                                                         long long count,
                                                                         const float* scale) {
    const float s = scale ? *scale : 1.0f;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride)
        dst[i] = f32_to_f16(bf16_to_f32(src[i]) * s);
}

// Chunked dense with f32 gradients of bf16 inputs: the chunk's G, written as f16 times 2^kg
// for the d_c product (cce_wgmma_qrows_g*'s g_scale), turned into bf16 G in place for the d_e
// product against bf16 c.
// Parameters: G u16 [rows, ldg] (f16 in, bf16 out), ldg a multiple of 8; cols8: the columns
//   written (V rounded up to 8, ≤ ldg); down f32 (device: 2^−kg).
// Tiling / thread mapping: grid-stride over the rows' groups of 8 columns, one group per thread
//   per step (one 16-byte load and store); the factor loaded once per thread.
extern "C" __global__ void __launch_bounds__(256) cce_g16_to_bf16(u16* G, long long ldg, int rows,
                                                                int cols8, const float* down) {
    const float s = *down;
    const long long per_row = cols8 / 8;
    const long long total = (long long)rows * per_row;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const long long r = i / per_row;
        uint4* p = reinterpret_cast<uint4*>(G + r * ldg + 8 * (i - r * per_row));
        const uint4 raw = *p;
        const u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
        u32 out[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float lo = f16_to_f32(static_cast<u16>(w[k] & 0xffffu)) * s;
            const float hi = f16_to_f32(static_cast<u16>(w[k] >> 16)) * s;
            asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(out[k]) : "f"(hi), "f"(lo));
        }
        *p = make_uint4(out[0], out[1], out[2], out[3]);
    }
}

// d_e rows from the f32 product of the row pass: d_e[r, k] = out(tmp[r, k] · rs[r] · *cscale),
//   rs = row_scale (mode 2) or 0 (→ 1), cscale f32 (device: 2^−kc of the f16 copy of c) or
//   null (→ 1). tmp f32 [rows, D]; d_e OT [rows, D] (0 f32, 1 f16, 2 bf16); accumulate ≠ 0:
//   d_e[r, k] = out(d_e[r, k] + tmp[r, k] · rs[r] · *cscale) (the caller's gradient
//   accumulation; the branch is taken once per launch, outside the element loop).
// Tiling / thread mapping: grid-stride over rows·D, one element per thread; cscale loaded once
//   per thread.
template <int OT, bool ACC>
__device__ __forceinline__ void split_de_finish(const float* tmp, const float* rs,
                                                const float* cscale, void* de, long long rows,
                                                int D) {
    const float cs = cscale ? *cscale : 1.0f;
    const long long n = rows * D;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float s = (rs ? rs[i / D] : 1.0f) * cs;
        float x = tmp[i] * s;
        if (ACC) x += Elem<OT>::load(de, i);
        Elem<OT>::store(de, i, x);
    }
}
#define DEF_PARAMS                                                                            \
    const float *tmp, const float *rs, const float *cscale, void *de, long long rows, int D, \
        int accumulate
#define DEF_DISPATCH(OT)                                                                      \
    if (accumulate)                                                                           \
        split_de_finish<OT, true>(tmp, rs, cscale, de, rows, D);                              \
    else                                                                                      \
        split_de_finish<OT, false>(tmp, rs, cscale, de, rows, D)
extern "C" __global__ void __launch_bounds__(256) cce_split_de_finish_f32(DEF_PARAMS) {
    DEF_DISPATCH(0);
}
extern "C" __global__ void __launch_bounds__(256) cce_split_de_finish_f16(DEF_PARAMS) {
    DEF_DISPATCH(1);
}
extern "C" __global__ void __launch_bounds__(256) cce_split_de_finish_bf16(DEF_PARAMS) {
    DEF_DISPATCH(2);
}

// (b) G of one class chunk, in place.
// Parameters:
//   L      f32 [N, ld] logits of classes [k0, k0+K) (ld a multiple of 8, 16-byte aligned
//          rows), row-major; G is written over it in GT (0 = f32, 1 = f16) with row stride
//          ld·4/sizeof(GT);
//   bias   DT [V] or 0 (indexed k0 + j); targets i32 [N] (global class or −1); lse, rest
//          (1 − p_y), tau f32 [N] from the row pass; dl_rows / dl_scalar / dlse as in the backward row kernel;
//   g_scale f32 (device; null = 1): the power of two G is multiplied by before it is stored,
//          loaded once per thread.
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
                                            const float* g_scale_p, int rows) {
    const long long r = (long long)blockIdx.x * GC_ROWS + (threadIdx.x >> 5);
    if (r >= rows) return;  // whole warps leave: no block barrier below
    const int lane = threadIdx.x & 31;
    const float g_scale = g_scale_p ? *g_scale_p : 1.0f;
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
        const float *g_scale, int rows
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

