//! Vocabulary-parallel linear cross-entropy on the CPU: the primitives of one shard, an
//! in-process communicator, and the driver of one rank (the math and the contract:
//! [`cce_core::vocab_parallel`]).
//!
//! - [`CpuShard::forward`]: the partial forward of a shard `[v0, v1)` (per row the shard's
//!   max, `Σ exp`, target logit, ... as [`cce_core::vocab_parallel::RowPartial`]);
//! - [`cce_core::vocab_parallel::merge_forward`]: the merge (pure, in cce-core);
//! - [`CpuShard::backward`]: `d_c` and `d_bias` of the shard and its partial `d_e` (f32), from
//!   the merged lse and `1 − p_y`;
//! - [`ThreadComm`]: a [`cce_core::vocab_parallel::Communicator`] over threads;
//! - [`RankDriver`]: the whole call on one rank over any communicator;
//! - [`SimulatedVocabParallel`]: `k` ranks over threads behind the [`cce_core::Backend`]
//!   trait (the conformance suite runs on it).
//!
//! A caller that owns its collectives uses the first three and its own process group; one
//! that has a [`cce_core::vocab_parallel::Communicator`] uses [`RankDriver`].
//!
//! Arithmetic: as the unsharded [`crate::CpuBackend`] (logits in f32, f64 under softcap;
//! online sums in f64; `G` and the gradients in f32), on tiles of [`CpuShard::tile`]
//! (recomputed in each pass, no `N × V` buffer). Only the shard's real classes are computed.

mod backward;
mod driver;
mod entry;
mod forward;
mod inputs;
mod simulated;
mod thread_comm;

pub use backward::ShardBackward;
pub use driver::{RankBackward, RankDriver, RankForward};
pub use forward::ShardForward;
pub use simulated::{SimulatedLayout, SimulatedVocabParallel};
pub use thread_comm::ThreadComm;

use cce_core::plan::{DeviceLimits, TileShape};

/// The CPU primitives of one vocabulary shard, with the logits tile they work on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuShard {
    tile: TileShape,
}

impl Default for CpuShard {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuShard {
    /// Tiles of [`DeviceLimits::cpu`] (64 rows x 256 classes).
    pub fn new() -> Self {
        Self {
            tile: DeviceLimits::cpu().tile,
        }
    }

    /// Tiles of `tile.rows` x `tile.classes` (the filter skips whole tiles, so this sets its
    /// granularity; `depth` is unused).
    pub fn with_tile(tile: TileShape) -> Self {
        Self { tile }
    }

    /// The tile shape.
    pub fn tile(&self) -> TileShape {
        self.tile
    }
}
