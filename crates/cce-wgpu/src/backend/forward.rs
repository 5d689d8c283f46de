//! The forward pass: `fwd_partial` + `fwd_merge` (+ `loss_reduce`) over the plan's chunks.

use super::interop::ForwardDest;
use super::{dtype_code, tile_params, tiles, WgpuBackend};
use crate::buffers::WgpuTensor;
use crate::config::{coop_forward, CoopTile};
use crate::pipelines::{flags, Params, ShaderKind};
use cce_core::problem::check_masked_targets;
use cce_core::{CceError, DType, ForwardOutput, Inputs, Options, Reduction, Result};

impl WgpuBackend {
    pub(super) fn forward_impl(
        &self,
        inputs: &Inputs<'_, WgpuTensor>,
        opts: &Options,
        dest: &ForwardDest,
    ) -> Result<ForwardOutput<WgpuTensor>> {
        let prep = self.prepare(inputs, opts)?;
        let inputs = &prep.inputs(inputs);
        let p = prep.problem;
        let plan = &prep.plan;
        let (n, d) = (p.n, p.d);
        let dt = dtype_code(p.dtype);
        let es = p.dtype.size_bytes() as u64;
        let ctx = &self.ctx;
        let fwd_kind = match coop_forward(&self.cfg, ctx.coop, dt) {
            Some(CoopTile::T128) => ShaderKind::FwdPartialCoop128,
            Some(CoopTile::T128W) => ShaderKind::FwdPartialCoop128W,
            Some(CoopTile::T128W16) => ShaderKind::FwdPartialCoop128W16,
            Some(CoopTile::T64) => ShaderKind::FwdPartialCoop,
            None => ShaderKind::FwdPartial,
        };
        // The forward partials' tiles (128 for the 128 x 128 cooperative-matrix forward);
        // the plan's chunks keep the configuration's.
        let t = fwd_kind.tile(self.t());
        let (splits, stride) = self.class_splits_t(plan, t)?;
        let max_rc = plan.row_chunks.iter().map(|r| r.len()).max().unwrap_or(1);

        let part = ctx.raw_buffer((max_rc * stride * 32) as u64, "partials")?;
        let tlogit = ctx.raw_buffer(4 * n as u64, "target logits")?;
        let lse = self.row_out(dest.lse.as_ref(), vec![n], "lse")?;
        let rest_mass = self.row_out(dest.rest_mass.as_ref(), vec![n], "rest_mass")?;
        let per_row = opts.reduction == Reduction::None;
        let loss_rows = self.row_out(dest.loss.as_ref().filter(|_| per_row), vec![n], "loss")?;
        let ent = ctx.alloc(vec![n], DType::F32, "entropy")?;
        let amax = ctx.alloc(vec![n], DType::I32, "argmax")?;
        let bad = ctx.upload_bytes(bytemuck::cast_slice(&[u32::MAX; 4]), "bad rows")?;
        let loss_scalar = if per_row {
            None
        } else {
            Some(self.row_out(dest.loss.as_ref(), vec![], "loss")?)
        };
        let workspace = part.size() + tlogit.size() + 4 * n as u64 * 2;
        let scale = match opts.reduction {
            Reduction::Mean if prep.n_valid > 0 => 1.0 / prep.n_valid as f32,
            // `prepare` has rejected a mean over no valid row (`PreparedTargets::new`).
            Reduction::Mean => return Err(CceError::all_targets_ignored(n, opts)),
            _ => 1.0,
        };

        let mut enc = self.encoder();
        {
            let mut pass = self.pass(&mut enc, "forward");
            let n_rc = plan.row_chunks.len();
            for (ri, rc) in plan.row_chunks.iter().enumerate() {
                let rows = rc.len();
                let (e_b, e_off) =
                    ctx.range_vec(inputs.e, (rc.start * d) as u64, (rows * d) as u64, es)?;
                let tgt_b = ctx.aligned(&prep.tgt, rc.start as u64, rows as u64, 4)?;
                let tl_b = ctx.aligned(&tlogit, rc.start as u64, rows as u64, 4)?;
                let part_b = ctx.whole(&part)?;
                for (ci, cc) in plan.class_chunks.iter().enumerate() {
                    let [(c_b, c_off), (b_b, b_off)] = self.class_chunk(inputs, cc, d, es)?;
                    let (per, nsplit, base) = splits[ci];
                    let prm = Params {
                        part_base: base as u32,
                        part_stride: stride as u32,
                        ..tile_params(
                            self.base_params(&p, opts),
                            rc,
                            cc,
                            [e_off, c_off, b_off],
                            per,
                        )
                    };
                    self.run(
                        &mut pass,
                        fwd_kind,
                        dt,
                        &prm,
                        &[e_b, c_b, b_b, tgt_b, part_b, tl_b],
                        [nsplit as u32, tiles(rows, t) as u32, 1],
                    )?;
                }
                let prm = Params {
                    n_rows: rows as u32,
                    row0: rc.start as u32,
                    part_stride: stride as u32,
                    ..self.base_params(&p, opts)
                };
                let lr_b = ctx.aligned(&loss_rows.work, rc.start as u64, rows as u64, 4)?;
                self.run(
                    &mut pass,
                    ShaderKind::FwdMerge,
                    dt,
                    &prm,
                    &[
                        part_b,
                        tgt_b,
                        tl_b,
                        ctx.aligned(&lse.work, rc.start as u64, rows as u64, 4)?,
                        lr_b,
                        ctx.aligned(&ent, rc.start as u64, rows as u64, 4)?,
                        ctx.aligned(&amax, rc.start as u64, rows as u64, 4)?,
                        ctx.whole(&bad)?,
                        ctx.aligned(&rest_mass.work, rc.start as u64, rows as u64, 4)?,
                    ],
                    Self::grid_1d(rows),
                )?;
                if let Some(ls) = &loss_scalar {
                    let mut f = 0;
                    if ri == 0 {
                        f |= flags::FIRST;
                    }
                    if ri + 1 == n_rc {
                        f |= flags::LAST;
                    }
                    let prm = Params {
                        n_rows: rows as u32,
                        flags: f,
                        aux: scale,
                        ..Params::default()
                    };
                    self.run(
                        &mut pass,
                        ShaderKind::LossReduce,
                        dt,
                        &prm,
                        &[lr_b, ctx.aligned(&ls.work, 0, 1, 4)?],
                        [1, 1, 1],
                    )?;
                }
            }
        }
        for out in [&lse, &rest_mass, &loss_rows]
            .into_iter()
            .chain(loss_scalar.as_ref())
        {
            out.copy_out(&mut enc);
        }
        let back = ctx.submit_and_read(enc, &[(&bad, 0, 16)])?;
        let bad_row = |k: usize| {
            let row = u32::from_le_bytes(back[0][4 * k..4 * k + 4].try_into().unwrap());
            (row != u32::MAX).then_some(row as usize)
        };
        if let Some(row) = bad_row(0).filter(|_| opts.check_finite) {
            let value = self.read_f32(&lse.work, row)?;
            return Err(CceError::NonFinite {
                what: "lse (a NaN or Inf in e, c or bias of this row, or a -inf in e or c)",
                index: row,
                row,
                // A −inf in e or c leaves a finite lse (the logit passed for a masked one).
                value: if value.is_finite() {
                    f32::NEG_INFINITY
                } else {
                    value
                },
            });
        }
        let (masked_target, any_masked) = (bad_row(1), bad_row(2));
        check_masked_targets(&prep.targets, opts, |i| {
            (Some(i) == masked_target, Some(i) == any_masked)
        })?;
        let loss = match loss_scalar {
            Some(l) => l,
            None => loss_rows,
        };
        Ok(ForwardOutput {
            loss: loss.into_result(),
            lse: lse.into_result(),
            rest_mass: rest_mass.into_result(),
            entropy: opts.side_outputs.entropy.then_some(ent),
            argmax: opts.side_outputs.argmax.then_some(amax),
            stats: self.stats(&prep, workspace),
        })
    }
}
