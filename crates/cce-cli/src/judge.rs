//! The pass/fail rule of `cce run --check`: MATH.md's conformance rule ("How results are
//! judged"), norm-wise per output.
//!
//! For each output `o` the check computes the *judged error*
//!
//! ```text
//! err_o = ‖ours − gt‖₂ / (‖gt‖₂ + unit_o · sqrt(len_o))
//! ```
//!
//! (`gt`: the f64 oracle on the same rounded inputs; the absolute `‖ours − gt‖₂` when the
//! denominator is 0; infinite when `ours` holds a NaN or an infinity) and passes it when
//! `err_o ≤ τ_o + filter_o`:
//!
//! - `τ_o = max(tol(dtype), tol(f32) · ρ(L_o) · κ_o)` ([`tau`]): `tol` is MATH.md's 1e-5
//!   (f32), 1e-3 (f16), 1e-2 (bf16) on values of order 1; `ρ(L) = sqrt(max(1, L / 1024))`
//!   grows it for long f32 sums (`L = V` for loss, lse, entropy and `d_e`; `N` for `d_c` and
//!   `d_bias`), and for the gradients `κ = max(1, zmag · sqrt(D) / 64)`, `zmag = max(1,
//!   max |lse|)`, covers the f32 rounding of large logits, which `p = exp(z − lse)` turns into a
//!   relative error (the conformance suite's `tests/src/judge.rs` derives both);
//! - `unit_o`, what "order 1" means: `zmag` for lse, entropy and the mean or per-row loss
//!   (their error is an absolute error of the logits, and entropy or a per-row loss may be
//!   near 0), `zmag · sqrt(n_valid)` for the summed loss, 0 for the gradients (a plain
//!   relative L2 error);
//! - `filter_o`, for gradients the filter applied to only ([`FilterBound`]): what the skipped
//!   entries can explain, a rigorous bound from the backward's reported largest dropped mass per
//!   row, relative to `‖gt‖₂`.
//!
//! A norm over the whole output hides a few bad rows, so `d_e` (per row) and `d_c` (per class
//! row) are also judged row by row with the rule of [`cut_cross_entropy::tolerance::RowError`]:
//! `‖ours_i − gt_i‖₂ ≤ τ · (‖gt_i‖₂ + Σ_j |G_ij| · max_j ‖c_j‖₂) + filter_i` (the same `τ`; the
//! terms of the row from the oracle's `G`), and the worst rows are printed.

// ρ, κ and τ: the tolerance of MATH.md, shared with the conformance suite (cce_core::tolerance).
pub use cut_cross_entropy::tolerance::{kappa, tau};

/// `zmag = max(1, max_i |lse_i|)` over the finite values of the oracle's lse.
pub fn zmag(lse: &[f64]) -> f64 {
    lse.iter()
        .filter(|x| x.is_finite())
        .fold(1.0f64, |m, x| m.max(x.abs()))
}

/// `‖x‖₂`.
pub fn norm(x: &[f64]) -> f64 {
    x.iter().map(|v| v * v).sum::<f64>().sqrt()
}

/// The judged error `‖got − want‖₂ / (‖want‖₂ + unit · sqrt(len))` (absolute when the
/// denominator is 0; `+∞` when `got` or `want` holds a non-finite value).
pub fn judged_error(got: &[f32], want: &[f64], unit: f64) -> f64 {
    if got.iter().any(|x| !x.is_finite()) || want.iter().any(|x| !x.is_finite()) {
        return f64::INFINITY;
    }
    let diff: f64 = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w).powi(2))
        .sum::<f64>()
        .sqrt();
    let den = norm(want) + unit * (want.len() as f64).sqrt();
    if den > 0.0 {
        diff / den
    } else {
        diff
    }
}

