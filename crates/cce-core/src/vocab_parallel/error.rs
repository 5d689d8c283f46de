//! The errors of a vocabulary-parallel call that a single-device call cannot have: shards that
//! do not tile the vocabulary, ranks that disagree, and peers that failed or left.

/// What went wrong between the shards or ranks of a vocabulary-parallel call. Carried by
/// [`crate::CceError::VocabParallel`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum VocabParallelError {
    /// A layout of zero shards (or a communicator of zero ranks).
    #[error("no shards: a vocabulary of {vocab_size} classes needs at least one shard")]
    NoShards {
        /// `V`.
        vocab_size: usize,
    },
    /// A shard `[start, end)` with `start >= end`: every shard holds at least one class (a
    /// padding class counts).
    #[error("shard {shard} is empty: [{start}, {end})")]
    EmptyShard {
        /// Index of the shard (its rank).
        shard: usize,
        /// First class.
        start: usize,
        /// One past the last class.
        end: usize,
    },
    /// A shard starts after the previous one ends (or the first one after class 0): the
    /// classes in between belong to no shard.
    #[error("gap before shard {shard}: it starts at class {start}, expected {expected_start}")]
    Gap {
        /// Index of the shard.
        shard: usize,
        /// Where it should start (the previous shard's end, 0 for the first).
        expected_start: usize,
        /// Where it starts.
        start: usize,
    },
    /// A shard starts inside the previous one: the classes in between belong to two shards.
    #[error("shard {shard} overlaps shard {}: it starts at class {start}, before {previous_end}", shard - 1)]
    Overlap {
        /// Index of the shard.
        shard: usize,
        /// End of the previous shard.
        previous_end: usize,
        /// Where it starts.
        start: usize,
    },
    /// A shard starts before the previous one: shards must be listed (and ranked) in class
    /// order.
    #[error("shard {shard} is out of order: it starts at class {start}, before shard {}'s start {previous_start}", shard - 1)]
    OutOfOrder {
        /// Index of the shard.
        shard: usize,
        /// Start of the previous shard.
        previous_start: usize,
        /// Where it starts.
        start: usize,
    },
    /// The last shard ends before `V`: the classes after it belong to no shard.
    #[error("the shards cover classes [0, {covered_end}) of a vocabulary of {vocab_size}")]
    DoesNotCover {
        /// `V`.
        vocab_size: usize,
        /// End of the last shard.
        covered_end: usize,
    },
    /// Ranks disagree on the vocabulary size `V`.
    #[error("shard {shard} was built for a vocabulary of {got} classes, shard 0 for {expected}")]
    VocabSizeMismatch {
        /// Index of the disagreeing shard.
        shard: usize,
        /// `V` of shard 0.
        expected: usize,
        /// Its `V`.
        got: usize,
    },
    /// The layout has a different number of shards than the communicator has ranks.
    #[error("{shards} shards for a communicator of {ranks} ranks")]
    RankCount {
        /// Ranks of the communicator.
        ranks: usize,
        /// Shards of the layout.
        shards: usize,
    },
    /// A rank index past the layout.
    #[error("rank {rank} of a layout of {ranks} shards")]
    RankOutOfRange {
        /// The rank asked for.
        rank: usize,
        /// Shards of the layout.
        ranks: usize,
    },
    /// An input every rank must hold identically (`e`'s row count, the targets) differs
    /// between ranks: `what` names it.
    #[error("rank {rank} disagrees with rank 0 on {what}: the replicated inputs differ")]
    ReplicaMismatch {
        /// The rank that differs from rank 0.
        rank: usize,
        /// Which input (`rows N`, `targets`, `valid rows`).
        what: &'static str,
    },
    /// Another rank failed this step (its own error is returned there); this rank's work was
    /// valid. `ranks` lists the failing ranks.
    #[error("rank(s) {ranks:?} failed; this rank stopped with them")]
    PeerFailed {
        /// The ranks that reported a failure, in order.
        ranks: Vec<usize>,
    },
    /// A rank left the group (dropped its communicator) while others still expected it in a
    /// collective.
    #[error("rank {rank} left the group during a collective")]
    PeerLost {
        /// The rank that left.
        rank: usize,
    },
    /// Ranks called different collectives, or the same one with different lengths.
    #[error("collective mismatch: {what}")]
    CollectiveMismatch {
        /// What differed.
        what: String,
    },
}
