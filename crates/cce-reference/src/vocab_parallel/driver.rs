//! The whole vocabulary-parallel call on one rank: the shard's primitives
//! ([`ShardPrimitives`]: the CPU reference's [`CpuShard`] by default, any backend's through
//! [`cce_core::vocab_parallel::BackendShard`]) joined by the collectives of a
//! [`Communicator`].

use super::backward::dropped_summary;
use super::CpuShard;
use cce_core::stats::CallStats;
use cce_core::vocab_parallel::partial::{decode, encode, encode_failure, wire_len};
use cce_core::vocab_parallel::{
    merge_forward, Communicator, MergedForward, RankPartial, ReduceOp, ShardBackward, ShardForward,
    ShardLayout, ShardPrimitives, VocabParallelError, VocabShard,
};
use cce_core::{
    CceError, DType, FilterRule, ForwardOutput, GradDType, HostTensor, Inputs, Options, Result,
    Saved, TensorMeta, Upstream,
};

/// The forward of one rank: the outputs of the whole vocabulary (the same on every rank) and
/// this shard's statistics.
#[derive(Debug)]
pub struct RankForward {
    /// Loss (`[]` f32 for mean/sum, `[N]` for none), lse `[N]` f32, `rest_mass` `[N]` f32
    /// (save both for the backward), entropy and argmax when asked. `stats`: this rank's
    /// tiles, the valid rows and the unsharded filter settings.
    pub output: ForwardOutput<HostTensor>,
    /// The merged rows, f64 (before rounding to the f32 outputs).
    pub merged: MergedForward,
    /// This shard's own statistics.
    pub shard_stats: CallStats,
}

/// The backward of one rank. `G`: the shard gradients' buffer type (the primitives'
/// [`ShardPrimitives::Grad`]).
#[derive(Debug)]
pub struct RankBackward<G = HostTensor> {
    /// `d_e` `[N, D]` (the shape of `e`), summed over the ranks (the same on every rank), in
    /// the gradient dtype; `None` unless `compute_d_e`.
    pub d_e: Option<HostTensor>,
    /// `d_c` of this rank's classes `[v1 − v0, D]` (padding rows 0); `None` unless
    /// `compute_d_c`.
    pub d_c: Option<G>,
    /// `d_bias` of this rank's classes `[v1 − v0]`; `None` without a bias or unless
    /// `compute_d_c`.
    pub d_bias: Option<G>,
    /// The whole call: tiles and entries summed over the ranks, the dropped mass per row
    /// summed over the shards (its max and mean over valid rows, `≤ max_dropped_mass`), the
    /// unsharded filter settings. When some rank's primitives know only their own maximum
    /// and mean ([`ShardBackward::dropped`] `None`), the mean is still exact (a sum of means
    /// over the same valid rows) and the maximum is the sum of the shards' maxima, an upper
    /// bound of the largest row's total.
    pub stats: CallStats,
    /// This shard's own statistics (its share of the bound, its dropped mass).
    pub shard_stats: CallStats,
    /// `[N]` probability mass (`Σ g0`) the filter skipped per row, summed over the shards
    /// (`≤ max_dropped_mass`; 0 where nothing was skipped); `None` when some rank's
    /// primitives do not report it per row.
    pub dropped: Option<Vec<f64>>,
}

/// Runs a vocabulary-parallel call on one rank: the shard primitives `P` ([`CpuShard`] unless
/// [`RankDriver::with_primitives`] sets others) and the collectives of `comm`. Every rank of
/// the group runs the same calls.
///
/// Collectives per call: the forward one all-gather of `k·(7 + 8N)` f64; the backward one
/// all-reduce of `N + k + 8` f64 (dropped mass per row, a failure flag per rank, counters)
/// and, with `compute_d_e`, one all-reduce of `N·D` f32 (`d_e`).
///
/// A rank whose own inputs are bad still takes part in the step's first collective, flagged
/// as failed, and returns its own error; the others return
/// `VocabParallelError::PeerFailed` naming it, so no rank waits for one that has stopped
/// (this needs the ranks to agree on `N`, the rows of `e`, which the collective's length
/// depends on). Every rank passes the same `e`, targets and options: the targets are checked
/// (a digest travels with the partials), the options are not (a rank with another
/// `compute_d_e` would skip the `d_e` all-reduce the others wait in).
#[derive(Debug)]
pub struct RankDriver<'c, C: ?Sized, P = CpuShard> {
    comm: &'c C,
    shard: VocabShard,
    prims: P,
}

