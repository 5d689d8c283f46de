//! The CPU backward of one shard: `d_c` and `d_bias` of its classes, and its part of `d_e`.

use super::entry::{prob, EntryRule, RowState};
use super::forward::shard_stats;
use super::inputs::{prepare, ShardInputs};
use super::CpuShard;
use crate::blocked::sgemm;
use crate::view::HostRead;
use cce_core::filter::{FilterRule, N_BINS};
use cce_core::problem::{
    check_masked_targets, check_upstream_finite, d_loss_mismatch, d_lse_mismatch, loss_grad_rows,
    scalar_loss_grad,
};
use cce_core::vocab_parallel::{shard_filter_rule, ShardBackward, VocabShard};
use cce_core::{
    CceError, DLoss, DType, GradDType, HostTensor, Inputs, Options, Reduction, Result, Saved,
    Upstream,
};
use rayon::prelude::*;
use std::ops::Range;

impl CpuShard {
    /// The backward of `shard` from the merged forward (MATH.md "Backward" on the shard's
    /// classes).
    ///
    /// `inputs` as for [`CpuShard::forward`]. `saved`: the merged `lse` and `rest_mass`
    /// (`[N]` f32 each) of the whole vocabulary, as the driver's forward returns them.
    /// `upstream`: `d_loss` (scalar for mean/sum, `[N]` f32 for none; a mean is divided by the
    /// valid rows of the whole batch) and optional `d_lse` `[N]` f32. The filter runs on the
    /// shard's classes with its share of `max_dropped_mass`
    /// ([`cce_core::vocab_parallel::filter_split`]).
    ///
    /// Errors: those of [`CpuShard::forward`]; `ShapeMismatch` for saved buffers or upstream
    /// gradients of the wrong shape; `NonFinite` for a NaN or infinite lse of a row with a
    /// target, upstream gradient or (overflowing) gradient under `check_finite`;
    /// `TargetMasked` when this shard masks (`−inf` bias) a row's target, `InvalidOption` for
    /// label smoothing when it masks any class.
    pub fn backward<T: HostRead, S: HostRead, U: HostRead>(
        &self,
        inputs: &Inputs<'_, T>,
        shard: &VocabShard,
        opts: &Options,
        saved: Saved<'_, S>,
        upstream: &Upstream<'_, U>,
    ) -> Result<ShardBackward> {
        let p = prepare(inputs, shard, opts, self.tile)?;
        let n = p.problem.n;
        saved.check(n)?;
        if let Some(err) = opts.check_finite.then(|| p.non_finite()).flatten() {
            return Err(err);
        }
        let (any_masked, target_masked) = p.masked();
        check_masked_targets(&p.targets, opts, |i| (target_masked(i), any_masked))?;
        let lse = saved.lse.f32_values()?;
        let rest = saved.rest_mass.f32_values()?;
        if opts.check_finite {
            let bad = lse.iter().enumerate().find(|&(i, &x)| {
                x.is_nan()
                    || x == f32::INFINITY
                    || (x == f32::NEG_INFINITY && p.targets.classes[i] >= 0)
            });
            if let Some((index, &value)) = bad {
                return Err(CceError::NonFinite {
                    what: "lse",
                    index,
                    row: index,
                    value,
                });
            }
        }
        let (g, h) = upstream_rows(&p, opts, upstream)?;
        let rows: Vec<RowState> = (0..n)
            .map(|i| RowState {
                g: g[i],
                h: h[i],
                lse: lse[i],
                rest: rest[i],
            })
            .collect();
        let rule = shard_filter_rule(opts, p.problem.dtype, shard);
        let entry = EntryRule {
            alpha: opts.label_smoothing,
            lambda: opts.z_loss,
            ls_per_entry: if rule.label_smoothing_analytic {
                0.0
            } else {
                opts.label_smoothing / p.problem.v as f32
            },
            softcap: opts.softcap,
        };
        let ctx = Ctx {
            p: &p,
            rows: &rows,
            entry,
            rule,
            softcap: opts.softcap,
        };
        let out = ctx.run(opts)?;
        finish(&p, opts, out)
    }
}

