//! The merge of the shards' partial forwards: per row lse, `1 − p_y`, loss, entropy, argmax.
//!
//! Every rank gathers the partials of all ranks (one all-gather, [`super::partial`]) and runs
//! the same pure merge on the same bytes in rank order, so every rank gets bit-identical lse
//! and loss whatever order the collective reduced in. With `M_i = max_r max_ir` and the shard
//! sums rescaled once, in f64:
//!
//! - `S_i = Σ_r sum_exp_ir · e^{max_ir − M_i}`, `lse_i = M_i + ln S_i`;
//! - `R_i = Σ_r rest_exp_ir · e^{max_ir − M_i}`, `1 − p_y = R_i / S_i` (no cancellation);
//! - `ℓ_i = −log p_y + α (z_y − Σ_j z_ij / V) + λ lse_i²` (MATH.md), `−log p_y` as
//!   [`cross_entropy`];
//! - entropy `lse_i − Σ_r weighted_ir e^{max_ir − M_i} / S_i`; argmax from the first rank
//!   holding `M_i` (lowest class on ties).
//!
//! Megatron-LM (`megatron/core/tensor_parallel/cross_entropy.py`) instead all-reduces the max,
//! then the rescaled sums and the target logit (two all-reduces); see the module docs of
//! [`super`] for why one all-gather is used here.

use super::partial::{PartialHeader, RowPartial};
use super::shard::{check_tiling, VocabShard};
use super::VocabParallelError;
use crate::error::{CceError, Result};
use crate::options::{Options, Reduction};
use crate::problem::{check_masked_targets, PreparedTargets};

/// One rank's gathered partial forward.
#[derive(Clone, Debug, PartialEq)]
pub struct RankPartial {
    /// Its header (shard, failure flag, replicated-input summary).
    pub header: PartialHeader,
    /// Its rows (`[N]`).
    pub rows: Vec<RowPartial>,
}

/// A row after the merge, f64.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MergedRow {
    /// `lse_i = log Σ_j e^{z_ij}` over the real classes of all shards, nats.
    pub lse: f64,
    /// `1 − p_y` without cancellation (0 for a row without a target).
    pub rest_mass: f64,
    /// The target's logit (from the shard that owns it), `None` for a row without a target.
    pub target_logit: Option<f64>,
    /// `Σ_j z_ij` over the finite logits of all real classes.
    pub logit_sum: f64,
    /// Softmax entropy, nats (0 when the row has no finite logit).
    pub entropy: f64,
    /// Global argmax (lowest class on ties; 0 when the row has no finite logit).
    pub argmax: i32,
    /// Whether some logit of the row is −inf (a masked class).
    pub masked: bool,
}

/// The merged forward of the whole vocabulary, as every rank computes it.
#[derive(Clone, Debug, PartialEq)]
pub struct MergedForward {
    /// Per row.
    pub rows: Vec<MergedRow>,
    /// Per-row loss `ℓ_i` `[N]` (0 at rows without a target), f64.
    pub row_loss: Vec<f64>,
    /// The loss under the reduction: mean over the valid rows of the whole batch, or sum;
    /// `None` for `Reduction::None` (then `row_loss` is the loss).
    pub loss: Option<f64>,
    /// Valid rows of the batch.
    pub n_valid: usize,
}

/// Merge the partials of one row, given in rank order (the shards' class order).
pub fn merge_row<'a>(parts: impl IntoIterator<Item = &'a RowPartial> + Clone) -> MergedRow {
    let mut max = f64::NEG_INFINITY;
    let mut argmax = 0u32;
    for p in parts.clone() {
        if p.max > max {
            max = p.max;
            argmax = p.argmax;
        }
    }
    let (mut s, mut r, mut pz, mut zsum) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    let mut target_logit = None;
    let mut masked = false;
    for p in parts {
        masked |= p.masked;
        zsum += p.logit_sum;
        if p.target_logit.is_some() {
            target_logit = p.target_logit;
        }
        // A shard with no finite logit has nothing to add (and −inf − −inf would be NaN).
        if p.max == f64::NEG_INFINITY {
            continue;
        }
        let scale = (p.max - max).exp();
        s += p.sum_exp * scale;
        r += p.rest_exp * scale;
        pz += p.weighted_logit_sum * scale;
    }
    let lse = max + s.ln();
    MergedRow {
        lse,
        rest_mass: if target_logit.is_some() { r / s } else { 0.0 },
        target_logit,
        logit_sum: zsum,
        entropy: if s > 0.0 { lse - pz / s } else { 0.0 },
        argmax: argmax as i32,
        masked,
    }
}

