//! The row kernels (`kernels/forward.cu` (2), `kernels/rows.cu`): the forward rows, `G` in
//! place, the target's entry of a 16-bit `G`, the per-row arguments they share.

use super::exec::CallPtrs;
use super::schedule::{self, Schedule};
use super::*;

/// Threads per block of the kernels (must match the `#define`s in `forward.cu` and `rows.cu`).
pub(super) const FWD_THREADS: u32 = 256;
pub(super) const BWD_THREADS: u32 = 512;
pub(super) const FUSED_THREADS: u32 = 512;
pub(super) const COLSUM_THREADS: u32 = 256;

/// Threads (one warp per row) of `cce_dense_target_fix_*`.
pub(super) const TFIX_THREADS: u32 = 256;

/// Per-row arrays and scalars the row kernels share (device addresses of `[N]` arrays, 0 =
/// absent; kernels get them offset to their chunk).
#[derive(Clone, Copy)]
pub(super) struct RowArgs {
    pub(super) ld: i64,
    pub(super) v: i32,
    pub(super) bias: u64,
    pub(super) softcap: f32,
    pub(super) alpha: f32,
    pub(super) lambda: f32,
    pub(super) targets: u64,
    /// Forward outputs: f32 lse, f32 `1 − p_y`, f32 per-row loss, entropy, argmax.
    pub(super) lse: u64,
    pub(super) rest: u64,
    pub(super) loss_rows: u64,
    pub(super) entropy: u64,
    pub(super) argmax: u64,
}

impl RowArgs {
    /// The per-row arrays (targets, lse, rest, loss, entropy, argmax) offset to row `r0`
    /// (absent ones stay 0).
    pub(super) fn rows_at(&self, r0: usize) -> (u64, u64, u64, u64, u64, u64) {
        let off4 = (r0 * 4) as u64;
        let at = |p: u64| if p != 0 { p + off4 } else { 0 };
        (
            at(self.targets),
            at(self.lse),
            at(self.rest),
            at(self.loss_rows),
            at(self.entropy),
            at(self.argmax),
        )
    }
}