/// Bounds on what the gradient filter's skipped entries change in the gradients (MATH.md,
/// "Filtered mode": the error must be explained by the skipped entries).
///
/// A skipped entry of row `i` has `|G_ij| ≤ w_i · g0_ij` with `w_i = |g_i · (1 + 2λ·lse_i)|`
/// (`g_i` the row's loss gradient: `1 / n_valid` for the mean, 1 for sum and none; `λ` the
/// z-loss weight; softcap only shrinks `G`), its `g0_ij` is below `filter_eps`, and the
/// skipped `g0` of a row sum to at most `m`, the backward's largest dropped mass per row. So
/// the skipped part `ΔG` has row sums `≤ w_i · m` and column sums `≤ Σ_i w_i · min(eps, m)`,
/// and
///
/// - `‖Δd_e‖_F ≤ m · sqrt(Σ_i w_i²) · max_j ‖c_j‖₂`,
/// - `‖Δd_c‖_F ≤ ‖ΔG‖₂ · ‖E‖_F` with `‖ΔG‖₂ ≤ sqrt(max_i w_i · m · Σ_i w_i · min(eps, m))`,
/// - `‖Δd_bias‖₂ ≤ ‖ΔG‖₂ · sqrt(n_valid)` (the bias is a column of ones in `E`).
#[derive(Clone, Debug, PartialEq)]
pub struct FilterBound {
    /// `w_i` per row (0 for rows without a target).
    pub row_weights: Vec<f64>,
    /// The backward's largest dropped mass per row.
    pub dropped_mass_max: f64,
    /// The backward's filter threshold.
    pub filter_eps: f64,
}

impl FilterBound {
    /// The bound for rows `valid` (`true`: the row has a target) of a call with this loss
    /// gradient per valid row, z-loss weight and oracle lse.
    pub fn new(
        valid: &[bool],
        g: f64,
        z_loss: f64,
        lse: &[f64],
        dropped_mass_max: f64,
        filter_eps: f64,
    ) -> Self {
        let row_weights = valid
            .iter()
            .zip(lse)
            .map(|(&v, &l)| {
                if v {
                    (g * (1.0 + 2.0 * z_loss * l)).abs()
                } else {
                    0.0
                }
            })
            .collect();
        Self {
            row_weights,
            dropped_mass_max,
            filter_eps,
        }
    }

    /// `‖ΔG‖₂` bound: `sqrt(max row sum · max column sum)`.
    fn spectral(&self) -> f64 {
        let m = self.dropped_mass_max;
        let w_max = self.row_weights.iter().fold(0.0f64, |a, &w| a.max(w));
        let w_sum: f64 = self.row_weights.iter().sum();
        (w_max * m * w_sum * self.filter_eps.min(m)).sqrt()
    }

    /// Bound on `‖Δd_e‖_F` for the classifier `c` (`[V, D]`, row-major).
    pub fn d_e(&self, c: &[f32], d: usize) -> f64 {
        let c_max = c
            .chunks(d.max(1))
            .map(|row| row.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt())
            .fold(0.0f64, f64::max);
        self.dropped_mass_max * norm(&self.row_weights) * c_max
    }

    /// Bound on `‖Δd_c‖_F` for the hidden states `e` (`[N, D]`, row-major); only the rows
    /// with a target count.
    pub fn d_c(&self, e: &[f32], d: usize) -> f64 {
        let e_norm = e
            .chunks(d.max(1))
            .zip(&self.row_weights)
            .filter(|(_, &w)| w > 0.0)
            .map(|(row, _)| row.iter().map(|&x| (x as f64).powi(2)).sum::<f64>())
            .sum::<f64>()
            .sqrt();
        self.spectral() * e_norm
    }

    /// Bound on `‖Δd_e_i‖₂` of row `i` alone: `w_i · m · max_j ‖c_j‖₂` (`c_max`).
    pub fn d_e_row(&self, i: usize, c_max: f64) -> f64 {
        self.row_weights[i] * self.dropped_mass_max * c_max
    }

