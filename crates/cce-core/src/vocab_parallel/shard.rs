//! Vocabulary shards: which classes a rank holds, and the validation that the shards of all
//! ranks tile the vocabulary.
//!
//! A vocabulary of `V` classes is split into `k` contiguous shards `[v0, v1)` in rank order
//! (rank `r` holds rows `v0..v1` of `c` and the same entries of `bias`). The last shards may
//! end past `V` (a *padded* vocabulary, as Megatron-LM pads `V` to a multiple of
//! `make_vocab_size_divisible_by × tensor-parallel size`): classes `V..v1` are padding. A padding
//! class is never computed: it is not a target, never matches `ignore_index` or any other
//! sentinel (those are resolved before a class is compared with a shard), adds nothing to the
//! log-sum-exp, and gets a zero gradient.

use super::error::VocabParallelError;
use crate::backend::Inputs;
use crate::error::{CceError, Result};
use crate::options::Options;
use crate::problem::{check_index_limits, Problem};
use crate::tensor::TensorMeta;
use std::ops::Range;

/// The classes `[start, end)` one rank holds, of a vocabulary of `vocab_size` real classes.
/// Classes at and past `vocab_size` are padding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct VocabShard {
    vocab_size: usize,
    start: usize,
    end: usize,
}

impl VocabShard {
    /// Shard `[start, end)` of a vocabulary of `vocab_size` classes, as rank `shard` of its
    /// layout (the index is only used in the error).
    ///
    /// Errors: `EmptyInput` for `vocab_size == 0`; `VocabParallel(EmptyShard)` for
    /// `start >= end`. A shard wholly past `vocab_size` (all padding) is valid.
    pub fn new(vocab_size: usize, start: usize, end: usize) -> Result<Self> {
        Self::at(0, vocab_size, start, end)
    }

    fn at(shard: usize, vocab_size: usize, start: usize, end: usize) -> Result<Self> {
        if vocab_size == 0 {
            return Err(CceError::EmptyInput {
                what: "vocabulary (vocab_size)",
                shape: vec![0],
            });
        }
        if start >= end {
            return Err(VocabParallelError::EmptyShard { shard, start, end }.into());
        }
        Ok(Self {
            vocab_size,
            start,
            end,
        })
    }

    /// `V`, the real classes of the whole vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// First class of the shard.
    pub fn start(&self) -> usize {
        self.start
    }

    /// One past the last class of the shard (may exceed `V`: padding).
    pub fn end(&self) -> usize {
        self.end
    }

    /// Classes of the shard, padding included: the rows of its `c` and entries of its `bias`.
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    /// Always false: a shard holds at least one class.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The shard's real classes, global indices: `[start, min(end, V))` (empty for a shard of
    /// padding only).
    pub fn real_classes(&self) -> Range<usize> {
        let end = self.end.min(self.vocab_size);
        self.start.min(end)..end
    }

    /// Count of real classes.
    pub fn real_len(&self) -> usize {
        self.real_classes().len()
    }

    /// Count of padding classes (`end − max(start, V)`, 0 when `end ≤ V`).
    pub fn padding_len(&self) -> usize {
        self.len() - self.real_len()
    }

    /// The local index (row of the shard's `c`) of a prepared target class, when this shard
    /// owns it. `class` is a [`crate::PreparedTargets`] class: in `[0, V)`, or `-1` for a row
    /// without a target (ignored, or dropped by the shift). Only a real class matches, so no
    /// sentinel reaches a padding class.
    pub fn local_target(&self, class: i32) -> Option<usize> {
        let class = usize::try_from(class).ok()?;
        self.real_classes()
            .contains(&class)
            .then(|| class - self.start)
    }
}

/// The shards of every rank, validated to tile `[0, V)` in rank order (padding allowed after
/// `V`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardLayout {
    shards: Vec<VocabShard>,
}

impl ShardLayout {
    /// The layout of explicit class ranges, rank `r` holding `ranges[r]`.
    ///
    /// Errors: `EmptyInput` for `vocab_size == 0`; `VocabParallel` with `NoShards` (no range),
    /// `EmptyShard`, `OutOfOrder` (a range starts before the previous one), `Overlap` (inside
    /// the previous one), `Gap` (after its end, or the first after 0), `DoesNotCover` (the last
    /// ends before `V`).
    pub fn new(vocab_size: usize, ranges: &[Range<usize>]) -> Result<Self> {
        let shards = ranges
            .iter()
            .enumerate()
            .map(|(r, x)| VocabShard::at(r, vocab_size, x.start, x.end))
            .collect::<Result<Vec<_>>>()?;
        Self::from_shards(vocab_size, shards)
    }

