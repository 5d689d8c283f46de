//! Each row's dropped-mass budget spent on a suffix of whole class tiles: which class tiles of
//! the vocabulary order a filtered backward leaves out for each row, and the order of the rows
//! that lets it skip whole blocks.
//!
//! The contract ([`crate::filter`], MATH.md "Gradient filtering") lets a backward skip an entry
//! when `g0 < filter_eps`, as long as each row's skipped `Σ g0` stays `≤ δ`. The per-row
//! threshold `τ_i` is one way to meet it, but it skips a tile only when every entry of every
//! row is below its row's `τ_i`, and real rows spread their last `δ` of mass over thousands of
//! tiny entries, so `τ_i` is tiny (0.2% of 64 x 256 tiles on the shipped SmolLM2 rows at
//! `δ = 1e-3`). With the classes in batch-mean-logit order ([`crate::vocab_order`]) a row's
//! small entries gather at the end of the order, so each row spends its budget on the longest
//! suffix of whole tiles it can drop:
//!
//! 1. row `i` keeps the first `kept_i` class tiles, the smallest count such that every entry of
//!    the tiles after them has `g0 < eps` and their `Σ g0 ≤ δ` ([`TileMasses::kept_prefix`]);
//!    a row without a gradient keeps none;
//! 2. the rows sorted by descending `kept_i` (ties by row id, [`rows_by_kept`]) form row tiles
//!    whose rows keep about as many tiles, so that a block of `R` sorted rows x a class tile is
//!    computed for the rows that keep it, a prefix of the block, and skipped whole past the
//!    block's first row's `kept`.
//!
//! On the shipped real rows (12 windows of 1024, 256-class tiles) the rows keep 38% of the
//! tiles at `δ = 1e-3` (17% at `1e-2`), where deciding whole 128-row tiles jointly (the
//! smallest-first greedy of session 22) kept 89% (70%): docs/perf-log.md, session 23. A row's
//! dropped mass is its suffix's `Σ g0`, `≤ δ` by construction; deterministic.

/// Per `(row, class tile)` of one row tile, row-major `[rows x tiles]`: the row's `Σ g0` over the
/// tile's classes and its largest `g0` there.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TileMasses {
    /// Rows of the row tile.
    pub rows: usize,
    /// Class tiles.
    pub tiles: usize,
    /// `Σ g0` per `(row, tile)`, probability units.
    pub mass: Vec<f64>,
    /// Largest `g0` per `(row, tile)`.
    pub max_g0: Vec<f32>,
}

impl TileMasses {
    /// Zeros for `rows x tiles`.
    pub fn zeros(rows: usize, tiles: usize) -> Self {
        Self {
            rows,
            tiles,
            mass: vec![0.0; rows * tiles],
            max_g0: vec![0.0; rows * tiles],
        }
    }

    /// Adds one entry `g0` of row `r` in tile `t`.
    pub fn add(&mut self, r: usize, t: usize, g0: f32) {
        let at = r * self.tiles + t;
        self.mass[at] += g0 as f64;
        self.max_g0[at] = self.max_g0[at].max(g0);
    }

    /// Per row (`[rows]`): how many leading class tiles it keeps, and the `Σ g0` of the tiles
    /// it drops (`≤ delta`): the longest suffix of tiles whose entries are all `< eps` (an
    /// entry at or above `eps` is never skipped; a target's tile carries `max_g0 = ∞` where the
    /// caller wants it kept) and whose masses sum to at most `delta`.
    pub fn kept_prefix(&self, eps: f32, delta: f64) -> Vec<(usize, f64)> {
        (0..self.rows)
            .map(|r| {
                let mass = &self.mass[r * self.tiles..(r + 1) * self.tiles];
                let max_g0 = &self.max_g0[r * self.tiles..(r + 1) * self.tiles];
                let mut kept = self.tiles;
                let mut dropped = 0.0f64;
                while kept > 0 && max_g0[kept - 1] < eps && dropped + mass[kept - 1] <= delta {
                    dropped += mass[kept - 1];
                    kept -= 1;
                }
                (kept, dropped)
            })
            .collect()
    }
}

/// The rows in the order a backward visits them (`[n]`, row ids): by descending `kept` (tiles
/// each row keeps), ties by ascending row id.
pub fn rows_by_kept(kept: &[usize]) -> Vec<u32> {
    let mut order: Vec<u32> = (0..kept.len() as u32).collect();
    order.sort_by(|&a, &b| kept[b as usize].cmp(&kept[a as usize]).then(a.cmp(&b)));
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    fn masses(rows: usize, tiles: usize, m: &[f64], mx: &[f32]) -> TileMasses {
        TileMasses {
            rows,
            tiles,
            mass: m.to_vec(),
            max_g0: mx.to_vec(),
        }
    }

    #[test]
    fn each_row_drops_the_longest_suffix_that_fits() {
        // Two rows, four tiles (binary fractions: exact sums).
        let t = masses(
            2,
            4,
            &[0.125, 0.25, 0.375, 0.0, 0.5, 0.75, 0.125, 0.25],
            &[0.01; 8],
        );
        // Row 0: 0.0 + 0.375 = 0.375 fits 0.5, + 0.25 does not: keeps 2. Row 1: 0.25 + 0.125
        // fits, + 0.75 does not: keeps 2.
        assert_eq!(t.kept_prefix(1.0, 0.5), [(2, 0.375), (2, 0.375)]);
        assert_eq!(t.kept_prefix(1.0, 0.0), [(3, 0.0), (4, 0.0)]);
        assert_eq!(t.kept_prefix(1.0, 10.0), [(0, 0.75), (0, 1.625)]);
    }

    #[test]
    fn an_entry_at_eps_stops_the_suffix() {
        let t = masses(1, 3, &[0.0, 0.0, 0.0], &[0.0, 0.5, 0.0]);
        assert_eq!(t.kept_prefix(0.5, 1.0), [(2, 0.0)]);
        assert_eq!(t.kept_prefix(0.6, 1.0), [(0, 0.0)]);
        let t = masses(1, 2, &[0.0, 0.0], &[0.0, f32::INFINITY]);
        assert_eq!(t.kept_prefix(1.0, 1.0), [(2, 0.0)]);
    }

    #[test]
    fn rows_sort_by_descending_kept_then_id() {
        assert_eq!(rows_by_kept(&[1, 3, 0, 3, 1]), [1, 3, 0, 4, 2]);
        assert!(rows_by_kept(&[]).is_empty());
    }

    #[test]
    fn dropped_mass_never_exceeds_the_budget_and_is_the_suffix_sum() {
        let mut x = 0x2545_f491u32;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 1000) as f64 / 1000.0
        };
        for &(rows, tiles) in &[(1usize, 1usize), (3, 7), (16, 40), (64, 5)] {
            let mut t = TileMasses::zeros(rows, tiles);
            for r in 0..rows {
                for k in 0..tiles {
                    let g0 = (next() * next() * 1e-3) as f32;
                    t.add(r, k, g0);
                    t.add(r, k, g0 * 0.5);
                }
            }
            let delta = 2e-3;
            for (r, &(kept, dropped)) in t.kept_prefix(1e-3, delta).iter().enumerate() {
                let suffix: f64 = (kept..tiles).map(|k| t.mass[r * tiles + k]).sum();
                assert!((suffix - dropped).abs() <= 1e-15, "row {r}");
                assert!(dropped <= delta, "row {r}: {dropped}");
                if kept > 0 {
                    let more = dropped + t.mass[r * tiles + kept - 1];
                    assert!(more > delta || t.max_g0[r * tiles + kept - 1] >= 1e-3);
                }
            }
        }
    }
}
