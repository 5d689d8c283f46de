// staircase.cu: the device steps of the staircase backward (docs/perf-log.md, session 23;
// cce-core tile_budget.rs): the batch's class order by mean logit, each row's kept prefix of
// 256-class tiles from the forward's per-(row, tile) partials, the rows sorted by kept count,
// and the gathers and scatters that let every product of the backward be a dense GEMM over the
// first n_c sorted rows of a gathered class chunk. Appended to the dense module (uses
// dense_common.cu's u16 / u32 / u64, Elem<DT>, NEG_INF, FULL_MASK).
//
// Parameters
//   e, c          DT [N, D] / [V, D] row-major (DT 0 f32, 1 f16, 2 bf16: the symbol's suffix).
//   targets       i32 [N], the class or −1 (ignored).
//   part, cnt     (col_sums) f64 [blocks, 2, D] column sums of the block's valid rows and of
//                 all its rows; i32 [blocks] its valid rows. rows_per_block rows per block.
//   mean          f32 [D]: the mean of the valid rows of e (of all rows when none is valid).
//   bias          DT [V] or 0.
//   keys          u64 [n_pow2]: sort keys, ascending order = visiting order; the low 32 bits
//                 are the id (class or row); padding entries are ~0.
//   partial       float2 [N, ld_tiles]: per (row, 256-class tile of the visiting order) the
//                 tile's largest logit m and Σ exp(z − m) over its classes other than the row's
//                 target (cce_wgmma_lse_*'s partials, wgmma.cu); lse f32 [N].
//   ytile         i32 [N]: the visiting-order tile holding the row's target, or −1.
//   dl_rows, dl_scalar, dlse   the upstream gradients (dl_rows f32 [N] or 0, then dl_scalar
//                 for every row with a target; dlse f32 [N] or 0): a row with neither keeps
//                 nothing.
//   eps, delta    filter_eps and max_dropped_mass (cce-core FilterRule).
//   kept, dropped u32 [N] tiles kept (a prefix of the visiting order, rounded up to
//                 `granule` tiles), f32 [N] the Σ g0 of the dropped suffix (≤ delta).
//   idx           u32 [rows]: row k of a gather's output is row idx[k] of its input; row k of
//                 a scatter's input goes to row idx[k] of its output.
//
// Tiling
//   col_sums: rows_per_block rows per block, 256 threads over the columns (a row's columns
//   coalesced), f64 sums in row order. class_keys: one warp per class, its D products in lane
//   order then a fixed shuffle tree, in f64. Bitonic sort: 2048 keys per block in shared memory
//   for every step whose partner distance is below 2048, one global step per launch above.
//   kept_rows: one warp per row, 32 tiles per step from the end of the order. Gathers and
//   scatters: one block per row, 16-byte vectors where D allows.
//
// Thread mapping
//   Sorts: thread t of a block owns the compare-exchange pair t of its 2048 keys (1024
//   threads). kept_rows: lane l of the warp takes tile base − 1 − l; the suffix sums are an
//   inclusive shuffle scan in f64; the suffix stops at the first lane whose tile holds an entry
//   ≥ eps (or the target) or whose sum passes delta (ballots). Everything is deterministic:
//   fixed reduction orders, unique sort keys.

#define STAIR_SORT_BLOCK 2048
#define STAIR_TILE 256

// Per block: f64 column sums of its rows of e, over the valid rows and over all rows, and
// the count of its valid rows.
template <int DT>
__device__ __forceinline__ void stair_col_sums(const void* e, int n, int d, const int* targets,
                                               int rows_per_block, double* part, int* cnt) {
    const int r0 = blockIdx.x * rows_per_block;
    const int r1 = min(n, r0 + rows_per_block);
    for (int k = threadIdx.x; k < d; k += blockDim.x) {
        double sv = 0.0, sa = 0.0;
        for (int r = r0; r < r1; ++r) {
            const double x = (double)Elem<DT>::load(e, (long long)r * d + k);
            sa += x;
            if (targets[r] >= 0) sv += x;
        }
        part[((long long)blockIdx.x * 2) * d + k] = sv;
        part[((long long)blockIdx.x * 2 + 1) * d + k] = sa;
    }
    if (threadIdx.x == 0) {
        int c = 0;
        for (int r = r0; r < r1; ++r) c += targets[r] >= 0;
        cnt[blockIdx.x] = c;
    }
}

