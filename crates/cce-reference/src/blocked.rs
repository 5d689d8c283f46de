//! The blocked CPU backend: follows the plan and the filter rule of `cce-core` exactly.
//!
//! Forward (paper section 4.2): per row tile (in parallel), the class tiles of every class chunk
//! in order; each logits tile is one f32 GEMM (`tile.rows x tile.classes x D`; f64 under
//! softcap, whose derivative amplifies logit rounding by `2/s`), followed by bias and softcap;
//! an online log-sum-exp (f64 accumulators) keeps max, sum, the non-target sum (for
//! `rest_mass`), the target logit, `Σ z`, `Σ p z` (entropy) and the argmax. −inf logits
//! (classes masked by the bias) add nothing.
//!
//! Backward (paper section 4.3), from the saved lse and rest mass (the target's `G` and `g0`
//! from `1 − p_y = rest`, without cancellation on confident rows):
//! 1. the filter's decisions, per row: each row's `Σ g0` (`g0 = |p − onehot|`) and largest `g0`
//!    per class tile, then the longest suffix of tiles it can drop within `max_dropped_mass`
//!    with no entry at `filter_eps` ([`cce_core::tile_budget`]); a filtered call visits the
//!    classes by batch-mean logit ([`cce_core::vocab_order`]), so that a row's small entries
//!    gather at the end, and the rows by descending count of kept tiles, so that a row tile
//!    computes a class tile for a prefix of its rows and skips it past its first row's count;
//! 2. the dropped mass of a row is `Σ g0` over its dropped suffix;
//! 3. `d_e` (row-owned, parallel over row tiles) and `d_c`/`d_bias` (class-owned, parallel over
//!    class tiles), f32 accumulation in a fixed order (bitwise deterministic).
//!
//! `Strategy::ChunkedDense` materializes the `G` of a row chunk once (the plan's workspace);
//! `Strategy::TileOwnership` recomputes each tile in every pass. Both produce the same bits.

use crate::view::HostRead;
use cce_core::filter::FilterRule;
use cce_core::options::{GradDType, Options, Reduction};
use cce_core::plan::{DeviceLimits, Plan, Strategy};
use cce_core::problem::{
    check_masked_targets, d_loss_mismatch, d_lse_mismatch, loss_grad_rows, scalar_loss_grad,
    PreparedTargets, Problem,
};
use cce_core::stats::CallStats;
use cce_core::vocab_order::VocabOrder;
use cce_core::{
    Backend, BackwardOutput, CceError, DLoss, DType, ForwardBackward, ForwardOutput, HostTensor,
    Inputs, Result, Saved, Upstream,
};
use rayon::prelude::*;
use std::borrow::Cow;
use std::ops::Range;

mod math;
mod order;
mod row_acc;
mod tile_g;
pub(crate) use math::{cap, dcap, dgemm, sgemm};
use row_acc::{RowAcc, TileStats};
use tile_g::{GCtx, TileG};

/// The CPU backend. Buffers are [`HostTensor`]s; every computation follows the [`Plan`].
#[derive(Clone, Debug)]
pub struct CpuBackend {
    limits: DeviceLimits,
    /// A filtered backward visits the classes by batch-mean logit ([`cce_core::vocab_order`]).
    vocab_order: bool,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    /// A backend with [`DeviceLimits::cpu`] (prefers `ChunkedDense`).
    pub fn new() -> Self {
        Self::with_limits(DeviceLimits::cpu())
    }

    /// A backend with custom limits (tile shape, strategies, buffer sizes), e.g. to run the
    /// plan a GPU would get.
    pub fn with_limits(limits: DeviceLimits) -> Self {
        Self {
            limits,
            vocab_order: true,
        }
    }

    /// Whether a filtered backward visits the classes by descending batch-mean logit (default
    /// on; [`cce_core::vocab_order`]): the same bound on each row's dropped mass, more whole
    /// tiles skipped on real rows. Off visits them in class-id order, as exact calls always do
    /// (benches and tests compare the two).
    pub fn with_vocab_order(mut self, on: bool) -> Self {
        self.vocab_order = on;
        self
    }
}

/// Validated inputs as f32 (exact widening of f32/f16/bf16).
struct Prepared<'a> {
    problem: Problem,
    plan: Plan,
    targets: PreparedTargets,
    e: Cow<'a, [f32]>,
    c: Cow<'a, [f32]>,
    bias: Option<Cow<'a, [f32]>>,
    /// Accumulate the logits in f64 (under softcap, see [`Prepared::raw_logits_tile`]).
    wide_logits: bool,
}

