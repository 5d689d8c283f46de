// sparse.cu: the sparse backward's row pass: the select kernels (τ_i, kept entries as
// records). Concatenated after dense_util.cu (src/dense/mod.rs `KERNEL_SOURCE`); the gathers
// and the regrouping by class follow in sparse_gather.cu.
//
// Parameters: L f32 [rows, ld] logits of a row chunk; the per-row arrays chunk-relative; the
//   records grow down from recs_end; details at cce_sparse_select_* below.
// Tiling: one block per row (SEL_THREADS, or 256 threads for the _t256 variant).
// Thread mapping: as cce_dense_bwd (float4 columns per thread per step).

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

