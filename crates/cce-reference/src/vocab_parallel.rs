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
//! The backward needs the merged `1 − p_y` beside the lse (as the unsharded backward does): a
//! confident row's target gradient `g (p_y − 1)` cannot be formed from an f32 lse, and only the
//! shard that owns the target sees `z_y`.
//!
//! # Example: three ranks as threads
//!
//! ```
//! use cce_core::vocab_parallel::{Communicator, ShardLayout};
//! use cce_core::{DType, HostTensor, Inputs, Options, Upstream};
//! use cce_reference::vocab_parallel::{RankDriver, ThreadComm};
//!
//! let (n, d, v) = (4, 8, 10);
//! let e = HostTensor::from_f32(vec![n, d], &vec![0.1; n * d], DType::F32)?;
//! let c: Vec<f32> = (0..v * d).map(|k| (k % 7) as f32 * 0.05).collect();
//! let targets = HostTensor::from_i64(vec![1, 9, -100, 4]);
//! // V = 10 over 3 ranks, padded to 12: rank 2 holds classes 8, 9 and two padding rows.
//! let layout = ShardLayout::padded(v, 3, 4)?;
//! let losses = ThreadComm::run(3, |comm| -> cce_core::Result<f32> {
//!     let shard = layout.shard(comm.rank())?;
//!     let real = shard.real_classes();
//!     let mut rows = c[real.start * d..real.end * d].to_vec();
//!     rows.resize(shard.len() * d, 0.0); // padding rows: never read
//!     let c_shard = HostTensor::from_f32(vec![shard.len(), d], &rows, DType::F32)?;
//!     let inputs = Inputs { e: &e, c: &c_shard, bias: None, targets: &targets };
//!     let driver = RankDriver::new(comm, &layout)?;
//!     let upstream = Upstream::<HostTensor>::default();
//!     let (fwd, bwd) = driver.forward_backward(&inputs, &Options::default(), &upstream)?;
//!     assert_eq!(bwd.d_c.as_ref().map(|t| t.shape().to_vec()), Some(vec![shard.len(), d]));
//!     Ok(fwd.output.loss.to_f32_vec()[0])
//! });
//! let losses: Vec<f32> = losses.into_iter().collect::<cce_core::Result<_>>()?;
//! assert!(losses.iter().all(|&l| l == losses[0] && l.is_finite()));
//! # use cce_core::TensorMeta;
//! # Ok::<(), cce_core::CceError>(())
//! ```
//!
//! Arithmetic: as the unsharded [`crate::CpuBackend`] (logits in f32, f64 under softcap;
//! online sums in f64; `G` and the gradients in f32), on tiles of [`CpuShard::tile`]
//! (recomputed in each pass, no `N × V` buffer). Only the shard's real classes are computed.

mod backward;
mod driver;
mod entry;
mod forward;
mod inputs;
mod over_backend;
mod simulated;
mod thread_comm;

pub use cce_core::vocab_parallel::{ShardBackward, ShardForward, ShardPrimitives};
pub use driver::{RankBackward, RankDriver, RankForward};
pub use over_backend::{simulate_over_backends, SimulatedCall};
pub use simulated::{SimulatedLayout, SimulatedVocabParallel};
pub use thread_comm::ThreadComm;

use crate::view::HostRead;
use cce_core::plan::{DeviceLimits, TileShape};
use cce_core::vocab_parallel::VocabShard;
use cce_core::{HostTensor, Inputs, Options, Result, Saved, Upstream};

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

impl<T: HostRead, S: HostRead, U: HostRead> ShardPrimitives<T, S, U> for CpuShard {
    type Grad = HostTensor;

    /// [`CpuShard::forward`].
    fn shard_forward(
        &self,
        inputs: &Inputs<'_, T>,
        shard: &VocabShard,
        opts: &Options,
    ) -> Result<ShardForward> {
        self.forward(inputs, shard, opts)
    }

    /// [`CpuShard::backward`].
    fn shard_backward(
        &self,
        inputs: &Inputs<'_, T>,
        shard: &VocabShard,
        opts: &Options,
        saved: Saved<'_, S>,
        upstream: &Upstream<'_, U>,
    ) -> Result<ShardBackward> {
        self.backward(inputs, shard, opts, saved, upstream)
    }
}

/// The composed shard primitives ([`cce_core::vocab_parallel::BackendShard`]) over the
/// unsharded CPU backend, through the host (what the tests check the composition with).
impl cce_core::vocab_parallel::ShardRows for crate::CpuBackend {}
