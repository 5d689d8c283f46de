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

/// Device addresses of one call of [`DenseEngine::stair_kept_rows_at`] (0 = absent).
#[derive(Clone, Copy, Debug)]
pub(super) struct KeptRowsAt {
    pub(super) partial: u64,
    pub(super) lse: u64,
    pub(super) ytile: u64,
    pub(super) dl_rows: u64,
    pub(super) dl_scalar: f32,
    pub(super) dlse: u64,
    pub(super) kept: u64,
    pub(super) dropped: u64,
    pub(super) kept_entries: u64,
}

impl DenseEngine {
    /// [`DenseEngine::stair_mean_rows`] on device addresses.
    ///
    /// # Safety
    /// `e` holds `n x d` of `dtype`, `targets` `n` i32, `scratch` [`mean_scratch_bytes`] and
    /// `mean` `d` f32, all live on the engine's stream.
    pub(super) unsafe fn stair_mean_rows_at(
        &self,
        dtype: DType,
        (e, n, d): (u64, usize, usize),
        targets: u64,
        (scratch, mean): (u64, u64),
    ) -> Result<()> {
        let blocks = n.div_ceil(COL_SUM_ROWS).max(1);
        let sums = ColSumsParams {
            e,
            n: to_i32(n, "N")?,
            d: to_i32(d, "D")?,
            targets,
            rows_per_block: COL_SUM_ROWS as i32,
            part: scratch,
            cnt: scratch + (blocks * 2 * d * 8) as u64,
        };
        let f = self.func(&format!("cce_stair_col_sums_{}", dtype_code(dtype)?))?;
        // SAFETY: ColSumsParams is STAIR_COLS_PARAMS; the buffers as this function's contract
        // says (the scratch: blocks x 2 x d f64, then blocks i32); one block per 64 rows.
        unsafe { self.launch_params(&self.stream, f, per_row(blocks, 256), &sums) }?;
        let mp = MeanParams {
            part: scratch,
            cnt: sums.cnt,
            blocks: blocks as i32,
            n: sums.n,
            d: sums.d,
            mean,
        };
        let f = self.func("cce_stair_mean")?;
        // SAFETY: MeanParams is cce_stair_mean's list; the scratch written above (stream
        // order); mean holds d f32 (the contract).
        unsafe { self.launch_params(&self.stream, f, strided(d, 256), &mp) }
    }

