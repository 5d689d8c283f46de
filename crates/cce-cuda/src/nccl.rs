//! A [`Communicator`] over NCCL (feature `nccl`), for the vocabulary-parallel driver
//! (`cce_reference::vocab_parallel::RankDriver`) with one rank per GPU; the CUDA shard
//! primitives are `cce_core::vocab_parallel::BackendShard` over `CudaBackend`.
//!
//! Each collective is host-staged: the host slice is copied to a device buffer on the
//! communicator's stream, reduced or gathered there by NCCL (`ncclAllReduce`,
//! `ncclAllGather`), copied back, and the stream synchronized before the call returns, as the
//! trait asks. That fits the CPU shard primitives, whose buffers live on the host; a
//! device-resident path (collectives on `CudaSlice`s in place, no copies, no synchronization)
//! belongs with CUDA shard primitives, which do not exist yet.
//!
//! **Never run**: this module is compiled (`cargo check -p cce-cuda --features nccl`) but has
//! not been executed on any machine; no multi-GPU host was available when it was written. What
//! it relies on, unverified here: cudarc 0.19's `nccl::Comm` (`from_rank`, `from_devices`,
//! `all_reduce_in_place`, `all_gather`), NCCL ≥ 2.30's ABI (cudarc's `nccl` feature), libnccl
//! loadable at run time by a name cudarc tries (`libnccl.so`; NCCL installs `libnccl.so.2`, so
//! a link is needed, which the constructors' `NoDevice` error says), and one thread (or
//! process) per rank: NCCL collectives of several ranks issued from one thread without
//! `ncclGroupStart`/`End` deadlock. Run with `NCCL_NVLS_ENABLE=0` on shared hosts (NVLink
//! multicast). What did run: with `libnccl.so` linked to the `nvidia-nccl-cu13` 2.28.9 wheel
//! and no GPU, the library loads and `from_devices(vec![])` returns without a panic
//! (`tests/nccl.rs`); the bindings are 2.30's, the calls used here exist in both.
//!
//! Determinism: NCCL gives every rank the same result bits of an all-reduce, in an order that
//! depends on the topology and algorithm; the driver relies on the former only for `d_e`.

