// wgmma.cu: WGMMA GEMMs Z = E · Cᵀ on Hopper (sm_90a) whose f32 logits never leave the
// registers: one persistent main loop (`gemm_tiles`, TMA + mbarrier pipeline, warp-specialized)
// and three epilogues. (1) The fused forward of forward-only dense calls: each 128 x 256 tile
// of Z reduced to per-row (max, Σexp) (`LseEpi`, `cce_wgmma_lse[_x]_*`), then one combine pass
// per row to lse and the loss (`cce_wgmma_lse_combine_*`). (2) Split dense's class pass: G
// of a class chunk from the saved lse, written as f16 (`GColsEpi`, `cce_wgmma_gcols[_cap]_*`).
// (3) The dense row pass of a forward-and-backward call (split and chunked dense, bf16): (1)
// that also stores each q = e^{z − m_tile} as bf16 (`cce_wgmma_lseq[_x]_bf16`), the combine,
// then G = cp·q·e^{m_tile −
// lse} − cy·[c = y] in place as bf16 (`cce_wgmma_qrows_g[_cap]_bf16`, a memory-bound pass):
// 2 + 2 + 2 bytes per logit instead of cuBLAS's f32 logits read twice (4 + 4 + 4 + 2); its
// kernels are in wgmma_rows.cu (appended after this file).
// Appended to the dense kernel files (same NVRTC module: it uses dense_common.cu's typedefs u16 / u32 / u64,
// NEG_INF, FULL_MASK, Elem, bf16_to_f32 / f16_to_f32 / f32_to_f16, cap_z, g_coef and
// write_row_outputs). The main loop is the device code of the standalone benchmark
// benches/wgmma/wgmma_lse.cuh (commit d8e9f6b; kernel B, CM = 1, ordered epilogues; NOTES.md
// there has the measurements), unchanged in tiling and barriers.
//
// Parameters
//   tmE, tmC  CUtensorMap (128 opaque bytes, 64-byte aligned, __grid_constant__) of E [N, D] and
//             C [V, D] (16-bit, row-major, K-major operands), encoded by the host
//             (src/dense/launch.rs `tensor_map`): dims {D, rows}, stride D·2 bytes, box {64, 128} for E
//             and {64, 256} for C, 128-byte swizzle, zero out-of-bounds fill. For the class
//             pass C's map starts at class k0 and holds the chunk's K classes.
//   N, V, D   rows of this launch (a row group: E's map starts at its first row), classes, hidden
//             size; D % 64 == 0 (no K tail; the host checks), N, V ≥ 1.
//   partial   float2 [N, n_tiles], n_tiles = ceil(V / 256): partial[r·n_tiles + j] = (m, s),
//             m = max_{c in tile j, c < V, c ≠ y_r} z[r, c], s = Σ_{same c} exp(z[r, c] − m)
//             (the target left out: rest = 1 − p_y without cancellation; (−inf, 0) for a tile
//             with no other unmasked column); targets i32 [N] of the launch's rows;
//             zy_tile f32 [N]: the target's logit z[r, y] (after bias and softcap), written
//             by the one thread whose tile column is y (rows with y < 0: not written).
//   group_m   row tiles per group of the grouped tile order (16); ordered_epi: 1 (consumers take
//             turns in the epilogue; the measured best), 0 (lockstep).
//   bias, softcap  (lse_x, combine, gcols) bias DT [V] or null; softcap ≤ 0 off. The _x / _cap
//             epilogues compute z = cap_fast(x + bias); the combine's own target logit (zy_in
//             null) uses cap_z.
//   combine   (cce_wgmma_lse_combine_*): partial, N, n_tiles, E, C, D, targets i32 [N]
//             (−1 ignored), λ, V, lse_out f32 [N], rest_out f32 [N] (1 − p_y, 0 at ignored rows),
//             loss_out f32 [N], bias, softcap, zy_in f32 [N] (the lse epilogue's zy_tile: the
//             loss's lse − z_y then cancels the rounding common to the row's tensor-core
//             logits; may be lse_out itself: each row's is read before its lse is written) or
//             null (z_y computed here), all of the row group.
//   lseq, qrows  the dense row pass's kernels: wgmma_rows.cu.
//   gcols     (cce_wgmma_gcols[_cap]_*): N, K (classes of the chunk), D, k0 (its first class),
//             V (all classes: label smoothing's α/V), tmG: the tensor map of G u16 [N, ldg] (f16;
//             dims {K, N}, row stride ldg·2 bytes a multiple of 16, box {64, 64}, 128-byte
//             swizzle), bias, softcap, targets i32 [N] (global class or −1), lse, rest f32 [N],
//             dl_rows f32 [N] or null (→ dl_scalar), dlse f32 [N] or null, α, λ, g_scale f32
//             (device, the class pass's scale set; null = 1: the power of two G is stored
//             times, loaded once per thread at the kernel's start), group_m, ordered_epi.
//
// Tiling
//   BM = 128 rows of E, BN = 256 rows of C per CTA tile, BK = 64 (one 128-byte swizzle atom:
//   64 16-bit values per row). Per stage A 128 x 64 (16 KB) + B 256 x 64 (32 KB), written by TMA
//   with 128-byte swizzle into 1024-byte aligned shared memory, 4 stages (192 KB + 1 KB
//   alignment slack + 64 B of mbarriers = 197696 B of dynamic shared memory; the kernels that
//   store f16 (lseq, gcols) add a 32 KB output staging buffer 1 KB past the mbarriers: 231424 B,
//   under sm_90's 227 KB). Per stage a
//   "full" mbarrier (1 arrival + expect-tx 48 KB) and an "empty" one (8 arrivals: lane 0 of each
//   consumer warp once the wgmmas that read the stage retired). Persistent grid (one CTA per
//   SM, at most the tile count); CTA b walks tiles b, b + grid, ... of a grouped order (groups
//   of group_m row tiles, row tile fastest inside a group) so the resident tiles share E row
//   panels and C column panels in L2. Rows ≥ N and columns ≥ V of a tile are read as zeros by
//   TMA; the lse epilogue sets columns ≥ V to −inf, the f16 outputs (q, G) leave through TMA
//   stores of 64 x 64 boxes that write no column ≥ V (K) and no row ≥ N.
//
// Thread mapping (384 threads = 3 warpgroups, __launch_bounds__(384, 1))
//   warpgroup 0: producer. setmaxnreg.dec to 40; thread 0 alone issues the TMA loads for every
//                (tile, k-step) of the CTA, up to 4 stages ahead of the consumers.
//   warpgroups 1, 2: consumers. setmaxnreg.inc to 232. Consumer c owns tile rows [64c, 64c+64)
//                and issues per k-step four wgmma.mma_async.m64n256k16.f32.{bf16,f16} (both
//                operands from shared memory through matrix descriptors; K-steps of 16 advance
//                the start address by 32 B inside the swizzle atom), one wgmma group in flight.
//   Accumulator fragment (PTX ISA, wgmma m64nNk16 f32 D): thread t of the warpgroup, warp
//                w = t / 32, lane l = t % 32, register i < 128: row 16w + l/4 + 8·((i >> 1) & 1),
//                column 8·(i >> 2) + 2·(l % 4) + (i & 1). A row's 256 columns live in the 4
//                lanes of a quad: max and Σ ex2 in registers, then over the quad by two
//                xor-shuffles; lane 0 of the quad writes the row's float2. The f16 epilogues
//                write each register pair (i, i + 1) of a row as one f16x2 word into the
//                swizzled staging buffer, then one thread per consumer issues the TMA stores
//                (`store_f16_tile`).
//   Ordered epilogues: the consumers take turns through named barriers 1 and 2, so one runs
//                its epilogue while the other still issues wgmmas.
//   qrows:   one warp per (row, 256-column tile), lane l the tile's columns 8l..8l+7 (16-byte
//                load and store); grid (rows, ceil(n_tiles / 8)), 256 threads.
//   combine: one warp per row (8 rows per 256-thread block): lse = M + log Σ_j s_j e^{m_j − M}
//                over the row's partials; z_y from zy_in, or (null) Σ_k e[r, k]·c[y, k] in
//                f32 (each lane 2 values per step of 64, a fixed shuffle tree: deterministic);
//                lane 0 writes lse, loss.

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