/// `−log p_y` from the row's `lse`, target logit `z_y` and `rest = 1 − p_y` (without
/// cancellation): `−log1p(−rest)` when `p_y ≥ 1/2`, exact where `lse − z_y` would cancel (a
/// confident row); `lse − z_y` otherwise, where it is at least `ln 2`.
pub fn cross_entropy(lse: f64, target_logit: f64, rest: f64) -> f64 {
    if rest < 0.5 {
        -(-rest).ln_1p()
    } else {
        lse - target_logit
    }
}

/// `ℓ_i = −log p_y + α (z_y − Σ_j z_ij / V) + λ lse²` of a merged row (MATH.md, "Forward"),
/// 0 for a row without a target. `alpha`: label smoothing; `lambda`: z-loss weight;
/// `vocab_size`: `V` (real classes).
pub fn row_loss(row: &MergedRow, alpha: f64, lambda: f64, vocab_size: usize) -> f64 {
    let Some(zy) = row.target_logit else {
        return 0.0;
    };
    let zmean = row.logit_sum / vocab_size as f64;
    cross_entropy(row.lse, zy, row.rest_mass) + alpha * (zy - zmean) + lambda * row.lse * row.lse
}

/// The reduced loss of per-row losses: the sum over rows, divided by the count of valid rows
/// of the whole batch for `Mean` (`None` for `Reduction::None`).
///
/// Errors: `AllTargetsIgnored` for a mean over no valid row (`n` rows).
pub fn reduce_loss(row_loss: &[f64], n_valid: usize, opts: &Options) -> Result<Option<f64>> {
    let total: f64 = row_loss.iter().sum();
    match opts.reduction {
        Reduction::None => Ok(None),
        Reduction::Sum => Ok(Some(total)),
        Reduction::Mean if n_valid == 0 => Err(CceError::all_targets_ignored(row_loss.len(), opts)),
        Reduction::Mean => Ok(Some(total / n_valid as f64)),
    }
}

/// Check the gathered partials of all ranks against each other and this rank's targets.
///
/// Errors (`VocabParallel`): `PeerFailed` listing the ranks that reported a failure;
/// `ReplicaMismatch` when a rank's row count or targets differ from rank 0's or from
/// `targets`; the tiling errors of [`check_tiling`] when the ranks' shards do not tile `V` in
/// rank order.
pub fn check_gathered(
    gathered: &[RankPartial],
    targets: &PreparedTargets,
) -> Result<Vec<VocabShard>> {
    let failed: Vec<usize> = gathered
        .iter()
        .enumerate()
        .filter(|(_, g)| g.header.failed)
        .map(|(r, _)| r)
        .collect();
    if !failed.is_empty() {
        return Err(VocabParallelError::PeerFailed { ranks: failed }.into());
    }
    let n = targets.classes.len();
    let digest = super::partial::targets_digest(targets);
    for (rank, g) in gathered.iter().enumerate() {
        let h = &g.header;
        if h.rows != n || g.rows.len() != n {
            return Err(VocabParallelError::ReplicaMismatch {
                rank,
                what: "rows N",
            }
            .into());
        }
        if h.n_valid != targets.n_valid || h.targets_digest != digest {
            return Err(VocabParallelError::ReplicaMismatch {
                rank,
                what: "targets",
            }
            .into());
        }
    }
    let shards: Vec<VocabShard> = gathered.iter().filter_map(|g| g.header.shard).collect();
    let Some(first) = shards.first() else {
        return Err(VocabParallelError::NoShards { vocab_size: 0 }.into());
    };
    check_tiling(first.vocab_size(), &shards)?;
    Ok(shards)
}