impl<'c, C: Communicator + ?Sized> RankDriver<'c, C> {
    /// The driver of rank `comm.rank()` of `layout`.
    ///
    /// Errors: `VocabParallel(RankCount)` when the layout has not one shard per rank.
    pub fn new(comm: &'c C, layout: &ShardLayout) -> Result<Self> {
        if layout.len() != comm.size() {
            return Err(VocabParallelError::RankCount {
                ranks: comm.size(),
                shards: layout.len(),
            }
            .into());
        }
        Ok(Self::from_shard(comm, layout.shard(comm.rank())?))
    }

    /// The driver of a rank that knows only its own shard (the tiling of all shards is then
    /// checked by the forward's merge, on every call).
    pub fn from_shard(comm: &'c C, shard: VocabShard) -> Self {
        Self {
            comm,
            shard,
            prims: CpuShard::new(),
        }
    }

    /// The same driver with other CPU primitives (e.g. another tile shape).
    pub fn with_cpu(self, cpu: CpuShard) -> Self {
        Self { prims: cpu, ..self }
    }
}

impl<'c, C: Communicator + ?Sized, P> RankDriver<'c, C, P> {
    /// The same driver over other shard primitives (e.g.
    /// [`cce_core::vocab_parallel::BackendShard`] over a GPU backend).
    pub fn with_primitives<Q>(self, prims: Q) -> RankDriver<'c, C, Q> {
        RankDriver {
            comm: self.comm,
            shard: self.shard,
            prims,
        }
    }

    /// The shard primitives.
    pub fn primitives(&self) -> &P {
        &self.prims
    }

    /// This rank's shard.
    pub fn shard(&self) -> VocabShard {
        self.shard
    }

    /// Forward: this shard's partial ([`ShardPrimitives::shard_forward`]), the all-gather, the merge
    /// ([`merge_forward`]). `inputs`: `e` and `targets` of the whole batch (identical on every
    /// rank), `c` and `bias` of this shard.
    ///
    /// Errors: this shard's own errors ([`ShardPrimitives::shard_forward`]); those of [`merge_forward`]
    /// (shards that do not tile the vocabulary, ranks that disagree or failed, masked targets,
    /// overflow); the communicator's.
    pub fn forward<T: TensorMeta>(
        &self,
        inputs: &Inputs<'_, T>,
        opts: &Options,
    ) -> Result<RankForward>
    where
        P: ShardPrimitives<T>,
    {
        let n = rows_of(inputs);
        let local = self.prims.shard_forward(inputs, &self.shard, opts);
        let msg = match &local {
            Ok(f) => encode(&f.header(), &f.rows),
            Err(_) => encode_failure(n),
        };
        let k = self.comm.size();
        let mut recv = vec![0.0f64; k * msg.len()];
        let gathered = self.comm.all_gather_f64(&msg, &mut recv);
        let local = local?;
        gathered?;
        let parts = recv
            .chunks_exact(wire_len(local.rows.len()).max(1))
            .enumerate()
            .map(|(r, m)| decode(m, r).map(|(header, rows)| RankPartial { header, rows }))
            .collect::<Result<Vec<_>>>()?;
        let merged = merge_forward(&parts, &local.targets, opts)?;
        let output = forward_output(&local, &merged, opts, inputs.e.dtype())?;
        Ok(RankForward {
            output,
            merged,
            shard_stats: local.stats,
        })
    }

    /// Backward from the merged `lse` and `rest_mass` of [`RankDriver::forward`] (the same
    /// inputs and options): this shard's gradients ([`ShardPrimitives::shard_backward`]), the
    /// agreement all-reduce, and the `d_e` all-reduce.
    ///
    /// Errors: this shard's own errors ([`ShardPrimitives::shard_backward`]); `PeerFailed` when another
    /// rank's failed; `NonFinite` when the summed `d_e` overflows under `check_finite`; the
    /// communicator's.
    pub fn backward<T: TensorMeta, S, U>(
        &self,
        inputs: &Inputs<'_, T>,
        opts: &Options,
        saved: Saved<'_, S>,
        upstream: &Upstream<'_, U>,
    ) -> Result<RankBackward<P::Grad>>
    where
        P: ShardPrimitives<T, S, U>,
    {
        let n = rows_of(inputs);
        let local = self
            .prims
            .shard_backward(inputs, &self.shard, opts, saved, upstream);
        let mut agreed = agreement_buffer(&local, n, self.comm.rank(), self.comm.size());
        let reduced = self.comm.all_reduce_f64(&mut agreed, ReduceOp::Sum);
        let local = local?;
        reduced?;
        let failed: Vec<usize> = agreed[n..n + self.comm.size()]
            .iter()
            .enumerate()
            .filter(|(_, &f)| f != 0.0)
            .map(|(r, _)| r)
            .collect();
        if !failed.is_empty() {
            return Err(VocabParallelError::PeerFailed { ranks: failed }.into());
        }
        let stats = merged_backward_stats(&local, &agreed, n, self.comm.size(), opts, inputs);
        let d_e = match local.d_e_partial {
            Some(mut d_e) => {
                self.comm.all_reduce_f32(&mut d_e, ReduceOp::Sum)?;
                if opts.check_finite {
                    if let Some((index, &value)) =
                        d_e.iter().enumerate().find(|(_, x)| !x.is_finite())
                    {
                        let d = inputs.c.shape().get(1).copied().unwrap_or(1).max(1);
                        return Err(CceError::NonFinite {
                            what: "d_e (overflow)",
                            index,
                            row: index / d,
                            value,
                        });
                    }
                }
                Some(HostTensor::from_f32(
                    inputs.e.shape().to_vec(),
                    &d_e,
                    grad_dtype(opts, inputs.e.dtype()),
                )?)
            }
            None => None,
        };
        Ok(RankBackward {
            d_e,
            d_c: local.d_c,
            d_bias: local.d_bias,
            stats,
            shard_stats: local.stats,
            dropped: (agreed[n + self.comm.size() + 7] == 0.0).then(|| agreed[..n].to_vec()),
        })
    }

    /// [`RankDriver::forward`] then [`RankDriver::backward`] from its saved outputs.
    pub fn forward_backward<T: TensorMeta, U>(
        &self,
        inputs: &Inputs<'_, T>,
        opts: &Options,
        upstream: &Upstream<'_, U>,
    ) -> Result<RankCall<GradOf<P, T, U>>>
    where
        P: ShardPrimitives<T> + ShardPrimitives<T, HostTensor, U>,
    {
        let fwd = self.forward(inputs, opts)?;
        let bwd = self.backward(inputs, opts, fwd.output.saved(), upstream)?;
        Ok((fwd, bwd))
    }
}