namespace cce_wg {

constexpr int BM = 128;
constexpr int BN = 256;
constexpr int BK = 64;
constexpr int STAGES = 4;
constexpr int NUM_THREADS = 384;
constexpr int PRODUCER_REGS = 40;
constexpr int CONSUMER_REGS = 232;
constexpr int STAGE_BYTES_ALL = STAGES * (BM + BN) * BK * 2;
// The f16 output staging of the TMA-store epilogues (one consumer's 64 x 256 half tile, four
// 64 x 64 boxes of 8 KB in 128-byte swizzle), 1 KB past the mbarriers; the two consumers use
// it in turn (ordered epilogues).
constexpr int OUT_OFFSET = STAGE_BYTES_ALL + 1024;
constexpr int OUT_BYTES = 64 * BN * 2;

// A CUtensorMap is 128 opaque bytes, 64-byte aligned; the host copies its encoded map in here.
struct __align__(64) TmaDesc {
    u64 w[16];
};

__device__ __forceinline__ u32 smem_u32(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// ---- mbarrier -------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(u32 bar, u32 parity) {
    u32 ok;
    asm volatile(
        "{\n"
        ".reg .pred q;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2;\n"
        "selp.u32 %0, 1, 0, q;\n"
        "}\n"
        : "=r"(ok)
        : "r"(bar), "r"(parity)
        : "memory");
    return ok != 0;
}
// Wait until the phase of parity `parity` has completed. A wait longer than ~4·10⁹ SM clocks
// (2-3 s) traps, so that a pipeline bug fails the launch instead of hanging. No printf here: a
// call inside the wgmma pipeline makes ptxas serialize the wgmmas (C7510).
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    if (mbar_try_wait(bar, parity)) return;
    const long long t0 = clock64();
    while (!mbar_try_wait(bar, parity)) {
        if (clock64() - t0 > 4000000000LL) __trap();
    }
}

