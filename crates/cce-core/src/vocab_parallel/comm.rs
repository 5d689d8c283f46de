//! The collectives a vocabulary-parallel call needs, as a trait the caller implements over
//! its own process group (NCCL, MPI, torch.distributed, threads).

use crate::error::Result;

/// Element-wise reduction of an all-reduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Maximum (NaN handling is the implementation's; the driver never reduces a NaN by max).
    Max,
}

/// A group of `size()` ranks that run the same sequence of collectives.
///
/// Every rank must call the same collectives in the same order with the same lengths; an
/// implementation that can detect a mismatch returns
/// `CceError::VocabParallel(CollectiveMismatch)`, one whose peer left returns
/// `VocabParallel(PeerLost)`, and one over a runtime (NCCL) returns `CceError::Backend` with
/// the runtime's own error. Each call completes before it returns (the host buffers hold the
/// result).
///
/// Determinism: an implementation must give every rank the same result bits (NCCL's
/// all-reduce does; the in-process one sums in rank order). The vocabulary-parallel driver
/// relies on it only for `d_e`, which every rank then holds; the forward's merge runs on
/// all-gathered bytes and is identical on every rank by construction.
pub trait Communicator {
    /// This rank, in `0..size()`.
    fn rank(&self) -> usize;

    /// Ranks in the group.
    fn size(&self) -> usize;

    /// In place: `buf[k] = op over ranks of buf[k]`, f32.
    fn all_reduce_f32(&self, buf: &mut [f32], op: ReduceOp) -> Result<()>;

    /// In place: `buf[k] = op over ranks of buf[k]`, f64.
    fn all_reduce_f64(&self, buf: &mut [f64], op: ReduceOp) -> Result<()>;

    /// `recv[r·L..(r+1)·L] = send of rank r` (`L = send.len()`, the same on every rank;
    /// `recv.len() = size()·L`), f32.
    fn all_gather_f32(&self, send: &[f32], recv: &mut [f32]) -> Result<()>;

    /// As [`Communicator::all_gather_f32`], f64.
    fn all_gather_f64(&self, send: &[f64], recv: &mut [f64]) -> Result<()>;
}
