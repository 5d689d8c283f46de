//! The shard primitives of any [`Backend`], composed from its unsharded `forward` and
//! `backward` on the shard's classes: no kernel of the backend's own (the CUDA backend's
//! vocabulary-parallel primitives are these).
//!
//! # Forward: `RowPartial` from up to three unsharded forwards on the shard's real classes
//!
//! Each call runs with `reduction = None`, no shift, no z-loss, and gives every row a class of
//! the shard as its target (the row's own when the shard owns it, else a *stand-in*: the
//! first class the bias does not mask), so the backend computes every row. With `V_r` the
//! shard's real classes and `L_r` its lse:
//!
//! 1. label smoothing 0, entropy and argmax as asked: `L_r`, `ℓ1 = L_r − z_t`,
//!    `rest1 = 1 − p_t` (within the shard), `H_r`, the shard's argmax `a`. Then
//!    `z_y = L_r − ℓ1` and `rest_exp / sum_exp = rest1` on a row whose target it owns;
//! 2. with label smoothing only: label smoothing `A = 15/16` (any value in `(0, 1)` works;
//!    near 1 least amplifies rounding), `ℓ2 = L_r − (1 − A) z_t − A · mean_j z_j`, so
//!    `Σ_j z_j = V_r (L_r − (ℓ2 − (1 − A) ℓ1) / A)`;
//! 3. with the argmax side output only: targets `a`, `ℓ3 = L_r − z_a`, the shard's largest
//!    logit `z_a = L_r − ℓ3`.
//!
//! The partial is written around `max = L_r − u` with `u = ℓ3` when the argmax is asked (the
//! merge picks the global argmax by `max`, so it must be the largest logit) and `u = 0`
//! otherwise: `sum_exp = e^u` (exact in `u`, whatever rounding `L_r − u` has, as the merge
//! only ever forms `max + ln sum_exp`), `rest_exp = rest1 · sum_exp` (owned target) or
//! `sum_exp`, `weighted_logit_sum = (L_r − H_r) · sum_exp`. A class whose bias is −inf sets
//! `masked`; a shard whose every real class is masked sends the empty partial (no forward).
//!
//! # Backward: one unsharded backward on the shard's classes plus one zero class
//!
//! The unsharded backward from a given lse computes, for a row with target `t`,
//! `G'_ij = g'(p_ij − (1 − α') δ_jt − α'/V') + h' p_ij` (z-loss 0; `p` from the saved lse;
//! at the target `p_t` from the saved `rest_mass`). The shard needs
//! `G_ij = g((1 + 2λL) p_ij − (1 − α) δ_jy − α/V) + h p_ij` with the *merged* `L` (saved as
//! is) and the global `V`, and no one-hot on a row whose target another shard owns. So:
//!
//! - the backend sees `c` extended by one zero row (class `V_r`, `V' = V_r + 1`, bias 0): a
//!   row whose target is elsewhere gets target `V_r` and `rest_mass` 1, so its one-hot lands
//!   on the zero class, whose `d_e` contribution is `G · 0 = 0` and whose `d_c` row and
//!   `d_bias` entry are dropped; a row with the target gets its local class and the merged
//!   `rest_mass`; a row without a target stays ignored (`g = 0`, only `h p`);
//! - per-row `d_loss' = κ g`, `d_lse' = h + g (2λL + 1 − κ)`, and label smoothing
//!   `α' = (α V'/V) / κ` with `κ = 1 − α + α V'/V`: matching the coefficients of `p`, `δ` and
//!   the constant gives exactly `G` (also the filter's `g0`, which depends on the same
//!   `g(1 + 2λL) + h` and `g(1 − α)`), softcap's derivative applied by the backend per entry;
//! - the filter bound is the shard's share ([`super::filter_split`]); the zero class's entry
//!   (`g0 ≥ 1`) is never skipped, so the class tile holding it is never skipped either: a
//!   sharded call may skip a little less than the CPU shard, never more.
//!
//! The backward runs with f32 gradients (the partial `d_e` is summed over the ranks in f32, as
//! the CPU shard's) and the shard's `d_c`, `d_bias` are then cut to its real classes, padded
//! with zero rows and converted to the gradient dtype by [`ShardRows::resize_rows`].