fn prepare<'a, T: HostRead>(
    inputs: &Inputs<'a, T>,
    opts: &Options,
    limits: &DeviceLimits,
) -> Result<Prepared<'a>> {
    let problem = inputs.problem(opts)?;
    let raw = inputs.targets.i64_values().ok_or(CceError::DTypeMismatch {
        what: "targets",
        expected: "i32 or i64".into(),
        got: inputs.targets.dtype(),
    })?;
    let targets = PreparedTargets::new(&raw, &problem, opts)?;
    let plan = Plan::new(&problem, opts, limits)?;
    Ok(Prepared {
        problem,
        plan,
        targets,
        e: inputs.e.f32_values()?,
        c: inputs.c.f32_values()?,
        bias: inputs.bias.map(|b| b.f32_values()).transpose()?,
        wide_logits: opts.softcap.is_some(),
    })
}

impl Prepared<'_> {
    /// Logits tile `z[rows x classes]` (f32, bias and softcap applied), row-major.
    fn logits_tile(
        &self,
        rows: &Range<usize>,
        classes: &Range<usize>,
        softcap: Option<f32>,
    ) -> Vec<f32> {
        let mut z = self.raw_logits_tile(rows, classes);
        if let Some(s) = softcap {
            z.iter_mut().for_each(|x| *x = cap(*x, s));
        }
        z
    }

    /// Uncapped logits tile `x[rows x classes]` (f32, bias applied), row-major.
    ///
    /// Under softcap the products accumulate in f64 (then round to f32): the softcap's
    /// derivative `4w/(1 + w)²`, `w = e^{−2|x/s|}`, turns an absolute logit error `δx` into a
    /// relative gradient error `2δx/s`, so f32 accumulation (`δx ~ 2⁻²⁴·Σ_k |e_k c_k|`) would
    /// cost a small cap (`s = 1e-3`) three decimal digits; rounded once, `δx ≤ 2⁻²⁴·|x|`.
    fn raw_logits_tile(&self, rows: &Range<usize>, classes: &Range<usize>) -> Vec<f32> {
        let d = self.problem.d;
        let (r, k) = (rows.len(), classes.len());
        let e = &self.e[rows.start * d..rows.end * d];
        let c = &self.c[classes.start * d..classes.end * d];
        let mut z = vec![0.0f32; r * k];
        if self.wide_logits {
            let wide = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<f64>>();
            let (e, c) = (wide(e), wide(c));
            let mut z64 = vec![0.0f64; r * k];
            dgemm(r, d, k, &e, &c, &mut z64);
            z.iter_mut().zip(&z64).for_each(|(o, &x)| *o = x as f32);
        } else {
            sgemm(r, d, k, e, (d, 1), c, (1, d), 0.0, &mut z, k);
        }
        if let Some(b) = &self.bias {
            for row in z.chunks_mut(k) {
                for (x, b) in row.iter_mut().zip(&b[classes.clone()]) {
                    *x += b;
                }
            }
        }
        z
    }

    /// The tile's capped logits from its uncapped ones (`x` itself without a softcap).
    fn capped<'x>(&self, x: &'x [f32], softcap: Option<f32>) -> Cow<'x, [f32]> {
        match softcap {
            Some(s) => Cow::Owned(x.iter().map(|&x| cap(x, s)).collect()),
            None => Cow::Borrowed(x),
        }
    }
}

/// What a forward-and-backward call's forward hands its backward
/// ([`CpuBackend::forward_backward_host`]): the order its classes took (the problem is already
/// in it) and, when the call fuses ([`fuses`]), its per-(row, class tile) statistics.
struct Decided {
    order: Option<VocabOrder>,
    stats: Option<TileStats>,
}

/// Bytes of a fused call's per-(row, class tile) statistics and masses ([`TileStats`]).
fn stats_bytes(p: &Prepared) -> u64 {
    let tiles: usize = (p.plan.class_chunks.iter())
        .map(|cc| p.plan.class_tiles(cc.clone()).count())
        .sum();
    p.problem.n as u64 * tiles as u64 * TileStats::BYTES_PER_ENTRY
}

/// Whether a forward-and-backward call of `p` keeps its forward's per-tile statistics for the
/// backward's skip decisions: when the filter is on and the statistics (and the order's copy,
/// when taken) fit in the budget beside the plan's workspace.
fn fuses(p: &Prepared, opts: &Options, order: Option<&VocabOrder>) -> bool {
    let Problem { v, d, .. } = p.problem;
    let copy = order.map_or(0, |_| VocabOrder::copy_bytes(v, d, p.bias.is_some()));
    p.plan.filter.enabled
        && p.plan
            .workspace_bytes
            .saturating_add(copy)
            .saturating_add(stats_bytes(p))
            <= opts.workspace_budget_bytes
}

