//! The sparse backward (`kernels/sparse.cu`, `kernels/sparse_gather.cu`): the kept entries of
//! each row as records, `d_e` by gathering rows of `c`, the records regrouped by class and
//! `d_c`, `d_bias` by gathering rows of `e`.

use super::*;

pub(super) const SEL_THREADS: u32 = 512;

pub(super) const GATHER_THREADS: u32 = 128;

pub(super) const GATHER_WARPS: u32 = 8;

/// Row blocks of the d_c gathers over the class lists (light: `cce_sparse_gather_*_l`, heavy:
/// `_h`, times the column blocks); they stride over the lists (classes without records are
/// listed, and written as zeros, only where most classes have records; else a memset zeroes
/// d_c first). Heavy classes hold more than 128 records each, so there are few.
pub(super) const GATHER_LIGHT_ROW_BLOCKS: u32 = 1024;

pub(super) const GATHER_HEAVY_ROW_BLOCKS: u32 = 256;

/// Threads of a light d_c gather block and of a d_e gather block (`LIGHT_WARPS` in
/// chunked.cu).
pub(super) const GATHER_LIGHT_THREADS: u32 = 256;

/// Mean kept entries per row (the probe's) above which the sparse backward runs the forward
/// rows and select apart rather than folded (`cce_sparse_select_fwd_*`). Rows keeping more
/// have more candidates per select warp, and the folded form compacts its candidate slots
/// more often: session 7 run 3 measured the folded form faster at 3 and 209 kept entries per
/// row (V = 128256: c/8 10.49 against 11.17 ms at 4096 rows) and slower at 327 (the seed's
/// c/8: select 39-40 ms against 9.4 + 21.2 apart). The bound sits between.
pub(super) const FOLD_MAX_KEPT: f64 = 256.0;

/// Classes per scan block (`SCAN_TILE`) and its threads (`SCAN_THREADS`).
pub(super) const SCAN_TILE: usize = 4096;

pub(super) const SCAN_THREADS: u32 = 256;

/// What the sparse backward reads and writes besides the workspace (0 = absent).
#[derive(Clone, Copy)]
pub(super) struct SparseArgs {
    /// Also run the forward rows (lse, loss) in its row pass.
    pub(super) forward: bool,
    /// f32 `[N]` lse the selection uses (the forward's or the caller's).
    pub(super) saved_lse: u64,
    /// f32 `[N]` `1 − p_y` saved beside it.
    pub(super) saved_rest: u64,
    pub(super) dl_rows: u64,
    pub(super) dl_scalar: f32,
    pub(super) dlse: u64,
    pub(super) e: u64,
    pub(super) c: u64,
    /// Gradient outputs in the gradient dtype (0 when not computed).
    pub(super) d_e: u64,
    pub(super) d_c: u64,
    pub(super) d_bias: u64,
    pub(super) delta_fixed: u64,
    /// Tile statistics: tile rows, tile classes, class tiles.
    pub(super) tile: (i32, i32, i32),
}

impl DenseEngine {
    /// `cce_sparse_gather_*` (`f`): output row r of `out` = Σ_k G_k · `src`[idx_k] over the
    /// records `off[r] .. off[r] + cnt[r]` (`cnt` = 0: `off[r + 1] − off[r]`), record k at
    /// `recs + step·k`; `sum_out[r]` = Σ_k G_k when non-zero. Grid: `(row blocks, column
    /// blocks)`, [`GATHER_WARPS`] warps per block, a block per (output row, column block).
    ///
    /// # Safety
    /// `f` is a gather kernel of this engine; every address is a live device buffer: `off`
    /// (and `cnt`) hold a row per output row (`off` one more when `cnt` is 0), every record
    /// they name lies in the records buffer and holds an index < the rows of `src` (`[*, d]`
    /// in the input dtype), `out` holds `out rows x d` and `sum_out` (or 0) `out rows` in the
    /// kernel's output dtype; the records and counts were written earlier on this stream.
    pub(super) unsafe fn gather(
        &self,
        f: &CudaFunction,
        (off, cnt, recs, step): (u64, u64, u64, i64),
        (src, d, out, sum_out): (u64, i64, u64, u64),
        (rows, col_blocks): (u32, u32),
    ) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        let rows_i = rows as i64;
        let mut b = self.stream.launch_builder(f);
        b.arg(&off)
            .arg(&cnt)
            .arg(&recs)
            .arg(&step)
            .arg(&src)
            .arg(&d)
            .arg(&out)
            .arg(&sum_out)
            .arg(&rows_i);
        // SAFETY: argument types and order match GATHER_PARAMS in chunked.cu; the buffers are
        // as the caller guarantees (# Safety).
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (rows, col_blocks, 1),
                block_dim: (GATHER_WARPS * 32, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(drv)
        .map(|_| ())
    }

