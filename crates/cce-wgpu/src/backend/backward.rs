//! The backward pass: row state (and the filter's thresholds), `d_e` row-owned, `d_c` and
//! `d_bias` class-owned, then the filter statistics. The `d_e` and `d_c` passes sum their
//! splits in per-split slabs or through f32 atomics into one slab (`config::accumulation`).

use super::interop::BackwardDest;
use super::{dtype_code, split, tile_params, tiles, u32c, WgpuBackend, ROW_STATE_BYTES};
use crate::buffers::WgpuTensor;
use crate::config::{accumulation, bwd_splits, coop_backward, Accumulation};
use crate::pipelines::{flags, Params, ShaderKind};
use crate::status::{self, Finding, ROW_CHECKS, STATUS_BYTES};
use cce_core::filter::{FilterRule, FIXED_POINT_ONE, N_BINS};
use cce_core::{
    BackwardOutput, CceError, DLoss, DType, GradDType, Inputs, Options, Reduction, Result, Saved,
    TensorMeta, Upstream,
};
use std::ops::Range;

impl WgpuBackend {
    #[allow(clippy::too_many_lines)]
    pub(super) fn backward_impl(
        &self,
        inputs: &Inputs<'_, WgpuTensor>,
        opts: &Options,
        saved: Saved<'_, WgpuTensor>,
        upstream: &Upstream<'_, WgpuTensor>,
        dest: &BackwardDest,
    ) -> Result<BackwardOutput<WgpuTensor>> {
        let lse = saved.lse;
        let prep = self.prepare(inputs, opts)?;
        let inputs = &prep.inputs(inputs);
        let p = prep.problem;
        let plan = &prep.plan;
        let rule: FilterRule = plan.filter;
        let (n, d, v) = (p.n, p.d, p.v);
        let t = self.t();
        let dt = dtype_code(p.dtype);
        let es = p.dtype.size_bytes() as u64;
        let ctx = &self.ctx;
        let check_rows = |b: &WgpuTensor, what: &'static str| -> Result<()> {
            ctx.check_own(b, what)?;
            if b.shape().iter().product::<usize>() != n || b.dtype() != DType::F32 {
                return Err(CceError::ShapeMismatch {
                    what,
                    expected: format!("[{n}] f32"),
                    got: format!("{:?} {}", b.shape(), b.dtype()),
                });
            }
            Ok(())
        };
        check_rows(lse, "lse")?;
        check_rows(saved.rest_mass, "rest_mass")?;
        let bad_dloss = |what: &str| CceError::ShapeMismatch {
            what: "d_loss",
            expected: format!("per-row [{n}] f32 for reduction none, a scalar otherwise"),
            got: format!("{what} with reduction {:?}", opts.reduction),
        };
        let (g_scalar, dloss_rows) = match upstream.d_loss {
            DLoss::Scalar(_) if opts.reduction == Reduction::None => {
                return Err(bad_dloss("scalar"));
            }
            DLoss::Scalar(g) => {
                cce_core::problem::check_upstream_finite("d_loss", [g])?;
                let g = match opts.reduction {
                    Reduction::Mean if prep.n_valid > 0 => g / prep.n_valid as f32,
                    // `prepare` has rejected a mean over no valid row (`PreparedTargets::new`).
                    Reduction::Mean => return Err(CceError::all_targets_ignored(n, opts)),
                    _ => g,
                };
                (g, None)
            }
            DLoss::PerRow(_) if opts.reduction != Reduction::None => {
                return Err(bad_dloss("per-row tensor"));
            }
            DLoss::PerRow(b) => {
                check_rows(b, "d_loss")?;
                (0.0, Some(b))
            }
        };
        if let Some(h) = upstream.d_lse {
            check_rows(h, "d_lse")?;
        }
        let out_dtype = if opts.grad_dtype == GradDType::F32 {
            DType::F32
        } else {
            p.dtype
        };
        let out_dt = dtype_code(out_dtype);
        let want_de = opts.compute_d_e;
        let want_dc = opts.compute_d_c;
        let ls_analytic = rule.label_smoothing_analytic && opts.label_smoothing > 0.0;
        let filter_e = rule.filter_e_grad && want_de;
        let filter_c = rule.filter_c_grad && want_dc;
        let need_hist = filter_e || filter_c;
        let max_rc = plan.row_chunks.iter().map(|r| r.len()).max().unwrap_or(1);
        let max_cc = plan.class_chunks.iter().map(|c| c.len()).max().unwrap_or(1);
        let budget = opts.workspace_budget_bytes;