impl Backend for CpuBackend {
    type Buffer = HostTensor;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn limits(&self) -> DeviceLimits {
        self.limits.clone()
    }

    fn upload(&self, host: &HostTensor) -> Result<HostTensor> {
        host.try_clone()
    }

    fn download(&self, buf: &HostTensor) -> Result<HostTensor> {
        buf.try_clone()
    }

    fn forward(
        &self,
        inputs: &Inputs<'_, HostTensor>,
        opts: &Options,
    ) -> Result<ForwardOutput<HostTensor>> {
        self.forward_host(inputs, opts)
    }

    fn backward(
        &self,
        inputs: &Inputs<'_, HostTensor>,
        opts: &Options,
        saved: Saved<'_, HostTensor>,
        upstream: &Upstream<'_, HostTensor>,
    ) -> Result<BackwardOutput<HostTensor>> {
        self.backward_host(inputs, opts, saved, upstream)
    }

    fn forward_backward(
        &self,
        inputs: &Inputs<'_, HostTensor>,
        opts: &Options,
        upstream: &Upstream<'_, HostTensor>,
    ) -> Result<ForwardBackward<HostTensor>> {
        self.forward_backward_host(inputs, opts, upstream)
    }
}

impl CpuBackend {
    /// [`Backend::forward`] on any host buffers ([`HostRead`]): owned [`HostTensor`]s or
    /// borrowed [`HostView`](crate::HostView)s, read in place (f32) without a copy. Same
    /// errors as [`Backend::forward`].
    pub fn forward_host<T: HostRead>(
        &self,
        inputs: &Inputs<'_, T>,
        opts: &Options,
    ) -> Result<ForwardOutput<HostTensor>> {
        let p = prepare(inputs, opts, &self.limits)?;
        // Up front: a −inf in `e` or `c` would otherwise pass for a masked logit.
        if let Some(err) = opts.check_finite.then(|| non_finite_input(&p)).flatten() {
            return Err(err);
        }
        Ok(self.forward_prepared(&p, opts, None, false)?.0)
    }

    /// The forward of a prepared problem, its classes in `order` when given (`p` then the
    /// reordered problem; the argmax comes back as a class id); with `keep_stats` also each
    /// `(row, class tile)`'s largest logit and `Σ e^{z − max}` ([`TileStats`]).
    fn forward_prepared(
        &self,
        p: &Prepared,
        opts: &Options,
        order: Option<&VocabOrder>,
        keep_stats: bool,
    ) -> Result<(ForwardOutput<HostTensor>, Option<TileStats>)> {
        let Problem { n, v, .. } = p.problem;
        let y = &p.targets.classes;
        let id = |j: usize| order.map_or(j as i32, |o| o.perm()[j] as i32);
        let class_tiles: Vec<Range<usize>> = p
            .plan
            .class_chunks
            .iter()
            .flat_map(|cc| p.plan.class_tiles(cc.clone()))
            .collect();
        let n_tiles = class_tiles.len();
        let mut acc = vec![RowAcc::new(); n];
        let tile_rows = p.plan.tile.rows;
        // Per row tile, its rows' (max, Σexp) per class tile when kept (row-major).
        let per_row_tile: Vec<Vec<(f32, f32)>> = acc
            .par_chunks_mut(tile_rows)
            .enumerate()
            .map(|(t, accs)| {
                let rows = t * tile_rows..(t * tile_rows + accs.len());
                let mut stats =
                    vec![(0.0f32, 0.0f32); if keep_stats { accs.len() * n_tiles } else { 0 }];
                for (ct, classes) in class_tiles.iter().enumerate() {
                    let z = p.logits_tile(&rows, classes, opts.softcap);
                    let k = classes.len();
                    for (ii, a) in accs.iter_mut().enumerate() {
                        let zr = &z[ii * k..(ii + 1) * k];
                        let st = a.fold(zr, classes.start, y[rows.start + ii], id);
                        if keep_stats {
                            stats[ii * n_tiles + ct] = st;
                        }
                    }
                }
                stats
            })
            .collect();
        let tile_stats = keep_stats.then(|| TileStats {
            tiles: n_tiles,
            stat: per_row_tile.concat(),
        });
        // A row whose every class is masked has lse −inf (only an ignored row may).
        let lse: Vec<f64> = acc.iter().map(|a| a.m + a.s.ln()).collect();
        if opts.check_finite {
            if let Some(row) = lse.iter().position(|x| x.is_nan() || *x == f64::INFINITY) {
                return Err(locate_non_finite(p, row));
            }
        }
        check_masked_targets(&p.targets, opts, |i| {
            (acc[i].zy == f64::NEG_INFINITY, acc[i].masked)
        })?;
        let alpha = opts.label_smoothing as f64;
        let lambda = opts.z_loss as f64;
        let rest: Vec<f64> = (0..n)
            .map(|i| if y[i] < 0 { 0.0 } else { acc[i].r / acc[i].s })
            .collect();
        let row_loss: Vec<f64> = (0..n)
            .map(|i| {
                if y[i] < 0 {
                    0.0
                } else {
                    let (l, a) = (lse[i], &acc[i]);
                    let zmean = a.zsum / v as f64;
                    cross_entropy(l, a.zy, rest[i]) + alpha * (a.zy - zmean) + lambda * l * l
                }
            })
            .collect();
        let total: f64 = row_loss.iter().sum();
        let n_valid = p.targets.n_valid;
        let loss = match opts.reduction {
            Reduction::None => HostTensor::from_f32(
                vec![n],
                &row_loss.iter().map(|&x| x as f32).collect::<Vec<_>>(),
                DType::F32,
            )?,
            Reduction::Sum => HostTensor::scalar_f32(total as f32),
            // `prepare` has rejected a mean over no valid row (`PreparedTargets::new`); kept as
            // an error, not a division by zero, should that ever change.
            Reduction::Mean if n_valid == 0 => {
                return Err(CceError::all_targets_ignored(n, opts));
            }
            Reduction::Mean => HostTensor::scalar_f32((total / n_valid as f64) as f32),
        };
        let f32v = |f: &dyn Fn(usize) -> f64| -> Result<HostTensor> {
            HostTensor::from_f32(
                vec![n],
                &(0..n).map(|i| f(i) as f32).collect::<Vec<_>>(),
                DType::F32,
            )
        };
        Ok((
            ForwardOutput {
                loss,
                lse: f32v(&|i| lse[i])?,
                rest_mass: f32v(&|i| rest[i])?,
                entropy: if opts.side_outputs.entropy {
                    Some(f32v(&|i| {
                        if acc[i].s > 0.0 {
                            lse[i] - acc[i].pz / acc[i].s
                        } else {
                            0.0
                        }
                    })?)
                } else {
                    None
                },
                argmax: if opts.side_outputs.argmax {
                    Some(HostTensor::from_i32(acc.iter().map(|a| a.argmax).collect()))
                } else {
                    None
                },
                stats: base_stats(p, opts),
            },
            tile_stats,
        ))
    }