/// The gradient buffers of primitives `P` whose backward reads host-saved buffers.
type GradOf<P, T, U> = <P as ShardPrimitives<T, HostTensor, U>>::Grad;

/// A rank's forward and backward.
type RankCall<G> = (RankForward, RankBackward<G>);

/// Rows `N` as the shapes tell (the product of `e`'s leading dimensions, else the targets'
/// length), for the length of a failing rank's message.
fn rows_of<T: TensorMeta>(inputs: &Inputs<'_, T>) -> usize {
    let es = inputs.e.shape();
    if es.len() >= 2 {
        if let Ok(n) = cce_core::checked_numel(&es[..es.len() - 1]) {
            return n;
        }
    }
    inputs.targets.numel()
}

/// `[dropped mass per row (N) | failure flag per rank (k) | tiles visited, tiles skipped,
/// entries kept, entries skipped, tiles total, dropped-mass maximum, dropped-mass mean, ranks
/// without per-row dropped mass]`, this rank's contribution to the sum.
fn agreement_buffer<G>(
    local: &Result<ShardBackward<G>>,
    n: usize,
    rank: usize,
    k: usize,
) -> Vec<f64> {
    let mut buf = vec![0.0f64; n + k + 8];
    match local {
        Ok(b) => {
            if let Some(dropped) = &b.dropped {
                let len = dropped.len().min(n);
                buf[..len].copy_from_slice(&dropped[..len]);
            }
            let s = &b.stats;
            buf[n + k..].copy_from_slice(&[
                s.tiles_visited as f64,
                s.tiles_skipped as f64,
                s.entries_kept as f64,
                s.entries_skipped as f64,
                s.tiles_total as f64,
                s.dropped_mass_max,
                s.dropped_mass_mean,
                f64::from(u8::from(b.dropped.is_none())),
            ]);
        }
        Err(_) => buf[n + rank] = 1.0,
    }
    buf
}

