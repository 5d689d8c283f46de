//! The conformance suite on vocabulary-parallel calls: `k` ranks simulated by threads
//! (`cce_reference::vocab_parallel::SimulatedVocabParallel`), each holding a shard of `c` and
//! `bias`, joined by the in-process communicator. Every check of the suite (every option,
//! reduction, dtype, the filter's bound, bad inputs) judges the sharded call against the f64
//! oracle of the unsharded problem.
//!
//! Stampings: `k = 1, 2, 3, 4` with shards differing by at most one class (so `V` not divisible
//! by `k`; a `V` smaller than `k` is padded), and `k = 3` on a vocabulary padded to a multiple
//! of `3 × 8` with small tiles (16 x 32), whose padding rows hold NaN.

use cce_core::plan::TileShape;
use cce_reference::vocab_parallel::{CpuShard, SimulatedLayout, SimulatedVocabParallel};

cce_conformance::conformance_suite!(
    vocab_parallel_k1,
    SimulatedVocabParallel::new(1),
    require = true,
    max_work_flop = 2e9,
    fixture_max_rows = 64,
);

cce_conformance::conformance_suite!(
    vocab_parallel_k2,
    SimulatedVocabParallel::new(2),
    require = true,
    max_work_flop = 2e9,
    fixture_max_rows = 64,
);

cce_conformance::conformance_suite!(
    vocab_parallel_k3,
    SimulatedVocabParallel::new(3),
    require = true,
    max_work_flop = 2e9,
    fixture_max_rows = 64,
);

cce_conformance::conformance_suite!(
    vocab_parallel_k4,
    SimulatedVocabParallel::new(4),
    require = true,
    max_work_flop = 2e9,
    fixture_max_rows = 64,
);

/// Three ranks on a vocabulary padded to a multiple of 24, 16 x 32 tiles.
fn padded_small_tiles() -> SimulatedVocabParallel {
    SimulatedVocabParallel::new(3)
        .with_layout(SimulatedLayout::Padded { multiple: 8 })
        .with_cpu(CpuShard::with_tile(TileShape {
            rows: 16,
            classes: 32,
            depth: 32,
        }))
}

cce_conformance::conformance_suite!(
    vocab_parallel_k3_padded,
    padded_small_tiles(),
    require = true,
    max_work_flop = 5e8,
    fixture_max_rows = 32,
);