impl DenseEngine {
    /// Step (2), the forward row kernel, for rows `r0..r0 + rows` of logits at `l_ptr`.
    pub(super) fn fwd_rows(
        &self,
        f: &CudaFunction,
        a: &RowArgs,
        r0: usize,
        rows: usize,
        l_ptr: u64,
    ) -> Result<()> {
        let (t_r, lse_r, rest_r, loss_r, ent_r, am_r) = a.rows_at(r0);
        let params = FwdParams {
            l: l_ptr,
            ld: a.ld,
            v: a.v,
            bias: a.bias,
            softcap: a.softcap,
            targets: t_r,
            alpha: a.alpha,
            lambda: a.lambda,
            lse: lse_r,
            rest: rest_r,
            loss: loss_r,
            entropy: ent_r,
            argmax: am_r,
        };
        let cfg_l = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (FWD_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: FwdParams is FWD_PARAMS in forward.cu; L holds rows x ld f32 written by the
        // logits GEMM before this launch (stream order); the [N] outputs (checked sizes) are
        // offset to the chunk and hold its rows.
        unsafe { self.launch_params(&self.stream, f, cfg_l, &params) }
    }

    /// Step (4'), `cce_dense_target_fix_*` for rows `rows` of a chunk whose 16-bit `G` (`g16`:
    /// 1 f16, 2 bf16; row stride `g_ld` elements; stored times `1 / row_scale` when `rs` ≠ 0)
    /// the d_e product has read: adds the rounding residual of each row's target entry times
    /// `c_y` to the chunk's `d_e` rows (`d_e`, in `out_ty`). The per-row arrays are offset to
    /// the chunk; `e_r` is the chunk's first row of `e`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn target_fix(
        &self,
        code: &str,
        (g, g_ld, g16, rs): (u64, usize, i32, u64),
        (rows, t_r, lse_r, rest_r): (usize, u64, u64, u64),
        (dl_r, dl_scalar, dlse_r): (u64, f32, u64),
        (alpha, lambda, v_i, softcap, bias): (f32, f32, i32, f32, u64),
        (e_r, c, d): (u64, u64, usize),
        (d_e, out_ty): (u64, DType),
    ) -> Result<()> {
        let f = self.func(&format!("cce_dense_target_fix_{code}"))?;
        let out_kind: i32 = match out_ty {
            DType::F32 => 0,
            DType::F16 => 1,
            _ => 2,
        };
        let per_block = TFIX_THREADS as usize / 32;
        let params = TargetFixParams {
            g,
            g_ld: g_ld as i64,
            g16,
            row_scale: rs,
            targets: t_r,
            lse: lse_r,
            rest: rest_r,
            dl_rows: dl_r,
            dl_scalar,
            dlse: dlse_r,
            alpha,
            lambda,
            v: v_i,
            softcap,
            bias,
            e: e_r,
            c,
            d: to_i32(d, "D")?,
            d_e,
            out_kind,
            rows: to_i32(rows, "rows")?,
        };
        let launch = LaunchConfig {
            grid_dim: (rows.div_ceil(per_block) as u32, 1, 1),
            block_dim: (TFIX_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: TargetFixParams is TFIX_PARAMS in rows.cu; G holds `rows` rows of `g_ld`
        // 16-bit values (the chunk's G, written by the row kernels and read by the d_e product
        // before this launch, stream order; targets < V ≤ g_ld); row_scale 0 or `rows` f32;
        // the per-row arrays and e_r hold the chunk's rows ([N] buffers checked by `run`,
        // offset to the chunk); c V x D and bias V values of the input dtype; d_e holds the
        // chunk's rows x D in out_ty; one warp per row < rows.
        unsafe { self.launch_params(&self.stream, f, launch, &params) }
    }
}

kernel_params! {
    /// `FWD_PARAMS` of `cce_dense_fwd_*` (`kernels/forward.cu`); the per-row arrays offset to
    /// the chunk.
    FwdParams {
        l: u64,
        ld: i64,
        v: i32,
        bias: u64,
        softcap: f32,
        targets: u64,
        alpha: f32,
        lambda: f32,
        lse: u64,
        rest: u64,
        loss: u64,
        entropy: u64,
        argmax: u64,
    }
}

kernel_params! {
    /// `TFIX_PARAMS` of `cce_dense_target_fix_*` (`kernels/rows.cu`): the chunk's 16-bit `G`
    /// (`g16`: 1 f16, 2 bf16; stored times `1 / row_scale` when `row_scale` ≠ 0), its rows'
    /// arrays, the coefficients, `e`'s chunk rows and `c`, the `d_e` rows (`out_kind`: 0 f32,
    /// 1 f16, 2 bf16).
    TargetFixParams {
        g: u64,
        g_ld: i64,
        g16: i32,
        row_scale: u64,
        targets: u64,
        lse: u64,
        rest: u64,
        dl_rows: u64,
        dl_scalar: f32,
        dlse: u64,
        alpha: f32,
        lambda: f32,
        v: i32,
        softcap: f32,
        bias: u64,
        e: u64,
        c: u64,
        d: i32,
        d_e: u64,
        out_kind: i32,
        rows: i32,
    }
}

impl RowArgs {
    /// The row kernels' arguments of a call with row stride `ld` and buffers `p`.
    pub(super) fn of_call(cfg: &DenseConfig, ld: usize, p: &CallPtrs) -> Result<Self> {
        Ok(Self {
            ld: ld as i64,
            v: to_i32(cfg.v, "V")?,
            bias: p.bias,
            softcap: cfg.softcap.unwrap_or(0.0),
            alpha: cfg.label_smoothing,
            lambda: cfg.z_loss,
            targets: p.targets,
            lse: p.lse,
            rest: p.rest,
            loss_rows: p.loss_rows,
            entropy: p.entropy,
            argmax: p.argmax,
        })
    }
}

/// The filter's arguments of the backward row kernels: on (1) or off, the bin edges, the
/// fixed-point dropped-mass bound, the statistics buffers (chunk-relative kept and dropped,
/// the tile flags), the row's first index and the plan's tiles.
#[derive(Clone, Copy)]
pub(super) struct FilterArgs {
    pub(super) on: i32,
    pub(super) edges: u64,
    pub(super) delta_fixed: u64,
    pub(super) kept: u64,
    pub(super) dropped: u64,
    pub(super) flags: u64,
    pub(super) row0: i64,
    pub(super) tile: (i32, i32, i32),
}

impl FilterArgs {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
        b.arg(&self.on).arg(&self.edges).arg(&self.delta_fixed);
    }

    fn push_stats<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
        b.arg(&self.kept).arg(&self.dropped).arg(&self.flags);
    }