    /// [`Backend::backward`] on any host buffers ([`HostRead`]), as
    /// [`CpuBackend::forward_host`]. Same errors as [`Backend::backward`].
    pub fn backward_host<T: HostRead>(
        &self,
        inputs: &Inputs<'_, T>,
        opts: &Options,
        saved: Saved<'_, T>,
        upstream: &Upstream<'_, T>,
    ) -> Result<BackwardOutput<HostTensor>> {
        let p = prepare(inputs, opts, &self.limits)?;
        saved.check(p.problem.n)?;
        if let Some(err) = opts.check_finite.then(|| non_finite_input(&p)).flatten() {
            return Err(err);
        }
        let lse = saved.lse.f32_values()?;
        let rest = saved.rest_mass.f32_values()?;
        self.backward_prepared(p, inputs.e.shape(), opts, (&lse, &rest), upstream, None)
    }

    /// [`Backend::forward_backward`] on any host buffers ([`HostRead`]), as
    /// [`CpuBackend::forward_host`]. A filtered call whose statistics fit in the budget beside
    /// the plan keeps each `(row, class tile)`'s largest logit and `Σ e^{z − max}`
    /// from its forward (with the classes by batch-mean logit, [`cce_core::vocab_order`]), so
    /// that its backward decides each row's kept tiles before recomputing any logits and
    /// recomputes only those; otherwise its backward decides from its own logits, as
    /// [`CpuBackend::backward_host`] does (the order taken once for both). Same errors as
    /// [`Backend::forward`] and [`Backend::backward`].
    pub fn forward_backward_host<T: HostRead>(
        &self,
        inputs: &Inputs<'_, T>,
        opts: &Options,
        upstream: &Upstream<'_, T>,
    ) -> Result<(ForwardOutput<HostTensor>, BackwardOutput<HostTensor>)> {
        let p = prepare(inputs, opts, &self.limits)?;
        if let Some(err) = opts.check_finite.then(|| non_finite_input(&p)).flatten() {
            return Err(err);
        }
        let order = order::order_for(&p, opts.workspace_budget_bytes).filter(|_| self.vocab_order);
        let keep_stats = fuses(&p, opts, order.as_ref());
        let mut p = match &order {
            Some(o) => order::reordered(p, o),
            None => p,
        };
        if keep_stats {
            p.plan.workspace_bytes += stats_bytes(&p);
        }
        let (fwd, stats) = self.forward_prepared(&p, opts, order.as_ref(), keep_stats)?;
        let (lse, rest) = (fwd.lse.f32_values()?, fwd.rest_mass.f32_values()?);
        let bwd = self.backward_prepared(
            p,
            inputs.e.shape(),
            opts,
            (&lse, &rest),
            upstream,
            Some(Decided { order, stats }),
        )?;
        Ok((fwd, bwd))
    }

