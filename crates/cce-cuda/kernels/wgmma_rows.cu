// wgmma_rows.cu: the dense row pass of a forward-and-backward call through the WGMMA
// epilogue (split and chunked dense, bf16; `schedule::wgmma_rows_unfit`): `cce_wgmma_lseq[_x]`
// (wgmma.cu's main loop with `LseEpi<.., QS>`: the lse partials and each q = e^{z − m_tile}
// stored by TMA as bf16, or as its q9 code (`q9_code`, wgmma.cu) for chunked dense's f16-G
// path), the combine (wgmma.cu), then `cce_wgmma_qrows_g[_cap]` (G over q in place).
// Appended after wgmma.cu in the same NVRTC module (it uses its namespace cce_wg: BN,
// LseEpi, gemm_tiles, bulk_wait_all, q9_value; and dense_common.cu's g_coef, g_target).
//
// Parameters
//   lseq      (cce_wgmma_lseq[_x][_q9]_bf16): the lse kernel's parameters, then tmQ: the tensor
//             map of Q u16 [N, ldq] (bf16 q, or its q9 code for _q9; dims {V, N}, row stride
//             ldq·2 bytes a multiple of 16, box {64, 64}, 128-byte swizzle), written by TMA
//             stores.
//   qrows     (cce_wgmma_qrows_g[_cap][_q9]_bf16): Q (q in, bf16 or q9 code for _q9; G out),
//             ldq, V, n_tiles, partial,
//             lse f32 [N], zy f32 [N], rest f32 [N] (the combine's), targets, dl_rows f32 [N]
//             or null (→ dl_scalar), dlse f32 [N] or null, λ, softcap (> 0 for _cap); no label
//             smoothing (α = 0); g_scale f32 (device) or null: where set, G is written as f16
//             times *g_scale (a power of two keeping |G| ≤ 2^14: chunked dense's f16 d_c
//             operand with f32 gradients), else as bf16.
//
// Tiling
//   lseq: wgmma.cu's (BM = 128, BN = 256, BK = 64, persistent CTAs, ordered epilogues).
//   qrows: one 256-column tile of one row per warp, 8 columns per lane.
//
// Thread mapping
//   lseq: wgmma.cu's (one producer warp group, two consumer warp groups). qrows: below, at
//   `qrows_g`.

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

namespace cce_wg {

// The dense row pass after `cce_wgmma_lseq[_x]_*` and the combine: G of each row, from the
// bf16 q = e^{z − m_j} of column tile j (m_j = partial[r·n_tiles + j].x) and the row's lse:
// p = q·e^{m_j − lse}, G = cp·p (g_coef with α = 0: no label smoothing), written
// in place over q as bf16 (same row stride ldq). CAP (softcap s > 0): times 1 − (z/s)², z =
// m_j + ln q clamped to [−s, s] (q = 0 gives z = −s and G = 0: such an entry's p is under
// 2⁻²⁴·e^{m_j − lse}). The target entry is cd − cp·rest from the combine's rest = 1 − p_y
// (g_target; its q is 0: the lse epilogue left it out), times the factor of the combine's z_y.
// Inactive rows (no loss or lse gradient) get exact zeros, as every column ≥ V of the last
// 8-column group.
// Thread mapping: one warp per (row, column tile): lane l owns the 8 columns 256·j + 8·l (one
// 16-byte load of q, one 16-byte store of G; ldq a multiple of 8 and ≥ V rounded up to 8, so a
// group never crosses the row's end); blockIdx.x = row, blockIdx.y·8 + warp = tile.
template <bool CAP, bool Q9 = false>
__device__ __forceinline__ void qrows_g(u16* __restrict__ Q, long long ldq, int V, int n_tiles,
                                        const float2* __restrict__ partial,
                                        const float* __restrict__ lse_in,
                                        const float* __restrict__ zy_in,
                                        const float* __restrict__ rest_in,
                                        const int* __restrict__ targets, const float* dl_rows,
                                        float dl_scalar, const float* dlse, float lambda,
                                        float softcap, const float* g_scale) {
    constexpr float L2E = 1.4426950408889634f;
    constexpr float LN2 = 0.6931471805599453f;
    const long long r = blockIdx.x;
    const int tile = blockIdx.y * (blockDim.x / 32) + threadIdx.x / 32;
    if (tile >= n_tiles) return;
    const int c0 = tile * BN + 8 * (threadIdx.x % 32);
    if (c0 >= V) return;
    const int y = targets[r];
    const float l = lse_in[r];
    const GCoef c = g_coef(y, r, dl_rows, dl_scalar, dlse, l, 0.0f, lambda, V);
    const float m = partial[r * n_tiles + tile].x;
    const float f = c.cp * ex2_approx((m - l) * L2E);  // cp·e^{m_j − lse}
    const float inv_cap = CAP ? 1.0f / softcap : 0.0f;
    // f16 G times 2^kg (chunked dense's d_c operand) where g_scale is set, else bf16 G.
    const float up = g_scale ? *g_scale : 0.0f;
    u16* q = Q + r * ldq + c0;
    const uint4 raw = *reinterpret_cast<const uint4*>(q);
    const u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
    u32 out[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        float g[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int col = c0 + 2 * k + e;
            const u16 qc = static_cast<u16>(e == 0 ? (w[k] & 0xffffu) : (w[k] >> 16));
            const float qv = Q9 ? q9_value(qc) : bf16_to_f32(qc);
            float gv = f * qv;
            if (CAP) {
                float z = fmaf(__log2f(qv), LN2, m);
                z = fminf(fmaxf(z, -softcap), softcap);
                const float t = z * inv_cap;
                gv *= 1.0f - t * t;
            }
            if (col == y) {
                const float zy = zy_in[r];
                float gy = g_target(c, rest_in[r]);
                if (CAP) {
                    const float t = zy * inv_cap;
                    gy *= 1.0f - t * t;
                }
                gv = gy;
            }
            g[e] = (c.active && col < V) ? gv : 0.0f;
        }
        if (g_scale)
            asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(out[k]) : "f"(g[1] * up), "f"(g[0] * up));
        else
            asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(out[k]) : "f"(g[1]), "f"(g[0]));
    }
    *reinterpret_cast<uint4*>(q) = make_uint4(out[0], out[1], out[2], out[3]);
}

}  // namespace cce_wg

