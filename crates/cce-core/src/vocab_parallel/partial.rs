//! The per-row partial forward of one shard, and its wire format for the all-gather.
//!
//! For row `i` and the shard's real classes `j ∈ [v0, min(v1, V))`, with `z_ij` the (capped)
//! logit, a shard accumulates online (paper section 4.2, one running max):
//!
//! - `max_i = max_j z_ij` over finite logits (−inf when there is none);
//! - `sum_exp_i = Σ_j e^{z_ij − max_i}`, and `rest_exp_i`, the same sum without the target
//!   class (equal to `sum_exp_i` on a shard that does not own the target), so that the merged
//!   `1 − p_y` needs no cancellation;
//! - the target logit `z_{i,y_i}` when the shard owns `y_i`;
//! - `Σ_j z_ij` (label smoothing), `Σ_j e^{z_ij − max_i} z_ij` (entropy), the argmax (global
//!   class index, lowest on ties) and whether a logit was −inf (a masked class).
//!
//! Megatron-LM's vocab-parallel cross-entropy keeps the first three of these per rank
//! (`logits_max`, `sum_exp_logits`, `predicted_logits`) and combines them by all-reduces.

use super::shard::VocabShard;
use super::VocabParallelError;
use crate::error::{CceError, Result};
use crate::problem::PreparedTargets;

/// What one shard knows of one row. f64: the CPU shard accumulates in f64, and the wire
/// carries f64 so that no backend's partial is rounded on the way.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowPartial {
    /// Largest finite logit of the shard's classes (−inf when none).
    pub max: f64,
    /// `Σ e^{z − max}` over the shard's finite logits.
    pub sum_exp: f64,
    /// `Σ e^{z − max}` over the shard's finite logits other than the target.
    pub rest_exp: f64,
    /// The target's logit, when this shard owns the row's target (else `None`).
    pub target_logit: Option<f64>,
    /// `Σ z` over the shard's finite logits (label smoothing).
    pub logit_sum: f64,
    /// `Σ e^{z − max} · z` over the shard's finite logits (entropy).
    pub weighted_logit_sum: f64,
    /// Global class index of `max` (lowest on ties; 0 when the shard has no finite logit).
    pub argmax: u32,
    /// Whether a logit of the shard was −inf (a class masked by the bias).
    pub masked: bool,
}

impl Default for RowPartial {
    fn default() -> Self {
        Self::EMPTY
    }
}

impl RowPartial {
    /// The partial of no class.
    pub const EMPTY: Self = Self {
        max: f64::NEG_INFINITY,
        sum_exp: 0.0,
        rest_exp: 0.0,
        target_logit: None,
        logit_sum: 0.0,
        weighted_logit_sum: 0.0,
        argmax: 0,
        masked: false,
    };

    /// Add the logit `z` of global class `class` (`is_target`: the row's target). A −inf logit
    /// (masked class) adds nothing but the flag (and the target logit, when it is the target);
    /// a NaN poisons the sums (as in the unsharded call).
    pub fn push(&mut self, class: u32, z: f64, is_target: bool) {
        if is_target {
            self.target_logit = Some(z);
        }
        if z == f64::NEG_INFINITY {
            self.masked = true;
            return;
        }
        if z > self.max {
            let scale = (self.max - z).exp();
            self.sum_exp *= scale;
            self.rest_exp *= scale;
            self.weighted_logit_sum *= scale;
            self.max = z;
            self.argmax = class;
        }
        let w = (z - self.max).exp();
        self.sum_exp += w;
        if !is_target {
            self.rest_exp += w;
        }
        self.weighted_logit_sum += w * z;
        self.logit_sum += z;
    }
}

/// What a rank sends besides its rows: its shard, whether it failed before the collective,
/// and a summary of the inputs every rank must hold identically (rows, targets).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PartialHeader {
    /// Whether the rank failed (its rows are then zeros and must not be read).
    pub failed: bool,
    /// The rank's shard (`None` when it failed before knowing it).
    pub shard: Option<VocabShard>,
    /// Rows `N`.
    pub rows: usize,
    /// Valid rows of the prepared targets.
    pub n_valid: usize,
    /// [`targets_digest`] of the prepared targets.
    pub targets_digest: u64,
}

/// f64 values of the header on the wire.
pub const HEADER_LEN: usize = 7;
/// f64 values of one row on the wire.
pub const ROW_LEN: usize = 8;

/// Length in f64 of one rank's message for `rows` rows.
pub fn wire_len(rows: usize) -> usize {
    HEADER_LEN + rows * ROW_LEN
}

/// A 52-bit digest of the prepared targets (FNV-1a over the classes), exact as an f64, so ranks
/// can check that they hold the same targets.
pub fn targets_digest(targets: &PreparedTargets) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &c in &targets.classes {
        for b in c.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h >> 12
}