    /// The backward of a prepared problem from the saved `(lse, rest_mass)`, checked here
    /// (upstream gradients, masked targets, a non-finite saved state). `decided`: the problem is
    /// already in the forward's order, and its statistics, when kept, decide the skips; without
    /// it the backward takes its own order ([`order::order_for`]) and decides from its logits.
    fn backward_prepared<T: HostRead>(
        &self,
        p: Prepared,
        e_shape: &[usize],
        opts: &Options,
        (lse, rest): (&[f32], &[f32]),
        upstream: &Upstream<'_, T>,
        decided: Option<Decided>,
    ) -> Result<BackwardOutput<HostTensor>> {
        let Problem { n, d, v, .. } = p.problem;
        // Only the bias can hold −inf (checked above, or the caller's choice).
        let bias_masks = p
            .bias
            .as_ref()
            .is_some_and(|b| b.contains(&f32::NEG_INFINITY));
        check_masked_targets(&p.targets, opts, |i| {
            let yi = p.targets.classes[i] as usize;
            let masked = p.bias.as_ref().is_some_and(|b| b[yi] == f32::NEG_INFINITY);
            (masked, bias_masks)
        })?;
        // A filtered backward may visit the classes by batch-mean logit (`order`): `p` is then
        // the reordered problem, and `d_c`, `d_bias` go back to class order at the end.
        let (p, order, stats) = match decided {
            Some(Decided { order, stats }) => (p, order, stats),
            None => {
                let order =
                    order::order_for(&p, opts.workspace_budget_bytes).filter(|_| self.vocab_order);
                let p = match &order {
                    Some(o) => order::reordered(p, o),
                    None => p,
                };
                (p, order, None)
            }
        };
        // With `check_finite` off the caller asked for NaN/Inf to propagate (the forward did not
        // reject them either), so a non-finite saved state is passed through.
        if opts.check_finite {
            cce_core::problem::check_saved_finite(lse, rest, &p.targets.classes)?;
        }
        check_upstream_rows(upstream, n)?;
        match upstream.d_loss {
            DLoss::Scalar(s) => cce_core::problem::check_upstream_finite("d_loss", [s])?,
            DLoss::PerRow(t) if opts.check_finite => {
                cce_core::problem::check_upstream_finite("d_loss", t.f32_values()?.iter().copied())?
            }
            DLoss::PerRow(_) => {}
        }
        if let (Some(t), true) = (upstream.d_lse, opts.check_finite) {
            cce_core::problem::check_upstream_finite("d_lse", t.f32_values()?.iter().copied())?;
        }
        let y = &p.targets.classes;
        // Upstream g_i and h_i.
        let g: Vec<f32> = match (opts.reduction, upstream.d_loss) {
            (Reduction::None, DLoss::PerRow(t)) if t.shape() == [n] => {
                let t = t.f32_values()?;
                loss_grad_rows(y, |i| t[i])
            }
            (Reduction::Mean | Reduction::Sum, DLoss::Scalar(s)) => {
                let s = scalar_loss_grad(opts.reduction, s, p.targets.n_valid);
                loss_grad_rows(y, |_| s)
            }
            _ => {
                let got = match upstream.d_loss {
                    DLoss::Scalar(_) => "a scalar".to_string(),
                    DLoss::PerRow(t) => format!("per-row {:?} {}", t.shape(), t.dtype()),
                };
                return Err(d_loss_mismatch(n, opts.reduction, &got));
            }
        };
        let h: Vec<f32> = match upstream.d_lse {
            Some(t) if t.shape() == [n] => t.f32_values()?.into_owned(),
            Some(t) => return Err(d_lse_mismatch(n, t.shape())),
            None => vec![0.0; n],
        };
        let rule = p.plan.filter;
        let alpha = opts.label_smoothing;
        let lambda = opts.z_loss;
        let active: Vec<bool> = (0..n).map(|i| g[i] != 0.0 || h[i] != 0.0).collect();
        let class_tiles: Vec<Range<usize>> = p
            .plan
            .class_chunks
            .iter()
            .flat_map(|cc| p.plan.class_tiles(cc.clone()))
            .collect();
        let row_tiles_of =
            |rc: &Range<usize>| -> Vec<Range<usize>> { p.plan.row_tiles(rc.clone()).collect() };
        let tiles_per_chunk: Vec<(Range<usize>, Vec<Range<usize>>)> = (p.plan.row_chunks.iter())
            .map(|rc| (rc.clone(), row_tiles_of(rc)))
            .collect();

        // 1. The filter's decisions, per row: the class tiles it keeps (a prefix of the order)
        // and the mass it drops ([`cce_core::tile_budget`]), from the fused forward's
        // statistics or from a pass over the logits.
        let decisions: Option<Vec<(usize, f64)>> = rule.enabled.then(|| {
            let g_ctx = GCtx {
                p: &p,
                lse,
                rest,
                g: &g,
                h: &h,
                y: &p.targets.classes,
                opts,
                alpha,
                lambda,
                rule,
                kept: None,
            };
            let (eps, delta) = (rule.eps, rule.max_dropped_mass as f64);
            let row_tiles: Vec<&Range<usize>> =
                tiles_per_chunk.iter().flat_map(|(_, rts)| rts).collect();
            let per_tile: Vec<Vec<(usize, f64)>> = row_tiles
                .into_par_iter()
                .map(|rows| match &stats {
                    Some(st) => st
                        .masses(rows, lse, &active, &p.targets.classes, &class_tiles)
                        .kept_prefix(eps, delta),
                    None => {
                        let probs = class_tiles.iter().map(|cl| {
                            let z = p.logits_tile(rows, cl, opts.softcap);
                            (cl.clone(), g_ctx.probs(rows, cl.len(), &z))
                        });
                        g_ctx.decide_rows(rows, class_tiles.len(), probs)
                    }
                })
                .collect();
            per_tile.concat()
        });
        // The rows by descending kept tiles: `p` and every per-row array then in that order,
        // `d_e` and the dropped masses back in row order at the end.
        let row_order = decisions.as_ref().map(|dec| {
            let kept: Vec<usize> = dec.iter().map(|&(k, _)| k).collect();
            cce_core::tile_budget::rows_by_kept(&kept)
        });
        let ro = row_order.as_deref();
        let (lse, rest) = (order::in_order(lse, ro), order::in_order(rest, ro));
        let (g, h) = (order::in_order(&g, ro), order::in_order(&h, ro));
        let (kept, dropped): (Option<Vec<usize>>, Vec<f64>) = match (&decisions, &row_order) {
            (Some(dec), Some(ro)) => {
                let dec = order::gather(dec, ro);
                (
                    Some(dec.iter().map(|&(k, _)| k).collect()),
                    dec.iter().map(|&(_, m)| m).collect(),
                )
            }
            _ => (None, vec![0.0; n]),
        };
        let p = match &row_order {
            Some(ro) => order::reordered_rows(p, ro),
            None => p,
        };
        let active: Vec<bool> = (0..n).map(|i| g[i] != 0.0 || h[i] != 0.0).collect();
        let y = &p.targets.classes;
        let g_ctx = GCtx {
            p: &p,
            lse: &lse,
            rest: &rest,
            g: &g,
            h: &h,
            y,
            opts,
            alpha,
            lambda,
            rule,
            kept: kept.as_deref(),
        };

        // 2-3. d_e, d_c per row chunk, per the strategy, each tile for the rows that keep it.
        let materialize = matches!(p.plan.strategy, Strategy::ChunkedDense { .. });
        let mut d_e = cce_core::try_filled(if opts.compute_d_e { n * d } else { 0 }, 0.0f32)?;
        let mut d_c = cce_core::try_filled(if opts.compute_d_c { v * d } else { 0 }, 0.0f32)?;
        let mut d_bias = cce_core::try_filled(if opts.compute_d_c { v } else { 0 }, 0.0f32)?;
        let (mut kept_tiles, mut skipped_tiles, mut kept_entries, mut skipped_entries) =
            (0u64, 0u64, 0u64, 0u64);
        for (rc, row_tiles) in &tiles_per_chunk {
            // Every tile of the chunk: its kept rows, and their G when materialized
            // (ChunkedDense); tile ownership recomputes G in each pass.
            let per_row_tile: Vec<Vec<TileG>> = row_tiles
                .par_iter()
                .map(|rows| {
                    (class_tiles.iter().enumerate())
                        .map(|(ct, classes)| g_ctx.tile(rows, ct, classes, materialize))
                        .collect()
                })
                .collect();
            for (rows, tiles) in row_tiles.iter().zip(&per_row_tile) {
                for t in tiles {
                    let (keep, drop) = rows
                        .clone()
                        .partition::<Vec<usize>, _>(|&i| i - rows.start < t.rows_kept);
                    let count = |x: &[usize]| x.iter().filter(|&&i| active[i]).count() as u64;
                    kept_entries += count(&keep) * t.classes as u64;
                    skipped_entries += count(&drop) * t.classes as u64;
                    if t.rows_kept == 0 {
                        skipped_tiles += 1;
                    } else {
                        kept_tiles += 1;
                    }
                }
            }
            // G of a tile for a product: its kept rows when that product is filtered, else
            // every row of the tile; `None` when no row keeps it.
            let g_of = |rows: &Range<usize>,
                        rt: usize,
                        ct: usize,
                        classes: &Range<usize>,
                        filtered: bool|
             -> Option<(usize, Cow<'_, [f32]>)> {
                let t = &per_row_tile[rt][ct];
                if !filtered && t.rows_kept < rows.len() {
                    return Some((rows.len(), Cow::Owned(g_ctx.dense_tile(rows, classes))));
                }
                if t.rows_kept == 0 {
                    return None;
                }
                // Materialized G is borrowed; tile ownership recomputes it.
                let g = match &t.g {
                    Some(gt) => Cow::Borrowed(gt.as_slice()),
                    None => Cow::Owned(g_ctx.tile(rows, ct, classes, true).g.unwrap_or_default()),
                };
                Some((t.rows_kept, g))
            };
            if opts.compute_d_e {
                let rows_slice = &mut d_e[rc.start * d..rc.end * d];
                rows_slice
                    .par_chunks_mut(p.plan.tile.rows * d)
                    .enumerate()
                    .for_each(|(rt, out)| {
                        let rows = &row_tiles[rt];
                        for (ct, classes) in class_tiles.iter().enumerate() {
                            if let Some((r, gt)) = g_of(rows, rt, ct, classes, rule.filter_e_grad) {
                                sgemm(
                                    r,
                                    classes.len(),
                                    d,
                                    &gt,
                                    (classes.len(), 1),
                                    &p.c[classes.start * d..classes.end * d],
                                    (d, 1),
                                    1.0,
                                    &mut out[..r * d],
                                    d,
                                );
                            }
                        }
                    });
            }
            if opts.compute_d_c {
                let tc = p.plan.tile.classes;
                d_c.par_chunks_mut(tc * d)
                    .zip(d_bias.par_chunks_mut(tc))
                    .enumerate()
                    .for_each(|(ct, (out, bias_out))| {
                        let classes = &class_tiles[ct];
                        for (rt, rows) in row_tiles.iter().enumerate() {
                            if let Some((r, gt)) = g_of(rows, rt, ct, classes, rule.filter_c_grad) {
                                let k = classes.len();
                                sgemm(
                                    k,
                                    r,
                                    d,
                                    &gt,
                                    (1, k),
                                    &p.e[rows.start * d..(rows.start + r) * d],
                                    (d, 1),
                                    1.0,
                                    out,
                                    d,
                                );
                                for ii in 0..r {
                                    for jj in 0..k {
                                        bias_out[jj] += gt[ii * k + jj];
                                    }
                                }
                            }
                        }
                    });
            }
        }
        // Label smoothing's rank-1 term (MATH.md, "Backward"), when analytic.
        if rule.label_smoothing_analytic && alpha > 0.0 {
            let a = alpha / v as f32;
            if opts.compute_d_e {
                let mut csum = vec![0.0f32; d];
                for row in p.c.chunks(d) {
                    csum.iter_mut().zip(row).for_each(|(s, x)| *s += x);
                }
                d_e.par_chunks_mut(d).enumerate().for_each(|(i, out)| {
                    out.iter_mut()
                        .zip(&csum)
                        .for_each(|(o, s)| *o -= a * g[i] * s);
                });
            }
            if opts.compute_d_c {
                let mut ge = vec![0.0f32; d];
                for (i, row) in p.e.chunks(d).enumerate() {
                    ge.iter_mut().zip(row).for_each(|(s, x)| *s += g[i] * x);
                }
                let gsum: f32 = g.iter().sum();
                d_c.par_chunks_mut(d)
                    .for_each(|out| out.iter_mut().zip(&ge).for_each(|(o, s)| *o -= a * s));
                d_bias.iter_mut().for_each(|b| *b -= a * gsum);
            }
        }
        // A NaN/Inf input with a finite saved lse surfaces in the gradients: name the input.
        if opts.check_finite {
            let bad = d_e
                .iter()
                .chain(&d_c)
                .chain(&d_bias)
                .any(|x| !x.is_finite());
            if bad {
                return Err(locate_non_finite(&p, 0));
            }
        }
        let filtered_passes = rule.filter_e_grad as u64 + rule.filter_c_grad as u64;
        let mut stats = base_stats(&p, opts);
        stats.tiles_visited = kept_tiles * filtered_passes;
        stats.tiles_skipped = skipped_tiles * filtered_passes;
        stats.entries_kept = kept_entries * filtered_passes;
        stats.entries_skipped = skipped_entries * filtered_passes;
        let valid_dropped: Vec<f64> = (0..n).filter(|&i| y[i] >= 0).map(|i| dropped[i]).collect();
        stats.dropped_mass_max = valid_dropped.iter().cloned().fold(0.0, f64::max);
        stats.dropped_mass_mean = if valid_dropped.is_empty() {
            0.0
        } else {
            valid_dropped.iter().sum::<f64>() / valid_dropped.len() as f64
        };
        if let Some(o) = &order {
            order::restore_rows(&mut d_c, d, o.perm());
            order::restore_rows(&mut d_bias, 1, o.perm());
        }
        if let Some(ro) = &row_order {
            order::restore_rows(&mut d_e, d, ro);
        }
        let out_dtype = match opts.grad_dtype {
            GradDType::F32 => DType::F32,
            GradDType::Input => p.problem.dtype,
        };
        let e_shape = e_shape.to_vec();
        Ok(BackwardOutput {
            d_e: if opts.compute_d_e {
                Some(HostTensor::from_f32(e_shape, &d_e, out_dtype)?)
            } else {
                None
            },
            d_c: if opts.compute_d_c {
                Some(HostTensor::from_f32(vec![v, d], &d_c, out_dtype)?)
            } else {
                None
            },
            d_bias: if opts.compute_d_c && p.bias.is_some() {
                Some(HostTensor::from_f32(vec![v], &d_bias, out_dtype)?)
            } else {
                None
            },
            stats,
        })
    }
}