    /// The sparse backward's control words (one host sync): pairs allocated, whether a row's
    /// pairs overflowed, and rows whose select pass 2 re-read the row (candidates did not hold
    /// every kept entry; for the profile).
    pub(super) fn sparse_ctl(&self, ws: &DenseWorkspace) -> Result<(u64, bool, u32)> {
        let host = self.read_back::<16>(&ws.sparse_ctl)?;
        let counter = u64::from_le_bytes(host[0..8].try_into().expect("8 bytes"));
        let overflow = u32::from_le_bytes(host[8..12].try_into().expect("4 bytes"));
        let full = u32::from_le_bytes(host[12..16].try_into().expect("4 bytes"));
        Ok((counter, overflow != 0, full))
    }

    /// The plan's [`cce_core::SparseBackward`] (`chunked.cu` "Sparse backward"): per row chunk
    /// the logits GEMM, the forward rows (forward calls), the kept pairs, `d_e` rows by
    /// gathering `c` (per chunk, or in one launch after the last chunk on peaked data:
    /// [`cce_core::SparseBackward::defer_d_e`]); then the pairs regrouped by class and `d_c`
    /// (and `d_bias`) by gathering `e`. Returns `Ok(Ok(pairs))`, or `Ok(Err((why, rows)))` when it gives way to the dense
    /// passes: the first chunk keeps more than `max_mean_kept` entries per row, or the pairs
    /// outgrow the capacity. `rows` > 0: it gave way after the first chunk, whose logits (rows
    /// `0..rows`, row stride `ld`, at the start of the scratch) and forward rows stay valid for
    /// the dense passes to reuse; nothing else it wrote is used. Two host syncs (three with
    /// [`crate::CudaSwitches::profile`]).
    pub(super) fn sparse_backward(
        &self,
        cfg: &DenseConfig,
        ws: &mut DenseWorkspace,
        ra: &RowArgs,
        a: &SparseArgs,
    ) -> Result<std::result::Result<u64, (String, usize)>> {
        let sp = cfg.sparse.ok_or_else(|| CceError::InvalidOption {
            name: "plan.sparse",
            reason: "no sparse backward in the plan".into(),
        })?;
        let (n, d, v) = (cfg.n, cfg.d, cfg.v);
        let dt = cfg.dtype;
        let code = dtype_code(dt)?;
        let out_ty = cfg.grad_dtype();
        let out_code = dtype_code(out_ty)?;
        let ld = ws.ld;
        let scratch = sp.scratch_bytes;
        if ws.logits.len() < scratch
            || ws.sparse_rows.len() < n * 8
            || ws.kept.len() < n * 4
            || ld != cce_core::SparseBackward::ld(v)
        {
            return Err(CceError::InvalidOption {
                name: "workspace",
                reason: "allocated for another configuration".into(),
            });
        }
        let base = self.ptr(&ws.logits);
        // Logits chunk at the start; row records grow down from the end (kernels/chunked.cu).
        let l_ptr = base;
        let recs_end = base + scratch as u64;
        let row_off = self.ptr(&ws.sparse_rows);
        let row_cnt = row_off + (n * 4) as u64;
        let ctl = self.ptr(&ws.sparse_ctl);
        let (counter, overflow) = (ctl, ctl + 8);
        self.stream.memset_zeros(&mut ws.sparse_ctl).map_err(drv)?;
        let mut chunk = sp.probe_rows.clamp(1, n);
        let mut cap = sp.capacity(chunk, v) as u64;
        let f_fwd = self.func(&format!("cce_dense_fwd_{code}"))?;
        // Select blocks of 512 threads (256 with `CudaSwitches::sparse_select_threads`).
        let sel_threads: u32 = if self.switches.sparse_select_threads == 256 {
            256
        } else {
            SEL_THREADS
        };
        // The forward rows fold into select (its pass 1 carries the online lse) when the call
        // wants only lse and loss of them (no entropy, argmax or label smoothing).
        let fold_fwd = a.forward
            && sel_threads == SEL_THREADS
            && ra.entropy == 0
            && ra.argmax == 0
            && ra.alpha == 0.0
            && self.switches.sparse_fold_forward;
        let f_sel_fold = self.func(&format!("cce_sparse_select_fwd_{code}"))?;
        let f_sel = self.func(&if sel_threads == 256 {
            format!("cce_sparse_select_{code}_t256")
        } else {
            format!("cce_sparse_select_{code}")
        })?;
        // Folded chunks: the probe, and the chunks after it unless most of its rows had to be
        // re-read (their candidates against the running max did not fit; then the forward
        // rows and select run apart, which reads each row twice instead of three times).
        let mut fold = fold_fwd;
        let vec16 = 16 / dt.size_bytes();
        let vec = if d % vec16 == 0 { vec16 } else { 1 };
        let f_gather = self.func(&format!("cce_sparse_gather_{code}_{out_code}_v{vec}"))?;
        let f_gather_l = self.func(&format!("cce_sparse_gather_{code}_{out_code}_v{vec}_l"))?;
        let f_gather_h = self.func(&format!("cce_sparse_gather_{code}_{out_code}_v{vec}_h"))?;
        // Gather column slices of 32·vec columns.
        let gy = d.div_ceil(32 * vec) as u32;
        let osz = out_ty.size_bytes();
        let d_i = d as i64;
        let (kept_ptr, dropped_ptr, tau_ptr, flags_ptr, edges_ptr) = (
            self.ptr(&ws.kept),
            self.ptr(&ws.dropped),
            self.ptr(&ws.tau),
            self.ptr(&ws.flags),
            self.ptr(&ws.edges),
        );
        let (tile_rows, tile_classes, n_ctiles) = a.tile;
        let esz = dt.size_bytes();
        let mut timer = PhaseTimer::new(&self.stream, self.switches.profile)?;
        let mut r0 = 0usize;
        // d_e in one launch after the row pass (peaked data), or per chunk (set by the probe).
        let mut defer_de = false;
        while r0 < n {
            let rows = chunk.min(n - r0);
            let e_r = a.e + (r0 * d * esz) as u64;
            self.gemm_logits((v, d, rows), dt, (a.c, e_r, l_ptr), ld)?;
            PhaseTimer::mark(&mut timer, "logits GEMM")?;
            if a.forward && !fold {
                self.fwd_rows(f_fwd, ra, r0, rows, l_ptr)?;
                PhaseTimer::mark(&mut timer, "forward rows")?;
            }
            let off4 = (r0 * 4) as u64;
            let at = |p: u64| if p != 0 { p + off4 } else { 0 };
            // Folded: select writes the forward's lse, rest and loss rows (a.saved_lse is
            // ra.lse in a forward call, a.saved_rest ra.rest).
            let (t_r, lse_r, rest_r, dl_r, dlse_r) = if fold {
                (
                    at(ra.targets),
                    at(ra.lse),
                    at(ra.rest),
                    at(a.dl_rows),
                    at(a.dlse),
                )
            } else {
                (
                    at(ra.targets),
                    at(a.saved_lse),
                    at(a.saved_rest),
                    at(a.dl_rows),
                    at(a.dlse),
                )
            };
            let loss_r = if fold { at(ra.loss_rows) } else { 0 };
            // The probe (first chunk) fills the lse − max histogram, later chunks read it.
            let (gap_hist, use_gap) = (ctl + 16, i32::from(r0 > 0));
            let (off_r, cnt_r, kept_r, dropped_r, tau_r) = (
                row_off + off4,
                row_cnt + off4,
                kept_ptr + off4,
                dropped_ptr + off4,
                tau_ptr + off4,
            );
            let row0 = r0 as i64;
            let mut b = self
                .stream
                .launch_builder(if fold { f_sel_fold } else { f_sel });
            b.arg(&l_ptr)
                .arg(&ra.ld)
                .arg(&ra.v)
                .arg(&ra.bias)
                .arg(&ra.softcap)
                .arg(&t_r)
                .arg(&lse_r)
                .arg(&rest_r)
                .arg(&dl_r)
                .arg(&a.dl_scalar)
                .arg(&dlse_r)
                .arg(&ra.lambda)
                .arg(&edges_ptr)
                .arg(&a.delta_fixed)
                .arg(&cap)
                .arg(&counter)
                .arg(&overflow)
                .arg(&off_r)
                .arg(&cnt_r)
                .arg(&recs_end)
                .arg(&kept_r)
                .arg(&dropped_r)
                .arg(&tau_r)
                .arg(&flags_ptr)
                .arg(&row0)
                .arg(&tile_rows)
                .arg(&tile_classes)
                .arg(&n_ctiles)
                .arg(&loss_r)
                .arg(&gap_hist)
                .arg(&use_gap);
            // SAFETY: argument types and order match SEL_PARAMS; L holds the chunk's logits
            // (stream order); per-row arrays hold N entries and are offset to the chunk (the
            // folded form writes lse and loss rows there, which no other launch in flight
            // touches); the
            // kernel writes a row's records only when its allocation ends within `cap` =
            // `SparseBackward::capacity(chunk)`, which keeps the records between the end of
            // this chunk's logits and the end of the scratch (`scratch_bytes` ≤ the buffer,
            // checked above).
            unsafe {
                b.launch(LaunchConfig {
                    grid_dim: (rows as u32, 1, 1),
                    block_dim: (sel_threads, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map_err(drv)?;
            PhaseTimer::mark(&mut timer, "select")?;
            if r0 == 0 {
                let (pairs, over, reread) = self.sparse_ctl(ws)?;
                fold = fold
                    && (reread as usize) * 4 <= rows
                    && (pairs as f64) <= FOLD_MAX_KEPT * rows as f64;
                let mean = pairs as f64 / rows as f64;
                if over {
                    return Ok(Err((
                        format!(
                            "the first {rows} rows' pairs overflowed the sparse capacity of {cap}"
                        ),
                        rows,
                    )));
                }
                if mean > sp.max_mean_kept as f64 {
                    return Ok(Err((
                        format!(
                            "the first {rows} rows keep {mean:.0} entries per row (filter threshold at dropped mass {:.0e}), above the {} where the sparse products stop paying",
                            cfg.filter.max_dropped_mass, sp.max_mean_kept
                        ),
                        rows,
                    )));
                }
                // Grow the chunks to what the density leaves room for.
                chunk = sp.rows_after_probe(pairs, n, v);
                cap = sp.capacity(chunk, v) as u64;
                if mean * n as f64 > cap as f64 {
                    return Ok(Err((
                        format!(
                            "the first {rows} rows keep {mean:.0} entries per row; all {n} rows would need about {:.0} pairs, over the sparse capacity of {cap}",
                            mean * n as f64
                        ),
                        rows,
                    )));
                }
                defer_de = sp.defer_d_e(mean * n as f64, v);
            }
            if a.d_e != 0 && !defer_de {
                let de_r = a.d_e + (r0 * d * osz) as u64;
                // SAFETY: row offsets/counts were written by the select kernel above (stream
                // order) and index pairs within `cap`, growing down from `recs_end − 8`;
                // classes are < V, so every gathered row lies in c [V, D]; d_e holds N x D of
                // the gradient dtype and is offset to the chunk; no d_bias sum.
                unsafe {
                    self.gather(
                        f_gather,
                        (off_r, cnt_r, recs_end - 8, -1),
                        (a.c, d_i, de_r, 0),
                        (rows as u32, gy),
                    )
                }?;
                PhaseTimer::mark(&mut timer, "d_e gather")?;
            }
            r0 += rows;
        }
        let (pairs, over, _) = self.sparse_ctl(ws)?;
        let mut dc_lists = String::new();
        if over {
            return Ok(Err((
                format!(
                "the pairs outgrew the sparse capacity of {cap} after the first chunk ({pairs} asked)"
                ),
                0,
            )));
        }
        if a.d_e != 0 && defer_de {
            // One warp per row over all rows (a block per row and chunk would be mostly idle).
            let f = self.func(&format!("cce_sparse_gather_{code}_{out_code}_v{vec}_b32"))?;
            let n_ll = n as i64;
            let mut b = self.stream.launch_builder(f);
            b.arg(&row_off)
                .arg(&row_cnt)
                .arg(&recs_end)
                .arg(&a.c)
                .arg(&d_i)
                .arg(&a.d_e)
                .arg(&n_ll);
            // SAFETY: matches ROWS_GATHER_PARAMS in chunked.cu; row offsets and counts hold N
            // entries written by the select kernels (stream order), naming pairs within `cap`
            // that grow down from `recs_end` (no overflow: checked above); classes are < V, so
            // every gathered row lies in c [V, D]; d_e holds N x D of the gradient dtype.
            unsafe {
                b.launch(LaunchConfig {
                    // A warp per row, rows strided over the grid: no more blocks than rows
                    // need.
                    grid_dim: (
                        GATHER_LIGHT_ROW_BLOCKS
                            .min(n.div_ceil(GATHER_LIGHT_THREADS as usize / 32) as u32),
                        gy,
                        1,
                    ),
                    block_dim: (GATHER_LIGHT_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map_err(drv)?;
            PhaseTimer::mark(&mut timer, "d_e gather")?;
        }
        if a.d_c != 0 {
            let (counts_off, starts_off, lists_off, end) =
                cce_core::SparseBackward::class_layout(pairs as usize, v);
            if end + 8 * pairs as usize > scratch {
                return Err(CceError::InvalidOption {
                    name: "sparse layout",
                    reason: format!("{pairs} pairs leave no room to regroup them by class"),
                });
            }
            let counts = base + counts_off as u64;
            let ctr = counts + (v * 4) as u64;
            let (starts, lists) = (base + starts_off as u64, base + lists_off as u64);
            let csc = base;
            {
                // counts and the two list counters after them.
                let mut view = ws.logits.slice_mut(counts_off..counts_off + (v + 2) * 4);
                self.stream.memset_zeros(&mut view).map_err(drv)?;
            }
            let rows_cfg = LaunchConfig {
                grid_dim: (n as u32, 1, 1),
                block_dim: (GATHER_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = self.stream.launch_builder(self.func("cce_sparse_count")?);
            b.arg(&row_off).arg(&row_cnt).arg(&recs_end).arg(&counts);
            // SAFETY: matches cce_sparse_count; rows' pairs as written by the select kernels
            // (classes < V, counts holds V u32, zeroed above); the logits are no longer read.
            unsafe { b.launch(rows_cfg) }.map_err(drv)?;
            PhaseTimer::mark(&mut timer, "count by class")?;
            let v_i = v as i32;
            let scan_cfg = LaunchConfig {
                grid_dim: (v.div_ceil(SCAN_TILE) as u32, 1, 1),
                block_dim: (SCAN_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = self
                .stream
                .launch_builder(self.func("cce_sparse_tile_sums")?);
            b.arg(&counts).arg(&ctr).arg(&v_i);
            // SAFETY: matches cce_sparse_tile_sums; counts V u32, ctr 2 + ⌈V / SCAN_TILE⌉ u32
            // (class_layout), one block per tile.
            unsafe { b.launch(scan_cfg) }.map_err(drv)?;
            // Classes without records: written as zeros by the light gather where the pairs
            // outnumber the classes (most have records: c/8), else zeroed by one memset (most
            // have none: randn; seed 1.6 → 1.15 ms, session 6 runs 2 and 5).
            let list_empty = i32::from(pairs >= v as u64);
            if list_empty == 0 {
                // SAFETY: d_c holds V x D and d_bias (or 0) V elements of the gradient dtype.
                unsafe {
                    cudarc::driver::result::memset_d8_async(
                        a.d_c,
                        0,
                        v * d * osz,
                        self.stream.cu_stream(),
                    )
                    .map_err(drv)?;
                    if a.d_bias != 0 {
                        cudarc::driver::result::memset_d8_async(
                            a.d_bias,
                            0,
                            v * osz,
                            self.stream.cu_stream(),
                        )
                        .map_err(drv)?;
                    }
                }
            }
            let mut b = self
                .stream
                .launch_builder(self.func("cce_sparse_scan_tiles")?);
            b.arg(&counts)
                .arg(&ctr)
                .arg(&starts)
                .arg(&lists)
                .arg(&v_i)
                .arg(&list_empty);
            // SAFETY: matches cce_sparse_scan_tiles; the tile sums were written by the launch
            // above (stream order); starts V + 1 u32 and lists V u32 (class_layout).
            unsafe { b.launch(scan_cfg) }.map_err(drv)?;
            PhaseTimer::mark(&mut timer, "scan")?;
            let mut b = self.stream.launch_builder(self.func("cce_sparse_scatter")?);
            b.arg(&row_off)
                .arg(&row_cnt)
                .arg(&recs_end)
                .arg(&starts)
                .arg(&counts)
                .arg(&csc);
            // SAFETY: matches cce_sparse_scatter; starts sum to Σ row_cnt ≤ `pairs`, so every
            // position is below `class_layout`'s end, checked above to stay under the row
            // records; the class records overlay only the (no longer read) logits.
            unsafe { b.launch(rows_cfg) }.map_err(drv)?;
            PhaseTimer::mark(&mut timer, "scatter")?;
            let v_ll = v as i64;
            for (f, threads, gx) in [
                (f_gather_l, GATHER_LIGHT_THREADS, GATHER_LIGHT_ROW_BLOCKS),
                (f_gather_h, GATHER_WARPS * 32, GATHER_HEAVY_ROW_BLOCKS),
            ] {
                let mut b = self.stream.launch_builder(f);
                b.arg(&starts)
                    .arg(&csc)
                    .arg(&a.e)
                    .arg(&d_i)
                    .arg(&a.d_c)
                    .arg(&a.d_bias)
                    .arg(&lists)
                    .arg(&ctr)
                    .arg(&v_ll);
                // SAFETY: matches CLASS_GATHER_PARAMS in chunked.cu; the lists name classes
                // < V whose records (starts, scan above) lie in csc and hold rows < N, so
                // gathered rows lie in e [N, D]; d_c V x D, d_bias V (or 0), gradient dtype.
                unsafe {
                    b.launch(LaunchConfig {
                        grid_dim: (gx.min(v as u32), gy, 1),
                        block_dim: (threads, 1, 1),
                        shared_mem_bytes: 0,
                    })
                }
                .map_err(drv)?;
            }
            PhaseTimer::mark(&mut timer, "d_c gather")?;
            if timer.is_some() {
                // Profile only: the light and heavy class counts (one more host sync).
                let mut host = [0u8; 8];
                let off = counts_off + v * 4;
                self.stream
                    .memcpy_dtoh(&ws.logits.slice(off..off + 8), &mut host[..])
                    .map_err(drv)?;
                self.stream.synchronize().map_err(drv)?;
                let word =
                    |i: usize| u32::from_le_bytes([host[i], host[i + 1], host[i + 2], host[i + 3]]);
                dc_lists = format!(", d_c over {} light + {} heavy classes", word(0), word(4));
            }
        }
        if timer.is_some() {
            let (_, _, full) = self.sparse_ctl(ws)?;
            PhaseTimer::report(
                timer,
                &format!("sparse backward ({sel_threads}-thread select, {full} of {n} rows re-read in pass 2{dc_lists})"),
            )?;
        }
        Ok(Ok(pairs))
    }
}