    /// The layout of shards built elsewhere (e.g. gathered from the ranks), with the checks of
    /// [`ShardLayout::new`] plus `VocabSizeMismatch` when a shard was built for another `V`.
    pub fn from_shards(vocab_size: usize, shards: Vec<VocabShard>) -> Result<Self> {
        if vocab_size == 0 {
            return Err(CceError::EmptyInput {
                what: "vocabulary (vocab_size)",
                shape: vec![0],
            });
        }
        check_tiling(vocab_size, &shards)?;
        Ok(Self { shards })
    }

    /// `ranks` shards without padding, sizes differing by at most one (the first `V mod k`
    /// shards hold one class more).
    ///
    /// Errors: `VocabParallel(NoShards)` for `ranks == 0`, `VocabParallel(EmptyShard)` when
    /// `ranks > V` (use [`ShardLayout::padded`]).
    pub fn even(vocab_size: usize, ranks: usize) -> Result<Self> {
        if ranks == 0 {
            return Err(VocabParallelError::NoShards { vocab_size }.into());
        }
        let (q, extra) = (vocab_size / ranks, vocab_size % ranks);
        let mut start = 0;
        let ranges: Vec<Range<usize>> = (0..ranks)
            .map(|r| {
                let len = q + usize::from(r < extra);
                let range = start..start + len;
                start += len;
                range
            })
            .collect();
        Self::new(vocab_size, &ranges)
    }

    /// `ranks` equal shards of the vocabulary padded to a multiple of `ranks × multiple`
    /// (Megatron-LM's `make_vocab_size_divisible_by`; `multiple = 1` pads only to a multiple
    /// of `ranks`). The last shards hold the padding; a shard may be padding only when `V` is
    /// small.
    ///
    /// Errors: `VocabParallel(NoShards)` for `ranks == 0`, `InvalidOption` for
    /// `multiple == 0`, `ResourceLimit` if the padded size overflows, `EmptyInput` for
    /// `vocab_size == 0`.
    pub fn padded(vocab_size: usize, ranks: usize, multiple: usize) -> Result<Self> {
        if ranks == 0 {
            return Err(VocabParallelError::NoShards { vocab_size }.into());
        }
        if multiple == 0 {
            return Err(CceError::InvalidOption {
                name: "multiple",
                reason: "the padding multiple must be at least 1".into(),
            });
        }
        let overflow = || CceError::ResourceLimit {
            resource: format!(
                "padded vocabulary ({vocab_size} to a multiple of {ranks} x {multiple})"
            ),
            requested: u64::MAX,
            max: usize::MAX as u64,
        };
        let step = ranks.checked_mul(multiple).ok_or_else(overflow)?;
        let padded = vocab_size
            .div_ceil(step)
            .checked_mul(step)
            .ok_or_else(overflow)?;
        let per = padded / ranks;
        let ranges: Vec<Range<usize>> = (0..ranks).map(|r| r * per..(r + 1) * per).collect();
        Self::new(vocab_size, &ranges)
    }

    /// The shards, in rank order.
    pub fn shards(&self) -> &[VocabShard] {
        &self.shards
    }

    /// Number of shards (ranks).
    pub fn len(&self) -> usize {
        self.shards.len()
    }

    /// Always false: a layout holds at least one shard.
    pub fn is_empty(&self) -> bool {
        self.shards.is_empty()
    }

    /// `V`.
    pub fn vocab_size(&self) -> usize {
        self.shards[0].vocab_size
    }

    /// The padded vocabulary size: the end of the last shard (`≥ V`).
    pub fn padded_vocab_size(&self) -> usize {
        self.shards[self.shards.len() - 1].end
    }

    /// The shard of `rank`. Errors: `VocabParallel(RankOutOfRange)`.
    pub fn shard(&self, rank: usize) -> Result<VocabShard> {
        self.shards.get(rank).copied().ok_or_else(|| {
            VocabParallelError::RankOutOfRange {
                rank,
                ranks: self.shards.len(),
            }
            .into()
        })
    }
}