use super::filter_split::{shard_filter_rule, split_dropped_mass};
use super::partial::RowPartial;
use super::primitives::{ShardBackward, ShardForward, ShardPrimitives};
use super::shard::VocabShard;
use crate::backend::{Backend, DLoss, Inputs, Saved, Upstream};
use crate::dtype::DType;
use crate::error::{CceError, Result};
use crate::options::{GradDType, Options, Reduction, SideOutputs};
use crate::problem::{
    check_masked_targets, check_upstream_finite, d_loss_mismatch, d_lse_mismatch, loss_grad_rows,
    scalar_loss_grad, PreparedTargets, Problem,
};
use crate::stats::CallStats;
use crate::tensor::{HostTensor, TensorMeta};

/// The label smoothing of the forward that measures `Σ_j z_j` (module docs, step 2).
const SUM_PROBE_ALPHA: f32 = 15.0 / 16.0;

/// Row operations on a backend's buffers that the composed shard primitives need beside the
/// [`Backend`] trait. The default goes through the host ([`Backend::download`] and
/// [`Backend::upload`]); a GPU backend overrides it with device copies.
pub trait ShardRows: Backend {
    /// A new buffer: rows `[0, take)` of `buf` (row-major, rows along its first dimension)
    /// followed by `zeros` rows of zeros, in `dtype` (float dtypes; values rounded to nearest
    /// from `buf`'s dtype). Shape `[take + zeros, rest of buf's shape]`.
    ///
    /// Errors: `ShapeMismatch` for a buffer of rank 0 or fewer than `take` rows;
    /// `DTypeMismatch` for integer dtypes; `ResourceLimit`, `OutOfMemory`, `Backend`.
    fn resize_rows(
        &self,
        buf: &Self::Buffer,
        take: usize,
        zeros: usize,
        dtype: DType,
    ) -> Result<Self::Buffer> {
        let (shape, width) = resized_shape(buf, take, zeros, dtype)?;
        let host = self.download(buf)?;
        let mut vals = host.try_to_f32_vec()?;
        vals.truncate(take * width);
        vals.resize((take + zeros) * width, 0.0);
        self.upload(&HostTensor::from_f32(shape, &vals, dtype)?)
    }
}

/// The shape of [`ShardRows::resize_rows`]'s result and the elements per row, with its checks.
pub fn resized_shape(
    buf: &dyn TensorMeta,
    take: usize,
    zeros: usize,
    dtype: DType,
) -> Result<(Vec<usize>, usize)> {
    let s = buf.shape();
    if s.is_empty() || s[0] < take {
        return Err(CceError::ShapeMismatch {
            what: "rows to keep",
            expected: format!("at least {take} rows"),
            got: format!("{s:?}"),
        });
    }
    if !dtype.is_float() || !buf.dtype().is_float() {
        return Err(CceError::DTypeMismatch {
            what: "resized rows",
            expected: "a float dtype".into(),
            got: if dtype.is_float() { buf.dtype() } else { dtype },
        });
    }
    let width = crate::tensor::checked_numel(&s[1..])?;
    let mut shape = s.to_vec();
    shape[0] = take
        .checked_add(zeros)
        .ok_or_else(|| CceError::ResourceLimit {
            resource: "resized rows".into(),
            requested: u64::MAX,
            max: usize::MAX as u64,
        })?;
    crate::tensor::checked_bytes(&shape, dtype)?;
    Ok((shape, width))
}

/// The shard primitives of backend `B` ([`ShardPrimitives`] over `B::Buffer`), composed from
/// its unsharded forward and backward (module docs).
#[derive(Debug)]
pub struct BackendShard<'b, B: ?Sized> {
    backend: &'b B,
}

impl<'b, B: ?Sized> BackendShard<'b, B> {
    /// The primitives of `backend`.
    pub fn new(backend: &'b B) -> Self {
        Self { backend }
    }
}

