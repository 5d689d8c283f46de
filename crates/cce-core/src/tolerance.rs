//! The growth terms of the conformance tolerance (MATH.md, "How results are judged"), shared
//! by the conformance suite's judge (`tests/src/judge.rs`) and `cce run --check`.
//!
//! An output with reduction length `L` from inputs of dtype `t` is judged against
//! `τ = max(tol(t), tol(f32) · ρ(L) · κ)` ([`DType::tolerance`] gives `tol`): f32 accumulation
//! error grows like `sqrt(L)` past `L = 1024` (`ρ`), and the gradients' with the logits'
//! magnitude times `sqrt(D)` past 64 (`κ`).

use crate::DType;

/// Reduction length above which the f32 accumulation tolerance grows (`ρ`).
pub const RHO_BASE_LEN: f64 = 1024.0;
/// `zmag · sqrt(D)` above which the f32 tolerance of the gradients grows (`κ`).
pub const KAPPA_BASE: f64 = 64.0;

/// `ρ(L) = sqrt(max(1, L / 1024))` for a reduction of `len` terms.
pub fn rho(len: usize) -> f64 {
    (len as f64 / RHO_BASE_LEN).max(1.0).sqrt()
}

/// `κ = max(1, zmag · sqrt(D) / 64)` for the gradients (the forward outputs take 1), with
/// `zmag` the largest |lse| (at least 1) and `d` the hidden size. Why it grows with `|lse|`:
/// the saved f32 lse and the f32 logits carry `~|lse|·2⁻²⁴` of absolute error, which
/// `p = exp(z − lse)` turns into a relative error of every `p` of the row; a common offset of
/// the logits (the same bias on every class) is not cancelled (crate docs, "Accuracy on hard
/// inputs").
pub fn kappa(zmag: f64, d: usize) -> f64 {
    (zmag * (d as f64).sqrt() / KAPPA_BASE).max(1.0)
}

/// The `zmag` of [`kappa`] for the gradients under a softcap `s`:
/// `max(zmag, ‖e‖_max · ‖c‖_max / s)` (`zmag` unchanged without a softcap).
///
/// Why: the softcap multiplies every `G_ij` by `1 − tanh²(z_ij / s)`, whose relative error is
/// `2·|tanh(z_ij / s)| / s` times the raw logit's absolute error. That error is an f32 dot
/// product's, `~u·sqrt(D)·Σ_k |e_ik c_jk|` (at most `‖e_i‖₂·‖c_j‖₂`, Cauchy–Schwarz), not
/// `~u·sqrt(D)·|z_ij|`: a logit whose terms cancel to within `s` of 0, where the factor is
/// steepest, keeps the error of its terms. Relative to the term scale `p + onehot` (which
/// carries no softcap factor) the amplification is at most `2·max_x tanh(x)·sech²(x) / s
/// ≈ 0.77 / s`, so the product of the operands' largest row norms over `s` stands in for
/// `zmag`. The softcaps in use (15-50) leave `zmag` unchanged on model data; a softcap of
/// `3e-3` over `‖e‖·‖c‖ ≈ 3` widens the gradients' tolerance ~70x (an ill-conditioned problem:
/// the same-precision reference itself errs ~10x above the uncapped tolerance there). The bias
/// is left out: it is added once, with one rounding, and may be −∞ (a masked class).
pub fn softcapped_zmag(zmag: f64, softcap: Option<f64>, max_e_norm: f64, max_c_norm: f64) -> f64 {
    match softcap {
        Some(s) if s > 0.0 && s.is_finite() => zmag.max(max_e_norm * max_c_norm / s),
        _ => zmag,
    }
}

/// The relative tolerance `τ = max(tol(dtype), tol(f32) · ρ(len) · κ)` of an output with
/// reduction length `len` from inputs of `dtype`.
pub fn tau(dtype: DType, len: usize, kappa: f64) -> f64 {
    dtype
        .tolerance()
        .max(DType::F32.tolerance() * rho(len) * kappa)
}