/// Whether `shards` tile `[0, vocab_size)` in order (padding after `vocab_size` allowed): the
/// one rule of [`ShardLayout::new`], [`ShardLayout::from_shards`] and the merge of gathered
/// partials.
pub fn check_tiling(vocab_size: usize, shards: &[VocabShard]) -> Result<()> {
    let err = |e: VocabParallelError| Err(e.into());
    let Some(first) = shards.first() else {
        return err(VocabParallelError::NoShards { vocab_size });
    };
    for (shard, s) in shards.iter().enumerate() {
        if s.vocab_size != vocab_size {
            return err(VocabParallelError::VocabSizeMismatch {
                shard,
                expected: vocab_size,
                got: s.vocab_size,
            });
        }
    }
    // Order and overlaps first: a permuted layout is reported as out of order, not as a gap.
    for (i, pair) in shards.windows(2).enumerate() {
        let (prev, s) = (pair[0], pair[1]);
        let shard = i + 1;
        if s.start < prev.start {
            return err(VocabParallelError::OutOfOrder {
                shard,
                previous_start: prev.start,
                start: s.start,
            });
        }
        if s.start < prev.end {
            return err(VocabParallelError::Overlap {
                shard,
                previous_end: prev.end,
                start: s.start,
            });
        }
    }
    if first.start != 0 {
        return err(VocabParallelError::Gap {
            shard: 0,
            expected_start: 0,
            start: first.start,
        });
    }
    for (i, pair) in shards.windows(2).enumerate() {
        let (prev, s) = (pair[0], pair[1]);
        let shard = i + 1;
        if s.start > prev.end {
            return err(VocabParallelError::Gap {
                shard,
                expected_start: prev.end,
                start: s.start,
            });
        }
    }
    let covered_end = shards[shards.len() - 1].end;
    if covered_end < vocab_size {
        return err(VocabParallelError::DoesNotCover {
            vocab_size,
            covered_end,
        });
    }
    Ok(())
}