    fn push_tiles<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
        b.arg(&self.row0)
            .arg(&self.tile.0)
            .arg(&self.tile.1)
            .arg(&self.tile.2);
    }
}

/// `FUSED_PARAMS` of `cce_dense_fused_*` (`kernels/rows.cu`); the per-row arrays offset to
/// the chunk.
pub(super) struct FusedParams {
    pub(super) l: u64,
    pub(super) ld: i64,
    pub(super) v: i32,
    pub(super) slice: i32,
    pub(super) bias: u64,
    pub(super) softcap: f32,
    pub(super) targets: u64,
    pub(super) alpha: f32,
    pub(super) lambda: f32,
    pub(super) dl_rows: u64,
    pub(super) dl_scalar: f32,
    pub(super) dlse: u64,
    pub(super) filter: FilterArgs,
    pub(super) lse: u64,
    pub(super) rest: u64,
    pub(super) loss: u64,
    pub(super) entropy: u64,
    pub(super) argmax: u64,
}

impl KernelParams for FusedParams {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
        b.arg(&self.l)
            .arg(&self.ld)
            .arg(&self.v)
            .arg(&self.slice)
            .arg(&self.bias)
            .arg(&self.softcap)
            .arg(&self.targets)
            .arg(&self.alpha)
            .arg(&self.lambda)
            .arg(&self.dl_rows)
            .arg(&self.dl_scalar)
            .arg(&self.dlse);
        self.filter.push(b);
        b.arg(&self.lse)
            .arg(&self.rest)
            .arg(&self.loss)
            .arg(&self.entropy)
            .arg(&self.argmax);
        self.filter.push_stats(b);
        self.filter.push_tiles(b);
    }
}

/// `BWD_PARAMS` of `cce_dense_bwd_*` (`kernels/rows.cu`); the per-row arrays offset to the
/// chunk.
pub(super) struct BwdParams {
    pub(super) l: u64,
    pub(super) ld: i64,
    pub(super) v: i32,
    pub(super) bias: u64,
    pub(super) softcap: f32,
    pub(super) targets: u64,
    pub(super) lse: u64,
    pub(super) rest: u64,
    pub(super) dl_rows: u64,
    pub(super) dl_scalar: f32,
    pub(super) dlse: u64,
    pub(super) alpha: f32,
    pub(super) lambda: f32,
    pub(super) filter: FilterArgs,
    /// f32 `[rows]` thresholds out (split dense), or 0.
    pub(super) tau: u64,
    /// f32 `[rows]` per-row scales of f16 `G` (`g_mode` 2), or 0.
    pub(super) row_scale: u64,
}

impl KernelParams for BwdParams {
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
            .arg(&self.alpha)
            .arg(&self.lambda);
        self.filter.push(b);
        self.filter.push_stats(b);
        self.filter.push_tiles(b);
        b.arg(&self.tau).arg(&self.row_scale);
    }
}

/// `COLSUM_PARAMS` of `cce_dense_colsum_*` (`kernels/rows.cu`): `acc[j] += *scale · Σ_rows
/// G[r, j]` over `cols` columns.
pub(super) struct ColsumParams {
    pub(super) g: u64,
    pub(super) ldg: i64,
    pub(super) rows: i32,
    pub(super) cols: i32,
    pub(super) acc: u64,
    /// `const float*`: the f32 factor in device memory, or 0 (1).
    pub(super) scale: u64,
}