// ---- TMA --------------------------------------------------------------------------------------
__device__ __forceinline__ void tma_load_2d(u32 dst, const TmaDesc* map, u32 bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, "
        "%4}], [%2];\n" ::"r"(dst),
        "l"(reinterpret_cast<u64>(map)), "r"(bar), "r"(c0), "r"(c1)
        : "memory");
}
__device__ __forceinline__ void tma_prefetch_desc(const TmaDesc* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(map)) : "memory");
}
// Shared → global tile store (bulk async-group of the issuing thread); out-of-bounds elements
// of the box are not written.
__device__ __forceinline__ void tma_store_2d(const TmaDesc* map, u32 src, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
            reinterpret_cast<u64>(map)),
        "r"(src), "r"(c0), "r"(c1)
        : "memory");
}
__device__ __forceinline__ void bulk_commit() {
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Until every committed bulk store of this thread has read its shared memory.
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
// Until every committed bulk store of this thread is complete (visible in global memory).
__device__ __forceinline__ void bulk_wait_all() {
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

// ---- wgmma ------------------------------------------------------------------------------------
// Shared-memory matrix descriptor, K-major operand in 128-byte swizzle atoms (8 rows x 128 B):
// bits 0-13 start address >> 4, 16-29 leading byte offset >> 4 (unused for swizzled K-major:
// 1), 32-45 stride byte offset >> 4 (1024 B between 8-row groups), 49-51 base offset 0 (atoms
// 1024-byte aligned), 62-63 swizzle mode 1 = 128 B.
__device__ __forceinline__ u64 make_desc(u32 saddr) {
    u64 d = 0;
    d |= static_cast<u64>((saddr & 0x3FFFFu) >> 4);
    d |= static_cast<u64>(1) << 16;
    d |= static_cast<u64>(1024 >> 4) << 32;
    d |= static_cast<u64>(1) << 62;
    return d;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int W>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(W) : "memory");
}
// Compiler-only fence on the accumulators, so no access to them moves across a wgmma wait.
template <int NREG>
__device__ __forceinline__ void fence_regs(float* d) {
#pragma unroll
    for (int i = 0; i < NREG; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#define CCE_WG_D128                                                                              \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "  \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "   \
    "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "    \
    "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, "   \
    "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, "   \
    "%92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, "     \
    "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, "   \
    "%123, %124, %125, %126, %127}, "
#define CCE_WG_OUT128                                                                            \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),            \
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),    \
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),              \
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),              \
        "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),              \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]),              \
        "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),              \
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),              \
        "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),              \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]),              \
        "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]),              \
        "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]),              \
        "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),              \
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]),              \
        "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]),              \
        "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),              \
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),          \
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),        \
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),        \
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),        \
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// One m64n256k16 wgmma, f32 accumulators, A and B K-major in shared memory; F16: f16 inputs,
// else bf16.
template <bool F16>
__device__ __forceinline__ void wgmma_256(float* d, u64 da, u64 db, int scale_d);

template <>
__device__ __forceinline__ void wgmma_256<false>(float* d, u64 da, u64 db, int scale_d) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " CCE_WG_D128
        "%128, %129, p, 1, 1, 0, 0;\n"
        "}\n"
        : CCE_WG_OUT128
        : "l"(da), "l"(db), "r"(scale_d));
}

template <>
__device__ __forceinline__ void wgmma_256<true>(float* d, u64 da, u64 db, int scale_d) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 " CCE_WG_D128
        "%128, %129, p, 1, 1, 0, 0;\n"
        "}\n"
        : CCE_WG_OUT128
        : "l"(da), "l"(db), "r"(scale_d));
}

