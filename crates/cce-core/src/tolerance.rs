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

/// The relative tolerance `τ = max(tol(dtype), tol(f32) · ρ(len) · κ)` of an output with
/// reduction length `len` from inputs of `dtype`.
pub fn tau(dtype: DType, len: usize, kappa: f64) -> f64 {
    dtype
        .tolerance()
        .max(DType::F32.tolerance() * rho(len) * kappa)
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
        assert_eq!(tau(DType::BF16, 49152, kappa(20.0, 576)), 1e-2);
        assert!((tau(DType::F32, 4096, kappa(32.0, 16)) - 4e-5).abs() < 1e-12);
    }
}