impl<B: ?Sized> Clone for BackendShard<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: ?Sized> Copy for BackendShard<'_, B> {}

/// A shard's validated inputs, what the host knows of them.
struct Prepared {
    problem: Problem,
    targets: PreparedTargets,
    /// Local target of each row when the shard owns it.
    local: Vec<Option<usize>>,
    /// Per real class: masked by a −inf bias.
    masked: Vec<bool>,
}

impl Prepared {
    fn any_masked(&self) -> bool {
        self.masked.contains(&true)
    }

    fn target_masked(&self, i: usize) -> bool {
        self.local[i].is_some_and(|l| self.masked[l])
    }
}

/// Row `i`'s values of an `[N]` f32 host tensor.
fn f32s(t: &HostTensor) -> Result<Vec<f32>> {
    t.try_to_f32_vec()
}

impl<B: ShardRows + ?Sized> BackendShard<'_, B> {
    /// Validate the shard's inputs as the CPU shard does, read the targets (and the bias) to
    /// the host.
    fn prepare(
        &self,
        inputs: &Inputs<'_, B::Buffer>,
        shard: &VocabShard,
        opts: &Options,
    ) -> Result<Prepared> {
        let problem = super::shard::shard_problem(inputs, shard, opts)?;
        let raw =
            self.backend
                .download(inputs.targets)?
                .to_i64_vec()
                .ok_or(CceError::DTypeMismatch {
                    what: "targets",
                    expected: "i32 or i64".into(),
                    got: inputs.targets.dtype(),
                })?;
        let targets = PreparedTargets::new(&raw, &problem, opts)?;
        let local = targets
            .classes
            .iter()
            .map(|&y| shard.local_target(y))
            .collect();
        let real = shard.real_len();
        let masked = match inputs.bias {
            Some(b) => {
                let vals = f32s(&self.backend.download(b)?)?;
                vals[..real]
                    .iter()
                    .map(|&x| x == f32::NEG_INFINITY)
                    .collect()
            }
            None => vec![false; real],
        };
        Ok(Prepared {
            problem,
            targets,
            local,
            masked,
        })
    }

    /// `buf` cut to the shard's real rows (itself when there is no padding).
    fn real_rows<'x>(
        &self,
        buf: &'x B::Buffer,
        shard: &VocabShard,
        extra: usize,
        holder: &'x mut Option<B::Buffer>,
    ) -> Result<&'x B::Buffer> {
        if shard.padding_len() == 0 && extra == 0 {
            return Ok(buf);
        }
        let t = self
            .backend
            .resize_rows(buf, shard.real_len(), extra, buf.dtype())?;
        Ok(holder.insert(t))
    }

    /// An `[N]`-row integer targets buffer of the original targets' shape.
    fn targets_buffer(&self, like: &B::Buffer, vals: Vec<i64>) -> Result<B::Buffer> {
        let t = HostTensor::from_i64(vals).reshape(like.shape().to_vec())?;
        self.backend.upload(&t)
    }

    /// Run one unsharded forward on the shard's real classes: its outputs on the host.
    fn probe(
        &self,
        inputs: &Inputs<'_, B::Buffer>,
        targets: Vec<i64>,
        opts: &Options,
    ) -> Result<Probe> {
        let t = self.targets_buffer(inputs.targets, targets)?;
        let out = self.backend.forward(
            &Inputs {
                targets: &t,
                ..*inputs
            },
            opts,
        )?;
        let get = |b: &B::Buffer| -> Result<Vec<f32>> { f32s(&self.backend.download(b)?) };
        let entropy = out.entropy.as_ref().map(get).transpose()?;
        let argmax = match &out.argmax {
            Some(a) => Some(self.backend.download(a)?.to_i64_vec().ok_or_else(|| {
                CceError::backend(self.backend.name(), "argmax is not an integer tensor")
            })?),
            None => None,
        };
        Ok(Probe {
            loss: get(&out.loss)?,
            lse: get(&out.lse)?,
            rest: get(&out.rest_mass)?,
            entropy,
            argmax,
            stats: out.stats,
        })
    }
}

