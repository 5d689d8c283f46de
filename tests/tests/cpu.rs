//! The conformance suite on the blocked CPU backend (`cce_reference::CpuBackend`). The CPU
//! always exists, so a missing device is never a skip here.
//!
//! Two stampings: the default plan (chunked-dense, 64 x 256 tiles), and the recomputing
//! tile-ownership strategy with small GPU-like tiles, so the plan and filter paths a GPU
//! backend follows are checked without a GPU.

use cce_core::plan::{DeviceLimits, StrategyKind, TileShape};
use cce_reference::CpuBackend;

cce_conformance::conformance_suite!(
    cpu,
    CpuBackend::new(),
    require = true,
    max_work_flop = 2e11,
    fixture_max_rows = 1024,
);

/// Limits of a GPU-like plan: tile-ownership only, 16 x 128 tiles, depth 32.
fn tile_ownership_limits() -> DeviceLimits {
    DeviceLimits {
        name: "cpu (tile-ownership, 16 x 128 tiles)".into(),
        tile: TileShape {
            rows: 16,
            classes: 128,
            depth: 32,
        },
        strategies: vec![StrategyKind::TileOwnership],
        ..DeviceLimits::cpu()
    }
}

cce_conformance::conformance_suite!(
    cpu_tile_ownership,
    CpuBackend::with_limits(tile_ownership_limits()),
    require = true,
    max_work_flop = 2e10,
    fixture_max_rows = 32,
);
