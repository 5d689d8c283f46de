//! The gradient filter rule: which entries of `G` a backward may skip.
//!
//! CCE (paper section 4.3) skips a whole tile of the backward when every entry has
//! `|p_ij − [j = y_i]| < filter_eps`. On real LM data that drops 3-5% of `d_e` (MATH.md,
//! "Gradient filtering"), so this crate bounds, per row, the total skipped magnitude too:
//!
//! - `g0_ij = p_ij` for `j ≠ y_i`, and `max(|1 − p|, |w − p|)` at the target, `w` the `p` at
//!   which the target's `G` vanishes: `G_ij = cp_i·p_ij − cy_i·[j = y_i]` (besides the uniform
//!   `−α g / V`) with `cp = g·(1 + 2λ·lse) + h`, `cy = g·(1 − α)` (`g` the loss gradient, `h`
//!   the lse gradient, `λ` the z-loss weight), so `w = cy / cp`: `1 − α` without z-loss and
//!   lse gradient, `0` for a row with only an lse gradient. The first term is CCE's
//!   `|p − onehot|`, the second the entry's real size in the units of every other entry
//!   (`|G| / |cp|`), so a target with `p → 1` is never skipped under label smoothing or z-loss
//!   (whose target `G → g·(α + 2λ·lse)`). Every backend's threshold histogram and skip
//!   decision use this `w`;
//! - row `i` gets a threshold `τ_i ≤ filter_eps`: the largest grid value
//!   `τ_k = filter_eps · 2^(−k/4)`, `k = 0..=64`, such that `Σ_{j: g0_ij < τ_k} g0_ij ≤ δ`
//!   (`δ = max_dropped_mass`), or `τ_i = 0` (skip nothing) if even the lowest edge holds more;
//! - entries with `g0_ij < τ_i` **may** be skipped; a backend may skip fewer (for example only
//!   whole tiles of such entries, keeping every entry of a visited tile, as CCE does);
//! - the "dropped mass" a call reports for row `i` is `Σ g0_ij` over the entries it actually
//!   skipped, so `dropped_mass_i ≤ δ` always holds.
//!
//! `τ_i` is one way to meet the contract (every skipped entry `< filter_eps`, each row's skipped
//! `Σ g0 ≤ δ`), the one for backends that skip single entries (CUDA's sparse backward) or decide
//! each tile alone (wgpu). A backend that decides all of a row's class tiles at once spends
//! each row's `δ` on a suffix of whole tiles instead ([`crate::tile_budget`], the CPU backend's
//! rule), which meets the same contract and skips far more tiles on real rows.
//!
//! `τ_i` comes from a histogram of `g0` over the grid's bins ([`FilterRule::bin`]), which a GPU
//! builds in one recompute pass with integer atomics ([`FilterRule::mass_to_fixed`]).
//!
//! Label smoothing's dense term `−α g_i / V` is not filtered: without softcap it is rank-1 and
//! handled analytically (`label_smoothing_analytic`); with softcap filtering is turned off.

use crate::dtype::DType;
use crate::options::{FilterEps, Options};

/// Sub-bins per octave of the threshold grid.
pub const BINS_PER_OCTAVE: u32 = 4;
/// Octaves the grid spans below `filter_eps`.
pub const OCTAVES: u32 = 16;
/// Histogram bins: `BINS_PER_OCTAVE · OCTAVES` graded bins plus one underflow bin.
pub const N_BINS: usize = (BINS_PER_OCTAVE * OCTAVES) as usize + 1;
/// Scale of the fixed-point mass used by integer-atomic histograms: `2^30` per unit of mass.
pub const FIXED_POINT_ONE: f64 = (1u64 << 30) as f64;

/// The filter as resolved for one call: whether it is on, its threshold and bound.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FilterRule {
    /// Whether any entry may be skipped.
    pub enabled: bool,
    /// `filter_eps` after resolving `Auto` against the dtype (0 when disabled).
    pub eps: f32,
    /// Per-row bound `δ` on the skipped `Σ g0`.
    pub max_dropped_mass: f32,
    /// Filter applies to `d_e`.
    pub filter_e_grad: bool,
    /// Filter applies to `d_c` and `d_bias`.
    pub filter_c_grad: bool,
    /// Label smoothing's `−α/V` term is added analytically (rank-1) instead of per entry.
    pub label_smoothing_analytic: bool,
    /// `edges[k] = eps · 2^(−k/4)`, precomputed so that [`FilterRule::bin`] needs no
    /// transcendental function.
    edges: [f32; N_BINS],
}

impl FilterRule {
    /// Resolve the options for inputs of `dtype`. The filter is disabled when `filter_eps` is
    /// `Off`, when `max_dropped_mass` is 0, when both `filter_e_grad` and `filter_c_grad` are
    /// off, or when label smoothing is combined with softcap (its dense term is then not rank-1:
    /// MATH.md, "Backward").
    pub fn resolve(opts: &Options, dtype: DType) -> Self {
        let eps = match opts.filter_eps {
            FilterEps::Off => 0.0,
            FilterEps::Auto => dtype.auto_filter_eps().unwrap_or(0.0),
            FilterEps::Value(v) => v,
        };
        let ls = opts.label_smoothing > 0.0;
        let enabled = eps > 0.0
            && opts.max_dropped_mass > 0.0
            && (opts.filter_e_grad || opts.filter_c_grad)
            && !(ls && opts.softcap.is_some());
        let eps = if enabled { eps } else { 0.0 };
        let mut edges = [0.0f32; N_BINS];
        for (k, e) in edges.iter_mut().enumerate() {
            *e = eps * (-(k as f32) / BINS_PER_OCTAVE as f32).exp2();
        }
        Self {
            enabled,
            eps,
            edges,
            max_dropped_mass: if enabled { opts.max_dropped_mass } else { 0.0 },
            filter_e_grad: enabled && opts.filter_e_grad,
            filter_c_grad: enabled && opts.filter_c_grad,
            label_smoothing_analytic: ls && opts.softcap.is_none(),
        }
    }

