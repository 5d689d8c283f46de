//! `G` of one logits tile for the backward: probabilities, the filter's skip decisions (whole
//! tiles, each row tile's decided at once: [`cce_core::tile_budget`]) and their dropped mass,
//! and `G` itself when the tile is kept (MATH.md, "Backward").

use super::*;
use cce_core::tile_budget::TileMasses;
use std::collections::BTreeMap;

/// A row tile's skip decisions, per class tile (in the order of the call's class tiles).
pub(super) struct RowTileSkips {
    /// Whether class tile `t` is skipped.
    pub(super) skip: Vec<bool>,
    /// Each row's `g0` mass per class tile, when the decisions were made from a fused
    /// forward's statistics before any logits of the backward (the skipped tiles' dropped mass).
    pub(super) mass: Option<TileMasses>,
}

/// The skip decisions of every row tile, by the row tile's first row.
pub(super) type SkipMask = BTreeMap<usize, RowTileSkips>;

/// A tile's backward data.
pub(super) struct TileG {
    pub(super) classes: usize,
    pub(super) skipped: bool,
    /// Per row of the tile, `Σ g0` (skipped tiles only).
    pub(super) dropped: Vec<f64>,
    /// `G` of the tile (row-major), when materialized and kept.
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
    /// Tile ownership's skip decisions, made in a pass before the gradient passes.
    pub(super) skips: Option<&'a SkipMask>,
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

    /// Which of a row tile's `n_tiles` class tiles to skip, from their probability tiles
    /// `(classes, p)` in order: each row's `g0` mass and largest `g0` per tile, then
    /// [`TileMasses::skips`] under `filter_eps` and `max_dropped_mass`.
    pub(super) fn skip_row<P: AsRef<[f32]>>(
        &self,
        rows: &Range<usize>,
        n_tiles: usize,
        tiles: impl Iterator<Item = (Range<usize>, P)>,
    ) -> Vec<bool> {
        if !self.rule.enabled {
            return vec![false; n_tiles];
        }
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
        masses.skips(self.rule.eps, self.rule.max_dropped_mass as f64)
    }

    /// Skip decision (and `G` if `keep_g` and kept) of class tile `ct` of a row tile,
    /// recomputing its logits and reading the decisions of the skip pass.
    pub(super) fn tile(
        &self,
        rows: &Range<usize>,
        ct: usize,
        classes: &Range<usize>,
        keep_g: bool,
    ) -> TileG {
        let decided = self.skips.and_then(|m| m.get(&rows.start));
        let skip = decided.is_some_and(|d| d.skip[ct]);
        if let (true, Some(mass)) = (skip, decided.and_then(|d| d.mass.as_ref())) {
            return Self::skipped_from(classes.len(), ct, mass);
        }
        let x = self.p.raw_logits_tile(rows, classes);
        let p = self.probs(rows, classes.len(), &self.p.capped(&x, self.opts.softcap));
        self.tile_from(rows, classes, x, &p, skip, keep_g)
    }

    /// Skipped class tile `ct` (of `k` classes) of a row tile whose masses are known
    /// beforehand: no logits, the dropped mass from `mass`.
    pub(super) fn skipped_from(k: usize, ct: usize, mass: &TileMasses) -> TileG {
        TileG {
            classes: k,
            skipped: true,
            dropped: (0..mass.rows)
                .map(|r| mass.mass[r * mass.tiles + ct])
                .collect(),
            g: None,
        }
    }

    /// The tile (`G` if `keep_g` and kept) from its uncapped logits `x` and their
    /// probabilities `p`; when `skip` (the row tile's decision), its dropped mass per row.
    pub(super) fn tile_from(
        &self,
        rows: &Range<usize>,
        classes: &Range<usize>,
        x: Vec<f32>,
        p: &[f32],
        skip: bool,
        keep_g: bool,
    ) -> TileG {
        let k = classes.len();
        let skipped = skip && self.rule.enabled;
        let mut dropped = vec![0.0f64; rows.len()];
        if skipped {
            for (ii, out) in dropped.iter_mut().enumerate() {
                let i = rows.start + ii;
                *out = (0..k)
                    .map(|jj| self.g0(i, classes.start + jj, p[ii * k + jj]) as f64)
                    .sum();
            }
        }
        if skipped {
            return TileG {
                classes: k,
                skipped,
                dropped,
                g: None,
            };
        }
        let g = keep_g.then(|| {
            let mut out = x;
            for ii in 0..rows.len() {
                for jj in 0..k {
                    let at = ii * k + jj;
                    out[at] = self.g_entry(rows.start + ii, classes.start + jj, p[at], out[at]);
                }
            }
            out
        });
        TileG {
            classes: k,
            skipped: false,
            dropped: vec![],
            g,
        }
    }
}