    /// `mean` (f32 `[D]`) = the mean of the rows of `e` (`dtype` `[N, D]`) whose `targets`
    /// (i32 `[N]`) is a class, or of all rows when none is (f64 sums in a fixed order: bitwise
    /// deterministic). `scratch`: [`mean_scratch_bytes`].
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
        let at = (self.ptr(scratch), self.ptr(mean));
        // SAFETY: every buffer's length checked above against what the step reads and writes.
        unsafe { self.stair_mean_rows_at(dtype, (self.ptr(e), n, d), self.ptr(targets), at) }
    }

    /// [`DenseEngine::stair_class_order`] on device addresses (`bias` 0: none).
    ///
    /// # Safety
    /// `c` holds `v x d` of `dtype`, `bias` `v` of `dtype` (or is 0), `mean` `d` f32, `keys`
    /// `8 ·` [`sort_len`]`(v)` bytes, `perm` and `inv` `v` u32 each, all live on the stream.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn stair_class_order_at(
        &self,
        dtype: DType,
        (c, v, d): (u64, usize, usize),
        (mean, bias): (u64, u64),
        keys: u64,
        (perm, inv): (u64, u64),
    ) -> Result<()> {
        let len = sort_len(v);
        let kp = ClassKeysParams {
            c,
            v: to_i32(v, "V")?,
            d: to_i32(d, "D")?,
            mean,
            bias,
            n_pow2: to_i32(len, "sort length")?,
            keys,
        };
        let f = self.func(&format!("cce_stair_class_keys_{}", dtype_code(dtype)?))?;
        // SAFETY: ClassKeysParams is STAIR_KEYS_PARAMS; the buffers as the contract says; one
        // warp per key, grid-stride.
        unsafe { self.launch_params(&self.stream, f, strided(len * 32, 256), &kp) }?;
        // SAFETY: keys holds len u64 (the contract).
        unsafe { self.stair_sort(keys, len) }?;
        let pp = PermParams {
            keys,
            n: kp.v,
            perm,
            inv,
        };
        let f = self.func("cce_stair_perm")?;
        // SAFETY: PermParams is cce_stair_perm's list; keys holds len ≥ v sorted keys whose
        // ids are < v (written above, stream order); perm and inv hold v u32.
        unsafe { self.launch_params(&self.stream, f, strided(v, 256), &pp) }
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
        need(c, v * d * dtype.size_bytes(), "c")?;
        need(mean, d * 4, "mean")?;
        if let Some(b) = bias {
            need(b, v * dtype.size_bytes(), "bias")?;
        }
        need(keys, sort_len(v) * 8, "sort keys")?;
        need(perm, v * 4, "class order")?;
        need(inv, v * 4, "class positions")?;
        let (mb, out) = (
            (self.ptr(mean), self.opt_ptr(bias)),
            (self.ptr(perm), self.ptr(inv)),
        );
        // SAFETY: every buffer's length checked above.
        unsafe { self.stair_class_order_at(dtype, (self.ptr(c), v, d), mb, self.ptr(keys), out) }
    }

    /// Sort `len` u64 keys at `keys` ascending in place ([`bitonic_steps`]).
    ///
    /// # Safety
    /// `keys` holds `len` u64 live on the stream; `len` a power of two ≥ [`SORT_BLOCK`].
    unsafe fn stair_sort(&self, keys: u64, len: usize) -> Result<()> {
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
                    // len u64 (the contract), one block per 2048 of them.
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

    /// [`DenseEngine::stair_kept_rows`] on device addresses.
    ///
    /// # Safety
    /// `at.partial` holds `n x ld_tiles` float2 with `ceil(v / 256) ≤ ld_tiles`; `lse`,
    /// `ytile`, `kept`, `dropped`, and `dl_rows`, `dlse`, `kept_entries` unless 0, hold `n`
    /// 4-byte words each; all live on the stream.
    pub(super) unsafe fn stair_kept_rows_at(
        &self,
        at: &KeptRowsAt,
        (n, v, ld_tiles): (usize, usize, usize),
        (eps, delta, granule): (f32, f32, usize),
    ) -> Result<()> {
        let p = KeptRowsParams {
            partial: at.partial,
            ld_tiles: ld_tiles as i64,
            n: to_i32(n, "N")?,
            n_tiles: to_i32(v.div_ceil(STAIR_TILE), "tiles")?,
            v: to_i32(v, "V")?,
            lse: at.lse,
            ytile: at.ytile,
            dl_rows: at.dl_rows,
            dl_scalar: at.dl_scalar,
            dlse: at.dlse,
            eps,
            delta,
            granule: to_i32(granule.max(1), "granule")?,
            kept: at.kept,
            dropped: at.dropped,
            kept_entries: at.kept_entries,
        };
        let f = self.func("cce_stair_kept_rows")?;
        // SAFETY: KeptRowsParams is cce_stair_kept_rows' list; the buffers as the contract
        // says; one warp per row, grid-stride.
        unsafe { self.launch_params(&self.stream, f, strided(n * 32, 256), &p) }
    }

    /// Each row's kept tiles and dropped mass (`kept` u32 `[N]`, `dropped` f32 `[N]`) from the
    /// forward's `partial` (float2 `[N, ld_tiles]`, the first `ceil(V / 256)` of each row in
    /// the visiting order of `V` classes), `lse` f32 `[N]`, `ytile` i32 `[N]` (the target's
    /// tile, −1 none) and the upstream gradients (a row with neither keeps nothing), under
    /// `eps` and `delta`, the kept count rounded up to a multiple of `granule` tiles
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
        let at = KeptRowsAt {
            partial: self.ptr(partial),
            lse: self.ptr(lse),
            ytile: self.ptr(ytile),
            dl_rows: self.opt_ptr(dl_rows),
            dl_scalar,
            dlse: self.opt_ptr(dlse),
            kept: self.ptr(kept),
            dropped: self.ptr(dropped),
            kept_entries,
        };
        // SAFETY: every buffer's length checked above.
        unsafe { self.stair_kept_rows_at(&at, (n, v, ld_tiles), (eps, delta, granule)) }
    }

    /// [`DenseEngine::stair_place_tiles`] on device addresses.
    ///
    /// # Safety
    /// `src` holds `n x k_tiles` float2 and `dst` `n x ld` with `t0 + k_tiles ≤ ld`, live on
    /// the stream.
    pub(super) unsafe fn stair_place_tiles_at(
        &self,
        (src, n, k_tiles): (u64, usize, usize),
        (dst, ld, t0): (u64, usize, usize),
    ) -> Result<()> {
        let p = PlaceTilesParams {
            src,
            n: to_i32(n, "N")?,
            k_tiles: to_i32(k_tiles, "tiles")?,
            dst,
            ld: ld as i64,
            t0: to_i32(t0, "tile")?,
        };
        let f = self.func("cce_stair_place_tiles")?;
        // SAFETY: PlaceTilesParams is cce_stair_place_tiles' list; the buffers as the contract
        // says; grid-stride.
        unsafe { self.launch_params(&self.stream, f, strided(n * k_tiles, 256), &p) }
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
                got: format!("{k_tiles} from tile {t0}"),
            });
        }
        need(src, n * k_tiles * 8, "chunk partials")?;
        need(dst, n * ld * 8, "partials")?;
        // SAFETY: lengths checked above.
        unsafe { self.stair_place_tiles_at((self.ptr(src), n, k_tiles), (self.ptr(dst), ld, t0)) }
    }

    /// [`DenseEngine::stair_row_order`] on device addresses.
    ///
    /// # Safety
    /// `kept` holds `n` u32 (each ≤ `n_tiles`), `keys` `8 ·` [`sort_len`]`(n)` bytes, `perm`
    /// `n` u32, live on the stream.
    pub(super) unsafe fn stair_row_order_at(
        &self,
        (kept, n, n_tiles): (u64, usize, usize),
        keys: u64,
        perm: u64,
    ) -> Result<()> {
        let len = sort_len(n);
        let kp = RowKeysParams {
            kept,
            n: to_i32(n, "N")?,
            n_tiles: to_i32(n_tiles, "tiles")?,
            n_pow2: to_i32(len, "sort length")?,
            keys,
        };
        let f = self.func("cce_stair_row_keys")?;
        // SAFETY: RowKeysParams is cce_stair_row_keys' list; the buffers as the contract says;
        // grid-stride.
        unsafe { self.launch_params(&self.stream, f, strided(len, 256), &kp) }?;
        // SAFETY: keys holds len u64 (the contract).
        unsafe { self.stair_sort(keys, len) }?;
        let pp = PermParams {
            keys,
            n: kp.n,
            perm,
            inv: 0,
        };
        let f = self.func("cce_stair_perm")?;
        // SAFETY: PermParams is cce_stair_perm's list; keys holds len ≥ n sorted keys whose
        // ids are < n; perm holds n u32; no inverse.
        unsafe { self.launch_params(&self.stream, f, strided(n, 256), &pp) }
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
        need(kept, n * 4, "kept tiles")?;
        need(keys, sort_len(n) * 8, "sort keys")?;
        need(perm, n * 4, "row order")?;
        // SAFETY: lengths checked above (the kept counts are the caller's ≤ n_tiles: a larger
        // one only sorts that row first).
        unsafe {
            self.stair_row_order_at((self.ptr(kept), n, n_tiles), self.ptr(keys), self.ptr(perm))
        }
    }

    /// [`DenseEngine::stair_map_targets`] on device addresses (`row_perm`, `out`, `ytile` 0:
    /// absent).
    ///
    /// # Safety
    /// `targets`, and `row_perm`, `out`, `ytile` unless 0, hold `n` 4-byte words; `class_inv`
    /// an entry for every class a target names; all live on the stream.
    pub(super) unsafe fn stair_map_targets_at(
        &self,
        (targets, n): (u64, usize),
        (row_perm, class_inv): (u64, u64),
        (offset, limit): (usize, usize),
        (out, ytile): (u64, u64),
    ) -> Result<()> {
        let p = MapTargetsParams {
            targets,
            row_perm,
            class_inv,
            n: to_i32(n, "N")?,
            offset: to_i32(offset, "offset")?,
            limit: to_i32(limit.min(i32::MAX as usize), "limit")?,
            out,
            ytile,
        };
        let f = self.func("cce_stair_map_targets")?;
        // SAFETY: MapTargetsParams is cce_stair_map_targets' list; the buffers as the contract
        // says; grid-stride.
        unsafe { self.launch_params(&self.stream, f, strided(n, 256), &p) }
    }

    /// The rows' targets in the visiting orders: with `pos = class_inv[targets[row_perm[k]]]`
    /// (`row_perm` `None`: the rows in their own order), `out[k] = pos − offset` where that lies
    /// in `[0, limit)` (a class chunk's own columns), else −1, and `ytile[k]` the tile of `pos`
    /// (`/ 256`, −1 without a target). Every buffer i32 / u32 `[N]`, `class_inv` u32 `[V]`
    /// (`V` its length: every target must be below it).
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
        let outs = (
            out.transpose()?.unwrap_or(0),
            ytile.transpose()?.unwrap_or(0),
        );
        let maps = (self.opt_ptr(row_perm), self.ptr(class_inv));
        // SAFETY: lengths checked above; class_inv is [V] for the caller's targets < V.
        unsafe { self.stair_map_targets_at((self.ptr(targets), n), maps, (offset, limit), outs) }
    }

    /// [`DenseEngine::stair_chunk_rows`] on device addresses.
    ///
    /// # Safety
    /// `kept_sorted` holds `n` u32 and `counts` `chunks` u32, live on the stream.
    pub(super) unsafe fn stair_chunk_rows_at(
        &self,
        (kept_sorted, n): (u64, usize),
        (step, chunks): (usize, usize),
        counts: u64,
    ) -> Result<()> {
        let p = ChunkRowsParams {
            kept_sorted,
            n: to_i32(n, "N")?,
            step: to_i32(step, "tiles per chunk")?,
            chunks: to_i32(chunks, "chunks")?,
            counts,
        };
        let f = self.func("cce_stair_chunk_rows")?;
        // SAFETY: ChunkRowsParams is cce_stair_chunk_rows' list; the buffers as the contract
        // says; one thread per chunk.
        unsafe { self.launch_params(&self.stream, f, strided(chunks, 256), &p) }
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
        // SAFETY: lengths checked above.
        unsafe {
            self.stair_chunk_rows_at((self.ptr(kept_sorted), n), (step, chunks), self.ptr(counts))
        }
    }

    /// `dst[k] = src[idx[k]]` for `n` 16-bit values on device addresses (the bias in the
    /// class order).
    ///
    /// # Safety
    /// `idx` holds `n` u32, each an index of `src`'s 16-bit values; `dst` holds `n` of them;
    /// live on the stream.
    pub(super) unsafe fn stair_gather_u16_at(
        &self,
        (src, idx, n): (u64, u64, usize),
        dst: u64,
    ) -> Result<()> {
        let p = GatherU32Params {
            src,
            idx,
            n: to_i32(n, "rows")?,
            dst,
        };
        let f = self.func("cce_stair_gather_u16")?;
        // SAFETY: GatherU32Params matches cce_stair_gather_u16's list (u16*, u32*, int, u16*:
        // the same addresses and count); the buffers as the contract says; grid-stride.
        unsafe { self.launch_params(&self.stream, f, strided(n, 256), &p) }
    }

    /// [`DenseEngine::stair_gather_u32`] on device addresses.
    ///
    /// # Safety
    /// `idx` and `dst` hold `n` u32, every `idx` entry indexes `src`; live on the stream.
    pub(super) unsafe fn stair_gather_u32_at(
        &self,
        (src, idx, n): (u64, u64, usize),
        dst: u64,
    ) -> Result<()> {
        let p = GatherU32Params {
            src,
            idx,
            n: to_i32(n, "rows")?,
            dst,
        };
        let f = self.func("cce_stair_gather_u32")?;
        // SAFETY: GatherU32Params is cce_stair_gather_u32's list; the buffers as the contract
        // says; grid-stride.
        unsafe { self.launch_params(&self.stream, f, strided(n, 256), &p) }
    }

    /// `dst[k] = src[idx[k]]` for `n` 32-bit words (`idx` u32 `[n]`, every entry below the
    /// length of `src` in words, else `ShapeMismatch` is not detected: the caller's
    /// permutation).
    pub fn stair_gather_u32(
        &self,
        src: &CudaSlice<u8>,
        idx: &CudaSlice<u8>,
        n: usize,
        dst: &mut CudaSlice<u8>,
    ) -> Result<()> {
        need(idx, n * 4, "gather index")?;
        need(dst, n * 4, "gather output")?;
        // SAFETY: lengths checked above; idx is the caller's permutation of src's words.
        unsafe { self.stair_gather_u32_at((self.ptr(src), self.ptr(idx), n), self.ptr(dst)) }
    }

    /// [`DenseEngine::stair_gather_rows16`] on device addresses.
    ///
    /// # Safety
    /// `idx` holds `rows` u32, each a row of `src` (`d` 16-bit values per row); `dst` holds
    /// `rows x d` 16-bit values; both bases 16-byte aligned; live on the stream.
    pub(super) unsafe fn stair_gather_rows16_at(
        &self,
        (src, idx): (u64, u64),
        (rows, d): (usize, usize),
        dst: u64,
    ) -> Result<()> {
        let p = GatherRowsParams {
            src,
            idx,
            rows: to_i32(rows, "rows")?,
            d: to_i32(d, "D")?,
            dst,
        };
        let f = self.func("cce_stair_gather_rows16")?;
        // SAFETY: GatherRowsParams is cce_stair_gather_rows16's list; the buffers as the
        // contract says; one block per row.
        unsafe { self.launch_params(&self.stream, f, per_row(rows, 128), &p) }
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
        // SAFETY: lengths checked above; idx is the caller's permutation of src's rows.
        unsafe {
            self.stair_gather_rows16_at((self.ptr(src), self.ptr(idx)), (rows, d), self.ptr(dst))
        }
    }

    /// [`DenseEngine::stair_scatter_rows`] on device addresses.
    ///
    /// # Safety
    /// `src` holds `rows x d` f32, `idx` `rows` distinct rows of `dst` (`d` values of `dtype`
    /// per row); live on the stream; `accumulate` only with an f32 `dst`.
    pub(super) unsafe fn stair_scatter_rows_at(
        &self,
        (src, idx): (u64, u64),
        (rows, d): (usize, usize),
        (dtype, dst, accumulate): (DType, u64, bool),
    ) -> Result<()> {
        let p = ScatterRowsParams {
            src,
            idx,
            rows: to_i32(rows, "rows")?,
            d: to_i32(d, "D")?,
            dst,
            accumulate: accumulate as i32,
        };
        let f = self.func(&format!("cce_stair_scatter_rows_{}", dtype_code(dtype)?))?;
        // SAFETY: ScatterRowsParams is STAIR_SCATTER_PARAMS; the buffers as the contract says;
        // one block per row.
        unsafe { self.launch_params(&self.stream, f, per_row(rows, 128), &p) }
    }

    /// Row `idx[k]` of `dst` (`dtype`, `d` per row) = row `k` of `src` (f32 `[rows, d]`),
    /// converted; with `accumulate` (f32 `dst` only) added to it. `idx` u32 `[rows]`, distinct
    /// entries, each a row of `dst`.
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
        let out = (dtype, self.ptr(dst), accumulate);
        // SAFETY: lengths checked above; idx is the caller's permutation of dst's rows.
        unsafe { self.stair_scatter_rows_at((self.ptr(src), self.ptr(idx)), (rows, d), out) }
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
