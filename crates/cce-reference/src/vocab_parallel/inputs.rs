//! Validation of one shard's inputs and its logits tiles.

use crate::blocked::{cap, dgemm, sgemm};
use crate::view::HostRead;
use cce_core::plan::TileShape;
use cce_core::problem::{PreparedTargets, Problem};
use cce_core::vocab_parallel::VocabShard;
use cce_core::{CceError, Inputs, Options, Result};
use std::borrow::Cow;
use std::ops::Range;

/// A shard's validated inputs as f32 (exact widening of f32/f16/bf16).
pub(crate) struct ShardInputs<'a> {
    pub shard: VocabShard,
    /// The problem of the whole vocabulary: `v` is `V` (real classes), not the shard's.
    pub problem: Problem,
    pub targets: PreparedTargets,
    /// Local index of each row's target when this shard owns it.
    pub local_targets: Vec<Option<usize>>,
    pub e: Cow<'a, [f32]>,
    /// The shard's rows of `c`, `[len, D]`, padding rows included (never read).
    pub c: Cow<'a, [f32]>,
    pub bias: Option<Cow<'a, [f32]>>,
    pub tile: TileShape,
    /// Accumulate the logits in f64 (under softcap, as the unsharded CPU backend).
    pub wide_logits: bool,
}

/// Validate the inputs of `shard`: `e` `[N, D]` (or `[..., T, D]`) and `targets` `[N]` of
/// the whole batch, `c` `[v1 − v0, D]` and `bias` `[v1 − v0]` of the shard.
///
/// Errors: `ShapeMismatch` when `c` does not have the shard's rows; those of [`Problem::new`]
/// on these shapes; `ResourceLimit` for `N` or the padded vocabulary past 32-bit indices;
/// those of [`PreparedTargets::new`] against `V` (a target in the padding is
/// `TargetOutOfRange`).
pub(crate) fn prepare<'a, T: HostRead>(
    inputs: &Inputs<'a, T>,
    shard: &VocabShard,
    opts: &Options,
    tile: TileShape,
) -> Result<ShardInputs<'a>> {
    let problem = cce_core::vocab_parallel::shard_problem(inputs, shard, opts)?;
    let raw = inputs.targets.i64_values().ok_or(CceError::DTypeMismatch {
        what: "targets",
        expected: "i32 or i64".into(),
        got: inputs.targets.dtype(),
    })?;
    let targets = PreparedTargets::new(&raw, &problem, opts)?;
    let local_targets = targets
        .classes
        .iter()
        .map(|&y| shard.local_target(y))
        .collect();
    Ok(ShardInputs {
        shard: *shard,
        problem,
        targets,
        local_targets,
        e: inputs.e.f32_values()?,
        c: inputs.c.f32_values()?,
        bias: inputs.bias.map(|b| b.f32_values()).transpose()?,
        tile,
        wide_logits: opts.softcap.is_some(),
    })
}

impl ShardInputs<'_> {
    /// Local class tiles over the shard's real classes `[0, real_len)`.
    pub fn class_tiles(&self) -> Vec<Range<usize>> {
        tiles(self.shard.real_len(), self.tile.classes)
    }

    /// Row tiles over `[0, N)`.
    pub fn row_tiles(&self) -> Vec<Range<usize>> {
        tiles(self.problem.n, self.tile.rows)
    }

    /// Uncapped logits `x[rows x classes]` (f32, bias applied), row-major; `classes` local
    /// (rows of the shard's `c`). f64 accumulation under softcap (whose derivative amplifies
    /// logit rounding by `2/s`), as the unsharded CPU backend.
    pub fn raw_logits_tile(&self, rows: &Range<usize>, classes: &Range<usize>) -> Vec<f32> {
        let d = self.problem.d;
        let (r, k) = (rows.len(), classes.len());
        let e = &self.e[rows.start * d..rows.end * d];
        let c = &self.c[classes.start * d..classes.end * d];
        let mut z = vec![0.0f32; r * k];
        if self.wide_logits {
            let wide = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<f64>>();
            let mut z64 = vec![0.0f64; r * k];
            dgemm(r, d, k, &wide(e), &wide(c), &mut z64);
            z.iter_mut().zip(&z64).for_each(|(o, &x)| *o = x as f32);
        } else {
            sgemm(r, d, k, e, (d, 1), c, (1, d), 0.0, &mut z, k);
        }
        if let Some(b) = &self.bias {
            for row in z.chunks_mut(k.max(1)) {
                row.iter_mut()
                    .zip(&b[classes.clone()])
                    .for_each(|(x, b)| *x += b);
            }
        }
        z
    }

    /// The capped logits of uncapped ones (`x` itself without a softcap).
    pub fn capped<'x>(&self, x: &'x [f32], softcap: Option<f32>) -> Cow<'x, [f32]> {
        match softcap {
            Some(s) => Cow::Owned(x.iter().map(|&v| cap(v, s)).collect()),
            None => Cow::Borrowed(x),
        }
    }

    /// The first value `check_finite` rejects, with global indices: a NaN or ±inf in `e` or in
    /// a real row of the shard's `c`, a NaN or +inf in a real entry of its `bias` (−inf there
    /// masks a class). Padding rows and entries are not read.
    pub fn non_finite(&self) -> Option<CceError> {
        let d = self.problem.d;
        let (v0, real) = (self.shard.start(), self.shard.real_len());
        let first = |vals: &[f32]| cce_core::problem::first_non_finite(vals.iter().copied());
        if let Some((index, value)) = first(&self.e) {
            return Some(CceError::NonFinite {
                what: "e",
                index,
                row: index / d.max(1),
                value,
            });
        }
        if let Some((index, value)) = first(&self.c[..real * d]) {
            let index = v0 * d + index;
            return Some(CceError::NonFinite {
                what: "c",
                index,
                row: index / d.max(1),
                value,
            });
        }
        let b = self.bias.as_ref()?;
        let (index, value) = cce_core::problem::first_bad_bias(b[..real].iter().copied())?;
        Some(CceError::NonFinite {
            what: "bias",
            index: v0 + index,
            row: v0 + index,
            value,
        })
    }

    /// Whether a real entry of the shard's bias is −inf (a masked class), and whether the
    /// target of row `i` is one of them.
    pub fn masked(&self) -> (bool, impl Fn(usize) -> bool + '_) {
        let real = self.shard.real_len();
        let any = self
            .bias
            .as_ref()
            .is_some_and(|b| b[..real].contains(&f32::NEG_INFINITY));
        let target = move |i: usize| {
            let b = self.bias.as_ref();
            matches!((b, self.local_targets[i]), (Some(b), Some(l)) if b[l] == f32::NEG_INFINITY)
        };
        (any, target)
    }
}

/// `[0, len)` in steps of `step` (the last one short).
fn tiles(len: usize, step: usize) -> Vec<Range<usize>> {
    let step = step.max(1);
    (0..len)
        .step_by(step)
        .map(|s| s..(s + step).min(len))
        .collect()
}
