//! The NCCL communicator (feature `nccl`): what can be checked without several GPUs.
//!
//! The collectives themselves have never run (no multi-GPU host); this file checks that the
//! communicator drives the vocabulary-parallel driver (a compile-time check) and that a
//! missing libnccl is a typed error, not cudarc's panic.
#![cfg(feature = "nccl")]

use cce_core::vocab_parallel::ShardLayout;
use cce_core::CceError;
use cce_cuda::nccl::NcclComm;
use cce_reference::vocab_parallel::RankDriver;

/// The driver of one rank over NCCL: compiles, so `NcclComm` meets the driver's bounds.
#[allow(dead_code)]
fn driver_over_nccl<'c>(
    comm: &'c NcclComm,
    layout: &ShardLayout,
) -> cce_core::Result<RankDriver<'c, NcclComm>> {
    RankDriver::new(comm, layout)
}

#[test]
fn no_libnccl_is_no_device_and_no_stream_is_no_rank() {
    match NcclComm::from_devices(Vec::new()) {
        Err(CceError::NoDevice {
            backend: "nccl", ..
        }) => {}
        Ok(comms) => assert!(comms.is_empty()),
        Err(CceError::Backend {
            backend: "nccl", ..
        }) => {}
        Err(other) => panic!("{other:?}"),
    }
}