/// The upstream gradients per row: `g_i` (0 at rows without a target; a mean's scalar over the
/// valid rows of the whole batch) and `h_i`.
fn upstream_rows<U: HostRead>(
    p: &ShardInputs,
    opts: &Options,
    upstream: &Upstream<'_, U>,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let n = p.problem.n;
    let y = &p.targets.classes;
    match upstream.d_loss {
        DLoss::Scalar(s) => check_upstream_finite("d_loss", [s])?,
        DLoss::PerRow(t) if opts.check_finite => {
            check_upstream_finite("d_loss", t.f32_values()?.iter().copied())?
        }
        DLoss::PerRow(_) => {}
    }
    if let (Some(t), true) = (upstream.d_lse, opts.check_finite) {
        check_upstream_finite("d_lse", t.f32_values()?.iter().copied())?;
    }
    let g: Vec<f32> = match (opts.reduction, upstream.d_loss) {
        (Reduction::None, DLoss::PerRow(t)) if t.shape() == [n] => {
            let t = t.f32_values()?;
            loss_grad_rows(y, |i| t[i])
        }
        (Reduction::Mean | Reduction::Sum, DLoss::Scalar(s)) => {
            let s = scalar_loss_grad(opts.reduction, s, p.targets.n_valid);
            loss_grad_rows(y, |_| s)
        }
        _ => return Err(d_loss_mismatch(n, opts.reduction, upstream.d_loss.kind())),
    };
    let h = match upstream.d_lse {
        Some(t) if t.shape() == [n] => t.f32_values()?.into_owned(),
        Some(t) => return Err(d_lse_mismatch(n, t.shape())),
        None => vec![0.0; n],
    };
    Ok((g, h))
}

/// The shard's gradients in f32 and its filter figures, before the output dtype.
struct Raw {
    d_e: Vec<f32>,
    d_c: Vec<f32>,
    d_bias: Vec<f32>,
    dropped: Vec<f64>,
    kept_tiles: u64,
    skipped_tiles: u64,
    kept_entries: u64,
    skipped_entries: u64,
}

/// A row tile's skip decisions (one per class tile) and dropped mass per row.
struct RowTileMask {
    skipped: Vec<bool>,
    dropped: Vec<f64>,
    kept: (u64, u64),
    skipped_counts: (u64, u64),
}

/// Everything a tile's `G` needs.
#[derive(Clone, Copy)]
struct Ctx<'a> {
    p: &'a ShardInputs<'a>,
    rows: &'a [RowState],
    entry: EntryRule,
    rule: FilterRule,
    softcap: Option<f32>,
}