use cce_core::vocab_parallel::{Communicator, ReduceOp};
use cce_core::{CceError, Result};
use cudarc::driver::{CudaStream, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::{Comm, Id, NcclType};
use std::sync::Arc;

/// One rank of an NCCL communicator, on its device's stream.
#[derive(Debug)]
pub struct NcclComm {
    comm: Comm,
}

/// The names cudarc 0.19 loads libnccl by at run time (Linux; `get_lib_name_candidates`, the
/// ones a libnccl can carry). NCCL's own soname, `libnccl.so.2`, is not among them.
const CUDARC_NCCL_NAMES: [&str; 7] = [
    "libnccl.so",
    "libnccl.so.13",
    "libnccl.so.12",
    "libnccl.so.11",
    "libnccl.so.10",
    "libnccl.so.9",
    "libnccl.so.1",
];

/// Whether the dynamic loader finds `name`.
fn loadable(name: &str) -> bool {
    // SAFETY: loading libnccl runs only its initializers, which have no preconditions; no
    // symbol is resolved or called, and the handle is closed at once.
    unsafe { libloading::Library::new(name) }.is_ok()
}

/// `NoDevice` unless libnccl can be loaded by a name cudarc tries (cudarc panics at the first
/// NCCL call otherwise).
fn check_library() -> Result<()> {
    if CUDARC_NCCL_NAMES.into_iter().any(loadable) {
        return Ok(());
    }
    let reason = if loadable("libnccl.so.2") {
        format!(
            "libnccl.so.2 is installed, but cudarc loads libnccl by the names \
             {CUDARC_NCCL_NAMES:?}: put a link libnccl.so -> libnccl.so.2 in a folder of \
             LD_LIBRARY_PATH"
        )
    } else {
        format!("none of {CUDARC_NCCL_NAMES:?} (nor libnccl.so.2) could be loaded")
    };
    Err(CceError::NoDevice {
        backend: "nccl",
        reason,
    })
}

/// An NCCL error as `CceError::Backend` (the NCCL result code's name as its message).
fn nccl_error(e: cudarc::nccl::result::NcclError) -> CceError {
    CceError::backend("nccl", format!("{:?}", e.0))
}

fn cuda_error(e: cudarc::driver::DriverError) -> CceError {
    CceError::backend("nccl", e)
}

impl NcclComm {
    /// Rank `rank` of `world_size` ranks (one process or thread each), on `stream`'s device;
    /// `id` is rank 0's [`Id::new`], sent to the others by the caller (its bytes are
    /// [`Id::internal`], rebuilt with [`Id::uninit`]). Every rank calls this together.
    ///
    /// Errors: `NoDevice` when libnccl cannot be loaded; `InvalidOption` for `rank ≥
    /// world_size` or sizes past `i32`; `Backend` with NCCL's error code.
    pub fn from_rank(
        stream: Arc<CudaStream>,
        rank: usize,
        world_size: usize,
        id: Id,
    ) -> Result<Self> {
        check_library()?;
        if rank >= world_size || i32::try_from(world_size).is_err() {
            return Err(CceError::InvalidOption {
                name: "rank",
                reason: format!("rank {rank} of a group of {world_size} (at most i32::MAX ranks)"),
            });
        }
        let comm = Comm::from_rank(stream, rank, world_size, id).map_err(nccl_error)?;
        Ok(Self { comm })
    }

    /// One rank per stream (one per device) in this process (`ncclCommInitAll`); drive each
    /// from its own thread.
    ///
    /// Errors: `NoDevice` when libnccl cannot be loaded; `Backend` with NCCL's error code.
    pub fn from_devices(streams: Vec<Arc<CudaStream>>) -> Result<Vec<Self>> {
        check_library()?;
        let comms = Comm::from_devices(streams).map_err(nccl_error)?;
        Ok(comms.into_iter().map(|comm| Self { comm }).collect())
    }

    /// The cudarc communicator (its stream, device, rank).
    pub fn comm(&self) -> &Comm {
        &self.comm
    }

    /// Host → device, `op` in place, device → host, synchronized.
    fn all_reduce<T: NcclType + DeviceRepr + ValidAsZeroBits + Copy>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let stream = self.comm.stream();
        let mut dev = stream.clone_htod(buf).map_err(cuda_error)?;
        let op = match op {
            ReduceOp::Sum => cudarc::nccl::ReduceOp::Sum,
            ReduceOp::Max => cudarc::nccl::ReduceOp::Max,
        };
        self.comm
            .all_reduce_in_place(&mut dev, &op)
            .map_err(nccl_error)?;
        stream.memcpy_dtoh(&dev, buf).map_err(cuda_error)?;
        stream.synchronize().map_err(cuda_error)
    }

    /// Host → device, gather, device → host, synchronized.
    fn all_gather<T: NcclType + DeviceRepr + ValidAsZeroBits + Copy>(
        &self,
        send: &[T],
        recv: &mut [T],
    ) -> Result<()> {
        let size = self.comm.world_size();
        if send.len().checked_mul(size) != Some(recv.len()) {
            return Err(CceError::ShapeMismatch {
                what: "all-gather receive buffer",
                expected: format!("{size} x {} values", send.len()),
                got: format!("{} values", recv.len()),
            });
        }
        if send.is_empty() {
            return Ok(());
        }
        let stream = self.comm.stream();
        let src = stream.clone_htod(send).map_err(cuda_error)?;
        let mut dst = stream.alloc_zeros::<T>(recv.len()).map_err(cuda_error)?;
        self.comm.all_gather(&src, &mut dst).map_err(nccl_error)?;
        stream.memcpy_dtoh(&dst, recv).map_err(cuda_error)?;
        stream.synchronize().map_err(cuda_error)
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn size(&self) -> usize {
        self.comm.world_size()
    }

    fn all_reduce_f32(&self, buf: &mut [f32], op: ReduceOp) -> Result<()> {
        self.all_reduce(buf, op)
    }

    fn all_reduce_f64(&self, buf: &mut [f64], op: ReduceOp) -> Result<()> {
        self.all_reduce(buf, op)
    }

    fn all_gather_f32(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        self.all_gather(send, recv)
    }

    fn all_gather_f64(&self, send: &[f64], recv: &mut [f64]) -> Result<()> {
        self.all_gather(send, recv)
    }
}