        // Per-row state, threshold histogram, dropped mass, counters.
        let rs = ctx.raw_buffer(ROW_STATE_BYTES * n as u64, "row state")?;
        let hist = if need_hist {
            Some(ctx.raw_buffer(4 * (N_BINS * n) as u64, "histogram")?)
        } else {
            None
        };
        let edges: Vec<f32> = (0..N_BINS).map(|k| rule.edge(k)).collect();
        let edges_b = ctx.upload_bytes(bytemuck::cast_slice(&edges), "edges")?;
        let dropped = ctx.raw_buffer(4 * n as u64, "dropped mass")?;
        let stat = ctx.raw_buffer(8, "dropped stats")?;
        // Under check_finite, what `bwd_prep` and `finalize` find non-finite (`crate::status`).
        let status = ctx.upload_bytes(bytemuck::cast_slice(&status::initial()), "status")?;
        let mut workspace = rs.size() + hist.as_ref().map_or(0, |h| h.size()) + dropped.size();

        // Splits and slabs: one slab per split within the budget, or one slab per chunk that
        // the splits add into atomically (`config::accumulation`).
        let acc = accumulation(ctx.float_atomics(), opts.deterministic);
        let atomic = acc == Accumulation::Atomic;
        // The atomic adds through subgroup shuffles where they apply (`config::coalesced_adds`);
        // each pass by cooperative matrices where it can (`config::coop_backward`).
        let (mut de_kind, mut dc_kind) = if atomic && self.has_coalesced_adds() {
            (ShaderKind::BwdDeAtomicCo, ShaderKind::BwdDcAtomicCo)
        } else if atomic {
            (ShaderKind::BwdDeAtomic, ShaderKind::BwdDcAtomic)
        } else {
            (ShaderKind::BwdDe, ShaderKind::BwdDc)
        };
        if coop_backward(&self.cfg, ctx.coop, dt, filter_e) {
            de_kind = if atomic {
                ShaderKind::BwdDeCoopAtomic
            } else {
                ShaderKind::BwdDeCoop
            };
        }
        if coop_backward(&self.cfg, ctx.coop, dt, filter_c) {
            dc_kind = if atomic {
                ShaderKind::BwdDcCoopAtomic
            } else {
                ShaderKind::BwdDcCoop
            };
        }
        // The passes' tiles: 128 for the cooperative-matrix ones, else the configuration's.
        let (t_de, t_dc) = (de_kind.tile(t), dc_kind.tile(t));
        let room = (budget.saturating_sub(workspace), ctx.max_binding());
        let target = self.cfg.target_workgroups;
        let de_split = bwd_splits(
            acc,
            target,
            (tiles(max_rc, t_de), tiles(max_cc, t_de)),
            (max_rc * d * 4) as u64,
            room,
        );
        let dc_split = bwd_splits(
            acc,
            target,
            (tiles(max_cc, t_dc), tiles(max_rc, t_dc)),
            (max_cc * d * 4) as u64,
            room,
        );
        // Splits per chunk (capped per workgroup), slabs, and counter slots: every workgroup of
        // the d_e and d_c passes.
        let bcap = self.cap_tiles(self.bwd_iters(d));
        let de_splits: Vec<(usize, usize)> = plan
            .class_chunks
            .iter()
            .map(|cc| split(tiles(cc.len(), t_de), de_split, bcap))
            .collect();
        let dc_splits: Vec<(usize, usize)> = plan
            .row_chunks
            .iter()
            .map(|rc| split(tiles(rc.len(), t_dc), dc_split, bcap))
            .collect();
        // Slabs: at most the budgeted split count; more splits run in waves over the same slabs
        // (`de_wave` / `dc_wave` splits per dispatch). The atomic modules add every split of a
        // chunk into one slab, in one dispatch (or waves of the grid's largest x extent).
        let max_splits = |s: &[(usize, usize)]| s.iter().map(|x| x.1).max().unwrap_or(1);
        let max_x = (ctx.limits.max_compute_workgroups_per_dimension as usize).max(1);
        let (de_slabs, de_wave) = if atomic {
            (1, max_splits(&de_splits).min(max_x))
        } else {
            let n = max_splits(&de_splits).min(de_split);
            (n, n)
        };
        let (dc_slabs, dc_wave) = if atomic {
            (1, max_splits(&dc_splits).min(max_x))
        } else {
            let n = max_splits(&dc_splits).min(dc_split);
            (n, n)
        };
        let mut de_slots = 0usize;
        let mut dc_slots = 0usize;
        for (ri, rc) in plan.row_chunks.iter().enumerate() {
            for (ci, cc) in plan.class_chunks.iter().enumerate() {
                de_slots += de_splits[ci].1 * tiles(rc.len(), t_de);
                dc_slots += dc_splits[ri].1 * tiles(cc.len(), t_dc);
            }
        }
        let n_slots = (if want_de { de_slots } else { 0 }) + (if want_dc { dc_slots } else { 0 });
        let counters = ctx.raw_buffer(16 * n_slots.max(1) as u64, "counters")?;
        workspace += counters.size();

