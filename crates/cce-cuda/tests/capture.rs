//! Calls a training step can capture and pipeline: a forward+backward captured in a CUDA graph
//! and replayed on new input contents; checks deferred to `CudaBackend::status` on a caller's
//! stream, eager on the backend's own. Skips without a CUDA device (`CCE_REQUIRE_CUDA=1` fails
//! instead).

mod common;

use cce_core::{Backend, CceError, DType, Inputs, Options, Reduction, StrategyKind, Upstream};
use cce_cuda::{Checks, CudaBackend, CudaTensor, ForwardInto, GradsInto};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};

fn f32s(be: &CudaBackend, t: &CudaTensor) -> Vec<f32> {
    be.download(t).unwrap().to_f32_vec()
}

/// The largest difference of `got` from `want`, relative to want's largest magnitude.
fn rel_diff(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1e-30f32, |m, q| m.max(q.abs()));
    got.iter()
        .zip(want)
        .fold(0f32, |m, (p, q)| m.max((p - q).abs()))
        / scale
}

/// Outputs of a mean forward+backward, allocated once (a graph replays into them).
struct Outs {
    loss: CudaTensor,
    lse: CudaTensor,
    rest: CudaTensor,
    d_e: CudaTensor,
    d_c: CudaTensor,
}

impl Outs {
    fn new(be: &CudaBackend, (n, d, v): (usize, usize, usize)) -> Self {
        let z = |shape: Vec<usize>, dt| be.zeros(shape, dt).unwrap();
        Outs {
            loss: z(vec![], DType::F32),
            lse: z(vec![n], DType::F32),
            rest: z(vec![n], DType::F32),
            d_e: z(vec![n, d], DType::BF16),
            d_c: z(vec![v, d], DType::BF16),
        }
    }