    /// Upper edge of bin `k` (`k = 0..N_BINS`): `eps · 2^(−k/4)`. Bin `k < N_BINS − 1` holds
    /// `[edge(k+1), edge(k))`; the last bin holds `[0, edge(N_BINS − 1))`.
    pub fn edge(&self, k: usize) -> f32 {
        self.edges[k]
    }

    /// Histogram bin of a magnitude `g0 ≥ 0`, or `None` when `g0 ≥ eps` (never skippable) or
    /// the filter is off.
    pub fn bin(&self, g0: f32) -> Option<usize> {
        if !self.enabled || g0.is_nan() || g0 >= self.eps {
            return None;
        }
        // Edges decrease with k: the count of edges[1..] above g0 is the bin (binary search).
        Some(self.edges[1..].partition_point(|&e| e > g0))
    }

    /// The row threshold `τ` from a histogram `hist[k]` = `Σ g0` of the row's entries in bin `k`
    /// (`N_BINS` values). Entries with `g0 < τ` may be skipped; their sum is `≤ δ`.
    /// Returns 0 when the filter is off or nothing can be skipped.
    pub fn threshold(&self, hist: &[f64]) -> f32 {
        if !self.enabled {
            return 0.0;
        }
        debug_assert_eq!(hist.len(), N_BINS);
        let delta = self.max_dropped_mass as f64;
        // below[k] = mass of bins k.. ; the threshold edge(k) admits exactly those bins.
        let mut below = 0.0;
        let mut best = None;
        for k in (0..N_BINS).rev() {
            below += hist[k];
            if below <= delta {
                best = Some(k);
            } else {
                break;
            }
        }
        best.map_or(0.0, |k| self.edge(k))
    }

    /// Fixed-point mass for integer-atomic histograms: `ceil(g0 · 2^30)` as u32. Rounding up
    /// over-estimates the mass, so a threshold from it never drops more than `δ`.
    pub fn mass_to_fixed(g0: f32) -> u32 {
        (g0 as f64 * FIXED_POINT_ONE).ceil().min(u32::MAX as f64) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(eps: f32, delta: f32) -> FilterRule {
        let o = Options {
            filter_eps: FilterEps::Value(eps),
            max_dropped_mass: delta,
            ..Default::default()
        };
        FilterRule::resolve(&o, DType::BF16)
    }

    #[test]
    fn bins_contain_their_values() {
        let r = rule(2f32.powi(-12), 1e-3);
        let mut g = 2f32.powi(-12) * 0.999;
        while g > 1e-12 {
            let k = r.bin(g).unwrap();
            assert!(g < r.edge(k), "g {g} bin {k}");
            if k < N_BINS - 1 {
                assert!(g >= r.edge(k + 1), "g {g} bin {k}");
            }
            g *= 0.93;
        }
        assert_eq!(r.bin(2f32.powi(-12)), None);
        assert_eq!(r.bin(0.0), Some(N_BINS - 1));
    }

    #[test]
    fn threshold_bounds_the_dropped_mass() {
        let r = rule(2f32.powi(-12), 1e-3);
        // 1000 entries of 1e-5 (mass 1e-2) and 100 of 1e-7 (mass 1e-5).
        let vals: Vec<f32> = std::iter::repeat_n(1e-5f32, 1000)
            .chain(std::iter::repeat_n(1e-7f32, 100))
            .collect();
        let mut hist = vec![0.0; N_BINS];
        for &g in &vals {
            hist[r.bin(g).unwrap()] += g as f64;
        }
        let tau = r.threshold(&hist);
        let dropped: f64 = vals.iter().filter(|&&g| g < tau).map(|&g| g as f64).sum();
        assert!(dropped <= 1e-3, "dropped {dropped}");
        assert!(tau > 1e-7 && tau <= 1e-5, "tau {tau}");
    }

    #[test]
    fn auto_resolves_per_dtype_and_off_disables() {
        let o = Options::default();
        assert_eq!(FilterRule::resolve(&o, DType::BF16).eps, 2f32.powi(-12));
        assert!(!FilterRule::resolve(&Options::exact(), DType::BF16).enabled);
        let ls_cap = Options {
            label_smoothing: 0.1,
            softcap: Some(30.0),
            ..Default::default()
        };
        assert!(!FilterRule::resolve(&ls_cap, DType::F32).enabled);
        let ls = Options {
            label_smoothing: 0.1,
            ..Default::default()
        };
        let r = FilterRule::resolve(&ls, DType::F32);
        assert!(r.enabled && r.label_smoothing_analytic);
    }
}
