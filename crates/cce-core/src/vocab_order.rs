//! The vocabulary order of a filtered backward: classes sorted by their batch-mean logit, so
//! that the classes a batch's rows keep share class tiles and whole tiles can be skipped.
//!
//! A backward that skips whole tiles (CCE's rule, [`crate::filter`]) keeps a tile when any of
//! its rows keeps any of its entries. Real rows keep the same few hundred likely classes, spread
//! over the vocabulary in token-id order, so in that order nearly every tile holds one: on the
//! shipped SmolLM2 rows (V = 49152, 1024 rows) 94% of 64-row x 256-class tiles hold an entry
//! with `p ≥ 2⁻¹²`, 57% once the classes are sorted by their mean logit over the batch (data
//! README; docs/perf-log.md, session 22). The mean logit needs no pass over the logits: it is
//! linear, `z̄_j = ē · c_j + b_j` with `ē` the mean of the valid rows of `e`, one `V x D`
//! product by a vector. Under softcap the cap is monotone, so the same order serves.
//!
//! What a backend does with the order: it visits class tile `t` as the classes
//! `perm[t·T .. (t+1)·T]`, maps each row's target into that order, and writes `d_c` / `d_bias`
//! row `perm[k]` from its `k`-th visited class. Everything else (thresholds, dropped mass, the
//! filter's bound `δ` per row) is unchanged: the order only decides which entries share a tile.

use crate::filter::FilterRule;

/// A permutation of the classes `0..V`: `perm()[k]` is the class visited `k`-th.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VocabOrder {
    perm: Vec<u32>,
}

impl VocabOrder {
    /// Classes by descending `score` (the batch-mean logit), ties and equal scores by ascending
    /// class id; NaN scores count as `−∞`, so NaN and masked (`−∞` bias) classes come last.
    /// `scores`: `[V]`, `V ≤ u32::MAX` (the backends' class index width; longer inputs are cut
    /// there by the caller's shape checks before this is reached).
    pub fn by_score(scores: &[f32]) -> Self {
        let key = |x: f32| if x.is_nan() { f32::NEG_INFINITY } else { x };
        let mut perm: Vec<u32> = (0..scores.len() as u32).collect();
        perm.sort_by(|&a, &b| {
            key(scores[b as usize])
                .total_cmp(&key(scores[a as usize]))
                .then(a.cmp(&b))
        });
        Self { perm }
    }

    /// `[V]`: the class visited `k`-th is `perm()[k]`.
    pub fn perm(&self) -> &[u32] {
        &self.perm
    }

    /// `[V]`: the visiting position of class `j` (the inverse permutation).
    pub fn inverse(&self) -> Vec<u32> {
        let mut inv = vec![0u32; self.perm.len()];
        for (k, &j) in self.perm.iter().enumerate() {
            inv[j as usize] = k as u32;
        }
        inv
    }

    /// Bytes a backend holding a reordered `f32` copy of `c` (`V x D`), of the bias and of the
    /// permutation needs: what [`takes_order`] counts against the budget.
    pub fn copy_bytes(v: usize, d: usize, bias: bool) -> u64 {
        let v = v as u64;
        v * d as u64 * 4 + if bias { v * 4 } else { 0 } + v * 4
    }
}

/// The facts [`takes_order`] decides from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OrderFacts {
    /// The call's filter ([`FilterRule::resolve`]).
    pub rule: FilterRule,
    /// Classes `V`.
    pub v: usize,
    /// Classes per tile of the backward's skip decisions.
    pub tile_classes: usize,
    /// Bytes the order costs the backend ([`VocabOrder::copy_bytes`] or its own figure).
    pub order_bytes: u64,
    /// The plan's workspace, bytes.
    pub plan_bytes: u64,
    /// The call's workspace budget, bytes.
    pub budget_bytes: u64,
}

/// Whether a backward that skips whole tiles visits the classes in the batch-mean-logit order:
/// only when the filter is on (an exact call visits every tile anyway, and keeps its bits),
/// when there is more than one class tile to sort between, and when the order's copy fits in
/// the budget beside the plan's workspace.
pub fn takes_order(f: OrderFacts) -> bool {
    f.rule.enabled
        && f.tile_classes > 0
        && f.v > f.tile_classes
        && f.plan_bytes.saturating_add(f.order_bytes) <= f.budget_bytes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::options::{FilterEps, Options};
    use crate::DType;

    #[test]
    fn by_score_sorts_descending_with_nan_and_masked_last_and_ties_by_id() {
        let s = [
            1.0,
            f32::NAN,
            3.0,
            f32::NEG_INFINITY,
            3.0,
            -2.0,
            f32::INFINITY,
        ];
        let o = VocabOrder::by_score(&s);
        assert_eq!(o.perm(), &[6, 2, 4, 0, 5, 1, 3]);
        let inv = o.inverse();
        for (k, &j) in o.perm().iter().enumerate() {
            assert_eq!(inv[j as usize] as usize, k);
        }
    }

    #[test]
    fn by_score_of_nothing_is_empty() {
        assert!(VocabOrder::by_score(&[]).perm().is_empty());
    }

    #[test]
    fn by_score_is_a_permutation_for_random_scores() {
        let mut x = 0x9e37_79b9u32;
        for v in [1usize, 2, 7, 255, 256, 257, 1000] {
            let s: Vec<f32> = (0..v)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    (x % 64) as f32 - 32.0
                })
                .collect();
            let o = VocabOrder::by_score(&s);
            let mut seen = vec![false; v];
            for &j in o.perm() {
                assert!(!seen[j as usize]);
                seen[j as usize] = true;
            }
            for w in o.perm().windows(2) {
                let (a, b) = (s[w[0] as usize], s[w[1] as usize]);
                assert!(a > b || (a == b && w[0] < w[1]));
            }
        }
    }

    fn facts(filter: FilterEps) -> OrderFacts {
        let opts = Options {
            filter_eps: filter,
            ..Options::default()
        };
        OrderFacts {
            rule: FilterRule::resolve(&opts, DType::BF16),
            v: 1024,
            tile_classes: 256,
            order_bytes: VocabOrder::copy_bytes(1024, 64, false),
            plan_bytes: 1 << 20,
            budget_bytes: 1 << 29,
        }
    }

    #[test]
    fn order_only_for_filtered_calls_with_tiles_to_sort_within_the_budget() {
        assert!(takes_order(facts(FilterEps::Auto)));
        assert!(!takes_order(facts(FilterEps::Off)));
        let one_tile = OrderFacts {
            v: 256,
            ..facts(FilterEps::Auto)
        };
        assert!(!takes_order(one_tile));
        let tight = facts(FilterEps::Auto);
        let tight = OrderFacts {
            budget_bytes: tight.plan_bytes + tight.order_bytes - 1,
            ..tight
        };
        assert!(!takes_order(tight));
        assert_eq!(VocabOrder::copy_bytes(10, 3, true), 10 * 3 * 4 + 40 + 40);
    }
}