        let d_e = if want_de {
            let shape = inputs.e.shape().to_vec();
            Some(self.grad_out(dest.d_e.as_ref(), shape, out_dtype, "d_e")?)
        } else {
            None
        };
        let d_c = if want_dc {
            Some(self.grad_out(dest.d_c.as_ref(), vec![v, d], out_dtype, "d_c")?)
        } else {
            None
        };
        let d_bias = if want_dc && p.has_bias {
            Some(self.grad_out(dest.d_bias.as_ref(), vec![v], out_dtype, "d_bias")?)
        } else {
            None
        };
        let csum = if ls_analytic && want_de {
            Some(ctx.raw_buffer(4 * (d + 1) as u64, "sum of c")?)
        } else {
            None
        };
        let esum = if ls_analytic && want_dc {
            Some(ctx.raw_buffer(4 * (d + 1) as u64, "sum of g e")?)
        } else {
            None
        };

        let base = self.base_params(&p, opts);
        let mut enc = self.encoder();
        // Per-row inputs as the passes bind them (views at unaligned offsets copied).
        let lse = self.row_in(&mut enc, lse, "lse")?;
        let rest_mass = self.row_in(&mut enc, saved.rest_mass, "rest_mass")?;
        let dloss_rows = match dloss_rows {
            Some(b) => Some(self.row_in(&mut enc, b, "d_loss")?),
            None => None,
        };
        let d_lse = match upstream.d_lse {
            Some(b) => Some(self.row_in(&mut enc, b, "d_lse")?),
            None => None,
        };

