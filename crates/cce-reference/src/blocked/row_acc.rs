//! The forward's per-row accumulators, folded one logits tile at a time, and the per-(row,
//! class tile) statistics a fused forward-and-backward keeps for its skip decisions.
//!
//! Each tile's row is reduced against the tile's own largest logit (one `exp` per entry), then
//! merged into the running row: the online log-sum-exp of the paper's forward (section 4.2),
//! f64 throughout. The tile's `(max, Σ e^{z − max})` are what a GPU forward's epilogue has per
//! `(row, tile)` too; with the row's lse they give each row's probability mass in the tile and
//! its largest probability, so the backward can decide each row's kept tiles
//! ([`cce_core::tile_budget`]) before recomputing any logits.

use cce_core::tile_budget::TileMasses;
use std::ops::Range;

/// Per-row forward accumulators.
#[derive(Clone, Copy, Debug)]
pub(super) struct RowAcc {
    /// Running max of the finite logits.
    pub(super) m: f64,
    /// `Σ_j e^{z_j − m}`.
    pub(super) s: f64,
    /// `Σ_{j≠y} e^{z_j − m}`: the non-target part of `s`, so `1 − p_y = r / s` without
    /// cancellation.
    pub(super) r: f64,
    /// Whether a logit of the row is −inf.
    pub(super) masked: bool,
    /// `Σ_j e^{z_j − m} z_j` (for the entropy).
    pub(super) pz: f64,
    /// `Σ_j z_j` over the unmasked classes (label smoothing's mean logit).
    pub(super) zsum: f64,
    /// The target's logit.
    pub(super) zy: f64,
    /// Class id of the largest logit (the smallest id among equal ones).
    pub(super) argmax: i32,
}

impl RowAcc {
    /// Nothing folded yet.
    pub(super) fn new() -> Self {
        Self {
            m: f64::NEG_INFINITY,
            s: 0.0,
            r: 0.0,
            masked: false,
            pz: 0.0,
            zsum: 0.0,
            zy: 0.0,
            argmax: 0,
        }
    }

    /// Folds one row of a logits tile: `z` its (capped) logits, the first at visiting position
    /// `start`, `y` the row's target position (−1 when ignored), `id(j)` the class id at
    /// visiting position `j` (for the argmax). Returns the tile's largest logit and
    /// `Σ e^{z − max}` over its unmasked classes (`(−∞, 0)` when every class is masked).
    /// A −inf logit (a class masked by the bias) adds nothing; NaN propagates into `s`.
    pub(super) fn fold(
        &mut self,
        z: &[f32],
        start: usize,
        y: i32,
        id: impl Fn(usize) -> i32,
    ) -> (f32, f32) {
        let mut tm = f64::NEG_INFINITY;
        let mut am = -1i32;
        let mut any = false;
        for (jj, &x) in z.iter().enumerate() {
            let x = x as f64;
            let j = start + jj;
            if y == j as i32 {
                self.zy = x;
            }
            if x == f64::NEG_INFINITY {
                self.masked = true;
                continue;
            }
            any = true;
            if x > tm || (x == tm && id(j) < am) {
                tm = x;
                am = id(j);
            }
        }
        if !any {
            return (f32::NEG_INFINITY, 0.0);
        }
        let (mut ts, mut tr, mut tpz) = (0.0f64, 0.0f64, 0.0f64);
        for (jj, &x) in z.iter().enumerate() {
            let x = x as f64;
            if x == f64::NEG_INFINITY {
                continue;
            }
            let w = (x - tm).exp();
            ts += w;
            if y != (start + jj) as i32 {
                tr += w;
            }
            tpz += w * x;
            self.zsum += x;
        }
        if tm > self.m {
            let scale = (self.m - tm).exp();
            self.s *= scale;
            self.r *= scale;
            self.pz *= scale;
            self.m = tm;
            self.argmax = am;
        } else if tm == self.m && am >= 0 {
            self.argmax = self.argmax.min(am);
        }
        let scale = (tm - self.m).exp();
        self.s += ts * scale;
        self.r += tr * scale;
        self.pz += tpz * scale;
        (tm as f32, ts as f32)
    }
}