#define STAIR_COLS_PARAMS                                                                      \
    const void *e, int n, int d, const int *targets, int rows_per_block, double *part, int *cnt
extern "C" __global__ void __launch_bounds__(256) cce_stair_col_sums_f32(STAIR_COLS_PARAMS) {
    stair_col_sums<0>(e, n, d, targets, rows_per_block, part, cnt);
}
extern "C" __global__ void __launch_bounds__(256) cce_stair_col_sums_f16(STAIR_COLS_PARAMS) {
    stair_col_sums<1>(e, n, d, targets, rows_per_block, part, cnt);
}
extern "C" __global__ void __launch_bounds__(256) cce_stair_col_sums_bf16(STAIR_COLS_PARAMS) {
    stair_col_sums<2>(e, n, d, targets, rows_per_block, part, cnt);
}

// mean[k] = Σ_blocks part / Σ_blocks cnt over the valid rows (all n rows when none is
// valid), the blocks in order.
extern "C" __global__ void __launch_bounds__(256) cce_stair_mean(const double* part,
                                                                 const int* cnt, int blocks,
                                                                 int n, int d, float* mean) {
    long long valid = 0;
    for (int b = 0; b < blocks; ++b) valid += cnt[b];
    const int which = valid > 0 ? 0 : 1;
    const double inv = 1.0 / (double)(valid > 0 ? valid : (n > 0 ? n : 1));
    for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < d; k += gridDim.x * blockDim.x) {
        double s = 0.0;
        for (int b = 0; b < blocks; ++b) s += part[((long long)b * 2 + which) * d + k];
        mean[k] = (float)(s * inv);
    }
}

// The ascending-order code of a score: NaN as −inf (cce-core VocabOrder::by_score), then the
// IEEE bits mapped so that unsigned order is numeric order.
__device__ __forceinline__ u32 stair_ordered(float x) {
    if (x != x) x = NEG_INF;
    const u32 u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// keys[j] = (descending score code << 32) | j with score = mean · c_j + bias_j (f64 sums),
// so that ascending keys visit the classes by descending batch-mean logit, ties by id;
// keys[v .. n_pow2) = ~0.
template <int DT>
__device__ __forceinline__ void stair_class_keys(const void* c, int v, int d, const float* mean,
                                                 const void* bias, int n_pow2, u64* keys) {
    const int lane = threadIdx.x & 31;
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long j = warp; j < n_pow2; j += warps) {
        if (j >= v) {
            if (lane == 0) keys[j] = ~0ull;
            continue;
        }
        double s = 0.0;
        for (int k = lane; k < d; k += 32) {
            s += (double)Elem<DT>::load(c, j * d + k) * (double)mean[k];
        }
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(FULL_MASK, s, o);
        if (lane == 0) {
            if (bias) s += (double)Elem<DT>::load(bias, j);
            const u32 desc = ~stair_ordered((float)s);
            keys[j] = ((u64)desc << 32) | (u64)j;
        }
    }
}

#define STAIR_KEYS_PARAMS                                                                      \
    const void *c, int v, int d, const float *mean, const void *bias, int n_pow2, u64 *keys
extern "C" __global__ void __launch_bounds__(256) cce_stair_class_keys_f32(STAIR_KEYS_PARAMS) {
    stair_class_keys<0>(c, v, d, mean, bias, n_pow2, keys);
}
extern "C" __global__ void __launch_bounds__(256) cce_stair_class_keys_f16(STAIR_KEYS_PARAMS) {
    stair_class_keys<1>(c, v, d, mean, bias, n_pow2, keys);
}
extern "C" __global__ void __launch_bounds__(256) cce_stair_class_keys_bf16(STAIR_KEYS_PARAMS) {
    stair_class_keys<2>(c, v, d, mean, bias, n_pow2, keys);
}

