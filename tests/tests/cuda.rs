//! The conformance suite on the CUDA backend (feature `cuda`). Without a CUDA device or
//! driver library the tests print "skipping: ..." and pass, unless `CCE_REQUIRE_CUDA=1`.
//!
//! Stamped four times: the default strategy choice (`cuda`), then each strategy alone
//! (`cuda_split`, `cuda_chunked`; f16 inputs, and filtered calls for chunked dense, run split
//! dense), with chunks capped at one 128 x 128 tile so that the suite's small problems run several row and class chunks. The
//! default stamp's split-dense calls take f16 `G` for `d_e` (small problems leave room for an
//! f16 copy of `c`); `cuda_split` forces bf16 `G`, the path of the default budget at the
//! seed shape. `cuda_sparse` is split dense with its sparse backward at any density
//! (`SparseMode::Always`: the suite's small vocabularies keep more than `V / 256` entries per
//! row, where the default gives way to the dense passes), 128-row chunks.

#![cfg(feature = "cuda")]

use cut_cross_entropy::cce_cuda::{CudaBackend, SparseMode};
use cut_cross_entropy::StrategyKind;

cce_conformance::conformance_suite!(
    cuda,
    CudaBackend::new(0),
    max_work_flop = 1e13,
    fixture_max_rows = 1024,
);

cce_conformance::conformance_suite!(
    cuda_split,
    CudaBackend::new(0)
        .and_then(|b| b.with_strategies(&[StrategyKind::SplitDense]))
        .and_then(|b| b.with_chunk_cap(128, 128))
        .map(|b| b.with_split_de_f16(false)),
    max_work_flop = 1e13,
    fixture_max_rows = 1024,
);

cce_conformance::conformance_suite!(
    cuda_chunked,
    CudaBackend::new(0)
        .and_then(|b| b.with_strategies(&[StrategyKind::ChunkedDense]))
        .and_then(|b| b.with_chunk_cap(128, 128)),
    max_work_flop = 1e13,
    fixture_max_rows = 1024,
);

cce_conformance::conformance_suite!(
    cuda_sparse,
    CudaBackend::new(0)
        .and_then(|b| b.with_strategies(&[StrategyKind::SplitDense]))
        .and_then(|b| b.with_chunk_cap(128, 128))
        .map(|b| b.with_sparse(SparseMode::Always)),
    max_work_flop = 1e13,
    fixture_max_rows = 1024,
);
