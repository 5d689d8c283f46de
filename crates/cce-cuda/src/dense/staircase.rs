//! The device steps of the staircase backward (`kernels/staircase.cu`; docs/perf-log.md,
//! session 23): the order a filtered backward visits the classes (by batch-mean logit,
//! [`cce_core::vocab_order`]) and the rows (by descending count of kept 256-class tiles,
//! [`cce_core::tile_budget`]), each row's kept tiles from the forward's per-(row, tile)
//! partials, the per-chunk counts of rows that keep a class chunk, and the gathers and
//! scatters between the caller's layout and the visiting orders.
//!
//! With the rows sorted by kept count, a chunk of classes in the visiting order is needed by a
//! prefix of the sorted rows, so every product of the backward is a dense GEMM over the first
//! `n_c` rows of a gathered chunk: the kept share of the work without a block-sparse kernel.
//! The pure decisions ([`sort_len`], [`bitonic_steps`], [`kept_by_warp_groups`],
//! [`chunk_rows`]) are here beside their launches and tested on the CPU; the steps
//! themselves are checked against these and against `cce-core` on the device
//! (`tests/staircase.rs`). Not yet wired into a call's schedule.
//!
//! Every buffer is raw bytes on the engine's device; the methods check each one's length
//! before launching and return `ShapeMismatch` (or `ResourceLimit` past 32-bit sizes).

use super::exec::need;
use super::*;

/// Classes per tile of the visiting order: the WGMMA forward's partials are per 256 classes.
pub const STAIR_TILE: usize = 256;

/// Keys per block of the bitonic sort's shared-memory steps (`cce_stair_bitonic_local`).
pub const SORT_BLOCK: usize = 2048;

/// Rows per block of `cce_stair_col_sums_*`.
const COL_SUM_ROWS: usize = 64;

/// The sort length for `n` keys: the next power of two, at least [`SORT_BLOCK`].
pub fn sort_len(n: usize) -> usize {
    n.next_power_of_two().max(SORT_BLOCK)
}

/// One launch of the bitonic sort over [`sort_len`] keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SortStep {
    /// `cce_stair_bitonic_local`: every step of partner distance below [`SORT_BLOCK`] of the
    /// merges of sizes `k_first..=k_last`.
    Local {
        /// The first merge size (2: sort each block from scratch).
        k_first: usize,
        /// The last merge size.
        k_last: usize,
    },
    /// `cce_stair_bitonic_step`: one step of partner distance `j ≥` [`SORT_BLOCK`].
    Global {
        /// The merge size.
        k: usize,
        /// The partner distance.
        j: usize,
    },
}

/// The launches that sort `len` keys ascending (`len` a power of two ≥ [`SORT_BLOCK`]): each
/// block's keys from scratch, then per merge size `k` above the block its global steps and the
/// local finish.
pub fn bitonic_steps(len: usize) -> Vec<SortStep> {
    let mut steps = vec![SortStep::Local {
        k_first: 2,
        k_last: SORT_BLOCK.min(len),
    }];
    let mut k = SORT_BLOCK * 2;
    while k <= len {
        let mut j = k / 2;
        while j >= SORT_BLOCK {
            steps.push(SortStep::Global { k, j });
            j /= 2;
        }
        steps.push(SortStep::Local {
            k_first: k,
            k_last: k,
        });
        k *= 2;
    }
    steps
}