/// The whole call's backward statistics from the summed agreement buffer.
fn merged_backward_stats<T: TensorMeta, G>(
    local: &ShardBackward<G>,
    summed: &[f64],
    n: usize,
    k: usize,
    opts: &Options,
    inputs: &Inputs<'_, T>,
) -> CallStats {
    let rule = FilterRule::resolve(opts, inputs.e.dtype());
    let counters = &summed[n + k..];
    let (max, mean) = if counters[7] == 0.0 {
        dropped_summary(&summed[..n], &local.targets.classes)
    } else {
        (counters[5], counters[6])
    };
    CallStats {
        backend: format!("{} vocab-parallel ({k} ranks)", shard_backend(&local.stats)),
        plan_reason: format!("{k} vocabulary shards; {}", local.stats.plan_reason),
        tiles_visited: counters[0] as u64,
        tiles_skipped: counters[1] as u64,
        entries_kept: counters[2] as u64,
        entries_skipped: counters[3] as u64,
        tiles_total: counters[4] as u64,
        dropped_mass_max: max,
        dropped_mass_mean: mean,
        filter_eps: rule.eps,
        max_dropped_mass: rule.max_dropped_mass,
        ..local.stats.clone()
    }
}

/// The name of a shard's backend in its statistics (`cpu (vocab shard)` -> `cpu`).
fn shard_backend(stats: &CallStats) -> &str {
    stats.backend.split(' ').next().unwrap_or("cpu")
}

/// The gradients' dtype.
fn grad_dtype(opts: &Options, input: DType) -> DType {
    match opts.grad_dtype {
        GradDType::F32 => DType::F32,
        GradDType::Input => input,
    }
}

/// The forward's outputs as host tensors (the unsharded backend's shapes and dtypes).
fn forward_output(
    local: &ShardForward,
    merged: &MergedForward,
    opts: &Options,
    dtype: DType,
) -> Result<ForwardOutput<HostTensor>> {
    let n = merged.rows.len();
    let f32v = |f: &dyn Fn(usize) -> f64| -> Result<HostTensor> {
        HostTensor::from_f32(
            vec![n],
            &(0..n).map(|i| f(i) as f32).collect::<Vec<_>>(),
            DType::F32,
        )
    };
    let loss = match merged.loss {
        Some(l) => HostTensor::scalar_f32(l as f32),
        None => f32v(&|i| merged.row_loss[i])?,
    };
    let rule = FilterRule::resolve(opts, dtype);
    let stats = CallStats {
        filter_eps: rule.eps,
        max_dropped_mass: rule.max_dropped_mass,
        ..local.stats.clone()
    };
    Ok(ForwardOutput {
        loss,
        lse: f32v(&|i| merged.rows[i].lse)?,
        rest_mass: f32v(&|i| merged.rows[i].rest_mass)?,
        entropy: if opts.side_outputs.entropy {
            Some(f32v(&|i| merged.rows[i].entropy)?)
        } else {
            None
        },
        argmax: if opts.side_outputs.argmax {
            Some(HostTensor::from_i32(
                merged.rows.iter().map(|r| r.argmax).collect(),
            ))
        } else {
            None
        },
        stats,
    })
}