// keys[i] = ((n_tiles − kept[i]) << 32) | i, so that ascending keys visit the rows by
// descending kept count, ties by row id; keys[n .. n_pow2) = ~0.
extern "C" __global__ void __launch_bounds__(256) cce_stair_row_keys(const u32* kept, int n,
                                                                     int n_tiles, int n_pow2,
                                                                     u64* keys) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n_pow2;
         i += (long long)gridDim.x * blockDim.x) {
        keys[i] = i < n ? (((u64)(u32)(n_tiles - (int)kept[i]) << 32) | (u64)i) : ~0ull;
    }
}

// One compare-exchange of the bitonic network: the pair (i, i + j) of the merge of size k,
// ascending where (i & k) == 0.
__device__ __forceinline__ void stair_cmp_swap(u64& a, u64& b, bool ascending) {
    if ((a > b) == ascending) {
        const u64 t = a;
        a = b;
        b = t;
    }
}

// Every step (k, j) with j < 2048 of the bitonic network on the block's 2048 keys, for
// k from k_first to k_last (powers of two; k_first = 2 sorts the block's keys from scratch,
// k_first = k_last > 2048 finishes the merge of size k after its global steps).
extern "C" __global__ void __launch_bounds__(1024) cce_stair_bitonic_local(u64* keys,
                                                                            long long k_first,
                                                                            long long k_last) {
    __shared__ u64 sh[STAIR_SORT_BLOCK];
    const long long base = (long long)blockIdx.x * STAIR_SORT_BLOCK;
    const int t = threadIdx.x;
    sh[t] = keys[base + t];
    sh[t + 1024] = keys[base + t + 1024];
    __syncthreads();
    for (long long k = k_first; k <= k_last; k <<= 1) {
        for (long long j = (k > STAIR_SORT_BLOCK ? STAIR_SORT_BLOCK : k) >> 1; j > 0; j >>= 1) {
            const int i = (int)(2 * j * (t / j) + (t % j));
            const bool ascending = ((base + i) & k) == 0;
            stair_cmp_swap(sh[i], sh[i + j], ascending);
            __syncthreads();
        }
    }
    keys[base + t] = sh[t];
    keys[base + t + 1024] = sh[t + 1024];
}

// One global step (k, j), j ≥ 2048, of the bitonic network over n_pow2 keys: the pairs p
// grid-strided over the threads.
extern "C" __global__ void __launch_bounds__(256) cce_stair_bitonic_step(u64* keys,
                                                                          long long n_pow2,
                                                                          long long k,
                                                                          long long j) {
    for (long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x; p < n_pow2 / 2;
         p += (long long)gridDim.x * blockDim.x) {
        const long long i = 2 * j * (p / j) + (p % j);
        u64 a = keys[i], b = keys[i + j];
        stair_cmp_swap(a, b, (i & k) == 0);
        keys[i] = a;
        keys[i + j] = b;
    }
}

// perm[k] = the id of sorted key k (k < n); inv[perm[k]] = k when inv is not 0.
extern "C" __global__ void __launch_bounds__(256) cce_stair_perm(const u64* keys, int n,
                                                                 u32* perm, u32* inv) {
    for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < n; k += gridDim.x * blockDim.x) {
        const u32 id = (u32)(keys[k] & 0xffffffffull);
        perm[k] = id;
        if (inv) inv[id] = (u32)k;
    }
}

// Each row's kept tiles and dropped mass (cce-core TileMasses::kept_prefix): the longest
// suffix of tiles, from the end of the visiting order, whose every class has p < eps (the
// tile's largest p is e^{m − lse}), that does not hold the row's target, and whose masses
// Σexp·e^{m − lse} sum to at most delta; then the kept count rounded up to a multiple of
// `granule` tiles (the backward's class chunk: what it computes) and the dropped mass summed
// again past it. kept_entries (when not 0): the classes kept, min(kept·256, V), or
// INACTIVE_ROW for a row without a gradient (cce_dense_stats' input). One warp per row.
__device__ __forceinline__ double stair_tile_mass(const float2* row, int t, float l) {
    const float2 pm = row[t];
    return pm.x == NEG_INF ? 0.0 : (double)pm.y * (double)__expf(pm.x - l);
}