/// Merge the gathered partials of all ranks (rank order) into the forward of the whole
/// vocabulary: what every rank computes after the all-gather.
///
/// `targets`: this rank's prepared targets (every rank holds the same); `opts`: the call's
/// options (reduction, label smoothing, z-loss, `check_finite`).
///
/// Errors: those of [`check_gathered`]; `NonFinite { what: "lse (overflow)", .. }` for a row
/// whose lse is NaN or +inf under `check_finite` (the inputs were checked finite, so a logit
/// overflowed); `TargetMasked` and `InvalidOption` (label smoothing with a masked class) as
/// [`check_masked_targets`]; `AllTargetsIgnored` as [`reduce_loss`].
pub fn merge_forward(
    gathered: &[RankPartial],
    targets: &PreparedTargets,
    opts: &Options,
) -> Result<MergedForward> {
    let shards = check_gathered(gathered, targets)?;
    let vocab_size = shards[0].vocab_size();
    let n = targets.classes.len();
    let rows: Vec<MergedRow> = (0..n)
        .map(|i| merge_row(gathered.iter().map(|g| &g.rows[i])))
        .collect();
    if let Some(i) = (0..n).find(|&i| targets.classes[i] >= 0 && rows[i].target_logit.is_none()) {
        return Err(VocabParallelError::CollectiveMismatch {
            what: format!(
                "no shard reported the target {} of row {i}",
                targets.classes[i]
            ),
        }
        .into());
    }
    if opts.check_finite {
        if let Some(i) = rows
            .iter()
            .position(|r| r.lse.is_nan() || r.lse == f64::INFINITY)
        {
            return Err(CceError::NonFinite {
                what: "lse (overflow)",
                index: i,
                row: i,
                value: rows[i].lse as f32,
            });
        }
    }
    check_masked_targets(targets, opts, |i| {
        (
            rows[i].target_logit == Some(f64::NEG_INFINITY),
            rows[i].masked,
        )
    })?;
    let (alpha, lambda) = (opts.label_smoothing as f64, opts.z_loss as f64);
    let row_loss: Vec<f64> = rows
        .iter()
        .map(|r| row_loss(r, alpha, lambda, vocab_size))
        .collect();
    let loss = reduce_loss(&row_loss, targets.n_valid, opts)?;
    Ok(MergedForward {
        rows,
        row_loss,
        loss,
        n_valid: targets.n_valid,
    })
}

#[cfg(test)]
mod tests {
    use super::super::partial::targets_digest;
    use super::*;

    /// Partials of logits `z` (`[N, V]` row-major) for the shards `bounds` (`[v0, v1)` each,
    /// classes past `V` are padding and not pushed).
    fn partials(z: &[f64], v: usize, y: &[i32], bounds: &[(usize, usize)]) -> Vec<RankPartial> {
        let targets = PreparedTargets {
            classes: y.to_vec(),
            n_valid: y.iter().filter(|&&c| c >= 0).count(),
        };
        bounds
            .iter()
            .map(|&(a, b)| {
                let shard = VocabShard::new(v, a, b).unwrap();
                let rows = (0..y.len())
                    .map(|i| {
                        let mut p = RowPartial::EMPTY;
                        for j in shard.real_classes() {
                            p.push(j as u32, z[i * v + j], y[i] == j as i32);
                        }
                        p
                    })
                    .collect();
                RankPartial {
                    header: PartialHeader {
                        failed: false,
                        shard: Some(shard),
                        rows: y.len(),
                        n_valid: targets.n_valid,
                        targets_digest: targets_digest(&targets),
                    },
                    rows,
                }
            })
            .collect()
    }

    fn targets(y: &[i32]) -> PreparedTargets {
        PreparedTargets {
            classes: y.to_vec(),
            n_valid: y.iter().filter(|&&c| c >= 0).count(),
        }
    }

    #[test]
    fn any_split_merges_to_the_unsplit_row() {
        let v = 7;
        let z = [
            0.5,
            -1.0,
            3.0,
            2.5,
            -0.25,
            1.0,
            3.0, //
            40.0,
            -40.0,
            0.0,
            1.0,
            2.0,
            39.0,
            -1.0, //
            -5.0,
            f64::NEG_INFINITY,
            1.0,
            0.0,
            0.5,
            -0.5,
            2.0,
        ];
        let y = [3, 0, -1];
        let opts = Options {
            label_smoothing: 0.1,
            z_loss: 1e-3,
            ..Options::default()
        };
        // Label smoothing with a masked class in a valid row is refused, sharded or not.
        let y_all = [3, 0, 2];
        for bounds in [vec![(0, 7)], vec![(0, 1), (1, 7)]] {
            let r = merge_forward(&partials(&z, v, &y_all, &bounds), &targets(&y_all), &opts);
            assert!(
                matches!(
                    r,
                    Err(CceError::InvalidOption {
                        name: "label_smoothing",
                        ..
                    })
                ),
                "{r:?}"
            );
        }
        let opts_ok = opts;
        let whole = merge_forward(&partials(&z, v, &y, &[(0, 7)]), &targets(&y), &opts_ok).unwrap();
        for bounds in [
            vec![(0, 3), (3, 7)],
            vec![(0, 1), (1, 2), (2, 6), (6, 7)],
            vec![(0, 4), (4, 8)],
            vec![(0, 3), (3, 6), (6, 9), (9, 12)],
        ] {
            let split =
                merge_forward(&partials(&z, v, &y, &bounds), &targets(&y), &opts_ok).unwrap();
            for (a, b) in whole.rows.iter().zip(&split.rows) {
                assert!(
                    (a.lse - b.lse).abs() <= 1e-14 * a.lse.abs().max(1.0),
                    "{bounds:?}"
                );
                assert!((a.rest_mass - b.rest_mass).abs() <= 1e-14, "{bounds:?}");
                assert!((a.entropy - b.entropy).abs() <= 1e-13, "{bounds:?}");
                assert_eq!(
                    (a.argmax, a.masked, a.target_logit),
                    (b.argmax, b.masked, b.target_logit)
                );
            }
            let (a, b) = (whole.loss.unwrap(), split.loss.unwrap());
            assert!((a - b).abs() <= 1e-14 * a.abs(), "{bounds:?}: {a} vs {b}");
        }
        // Row 1: the tie between classes 0 (40) and 5 (39) is no tie; argmax 0.
        assert_eq!(whole.rows[1].argmax, 0);
        assert_eq!(whole.rows[2].rest_mass, 0.0);
        assert_eq!(whole.row_loss[2], 0.0);
    }