/// One row of a gradient (`[rows, cols]`, a row of `d_e` or a class row of `d_c`) judged as
/// a whole.
///
/// The per-row rule: `‖ours_i − gt_i‖₂ ≤ allowed_i` with ([`row_allowance`])
///
/// ```text
/// allowed_i = τ · (‖gt_i‖₂ + S_i · M) + F_i + sqrt(cols) · floor(out dtype)
/// ```
///
/// `S_i = Σ_j T_ij` over the terms of the row (for row `i` of `d_e = G·C`; `Σ_i T_ij` for
/// class row `j` of `d_c = Gᵀ·E`; from the f64 oracle, `cce_reference::Oracle::g_terms_rows`),
/// with `T_ij ≥ |G_ij|` the sizes of the parts of `G_ij` (`p_ij`, the smoothing's `α/V`, the
/// z-loss term, the lse upstream; for the target `α` and `1 − p_y`, never `p_y` and 1), `M`
/// the largest row norm of the other operand (`max_j ‖c_j‖₂`, `max_i ‖e_i‖₂`), so that
/// `S_i · M` bounds `Σ_j T_ij ‖c_j‖₂`: an implementation whose every part of `G` carries a
/// relative error `δ ≤ τ` (f32 logits, a 16-bit `G` for tensor cores, f32 accumulation) errs
/// by at most `δ · S_i · M`. A row is judged against the size of its own terms, not of the batch: a
/// confident row (`p_y → 1`), whose gradient is `1 − p_y` small, must be as accurate as any
/// other, which a batch norm or a term scale of `p + onehot` does not see. `F_i` is what the
/// gradient filter's skipped entries can explain in that row (0 in exact mode), and the last
/// term the error of elements near 0 ([`output_floor`]).
#[derive(Clone, Debug, PartialEq)]
pub struct RowError {
    /// Row index.
    pub row: usize,
    /// `‖ours_i − gt_i‖₂` (`+∞` when the row of `ours` holds a NaN or an infinity).
    pub error: f64,
    /// `‖ours_i‖₂`.
    pub ours_norm: f64,
    /// `‖gt_i‖₂`.
    pub truth_norm: f64,
    /// The row's allowance.
    pub allowed: f64,
}

impl RowError {
    /// Whether the row passes (`error ≤ allowed`; non-finite fails).
    pub fn pass(&self) -> bool {
        self.error <= self.allowed
    }

    /// `error / allowed` (how much of its allowance the row uses; > 1 fails).
    pub fn ratio(&self) -> f64 {
        if self.error == 0.0 {
            0.0
        } else {
            self.error / self.allowed.max(f64::MIN_POSITIVE)
        }
    }
}

/// The absolute error allowed on an output element near 0: `2⁻¹¹⁰` (2¹⁶ times f32's smallest
/// normal; the gradients accumulate in f32, whose subnormals carry an absolute rather than a
/// relative precision and which GPUs flush to zero in products and sums of terms of that
/// size), or half the smallest positive subnormal of a coarser output dtype (`2⁻²⁵` for f16).
pub fn output_floor(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 2f64.powi(-25),
        _ => 2f64.powi(-110),
    }
}

/// What flushing subnormal entries of `G` to zero may change in one gradient row: GPUs run
/// f32 with subnormals flushed (FTZ, and `exp` approximations that return 0 below `2⁻¹²⁶`), so
/// each of the `len` entries of `G` a row sums over (`V` for a row of `d_e`, `N` for a class
/// row of `d_c`) may lose up to `2⁻¹²⁶`, times the other operand's largest row norm
/// `m_other`: `2⁻¹²⁶ · len · m_other`. Negligible beside any gradient of normal size (a
/// p of `e^{−85}` at peaked logits is such an entry).
pub fn ftz_allowance(len: usize, m_other: f64) -> f64 {
    f32::MIN_POSITIVE as f64 * len as f64 * m_other
}

/// Relative range of a 16-bit `G` with one power-of-two scale per call (or per row): GPU
/// backends hold `G` for tensor-core products of 16-bit inputs in f16, scaled by `2^k` so that
/// `max |2^k · G| ≤ 2¹⁴` (above `2¹³`); f16 keeps an absolute `2⁻²⁵` of the scaled value
/// (half its subnormal spacing), so an entry of `G` may lose up to `2⁻³⁸ · max |G|`.
pub const F16_G_RANGE: f64 = 1.0 / (1u64 << 38) as f64;

/// What the range of the `G` a backend multiplies with may change in one gradient row: each
/// of the `len` entries of `G` the row sums over may lose `max(2⁻¹²⁶, r · g_max)` (FTZ,
/// [`ftz_allowance`]; `r` = [`F16_G_RANGE`] for 16-bit `dtype` inputs, 0 for f32), times the
/// other operand's largest row norm `m_other`. `g_max` bounds `max |G_ij|` over the call
/// (the judges take the largest row of the oracle's term sizes). A class row of `d_c` whose
/// every entry of `G` is below `2⁻³⁸` of the call's largest (a class with `p ~ e^{−30}` in
/// every row of a peaked batch) may thus come back as 0.
pub fn g_range_allowance(dtype: DType, len: usize, m_other: f64, g_max: f64) -> f64 {
    let range = match dtype {
        DType::F16 | DType::BF16 => F16_G_RANGE * g_max,
        _ => 0.0,
    };
    ftz_allowance(len, m_other).max(range * len as f64 * m_other)
}

