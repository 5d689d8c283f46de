//! The shard primitives as a trait: what a backend gives for one shard `[v0, v1)`, so that
//! one driver (`cce_reference::vocab_parallel::RankDriver`) joins any backend's shards with
//! the collectives.
//!
//! Two implementations: the CPU reference's own shard passes (`cce_reference::vocab_parallel::
//! CpuShard`, per-row dropped mass, f64 partials) and [`super::over_backend::BackendShard`],
//! the primitives of any [`crate::Backend`] composed from its unsharded `forward` and
//! `backward` (the CUDA backend's, with no kernel of its own).

use super::partial::{targets_digest, PartialHeader, RowPartial};
use super::shard::VocabShard;
use crate::backend::{Inputs, Saved, Upstream};
use crate::error::Result;
use crate::options::Options;
use crate::problem::PreparedTargets;
use crate::stats::CallStats;
use crate::tensor::HostTensor;

/// What one shard's partial forward gives: a [`RowPartial`] per row, and what the merge
/// checks it against.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardForward {
    /// The shard.
    pub shard: VocabShard,
    /// `[N]` partials over the shard's real classes.
    pub rows: Vec<RowPartial>,
    /// The prepared targets of the batch (shift and `ignore_index` applied; the same on every
    /// rank).
    pub targets: PreparedTargets,
    /// What the shard did (its tiles, its share of the filter bound).
    pub stats: CallStats,
}

impl ShardForward {
    /// The header this shard sends with its rows ([`super::partial`]).
    pub fn header(&self) -> PartialHeader {
        PartialHeader {
            failed: false,
            shard: Some(self.shard),
            rows: self.rows.len(),
            n_valid: self.targets.n_valid,
            targets_digest: targets_digest(&self.targets),
        }
    }
}

/// What one shard's backward gives. `G`: the gradient buffers' type (host tensors on the CPU,
/// device tensors on a GPU backend).
#[derive(Debug)]
pub struct ShardBackward<G = HostTensor> {
    /// This shard's part of `d_e`, `[N·D]` f32 (row-major, the shape of `e` flattened), to be
    /// summed over the ranks: `Σ_{j ∈ shard} G_ij c_j` (and the shard's part of label
    /// smoothing's rank-1 term). `None` unless `compute_d_e`.
    pub d_e_partial: Option<Vec<f32>>,
    /// `d_c` of the shard's classes, `[v1 − v0, D]` in the gradient dtype: final, no
    /// collective; the padding rows are 0. `None` unless `compute_d_c`.
    pub d_c: Option<G>,
    /// `d_bias` of the shard's classes, `[v1 − v0]`, padding entries 0. `None` without a bias
    /// or unless `compute_d_c`.
    pub d_bias: Option<G>,
    /// `[N]` probability mass (`Σ g0`) the shard's filter skipped per row, when the
    /// primitives know it per row (the CPU shard); `None` when only the shard's maximum and
    /// mean over valid rows are known (`stats.dropped_mass_max`, `stats.dropped_mass_mean`:
    /// a backend's unsharded backward reports no more).
    pub dropped: Option<Vec<f64>>,
    /// What the shard did: its tiles, its share of the filter bound, its own dropped mass.
    pub stats: CallStats,
    /// The prepared targets of the batch (which rows have one).
    pub targets: PreparedTargets,
}

/// The primitives of one vocabulary shard: its partial forward, and its backward from the
/// merged forward. `T`: the inputs' buffer type; `S`, `U`: the saved buffers' and the
/// upstream gradients' (the same as `T` unless an implementation reads several kinds).
///
/// Contract, for `inputs` with `e` `[N, D]` (or `[..., T, D]`) and `targets` `[N]` of the
/// whole batch (identical on every rank) and `c` `[v1 − v0, D]`, `bias` `[v1 − v0]` the
/// shard's rows (padding rows included and never read):
///
/// - [`ShardPrimitives::shard_forward`] gives per row the [`RowPartial`] of the shard's real
///   classes; any representation the merge ([`super::merge_forward`]) reads the same way is
///   allowed (e.g. `max` = the shard's lse and `sum_exp` = 1). Errors: the input errors of
///   [`crate::Backend::forward`] on these shapes (targets checked against `V`),
///   `ShapeMismatch` when `c` does not hold the shard's rows, `NonFinite` under
///   `check_finite` (global indices); never the errors that need other shards (masked
///   targets, overflow): those come from the merge.
/// - [`ShardPrimitives::shard_backward`] gives the shard's `d_c`, `d_bias` (final) and its
///   partial `d_e` (f32, summed by the driver) from the merged `lse` and `rest_mass` `[N]`
///   f32, filtering with the shard's share of the bound ([`super::filter_split`]). Errors:
///   those of the forward, `ShapeMismatch` for saved or upstream buffers of the wrong shape,
///   `NonFinite` for bad lse or upstream values under `check_finite`, `TargetMasked` /
///   `InvalidOption` when this shard masks a row's target / any class under label smoothing.
pub trait ShardPrimitives<T, S = T, U = T> {
    /// The gradient buffers' type.
    type Grad;

    /// The partial forward of `shard`.
    fn shard_forward(
        &self,
        inputs: &Inputs<'_, T>,
        shard: &VocabShard,
        opts: &Options,
    ) -> Result<ShardForward>;

    /// The backward of `shard` from the merged forward.
    fn shard_backward(
        &self,
        inputs: &Inputs<'_, T>,
        shard: &VocabShard,
        opts: &Options,
        saved: Saved<'_, S>,
        upstream: &Upstream<'_, U>,
    ) -> Result<ShardBackward<Self::Grad>>;
}