    fn call(&mut self, be: &CudaBackend, inputs: &Inputs<'_, CudaTensor>, opts: &Options) {
        be.forward_backward_into(
            inputs,
            opts,
            &Upstream::default(),
            ForwardInto {
                loss: &mut self.loss,
                lse: &mut self.lse,
                rest_mass: &mut self.rest,
                entropy: None,
                argmax: None,
            },
            GradsInto {
                d_e: Some(&mut self.d_e),
                d_c: Some(&mut self.d_c),
                d_bias: None,
                accumulate: false,
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }

    fn host(&self, be: &CudaBackend) -> [Vec<f32>; 4] {
        [
            f32s(be, &self.loss),
            f32s(be, &self.lse),
            f32s(be, &self.d_e),
            f32s(be, &self.d_c),
        ]
    }
}

/// Capture one forward+backward of `strategy` with `opts` on a caller's stream, replay it on
/// three contents of `e`, and compare each replay with an uncaptured call on the same data.
fn capture_and_replay(own: &CudaBackend, strategy: StrategyKind, opts: &Options) {
    let ctx = own.context().clone();
    let stream = ctx.new_stream().unwrap();
    let be = CudaBackend::on_stream(stream.clone())
        .unwrap()
        .with_strategies(&[strategy])
        .unwrap();
    assert_eq!(be.checks(), Checks::Deferred);
    let (n, d, v) = (1500, 256, 5000);
    let mut e = be.alloc_tensor(vec![n, d], DType::BF16).unwrap();
    let mut c = be.alloc_tensor(vec![v, d], DType::BF16).unwrap();
    be.fill_randn(&mut e, 11, 0.0, 0.5).unwrap();
    be.fill_randn(&mut c, 12, 0.0, 0.5).unwrap();
    let t = be.random_targets(n, v, 0.1, -100, 13).unwrap();
    let mut graph_outs = Outs::new(&be, (n, d, v));
    let mut call_outs = Outs::new(&be, (n, d, v));
    let inputs = Inputs {
        e: &e,
        c: &c,
        bias: None,
        targets: &t,
    };
    // Warm-up outside the capture: the engine made, its cuBLAS handle lent.
    graph_outs.call(&be, &inputs, opts);
    be.synchronize().unwrap();
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    graph_outs.call(&be, &inputs, opts);
    let graph = stream
        .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
        .unwrap()
        .expect("a graph was captured");
    for seed in [21, 22, 23] {
        be.fill_randn(&mut e, seed, 0.0, 0.5 + 0.25 * (seed - 21) as f32)
            .unwrap();
        graph.launch().unwrap();
        let inputs = Inputs {
            e: &e,
            c: &c,
            bias: None,
            targets: &t,
        };
        call_outs.call(&be, &inputs, opts);
        be.synchronize().unwrap();
        be.status().unwrap_or_else(|e| panic!("device status: {e}"));
        let (got, want) = (graph_outs.host(&be), call_outs.host(&be));
        for (name, (g, w)) in ["loss", "lse", "d_e", "d_c"]
            .iter()
            .zip(got.iter().zip(&want))
        {
            let r = rel_diff(g, w);
            assert!(
                r <= 1e-3,
                "{strategy:?} seed {seed}: replayed {name} differs from the call by {r:e}"
            );
        }
    }
    stream.synchronize().unwrap();
}

#[test]
fn a_forward_backward_captured_in_a_cuda_graph_replays_like_a_call() {
    let Some(own) = common::backend("a_forward_backward_captured_in_a_cuda_graph") else {
        return;
    };
    let mean = Options {
        reduction: Reduction::Mean,
        ..Options::default()
    };
    let exact = Options {
        filter_eps: cce_core::FilterEps::Off,
        ..mean.clone()
    };
    for opts in [&mean, &exact] {
        capture_and_replay(&own, StrategyKind::ChunkedDense, opts);
        capture_and_replay(&own, StrategyKind::SplitDense, opts);
    }
}

#[test]
fn deferred_checks_wait_in_the_status_and_eager_checks_fail_the_call() {
    let Some(own) = common::backend("deferred_checks_wait_in_the_status") else {
        return;
    };
    assert_eq!(own.checks(), Checks::Eager);
    let deferred = CudaBackend::on_stream(own.context().new_stream().unwrap()).unwrap();
    let (n, d, v) = (64, 32, 300);
    let mut rng = common::seeded();
    let k = common::random_case(&mut rng, n, d, v, DType::F32, false, 0.0, 1.0);
    let mut targets = k.targets.to_i64_vec().unwrap();
    targets[7] = v as i64 + 5;
    targets[12] = -3;
    let bad = cce_core::HostTensor::from_i64(targets);
    for be in [&own, &deferred] {
        let e = be.upload(&k.e).unwrap();
        let c = be.upload(&k.c).unwrap();
        let t = be.upload(&bad).unwrap();
        let inputs = Inputs {
            e: &e,
            c: &c,
            bias: None,
            targets: &t,
        };
        let first = be.forward(&inputs, &Options::default());
        let reported = match be.checks() {
            Checks::Eager => first.map(|_| ()),
            Checks::Deferred => {
                assert!(first.is_ok(), "a deferred call does not read the device");
                be.status().map(|_| ())
            }
        };
        match reported {
            Err(CceError::TargetOutOfRange { row: 7, value, .. }) => {
                assert_eq!(value, v as i64 + 5)
            }
            other => panic!("{:?}: {other:?}", be.checks()),
        }
        // Read once: the record is cleared; the last call's valid rows are reported.
        let report = be.status().unwrap();
        assert_eq!(report.n_valid, n - 2, "{:?}", be.checks());
    }
    // A mean over no valid row: reported at the status, the loss NaN meanwhile (an unread
    // record makes a mean or sum loss NaN, as torch's mean over no valid row is).
    let all_ignored = cce_core::HostTensor::from_i64(vec![-100; n]);
    let e = deferred.upload(&k.e).unwrap();
    let c = deferred.upload(&k.c).unwrap();
    let t = deferred.upload(&all_ignored).unwrap();
    let inputs = Inputs {
        e: &e,
        c: &c,
        bias: None,
        targets: &t,
    };
    let out = deferred.forward(&inputs, &Options::default()).unwrap();
    let loss = f32s(&deferred, &out.loss);
    assert!(loss.len() == 1 && loss[0].is_nan(), "{loss:?}");
    match deferred.status() {
        Err(CceError::AllTargetsIgnored { n: rows, .. }) => assert_eq!(rows, n),
        other => panic!("{other:?}"),
    }
    deferred.synchronize().unwrap();
}
