//! The conformance suite on the CUDA backend (feature `cuda`). Without a CUDA device or
//! driver library the tests print "skipping: ..." and pass, unless `CCE_REQUIRE_CUDA=1`.

#![cfg(feature = "cuda")]

cce_conformance::conformance_suite!(
    cuda,
    cut_cross_entropy::cce_cuda::CudaBackend::new(0),
    max_work_flop = 1e13,
    fixture_max_rows = 1024,
);