        // 1. Row state (and, with the filter, the threshold pass).
        {
            let mut pass = self.pass(&mut enc, "backward prep");
            for rc in &plan.row_chunks {
                let rows = rc.len();
                let mut f = 0;
                if dloss_rows.is_some() {
                    f |= flags::DLOSS_ROWS;
                }
                if d_lse.is_some() {
                    f |= flags::DLSE;
                }
                if ls_analytic {
                    f |= flags::LS_ANALYTIC;
                }
                let prm = Params {
                    n_rows: rows as u32,
                    row0: rc.start as u32,
                    flags: f,
                    aux: g_scalar,
                    ..base
                };
                let dl = match &dloss_rows {
                    Some(b) => ctx.aligned(b.as_ref(), rc.start as u64, rows as u64, 4)?,
                    None => ctx.whole(&ctx.dummy)?,
                };
                let dh = match &d_lse {
                    Some(b) => ctx.aligned(b.as_ref(), rc.start as u64, rows as u64, 4)?,
                    None => ctx.whole(&ctx.dummy)?,
                };
                self.run(
                    &mut pass,
                    ShaderKind::BwdPrep,
                    dt,
                    &prm,
                    &[
                        ctx.aligned(&prep.tgt, rc.start as u64, rows as u64, 4)?,
                        ctx.aligned(lse.as_ref(), rc.start as u64, rows as u64, 4)?,
                        dl,
                        dh,
                        ctx.aligned(&rs, rc.start as u64, rows as u64, ROW_STATE_BYTES)?,
                        ctx.aligned(rest_mass.as_ref(), rc.start as u64, rows as u64, 4)?,
                        ctx.whole(&status)?,
                    ],
                    Self::grid_1d(rows),
                )?;
            }
            if let Some(hist) = &hist {
                // The threshold pass at its own tiles where the config's leave its histogram
                // no room (`KernelConfig::hist_shape`; `check_cfg` found one that fits).
                let max_wgb = u64::from(ctx.limits.max_compute_workgroup_storage_size);
                let h_shape = self
                    .cfg
                    .hist_shape(max_wgb)
                    .ok_or_else(|| crate::context::backend_err("no threshold-pass shape fits"))?;
                let h_cfg = crate::KernelConfig {
                    wg: h_shape.0,
                    tk: h_shape.1,
                    ..self.cfg
                };
                let h_t = h_cfg.tile();
                let (splits, _) = self.class_splits_cfg(plan, h_t, &h_cfg)?;
                for rc in &plan.row_chunks {
                    let rows = rc.len();
                    let (e_b, e_off) =
                        ctx.range_vec(inputs.e, (rc.start * d) as u64, (rows * d) as u64, es)?;
                    let rs_b = ctx.aligned(&rs, rc.start as u64, rows as u64, ROW_STATE_BYTES)?;
                    let h_b = ctx.aligned(hist, rc.start as u64, rows as u64, 4 * N_BINS as u64)?;
                    for (ci, cc) in plan.class_chunks.iter().enumerate() {
                        let [(c_b, c_off), (b_b, b_off)] = self.class_chunk(inputs, cc, d, es)?;
                        let (per, nsplit, _) = splits[ci];
                        let prm = Params {
                            eps: rule.eps,
                            ..tile_params(base, rc, cc, [e_off, c_off, b_off], per)
                        };
                        self.run_at(
                            &mut pass,
                            ShaderKind::BwdHist,
                            dt,
                            h_shape,
                            &prm,
                            &[e_b, c_b, b_b, rs_b, ctx.whole(&edges_b)?, h_b],
                            [nsplit as u32, tiles(rows, h_t) as u32, 1],
                        )?;
                    }
                    let delta_fixed =
                        (rule.max_dropped_mass as f64 * FIXED_POINT_ONE).floor() as u64;
                    let prm = Params {
                        n_rows: rows as u32,
                        delta_fixed: delta_fixed.min(u32::MAX as u64) as u32,
                        ..base
                    };
                    self.run(
                        &mut pass,
                        ShaderKind::BwdTau,
                        dt,
                        &prm,
                        &[h_b, ctx.whole(&edges_b)?, rs_b],
                        Self::grid_1d(rows),
                    )?;
                }
            }
            // Column sums for analytic label smoothing, over pieces of at most `piece` rows
            // (one loop iteration per row in the shader).
            let piece = match self.cfg.max_loop_iterations {
                0 => usize::MAX,
                m => (m as usize / 2 / t * t).max(t),
            };
            let pieces = |r: &Range<usize>| -> Vec<Range<usize>> {
                (r.start..r.end)
                    .step_by(piece.min(r.len()).max(1))
                    .map(|s| s..s.saturating_add(piece).min(r.end))
                    .collect()
            };
            if let Some(cs) = &csum {
                for cc in plan.class_chunks.iter().flat_map(pieces) {
                    let (c_b, c_off) =
                        ctx.range(inputs.c, (cc.start * d) as u64, (cc.len() * d) as u64, es)?;
                    let prm = Params {
                        n_rows: cc.len() as u32,
                        e_off: c_off,
                        flags: 0,
                        ..base
                    };
                    self.run(
                        &mut pass,
                        ShaderKind::WSum,
                        dt,
                        &prm,
                        &[c_b, ctx.whole(&ctx.dummy)?, ctx.whole(cs)?],
                        Self::grid_1d(d + 1),
                    )?;
                }
            }
            if let Some(es_buf) = &esum {
                for rc in plan.row_chunks.iter().flat_map(pieces) {
                    let rows = rc.len();
                    let (e_b, e_off) =
                        ctx.range(inputs.e, (rc.start * d) as u64, (rows * d) as u64, es)?;
                    let prm = Params {
                        n_rows: rows as u32,
                        e_off,
                        flags: flags::WEIGHTED,
                        ..base
                    };
                    self.run(
                        &mut pass,
                        ShaderKind::WSum,
                        dt,
                        &prm,
                        &[
                            e_b,
                            ctx.aligned(&rs, rc.start as u64, rows as u64, ROW_STATE_BYTES)?,
                            ctx.whole(es_buf)?,
                        ],
                        Self::grid_1d(d + 1),
                    )?;
                }
            }
        }

