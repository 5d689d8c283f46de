//! The sparse backward (`kernels/sparse.cu`, `kernels/sparse_gather.cu`): the kept entries of
//! each row as records, `d_e` by gathering rows of `c`, the records regrouped by class and
//! `d_c`, `d_bias` by gathering rows of `e`.

use super::schedule;
use super::*;

/// Threads of a select block, of a count / scatter block, and warps of a gather block
/// (`SEL_THREADS`, `GATHER_THREADS`, `GATHER_WARPS` in sparse.cu).
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
/// sparse.cu).
pub(super) const GATHER_LIGHT_THREADS: u32 = 256;

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
        // SAFETY: argument types and order match GATHER_PARAMS in sparse_gather.cu; the buffers are
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

    /// The plan's [`cce_core::SparseBackward`] (`kernels/sparse.cu`): per row chunk the logits
    /// GEMM, the forward rows (forward calls), the kept pairs, `d_e` rows by gathering `c`
    /// (per chunk, or in one launch after the last chunk on peaked data:
    /// [`cce_core::SparseBackward::defer_d_e`]); then the pairs regrouped by class and `d_c`
    /// (and `d_bias`) by gathering `e`. Returns `Ok(Ok(pairs))`, or `Ok(Err((why, rows)))`
    /// when it gives way to the dense passes ([`schedule::probe_verdict`]): the first chunk
    /// keeps more than `max_mean_kept` entries per row, or the pairs outgrow the capacity.
    /// `rows` > 0: it gave way after the first chunk, whose logits (rows `0..rows`, row stride
    /// `ld`, at the start of the scratch) and forward rows stay valid for the dense passes to
    /// reuse; nothing else it wrote is used. Two host syncs (three with
    /// [`crate::CudaSwitches::profile`]).
    pub(super) fn sparse_backward(
        &self,
        cfg: &DenseConfig,
        ws: &mut DenseWorkspace,
        ra: &RowArgs,
        a: &SparseArgs,
    ) -> Result<std::result::Result<u64, (String, usize)>> {
        let x = self.sparse_ctx(cfg, ws, ra, a)?;
        let (n, v) = (cfg.n, cfg.v);
        let sp = x.sp;
        self.stream.memset_zeros(&mut ws.sparse_ctl).map_err(drv)?;
        let mut chunk = sp.probe_rows.clamp(1, n);
        let mut cap = sp.capacity(chunk, v) as u64;
        // Folded chunks: the probe, and the chunks after it unless most of its rows had to be
        // re-read (`schedule::fold_after_probe`).
        let mut fold = schedule::fold_forward(
            a.forward,
            x.sel_threads,
            (ra.entropy != 0, ra.argmax != 0, ra.alpha),
            self.switches.sparse_fold_forward,
        );
        let mut timer = PhaseTimer::new(&self.stream, self.switches.profile)?;
        let mut r0 = 0usize;
        // d_e in one launch after the row pass (peaked data), or per chunk (set by the probe).
        let mut defer_de = false;
        while r0 < n {
            let rows = chunk.min(n - r0);
            self.sparse_rows(&x, (r0, rows), fold, cap, &mut timer)?;
            if r0 == 0 {
                let (pairs, over, reread) = self.sparse_ctl(ws)?;
                fold = schedule::fold_after_probe(fold, reread, rows, pairs);
                match schedule::probe_verdict(cfg, &sp, rows, (pairs, over, cap)) {
                    Err(why) => return Ok(Err((why, rows))),
                    Ok(next) => {
                        chunk = next.chunk;
                        cap = next.cap;
                        defer_de = next.defer_d_e;
                    }
                }
            }
            if a.d_e != 0 && !defer_de {
                let off4 = (r0 * 4) as u64;
                let de_r = a.d_e + (r0 * cfg.d * x.osz) as u64;
                // SAFETY: row offsets/counts were written by the select kernel above (stream
                // order) and index pairs within `cap`, growing down from `recs_end − 8`;
                // classes are < V, so every gathered row lies in c [V, D]; d_e holds N x D of
                // the gradient dtype and is offset to the chunk; no d_bias sum.
                unsafe {
                    self.gather(
                        x.f_gather,
                        (x.row_off + off4, x.row_cnt + off4, x.recs_end - 8, -1),
                        (a.c, x.d_i, de_r, 0),
                        (rows as u32, x.gy),
                    )
                }?;
                PhaseTimer::mark(&mut timer, "d_e gather")?;
            }
            r0 += rows;
        }
        let (pairs, over, _) = self.sparse_ctl(ws)?;
        if over {
            return Ok(Err((schedule::pairs_outgrew_note(cap, pairs), 0)));
        }
        if a.d_e != 0 && defer_de {
            self.sparse_de_all(&x, &mut timer)?;
        }
        let dc_lists = if a.d_c != 0 {
            self.sparse_dc(&x, ws, pairs, &mut timer)?
        } else {
            String::new()
        };
        if timer.is_some() {
            let (_, _, full) = self.sparse_ctl(ws)?;
            PhaseTimer::report(
                timer,
                &format!("sparse backward ({}-thread select, {full} of {n} rows re-read in pass 2{dc_lists})", x.sel_threads),
            )?;
        }
        Ok(Ok(pairs))
    }

    /// The sparse backward's constants: the workspace checked against the plan, its regions'
    /// addresses, the kernels.
    fn sparse_ctx<'a>(
        &'a self,
        cfg: &'a DenseConfig,
        ws: &DenseWorkspace,
        ra: &'a RowArgs,
        a: &'a SparseArgs,
    ) -> Result<SparseCtx<'a>> {
        let sp = cfg.sparse.ok_or_else(|| CceError::InvalidOption {
            name: "plan.sparse",
            reason: "no sparse backward in the plan".into(),
        })?;
        let (n, d, v) = (cfg.n, cfg.d, cfg.v);
        let dt = cfg.dtype;
        let code = dtype_code(dt)?;
        let out_ty = cfg.grad_dtype();
        let out_code = dtype_code(out_ty)?;
        let scratch = sp.scratch_bytes;
        if ws.logits.len() < scratch
            || ws.sparse_rows.len() < n * 8
            || ws.kept.len() < n * 4
            || ws.ld != cce_core::SparseBackward::ld(v)
        {
            return Err(CceError::InvalidOption {
                name: "workspace",
                reason: "allocated for another configuration".into(),
            });
        }
        let base = self.ptr(&ws.logits);
        let row_off = self.ptr(&ws.sparse_rows);
        // Select blocks of 512 threads (256 with `CudaSwitches::sparse_select_threads`).
        let sel_threads = schedule::select_threads(self.switches.sparse_select_threads);
        let vec16 = 16 / dt.size_bytes();
        let vec = if d % vec16 == 0 { vec16 } else { 1 };
        let gather =
            |tail: &str| self.func(&format!("cce_sparse_gather_{code}_{out_code}_v{vec}{tail}"));
        Ok(SparseCtx {
            cfg,
            ra,
            a,
            sp,
            base,
            // Logits chunk at the start; row records grow down from the end (sparse.cu).
            recs_end: base + scratch as u64,
            scratch,
            ld: ws.ld,
            row_off,
            row_cnt: row_off + (n * 4) as u64,
            ctl: self.ptr(&ws.sparse_ctl),
            sel_threads,
            f_fwd: self.func(&format!("cce_dense_fwd_{code}"))?,
            f_sel_fold: self.func(&format!("cce_sparse_select_fwd_{code}"))?,
            f_sel: self.func(&if sel_threads == 256 {
                format!("cce_sparse_select_{code}_t256")
            } else {
                format!("cce_sparse_select_{code}")
            })?,
            f_gather: gather("")?,
            f_gather_l: gather("_l")?,
            f_gather_h: gather("_h")?,
            f_gather_b32: gather("_b32")?,
            // Gather column slices of 32·vec columns.
            gy: d.div_ceil(32 * vec) as u32,
            osz: out_ty.size_bytes(),
            d_i: d as i64,
            kept: self.ptr(&ws.kept),
            dropped: self.ptr(&ws.dropped),
            tau: self.ptr(&ws.tau),
            flags: self.ptr(&ws.flags),
            edges: self.ptr(&ws.edges),
        })
    }

    /// One row chunk of the sparse backward: the logits GEMM, the forward rows (unless
    /// folded), the select kernel (the kept pairs, folded: with lse, rest and loss rows).
    fn sparse_rows(
        &self,
        x: &SparseCtx<'_>,
        (r0, rows): (usize, usize),
        fold: bool,
        cap: u64,
        timer: &mut Option<PhaseTimer>,
    ) -> Result<()> {
        let (cfg, ra, a) = (x.cfg, x.ra, x.a);
        let (d, v) = (cfg.d, cfg.v);
        let l_ptr = x.base;
        let e_r = a.e + (r0 * d * cfg.dtype.size_bytes()) as u64;
        self.gemm_logits((v, d, rows), cfg.dtype, (a.c, e_r, l_ptr), x.ld)?;
        PhaseTimer::mark(timer, "logits GEMM")?;
        if a.forward && !fold {
            self.fwd_rows(x.f_fwd, ra, r0, rows, l_ptr)?;
            PhaseTimer::mark(timer, "forward rows")?;
        }
        let off4 = (r0 * 4) as u64;
        let at = |p: u64| if p != 0 { p + off4 } else { 0 };
        // Folded: select writes the forward's lse, rest and loss rows (a.saved_lse is
        // ra.lse in a forward call, a.saved_rest ra.rest).
        let (lse, rest) = if fold {
            (ra.lse, ra.rest)
        } else {
            (a.saved_lse, a.saved_rest)
        };
        let (tile_rows, tile_classes, n_ctiles) = a.tile;
        let params = SelectParams {
            l: l_ptr,
            ld: ra.ld,
            v: ra.v,
            bias: ra.bias,
            softcap: ra.softcap,
            targets: at(ra.targets),
            lse: at(lse),
            rest: at(rest),
            dl_rows: at(a.dl_rows),
            dl_scalar: a.dl_scalar,
            dlse: at(a.dlse),
            lambda: ra.lambda,
            edges: x.edges,
            delta_fixed: a.delta_fixed,
            cap,
            counter: x.ctl,
            overflow: x.ctl + 8,
            row_off: x.row_off + off4,
            row_cnt: x.row_cnt + off4,
            recs_end: x.recs_end,
            kept: x.kept + off4,
            dropped: x.dropped + off4,
            tau: x.tau + off4,
            flags: x.flags,
            row0: r0 as i64,
            tile: (tile_rows, tile_classes, n_ctiles),
            loss: if fold { at(ra.loss_rows) } else { 0 },
            // The probe (first chunk) fills the lse − max histogram, later chunks read it.
            gap_hist: x.ctl + 16,
            use_gap: i32::from(r0 > 0),
        };
        let f = if fold { x.f_sel_fold } else { x.f_sel };
        let launch = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (x.sel_threads, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: SelectParams is SEL_PARAMS; L holds the chunk's logits (stream order);
        // per-row arrays hold N entries and are offset to the chunk (the folded form writes lse
        // and loss rows there, which no other launch in flight touches); the kernel writes a
        // row's records only when its allocation ends within `cap` =
        // `SparseBackward::capacity(chunk)`, which keeps the records between the end of this
        // chunk's logits and the end of the scratch (`scratch_bytes` ≤ the buffer, checked by
        // `sparse_ctx`).
        unsafe { self.launch_params(&self.stream, f, launch, &params) }?;
        PhaseTimer::mark(timer, "select")
    }

    /// `d_e` of every row in one launch after the row pass (peaked data): one warp per row
    /// (a block per row and chunk would be mostly idle).
    fn sparse_de_all(&self, x: &SparseCtx<'_>, timer: &mut Option<PhaseTimer>) -> Result<()> {
        let n = x.cfg.n;
        let n_ll = n as i64;
        let mut b = self.stream.launch_builder(x.f_gather_b32);
        b.arg(&x.row_off)
            .arg(&x.row_cnt)
            .arg(&x.recs_end)
            .arg(&x.a.c)
            .arg(&x.d_i)
            .arg(&x.a.d_e)
            .arg(&n_ll);
        // SAFETY: matches ROWS_GATHER_PARAMS in sparse_gather.cu; row offsets and counts hold N
        // entries written by the select kernels (stream order), naming pairs within `cap`
        // that grow down from `recs_end` (no overflow: checked by the caller); classes are
        // < V, so every gathered row lies in c [V, D]; d_e holds N x D of the gradient dtype.
        unsafe {
            b.launch(LaunchConfig {
                // A warp per row, rows strided over the grid: no more blocks than rows
                // need.
                grid_dim: (
                    GATHER_LIGHT_ROW_BLOCKS
                        .min(n.div_ceil(GATHER_LIGHT_THREADS as usize / 32) as u32),
                    x.gy,
                    1,
                ),
                block_dim: (GATHER_LIGHT_THREADS, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(drv)?;
        PhaseTimer::mark(timer, "d_e gather")
    }

    /// `d_c` (and `d_bias`) of the sparse backward: the `pairs` records regrouped by class
    /// (`sparse_regroup`), then the light and heavy classes' gathers of rows of `e`. Returns
    /// the profile's note of the class lists (empty without the profile).
    fn sparse_dc(
        &self,
        x: &SparseCtx<'_>,
        ws: &mut DenseWorkspace,
        pairs: u64,
        timer: &mut Option<PhaseTimer>,
    ) -> Result<String> {
        let v = x.cfg.v;
        let a = x.a;
        let (counts_off, starts_off, lists_off, end) =
            cce_core::SparseBackward::class_layout(pairs as usize, v);
        if end + 8 * pairs as usize > x.scratch {
            return Err(CceError::InvalidOption {
                name: "sparse layout",
                reason: format!("{pairs} pairs leave no room to regroup them by class"),
            });
        }
        let base = x.base;
        let counts = base + counts_off as u64;
        let ctr = counts + (v * 4) as u64;
        let (starts, lists) = (base + starts_off as u64, base + lists_off as u64);
        let csc = base;
        {
            // counts and the two list counters after them.
            let mut view = ws.logits.slice_mut(counts_off..counts_off + (v + 2) * 4);
            self.stream.memset_zeros(&mut view).map_err(drv)?;
        }
        self.sparse_regroup(x, pairs, (counts, ctr, starts, lists, csc), timer)?;
        let v_ll = v as i64;
        for (f, threads, gx) in [
            (x.f_gather_l, GATHER_LIGHT_THREADS, GATHER_LIGHT_ROW_BLOCKS),
            (x.f_gather_h, GATHER_WARPS * 32, GATHER_HEAVY_ROW_BLOCKS),
        ] {
            let mut b = self.stream.launch_builder(f);
            b.arg(&starts)
                .arg(&csc)
                .arg(&a.e)
                .arg(&x.d_i)
                .arg(&a.d_c)
                .arg(&a.d_bias)
                .arg(&lists)
                .arg(&ctr)
                .arg(&v_ll);
            // SAFETY: matches CLASS_GATHER_PARAMS in sparse_gather.cu; the lists name classes
            // < V whose records (starts, scan by `sparse_regroup`) lie in csc and hold rows
            // < N, so gathered rows lie in e [N, D]; d_c V x D, d_bias V (or 0), gradient dtype.
            unsafe {
                b.launch(LaunchConfig {
                    grid_dim: (gx.min(v as u32), x.gy, 1),
                    block_dim: (threads, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map_err(drv)?;
        }
        PhaseTimer::mark(timer, "d_c gather")?;
        if timer.is_none() {
            return Ok(String::new());
        }
        // Profile only: the light and heavy class counts (one more host sync).
        let mut host = [0u8; 8];
        let off = counts_off + v * 4;
        self.stream
            .memcpy_dtoh(&ws.logits.slice(off..off + 8), &mut host[..])
            .map_err(drv)?;
        self.stream.synchronize().map_err(drv)?;
        let word = |i: usize| u32::from_le_bytes([host[i], host[i + 1], host[i + 2], host[i + 3]]);
        Ok(format!(
            ", d_c over {} light + {} heavy classes",
            word(0),
            word(4)
        ))
    }

    /// The `pairs` row records regrouped by class: counts per class, the scan over classes
    /// (first record of each class, the light and heavy class lists), the records scattered
    /// in class order to `csc` at the start of the scratch. Classes without records are
    /// zeroed in `d_c`, `d_bias` by a memset first where most classes have none.
    fn sparse_regroup(
        &self,
        x: &SparseCtx<'_>,
        pairs: u64,
        (counts, ctr, starts, lists, csc): (u64, u64, u64, u64, u64),
        timer: &mut Option<PhaseTimer>,
    ) -> Result<()> {
        let (n, d, v) = (x.cfg.n, x.cfg.d, x.cfg.v);
        let a = x.a;
        let rows_cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (GATHER_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(self.func("cce_sparse_count")?);
        b.arg(&x.row_off)
            .arg(&x.row_cnt)
            .arg(&x.recs_end)
            .arg(&counts);
        // SAFETY: matches cce_sparse_count; rows' pairs as written by the select kernels
        // (classes < V, counts holds V u32, zeroed by the caller); the logits are no longer
        // read.
        unsafe { b.launch(rows_cfg) }.map_err(drv)?;
        PhaseTimer::mark(timer, "count by class")?;
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
        let list_empty = i32::from(!schedule::dc_zero_by_memset(pairs, v));
        if list_empty == 0 {
            // SAFETY: d_c holds V x D and d_bias (or 0) V elements of the gradient dtype.
            unsafe {
                cudarc::driver::result::memset_d8_async(
                    a.d_c,
                    0,
                    v * d * x.osz,
                    self.stream.cu_stream(),
                )
                .map_err(drv)?;
                if a.d_bias != 0 {
                    cudarc::driver::result::memset_d8_async(
                        a.d_bias,
                        0,
                        v * x.osz,
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
        PhaseTimer::mark(timer, "scan")?;
        let mut b = self.stream.launch_builder(self.func("cce_sparse_scatter")?);
        b.arg(&x.row_off)
            .arg(&x.row_cnt)
            .arg(&x.recs_end)
            .arg(&starts)
            .arg(&counts)
            .arg(&csc);
        // SAFETY: matches cce_sparse_scatter; starts sum to Σ row_cnt ≤ `pairs`, so every
        // position is below `class_layout`'s end, checked by `sparse_dc` to stay under the
        // row records; the class records overlay only the (no longer read) logits.
        unsafe { b.launch(rows_cfg) }.map_err(drv)?;
        PhaseTimer::mark(timer, "scatter")
    }
}

/// The sparse backward's constants of one call: its inputs, the workspace's regions, the
/// kernels.
pub(super) struct SparseCtx<'a> {
    cfg: &'a DenseConfig,
    ra: &'a RowArgs,
    a: &'a SparseArgs,
    sp: cce_core::SparseBackward,
    /// The scratch: the logits chunk at `base`, the row records growing down from
    /// `recs_end` (`scratch` bytes after `base`).
    base: u64,
    recs_end: u64,
    scratch: usize,
    /// Row stride of the logits chunk.
    ld: usize,
    /// Row offsets, row counts (u32 `[N]` each), the control words.
    row_off: u64,
    row_cnt: u64,
    ctl: u64,
    sel_threads: u32,
    f_fwd: &'a CudaFunction,
    f_sel: &'a CudaFunction,
    f_sel_fold: &'a CudaFunction,
    f_gather: &'a CudaFunction,
    f_gather_l: &'a CudaFunction,
    f_gather_h: &'a CudaFunction,
    f_gather_b32: &'a CudaFunction,
    /// Column blocks of the gathers, gradient element size, `D`.
    gy: u32,
    osz: usize,
    d_i: i64,
    kept: u64,
    dropped: u64,
    tau: u64,
    flags: u64,
    edges: u64,
}

/// `SEL_PARAMS` of `cce_sparse_select_*` (`kernels/sparse.cu`); the per-row arrays offset to
/// the chunk.
pub(super) struct SelectParams {
    l: u64,
    ld: i64,
    v: i32,
    bias: u64,
    softcap: f32,
    targets: u64,
    lse: u64,
    rest: u64,
    dl_rows: u64,
    dl_scalar: f32,
    dlse: u64,
    lambda: f32,
    edges: u64,
    delta_fixed: u64,
    cap: u64,
    counter: u64,
    overflow: u64,
    row_off: u64,
    row_cnt: u64,
    recs_end: u64,
    kept: u64,
    dropped: u64,
    tau: u64,
    flags: u64,
    row0: i64,
    tile: (i32, i32, i32),
    loss: u64,
    gap_hist: u64,
    use_gap: i32,
}

impl KernelParams for SelectParams {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
        b.arg(&self.l)
            .arg(&self.ld)
            .arg(&self.v)
            .arg(&self.bias)
            .arg(&self.softcap)
            .arg(&self.targets)
            .arg(&self.lse)
            .arg(&self.rest)
            .arg(&self.dl_rows)
            .arg(&self.dl_scalar)
            .arg(&self.dlse)
            .arg(&self.lambda)
            .arg(&self.edges)
            .arg(&self.delta_fixed)
            .arg(&self.cap)
            .arg(&self.counter)
            .arg(&self.overflow)
            .arg(&self.row_off)
            .arg(&self.row_cnt)
            .arg(&self.recs_end)
            .arg(&self.kept)
            .arg(&self.dropped)
            .arg(&self.tau)
            .arg(&self.flags)
            .arg(&self.row0)
            .arg(&self.tile.0)
            .arg(&self.tile.1)
            .arg(&self.tile.2)
            .arg(&self.loss)
            .arg(&self.gap_hist)
            .arg(&self.use_gap);
    }
}