/// Per `(row, class tile)` of a forward, row-major `[n x tiles]`: the tile's largest (capped)
/// logit and `Σ e^{z − max}` over its unmasked classes, both f32.
#[derive(Clone, Debug)]
pub(super) struct TileStats {
    /// Class tiles per row.
    pub(super) tiles: usize,
    /// Per `(row, tile)`: the largest logit (−∞ when every class of the tile is masked) and
    /// `Σ e^{z − max}`.
    pub(super) stat: Vec<(f32, f32)>,
}

impl TileStats {
    /// Bytes per `(row, tile)`: these statistics and the masses a row tile's decision reads.
    pub(super) const BYTES_PER_ENTRY: u64 = 8 + 12;

    /// Each row's `g0` mass and largest `g0` per class tile of the row tile `rows`, from the
    /// row's `lse`: `p = e^{max − lse}`, mass `Σexp · e^{max − lse}`. The tile holding an
    /// active row's target is never a candidate (its `g0` is the target's, not a probability);
    /// rows without a gradient (`active` false) count nothing.
    pub(super) fn masses(
        &self,
        rows: &Range<usize>,
        lse: &[f32],
        active: &[bool],
        y: &[i32],
        class_tiles: &[Range<usize>],
    ) -> TileMasses {
        let mut m = TileMasses::zeros(rows.len(), self.tiles);
        for (r, i) in rows.clone().enumerate() {
            if !active[i] {
                continue;
            }
            for (t, classes) in class_tiles.iter().enumerate() {
                let at = r * self.tiles + t;
                if y[i] >= 0 && classes.contains(&(y[i] as usize)) {
                    m.max_g0[at] = f32::INFINITY;
                    continue;
                }
                let (max, sum) = self.stat[i * self.tiles + t];
                let pmax = (max as f64 - lse[i] as f64).exp();
                m.max_g0[at] = pmax as f32;
                m.mass[at] = sum as f64 * pmax;
            }
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fold of several tiles against one pass over the whole row.
    #[test]
    fn tiles_fold_to_the_whole_rows_log_sum_exp() {
        let z = [0.5f32, -1.0, 3.0, f32::NEG_INFINITY, 3.0, 2.0, -4.0];
        let y = 4;
        let mut a = RowAcc::new();
        for (start, end) in [(0, 3), (3, 5), (5, 7)] {
            a.fold(&z[start..end], start, y, |j| j as i32);
        }
        let lse_ref = z
            .iter()
            .filter(|x| x.is_finite())
            .map(|&x| (x as f64).exp())
            .sum::<f64>()
            .ln();
        assert!((a.m + a.s.ln() - lse_ref).abs() < 1e-12);
        let rest_ref = 1.0 - (3.0f64 - lse_ref).exp();
        assert!((a.r / a.s - rest_ref).abs() < 1e-12);
        assert_eq!(a.zy, 3.0);
        assert!(a.masked);
        // Equal largest logits at classes 2 and 4: the smaller id.
        assert_eq!(a.argmax, 2);
        let zsum: f64 = z.iter().filter(|x| x.is_finite()).map(|&x| x as f64).sum();
        assert!((a.zsum - zsum).abs() < 1e-12);
    }

    #[test]
    fn a_tile_of_masked_classes_returns_no_mass_and_nan_propagates() {
        let mut a = RowAcc::new();
        assert_eq!(
            a.fold(&[f32::NEG_INFINITY; 2], 0, -1, |j| j as i32),
            (f32::NEG_INFINITY, 0.0)
        );
        assert!(a.masked && a.s == 0.0);
        a.fold(&[1.0, f32::NAN], 2, -1, |j| j as i32);
        assert!(a.s.is_nan());
    }

    #[test]
    fn masses_read_probabilities_from_the_lse_and_never_offer_the_target_tile() {
        let stats = TileStats {
            tiles: 2,
            stat: vec![(0.0, 1.5), (-2.0, 2.0), (1.0, 1.0), (1.0, 1.0)],
        };
        let lse = [1.0f32, 3.0];
        let tiles = [0..4, 4..8];
        let m = stats.masses(&(0..2), &lse, &[true, false], &[5, 0], &tiles);
        assert!((m.max_g0[0] as f64 - (-1.0f64).exp()).abs() < 1e-7);
        assert!((m.mass[0] - 1.5 * (-1.0f64).exp()).abs() < 1e-7);
        assert_eq!(m.max_g0[1], f32::INFINITY);
        assert_eq!((m.mass[2], m.mass[3], m.max_g0[2]), (0.0, 0.0, 0.0));
    }
}