__device__ __forceinline__ float ex2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float rcp_approx(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// softcap·tanh(x / softcap) = s − 2s / (e^{2x/s} + 1), two MUFU ops (ex2, rcp) instead of
// tanhf's ~20 instructions; k2 = 2·log2(e) / s. Its absolute error is a few s·2⁻²² whatever x
// (the subtraction from s cancels for |x| ≪ s), against tanhf's 2⁻²³·|z|: ~1e-5 at s = 30,
// under the f32 logits' own rounding at D in the thousands, so the host takes these kernels
// only for softcap ≤ 100 (src/dense/config.rs `WGMMA_SOFTCAP_MAX`; ~1e-4 at s = 1000). Saturates to
// ±s (e^{2x/s} = inf or 0). Finite x only, as cap_z: an overflowed logit stays infinite so the
// lse check reports it.
__device__ __forceinline__ float cap_fast(float x, float softcap, float k2) {
    const float t = ex2_approx(x * k2);
    const float z = fmaf(-2.0f * softcap, rcp_approx(t + 1.0f), softcap);
    return isfinite(x) ? z : x;
}

// cap_fast and the softcap's derivative 1 − tanh²(x/s) from the same two MUFU values: with
// t = e^{2x/s} and r = 1/(t + 1), tanh = 1 − 2r and 1 − tanh² = 4r(1 − r), where 1 − r is t·r
// for x < 0 (r > 1/2 there: 1 − r would cancel). Full relative accuracy for every x (1 − (z/s)²
// from z rounds to 0 once |x| is a few s); 0 for an infinite x (a masked class: t = 0 or inf).
__device__ __forceinline__ float cap_fast_grad(float x, float softcap, float k2, float& grad) {
    const float t = ex2_approx(x * k2);
    const float r = rcp_approx(t + 1.0f);
    grad = 4.0f * r * (x > 0.0f ? 1.0f - r : t * r);
    const float z = fmaf(-2.0f * softcap, r, softcap);
    return isfinite(x) ? z : x;
}

// Grouped tile order: group_m row tiles per group; inside a group the row tile varies fastest.
__device__ __forceinline__ void tile_coords(int t, int m_tiles, int n_tiles, int group_m, int& mt,
                                            int& nt) {
    const int per_group = group_m * n_tiles;
    const int g = t / per_group;
    const int first_m = g * group_m;
    const int gsize = min(m_tiles - first_m, group_m);
    const int r = t - g * per_group;
    mt = first_m + r % gsize;
    nt = r / gsize;
}

__device__ __forceinline__ void named_bar_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// ---- the persistent WGMMA main loop, shared by every kernel of this file ---------------------
// Z = E · Cᵀ over the tiles of [N] x [V] (V: the classes the C map holds), one tile's f32
// accumulators at a time in the consumers' registers, then `epi(d, mt, nt, cw, warp, lane)`:
// the tile's epilogue (row tile mt, column tile nt, consumer cw, its warp and lane; d the
// accumulator fragment of "Thread mapping" above). The epilogue must not use block-wide
// barriers (the consumers may be in different tiles); warp shuffles are fine (whole warps).
template <bool F16, class Epi>
__device__ __forceinline__ void gemm_tiles(const TmaDesc& tmE, const TmaDesc& tmC, int N, int V,
                                           int D, int group_m, int ordered_epi, const Epi& epi) {
    constexpr int A_BYTES = BM * BK * 2;
    constexpr int B_BYTES = BN * BK * 2;
    constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
    constexpr int NREG = BN / 2;

    extern __shared__ __align__(1024) unsigned char cce_wg_smem[];
    const u32 base = (smem_u32(cce_wg_smem) + 1023u) & ~1023u;
    const u32 bar_full = base + STAGES * STAGE_BYTES;
    const u32 bar_empty = bar_full + STAGES * 8;

    const int m_tiles = (N + BM - 1) / BM;
    const int n_tiles = (V + BN - 1) / BN;
    const int total = m_tiles * n_tiles;
    const int cid = blockIdx.x;
    const int ncl = gridDim.x;
    const int KT = D / BK;
    const int wgi = threadIdx.x / 128;
    const int tid = threadIdx.x % 128;

    if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(bar_full + 8 * s, 1);
            mbar_init(bar_empty + 8 * s, 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wgi == 0) {
        // ------------------------------ producer ------------------------------
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
        if (tid == 0) {
            tma_prefetch_desc(&tmE);
            tma_prefetch_desc(&tmC);
            int stage = 0;
            u32 phase = 0;
            for (int t = cid; t < total; t += ncl) {
                int mt, nt;
                tile_coords(t, m_tiles, n_tiles, group_m, mt, nt);
                for (int k = 0; k < KT; ++k) {
                    mbar_wait(bar_empty + 8 * stage, phase ^ 1u);
                    const u32 sa = base + stage * STAGE_BYTES;
                    const u32 fb = bar_full + 8 * stage;
                    mbar_arrive_expect_tx(fb, STAGE_BYTES);
                    tma_load_2d(sa, &tmE, fb, k * BK, mt * BM);
                    tma_load_2d(sa + A_BYTES, &tmC, fb, k * BK, nt * BN);
                    if (++stage == STAGES) {
                        stage = 0;
                        phase ^= 1u;
                    }
                }
            }
        }
    } else {
        // ------------------------------ consumers ------------------------------
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));
        const int cw = wgi - 1;
        const int warp = tid / 32;
        const int lane = tid % 32;
        float d[NREG];
#pragma unroll
        for (int i = 0; i < NREG; ++i) d[i] = 0.f;
        int stage = 0;
        u32 phase = 0;
        int it = 0;
        for (int t = cid; t < total; t += ncl, ++it) {
            int mt, nt;
            tile_coords(t, m_tiles, n_tiles, group_m, mt, nt);
            int prev = 0;
            for (int k = 0; k < KT; ++k) {
                mbar_wait(bar_full + 8 * stage, phase);
                const u32 sa = base + stage * STAGE_BYTES + cw * (64 * 128);
                const u32 sb = base + stage * STAGE_BYTES + A_BYTES;
                const u64 da = make_desc(sa);
                const u64 db = make_desc(sb);
                fence_regs<NREG>(d);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BK / 16; ++kk) {
                    // +32 B per K-step of 16 values: +2 in the descriptor's start-address field.
                    wgmma_256<F16>(d, da + 2 * kk, db + 2 * kk, (k > 0 || kk > 0) ? 1 : 0);
                }
                wgmma_commit();
                fence_regs<NREG>(d);
                if (k > 0) {
                    wgmma_wait<1>();
                    fence_regs<NREG>(d);
                    if (lane == 0) mbar_arrive(bar_empty + 8 * prev);
                }
                prev = stage;
                if (++stage == STAGES) {
                    stage = 0;
                    phase ^= 1u;
                }
            }
            wgmma_wait<0>();
            fence_regs<NREG>(d);
            if (lane == 0) mbar_arrive(bar_empty + 8 * prev);

            // Ordered epilogues (ordered_epi != 0): the two consumer warpgroups take turns.
            // Named barrier 1 passes the turn 0 -> 1, barrier 2 passes 1 -> 0; arrivals and
            // waits pair up exactly (consumer 1 skips its last hand-back).
            if (ordered_epi) {
                if (cw == 0) {
                    if (it > 0) named_bar_sync(2, 256);
                } else {
                    named_bar_sync(1, 256);
                }
            }

            epi(d, mt, nt, cw, warp, lane);

            if (ordered_epi) {
                if (cw == 0) {
                    named_bar_arrive(1, 256);
                } else if (t + ncl < total) {
                    named_bar_arrive(2, 256);
                }
            }
        }
    }
}

// The q9 code of a q = e^{z − m} ∈ [0, 1] (chunked dense's row pass with f16 G for d_c): q's
// f32 bits shifted right by 14, rounded to nearest even. q ≤ 1 has sign 0 and a biased
// exponent ≤ 127, so the code keeps f32's whole range (subnormals included) in 7 exponent
// bits and 9 significand bits (2⁻¹⁰ relative, half bf16's 2⁻⁹); 1.0 is 0xFE00. Decoded by
// `q9_value` (a shift). Inputs above 1 are clamped to 1 (ex2 of z − m ≤ 0 never exceeds it).
__device__ __forceinline__ u32 q9_code(float q) {
    const u32 u = min(__float_as_uint(fmaxf(q, 0.0f)), 0x3F800000u);
    return (u + 0x1FFFu + ((u >> 14) & 1u)) >> 14;
}
__device__ __forceinline__ float q9_value(u16 c) { return __uint_as_float(static_cast<u32>(c) << 14); }