    /// Bound on `‖Δd_c_j‖₂` of any one class row: `min(eps, m) · Σ_i w_i ‖e_i‖₂` (`e` `[N, D]`).
    pub fn d_c_row(&self, e: &[f32], d: usize) -> f64 {
        let weighted: f64 = e
            .chunks(d.max(1))
            .zip(&self.row_weights)
            .map(|(row, w)| w * row.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt())
            .sum();
        self.filter_eps.min(self.dropped_mass_max) * weighted
    }

    /// Bound on `‖Δd_bias‖₂`.
    pub fn d_bias(&self) -> f64 {
        let n_valid = self.row_weights.iter().filter(|&&w| w > 0.0).count();
        self.spectral() * (n_valid as f64).sqrt()
    }
}

/// One output's verdict.
#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    /// Output name (`loss`, `lse`, `d_e`, ...).
    pub name: String,
    /// The judged error.
    pub error: f64,
    /// What it may reach: `τ` plus the filter's allowance.
    pub allowed: f64,
}

impl Verdict {
    /// Whether the output passes (`error ≤ allowed`; a NaN error fails).
    pub fn pass(&self) -> bool {
        self.error <= self.allowed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zmag_is_the_largest_finite_lse_at_least_one() {
        // ρ, κ and τ are tested in cce_core::tolerance.
        assert_eq!(zmag(&[0.5, -0.2]), 1.0);
        assert_eq!(zmag(&[3.0, -7.0, f64::NAN]), 7.0);
    }

    #[test]
    fn judged_error_is_relative_to_values_plus_unit() {
        let want = [3.0, 4.0];
        assert!((judged_error(&[3.0, 4.5], &want, 0.0) - 0.1).abs() < 1e-12);
        // unit 5 per element: ‖want‖ + 5·sqrt(2).
        let e = judged_error(&[3.0, 4.5], &want, 5.0);
        assert!((e - 0.5 / (5.0 + 5.0 * 2f64.sqrt())).abs() < 1e-12);
        assert_eq!(judged_error(&[0.0, 0.25], &[0.0, 0.0], 0.0), 0.25);
        assert_eq!(judged_error(&[f32::NAN, 4.0], &want, 0.0), f64::INFINITY);
        assert_eq!(judged_error(&[f32::INFINITY], &[1.0], 0.0), f64::INFINITY);
        let v = Verdict {
            name: "x".into(),
            error: f64::NAN,
            allowed: 1.0,
        };
        assert!(!v.pass());
    }

    #[test]
    fn filter_bound() {
        // Two valid rows of weight 0.5 (mean over 2, no z-loss), one ignored row.
        let b = FilterBound::new(&[true, false, true], 0.5, 0.0, &[1.0, 2.0, 3.0], 1e-3, 1e-4);
        assert_eq!(b.row_weights, vec![0.5, 0.0, 0.5]);
        // max ‖c_j‖ = 5 (row [3, 4]).
        let c = [3.0f32, 4.0, 1.0, 0.0];
        assert!((b.d_e(&c, 2) - 1e-3 * 0.5f64.sqrt() * 5.0).abs() < 1e-15);
        let spectral = (0.5f64 * 1e-3 * 1.0 * 1e-4).sqrt();
        // The ignored row's e does not count: ‖E_valid‖_F = sqrt(1 + 4).
        let e = [1.0f32, 0.0, 100.0, 100.0, 0.0, 2.0];
        assert!((b.d_c(&e, 2) - spectral * 5f64.sqrt()).abs() < 1e-15);
        assert!((b.d_bias() - spectral * 2f64.sqrt()).abs() < 1e-15);
        // z-loss scales the weights by |1 + 2λ·lse|.
        let z = FilterBound::new(&[true], 1.0, 0.5, &[2.0], 1e-3, 1e-4);
        assert_eq!(z.row_weights, vec![3.0]);
    }
}
