//! Whole-tile skips of a row tile under each row's dropped-mass bound: which class tiles a
//! backward that skips whole tiles leaves out, decided over all of a row tile's class tiles at
//! once.
//!
//! The contract ([`crate::filter`], MATH.md "Gradient filtering") lets a backward skip an entry
//! when `g0 < filter_eps`, as long as each row's skipped `Σ g0` stays `≤ δ`. The per-row
//! threshold `τ_i` is one way to meet it: it skips a tile only when every entry of every row is
//! below that row's `τ_i`, the level under which *all* of the row's entries sum to `≤ δ`. Real
//! rows spread their last `δ` of mass over thousands of tiny entries, so `τ_i` is tiny and
//! almost no tile of 64 rows is below it everywhere (0.2% of 64 x 256 tiles on the shipped
//! SmolLM2 rows at `δ = 1e-3`). Spending each row's budget on whole tiles instead, the tiles
//! whose largest row mass is smallest first, skips 20% of the same tiles with the classes in
//! batch-mean-logit order ([`crate::vocab_order`]), 42% at `δ = 1e-2` (docs/perf-log.md,
//! session 22). The rule:
//!
//! 1. a class tile is a candidate when every active row's entries in it have `g0 < eps`;
//! 2. candidates in ascending order of their largest row mass (ties by tile index);
//! 3. a candidate is skipped when every row's mass in it fits in what is left of that row's
//!    budget `δ`, which it then takes.
//!
//! Greedy, not optimal; deterministic, so every pass over a row tile makes the same skips. Rows
//! without a gradient have `g0 = 0` everywhere and constrain nothing.

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

    /// Which tiles to skip (`[tiles]`) under `eps` (entries at or above it are never skipped)
    /// and the per-row budget `delta` (module docs for the rule).
    pub fn skips(&self, eps: f32, delta: f64) -> Vec<bool> {
        let (rows, tiles) = (self.rows, self.tiles);
        let at = |r: usize, t: usize| r * tiles + t;
        let mut candidates: Vec<(f64, usize)> = (0..tiles)
            .filter(|&t| (0..rows).all(|r| self.max_g0[at(r, t)] < eps))
            .map(|t| {
                let key = (0..rows).map(|r| self.mass[at(r, t)]).fold(0.0, f64::max);
                (key, t)
            })
            .collect();
        candidates.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let mut budget = vec![delta; rows];
        let mut skip = vec![false; tiles];
        for (_, t) in candidates {
            if (0..rows).all(|r| self.mass[at(r, t)] <= budget[r]) {
                for (r, b) in budget.iter_mut().enumerate() {
                    *b -= self.mass[at(r, t)];
                }
                skip[t] = true;
            }
        }
        skip
    }
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
    fn smallest_tiles_first_until_a_row_runs_out() {
        // Two rows, four tiles (binary fractions: exact sums); row 1's budget binds.
        let t = masses(
            2,
            4,
            &[0.125, 0.25, 0.875, 0.0, 0.375, 0.75, 0.125, 0.5],
            &[0.01; 8],
        );
        // Keys (largest row mass): t0 0.375, t1 0.75, t2 0.875, t3 0.5 → order 0, 3, 1, 2.
        // t0: row budgets 0.875 / 0.625; t3: 0.875 / 0.125; t1 needs 0.75 of row 1: kept; t2
        // needs 0.875 of row 0 (left 0.875) and 0.125 of row 1 (left 0.125): skipped.
        assert_eq!(t.skips(1.0, 1.0), [true, false, true, true]);
    }

    #[test]
    fn an_entry_at_eps_keeps_its_tile_and_budgets_are_per_row() {
        let t = masses(2, 2, &[0.0, 0.0, 0.0, 0.0], &[0.0, 0.5, 0.0, 0.0]);
        assert_eq!(t.skips(0.5, 1.0), [true, false]);
        let t = masses(1, 3, &[0.3, 0.3, 0.3], &[0.1; 3]);
        assert_eq!(t.skips(1.0, 0.6), [true, true, false]);
        assert_eq!(t.skips(1.0, 0.0), [false; 3]);
    }

    #[test]
    fn skipped_mass_never_exceeds_the_budget() {
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
            let skip = t.skips(1e-3, delta);
            for r in 0..rows {
                let dropped: f64 = (0..tiles)
                    .filter(|&k| skip[k])
                    .map(|k| t.mass[r * tiles + k])
                    .sum();
                assert!(dropped <= delta * (1.0 + 1e-12), "row {r}: {dropped}");
            }
        }
    }
}
