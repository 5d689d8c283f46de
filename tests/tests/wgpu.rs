//! The conformance suite on the wgpu backend (feature `wgpu`). Without an adapter the tests
//! print "skipping: ..." and pass, unless `CCE_REQUIRE_WGPU=1`. Sized for a software Vulkan
//! driver (lavapipe, ~1 GFLOP/s); a dtype the adapter lacks is reported as skipped.

#![cfg(feature = "wgpu")]

cce_conformance::conformance_suite!(
    wgpu,
    cut_cross_entropy::cce_wgpu::WgpuBackend::new(),
    max_work_flop = 2e8,
    fixture_max_rows = 32,
    allow_unsupported = true,
);