/// The host copy of one unsharded forward's outputs.
struct Probe {
    loss: Vec<f32>,
    lse: Vec<f32>,
    rest: Vec<f32>,
    entropy: Option<Vec<f32>>,
    argmax: Option<Vec<i64>>,
    stats: CallStats,
}

/// A backend error about the shard's own `c` or `bias` with the shard's local indices, moved to
/// global indices (as the CPU shard reports them).
fn global_indices(e: CceError, shard: &VocabShard, d: usize) -> CceError {
    match e {
        CceError::NonFinite {
            what: what @ "c",
            index,
            row,
            value,
        } => CceError::NonFinite {
            what,
            index: index + shard.start() * d,
            row: row + shard.start(),
            value,
        },
        CceError::NonFinite {
            what: what @ "bias",
            index,
            row,
            value,
        } => CceError::NonFinite {
            what,
            index: index + shard.start(),
            row: row + shard.start(),
            value,
        },
        other => other,
    }
}

/// The options of the backend's calls on a shard: no reduction, no shift, no z-loss, no side
/// outputs, every row's target a class of the shard (`ignore_index = -1`).
fn shard_call_options(opts: &Options) -> Options {
    Options {
        reduction: Reduction::None,
        shift: 0,
        seq_len: None,
        ignore_index: -1,
        label_smoothing: 0.0,
        z_loss: 0.0,
        side_outputs: SideOutputs::default(),
        ..opts.clone()
    }
}

/// A shard's statistics from the backend's own (`pass`: forward or backward).
fn shard_stats(
    backend: &str,
    mut stats: CallStats,
    p: &Prepared,
    shard: &VocabShard,
    opts: &Options,
    pass: &str,
) -> CallStats {
    let rule = shard_filter_rule(opts, p.problem.dtype, shard);
    stats.plan_reason = format!(
        "{pass} of vocabulary shard [{}, {}) of V = {}: {} real classes, {} padding, through \
         the unsharded {backend} call; {}",
        shard.start(),
        shard.end(),
        shard.vocab_size(),
        shard.real_len(),
        shard.padding_len(),
        stats.plan_reason
    );
    stats.backend = format!("{backend} (vocab shard)");
    stats.n_valid = p.targets.n_valid;
    stats.filter_eps = rule.eps;
    stats.max_dropped_mass = rule.max_dropped_mass;
    stats
}

/// Statistics of a shard that ran nothing (padding only, or every class masked).
fn idle_stats(backend: &str, p: &Prepared, shard: &VocabShard, opts: &Options) -> CallStats {
    let base = CallStats {
        backend: String::new(),
        strategy: crate::plan::Strategy::TileOwnership,
        plan_reason: "no real class to compute".into(),
        n_valid: 0,
        tiles_total: 0,
        tiles_visited: 0,
        tiles_skipped: 0,
        entries_kept: 0,
        entries_skipped: 0,
        dropped_mass_max: 0.0,
        dropped_mass_mean: 0.0,
        filter_eps: 0.0,
        max_dropped_mass: 0.0,
        workspace_bytes: 0,
    };
    shard_stats(backend, base, p, shard, opts, "call")
}