// The dense row pass (bf16 only): the lse epilogue that also stores bf16 q (`LseEpi`, QS),
// then `cce_wgmma_qrows_g[_cap]_bf16` (G over q in place).
#define WG_LSEQ_PARAMS WG_LSE_PARAMS, const __grid_constant__ cce_wg::TmaDesc tmQ
#define WG_LSEQ_BODY(EXT, QS)                                                                    \
    const cce_wg::LseEpi<2, EXT, QS> epi{partial, N, V, (V + cce_wg::BN - 1) / cce_wg::BN,     \
                                           bias,    softcap, targets, zy_tile, &tmQ};            \
    (void)ordered_epi; /* the TMA-store epilogue needs ordered epilogues */                    \
    cce_wg::gemm_tiles<false>(tmE, tmC, N, V, D, group_m, 1, epi);                              \
    if (threadIdx.x >= 128 && threadIdx.x % 128 == 0) cce_wg::bulk_wait_all()
extern "C" __global__ void __launch_bounds__(cce_wg::NUM_THREADS, 1) cce_wgmma_lseq_bf16(WG_LSEQ_PARAMS) {
    WG_LSEQ_BODY(false, 1);
}
extern "C" __global__ void __launch_bounds__(cce_wg::NUM_THREADS, 1) cce_wgmma_lseq_x_bf16(WG_LSEQ_PARAMS) {
    WG_LSEQ_BODY(true, 1);
}
// q as its q9 code (chunked dense with f16 G for d_c), read by `cce_wgmma_qrows_g[_cap]_q9_bf16`.
extern "C" __global__ void __launch_bounds__(cce_wg::NUM_THREADS, 1) cce_wgmma_lseq_q9_bf16(WG_LSEQ_PARAMS) {
    WG_LSEQ_BODY(false, 2);
}
extern "C" __global__ void __launch_bounds__(cce_wg::NUM_THREADS, 1) cce_wgmma_lseq_x_q9_bf16(WG_LSEQ_PARAMS) {
    WG_LSEQ_BODY(true, 2);
}
#define WG_QROWS_PARAMS                                                                          \
    u16 *Q, long long ldq, int V, int n_tiles, const float2 *partial, const float *lse_in,        \
        const float *zy_in, const float *rest_in, const int *targets, const float *dl_rows,      \
        float dl_scalar, const float *dlse, float lambda, float softcap, const float *g_scale
#define WG_QROWS_ARGS                                                                            \
    Q, ldq, V, n_tiles, partial, lse_in, zy_in, rest_in, targets, dl_rows, dl_scalar, dlse,       \
        lambda, softcap, g_scale
extern "C" __global__ void __launch_bounds__(256) cce_wgmma_qrows_g_bf16(WG_QROWS_PARAMS) {
    cce_wg::qrows_g<false>(WG_QROWS_ARGS);
}
extern "C" __global__ void __launch_bounds__(256) cce_wgmma_qrows_g_cap_bf16(WG_QROWS_PARAMS) {
    cce_wg::qrows_g<true>(WG_QROWS_ARGS);
}
extern "C" __global__ void __launch_bounds__(256) cce_wgmma_qrows_g_q9_bf16(WG_QROWS_PARAMS) {
    cce_wg::qrows_g<false, true>(WG_QROWS_ARGS);
}
extern "C" __global__ void __launch_bounds__(256) cce_wgmma_qrows_g_cap_q9_bf16(WG_QROWS_PARAMS) {
    cce_wg::qrows_g<true, true>(WG_QROWS_ARGS);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
