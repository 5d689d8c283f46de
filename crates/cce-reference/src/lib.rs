//! # cce-reference: the CPU oracle and the CPU backend
//!
//! - [`mod@naive`]: logits materialized, MATH.md followed literally, in f64 (the ground truth of
//!   every test) or in the input dtype (what a user would otherwise run).
//! - [`blocked`]: a multi-threaded CPU backend that follows the blocking plan and the filter rule
//!   of `cce-core` exactly, so plan and filter bugs fail without a GPU.
//! - [`view`]: borrowed host tensors, read by the CPU backend in place.
//! - [`vocab_parallel`]: a vocabulary split over ranks: one shard's primitives on the CPU, an
//!   in-process communicator, the driver of one rank.

pub mod naive;

pub use naive::{naive, naive_values, Oracle, OracleDLoss, Precision};
pub mod blocked;

pub use blocked::CpuBackend;
pub mod view;

pub use view::{HostRead, HostSlice, HostView};
pub mod vocab_parallel;
