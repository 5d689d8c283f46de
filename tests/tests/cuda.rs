//! The conformance suite on the CUDA backend (feature `cuda`). Without a CUDA device or
//! driver library the tests print "skipping: ..." and pass, unless `CCE_REQUIRE_CUDA=1`.
//!
//! Stamped four times: the default strategy choice (`cuda`), then each strategy alone
//! (`cuda_split`, `cuda_chunked`; f16 inputs, bf16 inputs with f32 gradients and filtered calls
//! for chunked dense run split dense), with chunks capped at one 128 x 128 tile so that the
//! suite's small problems run several row and class chunks. The default stamp's split-dense
//! calls take f16 `G` for `d_e` (small problems leave room for an f16 copy of `c`);
//! `cuda_split` forces bf16 `G`, the path of the default budget at the seed shape. `cuda_sparse` is split dense with its sparse backward at any density
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

/// The facade's one call on device buffers (`cut_cross_entropy::cuda`) against the CPU's one
/// call on the same values: loss, lse and gradients, bf16 with a bias and ignored rows, on a
/// backend running on a caller's non-blocking stream.
#[test]
fn one_call_on_device_buffers_matches_the_cpu() {
    use cut_cross_entropy::cuda::{self, CudaBackend};
    use cut_cross_entropy::{Backend, CceError, DType, HostTensor, Options};
    let own = match CudaBackend::new(0) {
        Ok(b) => b,
        Err(CceError::NoDevice { reason, .. }) => {
            if std::env::var("CCE_REQUIRE_CUDA").as_deref() == Ok("1") {
                panic!("CCE_REQUIRE_CUDA=1 but no CUDA device: {reason}");
            }
            eprintln!("skipping one_call_on_device_buffers_matches_the_cpu: {reason}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let be = CudaBackend::on_stream(own.context().new_stream().unwrap()).unwrap();
    let (n, d, v) = (70, 64, 300);
    let vals = |k: usize, s: f32| -> Vec<f32> {
        (0..k)
            .map(|i| ((i * 37 % 101) as f32 / 50.0 - 1.0) * s)
            .collect()
    };
    let e = HostTensor::from_f32(vec![n, d], &vals(n * d, 0.5), DType::BF16).unwrap();
    let c = HostTensor::from_f32(vec![v, d], &vals(v * d, 0.3), DType::BF16).unwrap();
    let bias = HostTensor::from_f32(vec![v], &vals(v, 1.0), DType::BF16).unwrap();
    let t: Vec<i64> = (0..n as i64)
        .map(|i| {
            if i % 7 == 3 {
                -100
            } else {
                (i * 13) % v as i64
            }
        })
        .collect();
    let targets = HostTensor::from_i64(t);
    let opts = Options::exact();
    let cpu =
        cut_cross_entropy::linear_cross_entropy(&e, &c, Some(&bias), &targets, &opts).unwrap();
    let up = |h: &HostTensor| be.upload(h).unwrap();
    let out = cuda::linear_cross_entropy(
        &be,
        &up(&e),
        &up(&c),
        Some(&up(&bias)),
        &up(&targets),
        &opts,
    )
    .unwrap();
    let down = |t: &cuda::CudaTensor| be.download(t).unwrap().to_f32_vec();
    let close = |what: &str, got: Vec<f32>, want: Vec<f32>| {
        let scale = want.iter().fold(1e-30f32, |m, x| m.max(x.abs()));
        let worst = got
            .iter()
            .zip(&want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            worst <= 2e-2 * scale,
            "{what}: {worst:e} off (largest {scale:e})"
        );
    };
    close("loss", down(&out.loss), cpu.loss.to_f32_vec());
    close("lse", down(&out.lse), cpu.lse.to_f32_vec());
    close(
        "d_e",
        down(out.d_e.as_ref().unwrap()),
        cpu.d_e.unwrap().to_f32_vec(),
    );
    close(
        "d_c",
        down(out.d_c.as_ref().unwrap()),
        cpu.d_c.unwrap().to_f32_vec(),
    );
    close(
        "d_bias",
        down(out.d_bias.as_ref().unwrap()),
        cpu.d_bias.unwrap().to_f32_vec(),
    );
    assert!(out.backward_stats.is_some());
}
