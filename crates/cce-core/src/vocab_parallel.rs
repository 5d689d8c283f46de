//! Vocabulary-parallel linear cross-entropy: the math and the contract of a call whose
//! classifier `c` (and `bias`) is split by classes over the `k` ranks of a tensor-parallel
//! group, while `e` and the targets are replicated on every rank.
//!
//! This module holds what is pure: the shards and their validation ([`shard`]), the per-row
//! partials a shard computes and their wire format ([`partial`]), the merge of the partials
//! into the lse and the loss ([`merge`]), the split of the gradient filter's bound
//! ([`filter_split`]) and the [`Communicator`] trait the caller implements over its process
//! group ([`comm`]). The CPU shard computations, an in-process communicator and the driver
//! that runs a whole call on one rank are in `cce_reference::vocab_parallel`.
//!
//! # One call on rank `r`, shard `[v0, v1)` of `V` classes
//!
//! | step | what | collective |
//! |---|---|---|
//! | partial forward | per row: the shard's max logit, `Σ e^{z − max}` (all, and without the target), the target logit if owned, `Σ z`, `Σ e^{z − max} z`, argmax, masked flag ([`RowPartial`]) | |
//! | merge | all-gather the partials (`k × (7 + 8N)` f64), merge them in rank order ([`merge_forward`]): lse, `1 − p_y`, per-row and reduced loss, entropy, argmax, the same bits on every rank | all-gather f64 |
//! | shard backward | from the merged lse and `1 − p_y` (f32, as the unsharded backward saves them) and `d_loss`: `G` on the shard's classes; `d_c`, `d_bias` of the shard (final), `d_e` partial (f32) | |
//! | reduce | per-row dropped mass and a per-rank failure flag (`N + k` f64, sum); then `d_e` (`N × D` f32, sum) | 2 all-reduces |
//!
//! Sources: Megatron-LM's `VocabParallelCrossEntropy`
//! (`megatron/core/tensor_parallel/cross_entropy.py`: each rank holds a contiguous vocabulary
//! range, the loss needs the global max, the global `Σ exp` and the target logit from the rank
//! that owns it; `d_e` is summed over the group) and Apple's ml-cross-entropy
//! `VocabParallelOptions` (`start`, `stop`, the process group, and whether `d_e` is reduced
//! over the group). Both are facts cited, not code used.
//!
//! # Why one all-gather for the merge, not Megatron's all-reduces
//!
//! Megatron all-reduces the max, then the rescaled `Σ exp` and the target logit: two
//! collectives in sequence, and the sums in the collective's order (NCCL's depends on the
//! topology). Here every rank sends its whole partial and merges locally:
//!
//! - one collective instead of two (the forward is latency-bound: its payload is `O(N)`);
//! - the merge is a pure, tested function of the gathered bytes in rank order, so every rank
//!   gets bit-identical lse and loss, and a unit test needs no communicator;
//! - fields an all-reduce cannot combine travel with it: the argmax, the owner of the target,
//!   the masked flag, each rank's shard (so the tiling of the vocabulary is checked on every
//!   call), a digest of its targets (replicated inputs checked), and a failure flag (a rank
//!   whose input is bad still takes part in the collective, and every rank stops with a typed
//!   error instead of waiting for it);
//! - the cost: `k·(7 + 8N)·8` bytes received per rank, 8.4 MiB at `N = 32768`, `k = 4`; the
//!   `d_e` all-reduce of the backward moves `N·D·4` = 512 MiB at the seed shape
//!   (`D = 4096`), 60 times more.
//!
//! # Every option keeps its meaning
//!
//! - `ignore_index`, `shift`: resolved by [`crate::PreparedTargets`] on every rank before any
//!   class is compared with a shard; a row without a target is `-1` there, never a class.
//! - reductions: `Mean` divides by the valid rows of the whole batch (every rank counts the
//!   same replicated targets); the backward scales `d_loss` the same way on every shard.
//! - `bias`: each shard adds its own entries; `d_bias` of the shard is final (no collective).
//! - softcap: applied per logit, the derivative per entry, on each shard.
//! - z-loss: `λ lse²` from the merged lse; the backward's `(1 + 2λ lse) p` uses it.
//! - label smoothing: `Σ_j z_ij` over the real classes is a plain sum of the shards' sums; the
//!   backward's `−α g / V` (rank-1) puts `−(α g_i / V) Σ_{j ∈ shard} c_j` in each shard's
//!   partial `d_e`, which the all-reduce completes, and `−(α / V) Σ_i g_i e_i` on each real
//!   class row of `d_c`.
//! - filtering: each shard filters its own classes with its share of the per-row bound,
//!   `δ_r = δ · (real classes of r) / V` ([`filter_split`]), so the total a row drops stays
//!   within `max_dropped_mass`; the driver sums the per-row dropped mass over the shards and
//!   reports it beside each shard's own statistics.
//! - side outputs (entropy, argmax) and `check_finite`: from the merge.
//!
//! # Padded vocabularies
//!
//! A layout may end past `V` ([`ShardLayout::padded`]). Padding classes are never computed:
//! the shard's logits cover `[v0, min(v1, V))` only, the padding rows of `c` and entries of
//! `bias` are not read (they may hold anything, NaN included), their `d_c` rows and `d_bias`
//! entries are exactly 0, and targets are checked against `V`: a target in the padding is
//! `TargetOutOfRange`, and `ignore_index` (or any value meaning "no target") is resolved
//! before, so it can never match a padding column. (Apple's ml-cross-entropy open PR #59
//! reports an infinite loss when an ignored target meets padding.)

pub mod comm;
pub mod error;
pub mod filter_split;
pub mod merge;
pub mod over_backend;
pub mod partial;
pub mod primitives;
pub mod shard;

pub use comm::{Communicator, ReduceOp};
pub use error::VocabParallelError;
pub use filter_split::{shard_filter_rule, split_dropped_mass};
pub use merge::{merge_forward, MergedForward, MergedRow, RankPartial};
pub use over_backend::{BackendShard, ShardRows};
pub use partial::{PartialHeader, RowPartial};
pub use primitives::{ShardBackward, ShardForward, ShardPrimitives};
pub use shard::{check_tiling, shard_problem, ShardLayout, VocabShard};