/// The problem of one shard's call, checked: `c` holds the shard's `len` rows (padding
/// included), the shapes and options pass [`Problem::new`], `N` and the padded vocabulary fit
/// 32-bit indices; `v` is then the whole vocabulary's real classes (`shard.vocab_size()`), so
/// targets are judged against all of it. `e` `[N, D]` (or `[..., T, D]`) and `targets` `[N]`
/// are the whole batch's; `bias` `[len]` the shard's.
///
/// Errors: `ShapeMismatch` when `c` does not have the shard's rows (checked first: a `c` of the
/// wrong rows would otherwise be reported as a bias that does not fit it); those of
/// [`Problem::new`]; `ResourceLimit` past 32-bit indices.
pub fn shard_problem<T: TensorMeta>(
    inputs: &Inputs<'_, T>,
    shard: &VocabShard,
    opts: &Options,
) -> Result<Problem> {
    let cs = inputs.c.shape();
    if cs.len() == 2 && cs[0] != shard.len() {
        return Err(CceError::ShapeMismatch {
            what: "c (rows of the shard)",
            expected: format!(
                "[{}, {}] (shard [{}, {}))",
                shard.len(),
                cs[1],
                shard.start(),
                shard.end()
            ),
            got: format!("{cs:?}"),
        });
    }
    let local = inputs.problem(opts)?;
    check_index_limits(local.n, shard.end())?;
    Ok(Problem {
        v: shard.vocab_size(),
        ..local
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fault(r: Result<ShardLayout>) -> VocabParallelError {
        match r {
            Err(CceError::VocabParallel(e)) => e,
            other => panic!("expected a VocabParallel error, got {other:?}"),
        }
    }

    #[test]
    fn even_layouts_tile_without_padding() {
        for v in 1..40 {
            for k in 1..=v.min(6) {
                let l = ShardLayout::even(v, k).unwrap();
                assert_eq!(l.len(), k);
                assert_eq!(l.padded_vocab_size(), v);
                let lens: Vec<usize> = l.shards().iter().map(|s| s.len()).collect();
                assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1);
                assert_eq!(lens.iter().sum::<usize>(), v);
            }
        }
        assert!(matches!(
            fault(ShardLayout::even(3, 4)),
            VocabParallelError::EmptyShard { shard: 3, .. }
        ));
        assert!(matches!(
            fault(ShardLayout::even(3, 0)),
            VocabParallelError::NoShards { vocab_size: 3 }
        ));
    }

    #[test]
    fn padded_layouts_put_the_padding_last() {
        let l = ShardLayout::padded(10, 4, 1).unwrap();
        let ranges: Vec<_> = l.shards().iter().map(|s| s.start()..s.end()).collect();
        assert_eq!(ranges, vec![0..3, 3..6, 6..9, 9..12]);
        assert_eq!(l.shard(3).unwrap().real_classes(), 9..10);
        assert_eq!(l.shard(3).unwrap().padding_len(), 2);
        // A small vocabulary: the last shards are padding only.
        let l = ShardLayout::padded(5, 4, 4).unwrap();
        assert_eq!(l.padded_vocab_size(), 16);
        let s = l.shard(3).unwrap();
        assert_eq!((s.real_len(), s.padding_len()), (0, 4));
        assert!(s.real_classes().is_empty());
        assert_eq!(s.local_target(4), None);
        assert!(matches!(
            ShardLayout::padded(5, 4, 0),
            Err(CceError::InvalidOption { .. })
        ));
        assert!(matches!(
            ShardLayout::padded(5, usize::MAX, 2),
            Err(CceError::ResourceLimit { .. })
        ));
    }

    #[test]
    fn local_targets_never_reach_padding_or_sentinels() {
        let s = VocabShard::new(10, 8, 12).unwrap();
        assert_eq!(s.local_target(8), Some(0));
        assert_eq!(s.local_target(9), Some(1));
        for class in [-1, -100, 7, 10, 11, 12, i32::MAX, i32::MIN] {
            assert_eq!(s.local_target(class), None, "class {class}");
        }
    }

    #[test]
    fn bad_layouts_are_typed_errors() {
        let v = 10;
        assert!(matches!(
            fault(ShardLayout::new(v, &[])),
            VocabParallelError::NoShards { vocab_size: 10 }
        ));
        assert!(matches!(
            fault(ShardLayout::new(v, &[0..5, 5..5, 5..10])),
            VocabParallelError::EmptyShard {
                shard: 1,
                start: 5,
                end: 5
            }
        ));
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = [0..5, 7..5];
        assert!(matches!(
            fault(ShardLayout::new(v, &reversed)),
            VocabParallelError::EmptyShard { shard: 1, .. }
        ));
        assert!(matches!(
            fault(ShardLayout::new(v, &[1..5, 5..10])),
            VocabParallelError::Gap {
                shard: 0,
                expected_start: 0,
                start: 1
            }
        ));
        assert!(matches!(
            fault(ShardLayout::new(v, &[0..5, 6..10])),
            VocabParallelError::Gap {
                shard: 1,
                expected_start: 5,
                start: 6
            }
        ));
        assert!(matches!(
            fault(ShardLayout::new(v, &[0..6, 4..10])),
            VocabParallelError::Overlap {
                shard: 1,
                previous_end: 6,
                start: 4
            }
        ));
        assert!(matches!(
            fault(ShardLayout::new(v, &[0..5, 5..10, 2..4])),
            VocabParallelError::OutOfOrder {
                shard: 2,
                previous_start: 5,
                start: 2
            }
        ));
        assert!(matches!(
            fault(ShardLayout::new(v, &[0..5, 5..9])),
            VocabParallelError::DoesNotCover {
                vocab_size: 10,
                covered_end: 9
            }
        ));
        let mixed = vec![
            VocabShard::new(10, 0, 5).unwrap(),
            VocabShard::new(11, 5, 11).unwrap(),
        ];
        assert!(matches!(
            fault(ShardLayout::from_shards(10, mixed)),
            VocabParallelError::VocabSizeMismatch {
                shard: 1,
                expected: 10,
                got: 11
            }
        ));
        assert!(matches!(
            ShardLayout::new(0, &[0..1, 1..2]),
            Err(CceError::EmptyInput { .. })
        ));
        let l = ShardLayout::new(v, &[0..5, 5..12]).unwrap();
        assert!(matches!(
            l.shard(2),
            Err(CceError::VocabParallel(
                VocabParallelError::RankOutOfRange { rank: 2, ranks: 2 }
            ))
        ));
    }
}