        let mut slot = 0usize;
        // 2. d_e, row-owned.
        if let Some(d_e) = &d_e {
            let slab_stride = max_rc * d;
            let slab = ctx.raw_buffer((de_slabs * slab_stride * 4) as u64, "d_e slabs")?;
            workspace += slab.size();
            let mut f = base.flags;
            if filter_e {
                f |= flags::FILTER | flags::REPORT;
            }
            for rc in &plan.row_chunks {
                let rows = rc.len();
                enc.clear_buffer(&slab, 0, None);
                let mut pass = self.pass(&mut enc, "d_e");
                let (e_b, e_off) =
                    ctx.range_vec(inputs.e, (rc.start * d) as u64, (rows * d) as u64, es)?;
                let rs_b = ctx.aligned(&rs, rc.start as u64, rows as u64, ROW_STATE_BYTES)?;
                let dr_b = ctx.aligned(&dropped, rc.start as u64, rows as u64, 4)?;
                for (ci, cc) in plan.class_chunks.iter().enumerate() {
                    let [(c_b, c_off), (b_b, b_off)] = self.class_chunk(inputs, cc, d, es)?;
                    let (per, ns) = de_splits[ci];
                    let prm = Params {
                        flags: f,
                        slab_stride: u32c(rows * d, "slab stride")?,
                        ..tile_params(base, rc, cc, [e_off, c_off, b_off], per)
                    };
                    self.run_waves(
                        &mut pass,
                        (de_kind, dt),
                        &prm,
                        [ns, de_wave, tiles(rows, t_de)],
                        &mut slot,
                        &[
                            e_b,
                            c_b,
                            b_b,
                            rs_b,
                            ctx.whole(&slab)?,
                            dr_b,
                            ctx.whole(&counters)?,
                        ],
                    )?;
                }
                let (o_b, o_off) = ctx.range(
                    d_e,
                    (rc.start * d) as u64,
                    (rows * d) as u64,
                    out_dtype.size_bytes() as u64,
                )?;
                let mut ff = 0;
                if let Some(_cs) = &csum {
                    ff |= flags::LS_ANALYTIC | flags::WEIGHTED;
                }
                let prm = Params {
                    n_rows: rows as u32,
                    d: d as u32,
                    n_units: u32c(rows * d, "elements of a chunk")?,
                    n_slabs: de_slabs as u32,
                    slab_stride: u32c(rows * d, "slab stride")?,
                    out_off: o_off,
                    flags: ff,
                    aux: opts.label_smoothing / v as f32,
                    ..Params::default()
                };
                let units = if out_dt == 0 {
                    rows * d
                } else {
                    (rows * d).div_ceil(2)
                };
                self.run(
                    &mut pass,
                    ShaderKind::Finalize,
                    out_dt,
                    &prm,
                    &[
                        ctx.whole(&slab)?,
                        ctx.whole(csum.as_ref().unwrap_or(&ctx.dummy))?,
                        rs_b,
                        o_b,
                        ctx.whole(&status)?,
                    ],
                    Self::grid_1d(units),
                )?;
            }
        }