// The accumulator fragment d (f32 values) of consumer cw as f16 into the row-major u16 matrix
// described by the tensor map tmO (dims {columns, rows}, 64 x 64 boxes, 128-byte swizzle): rows
// [row0, row0 + 64), columns [col0, col0 + 256). The consumer's 128 threads write the half
// tile into the staging buffer (box b = columns 64b.., row-major 128-byte rows, 16-byte chunk
// k of row r at chunk k ^ (r % 8): the TMA's 128-byte swizzle; a warp's 4-byte stores of one
// pair j land in 8 different chunks, so no bank conflicts), fence it to the async proxy, sync
// on named barrier 3 + cw; its thread 0 issues four TMA stores (rows ≥ the map's rows and
// columns ≥ its columns are not written) and waits until they have read the buffer before it
// arrives at the turn barrier of the ordered epilogues, so the other consumer never
// overwrites a buffer in flight. Needs ordered epilogues and OUT_OFFSET + OUT_BYTES of
// dynamic shared memory past the 1024-byte aligned base; the kernel's thread 0 of each
// consumer waits for completion before it exits (`bulk_wait_all`).
// MODE: 0 f16; 1 bf16; 2 the q9 code (`q9_code`, values in [0, 1]); same layout.
template <int MODE = 0>
__device__ __forceinline__ void store_f16_tile(const float* d, const TmaDesc* tmO, int row0,
                                               int col0, int cw, int warp, int lane) {
    extern __shared__ __align__(1024) unsigned char cce_wg_smem[];
    const u32 base = (smem_u32(cce_wg_smem) + 1023u) & ~1023u;
    const u32 out = base + OUT_OFFSET;
    const int q = lane & 3;
    const int rl = 16 * warp + (lane >> 2);  // local row of pair h = 0 (h = 1: + 8)
    const u32 sw = static_cast<u32>(lane >> 2);  // rl % 8 (16·warp and 8·h are ≡ 0 mod 8)
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        const u32 box = out + (j >> 3) * (64 * 128);
        const u32 chunk = (static_cast<u32>(j & 7) ^ sw) * 16 + 4 * q;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            u32 pk;
            if (MODE == 2) {
                pk = (q9_code(d[4 * j + 2 * h + 1]) << 16) | q9_code(d[4 * j + 2 * h]);
            } else if (MODE == 1) {
                asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n"
                    : "=r"(pk)
                    : "f"(d[4 * j + 2 * h + 1]), "f"(d[4 * j + 2 * h]));
            } else {
                asm("cvt.rn.f16x2.f32 %0, %1, %2;\n"
                    : "=r"(pk)
                    : "f"(d[4 * j + 2 * h + 1]), "f"(d[4 * j + 2 * h]));
            }
            const u32 addr = box + (rl + 8 * h) * 128 + chunk;
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(pk) : "memory");
        }
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    named_bar_sync(3 + cw, 128);
    if (warp == 0 && lane == 0) {
#pragma unroll
        for (int b = 0; b < BN / 64; ++b) tma_store_2d(tmO, out + b * (64 * 128), col0 + 64 * b, row0);
        bulk_commit();
        bulk_wait_read();
    }
    __syncwarp();  // warp 0 whole again before the caller's next aligned barrier or shuffle
}