/// `ShapeMismatch` for a per-row upstream gradient (`d_loss` of `Reduction::None`, `d_lse`)
/// that is not `[n]` f32, the form the contract and every backend take (not widened here from
/// another dtype, which a GPU backend refuses).
fn check_upstream_rows<T: HostRead>(upstream: &Upstream<'_, T>, n: usize) -> Result<()> {
    let per_row = match upstream.d_loss {
        DLoss::PerRow(t) => Some(t),
        DLoss::Scalar(_) => None,
    };
    for (what, t) in [("d_loss", per_row), ("d_lse", upstream.d_lse)] {
        if let Some(t) = t {
            if t.shape() != [n] || t.dtype() != DType::F32 {
                return Err(CceError::ShapeMismatch {
                    what,
                    expected: format!("[{n}] f32"),
                    got: format!("{:?} {}", t.shape(), t.dtype()),
                });
            }
        }
    }
    Ok(())
}

/// `−log p_y = lse − z_y` from the row's `lse`, target logit `z_y` and `rest = 1 − p_y`
/// (without cancellation): `−log1p(−rest)` when `p_y ≥ 1/2`, exact where `lse − z_y` would
/// cancel (a confident row); `lse − z_y` otherwise, where it is at least `ln 2`.
fn cross_entropy(lse: f64, zy: f64, rest: f64) -> f64 {
    if rest < 0.5 {
        -(-rest).ln_1p()
    } else {
        lse - zy
    }
}

fn base_stats(p: &Prepared, opts: &Options) -> CallStats {
    let _ = opts;
    CallStats {
        backend: "cpu".into(),
        strategy: p.plan.strategy,
        plan_reason: p.plan.reason.clone(),
        n_valid: p.targets.n_valid,
        tiles_total: p.plan.tile_count(),
        tiles_visited: 0,
        tiles_skipped: 0,
        entries_kept: 0,
        entries_skipped: 0,
        dropped_mass_max: 0.0,
        dropped_mass_mean: 0.0,
        filter_eps: p.plan.filter.eps,
        max_dropped_mass: p.plan.filter.max_dropped_mass,
        workspace_bytes: p.plan.workspace_bytes,
    }
}

fn locate_non_finite(p: &Prepared, row: usize) -> CceError {
    let bias = p.bias.as_deref();
    cce_core::problem::locate_non_finite(&p.e, &p.c, bias, p.problem.d, row)
}

/// [`cce_core::problem::non_finite_input`] of the prepared inputs.
fn non_finite_input(p: &Prepared) -> Option<CceError> {
    let bias = p.bias.as_deref();
    cce_core::problem::non_finite_input(&p.e, &p.c, bias, p.problem.d)
}