extern "C" __global__ void __launch_bounds__(256) cce_stair_kept_rows(
    const float2* partial, long long ld_tiles, int n, int n_tiles, int v, const float* lse,
    const int* ytile, const float* dl_rows, float dl_scalar, const float* dlse, float eps,
    float delta, int granule, u32* kept, float* dropped, u32* kept_entries) {
    const int lane = threadIdx.x & 31;
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long r = warp; r < n; r += warps) {
        const int yt = ytile[r];
        const float g = yt >= 0 ? (dl_rows ? dl_rows[r] : dl_scalar) : 0.0f;
        const float h = dlse ? dlse[r] : 0.0f;
        if (g == 0.0f && h == 0.0f) {
            if (lane == 0) {
                kept[r] = 0;
                dropped[r] = 0.0f;
                if (kept_entries) kept_entries[r] = INACTIVE_ROW;
            }
            continue;
        }
        const float l = lse[r];
        const float2* row = partial + r * ld_tiles;
        int base = n_tiles;
        double acc = 0.0;
        while (base > 0) {
            const int group = base < 32 ? base : 32;
            const int t = base - 1 - lane;
            bool ok = false;
            double m = 0.0;
            if (lane < group) {
                const float2 pm = row[t];
                const float pmax = pm.x == NEG_INF ? 0.0f : __expf(pm.x - l);
                ok = t != yt && pmax < eps;
                m = stair_tile_mass(row, t, l);
            }
            // Inclusive suffix sums in lane order (tiles from the end).
            double s = m;
            for (int o = 1; o < 32; o <<= 1) {
                const double up = __shfl_up_sync(FULL_MASK, s, o);
                if (lane >= o) s += up;
            }
            const u32 bad = __ballot_sync(FULL_MASK, lane < group && !ok);
            const int first_bad = bad ? __ffs(bad) - 1 : group;
            const u32 fits =
                __ballot_sync(FULL_MASK, lane < first_bad && acc + s <= (double)delta);
            const int cnt = __popc(fits);
            const double last = __shfl_sync(FULL_MASK, s, cnt > 0 ? cnt - 1 : 0);
            if (cnt > 0) acc += last;
            base -= cnt;
            if (cnt < group) break;
        }
        const int g_len = granule > 1 ? granule : 1;
        int rounded = (base + g_len - 1) / g_len * g_len;
        if (rounded > n_tiles) rounded = n_tiles;
        if (rounded != base) {
            // What the chunk's rounding still drops: the tiles past it, strided over the
            // lanes, then a fixed shuffle tree.
            double part = 0.0;
            for (int t = rounded + lane; t < n_tiles; t += 32) part += stair_tile_mass(row, t, l);
            for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(FULL_MASK, part, o);
            acc = part;
        }
        if (lane == 0) {
            kept[r] = (u32)rounded;
            dropped[r] = (float)acc;
            if (kept_entries) {
                const long long e = (long long)rounded * STAIR_TILE;
                kept_entries[r] = (u32)(e < v ? e : v);
            }
        }
    }
}

// counts[c] = the sorted rows that keep tile c·step, the first tile of class chunk c
// (kept_sorted descending: a partition point, by bisection). One thread per chunk.
extern "C" __global__ void __launch_bounds__(256) cce_stair_chunk_rows(const u32* kept_sorted,
                                                                       int n, int step,
                                                                       int chunks, u32* counts) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= chunks) return;
    const u32 t = (u32)c * (u32)step;
    int lo = 0, hi = n;  // first sorted row with kept <= t
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (kept_sorted[mid] > t) lo = mid + 1; else hi = mid;
    }
    counts[c] = (u32)lo;
}

// Columns [t0, t0 + k_tiles) of dst (float2 [n, ld]) = src (float2 [n, k_tiles]): a class
// chunk's partials placed among all the tiles. Grid-stride over the n·k_tiles entries.
extern "C" __global__ void __launch_bounds__(256) cce_stair_place_tiles(const float2* src, int n,
                                                                        int k_tiles,
                                                                        float2* dst,
                                                                        long long ld, int t0) {
    const long long total = (long long)n * k_tiles;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / k_tiles;
        dst[r * ld + t0 + (i - r * k_tiles)] = src[i];
    }
}

