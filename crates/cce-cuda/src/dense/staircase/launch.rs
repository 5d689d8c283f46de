//! The staircase steps' launches on device addresses: the kernels' typed parameters
//! (`kernels/staircase.cu`, one struct per parameter list), their grids, and one `unsafe fn`
//! per step whose `# Safety` says what every address must hold (the executor,
//! `stair_pass.rs`, calls them on regions of its layout; `checked.rs` on checked slices).

use super::*;

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
pub(in crate::dense) struct KeptRowsAt {
    pub(in crate::dense) partial: u64,
    pub(in crate::dense) lse: u64,
    pub(in crate::dense) ytile: u64,
    pub(in crate::dense) dl_rows: u64,
    pub(in crate::dense) dl_scalar: f32,
    pub(in crate::dense) dlse: u64,
    pub(in crate::dense) kept: u64,
    pub(in crate::dense) dropped: u64,
    pub(in crate::dense) kept_entries: u64,
}

impl DenseEngine {
    /// [`DenseEngine::stair_mean_rows`] on device addresses.
    ///
    /// # Safety
    /// `e` holds `n x d` of `dtype`, `targets` `n` i32, `scratch` [`mean_scratch_bytes`] and
    /// `mean` `d` f32, all live on the engine's stream.
    pub(in crate::dense) unsafe fn stair_mean_rows_at(
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

    /// [`DenseEngine::stair_class_order`] on device addresses (`bias` 0: none).
    ///
    /// # Safety
    /// `c` holds `v x d` of `dtype`, `bias` `v` of `dtype` (or is 0), `mean` `d` f32, `keys`
    /// `8 ·` [`sort_len`]`(v)` bytes, `perm` and `inv` `v` u32 each, all live on the stream.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::dense) unsafe fn stair_class_order_at(
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
    pub(in crate::dense) unsafe fn stair_kept_rows_at(
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

    /// [`DenseEngine::stair_place_tiles`] on device addresses.
    ///
    /// # Safety
    /// `src` holds `n x k_tiles` float2 and `dst` `n x ld` with `t0 + k_tiles ≤ ld`, live on
    /// the stream.
    pub(in crate::dense) unsafe fn stair_place_tiles_at(
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

    /// [`DenseEngine::stair_row_order`] on device addresses.
    ///
    /// # Safety
    /// `kept` holds `n` u32 (each ≤ `n_tiles`), `keys` `8 ·` [`sort_len`]`(n)` bytes, `perm`
    /// `n` u32, live on the stream.
    pub(in crate::dense) unsafe fn stair_row_order_at(
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

    /// [`DenseEngine::stair_map_targets`] on device addresses (`row_perm`, `out`, `ytile` 0:
    /// absent).
    ///
    /// # Safety
    /// `targets`, and `row_perm`, `out`, `ytile` unless 0, hold `n` 4-byte words; `class_inv`
    /// an entry for every class a target names; all live on the stream.
    pub(in crate::dense) unsafe fn stair_map_targets_at(
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

    /// [`DenseEngine::stair_chunk_rows`] on device addresses.
    ///
    /// # Safety
    /// `kept_sorted` holds `n` u32 and `counts` `chunks` u32, live on the stream.
    pub(in crate::dense) unsafe fn stair_chunk_rows_at(
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

    /// `dst[k] = src[idx[k]]` for `n` 16-bit values on device addresses (the bias in the
    /// class order).
    ///
    /// # Safety
    /// `idx` holds `n` u32, each an index of `src`'s 16-bit values; `dst` holds `n` of them;
    /// live on the stream.
    pub(in crate::dense) unsafe fn stair_gather_u16_at(
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
    pub(in crate::dense) unsafe fn stair_gather_u32_at(
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

    /// [`DenseEngine::stair_gather_rows16`] on device addresses.
    ///
    /// # Safety
    /// `idx` holds `rows` u32, each a row of `src` (`d` 16-bit values per row); `dst` holds
    /// `rows x d` 16-bit values; both bases 16-byte aligned; live on the stream.
    pub(in crate::dense) unsafe fn stair_gather_rows16_at(
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

    /// [`DenseEngine::stair_scatter_rows`] on device addresses.
    ///
    /// # Safety
    /// `src` holds `rows x d` f32, `idx` `rows` distinct rows of `dst` (`d` values of `dtype`
    /// per row); live on the stream; `accumulate` only with an f32 `dst`.
    pub(in crate::dense) unsafe fn stair_scatter_rows_at(
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
}