impl<B: ShardRows + ?Sized> ShardPrimitives<B::Buffer> for BackendShard<'_, B> {
    type Grad = B::Buffer;

    /// The partial forward from up to three unsharded forwards (module docs). Errors as
    /// [`ShardPrimitives::shard_forward`] (a `NonFinite` in the shard's `c` or `bias` with
    /// global indices), plus the backend's own.
    fn shard_forward(
        &self,
        inputs: &Inputs<'_, B::Buffer>,
        shard: &VocabShard,
        opts: &Options,
    ) -> Result<ShardForward> {
        let p = self.prepare(inputs, shard, opts)?;
        let n = p.problem.n;
        let name = self.backend.name();
        let real = shard.real_len();
        let Some(stand_in) = p.masked.iter().position(|&m| !m) else {
            // Padding only, or every real class masked: nothing to compute.
            let mut rows = vec![RowPartial::EMPTY; n];
            for (r, l) in rows.iter_mut().zip(&p.local) {
                r.masked = real > 0;
                if l.is_some() {
                    r.target_logit = Some(f64::NEG_INFINITY);
                }
            }
            let stats = idle_stats(name, &p, shard, opts);
            return Ok(ShardForward {
                shard: *shard,
                rows,
                targets: p.targets,
                stats,
            });
        };
        let mut c_hold = None;
        let mut b_hold = None;
        let c = self.real_rows(inputs.c, shard, 0, &mut c_hold)?;
        let bias = match inputs.bias {
            Some(b) => Some(self.real_rows(b, shard, 0, &mut b_hold)?),
            None => None,
        };
        let local_inputs = Inputs { c, bias, ..*inputs };
        let base = shard_call_options(opts);
        let owned_targets: Vec<i64> = (0..n)
            .map(|i| match p.local[i] {
                Some(l) if !p.target_masked(i) => l as i64,
                _ => stand_in as i64,
            })
            .collect();
        let d = p.problem.d;
        let first = Options {
            side_outputs: opts.side_outputs,
            ..base.clone()
        };
        let run = |targets: Vec<i64>, o: &Options| {
            self.probe(&local_inputs, targets, o)
                .map_err(|e| global_indices(e, shard, d))
        };
        let Probe {
            loss: l1,
            lse,
            rest: rest1,
            entropy,
            argmax,
            stats: first_stats,
        } = run(owned_targets.clone(), &first)?;
        let logit_mean = if opts.label_smoothing > 0.0 && !p.any_masked() {
            let probe = Options {
                label_smoothing: SUM_PROBE_ALPHA,
                check_finite: false,
                ..base.clone()
            };
            let l2 = run(owned_targets, &probe)?.loss;
            let a = SUM_PROBE_ALPHA as f64;
            Some(
                (0..n)
                    .map(|i| lse[i] as f64 - (l2[i] as f64 - (1.0 - a) * l1[i] as f64) / a)
                    .collect::<Vec<f64>>(),
            )
        } else {
            None
        };
        let top = match &argmax {
            Some(a) if opts.side_outputs.argmax => {
                let probe = Options {
                    check_finite: false,
                    ..base.clone()
                };
                Some(run(a.clone(), &probe)?.loss)
            }
            _ => None,
        };
        let any_masked = p.any_masked();
        let rows = (0..n)
            .map(|i| {
                let l = lse[i] as f64;
                if l == f64::NEG_INFINITY {
                    return RowPartial {
                        masked: any_masked,
                        target_logit: p.local[i].map(|_| f64::NEG_INFINITY),
                        ..RowPartial::EMPTY
                    };
                }
                let u = top.as_ref().map_or(0.0, |t| t[i] as f64);
                let sum_exp = u.exp();
                let owned = p.local[i].is_some();
                let target_logit = match p.local[i] {
                    Some(_) if p.target_masked(i) => Some(f64::NEG_INFINITY),
                    Some(_) => Some(l - l1[i] as f64),
                    None => None,
                };
                RowPartial {
                    max: l - u,
                    sum_exp,
                    rest_exp: if owned && !p.target_masked(i) {
                        rest1[i] as f64 * sum_exp
                    } else {
                        sum_exp
                    },
                    target_logit,
                    logit_sum: logit_mean.as_ref().map_or(0.0, |m| m[i] * real as f64),
                    weighted_logit_sum: entropy
                        .as_ref()
                        .map_or(0.0, |h| (l - h[i] as f64) * sum_exp),
                    argmax: argmax
                        .as_ref()
                        .map_or(0, |a| (shard.start() as i64 + a[i]) as u32),
                    masked: any_masked,
                }
            })
            .collect();
        // The first forward's statistics stand for the call's (the probes repeat its plan).
        let mut stats = shard_stats(name, first_stats, &p, shard, opts, "forward");
        stats.plan_reason = format!(
            "{} unsharded forward(s): {}",
            1 + usize::from(logit_mean.is_some()) + usize::from(top.is_some()),
            stats.plan_reason
        );
        Ok(ShardForward {
            shard: *shard,
            rows,
            targets: p.targets,
            stats,
        })
    }

    /// The shard's gradients from one unsharded backward over its real classes and a zero
    /// class (module docs). Errors as [`ShardPrimitives::shard_backward`], plus the
    /// backend's own.
    fn shard_backward(
        &self,
        inputs: &Inputs<'_, B::Buffer>,
        shard: &VocabShard,
        opts: &Options,
        saved: Saved<'_, B::Buffer>,
        upstream: &Upstream<'_, B::Buffer>,
    ) -> Result<ShardBackward<B::Buffer>> {
        let p = self.prepare(inputs, shard, opts)?;
        let (n, d) = (p.problem.n, p.problem.d);
        let name = self.backend.name();
        saved.check(n)?;
        check_masked_targets(&p.targets, opts, |i| (p.target_masked(i), p.any_masked()))?;
        let lse = f32s(&self.backend.download(saved.lse)?)?;
        let rest = f32s(&self.backend.download(saved.rest_mass)?)?;
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
        let (g, h) = self.upstream_rows(&p, opts, upstream)?;
        let out_dtype = match opts.grad_dtype {
            GradDType::F32 => DType::F32,
            GradDType::Input => p.problem.dtype,
        };
        let real = shard.real_len();
        if real == 0 {
            let zeros = |shape: Vec<usize>| -> Result<B::Buffer> {
                let len = crate::tensor::checked_numel(&shape)?;
                let vals = crate::tensor::try_filled(len, 0.0f32)?;
                self.backend
                    .upload(&HostTensor::from_f32(shape, &vals, out_dtype)?)
            };
            let compute_d_c = opts.compute_d_c;
            return Ok(ShardBackward {
                d_e_partial: if opts.compute_d_e {
                    Some(crate::tensor::try_filled(n * d, 0.0f32)?)
                } else {
                    None
                },
                d_c: compute_d_c
                    .then(|| zeros(vec![shard.len(), d]))
                    .transpose()?,
                d_bias: (compute_d_c && inputs.bias.is_some())
                    .then(|| zeros(vec![shard.len()]))
                    .transpose()?,
                dropped: Some(vec![0.0; n]),
                stats: idle_stats(name, &p, shard, opts),
                targets: p.targets,
            });
        }
        // The coefficients of module docs: V' = V_r + 1 classes, the last one zero.
        let (alpha, lambda) = (opts.label_smoothing as f64, opts.z_loss as f64);
        let v = shard.vocab_size() as f64;
        let v_ext = (real + 1) as f64;
        let kappa = 1.0 - alpha + alpha * v_ext / v;
        let alpha_ext = (alpha * v_ext / v) / kappa;
        let one_minus_kappa = alpha * (1.0 - v_ext / v);
        let mut targets_b = vec![-1i64; n];
        let mut rest_b = vec![0.0f32; n];
        let mut dl_b = vec![0.0f32; n];
        let mut dlse_b = vec![0.0f32; n];
        for i in 0..n {
            let has = p.targets.classes[i] >= 0;
            if has {
                match p.local[i] {
                    Some(l) => {
                        targets_b[i] = l as i64;
                        rest_b[i] = rest[i];
                    }
                    None => {
                        targets_b[i] = real as i64;
                        rest_b[i] = 1.0;
                    }
                }
            }
            let gi = g[i] as f64;
            dl_b[i] = (kappa * gi) as f32;
            dlse_b[i] =
                (h[i] as f64 + gi * (2.0 * lambda * lse[i] as f64 + one_minus_kappa)) as f32;
        }
        let mut c_hold = None;
        let mut b_hold = None;
        let c = self.real_rows(inputs.c, shard, 1, &mut c_hold)?;
        let bias = match inputs.bias {
            Some(b) => Some(self.real_rows(b, shard, 1, &mut b_hold)?),
            None => None,
        };
        let t = self.targets_buffer(inputs.targets, targets_b)?;
        let up = |vals: &[f32]| -> Result<B::Buffer> {
            self.backend
                .upload(&HostTensor::from_f32(vec![n], vals, DType::F32)?)
        };
        let (rest_buf, dl_buf, dlse_buf) = (up(&rest_b)?, up(&dl_b)?, up(&dlse_b)?);
        let o = Options {
            label_smoothing: alpha_ext as f32,
            max_dropped_mass: split_dropped_mass(opts.max_dropped_mass, real, shard.vocab_size()),
            grad_dtype: GradDType::F32,
            ..shard_call_options(opts)
        };
        let out = self
            .backend
            .backward(
                &Inputs {
                    e: inputs.e,
                    c,
                    bias,
                    targets: &t,
                },
                &o,
                Saved {
                    lse: saved.lse,
                    rest_mass: &rest_buf,
                },
                &Upstream {
                    d_loss: DLoss::PerRow(&dl_buf),
                    d_lse: Some(&dlse_buf),
                },
            )
            .map_err(|e| global_indices(e, shard, d))?;
        let d_e_partial = match &out.d_e {
            Some(t) => Some(f32s(&self.backend.download(t)?)?),
            None => None,
        };
        let pad = shard.padding_len();
        let cut = |t: &Option<B::Buffer>| -> Result<Option<B::Buffer>> {
            t.as_ref()
                .map(|t| self.backend.resize_rows(t, real, pad, out_dtype))
                .transpose()
        };
        let d_c = if opts.compute_d_c {
            cut(&out.d_c)?
        } else {
            None
        };
        let d_bias = if opts.compute_d_c {
            cut(&out.d_bias)?
        } else {
            None
        };
        let stats = shard_stats(name, out.stats, &p, shard, opts, "backward");
        Ok(ShardBackward {
            d_e_partial,
            d_c,
            d_bias,
            dropped: None,
            stats,
            targets: p.targets,
        })
    }
}