/// The host twin of one row of `cce_stair_kept_rows` (the same groups of 32 tiles from the end,
/// suffix sums in lane order, the same stops, then the kept count rounded up to a multiple of
/// `granule` and the mass past it summed again): `(kept, dropped)` from the row's tile masses,
/// largest `p` per tile and target tile (`None`: no target). With `granule` 1, equal to
/// [`cce_core::tile_budget::TileMasses::kept_prefix`] up to the order of the f64 sums.
pub fn kept_by_warp_groups(
    mass: &[f64],
    pmax: &[f32],
    target_tile: Option<usize>,
    (eps, delta): (f32, f64),
    granule: usize,
) -> (usize, f64) {
    let tiles = mass.len();
    let mut base = tiles;
    let mut acc = 0.0f64;
    while base > 0 {
        let group = base.min(32);
        let order: Vec<usize> = (0..group).map(|l| base - 1 - l).collect();
        let ok = |t: usize| Some(t) != target_tile && pmax[t] < eps;
        let first_bad = order.iter().position(|&t| !ok(t)).unwrap_or(group);
        let mut s = 0.0f64;
        let mut cnt = 0;
        let mut last = 0.0f64;
        for (lane, &t) in order.iter().enumerate() {
            s += mass[t];
            if lane < first_bad && acc + s <= delta {
                cnt += 1;
                last = s;
            }
        }
        if cnt > 0 {
            acc += last;
        }
        base -= cnt;
        if cnt < group {
            break;
        }
    }
    let rounded = base.div_ceil(granule.max(1)) * granule.max(1);
    let rounded = rounded.min(tiles);
    if rounded != base {
        acc = mass[rounded..].iter().sum();
    }
    (rounded, acc)
}

/// How many of the rows, sorted by descending `kept` tiles, keep class chunk `c` of `step`
/// tiles (its first tile `c·step`): the host twin of `cce_stair_chunk_rows`.
pub fn chunk_rows(kept_sorted: &[u32], step: usize, chunks: usize) -> Vec<usize> {
    (0..chunks)
        .map(|c| kept_sorted.partition_point(|&k| k as usize > c * step))
        .collect()
}

/// Bytes of the scratch of [`DenseEngine::stair_mean_rows`] for `n` rows of `d`.
pub fn mean_scratch_bytes(n: usize, d: usize) -> usize {
    let blocks = n.div_ceil(COL_SUM_ROWS).max(1);
    blocks * 2 * d * 8 + blocks * 4
}

/// One grid-stride launch: `threads` per block, enough blocks for `work` items (at most
/// 132 x 32 blocks).
fn strided(work: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            work.div_ceil(threads as usize).clamp(1, 132 * 32) as u32,
            1,
            1,
        ),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per row.
