//! The CPU partial forward of one shard.

use super::inputs::{prepare, ShardInputs};
use super::CpuShard;
use crate::view::HostRead;
use cce_core::plan::Strategy;
use cce_core::stats::CallStats;
use cce_core::vocab_parallel::{shard_filter_rule, RowPartial, ShardForward, VocabShard};
use cce_core::{Inputs, Options, Result};
use rayon::prelude::*;

impl CpuShard {
    /// The partial forward of `shard` (MATH.md "Forward", restricted to the shard's real
    /// classes; `cce_core::vocab_parallel::partial` lists what is accumulated).
    ///
    /// `inputs`: `e` `[N, D]` (or `[..., T, D]`) and `targets` `[N]` of the whole batch, the
    /// same on every rank; `c` `[v1 − v0, D]` and optional `bias` `[v1 − v0]`: the shard's rows
    /// (padding rows included, never read); f32, f16 or bf16 (one dtype), targets i32/i64.
    /// Logits accumulate in f32 (f64 under softcap), the partial sums in f64.
    ///
    /// Errors: every input error of [`cce_core::Backend::forward`] on these shapes (a target is
    /// checked against `V`, so a target in the padding is `TargetOutOfRange`);
    /// `ShapeMismatch` when `c` does not hold the shard's rows; `NonFinite` (with global
    /// indices) under `check_finite`. Errors that need the other shards (masked targets,
    /// overflow of the lse) come from the merge.
    pub fn forward<T: HostRead>(
        &self,
        inputs: &Inputs<'_, T>,
        shard: &VocabShard,
        opts: &Options,
    ) -> Result<ShardForward> {
        let p = prepare(inputs, shard, opts, self.tile)?;
        if let Some(err) = opts.check_finite.then(|| p.non_finite()).flatten() {
            return Err(err);
        }
        let mut rows = vec![RowPartial::EMPTY; p.problem.n];
        let tr = p.tile.rows.max(1);
        let class_tiles = p.class_tiles();
        rows.par_chunks_mut(tr).enumerate().for_each(|(t, acc)| {
            let range = t * tr..t * tr + acc.len();
            for classes in &class_tiles {
                accumulate(&p, &range, classes, opts.softcap, acc);
            }
        });
        let stats = shard_stats(&p, opts, "forward");
        Ok(ShardForward {
            shard: *shard,
            rows,
            targets: p.targets,
            stats,
        })
    }
}

/// Push one logits tile into the partials `acc` of its rows.
fn accumulate(
    p: &ShardInputs,
    rows: &std::ops::Range<usize>,
    classes: &std::ops::Range<usize>,
    softcap: Option<f32>,
    acc: &mut [RowPartial],
) {
    let x = p.raw_logits_tile(rows, classes);
    let z = p.capped(&x, softcap);
    let k = classes.len();
    let v0 = p.shard.start();
    for (ii, a) in acc.iter_mut().enumerate() {
        let target = p.local_targets[rows.start + ii];
        for (jj, &zj) in z[ii * k..(ii + 1) * k].iter().enumerate() {
            let local = classes.start + jj;
            a.push((v0 + local) as u32, zj as f64, target == Some(local));
        }
    }
}

/// A shard's statistics before its backward: its tiles, valid rows, and its share of the
/// filter ([`shard_filter_rule`]).
pub(crate) fn shard_stats(p: &ShardInputs, opts: &Options, pass: &str) -> CallStats {
    let rule = shard_filter_rule(opts, p.problem.dtype, &p.shard);
    let s = &p.shard;
    CallStats {
        backend: "cpu (vocab shard)".into(),
        strategy: Strategy::TileOwnership,
        plan_reason: format!(
            "{pass} of vocabulary shard [{}, {}) of V = {}: {} real classes, {} padding; {} x {} tiles",
            s.start(),
            s.end(),
            s.vocab_size(),
            s.real_len(),
            s.padding_len(),
            p.tile.rows,
            p.tile.classes
        ),
        n_valid: p.targets.n_valid,
        tiles_total: (p.row_tiles().len() * p.class_tiles().len()) as u64,
        tiles_visited: 0,
        tiles_skipped: 0,
        entries_kept: 0,
        entries_skipped: 0,
        dropped_mass_max: 0.0,
        dropped_mass_mean: 0.0,
        filter_eps: rule.eps,
        max_dropped_mass: rule.max_dropped_mass,
        workspace_bytes: 0,
    }
}
