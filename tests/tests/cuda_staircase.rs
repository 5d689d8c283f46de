//! The conformance suite on the CUDA backend with the staircase backward switched on
//! (`CudaSwitches::staircase`, `crates/cce-cuda/src/dense/stair_pass.rs`): every filtered
//! forward-and-backward call the staircase takes (the suite's default options filter) is
//! judged against the f64 oracle within the bound of its reported dropped mass; the calls it
//! refuses run the default paths. Without a CUDA device the tests print "skipping: ..." and
//! pass, unless `CCE_REQUIRE_CUDA=1`.

#![cfg(feature = "cuda")]

use cut_cross_entropy::cce_cuda::{CudaBackend, CudaSwitches};

cce_conformance::conformance_suite!(
    cuda_staircase,
    CudaBackend::new(0).map(|b| {
        let s = b.switches();
        b.with_switches(CudaSwitches {
            staircase: true,
            ..s
        })
    }),
    max_work_flop = 1e13,
    fixture_max_rows = 1024,
);
