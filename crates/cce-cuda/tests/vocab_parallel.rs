//! The CUDA backend's vocabulary-shard primitives (`cce_core::vocab_parallel::BackendShard`
//! over `CudaBackend`, issue 22) on one GPU: `k ∈ {1, 2, 3, 4}` ranks simulated by threads
//! (one `CudaBackend` and stream per rank, `ThreadComm` between them), even layouts with `V`
//! not divisible by `k` and padded ones (a shard of padding only among them), every option;
//! per row, each output against the unsharded CUDA call (the sweep of
//! `cce-reference/tests/shared/backend_shards.rs`, which the CPU runs against `CpuBackend`),
//! and the sharded CUDA call against the CPU shards (`SimulatedVocabParallel`) on one case
//! per option. Shards that do not tile the vocabulary: a typed error on every rank.
//!
//! Without a CUDA device the tests print "skipping" and pass, unless `CCE_REQUIRE_CUDA=1`.

mod common;

#[path = "../../cce-reference/tests/shared/backend_shards.rs"]
mod backend_shards;

use cce_core::vocab_parallel::{BackendShard, VocabParallelError, VocabShard};
use cce_core::{Backend, CceError, DType, HostTensor, Inputs, Options};
use cce_cuda::CudaBackend;
use cce_reference::vocab_parallel::{RankDriver, ThreadComm};

/// The unsharded backend and four ranks', or `None` (skipped).
fn backends(test: &str) -> Option<Vec<CudaBackend>> {
    let first = common::backend(test)?;
    let mut all = vec![first];
    for _ in 0..4 {
        all.push(CudaBackend::new(0).expect("a second CUDA backend on device 0"));
    }
    Some(all)
}

#[test]
fn cuda_shards_equal_the_unsharded_cuda_call() {
    let Some(b) = backends("cuda_shards_equal_the_unsharded_cuda_call") else {
        return;
    };
    for big in [false, true] {
        for case in backend_shards::cases(big) {
            backend_shards::check(&case, &b);
        }
    }
}

#[test]
fn cuda_shards_equal_the_cpu_shards() {
    let Some(b) = backends("cuda_shards_equal_the_cpu_shards") else {
        return;
    };
    // The CPU reference as the "unsharded" side of the same sweep: its CpuBackend call is the
    // single-device truth the CPU shards were checked against.
    let cpu: Vec<cce_reference::CpuBackend> =
        (0..5).map(|_| cce_reference::CpuBackend::new()).collect();
    for case in backend_shards::cases(false)
        .into_iter()
        .filter(|c| c.ranks == 3)
    {
        backend_shards::check(&case, &cpu);
        backend_shards::check(&case, &b);
    }
}

#[test]
fn shards_that_do_not_tile_are_typed_errors_on_the_gpu() {
    let Some(b) = backends("shards_that_do_not_tile_are_typed_errors_on_the_gpu") else {
        return;
    };
    let (n, d, v) = (4, 8, 10);
    let e = HostTensor::from_f32(vec![n, d], &vec![0.1; n * d], DType::F32).unwrap();
    let targets = HostTensor::from_i64(vec![1, 9, -100, 4]);
    // Rank 1's shard overlaps rank 0's.
    let shards = [
        VocabShard::new(v, 0, 6).unwrap(),
        VocabShard::new(v, 4, 10).unwrap(),
    ];
    let out = ThreadComm::run(2, |comm| {
        let r = cce_core::vocab_parallel::Communicator::rank(comm);
        let be = &b[1 + r];
        let s = shards[r];
        let c = be
            .upload(
                &HostTensor::from_f32(vec![s.len(), d], &vec![0.05; s.len() * d], DType::F32)
                    .unwrap(),
            )
            .unwrap();
        let (e, t) = (be.upload(&e).unwrap(), be.upload(&targets).unwrap());
        let inputs = Inputs {
            e: &e,
            c: &c,
            bias: None,
            targets: &t,
        };
        RankDriver::from_shard(comm, s)
            .with_primitives(BackendShard::new(be))
            .forward(&inputs, &Options::default())
            .map(|_| ())
    });
    for r in out {
        assert!(
            matches!(
                r,
                Err(CceError::VocabParallel(VocabParallelError::Overlap {
                    shard: 1,
                    ..
                }))
            ),
            "{r:?}"
        );
    }
}