/// One rank's message: the header, then per row `max, sum_exp, rest_exp, target logit
/// (NaN when not owned), logit_sum, weighted_logit_sum, argmax, flags` (flags: 1 owned target,
/// 2 masked). Indices and sizes are integers below 2⁵³, exact in f64.
pub fn encode(header: &PartialHeader, rows: &[RowPartial]) -> Vec<f64> {
    let mut out = Vec::with_capacity(wire_len(rows.len()));
    let (start, end, vocab) = header.shard.map_or((0.0, 0.0, 0.0), |s| {
        (s.start() as f64, s.end() as f64, s.vocab_size() as f64)
    });
    out.extend([
        f64::from(u8::from(header.failed)),
        start,
        end,
        vocab,
        header.rows as f64,
        header.n_valid as f64,
        header.targets_digest as f64,
    ]);
    for r in rows {
        let flags = u8::from(r.target_logit.is_some()) | (u8::from(r.masked) << 1);
        out.extend([
            r.max,
            r.sum_exp,
            r.rest_exp,
            r.target_logit.unwrap_or(f64::NAN),
            r.logit_sum,
            r.weighted_logit_sum,
            r.argmax as f64,
            flags as f64,
        ]);
    }
    out
}

/// The failure message of a rank: a header with `failed` set and zero rows of `rows`, so the
/// collective still gets its full length.
pub fn encode_failure(rows: usize) -> Vec<f64> {
    let mut out = vec![0.0; wire_len(rows)];
    out[0] = 1.0;
    out
}

/// Read one rank's message back. Errors: `VocabParallel(CollectiveMismatch)` when the length
/// does not hold a header and whole rows; `VocabParallel(EmptyShard)` (or `EmptyInput`) for a
/// header whose shard is not a shard.
pub fn decode(msg: &[f64], rank: usize) -> Result<(PartialHeader, Vec<RowPartial>)> {
    if msg.len() < HEADER_LEN || !(msg.len() - HEADER_LEN).is_multiple_of(ROW_LEN) {
        return Err(VocabParallelError::CollectiveMismatch {
            what: format!(
                "rank {rank}'s partial has {} values, not a header of {HEADER_LEN} and rows of {ROW_LEN}",
                msg.len()
            ),
        }
        .into());
    }
    let int = |x: f64| x as usize;
    let failed = msg[0] != 0.0;
    let shard = if failed {
        None
    } else {
        Some(
            VocabShard::new(int(msg[3]), int(msg[1]), int(msg[2])).map_err(|e| match e {
                CceError::VocabParallel(VocabParallelError::EmptyShard { start, end, .. }) => {
                    VocabParallelError::EmptyShard {
                        shard: rank,
                        start,
                        end,
                    }
                    .into()
                }
                other => other,
            })?,
        )
    };
    let header = PartialHeader {
        failed,
        shard,
        rows: int(msg[4]),
        n_valid: int(msg[5]),
        targets_digest: msg[6] as u64,
    };
    let rows = msg[HEADER_LEN..]
        .chunks_exact(ROW_LEN)
        .map(|w| RowPartial {
            max: w[0],
            sum_exp: w[1],
            rest_exp: w[2],
            target_logit: (w[7] as u8 & 1 != 0).then_some(w[3]),
            logit_sum: w[4],
            weighted_logit_sum: w[5],
            argmax: w[6] as u32,
            masked: w[7] as u8 & 2 != 0,
        })
        .collect();
    Ok((header, rows))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_matches_a_direct_sum() {
        let z = [0.5, -3.0, 7.25, f64::NEG_INFINITY, 7.25, 2.0];
        let mut p = RowPartial::EMPTY;
        for (j, &x) in z.iter().enumerate() {
            p.push(10 + j as u32, x, j == 1);
        }
        let finite: Vec<f64> = z.iter().copied().filter(|x| x.is_finite()).collect();
        let m = 7.25;
        let s: f64 = finite.iter().map(|x| (x - m).exp()).sum();
        assert_eq!(p.max, m);
        assert!((p.sum_exp - s).abs() < 1e-15 * s);
        assert!((p.rest_exp - (s - (-3.0f64 - m).exp())).abs() < 1e-15 * s);
        assert_eq!(p.target_logit, Some(-3.0));
        assert_eq!(p.argmax, 12);
        assert!(p.masked);
        assert_eq!(p.logit_sum, finite.iter().sum::<f64>());
    }

    #[test]
    fn the_wire_round_trips() {
        let mut a = RowPartial::EMPTY;
        a.push(3, 1.5, true);
        a.push(4, f64::NEG_INFINITY, false);
        let b = RowPartial::EMPTY;
        let header = PartialHeader {
            failed: false,
            shard: Some(VocabShard::new(10, 3, 12).unwrap()),
            rows: 2,
            n_valid: 1,
            targets_digest: (1 << 52) - 3,
        };
        let msg = encode(&header, &[a, b]);
        assert_eq!(msg.len(), wire_len(2));
        let (h, rows) = decode(&msg, 1).unwrap();
        assert_eq!(h, header);
        assert_eq!(rows, vec![a, b]);
        let (h, _) = decode(&encode_failure(2), 1).unwrap();
        assert!(h.failed && h.shard.is_none());
        assert!(matches!(
            decode(&msg[..msg.len() - 1], 1),
            Err(CceError::VocabParallel(
                VocabParallelError::CollectiveMismatch { .. }
            ))
        ));
    }
}
