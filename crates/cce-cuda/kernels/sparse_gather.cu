// sparse_gather.cu: the sparse backward's products: d_e rows by gathering rows of c, the
// records regrouped by class, d_c (and d_bias) by gathering rows of e. Concatenated after
// sparse.cu (its #defines and records; src/dense/mod.rs `KERNEL_SOURCE`).
//
// Parameters: row offsets / counts u32 [N], the records (class | G bits << 32), src DT [*, D],
//   out in the gradient dtype; details at each kernel.
// Tiling: blocks over (output rows, column slices of 32·VEC columns); count / scatter one block
//   per row; the scan in SCAN_TILE-class tiles.
// Thread mapping: lane l owns VEC consecutive columns of its slice; see each kernel.

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