fn per_row(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.max(1) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

kernel_params! {
    /// `STAIR_COLS_PARAMS` of `cce_stair_col_sums_*`.
    ColSumsParams { e: u64, n: i32, d: i32, targets: u64, rows_per_block: i32, part: u64, cnt: u64 }
}

kernel_params! {
    /// The parameters of `cce_stair_mean`.
    MeanParams { part: u64, cnt: u64, blocks: i32, n: i32, d: i32, mean: u64 }
}

kernel_params! {
    /// `STAIR_KEYS_PARAMS` of `cce_stair_class_keys_*`.
    ClassKeysParams { c: u64, v: i32, d: i32, mean: u64, bias: u64, n_pow2: i32, keys: u64 }
}

kernel_params! {
    /// The parameters of `cce_stair_row_keys`.
    RowKeysParams { kept: u64, n: i32, n_tiles: i32, n_pow2: i32, keys: u64 }
}

kernel_params! {
    /// The parameters of `cce_stair_bitonic_local`.
    LocalSortParams { keys: u64, k_first: i64, k_last: i64 }
}

kernel_params! {
    /// The parameters of `cce_stair_bitonic_step`.
    GlobalSortParams { keys: u64, n_pow2: i64, k: i64, j: i64 }
}

kernel_params! {
    /// The parameters of `cce_stair_perm`.
    PermParams { keys: u64, n: i32, perm: u64, inv: u64 }
}

kernel_params! {
    /// The parameters of `cce_stair_kept_rows`.
    KeptRowsParams {
        partial: u64,
        ld_tiles: i64,
        n: i32,
        n_tiles: i32,
        v: i32,
        lse: u64,
        ytile: u64,
        dl_rows: u64,
        dl_scalar: f32,
        dlse: u64,
        eps: f32,
        delta: f32,
        granule: i32,
        kept: u64,
        dropped: u64,
        kept_entries: u64,
    }
}

kernel_params! {
    /// The parameters of `cce_stair_chunk_rows`.
    ChunkRowsParams { kept_sorted: u64, n: i32, step: i32, chunks: i32, counts: u64 }
}

kernel_params! {
    /// The parameters of `cce_stair_gather_u32`.
    GatherU32Params { src: u64, idx: u64, n: i32, dst: u64 }
}

kernel_params! {
    /// The parameters of `cce_stair_map_targets`.
    MapTargetsParams {
        targets: u64,
        row_perm: u64,
        class_inv: u64,
        n: i32,
        offset: i32,
        limit: i32,
        out: u64,
        ytile: u64,
    }
}

kernel_params! {
    /// The parameters of `cce_stair_place_tiles`.
    PlaceTilesParams { src: u64, n: i32, k_tiles: i32, dst: u64, ld: i64, t0: i32 }
}

kernel_params! {
    /// The parameters of `cce_stair_gather_rows16`.
    GatherRowsParams { src: u64, idx: u64, rows: i32, d: i32, dst: u64 }
}

kernel_params! {
    /// `STAIR_SCATTER_PARAMS` of `cce_stair_scatter_rows_*`.
    ScatterRowsParams { src: u64, idx: u64, rows: i32, d: i32, dst: u64, accumulate: i32 }
}

impl DenseEngine {
    /// `mean` (f32 `[D]`) = the mean of the rows of `e` (`dtype` `[N, D]`) whose `targets`
    /// (i32 `[N]`) is a class, or of all rows when none is (f64 sums in a fixed order: bitwise
    /// deterministic). `scratch`: [`mean_scratch_bytes`].
    #[allow(clippy::too_many_arguments)]
    pub fn stair_mean_rows(
        &self,
        dtype: DType,
        e: &CudaSlice<u8>,
        (n, d): (usize, usize),
        targets: &CudaSlice<u8>,
        scratch: &mut CudaSlice<u8>,
        mean: &mut CudaSlice<u8>,
    ) -> Result<()> {
        need(e, n * d * dtype.size_bytes(), "e")?;
        need(targets, n * 4, "targets")?;
        need(scratch, mean_scratch_bytes(n, d), "mean scratch")?;
        need(mean, d * 4, "mean")?;
        let blocks = n.div_ceil(COL_SUM_ROWS).max(1);
        let part = self.ptr(scratch);
        let sums = ColSumsParams {
            e: self.ptr(e),
            n: to_i32(n, "N")?,
            d: to_i32(d, "D")?,
            targets: self.ptr(targets),
            rows_per_block: COL_SUM_ROWS as i32,
            part,
            cnt: part + (blocks * 2 * d * 8) as u64,
        };
        let f = self.func(&format!("cce_stair_col_sums_{}", dtype_code(dtype)?))?;
        // SAFETY: ColSumsParams is STAIR_COLS_PARAMS; e holds n x d of dtype, targets n i32,
        // the scratch blocks x 2 x d f64 then blocks i32 (checked above); one block per 64
        // rows.
        unsafe { self.launch_params(&self.stream, f, per_row(blocks, 256), &sums) }?;
        let mp = MeanParams {
            part,
            cnt: sums.cnt,
            blocks: blocks as i32,
            n: sums.n,
            d: sums.d,
            mean: self.ptr(mean),
        };
        // SAFETY: MeanParams is cce_stair_mean's list; the scratch was written above on this
        // stream; mean holds d f32 (checked).
        unsafe {
            self.launch_params(
                &self.stream,
                self.func("cce_stair_mean")?,
                strided(d, 256),
                &mp,
            )
        }
    }

    /// The classes by descending `mean · c_j + bias_j` (ties by id; NaN as −∞: the order of
    /// [`cce_core::vocab_order::VocabOrder::by_score`]): `perm` (u32 `[V]`, the class visited
    /// `k`-th) and `inv` (u32 `[V]`, each class's position). `c`, `bias`: `dtype` `[V, D]`,
    /// `[V]`; `mean` f32 `[D]`; `keys`: `8 ·` [`sort_len`]`(V)` bytes of scratch.
    #[allow(clippy::too_many_arguments)]
    pub fn stair_class_order(
        &self,
        dtype: DType,
        c: &CudaSlice<u8>,
        (v, d): (usize, usize),
        mean: &CudaSlice<u8>,
        bias: Option<&CudaSlice<u8>>,
        keys: &mut CudaSlice<u8>,
        (perm, inv): (&mut CudaSlice<u8>, &mut CudaSlice<u8>),
    ) -> Result<()> {
        let len = sort_len(v);
        need(c, v * d * dtype.size_bytes(), "c")?;
        need(mean, d * 4, "mean")?;
        if let Some(b) = bias {
            need(b, v * dtype.size_bytes(), "bias")?;
        }
        need(keys, len * 8, "sort keys")?;
        need(perm, v * 4, "class order")?;
        need(inv, v * 4, "class positions")?;
        let kp = ClassKeysParams {
            c: self.ptr(c),
            v: to_i32(v, "V")?,
            d: to_i32(d, "D")?,
            mean: self.ptr(mean),
            bias: self.opt_ptr(bias),
            n_pow2: to_i32(len, "sort length")?,
            keys: self.ptr(keys),
        };
        let f = self.func(&format!("cce_stair_class_keys_{}", dtype_code(dtype)?))?;
        // SAFETY: ClassKeysParams is STAIR_KEYS_PARAMS; c holds v x d, bias v (or 0), mean d
        // f32, keys len u64 (checked); one warp per key, grid-stride.
        unsafe { self.launch_params(&self.stream, f, strided(len * 32, 256), &kp) }?;
        self.stair_sort(kp.keys, len)?;
        let pp = PermParams {
            keys: kp.keys,
            n: kp.v,
            perm: self.ptr(perm),
            inv: self.ptr(inv),
        };
        // SAFETY: PermParams is cce_stair_perm's list; keys holds len ≥ v sorted keys whose ids
        // are < v; perm and inv hold v u32 (checked).
        unsafe {
            self.launch_params(
                &self.stream,
                self.func("cce_stair_perm")?,
                strided(v, 256),
                &pp,
            )
        }
    }

    /// Sort `len` u64 keys at `keys` ascending in place ([`bitonic_steps`]).
    fn stair_sort(&self, keys: u64, len: usize) -> Result<()> {
        for step in bitonic_steps(len) {
            match step {
                SortStep::Local { k_first, k_last } => {
                    let p = LocalSortParams {
                        keys,
                        k_first: k_first as i64,
                        k_last: k_last as i64,
                    };
                    let cfg = per_row(len / SORT_BLOCK, 1024);
                    let f = self.func("cce_stair_bitonic_local")?;
                    // SAFETY: LocalSortParams is cce_stair_bitonic_local's list; keys holds
                    // len u64 (the callers' checks), one block per 2048 of them.
                    unsafe { self.launch_params(&self.stream, f, cfg, &p) }?;
                }
                SortStep::Global { k, j } => {
                    let p = GlobalSortParams {
                        keys,
                        n_pow2: len as i64,
                        k: k as i64,
                        j: j as i64,
                    };
                    let f = self.func("cce_stair_bitonic_step")?;
                    // SAFETY: GlobalSortParams is cce_stair_bitonic_step's list; keys holds len
                    // u64; one thread per pair (len / 2).
                    unsafe { self.launch_params(&self.stream, f, strided(len / 2, 256), &p) }?;
                }
            }
        }
        Ok(())
    }

    /// Each row's kept tiles and dropped mass (`kept` u32 `[N]`, `dropped` f32 `[N]`) from the
    /// forward's `partial` (float2 `[N, ld_tiles]`, the first `n_tiles` of each row in the
    /// visiting order of `V` classes), `lse` f32 `[N]`, `ytile` i32 `[N]` (the target's tile,
    /// −1 none) and the upstream gradients (a row with neither keeps nothing), under `eps` and
    /// `delta`, the kept count rounded up to a multiple of `granule` tiles
    /// ([`kept_by_warp_groups`]); `kept_entries` (u32 `[N]`, optional): the classes each row
    /// keeps, or `0xffffffff` for a row without a gradient (the filter statistics' input).
    #[allow(clippy::too_many_arguments)]
    pub fn stair_kept_rows(
        &self,
        partial: &CudaSlice<u8>,
        (n, v, ld_tiles): (usize, usize, usize),
        (lse, ytile): (&CudaSlice<u8>, &CudaSlice<u8>),
        (dl_rows, dl_scalar, dlse): (Option<&CudaSlice<u8>>, f32, Option<&CudaSlice<u8>>),
        (eps, delta, granule): (f32, f32, usize),
        (kept, dropped): (&mut CudaSlice<u8>, &mut CudaSlice<u8>),
        kept_entries: Option<&mut CudaSlice<u8>>,
    ) -> Result<()> {
        let n_tiles = v.div_ceil(STAIR_TILE);
        if n_tiles > ld_tiles {
            return Err(CceError::ShapeMismatch {
                what: "partials",
                expected: format!("a row stride of at least {n_tiles} tiles"),
                got: format!("{ld_tiles}"),
            });
        }
        need(partial, n * ld_tiles * 8, "partials")?;
        for (s, what) in [(lse, "lse"), (ytile, "target tiles")] {
            need(s, n * 4, what)?;
        }
        for s in [dl_rows, dlse].into_iter().flatten() {
            need(s, n * 4, "upstream gradient")?;
        }
        need(kept, n * 4, "kept tiles")?;
        need(dropped, n * 4, "dropped mass")?;
        let kept_entries = match kept_entries {
            Some(k) => {
                need(k, n * 4, "kept entries")?;
                self.ptr(k)
            }
            None => 0,
        };
        let p = KeptRowsParams {
            partial: self.ptr(partial),
            ld_tiles: ld_tiles as i64,
            n: to_i32(n, "N")?,
            n_tiles: to_i32(n_tiles, "tiles")?,
            v: to_i32(v, "V")?,
            lse: self.ptr(lse),
            ytile: self.ptr(ytile),
            dl_rows: self.opt_ptr(dl_rows),
            dl_scalar,
            dlse: self.opt_ptr(dlse),
            eps,
            delta,
            granule: to_i32(granule.max(1), "granule")?,
            kept: self.ptr(kept),
            dropped: self.ptr(dropped),
            kept_entries,
        };
        let f = self.func("cce_stair_kept_rows")?;
        // SAFETY: KeptRowsParams is cce_stair_kept_rows' list; every buffer holds what it
        // reads or writes for n rows (checked above); one warp per row, grid-stride.
        unsafe { self.launch_params(&self.stream, f, strided(n * 32, 256), &p) }
    }

    /// Columns `[t0, t0 + k_tiles)` of `dst` (float2 `[N, ld]`) = `src` (float2
    /// `[N, k_tiles]`): a class chunk's partials placed among all the tiles.
    pub fn stair_place_tiles(
        &self,
        src: &CudaSlice<u8>,
        (n, k_tiles): (usize, usize),
        dst: &mut CudaSlice<u8>,
        (ld, t0): (usize, usize),
    ) -> Result<()> {
        if t0 + k_tiles > ld {
            return Err(CceError::ShapeMismatch {
                what: "placed tiles",
                expected: format!("at most {ld} tiles per row"),
                got: format!("{} from tile {t0}", k_tiles),
            });
        }
        need(src, n * k_tiles * 8, "chunk partials")?;
        need(dst, n * ld * 8, "partials")?;
        let p = PlaceTilesParams {
            src: self.ptr(src),
            n: to_i32(n, "N")?,
            k_tiles: to_i32(k_tiles, "tiles")?,
            dst: self.ptr(dst),
            ld: ld as i64,
            t0: to_i32(t0, "tile")?,
        };
        let f = self.func("cce_stair_place_tiles")?;
        // SAFETY: PlaceTilesParams is cce_stair_place_tiles' list; src holds n x k_tiles and
        // dst n x ld float2 with t0 + k_tiles ≤ ld (checked); grid-stride.
        unsafe { self.launch_params(&self.stream, f, strided(n * k_tiles, 256), &p) }
    }

    /// The rows by descending `kept` (u32 `[N]`), ties by row id: `perm` (u32 `[N]`, the row
    /// visited `k`-th). `keys`: `8 ·` [`sort_len`]`(N)` bytes of scratch.
    pub fn stair_row_order(
        &self,
        kept: &CudaSlice<u8>,
        (n, n_tiles): (usize, usize),
        keys: &mut CudaSlice<u8>,
        perm: &mut CudaSlice<u8>,
    ) -> Result<()> {
        let len = sort_len(n);
        need(kept, n * 4, "kept tiles")?;
        need(keys, len * 8, "sort keys")?;
        need(perm, n * 4, "row order")?;
        let kp = RowKeysParams {
            kept: self.ptr(kept),
            n: to_i32(n, "N")?,
            n_tiles: to_i32(n_tiles, "tiles")?,
            n_pow2: to_i32(len, "sort length")?,
            keys: self.ptr(keys),
        };
        // SAFETY: RowKeysParams is cce_stair_row_keys' list; kept holds n u32 (each ≤
        // n_tiles), keys len u64 (checked); grid-stride.
        unsafe {
            self.launch_params(
                &self.stream,
                self.func("cce_stair_row_keys")?,
                strided(len, 256),
                &kp,
            )
        }?;
        self.stair_sort(kp.keys, len)?;
        let pp = PermParams {
            keys: kp.keys,
            n: kp.n,
            perm: self.ptr(perm),
            inv: 0,
        };
        // SAFETY: PermParams is cce_stair_perm's list; keys holds len ≥ n sorted keys whose ids
        // are < n; perm holds n u32 (checked); no inverse.
        unsafe {
            self.launch_params(
                &self.stream,
                self.func("cce_stair_perm")?,
                strided(n, 256),
                &pp,
            )
        }
    }

    /// The rows' targets in the visiting orders: with `pos = class_inv[targets[row_perm[k]]]`
    /// (`row_perm` `None`: the rows in their own order), `out[k] = pos − offset` where that lies
    /// in `[0, limit)` (a class chunk's own columns), else −1, and `ytile[k]` the tile of `pos`
    /// (`/ 256`, −1 without a target). Every buffer i32 / u32 `[N]`, `class_inv` u32 `[V]`.
    #[allow(clippy::too_many_arguments)]
    pub fn stair_map_targets(
        &self,
        targets: &CudaSlice<u8>,
        n: usize,
        (row_perm, class_inv): (Option<&CudaSlice<u8>>, &CudaSlice<u8>),
        (offset, limit): (usize, usize),
        (out, ytile): (Option<&mut CudaSlice<u8>>, Option<&mut CudaSlice<u8>>),
    ) -> Result<()> {
        need(targets, n * 4, "targets")?;
        if let Some(p) = row_perm {
            need(p, n * 4, "row order")?;
        }
        let out = out.map(|o| need(o, n * 4, "targets out").map(|_| self.ptr(o)));
        let ytile = ytile.map(|o| need(o, n * 4, "target tiles").map(|_| self.ptr(o)));
        let p = MapTargetsParams {
            targets: self.ptr(targets),
            row_perm: self.opt_ptr(row_perm),
            class_inv: self.ptr(class_inv),
            n: to_i32(n, "N")?,
            offset: to_i32(offset, "offset")?,
            limit: to_i32(limit.min(i32::MAX as usize), "limit")?,
            out: out.transpose()?.unwrap_or(0),
            ytile: ytile.transpose()?.unwrap_or(0),
        };
        // SAFETY: MapTargetsParams is cce_stair_map_targets' list; targets, row_perm, out and
        // ytile hold n words (checked); class_inv holds an entry for every class a target
        // names (the caller's prepared targets are < V, class_inv is [V]).
        unsafe {
            self.launch_params(
                &self.stream,
                self.func("cce_stair_map_targets")?,
                strided(n, 256),
                &p,
            )
        }
    }

    /// `counts[c]` (u32 `[chunks]`) = how many of the sorted rows keep class chunk `c` of
    /// `step` tiles (its first tile `c·step`), from their kept counts in the visiting order
    /// (`kept_sorted` u32 `[N]`, descending; [`chunk_rows`]).
    pub fn stair_chunk_rows(
        &self,
        kept_sorted: &CudaSlice<u8>,
        n: usize,
        (step, chunks): (usize, usize),
        counts: &mut CudaSlice<u8>,
    ) -> Result<()> {
        need(kept_sorted, n * 4, "sorted kept tiles")?;
        need(counts, chunks * 4, "chunk rows")?;
        let p = ChunkRowsParams {
            kept_sorted: self.ptr(kept_sorted),
            n: to_i32(n, "N")?,
            step: to_i32(step, "tiles per chunk")?,
            chunks: to_i32(chunks, "chunks")?,
            counts: self.ptr(counts),
        };
        // SAFETY: ChunkRowsParams is cce_stair_chunk_rows' list; buffers checked; one thread per
        // chunk.
        unsafe {
            self.launch_params(
                &self.stream,
                self.func("cce_stair_chunk_rows")?,
                strided(chunks, 256),
                &p,
            )
        }
    }

    /// `dst[k] = src[idx[k]]` for `n` 32-bit words (`idx` u32 `[n]`, every entry a valid index
    /// of `src`).
    pub fn stair_gather_u32(
        &self,
        src: &CudaSlice<u8>,
        idx: &CudaSlice<u8>,
        n: usize,
        dst: &mut CudaSlice<u8>,
    ) -> Result<()> {
        need(idx, n * 4, "gather index")?;
        need(dst, n * 4, "gather output")?;
        let p = GatherU32Params {
            src: self.ptr(src),
            idx: self.ptr(idx),
            n: to_i32(n, "rows")?,
            dst: self.ptr(dst),
        };
        // SAFETY: GatherU32Params is cce_stair_gather_u32's list; idx and dst hold n words
        // (checked), every idx entry indexes src (the caller's permutation of src's length).
        unsafe {
            self.launch_params(
                &self.stream,
                self.func("cce_stair_gather_u32")?,
                strided(n, 256),
                &p,
            )
        }
    }

    /// Row `k` of `dst` (16-bit `[rows, d]`) = row `idx[k]` of `src` (16-bit, `d` per row;
    /// `idx` u32 `[rows]`, every entry a row of `src`). `src` and `dst` 16-byte aligned.
    pub fn stair_gather_rows16(
        &self,
        src: &CudaSlice<u8>,
        idx: &CudaSlice<u8>,
        (rows, d): (usize, usize),
        dst: &mut CudaSlice<u8>,
    ) -> Result<()> {
        need(idx, rows * 4, "gather index")?;
        need(dst, rows * d * 2, "gather output")?;
        let p = GatherRowsParams {
            src: self.ptr(src),
            idx: self.ptr(idx),
            rows: to_i32(rows, "rows")?,
            d: to_i32(d, "D")?,
            dst: self.ptr(dst),
        };
        // SAFETY: GatherRowsParams is cce_stair_gather_rows16's list; idx holds rows u32 and
        // dst rows x d u16 (checked); every idx entry is a row of src (the caller's
        // permutation); one block per row.
        unsafe {
            self.launch_params(
                &self.stream,
                self.func("cce_stair_gather_rows16")?,
                per_row(rows, 128),
                &p,
            )
        }
    }

    /// Row `idx[k]` of `dst` (`dtype`, `d` per row) = row `k` of `src` (f32 `[rows, d]`),
    /// converted; with `accumulate` (f32 `dst` only) added to it. `idx` u32 `[rows]`, distinct
    /// entries, each a row of `dst`.
    #[allow(clippy::too_many_arguments)]
    pub fn stair_scatter_rows(
        &self,
        src: &CudaSlice<u8>,
        idx: &CudaSlice<u8>,
        (rows, d): (usize, usize),
        dtype: DType,
        dst: &mut CudaSlice<u8>,
        accumulate: bool,
    ) -> Result<()> {
        if accumulate && dtype != DType::F32 {
            return Err(CceError::InvalidOption {
                name: "accumulate",
                reason: format!("adds into f32 rows only, got {dtype}"),
            });
        }
        need(src, rows * d * 4, "scatter input")?;
        need(idx, rows * 4, "scatter index")?;
        let p = ScatterRowsParams {
            src: self.ptr(src),
            idx: self.ptr(idx),
            rows: to_i32(rows, "rows")?,
            d: to_i32(d, "D")?,
            dst: self.ptr(dst),
            accumulate: accumulate as i32,
        };
        let f = self.func(&format!("cce_stair_scatter_rows_{}", dtype_code(dtype)?))?;
        // SAFETY: ScatterRowsParams is STAIR_SCATTER_PARAMS; src holds rows x d f32 and idx
        // rows u32 (checked); every idx entry is a distinct row of dst (the caller's
        // permutation); one block per row.
        unsafe { self.launch_params(&self.stream, f, per_row(rows, 128), &p) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cce_core::tile_budget::TileMasses;

    /// The host simulation of the launches of [`bitonic_steps`], with the kernels' index maps.
    fn simulate(keys: &mut [u64]) {
        let len = keys.len();
        let swap = |keys: &mut [u64], i: usize, j: usize, k: usize| {
            let asc = i & k == 0;
            if (keys[i] > keys[i + j]) == asc {
                keys.swap(i, i + j);
            }
        };
        for step in bitonic_steps(len) {
            match step {
                SortStep::Local { k_first, k_last } => {
                    for base in (0..len).step_by(SORT_BLOCK) {
                        let mut k = k_first;
                        while k <= k_last {
                            let mut j = k.min(SORT_BLOCK) / 2;
                            while j > 0 {
                                for t in 0..SORT_BLOCK / 2 {
                                    let i = 2 * j * (t / j) + t % j;
                                    swap(keys, base + i, j, k);
                                }
                                j /= 2;
                            }
                            k *= 2;
                        }
                    }
                }
                SortStep::Global { k, j } => {
                    for p in 0..len / 2 {
                        swap(keys, 2 * j * (p / j) + p % j, j, k);
                    }
                }
            }
        }
    }

    #[test]
    fn the_bitonic_launches_sort() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for len in [2048usize, 4096, 16384, 65536] {
            let mut keys: Vec<u64> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x % 5000
                })
                .collect();
            let mut want = keys.clone();
            want.sort();
            simulate(&mut keys);
            assert_eq!(keys, want, "len {len}");
        }
        assert_eq!(sort_len(3), 2048);
        assert_eq!(sort_len(256000), 262144);
        assert_eq!(
            bitonic_steps(8192),
            [
                SortStep::Local {
                    k_first: 2,
                    k_last: 2048
                },
                SortStep::Global { k: 4096, j: 2048 },
                SortStep::Local {
                    k_first: 4096,
                    k_last: 4096
                },
                SortStep::Global { k: 8192, j: 4096 },
                SortStep::Global { k: 8192, j: 2048 },
                SortStep::Local {
                    k_first: 8192,
                    k_last: 8192
                },
            ]
        );
    }

    #[test]
    fn warp_groups_match_the_rule() {
        let mut x = 0x2545_f491u32;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 1000) as f64 / 1000.0
        };
        for tiles in [1usize, 5, 31, 32, 33, 64, 200, 1000] {
            for trial in 0..20 {
                let mass: Vec<f64> = (0..tiles).map(|_| next() * next() * 1e-4).collect();
                let pmax: Vec<f32> = (0..tiles)
                    .map(|_| if next() < 0.02 { 0.5 } else { 1e-5 })
                    .collect();
                let target = (trial % 3 == 0).then(|| (next() * tiles as f64) as usize);
                let mut tm = TileMasses::zeros(1, tiles);
                tm.mass.copy_from_slice(&mass);
                tm.max_g0.copy_from_slice(&pmax);
                if let Some(t) = target {
                    tm.max_g0[t] = f32::INFINITY;
                }
                let want = tm.kept_prefix(2.4e-4, 1e-3)[0];
                let got = kept_by_warp_groups(&mass, &pmax, target, (2.4e-4, 1e-3), 1);
                assert_eq!(got.0, want.0, "tiles {tiles} trial {trial}");
                assert!(
                    (got.1 - want.1).abs() <= 1e-15,
                    "tiles {tiles} trial {trial}"
                );
                // Rounded up to chunks of 7 tiles: what is past the rounding, never more.
                let (k7, m7) = kept_by_warp_groups(&mass, &pmax, target, (2.4e-4, 1e-3), 7);
                assert!(k7 >= got.0 && (k7 % 7 == 0 || k7 == tiles) && k7 < got.0 + 7);
                let past: f64 = mass[k7..].iter().sum();
                assert!((m7 - past).abs() <= 1e-15 && m7 <= got.1 + 1e-15);
            }
        }
    }

    #[test]
    fn chunk_rows_count_the_rows_past_each_chunk_start() {
        assert_eq!(chunk_rows(&[9, 5, 5, 2, 0], 2, 5), [4, 3, 3, 1, 1]);
        assert_eq!(chunk_rows(&[], 4, 2), [0, 0]);
        assert_eq!(mean_scratch_bytes(100, 10), 2 * 2 * 10 * 8 + 2 * 4);
    }
}