// The forward's epilogue: each row's (max, Σexp) over the tile's columns < V, one float2 per
// (row, tile) in partial [N, n_tiles].
// EXT: first z = softcap(x + bias) (bias DT [V] or null; softcap ≤ 0: off; cap_fast).
// QS (the dense row pass, `cce_wgmma_lseq[_x][_q9]_*`): also each q = e^{z − m} (m the row's
// max over the tile, so q ∈ [0, 1] and the tile's largest is 1) as bf16 (QS 1) or its q9 code
// (QS 2: `q9_code`, 2⁻¹⁰ relative) into Q [N, ldq] (the tensor map tmQ), the very ex2 values
// Σexp adds, through `store_f16_tile<1 or 2>` (TMA stores:
// no column ≥ V, no row ≥ N); `cce_wgmma_qrows_g*` turns them into G once the lse is known.
// Precision: every q keeps bf16's 8 bits, down to f32's range, so each entry of G is within
// two bf16 roundings of cp·p (G itself is bf16). f16 q (11 bits, but subnormal below 2⁻¹⁴)
// kept d_e as close but lost the tiny entries that make a rarely seen class's d_c row in
// chunked dense (docs/perf-log.md, session 16).
template <int DT, bool EXT, int QS = 0>
struct LseEpi {
    float2* partial;
    int N, V, n_tiles;
    const void* bias;
    float softcap;
    const int* targets;
    float* zy_tile;
    const TmaDesc* tmQ = nullptr;
    __device__ __forceinline__ void operator()(float* d, int mt, int nt, int cw, int warp,
                                               int lane) const {
        const int r0 = mt * BM + 64 * cw + 16 * warp + (lane >> 2);
        const int cb = nt * BN + 2 * (lane & 3);
        constexpr float L2E = 1.4426950408889634f;
        // −inf from the GEMM means −inf in e or c: NaN (dense_common.cu gemm_logit).
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) d[i] = gemm_logit(d[i]);
        if (EXT) {
            const float k2 = softcap > 0.0f ? 2.0f * L2E / softcap : 0.0f;
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = cb + 8 * j + e;
                    const float b =
                        (bias != nullptr && col < V) ? Elem<DT>::load(bias, col) : 0.0f;
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        float x = d[4 * j + 2 * h + e] + b;
                        if (softcap > 0.0f) x = cap_fast(x, softcap, k2);
                        d[4 * j + 2 * h + e] = x;
                    }
                }
            }
        }
        if ((nt + 1) * BN > V) {  // partial column tile: mask columns >= V
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    if (cb + 8 * j + e >= V) {
                        d[4 * j + e] = NEG_INF;
                        d[4 * j + 2 + e] = NEG_INF;
                    }
                }
            }
        }
        // The row's target column leaves the tile's (max, Σexp) and q (the combine adds it from
        // z_y, qrows_g computes its G from rest = 1 − p_y): the one thread that holds it writes
        // its logit to zy_tile[r] (the combine's z_y: from the same tensor-core sum as the
        // other logits, so that lse − z_y cancels their common rounding), then sets it to −inf
        // (a divergent branch, rarely taken). Out of the max too, so that a confident row's
        // other q keep their precision (relative to the largest of them, not to the target's
        // e^{z_y − m} ≈ 1).
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = r0 + 8 * h;
            const int rel = r < N ? targets[r] - cb : -1;
            if (rel >= 0 && rel < BN && (rel & 7) < 2) {
#pragma unroll
                for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        if (8 * j + e == rel) {
                            zy_tile[r] = d[4 * j + 2 * h + e];
                            d[4 * j + 2 * h + e] = NEG_INF;
                        }
                    }
                }
            }
        }
        float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            mx0 = fmaxf(mx0, fmaxf(d[4 * j], d[4 * j + 1]));
            mx1 = fmaxf(mx1, fmaxf(d[4 * j + 2], d[4 * j + 3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, 2));
        // A tile whose every column is masked (max −inf) contributes (−inf, 0), never NaN.
        const float o0 = mx0 == NEG_INF ? 0.0f : -mx0 * L2E;
        const float o1 = mx1 == NEG_INF ? 0.0f : -mx1 * L2E;
        float s0a = 0.f, s0b = 0.f, s1a = 0.f, s1b = 0.f;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const float q00 = ex2_approx(fmaf(d[4 * j], L2E, o0));
            const float q01 = ex2_approx(fmaf(d[4 * j + 1], L2E, o0));
            const float q10 = ex2_approx(fmaf(d[4 * j + 2], L2E, o1));
            const float q11 = ex2_approx(fmaf(d[4 * j + 3], L2E, o1));
            s0a += q00;
            s0b += q01;
            s1a += q10;
            s1b += q11;
            if (QS) {
                d[4 * j] = q00;
                d[4 * j + 1] = q01;
                d[4 * j + 2] = q10;
                d[4 * j + 3] = q11;
            }
        }
        if (QS) store_f16_tile<QS == 2 ? 2 : 1>(d, tmQ, mt * BM + 64 * cw, nt * BN, cw, warp, lane);
        float s0 = s0a + s0b, s1 = s1a + s1b;
        s0 += __shfl_xor_sync(FULL_MASK, s0, 1);
        s1 += __shfl_xor_sync(FULL_MASK, s1, 1);
        s0 += __shfl_xor_sync(FULL_MASK, s0, 2);
        s1 += __shfl_xor_sync(FULL_MASK, s1, 2);
        if ((lane & 3) == 0) {
            if (r0 < N) partial[static_cast<size_t>(r0) * n_tiles + nt] = make_float2(mx0, s0);
            if (r0 + 8 < N)
                partial[static_cast<size_t>(r0 + 8) * n_tiles + nt] = make_float2(mx1, s1);
        }
    }
};

template <bool F16, bool EXT>
__device__ __forceinline__ void gemm_lse(const TmaDesc& tmE, const TmaDesc& tmC, int N, int V,
                                         int D, float2* __restrict__ partial, int group_m,
                                         int ordered_epi, const void* bias, float softcap,
                                         const int* targets, float* zy_tile) {
    const LseEpi<F16 ? 1 : 2, EXT> epi{partial, N,       V,       (V + BN - 1) / BN,
                                       bias,    softcap, targets, zy_tile};
    gemm_tiles<F16>(tmE, tmC, N, V, D, group_m, ordered_epi, epi);
}