impl<B: ShardRows + ?Sized> BackendShard<'_, B> {
    /// The upstream gradients per row on the host: `g_i` (0 at rows without a target; a mean's
    /// scalar over the valid rows of the whole batch) and `h_i`, with the CPU shard's checks.
    fn upstream_rows(
        &self,
        p: &Prepared,
        opts: &Options,
        upstream: &Upstream<'_, B::Buffer>,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let n = p.problem.n;
        let y = &p.targets.classes;
        let per_row = |t: &B::Buffer| -> Result<Vec<f32>> { f32s(&self.backend.download(t)?) };
        let g: Vec<f32> = match (opts.reduction, upstream.d_loss) {
            (Reduction::None, DLoss::PerRow(t)) if t.shape() == [n] => {
                let t = per_row(t)?;
                if opts.check_finite {
                    check_upstream_finite("d_loss", t.iter().copied())?;
                }
                loss_grad_rows(y, |i| t[i])
            }
            (Reduction::Mean | Reduction::Sum, DLoss::Scalar(s)) => {
                check_upstream_finite("d_loss", [s])?;
                let s = scalar_loss_grad(opts.reduction, s, p.targets.n_valid);
                loss_grad_rows(y, |_| s)
            }
            _ => {
                if let DLoss::Scalar(s) = upstream.d_loss {
                    check_upstream_finite("d_loss", [s])?;
                }
                return Err(d_loss_mismatch(n, opts.reduction, upstream.d_loss.kind()));
            }
        };
        let h = match upstream.d_lse {
            Some(t) if t.shape() == [n] => {
                let t = per_row(t)?;
                if opts.check_finite {
                    check_upstream_finite("d_lse", t.iter().copied())?;
                }
                t
            }
            Some(t) => return Err(d_lse_mismatch(n, t.shape())),
            None => vec![0.0; n],
        };
        Ok((g, h))
    }
}