        // 3. d_c and d_bias, class-owned.
        if let Some(d_c) = &d_c {
            let slab_stride = max_cc * d;
            let slab = ctx.raw_buffer((dc_slabs * slab_stride * 4) as u64, "d_c slabs")?;
            let bslab = ctx.raw_buffer((dc_slabs * max_cc * 4) as u64, "d_bias slabs")?;
            workspace += slab.size() + bslab.size();
            let mut f = base.flags;
            if filter_c {
                f |= flags::FILTER;
                if !filter_e {
                    f |= flags::REPORT;
                }
            }
            for cc in &plan.class_chunks {
                let ncls = cc.len();
                enc.clear_buffer(&slab, 0, None);
                enc.clear_buffer(&bslab, 0, None);
                let mut pass = self.pass(&mut enc, "d_c");
                let [(c_b, c_off), (b_b, b_off)] = self.class_chunk(inputs, cc, d, es)?;
                for (ri, rc) in plan.row_chunks.iter().enumerate() {
                    let rows = rc.len();
                    let (e_b, e_off) =
                        ctx.range_vec(inputs.e, (rc.start * d) as u64, (rows * d) as u64, es)?;
                    let rs_b = ctx.aligned(&rs, rc.start as u64, rows as u64, ROW_STATE_BYTES)?;
                    let dr_b = ctx.aligned(&dropped, rc.start as u64, rows as u64, 4)?;
                    let (per, ns) = dc_splits[ri];
                    let prm = Params {
                        flags: f,
                        slab_stride: u32c(ncls * d, "slab stride")?,
                        ..tile_params(base, rc, cc, [e_off, c_off, b_off], per)
                    };
                    self.run_waves(
                        &mut pass,
                        (dc_kind, dt),
                        &prm,
                        [ns, dc_wave, tiles(ncls, t_dc)],
                        &mut slot,
                        &[
                            e_b,
                            c_b,
                            b_b,
                            rs_b,
                            ctx.whole(&slab)?,
                            dr_b,
                            ctx.whole(&counters)?,
                            ctx.whole(&bslab)?,
                        ],
                    )?;
                }
                let osz = out_dtype.size_bytes() as u64;
                let units = |k: usize| if out_dt == 0 { k } else { k.div_ceil(2) };
                let ff = if esum.is_some() {
                    flags::LS_ANALYTIC
                } else {
                    0
                };
                let alpha_v = opts.label_smoothing / v as f32;
                let (o_b, o_off) = ctx.range(d_c, (cc.start * d) as u64, (ncls * d) as u64, osz)?;
                let prm = Params {
                    d: d as u32,
                    n_units: u32c(ncls * d, "elements of a chunk")?,
                    n_slabs: dc_slabs as u32,
                    slab_stride: u32c(ncls * d, "slab stride")?,
                    out_off: o_off,
                    flags: ff,
                    aux: alpha_v,
                    ..Params::default()
                };
                let ev = match &esum {
                    Some(b) => ctx.whole(b)?,
                    None => ctx.whole(&ctx.dummy)?,
                };
                self.run(
                    &mut pass,
                    ShaderKind::Finalize,
                    out_dt,
                    &prm,
                    &[
                        ctx.whole(&slab)?,
                        ev,
                        ctx.whole(&ctx.dummy)?,
                        o_b,
                        ctx.whole(&status)?,
                    ],
                    Self::grid_1d(units(ncls * d)),
                )?;
                if let Some(db) = &d_bias {
                    let (o_b, o_off) = ctx.range(db, cc.start as u64, ncls as u64, osz)?;
                    // The bias term reads Σ_i g_i, stored at index D of `esum`.
                    let ev = match &esum {
                        Some(b) => ctx.whole(b)?,
                        None => ctx.whole(&ctx.dummy)?,
                    };
                    let prm = Params {
                        d: 1,
                        e_off: d as u32,
                        n_units: ncls as u32,
                        n_slabs: dc_slabs as u32,
                        slab_stride: ncls as u32,
                        out_off: o_off,
                        flags: ff,
                        aux: alpha_v,
                        ..Params::default()
                    };
                    self.run(
                        &mut pass,
                        ShaderKind::Finalize,
                        out_dt,
                        &prm,
                        &[
                            ctx.whole(&bslab)?,
                            ev,
                            ctx.whole(&ctx.dummy)?,
                            o_b,
                            ctx.whole(&status)?,
                        ],
                        Self::grid_1d(units(ncls)),
                    )?;
                }
            }
        }

