//! The conformance suite on the CUDA backend with the staircase backward switched off
//! (`CudaSwitches::staircase`, on by default, `crates/cce-cuda/src/dense/stair_pass.rs`): the
//! filtered forward-and-backward calls then take the sparse try and split dense, the paths the
//! staircase replaced, which stay reachable through the switch. Without a CUDA device the tests
//! print "skipping: ..." and pass, unless `CCE_REQUIRE_CUDA=1`.

#![cfg(feature = "cuda")]

use cut_cross_entropy::cce_cuda::{CudaBackend, CudaSwitches};

cce_conformance::conformance_suite!(
    cuda_no_staircase,
    CudaBackend::new(0).map(|b| {
        let s = b.switches();
        b.with_switches(CudaSwitches {
            staircase: false,
            ..s
        })
    }),
    max_work_flop = 1e13,
    fixture_max_rows = 1024,
);
