//! `G` of one logits tile for the backward: probabilities, each row's kept class tiles (the
//! filter's suffix of dropped tiles: [`cce_core::tile_budget`]) and `G` itself for the rows of
//! the tile that keep it (MATH.md, "Backward").

use super::*;
use cce_core::tile_budget::TileMasses;

/// A tile's backward data: the tile's rows that keep it are the first `rows_kept` (the rows
/// visit in descending order of their kept tiles, [`cce_core::tile_budget::rows_by_kept`]).
pub(super) struct TileG {
    pub(super) classes: usize,
    /// Rows of the row tile that keep this class tile (a prefix; 0: skipped whole).
    pub(super) rows_kept: usize,
    /// `G` of the kept rows (row-major `[rows_kept x classes]`), when materialized.
    pub(super) g: Option<Vec<f32>>,
}

/// Everything needed to compute `G` for a tile.
#[derive(Clone, Copy)]
pub(super) struct GCtx<'a> {
    pub(super) p: &'a Prepared<'a>,
    pub(super) lse: &'a [f32],
    /// `1 − p_y` per row without cancellation ([`ForwardOutput::rest_mass`]).
    pub(super) rest: &'a [f32],
    pub(super) g: &'a [f32],
    pub(super) h: &'a [f32],
    pub(super) y: &'a [i32],
    pub(super) opts: &'a Options,
    pub(super) alpha: f32,
    pub(super) lambda: f32,
    pub(super) rule: FilterRule,
    /// Per row (visiting order), the class tiles it keeps (the filter's decisions, made before
    /// the gradient passes); `None`: every row keeps every tile.
    pub(super) kept: Option<&'a [usize]>,
}

impl GCtx<'_> {
    /// Probabilities `p = exp(z − lse_i)` of a tile's (capped) logits (one `exp` per entry);
    /// 0 at a −inf (masked) logit, also in a row whose lse is −inf (every class masked).
    pub(super) fn probs(&self, rows: &Range<usize>, k: usize, z: &[f32]) -> Vec<f32> {
        let mut p = z.to_vec();
        for (ii, row) in p.chunks_mut(k.max(1)).enumerate() {
            let l = self.lse[rows.start + ii];
            row.iter_mut().for_each(|x| {
                *x = if *x == f32::NEG_INFINITY {
                    0.0
                } else {
                    (*x - l).exp()
                }
            });
        }
        p
    }

    /// `g0` of an active row (0 for inactive rows) from the probability `p`: `p` off the
    /// target, `max(|1 − p|, |w − p|)` at it with `w = cy / cp` the `p` at which the target's
    /// `G = cp·p − cy` vanishes (`1 − α` without z-loss and lse gradient, 0 for a row with only
    /// an lse gradient), see cce-core filter.rs.
    pub(super) fn g0(&self, i: usize, j: usize, p: f32) -> f32 {
        if self.g[i] == 0.0 && self.h[i] == 0.0 {
            return 0.0;
        }
        if self.y[i] == j as i32 {
            // |1 − p| and |w − p| = |(w − 1) + rest| from the saved rest mass, not from `p`.
            let rest = self.rest[i];
            let cp = self.g[i] * (1.0 + 2.0 * self.lambda * self.lse[i]) + self.h[i];
            let cy = self.g[i] * (1.0 - self.alpha);
            let w1 = if cp != 0.0 { (cy - cp) / cp } else { -1.0 };
            rest.abs().max((w1 + rest).abs())
        } else {
            p
        }
    }

    /// `G_ij` (MATH.md, "Backward") from the probability `p` and the uncapped logit `x` (for
    /// the softcap's derivative, [`dcap`]).
    ///
    /// At the target `p = 1 − rest` comes from the saved rest mass, and the bracket is
    /// rearranged so that nothing cancels on a confident row (`rest → 0`):
    /// `(1 + 2λ lse)(1 − rest) − (1 − α) = α − rest + 2λ lse (1 − rest)`.
    pub(super) fn g_entry(&self, i: usize, j: usize, p: f32, x: f32) -> f32 {
        let ls = if self.rule.label_smoothing_analytic {
            0.0
        } else {
            self.alpha / self.p.problem.v as f32
        };
        let l = self.lse[i];
        let mut gij = if self.y[i] == j as i32 {
            let rest = self.rest[i];
            let py = 1.0 - rest;
            let mut t = if self.g[i] == 0.0 {
                0.0
            } else {
                self.g[i] * ((self.alpha - rest) + 2.0 * self.lambda * l * py - ls)
            };
            t += self.h[i] * py;
            t
        } else {
            let t = if self.g[i] == 0.0 {
                0.0
            } else {
                self.g[i] * ((1.0 + 2.0 * self.lambda * l) * p - ls)
            };
            t + self.h[i] * p
        };
        if let Some(s) = self.opts.softcap {
            gij *= dcap(x, s);
        }
        gij
    }

    pub(super) fn dense_tile(&self, rows: &Range<usize>, classes: &Range<usize>) -> Vec<f32> {
        let x = self.p.raw_logits_tile(rows, classes);
        let k = classes.len();
        let p = self.probs(rows, k, &self.p.capped(&x, self.opts.softcap));
        let mut out = x;
        for ii in 0..rows.len() {
            for jj in 0..k {
                let at = ii * k + jj;
                out[at] = self.g_entry(rows.start + ii, classes.start + jj, p[at], out[at]);
            }
        }
        out
    }

    /// Each row's kept class tiles and dropped mass ([`TileMasses::kept_prefix`] under
    /// `filter_eps` and `max_dropped_mass`) of the row tile `rows`, from its probability tiles
    /// `(classes, p)` in order.
    pub(super) fn decide_rows<P: AsRef<[f32]>>(
        &self,
        rows: &Range<usize>,
        n_tiles: usize,
        tiles: impl Iterator<Item = (Range<usize>, P)>,
    ) -> Vec<(usize, f64)> {
        let mut masses = TileMasses::zeros(rows.len(), n_tiles);
        for (t, (classes, p)) in tiles.enumerate() {
            let p = p.as_ref();
            let k = classes.len();
            for ii in 0..rows.len() {
                let i = rows.start + ii;
                for jj in 0..k {
                    masses.add(ii, t, self.g0(i, classes.start + jj, p[ii * k + jj]));
                }
            }
        }
        masses.kept_prefix(self.rule.eps, self.rule.max_dropped_mass as f64)
    }

    /// How many of the rows `rows` keep class tile `ct` (a prefix of them).
    pub(super) fn rows_kept(&self, rows: &Range<usize>, ct: usize) -> usize {
        match self.kept {
            Some(kept) => kept[rows.clone()].partition_point(|&k| k > ct),
            None => rows.len(),
        }
    }

    /// Class tile `ct` of a row tile: its kept rows and, if `keep_g`, their `G` (logits
    /// recomputed for those rows only).
    pub(super) fn tile(
        &self,
        rows: &Range<usize>,
        ct: usize,
        classes: &Range<usize>,
        keep_g: bool,
    ) -> TileG {
        let rows_kept = self.rows_kept(rows, ct);
        let g = (keep_g && rows_kept > 0)
            .then(|| self.dense_tile(&(rows.start..rows.start + rows_kept), classes));
        TileG {
            classes: classes.len(),
            rows_kept,
            g,
        }
    }
}