// The class pass's epilogue (split dense, `classes.cu` "(b)" without the f32 logits): G of the
// tile's columns < K of a class chunk [k0, k0 + K), from the saved lse of each row, times
// g_scale, stored as f16 into G [N, ldg] (column j of the chunk at G[r·ldg + j]):
//   G = cp·p − cc − cy·[j = y],  p = exp(x + bias − lse)  (g_coef's coefficients, MATH.md),
// the target's entry cd − cp·rest − cc from the saved rest = 1 − p_y (g_target); exactly 0 at
// a masked class (x + bias = −inf).
// CAP (softcap > 0): z = cap_fast(x + bias) and G times 1 − tanh²(x/s) (cap_fast_grad); tanhf
// per value instead made the class pass slower than cuBLAS + the G pass (session 8 run 2). No τ
// (split dense's row pass never filters, so τ = 0).
// Per value: one add (bias), one FFMA and ex2 (p), one FFMA (cp·p − cc, g_scale folded into
// the coefficients), one select (inactive rows: exact zeros); the target's −cy by the one
// thread that holds it, in registers, before the f16 rounding (so G_y = f16(cp·p − cc − cy)).
// Thread mapping: the thread's two rows r0, r0 + 8 and its 64 columns (pairs 2·(lane % 4) +
// 8·j, j < 32); per pair one cvt.rn.f16x2 into the staging buffer, then the consumer's TMA
// stores (`store_f16_tile`: no row ≥ N, no column ≥ K reaches G).
template <int DT, bool CAP>
struct GColsEpi {
    const TmaDesc* tmG;
    int N, K, k0, V;
    const void* bias;
    float softcap;
    const int* targets;
    const float* lse;
    const float* rest;
    const float* dl_rows;
    float dl_scalar;
    const float* dlse;
    float alpha, lambda, g_scale;
    __device__ __forceinline__ void operator()(float* d, int mt, int nt, int cw, int warp,
                                               int lane) const {
        constexpr float L2E = 1.4426950408889634f;
        const float k2 = CAP ? 2.0f * L2E / softcap : 0.0f;
        const int r0 = mt * BM + 64 * cw + 16 * warp + (lane >> 2);
        const int cb = nt * BN + 2 * (lane & 3);  // chunk column of pair 0
        // Per row: cp·s, cc·s, cy·s (s = g_scale; 0 for inactive rows and rows ≥ N), −lse·log2 e,
        // and the target's offset from cb (only meaningful when `tin`).
        float cp[2], cc[2], gy[2], off[2];
        int rel[2];
        bool act[2], tin[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = r0 + 8 * h;
            cp[h] = cc[h] = gy[h] = off[h] = 0.0f;
            act[h] = tin[h] = false;
            rel[h] = -1;
            if (r < N) {
                const int y = targets[r];
                const float l = lse[r];
                const GCoef c = g_coef(y, r, dl_rows, dl_scalar, dlse, l, alpha, lambda, V);
                act[h] = c.active;
                cp[h] = c.cp * g_scale;
                cc[h] = c.cc * g_scale;
                off[h] = -l * L2E;
                if (c.active && y >= k0 && y < k0 + K) {
                    gy[h] = g_target(c, rest[r]) * g_scale;
                    rel[h] = y - k0 - cb;
                    tin[h] = rel[h] >= 0 && rel[h] < BN && (rel[h] & 7) < 2;
                }
            }
        }
        // G in place of the accumulators.
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const int col = cb + 8 * j;
            float bv[2] = {0.0f, 0.0f};
            if (bias != nullptr && col < K) {
                bv[0] = Elem<DT>::load(bias, (long long)k0 + col);
                if (col + 1 < K) bv[1] = Elem<DT>::load(bias, (long long)k0 + col + 1);
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float x = d[4 * j + 2 * h + e] + bv[e];
                    if (CAP) {
                        // z = s·tanh(x/s); G = (cp·p − cc − cy·[j = y])·(1 − tanh²(x/s)).
                        float dz;
                        const float z = cap_fast_grad(x, softcap, k2, dz);
                        const float p = ex2_approx(fmaf(z, L2E, off[h]));
                        float g = fmaf(cp[h], p, -cc[h]);
                        if (8 * j + e == rel[h]) g = gy[h];
                        d[4 * j + 2 * h + e] = act[h] && x != NEG_INF ? g * dz : 0.0f;
                    } else {
                        const float p = ex2_approx(fmaf(x, L2E, off[h]));
                        d[4 * j + 2 * h + e] =
                            act[h] && x != NEG_INF ? fmaf(cp[h], p, -cc[h]) : 0.0f;
                    }
                }
            }
        }
        // The target column: cd − cp·rest − cc by its one thread (a divergent branch, rarely
        // taken; CAP did it above, before the softcap factor).
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (!CAP && tin[h]) {
#pragma unroll
                for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        if (8 * j + e == rel[h]) d[4 * j + 2 * h + e] = gy[h];
                    }
                }
            }
        }
        // f16 pairs to G.
        store_f16_tile(d, tmG, mt * BM + 64 * cw, nt * BN, cw, warp, lane);
    }
};

// One warp per row: (max, Σexp without the target) from the row's partials (as the benchmark's
// lse_combine_kernel; a tile of masked columns is (−inf, 0) and adds 0), the target logit z_y
// from zy[r] (the lse epilogue's tile value, after bias and softcap; zy non-null) or else
// z_y = Σ_k e[r, k]·c[y, k] (f32, fixed order), then the row's forward outputs
// (write_row_outputs: lse, rest = 1 − p_y, loss; no label smoothing, no entropy / argmax).
template <int DT>
__device__ __forceinline__ void lse_combine(const float2* __restrict__ partial, int N, int n_tiles,
                                            const u16* __restrict__ e, const u16* __restrict__ c,
                                            int D, const int* __restrict__ targets, float lambda,
                                            int V, float* lse_out,
                                            float* __restrict__ rest_out,
                                            float* __restrict__ loss_out, const void* bias,
                                            float softcap, const float* zy_in) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= N) return;
    const float2* p = partial + static_cast<size_t>(row) * n_tiles;
    float M = NEG_INF;
    for (int j = lane; j < n_tiles; j += 32) M = fmaxf(M, p[j].x);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(FULL_MASK, M, o));
    float s = 0.f;
    for (int j = lane; j < n_tiles; j += 32) {
        const float2 q = p[j];
        s += q.x == NEG_INF ? 0.0f : q.y * __expf(q.x - M);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(FULL_MASK, s, o);
    const int y = targets[row];
    float zy = 0.0f;
    if (y >= 0 && zy_in != nullptr) {
        zy = zy_in[row];
    } else if (y >= 0) {  // warp-uniform
        // D is even (a multiple of 64), so each row is a whole number of 4-byte pairs.
        const u32* er = reinterpret_cast<const u32*>(e + static_cast<size_t>(row) * D);
        const u32* cr = reinterpret_cast<const u32*>(c + static_cast<size_t>(y) * D);
        float acc = 0.0f;
        for (int k = lane; k < D / 2; k += 32) {
            const u32 a = er[k], b = cr[k];
            const float a0 = DT == 1 ? f16_to_f32((u16)(a & 0xffff)) : bf16_to_f32((u16)(a & 0xffff));
            const float a1 = DT == 1 ? f16_to_f32((u16)(a >> 16)) : bf16_to_f32((u16)(a >> 16));
            const float b0 = DT == 1 ? f16_to_f32((u16)(b & 0xffff)) : bf16_to_f32((u16)(b & 0xffff));
            const float b1 = DT == 1 ? f16_to_f32((u16)(b >> 16)) : bf16_to_f32((u16)(b >> 16));
            acc = fmaf(a0, b0, acc);
            acc = fmaf(a1, b1, acc);
        }
        zy = warp_sum(acc);
        // z_y = softcap(x_y + bias_y) by cap_z (the row kernels' definition).
        if (bias != nullptr) zy += Elem<DT>::load(bias, y);
        zy = cap_z(zy, softcap, softcap > 0.0f ? 1.0f / softcap : 0.0f);
    }
    if (lane == 0) {
        write_row_outputs(row, y, M, s, zy, 0.0f, 0.0f, 0x7fffffff, 0.0f, lambda, V, lse_out,
                          rest_out, loss_out, nullptr, nullptr);
    }
}

}  // namespace cce_wg