impl KernelParams for ColsumParams {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
        b.arg(&self.g)
            .arg(&self.ldg)
            .arg(&self.rows)
            .arg(&self.cols)
            .arg(&self.acc)
            .arg(&self.scale);
    }
}

/// One row chunk: its first row, its rows, whether its logits and forward rows are already
/// in place (a sparse probe's), its index.
#[derive(Clone, Copy)]
struct Chunk {
    r0: usize,
    rows: usize,
    reused: bool,
    index: usize,
}

/// What every row chunk of a call shares.
struct RowPassCtx<'a> {
    cfg: &'a DenseConfig,
    sched: &'a Schedule,
    p: &'a CallPtrs,
    a: &'a RowArgs,
    code: &'static str,
    /// `G`'s row stride in elements written over the f32 logits (`ld·4 / sizeof(G)`).
    ldg: usize,
    f_fwd: &'a CudaFunction,
    f_bwd: &'a CudaFunction,
    f_colsum: &'a CudaFunction,
    /// `c` for the f16 `d_e` product (the f16 copy of bf16 `c`) and the device address of
    /// the f32 factor undoing its scale (0: none, 1).
    c_de: (u64, u64),
    /// f32 `d_e` rows and per-row scales of the f16 `d_e` product.
    tmp: u64,
    rs: u64,
    /// The WGMMA row pass's map of `c`, when it runs.
    wg: Option<TmaDesc>,
    filter_on: i32,
    delta_fixed: u64,
    tile: (i32, i32, i32),
}