    #[test]
    fn a_row_of_masked_or_padded_classes_only() {
        // V = 2, shard 1 is all padding: it has no finite logit and changes nothing.
        let z = [1.0, 2.0];
        let y = [1];
        let one = merge_forward(
            &partials(&z, 2, &y, &[(0, 2)]),
            &targets(&y),
            &Options::default(),
        )
        .unwrap();
        let two = merge_forward(
            &partials(&z, 2, &y, &[(0, 1), (1, 2), (2, 4)]),
            &targets(&y),
            &Options::default(),
        )
        .unwrap();
        assert_eq!(one.rows[0].lse.to_bits(), two.rows[0].lse.to_bits());
        assert!(one.loss.unwrap().is_finite());
        // Every class masked: lse −inf; a valid row there is TargetMasked.
        let z = [f64::NEG_INFINITY, f64::NEG_INFINITY];
        let r = merge_forward(
            &partials(&z, 2, &y, &[(0, 1), (1, 2)]),
            &targets(&y),
            &Options::default(),
        );
        assert!(
            matches!(r, Err(CceError::TargetMasked { row: 0, target: 1 })),
            "{r:?}"
        );
        let ignored = [-1];
        let opts = Options {
            reduction: Reduction::Sum,
            ..Options::default()
        };
        let m = merge_forward(
            &partials(&z, 2, &ignored, &[(0, 1), (1, 2)]),
            &targets(&ignored),
            &opts,
        )
        .unwrap();
        assert_eq!(m.rows[0].lse, f64::NEG_INFINITY);
        assert_eq!(m.loss, Some(0.0));
    }

    #[test]
    fn disagreeing_ranks_are_typed_errors() {
        let z = [1.0, 2.0, 3.0];
        let y = [2];
        let t = targets(&y);
        let ok = partials(&z, 3, &y, &[(0, 1), (1, 3)]);
        let mut failed = ok.clone();
        failed[1].header.failed = true;
        assert!(matches!(
            merge_forward(&failed, &t, &Options::default()),
            Err(CceError::VocabParallel(VocabParallelError::PeerFailed { ref ranks })) if ranks == &[1]
        ));
        let mut other_targets = ok.clone();
        other_targets[1].header.targets_digest ^= 1;
        assert!(matches!(
            merge_forward(&other_targets, &t, &Options::default()),
            Err(CceError::VocabParallel(
                VocabParallelError::ReplicaMismatch {
                    rank: 1,
                    what: "targets"
                }
            ))
        ));
        let overlap = partials(&z, 3, &y, &[(0, 2), (1, 3)]);
        assert!(matches!(
            merge_forward(&overlap, &t, &Options::default()),
            Err(CceError::VocabParallel(VocabParallelError::Overlap {
                shard: 1,
                ..
            }))
        ));
        let swapped = partials(&z, 3, &y, &[(1, 3), (0, 1)]);
        assert!(matches!(
            merge_forward(&swapped, &t, &Options::default()),
            Err(CceError::VocabParallel(VocabParallelError::OutOfOrder {
                shard: 1,
                ..
            }))
        ));
        let short = partials(&z, 3, &y, &[(0, 1), (1, 2)]);
        assert!(matches!(
            merge_forward(&short, &t, &Options::default()),
            Err(CceError::VocabParallel(
                VocabParallelError::DoesNotCover { .. }
            ))
        ));
    }

    #[test]
    fn overflow_is_reported_under_check_finite() {
        let z = [f64::INFINITY, 0.0];
        let y = [1];
        let r = merge_forward(
            &partials(&z, 2, &y, &[(0, 1), (1, 2)]),
            &targets(&y),
            &Options::default(),
        );
        assert!(
            matches!(r, Err(CceError::NonFinite { row: 0, .. })),
            "{r:?}"
        );
    }
}