impl Ctx<'_> {
    /// Uncapped logits and probabilities of a tile.
    fn tile_probs(&self, rows: &Range<usize>, classes: &Range<usize>) -> (Vec<f32>, Vec<f32>) {
        let x = self.p.raw_logits_tile(rows, classes);
        let z = self.p.capped(&x, self.softcap);
        let k = classes.len().max(1);
        let mut pr = z.into_owned();
        for (ii, row) in pr.chunks_mut(k).enumerate() {
            let l = self.rows[rows.start + ii].lse;
            row.iter_mut().for_each(|v| *v = prob(*v, l));
        }
        (x, pr)
    }

    fn is_target(&self, i: usize, local: usize) -> bool {
        self.p.local_targets[i] == Some(local)
    }

    /// `G` of a tile from its uncapped logits and probabilities.
    fn g_tile(
        &self,
        rows: &Range<usize>,
        classes: &Range<usize>,
        x: &[f32],
        pr: &[f32],
    ) -> Vec<f32> {
        let k = classes.len();
        let mut out = vec![0.0f32; rows.len() * k];
        for ii in 0..rows.len() {
            let i = rows.start + ii;
            for jj in 0..k {
                let at = ii * k + jj;
                let t = self.is_target(i, classes.start + jj);
                out[at] = self.entry.g(&self.rows[i], t, pr[at], x[at]);
            }
        }
        out
    }

    /// Row thresholds `τ_i` of a row tile over every class tile of the shard.
    fn thresholds(&self, rows: &Range<usize>, class_tiles: &[Range<usize>]) -> Vec<f32> {
        let mut hist = vec![0.0f64; rows.len() * N_BINS];
        for classes in class_tiles {
            let (_, pr) = self.tile_probs(rows, classes);
            let k = classes.len();
            for ii in 0..rows.len() {
                let i = rows.start + ii;
                for jj in 0..k {
                    let t = self.is_target(i, classes.start + jj);
                    let g0 = self.entry.g0(&self.rows[i], t, pr[ii * k + jj]);
                    if let Some(b) = self.rule.bin(g0) {
                        hist[ii * N_BINS + b] += g0 as f64;
                    }
                }
            }
        }
        (0..rows.len())
            .map(|ii| self.rule.threshold(&hist[ii * N_BINS..(ii + 1) * N_BINS]))
            .collect()
    }

    /// Whether a tile may be skipped (every entry of its active rows below the row's `τ`),
    /// with the `Σ g0` of each row when it is.
    fn skip(
        &self,
        rows: &Range<usize>,
        classes: &Range<usize>,
        pr: &[f32],
        tau: &[f32],
    ) -> Option<Vec<f64>> {
        if !self.rule.enabled {
            return None;
        }
        let k = classes.len();
        let mut dropped = vec![0.0f64; rows.len()];
        for ii in 0..rows.len() {
            let i = rows.start + ii;
            let row = &self.rows[i];
            if !row.active() {
                continue;
            }
            for jj in 0..k {
                let t = self.is_target(i, classes.start + jj);
                let g0 = self.entry.g0(row, t, pr[ii * k + jj]);
                if g0 >= tau[ii] {
                    return None;
                }
                dropped[ii] += g0 as f64;
            }
        }
        Some(dropped)
    }

    /// The three passes: thresholds and the row-owned `d_e` with the skip mask (parallel over
    /// row tiles), then the class-owned `d_c`, `d_bias` (parallel over class tiles), then
    /// label smoothing's rank-1 term.
    fn run(&self, opts: &Options) -> Result<Raw> {
        let p = self.p;
        let (n, d) = (p.problem.n, p.problem.d);
        let len = p.shard.len();
        let row_tiles = p.row_tiles();
        let class_tiles = p.class_tiles();
        let tr = p.tile.rows.max(1);
        let mut d_e = cce_core::try_filled(if opts.compute_d_e { n * d } else { 0 }, 0.0f32)?;
        let mut d_c = cce_core::try_filled(if opts.compute_d_c { len * d } else { 0 }, 0.0f32)?;
        let mut d_bias = cce_core::try_filled(if opts.compute_d_c { len } else { 0 }, 0.0f32)?;
        let need_mask = self.rule.enabled && (opts.compute_d_e || opts.compute_d_c);
        // Pass 1: per row tile, thresholds, the skip mask and d_e.
        let row_pass = |rt: usize, out: Option<&mut [f32]>| -> RowTileMask {
            let rows = &row_tiles[rt];
            let tau = if need_mask {
                self.thresholds(rows, &class_tiles)
            } else {
                vec![0.0; rows.len()]
            };
            let active = rows.clone().filter(|&i| self.rows[i].active()).count() as u64;
            let mut mask = RowTileMask {
                skipped: vec![false; class_tiles.len()],
                dropped: vec![0.0; rows.len()],
                kept: (0, 0),
                skipped_counts: (0, 0),
            };
            let mut out = out;
            for (ct, classes) in class_tiles.iter().enumerate() {
                if !need_mask && out.is_none() {
                    break;
                }
                let (x, pr) = self.tile_probs(rows, classes);
                let skip = self.skip(rows, classes, &pr, &tau);
                if let Some(dropped) = &skip {
                    mask.skipped[ct] = true;
                    mask.skipped_counts.0 += 1;
                    mask.skipped_counts.1 += active * classes.len() as u64;
                    mask.dropped
                        .iter_mut()
                        .zip(dropped)
                        .for_each(|(a, b)| *a += b);
                } else {
                    mask.kept.0 += 1;
                    mask.kept.1 += active * classes.len() as u64;
                }
                if let Some(out) = out.as_deref_mut() {
                    if skip.is_some() && self.rule.filter_e_grad {
                        continue;
                    }
                    let gt = self.g_tile(rows, classes, &x, &pr);
                    let c = &p.c[classes.start * d..classes.end * d];
                    sgemm(
                        rows.len(),
                        classes.len(),
                        d,
                        &gt,
                        (classes.len(), 1),
                        c,
                        (d, 1),
                        1.0,
                        out,
                        d,
                    );
                }
            }
            mask
        };
        let masks: Vec<RowTileMask> = if opts.compute_d_e {
            d_e.par_chunks_mut(tr * d.max(1))
                .enumerate()
                .map(|(rt, out)| row_pass(rt, Some(out)))
                .collect()
        } else {
            (0..row_tiles.len())
                .into_par_iter()
                .map(|rt| row_pass(rt, None))
                .collect()
        };
        // Pass 2: per class tile, d_c and d_bias from the recomputed G of the kept tiles.
        if opts.compute_d_c && !class_tiles.is_empty() {
            let tc = p.tile.classes.max(1);
            let real = p.shard.real_len();
            d_c[..real * d]
                .par_chunks_mut(tc * d.max(1))
                .zip(d_bias[..real].par_chunks_mut(tc))
                .enumerate()
                .for_each(|(ct, (out, bias_out))| {
                    let classes = &class_tiles[ct];
                    let k = classes.len();
                    for (rt, rows) in row_tiles.iter().enumerate() {
                        if masks[rt].skipped[ct] && self.rule.filter_c_grad {
                            continue;
                        }
                        let (x, pr) = self.tile_probs(rows, classes);
                        let gt = self.g_tile(rows, classes, &x, &pr);
                        let e = &p.e[rows.start * d..rows.end * d];
                        sgemm(k, rows.len(), d, &gt, (1, k), e, (d, 1), 1.0, out, d);
                        for ii in 0..rows.len() {
                            for jj in 0..k {
                                bias_out[jj] += gt[ii * k + jj];
                            }
                        }
                    }
                });
        }
        // Label smoothing's rank-1 term on the shard's real classes, when analytic.
        let alpha = opts.label_smoothing;
        if self.rule.label_smoothing_analytic && alpha > 0.0 {
            self.label_smoothing(alpha, opts, &mut d_e, &mut d_c, &mut d_bias);
        }
        let mut raw = Raw {
            d_e,
            d_c,
            d_bias,
            dropped: vec![0.0; n],
            kept_tiles: 0,
            skipped_tiles: 0,
            kept_entries: 0,
            skipped_entries: 0,
        };
        for (rt, m) in masks.iter().enumerate() {
            let rows = &row_tiles[rt];
            raw.dropped[rows.clone()].copy_from_slice(&m.dropped);
            raw.kept_tiles += m.kept.0;
            raw.kept_entries += m.kept.1;
            raw.skipped_tiles += m.skipped_counts.0;
            raw.skipped_entries += m.skipped_counts.1;
        }
        Ok(raw)
    }

    /// `−(α/V) g_i Σ_{j ∈ shard} c_j` on each row of `d_e` and `−(α/V) Σ_i g_i e_i` on each
    /// real class row of `d_c` (`−(α/V) Σ_i g_i` on `d_bias`).
    fn label_smoothing(
        &self,
        alpha: f32,
        opts: &Options,
        d_e: &mut [f32],
        d_c: &mut [f32],
        d_bias: &mut [f32],
    ) {
        let p = self.p;
        let d = p.problem.d;
        let real = p.shard.real_len();
        let a = alpha / p.problem.v as f32;
        if opts.compute_d_e {
            let mut csum = vec![0.0f32; d];
            for row in p.c[..real * d].chunks(d.max(1)) {
                csum.iter_mut().zip(row).for_each(|(s, x)| *s += x);
            }
            d_e.par_chunks_mut(d.max(1))
                .enumerate()
                .for_each(|(i, out)| {
                    let gi = self.rows[i].g;
                    out.iter_mut()
                        .zip(&csum)
                        .for_each(|(o, s)| *o -= a * gi * s);
                });
        }
        if opts.compute_d_c {
            let mut ge = vec![0.0f32; d];
            for (i, row) in p.e.chunks(d.max(1)).enumerate() {
                let gi = self.rows[i].g;
                ge.iter_mut().zip(row).for_each(|(s, x)| *s += gi * x);
            }
            let gsum: f32 = self.rows.iter().map(|r| r.g).sum();
            d_c[..real * d]
                .par_chunks_mut(d.max(1))
                .for_each(|out| out.iter_mut().zip(&ge).for_each(|(o, s)| *o -= a * s));
            d_bias[..real].iter_mut().for_each(|b| *b -= a * gsum);
        }
    }
}