/// The per-row allowance of [`RowError`]: `τ · (truth_norm + terms) + filter + sqrt(cols) ·
/// output_floor(out_dtype)`, with `terms = S_i · M`.
pub fn row_allowance(
    tau: f64,
    truth_norm: f64,
    terms: f64,
    filter: f64,
    cols: usize,
    out_dtype: DType,
) -> f64 {
    tau * (truth_norm + terms) + filter + (cols as f64).sqrt() * output_floor(out_dtype)
}

/// Per-row errors of a gradient `[rows, cols]` (row-major) against the f64 truth;
/// `allowed(row, truth_norm)` gives each row's allowance ([`row_allowance`]).
pub fn row_errors(
    ours: &[f64],
    truth: &[f64],
    cols: usize,
    allowed: impl Fn(usize, f64) -> f64,
) -> Vec<RowError> {
    let cols = cols.max(1);
    ours.chunks(cols)
        .zip(truth.chunks(cols))
        .enumerate()
        .map(|(row, (o, t))| {
            let norm = |x: &[f64]| x.iter().map(|v| v * v).sum::<f64>().sqrt();
            let truth_norm = norm(t);
            let error = if o.iter().all(|x| x.is_finite()) {
                o.iter()
                    .zip(t)
                    .map(|(a, b)| (a - b) * (a - b))
                    .sum::<f64>()
                    .sqrt()
            } else {
                f64::INFINITY
            };
            RowError {
                row,
                error,
                ours_norm: norm(o),
                truth_norm,
                allowed: allowed(row, truth_norm),
            }
        })
        .collect()
}

/// The `k` rows with the largest `error / allowed`, worst first.
pub fn worst_rows(rows: &[RowError], k: usize) -> Vec<RowError> {
    let mut sorted: Vec<&RowError> = rows.iter().collect();
    sorted.sort_by(|a, b| b.ratio().total_cmp(&a.ratio()));
    sorted.into_iter().take(k).cloned().collect()
}

/// `max_k ‖x_k‖₂` over the rows of a `[rows, cols]` matrix (`M` of [`RowError`]).
pub fn max_row_norm(x: &[f64], cols: usize) -> f64 {
    x.chunks(cols.max(1))
        .map(|r| r.iter().map(|v| v * v).sum::<f64>().sqrt())
        .fold(0.0, f64::max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn growth_terms() {
        assert_eq!(rho(100), 1.0);
        assert_eq!(rho(4096), 2.0);
        assert_eq!(kappa(1.0, 64), 1.0);
        assert_eq!(kappa(32.0, 16), 2.0);
        assert_eq!(softcapped_zmag(5.0, None, 3.0, 4.0), 5.0);
        assert_eq!(softcapped_zmag(5.0, Some(30.0), 3.0, 4.0), 5.0);
        assert_eq!(softcapped_zmag(5.0, Some(1e-2), 3.0, 4.0), 1200.0);
        assert_eq!(tau(DType::BF16, 49152, kappa(20.0, 576)), 1e-2);
        assert!((tau(DType::F32, 4096, kappa(32.0, 16)) - 4e-5).abs() < 1e-12);
    }

    #[test]
    fn a_confident_row_is_judged_against_its_own_terms() {
        // E = [[1]], C = [[16], [0]], target 0: G = [−r, r] with r = 1 − p_0 ≈ 1.125e-7, so
        // d_e = −16·r. A backend that loses r to cancellation returns 0: 100% wrong in that
        // row, though tiny against a batch or a term scale of p + onehot.
        let r = 1.0 / (1.0 + 16f64.exp());
        let truth = [-16.0 * r];
        let s = 2.0 * r; // Σ_j |G_0j|
        let m = 16.0; // max_j ‖c_j‖
        let allow = |_: usize, t: f64| row_allowance(1e-5, t, s * m, 0.0, 1, DType::F32);
        let bad = row_errors(&[0.0], &truth, 1, allow);
        assert!(!bad[0].pass() && bad[0].ratio() > 1e4, "{bad:?}");
        let good = row_errors(&[truth[0] * (1.0 + 1e-6)], &truth, 1, allow);
        assert!(good[0].pass(), "{good:?}");
        let nan = row_errors(&[f64::NAN], &truth, 1, allow);
        assert!(!nan[0].pass());
        // The worst rows come first.
        let rows = row_errors(&[1.0, 2.0, 3.5], &[1.0, 2.5, 3.0], 1, |_, _| 1.0);
        let w = worst_rows(&rows, 2);
        assert_eq!((w[0].row, w[1].row), (1, 2));
        assert_eq!(max_row_norm(&[3.0, 4.0, 1.0, 0.0], 2), 5.0);
    }
}