// dst[k] = src[idx[k]] for 16-bit values (the bias in the class order).
extern "C" __global__ void __launch_bounds__(256) cce_stair_gather_u16(const u16* src,
                                                                       const u32* idx, int n,
                                                                       u16* dst) {
    for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < n; k += gridDim.x * blockDim.x) {
        dst[k] = src[idx[k]];
    }
}

// dst[k] = src[idx[k]] for 32-bit words (f32 or i32 per-row arrays, kept counts).
extern "C" __global__ void __launch_bounds__(256) cce_stair_gather_u32(const u32* src,
                                                                       const u32* idx, int n,
                                                                       u32* dst) {
    for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < n; k += gridDim.x * blockDim.x) {
        dst[k] = src[idx[k]];
    }
}

// The rows' targets in the visiting orders: pos = class_inv[targets[row_perm[k]]] (row_perm
// 0: the rows in their own order), out[k] = pos − offset where that lies in [0, limit) (a
// class chunk's own columns), else −1; and the tile holding pos (pos / 256, or −1) when ytile
// is not 0.
extern "C" __global__ void __launch_bounds__(256) cce_stair_map_targets(
    const int* targets, const u32* row_perm, const u32* class_inv, int n, int offset, int limit,
    int* out, int* ytile) {
    for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < n; k += gridDim.x * blockDim.x) {
        const int y = targets[row_perm ? row_perm[k] : (u32)k];
        const int pos = y >= 0 ? (int)class_inv[y] : -1;
        const int rel = pos - offset;
        if (out) out[k] = pos >= 0 && rel >= 0 && rel < limit ? rel : -1;
        if (ytile) ytile[k] = pos >= 0 ? pos / STAIR_TILE : -1;
    }
}

// Row k of dst (16-bit, [rows, d], row stride d) = row idx[k] of src (row stride d). One
// block per row; 16-byte vectors when d % 8 == 0 (the caller's bases 16-byte aligned).
extern "C" __global__ void __launch_bounds__(128) cce_stair_gather_rows16(const u16* src,
                                                                          const u32* idx,
                                                                          int rows, int d,
                                                                          u16* dst) {
    const long long k = blockIdx.x;
    if (k >= rows) return;
    const u16* s = src + (long long)idx[k] * d;
    u16* o = dst + k * d;
    if ((d & 7) == 0) {
        for (int q = threadIdx.x; q < d / 8; q += blockDim.x) {
            ((uint4*)o)[q] = ((const uint4*)s)[q];
        }
    } else {
        for (int q = threadIdx.x; q < d; q += blockDim.x) o[q] = s[q];
    }
}

// Row idx[k] of dst (DT, [*, d]) = row k of src (f32 [rows, d]), converted; with accumulate
// (f32 dst only) added to it. One block per row.
template <int DT>
__device__ __forceinline__ void stair_scatter_rows(const float* src, const u32* idx, int rows,
                                                   int d, void* dst, int accumulate) {
    const long long k = blockIdx.x;
    if (k >= rows) return;
    const long long to = (long long)idx[k] * d;
    for (int q = threadIdx.x; q < d; q += blockDim.x) {
        float x = src[k * d + q];
        if (DT == 0 && accumulate) x += ((const float*)dst)[to + q];
        Elem<DT>::store(dst, to + q, x);
    }
}

#define STAIR_SCATTER_PARAMS                                                                   \
    const float *src, const u32 *idx, int rows, int d, void *dst, int accumulate
extern "C" __global__ void __launch_bounds__(128) cce_stair_scatter_rows_f32(
    STAIR_SCATTER_PARAMS) {
    stair_scatter_rows<0>(src, idx, rows, d, dst, accumulate);
}
extern "C" __global__ void __launch_bounds__(128) cce_stair_scatter_rows_f16(
    STAIR_SCATTER_PARAMS) {
    stair_scatter_rows<1>(src, idx, rows, d, dst, accumulate);
}
extern "C" __global__ void __launch_bounds__(128) cce_stair_scatter_rows_bf16(
    STAIR_SCATTER_PARAMS) {
    stair_scatter_rows<2>(src, idx, rows, d, dst, accumulate);
}