        // 4. Statistics.
        let report = filter_e || filter_c;
        if report {
            let mut pass = self.pass(&mut enc, "stats");
            for (ri, rc) in plan.row_chunks.iter().enumerate() {
                let rows = rc.len();
                let prm = Params {
                    n_rows: rows as u32,
                    flags: if ri == 0 { flags::FIRST } else { 0 },
                    ..Params::default()
                };
                self.run(
                    &mut pass,
                    ShaderKind::StatReduce,
                    dt,
                    &prm,
                    &[
                        ctx.aligned(&dropped, rc.start as u64, rows as u64, 4)?,
                        ctx.aligned(&prep.tgt, rc.start as u64, rows as u64, 4)?,
                        ctx.whole(&stat)?,
                    ],
                    [1, 1, 1],
                )?;
            }
        }
        // One wait: the status words (under check_finite) and the filter's statistics.
        let mut ranges: Vec<(&wgpu::Buffer, u64, u64)> = Vec::new();
        if opts.check_finite {
            ranges.push((&status, 0, STATUS_BYTES));
        }
        if report {
            ranges.extend([(&counters, 0, 16 * n_slots as u64), (&stat, 0, 8)]);
        }
        let back = ctx.submit_and_read(enc, &ranges)?;
        let mut back = back.iter();
        if opts.check_finite {
            let words: &[u32] = bytemuck::cast_slice(back.next().map_or(&[][..], |b| b));
            match status::finding(words) {
                Finding::Clean => {}
                Finding::Row { k, row } => {
                    let t = [
                        Some(&lse),
                        Some(&rest_mass),
                        dloss_rows.as_ref(),
                        d_lse.as_ref(),
                    ][k]
                        .ok_or_else(|| crate::context::backend_err("status of an absent input"))?;
                    let t: &WgpuTensor = t;
                    return Err(CceError::NonFinite {
                        what: ROW_CHECKS[k],
                        index: row,
                        row,
                        value: self.read_f32(t, row)?,
                    });
                }
                Finding::Gradient => return Err(self.locate_non_finite(inputs, d)?),
            }
        }
        let mut stats = self.stats(&prep, workspace);
        if report {
            let (Some(counts), Some(st)) = (back.next(), back.next()) else {
                return Err(crate::context::backend_err("statistics not read back"));
            };
            let words: &[u32] = bytemuck::cast_slice(counts);
            // Only passes that filter count (de slots first, then dc slots).
            let (de_range, dc_range): (Range<usize>, Range<usize>) = {
                let de_n = if want_de { de_slots } else { 0 };
                (0..de_n, de_n..n_slots)
            };
            let mut add = |r: Range<usize>| {
                for s in r {
                    stats.tiles_visited += words[4 * s] as u64;
                    stats.tiles_skipped += words[4 * s + 1] as u64;
                    stats.entries_kept += words[4 * s + 2] as u64;
                    stats.entries_skipped += words[4 * s + 3] as u64;
                }
            };
            if filter_e {
                add(de_range);
            }
            if filter_c {
                add(dc_range);
            }
            let st: &[u32] = bytemuck::cast_slice(st);
            stats.dropped_mass_max = st[0] as f64 / FIXED_POINT_ONE;
            let sum = f32::from_bits(st[1]) as f64;
            // The max is a fixed-point (rounded up) reduction and the sum an f32 one: clamp so
            // that rounding never reports a mean above the max.
            stats.dropped_mass_mean = if prep.n_valid > 0 {
                (sum / prep.n_valid as f64).min(stats.dropped_mass_max)
            } else {
                0.0
            };
        }
        Ok(BackwardOutput {
            d_e,
            d_c,
            d_bias,
            stats,
        })
    }
}
