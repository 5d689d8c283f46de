//! One entry of `G` and its filter magnitude `g0`, from the merged row statistics (MATH.md,
//! "Backward"; `cce_core::filter` for `g0`). f32, the arithmetic of the unsharded CPU
//! backend.

use crate::blocked::dcap;

/// What the backward knows of a row: its upstream gradients and the merged statistics of the
/// whole vocabulary.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct RowState {
    /// `g_i`: the loss gradient of the row (0 for a row without a target).
    pub g: f32,
    /// `h_i`: the lse gradient of the row.
    pub h: f32,
    /// The merged lse.
    pub lse: f32,
    /// The merged `1 − p_y` (0 for a row without a target).
    pub rest: f32,
}

impl RowState {
    /// Whether the row has a gradient at all.
    pub fn active(&self) -> bool {
        self.g != 0.0 || self.h != 0.0
    }
}

/// The options that shape `G`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct EntryRule {
    /// Label smoothing `α`.
    pub alpha: f32,
    /// z-loss weight `λ`.
    pub lambda: f32,
    /// `α/V` when label smoothing goes through every entry; 0 when it is added analytically
    /// (rank-1, no softcap).
    pub ls_per_entry: f32,
    /// Softcap `s`.
    pub softcap: Option<f32>,
}

/// `p = exp(z − lse)` of a capped logit; 0 at a −inf (masked) logit.
pub(crate) fn prob(z: f32, lse: f32) -> f32 {
    if z == f32::NEG_INFINITY {
        0.0
    } else {
        (z - lse).exp()
    }
}

impl EntryRule {
    /// `G_ij` from the probability `p` and the uncapped logit `x`. At the target `p_y` comes
    /// from the merged `1 − p_y`, and the bracket is rearranged so that nothing cancels on a
    /// confident row: `(1 + 2λ lse)(1 − rest) − (1 − α) = α − rest + 2λ lse (1 − rest)`.
    pub fn g(&self, row: &RowState, is_target: bool, p: f32, x: f32) -> f32 {
        let (g, h, l) = (row.g, row.h, row.lse);
        let mut gij = if is_target {
            let py = 1.0 - row.rest;
            let t = if g == 0.0 {
                0.0
            } else {
                g * ((self.alpha - row.rest) + 2.0 * self.lambda * l * py - self.ls_per_entry)
            };
            t + h * py
        } else {
            let t = if g == 0.0 {
                0.0
            } else {
                g * ((1.0 + 2.0 * self.lambda * l) * p - self.ls_per_entry)
            };
            t + h * p
        };
        if let Some(s) = self.softcap {
            gij *= dcap(x, s);
        }
        gij
    }

    /// The filter magnitude `g0` (0 for an inactive row): `p` off the target,
    /// `max(|1 − p|, |w − p|)` at it, `w = cy / cp` the `p` at which the target's `G` vanishes
    /// (`cce_core::filter`), from the merged `1 − p_y`.
    pub fn g0(&self, row: &RowState, is_target: bool, p: f32) -> f32 {
        if !row.active() {
            return 0.0;
        }
        if is_target {
            let cp = row.g * (1.0 + 2.0 * self.lambda * row.lse) + row.h;
            let cy = row.g * (1.0 - self.alpha);
            let w1 = if cp != 0.0 { (cy - cp) / cp } else { -1.0 };
            row.rest.abs().max((w1 + row.rest).abs())
        } else {
            p
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_follow_the_formula() {
        let rule = EntryRule {
            alpha: 0.1,
            lambda: 1e-2,
            ls_per_entry: 0.1 / 8.0,
            softcap: None,
        };
        let row = RowState {
            g: 0.5,
            h: 0.25,
            lse: 2.0,
            rest: 0.3,
        };
        let p = 0.125;
        let want = 0.5 * ((1.0 + 2.0 * 1e-2 * 2.0) * p - 0.1 / 8.0) + 0.25 * p;
        assert!((rule.g(&row, false, p, 0.0) - want).abs() < 1e-7);
        let py = 0.7;
        let want = 0.5 * ((1.0 + 2.0 * 1e-2 * 2.0) * py - 0.9 - 0.1 / 8.0) + 0.25 * py;
        assert!((rule.g(&row, true, py, 0.0) - want).abs() < 1e-6);
        assert_eq!(rule.g0(&row, false, p), p);
        let idle = RowState {
            g: 0.0,
            h: 0.0,
            ..row
        };
        assert_eq!(rule.g0(&idle, true, py), 0.0);
        assert_eq!(prob(f32::NEG_INFINITY, 1.0), 0.0);
    }
}