/// Check the gradients, fill the statistics and build the outputs.
fn finish(p: &ShardInputs, opts: &Options, raw: Raw) -> Result<ShardBackward> {
    if opts.check_finite {
        let bad = raw
            .d_e
            .iter()
            .chain(&raw.d_c)
            .chain(&raw.d_bias)
            .find(|x| !x.is_finite());
        if let Some(&value) = bad {
            return Err(CceError::NonFinite {
                what: "gradients (overflow)",
                index: 0,
                row: 0,
                value,
            });
        }
    }
    let rule = shard_filter_rule(opts, p.problem.dtype, &p.shard);
    let passes = u64::from(rule.filter_e_grad && opts.compute_d_e)
        + u64::from(rule.filter_c_grad && opts.compute_d_c);
    let mut stats = shard_stats(p, opts, "backward");
    stats.tiles_visited = raw.kept_tiles * passes;
    stats.tiles_skipped = raw.skipped_tiles * passes;
    stats.entries_kept = raw.kept_entries * passes;
    stats.entries_skipped = raw.skipped_entries * passes;
    let (max, mean) = dropped_summary(&raw.dropped, &p.targets.classes);
    stats.dropped_mass_max = max;
    stats.dropped_mass_mean = mean;
    let out_dtype = match opts.grad_dtype {
        GradDType::F32 => DType::F32,
        GradDType::Input => p.problem.dtype,
    };
    let (len, d) = (p.shard.len(), p.problem.d);
    Ok(ShardBackward {
        d_e_partial: opts.compute_d_e.then_some(raw.d_e),
        d_c: if opts.compute_d_c {
            Some(HostTensor::from_f32(vec![len, d], &raw.d_c, out_dtype)?)
        } else {
            None
        },
        d_bias: if opts.compute_d_c && p.bias.is_some() {
            Some(HostTensor::from_f32(vec![len], &raw.d_bias, out_dtype)?)
        } else {
            None
        },
        dropped: Some(raw.dropped),
        stats,
        targets: p.targets.clone(),
    })
}

/// Largest and mean per-row dropped mass over the rows with a target (`classes[i] ≥ 0`).
pub(crate) fn dropped_summary(dropped: &[f64], classes: &[i32]) -> (f64, f64) {
    let valid: Vec<f64> = dropped
        .iter()
        .zip(classes)
        .filter(|(_, &c)| c >= 0)
        .map(|(&m, _)| m)
        .collect();
    let max = valid.iter().copied().fold(0.0, f64::max);
    let mean = if valid.is_empty() {
        0.0
    } else {
        valid.iter().sum::<f64>() / valid.len() as f64
    };
    (max, mean)
}
