//! The composed shard primitives (`cce_core::vocab_parallel::BackendShard`) over the unsharded
//! CPU backend: `k ∈ {1, 2, 3, 4}` simulated ranks against the unsharded `CpuBackend` call,
//! every option (`shared/backend_shards.rs`; the CUDA test runs the same sweep on the GPU).

#[path = "shared/backend_shards.rs"]
mod backend_shards;

use cce_reference::CpuBackend;

#[test]
fn backend_shards_equal_the_unsharded_cpu_call() {
    let backends: Vec<CpuBackend> = (0..5).map(|_| CpuBackend::new()).collect();
    for case in backend_shards::cases(false) {
        backend_shards::check(&case, &backends);
    }
}
