//! How the per-row dropped-mass bound `δ` of the gradient filter ([`crate::filter`]) is split
//! between shards.
//!
//! Each shard filters its own classes on its own, with the bound
//! `δ_r = δ · |real classes of r| / V`, rounded down to an f32: the shards' bounds sum to at
//! most `δ`, so the total probability a row drops over all shards stays within the unsharded
//! bound, with no collective in the backward before the gradients are formed. A shard of
//! padding only gets `δ_r = 0` (nothing to drop). The cost against the unsharded filter: a row
//! whose tail lies mostly in one shard may drop less there (its bound is that shard's share),
//! so a sharded call skips at most as much and is at least as accurate. The alternative,
//! summing the per-row histograms of all shards (an all-reduce of `N × 65` values) to get the
//! unsharded thresholds exactly, needs a collective between the threshold pass and the
//! gradient passes of every row chunk; it is not done.
//!
//! `filter_eps` is not split: an entry may be skipped only when `|p − onehot| < filter_eps`,
//! whatever shard holds it.

use super::shard::VocabShard;
use crate::dtype::DType;
use crate::filter::FilterRule;
use crate::options::Options;

/// The shard's share of the per-row bound `delta`: the largest f32 not above
/// `delta · real / V` (exact real arithmetic), so that the shares of a layout sum to at most
/// `delta`. `real`: the shard's real classes; `vocab_size`: `V` (`> 0`).
pub fn split_dropped_mass(delta: f32, real: usize, vocab_size: usize) -> f32 {
    if vocab_size == 0 || real == 0 || delta <= 0.0 || delta.is_nan() {
        return 0.0;
    }
    if real >= vocab_size {
        return delta;
    }
    // The f64 product and quotient err by at most 2⁻⁵² each; shrinking by 2⁻⁵⁰ first keeps the
    // value at or below the exact share, then rounding to f32 downwards keeps it there.
    let share = delta as f64 * real as f64 / vocab_size as f64 * (1.0 - 2f64.powi(-50));
    let down = share as f32;
    if down as f64 > share {
        down.next_down()
    } else {
        down
    }
}

/// The filter rule of one shard: [`FilterRule::resolve`] with `max_dropped_mass` replaced by
/// the shard's share ([`split_dropped_mass`]). Disabled on a shard whose share is 0.
pub fn shard_filter_rule(opts: &Options, dtype: DType, shard: &VocabShard) -> FilterRule {
    let share = split_dropped_mass(opts.max_dropped_mass, shard.real_len(), shard.vocab_size());
    let local = Options {
        max_dropped_mass: share,
        ..opts.clone()
    };
    FilterRule::resolve(&local, dtype)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab_parallel::ShardLayout;

    #[test]
    fn shares_sum_to_at_most_the_bound() {
        for delta in [1e-3f32, 3e-3, 0.1, 1.0, 1e-30, f32::MIN_POSITIVE] {
            for v in [1usize, 2, 3, 7, 10, 507, 49152, 262_147] {
                for k in 1..=5usize {
                    let layout = ShardLayout::padded(v, k, 1).unwrap();
                    let shares: Vec<f32> = layout
                        .shards()
                        .iter()
                        .map(|s| split_dropped_mass(delta, s.real_len(), v))
                        .collect();
                    let total: f64 = shares.iter().map(|&x| x as f64).sum();
                    assert!(total <= delta as f64, "delta {delta} v {v} k {k}: {total}");
                    // Nothing is lost but rounding: within k f32 ulps of the bound.
                    assert!(
                        total >= delta as f64 * (1.0 - 1e-6 * k as f64) || delta < 1e-37,
                        "delta {delta} v {v} k {k}: {total}"
                    );
                }
            }
        }
        assert_eq!(split_dropped_mass(1e-3, 0, 10), 0.0);
        assert_eq!(split_dropped_mass(1e-3, 10, 10), 1e-3);
        assert_eq!(split_dropped_mass(0.0, 3, 10), 0.0);
    }

    #[test]
    fn a_padding_shard_filters_nothing() {
        let layout = ShardLayout::padded(5, 4, 4).unwrap();
        let opts = Options::default();
        let rule = shard_filter_rule(&opts, DType::BF16, &layout.shard(3).unwrap());
        assert!(!rule.enabled);
        let rule = shard_filter_rule(&opts, DType::BF16, &layout.shard(0).unwrap());
        assert!(rule.enabled);
        assert_eq!(rule.eps, 2f32.powi(-12));
        assert!(rule.max_dropped_mass <= 1e-3 * 4.0 / 5.0);
    }
}
