//! The staircase steps on device buffers with their lengths checked (`ShapeMismatch` before
//! any launch): the public face of `launch.rs`, used by the device tests
//! (`tests/staircase.rs`).

use super::super::exec::need;
use super::*;

impl DenseEngine {
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