impl DenseEngine {
    /// The row chunks of the dense passes (steps 1-5 per chunk, module docs), with split
    /// dense's f16 copy of `c` first and the WGMMA row pass where the schedule has it; its
    /// note in `stats`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn row_pass(
        &self,
        cfg: &DenseConfig,
        ws: &mut DenseWorkspace,
        inp: &DenseInputs<'_>,
        sched: &Schedule,
        p: &CallPtrs,
        a: &RowArgs,
        chunks: &[(usize, usize, bool)],
        sparse_used: bool,
        stats: &mut DenseStats,
    ) -> Result<()> {
        let dt = cfg.dtype;
        let code = dtype_code(dt)?;
        let layout = cfg.row_layout();
        let f_fwd = self.func(&format!("cce_dense_fwd_{code}"))?;
        let f_bwd = self.func(&match sched.g_mode {
            2 => format!("cce_dense_bwd_f16s_{code}"),
            _ => format!("cce_dense_bwd_{code}"),
        })?;
        // Split dense, f16 G for d_e: c in f16 (bf16 inputs: a copy scaled by 2^kc, its 2^−kc
        // in device memory).
        let c_de = if sched.c16_copy && !sparse_used {
            let down = self.c16_copy(cfg, ws, inp.c, p.ws_base + layout.c16 as u64)?;
            (p.ws_base + layout.c16 as u64, down)
        } else {
            (p.c, 0)
        };
        let f_colsum = self.func(&format!("cce_dense_colsum_{code}"))?;
        let wg = match (sched.row_wgmma, chunks.iter().any(|c| !c.2)) {
            (Some(verdict), true) => {
                let wg_chunks = chunks.iter().filter(|c| !c.2).count();
                let rows = cfg.wgmma_chunk_rows();
                stats.row_pass_note = Some(schedule::row_pass_note(verdict, wg_chunks, rows));
                if verdict.is_ok() {
                    // The row kernels write every row's τ (0: split dense's row pass never
                    // filters), which the cuBLAS class pass reads; these chunks write none,
                    // so zero them all (a sparse probe may have left thresholds there).
                    self.stream.memset_zeros(&mut ws.tau).map_err(drv)?;
                    Some(self.tensor_map(dt, p.c, cfg.v, cfg.d, WGMMA_BN)?)
                } else {
                    None
                }
            }
            _ => None,
        };
        let ctx = RowPassCtx {
            cfg,
            sched,
            p,
            a,
            code,
            ldg: ws.ld * 4 / cfg.g_dtype().size_bytes(),
            f_fwd,
            f_bwd,
            f_colsum,
            c_de,
            tmp: p.ws_base + layout.tmp as u64,
            rs: p.ws_base + layout.rs as u64,
            wg,
            filter_on: sched.filtering as i32,
            delta_fixed: (cfg.filter.max_dropped_mass as f64 * cce_core::filter::FIXED_POINT_ONE)
                .floor() as u64,
            tile: super::exec::tile_args(cfg)?,
        };
        let mut prof = if chunks.is_empty() {
            None
        } else {
            PhaseTimer::new(&self.stream, self.switches.profile)?
        };
        for (index, &(r0, rows, reused)) in chunks.iter().enumerate() {
            let ch = Chunk {
                r0,
                rows,
                reused,
                index,
            };
            let (ldg_c, g16) = self.chunk_g(&ctx, ws, ch, &mut prof)?;
            if sched.kind.backward() {
                self.chunk_products(&ctx, ch, ws.ld, (ldg_c, g16), &mut prof)?;
            }
        }
        PhaseTimer::report(prof, &format!("dense row pass ({} chunk(s))", chunks.len()))
    }

    /// Steps 1-3 of a chunk: the logits (unless in place), the forward rows and `G` in place
    /// (the row kernels, the fused kernel or the WGMMA row pass). Returns `G`'s row stride in
    /// elements and, where `G` is f16 for `d_c` (`Schedule::row_g16`), its factors and the
    /// f16 copy of the chunk's `e`.
    fn chunk_g(
        &self,
        x: &RowPassCtx<'_>,
        ws: &mut DenseWorkspace,
        ch: Chunk,
        prof: &mut Option<PhaseTimer>,
    ) -> Result<(usize, Option<(DeviceScales, u64)>)> {
        let ld = ws.ld;
        let (cfg, p) = (x.cfg, x.p);
        let (d, v) = (cfg.d, cfg.v);
        let e_r = p.e + (ch.r0 * d * cfg.dtype.size_bytes()) as u64;
        // The WGMMA row pass's map, for the chunks it takes (not one whose logits are there).
        let wg_tm = if ch.reused { None } else { x.wg.as_ref() };
        if wg_tm.is_none() && !ch.reused {
            // (1) logits.
            self.gemm_logits((v, d, ch.rows), cfg.dtype, (p.c, e_r, p.l_ptr), ld)?;
            PhaseTimer::mark(prof, "logits GEMM")?;
        }
        if let Some(tm_c) = wg_tm {
            // (1)+(2)+(3): logits, lse and G without f32 logits.
            let up = (p.saved_lse, p.saved_rest, p.dl_rows, p.dl_scalar, p.dlse);
            let at = (ch.r0, ch.rows, x.cfg.wgmma_chunk_rows(), x.sched.row_g16);
            let ptrs = (e_r, p.c, p.l_ptr, ld);
            let g16 = self.row_pass_wgmma(cfg, ws, tm_c, at, ptrs, x.a, up, prof)?;
            // G's row stride: ld (16-bit q then G, rows of ld·2 bytes).
            return Ok((ld, g16));
        }
        if let Some((cs, slice)) = x.sched.fused {
            // (2)+(3) fused.
            self.launch_fused(x, ch, (cs, slice))?;
            PhaseTimer::mark(prof, "fused rows")?;
            return Ok((x.ldg, None));
        }
        if x.sched.kind.forward() && !ch.reused {
            // (2) forward rows.
            self.fwd_rows(x.f_fwd, x.a, ch.r0, ch.rows, p.l_ptr)?;
            PhaseTimer::mark(prof, "forward rows")?;
        }
        if x.sched.kind.backward() {
            // (3) G in place.
            self.launch_bwd_rows(x, ch)?;
            PhaseTimer::mark(prof, "backward rows (G)")?;
        }
        Ok((x.ldg, None))
    }

    /// The filter arguments of a chunk's row kernels.
    fn filter_args(&self, x: &RowPassCtx<'_>, r0: usize) -> FilterArgs {
        let off4 = (r0 * 4) as u64;
        FilterArgs {
            on: x.filter_on,
            edges: x.p.edges,
            delta_fixed: x.delta_fixed,
            kept: x.p.kept + off4,
            dropped: x.p.dropped + off4,
            flags: x.p.flags,
            row0: r0 as i64,
            tile: x.tile,
        }
    }

    /// `cce_dense_fused_*` over a chunk: the forward rows and `G` in one read, the row in the
    /// shared memory of a cluster of `cs` blocks of `slice` columns each.
    fn launch_fused(
        &self,
        x: &RowPassCtx<'_>,
        ch: Chunk,
        (cs, slice): (usize, usize),
    ) -> Result<()> {
        let (p, a) = (x.p, x.a);
        let f = self.func(&format!("cce_dense_fused_{}_c{cs}", x.code))?;
        let off4 = (ch.r0 * 4) as u64;
        let at = |ptr: u64| if ptr != 0 { ptr + off4 } else { 0 };
        let params = FusedParams {
            l: p.l_ptr,
            ld: a.ld,
            v: a.v,
            slice: slice as i32,
            bias: p.bias,
            softcap: a.softcap,
            targets: p.targets + off4,
            alpha: a.alpha,
            lambda: a.lambda,
            dl_rows: at(p.dl_rows),
            dl_scalar: p.dl_scalar,
            dlse: at(p.dlse),
            filter: self.filter_args(x, ch.r0),
            lse: p.lse + off4,
            rest: p.rest + off4,
            loss: p.loss_rows + off4,
            entropy: at(p.entropy),
            argmax: at(p.argmax),
        };
        let cfg_l = LaunchConfig {
            grid_dim: (ch.rows as u32 * cs as u32, 1, 1),
            block_dim: (FUSED_THREADS, 1, 1),
            shared_mem_bytes: (slice * 4) as u32,
        };
        // SAFETY: FusedParams is FUSED_PARAMS in rows.cu; every pointer is a live device
        // buffer of the checked size (the chunk's rows of the [N] arrays start at offset r0);
        // the grid is rows·cs blocks, a multiple of the compile-time cluster size; dynamic
        // shared memory slice·4 ≤ the attribute set at construction.
        unsafe { self.launch_params(&self.stream, f, cfg_l, &params) }
    }

    /// `cce_dense_bwd_*` over a chunk: `G` in place over its logits from the saved lse.
    fn launch_bwd_rows(&self, x: &RowPassCtx<'_>, ch: Chunk) -> Result<()> {
        let (p, a) = (x.p, x.a);
        let off4 = (ch.r0 * 4) as u64;
        let params = BwdParams {
            l: p.l_ptr,
            ld: a.ld,
            v: a.v,
            bias: p.bias,
            softcap: a.softcap,
            targets: p.targets + off4,
            lse: p.saved_lse + off4,
            rest: p.saved_rest + off4,
            dl_rows: if p.dl_rows != 0 { p.dl_rows + off4 } else { 0 },
            dl_scalar: p.dl_scalar,
            dlse: if p.dlse != 0 { p.dlse + off4 } else { 0 },
            alpha: a.alpha,
            lambda: a.lambda,
            filter: self.filter_args(x, ch.r0),
            tau: if x.sched.split { p.tau + off4 } else { 0 },
            row_scale: if x.sched.g_mode == 2 { x.rs } else { 0 },
        };
        let cfg_l = LaunchConfig {
            grid_dim: (ch.rows as u32, 1, 1),
            block_dim: (BWD_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: BwdParams is BWD_PARAMS in rows.cu; L holds the chunk's logits (stream
        // order); lse rows were written by the forward kernel before or given by the caller
        // ([N] checked); flags hold row_tiles x class_tiles; tau [N] (split dense, checked) and
        // the row scales (rows f32 in the scratch's row layout) are offset to the chunk.
        unsafe { self.launch_params(&self.stream, x.f_bwd, cfg_l, &params) }
    }

    /// Steps 4-6 of a chunk: `d_e` rows (and the target's entry of a 16-bit `G`), chunked
    /// dense's `d_c` and `d_bias` accumulation. With `g16` (f16 `G` for `d_c`, its factors
    /// and the f16 copy of the chunk's `e`), `d_c` and `d_bias` come first, then `G` turns
    /// into bf16 for `d_e`.
    fn chunk_products(
        &self,
        x: &RowPassCtx<'_>,
        ch: Chunk,
        ld: usize,
        (ldg_c, g16): (usize, Option<(DeviceScales, u64)>),
        prof: &mut Option<PhaseTimer>,
    ) -> Result<()> {
        let (cfg, p) = (x.cfg, x.p);
        let (d, v, dt) = (cfg.d, cfg.v, cfg.dtype);
        let (g_ty, out_ty) = (cfg.g_dtype(), cfg.grad_dtype());
        let e_r = p.e + (ch.r0 * d * dt.size_bytes()) as u64;
        // Accumulating calls add every product to the outputs' contents (f32 outputs).
        let acc = x.sched.accumulate;
        if let Some((s, e16)) = g16 {
            self.chunk_dc_f16(x, ch, ldg_c, (s, e16))?;
            PhaseTimer::mark(prof, "d_c GEMM from f16 G (+ d_bias)")?;
            if cfg.compute_d_e {
                self.g16_to_bf16(p.l_ptr, (ch.rows, ldg_c, v.div_ceil(8) * 8), s.down_g())?;
                PhaseTimer::mark(prof, "G to bf16")?;
            }
        }
        if cfg.compute_d_e {
            // (4) d_e rows of the chunk.
            let de_r = p.d_e + (ch.r0 * d * out_ty.size_bytes()) as u64;
            if x.sched.g_mode == 0 {
                self.gemm_de(
                    (v, d, ch.rows),
                    (dt, g_ty, out_ty),
                    (p.c, p.l_ptr, de_r),
                    ldg_c,
                    (1.0, if acc { 1.0 } else { 0.0 }),
                )?;
            } else {
                // f16 G' (scaled per row) times c in f16 into f32 rows, then
                // d_e = rows · 2^−s_i · 2^−kc in the gradient dtype.
                self.gemm(
                    false,
                    false,
                    (d, ch.rows, v),
                    (x.c_de.0, DType::F16, d),
                    (p.l_ptr, DType::F16, ld * 2),
                    (1.0, 0.0),
                    (x.tmp, DType::F32, d),
                )?;
                self.de_finish(out_ty, x.tmp, x.rs, x.c_de.1, (de_r, acc), (ch.rows, d))?;
            }
            PhaseTimer::mark(prof, "d_e GEMM")?;
            if dt != DType::F32 {
                // (4') the target's entry of the 16-bit G, exact in d_e (an addition to the
                // rows the product wrote: the same with and without accumulation).
                self.chunk_target_fix(x, ch, (ld, ldg_c), (e_r, de_r))?;
                PhaseTimer::mark(prof, "d_e target entry")?;
            }
        }
        // (5) d_c += Gᵀ E_r, (6) d_bias (chunked dense; split dense: the class pass). The
        // first chunk overwrites the accumulator unless the call accumulates into the output;
        // the accumulator is f32 or, with `dc_in_grad_dtype`, the caller's d_c.
        if cfg.compute_d_c && !x.sched.split && g16.is_none() {
            let beta = if ch.index == 0 && !acc { 0.0 } else { 1.0 };
            let dims = (v, d, ch.rows);
            let tys = (dt, g_ty, cfg.dc_acc_dtype());
            self.gemm_dc(dims, tys, (e_r, p.l_ptr, p.dc_acc), ldg_c, (1.0, beta))?;
            if cfg.has_bias {
                self.chunk_dbias(x, x.f_colsum, ch, ldg_c, 0)?;
            }
            PhaseTimer::mark(prof, "d_c GEMM (+ d_bias)")?;
        }
        Ok(())
    }

    /// Steps (5), (6) of a chunk whose `G` is f16 times `2^kg` (`Schedule::row_g16`):
    /// `d_c += 2^(−ke−kg) · Gᵀ · E16` against the f16 copy `e16` of its rows of `e` (times
    /// `2^ke`), alpha and beta read from the chunk's scale set (cuBLAS's device pointer mode;
    /// beta 0 for the first chunk of a call that does not accumulate), and `d_bias +=
    /// 2^−kg · Σ_rows G`.
    fn chunk_dc_f16(
        &self,
        x: &RowPassCtx<'_>,
        ch: Chunk,
        ldg: usize,
        (s, e16): (DeviceScales, u64),
    ) -> Result<()> {
        let (cfg, p) = (x.cfg, x.p);
        let first = ch.index == 0 && !x.sched.accumulate;
        let scalars = GemmScalars::Device {
            alpha: s.down_xg(),
            beta: if first { s.zero() } else { s.one() },
        };
        let dims = (cfg.v, cfg.d, ch.rows);
        let tys = (DType::F16, DType::F16, DType::F32);
        self.gemm_dc(dims, tys, (e16, p.l_ptr, p.dc_acc), ldg, scalars)?;
        if cfg.has_bias {
            self.chunk_dbias(x, self.func("cce_dense_colsum_f16")?, ch, ldg, s.down_g())?;
        }
        Ok(())
    }

    /// Step (6) of a chunk: `d_bias += scale · Σ_rows G` by `f` (`cce_dense_colsum_*` of `G`'s
    /// dtype) over the chunk's `G` (row stride `ldg` elements); `scale` a device f32 of the
    /// workspace's scale sets, or 0 for 1.
    fn chunk_dbias(
        &self,
        x: &RowPassCtx<'_>,
        f: &CudaFunction,
        ch: Chunk,
        ldg: usize,
        scale: u64,
    ) -> Result<()> {
        let params = ColsumParams {
            g: x.p.l_ptr,
            ldg: ldg as i64,
            rows: ch.rows as i32,
            cols: x.a.v,
            acc: x.p.dbias_acc,
            scale,
        };
        let cfg_l = LaunchConfig {
            grid_dim: (x.cfg.v.div_ceil(COLSUM_THREADS as usize) as u32, 1, 1),
            block_dim: (COLSUM_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: ColsumParams is COLSUM_PARAMS; G is rows x ldg of f's dtype, written by the
        // row kernels or the WGMMA row pass before (stream order); the accumulator holds V f32
        // (zeroed, or the caller's f32 d_bias when accumulating); scale is 0 (the kernel reads
        // no factor: 1) or one f32 of ws.scales written before on this stream.
        unsafe { self.launch_params(&self.stream, f, cfg_l, &params) }
    }

    /// Step (4') of a chunk: the rounding residual of each row's target entry of the 16-bit
    /// `G` (row stride `ldg_c`, or the f16 `G` of `g_mode` 2 with stride `2·ld`) times `c_y`,
    /// added to its `d_e` rows at `de_r`.
    fn chunk_target_fix(
        &self,
        x: &RowPassCtx<'_>,
        ch: Chunk,
        (ld, ldg_c): (usize, usize),
        (e_r, de_r): (u64, u64),
    ) -> Result<()> {
        let (cfg, p, a) = (x.cfg, x.p, x.a);
        let f16_g = x.sched.g_mode == 2;
        let g16 = if f16_g || cfg.dtype == DType::F16 {
            1
        } else {
            2
        };
        let (g_ld, rs) = if f16_g { (ld * 2, x.rs) } else { (ldg_c, 0u64) };
        let off4 = (ch.r0 * 4) as u64;
        let at = |ptr: u64| if ptr != 0 { ptr + off4 } else { 0 };
        self.target_fix(
            x.code,
            (p.l_ptr, g_ld, g16, rs),
            (
                ch.rows,
                p.targets + off4,
                p.saved_lse + off4,
                p.saved_rest + off4,
            ),
            (at(p.dl_rows), p.dl_scalar, at(p.dlse)),
            (a.alpha, a.lambda, a.v, a.softcap, p.bias),
            (e_r, p.c, cfg.d),
            (de_r, cfg.grad_dtype()),
        )
    }
}