#define WG_LSE_PARAMS                                                                            \
    const __grid_constant__ cce_wg::TmaDesc tmE, const __grid_constant__ cce_wg::TmaDesc tmC,     \
        int N, int V, int D, float2 *partial, int group_m, int ordered_epi, const void *bias,     \
        float softcap, const int *targets, float *zy_tile
#define WG_COMBINE_PARAMS                                                                        \
    const float2 *partial, int N, int n_tiles, const u16 *e, const u16 *c, int D,                 \
        const int *targets, float lambda, int V, float *lse_out, float *rest_out,                \
        float *loss_out, const void *bias, float softcap, const float *zy_in

// cce_wgmma_lse_*: no bias, no softcap (bias / softcap ignored); cce_wgmma_lse_x_*: either.
extern "C" __global__ void __launch_bounds__(cce_wg::NUM_THREADS, 1) cce_wgmma_lse_bf16(WG_LSE_PARAMS) {
    cce_wg::gemm_lse<false, false>(tmE, tmC, N, V, D, partial, group_m, ordered_epi, bias, softcap,
                              targets, zy_tile);
}
extern "C" __global__ void __launch_bounds__(cce_wg::NUM_THREADS, 1) cce_wgmma_lse_f16(WG_LSE_PARAMS) {
    cce_wg::gemm_lse<true, false>(tmE, tmC, N, V, D, partial, group_m, ordered_epi, bias, softcap,
                              targets, zy_tile);
}
extern "C" __global__ void __launch_bounds__(cce_wg::NUM_THREADS, 1) cce_wgmma_lse_x_bf16(WG_LSE_PARAMS) {
    cce_wg::gemm_lse<false, true>(tmE, tmC, N, V, D, partial, group_m, ordered_epi, bias, softcap,
                              targets, zy_tile);
}
extern "C" __global__ void __launch_bounds__(cce_wg::NUM_THREADS, 1) cce_wgmma_lse_x_f16(WG_LSE_PARAMS) {
    cce_wg::gemm_lse<true, true>(tmE, tmC, N, V, D, partial, group_m, ordered_epi, bias, softcap,
                              targets, zy_tile);
}
extern "C" __global__ void __launch_bounds__(256) cce_wgmma_lse_combine_bf16(WG_COMBINE_PARAMS) {
    cce_wg::lse_combine<2>(partial, N, n_tiles, e, c, D, targets, lambda, V, lse_out, rest_out, loss_out,
                           bias, softcap, zy_in);
}
extern "C" __global__ void __launch_bounds__(256) cce_wgmma_lse_combine_f16(WG_COMBINE_PARAMS) {
    cce_wg::lse_combine<1>(partial, N, n_tiles, e, c, D, targets, lambda, V, lse_out, rest_out, loss_out,
                           bias, softcap, zy_in);
}

#define WG_GCOLS_PARAMS                                                                          \
    const __grid_constant__ cce_wg::TmaDesc tmE, const __grid_constant__ cce_wg::TmaDesc tmC,     \
        int N, int K, int D, int k0, int V, const __grid_constant__ cce_wg::TmaDesc tmG,         \
        const void *bias,                                                                         \
        float softcap, const int *targets, const float *lse, const float *rest,                  \
        const float *dl_rows,                                                                     \
        float dl_scalar, const float *dlse, float alpha, float lambda, const float *g_scale,     \
        int group_m, int ordered_epi
#define WG_GCOLS_BODY(DT, F16, CAP)                                                              \
    const float g_scale_v = g_scale ? *g_scale : 1.0f;                                          \
    const cce_wg::GColsEpi<DT, CAP> epi{&tmG,    N,       K,       k0,  V,       bias,          \
                                        softcap, targets, lse,     rest,    dl_rows, dl_scalar, \
                                        dlse,                                                 \
                                        alpha,   lambda,  g_scale_v};                           \
    (void)ordered_epi; /* the TMA-store epilogue needs ordered epilogues */                    \
    cce_wg::gemm_tiles<F16>(tmE, tmC, N, K, D, group_m, 1, epi);                                \
    if (threadIdx.x >= 128 && threadIdx.x % 128 == 0) cce_wg::bulk_wait_all()
// cce_wgmma_gcols_*: softcap off (ignored); cce_wgmma_gcols_cap_*: softcap > 0.
extern "C" __global__ void __launch_bounds__(cce_wg::NUM_THREADS, 1) cce_wgmma_gcols_bf16(WG_GCOLS_PARAMS) {
    WG_GCOLS_BODY(2, false, false);
}
extern "C" __global__ void __launch_bounds__(cce_wg::NUM_THREADS, 1) cce_wgmma_gcols_f16(WG_GCOLS_PARAMS) {
    WG_GCOLS_BODY(1, true, false);
}
extern "C" __global__ void __launch_bounds__(cce_wg::NUM_THREADS, 1) cce_wgmma_gcols_cap_bf16(WG_GCOLS_PARAMS) {
    WG_GCOLS_BODY(2, false, true);
}
extern "C" __global__ void __launch_bounds__(cce_wg::NUM_THREADS, 1) cce_wgmma_gcols_cap_f16(WG_GCOLS_PARAMS) {
    WG_GCOLS_BODY(1, true, true);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
