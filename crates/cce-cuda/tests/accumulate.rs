//! Gradient accumulation into the caller's f32 buffers ([`GradsInto::accumulate`]): a call adds
//! its gradients to the buffers' contents, through chunked dense and split dense (its row and
//! class passes, `d_e` from f16 and from bf16 `G`), exact and filtered, with a bias, from a
//! forward-and-backward and from a saved forward; a filtered split-dense call that accumulates
//! runs the dense passes instead of the sparse backward. Skips without a CUDA device
//! (`CCE_REQUIRE_CUDA=1` fails instead).

mod common;

use cce_core::{
    Backend, CallStats, CceError, DType, GradDType, Inputs, Options, Saved, StrategyKind, Upstream,
};
use cce_cuda::{Checks, CudaBackend, CudaTensor, ForwardInto, GradsInto, SparseMode};
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// Rows, hidden size (a multiple of 64: the WGMMA paths on sm_90), classes.
const SHAPE: (usize, usize, usize) = (300, 64, 1000);

fn f32s(be: &CudaBackend, t: &CudaTensor) -> Vec<f32> {
    be.download(t).unwrap().to_f32_vec()
}

/// Forward outputs and f32 gradient buffers of one problem.
struct Bufs {
    loss: CudaTensor,
    lse: CudaTensor,
    rest: CudaTensor,
    /// `d_e`, `d_c`, `d_bias`.
    grads: [CudaTensor; 3],
}

impl Bufs {
    fn new(be: &CudaBackend, opts: &Options) -> Self {
        let (n, d, v) = SHAPE;
        let z = |shape: Vec<usize>| be.zeros(shape, DType::F32).unwrap();
        let loss_shape = if opts.reduction == cce_core::Reduction::None {
            vec![n]
        } else {
            vec![]
        };
        Bufs {
            loss: z(loss_shape),
            lse: z(vec![n]),
            rest: z(vec![n]),
            grads: [z(vec![n, d]), z(vec![v, d]), z(vec![v])],
        }
    }

    /// A forward-and-backward call (`saved` `None`) or a backward from a saved lse and
    /// `1 − p_y`, its gradients into `self.grads` (added when `accumulate`). Returns the
    /// backward's statistics.
    fn call(
        &mut self,
        be: &CudaBackend,
        inputs: &Inputs<'_, CudaTensor>,
        opts: &Options,
        accumulate: bool,
        saved: Option<(&CudaTensor, &CudaTensor)>,
    ) -> CallStats {
        let [d_e, d_c, d_bias] = &mut self.grads;
        let grads = GradsInto {
            d_e: Some(d_e),
            d_c: Some(d_c),
            d_bias: Some(d_bias),
            accumulate,
        };
        let up = Upstream::default();
        match saved {
            None => {
                let fwd = ForwardInto {
                    loss: &mut self.loss,
                    lse: &mut self.lse,
                    rest_mass: &mut self.rest,
                    entropy: None,
                    argmax: None,
                };
                be.forward_backward_into(inputs, opts, &up, fwd, grads)
                    .map(|(_, b)| b)
            }
            Some((lse, rest_mass)) => {
                let saved = Saved { lse, rest_mass };
                be.backward_into(inputs, opts, saved, &up, grads)
            }
        }
        .unwrap_or_else(|e| panic!("{e}"))
    }

    fn host(&self, be: &CudaBackend) -> [Vec<f32>; 3] {
        self.grads.each_ref().map(|t| f32s(be, t))
    }
}

/// `got` against `want` element by element, within 1e-5 of want's largest magnitude.
fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(1e-30f32, |m, q| m.max(q.abs()));
    let (worst, at) = got
        .iter()
        .zip(want)
        .enumerate()
        .fold((0f32, 0), |(m, k), (i, (p, q))| {
            let x = (p - q).abs();
            if x > m {
                (x, i)
            } else {
                (m, k)
            }
        });
    assert!(
        worst <= 1e-5 * scale,
        "{what}: differs by {worst:e} at {at} ({} vs {}; largest |value| {scale:e})",
        got[at],
        want[at]
    );
}

/// Element-wise `a + b`.
fn sum(a: &[f32], b: &[f32]) -> Vec<f32> {
    a.iter().zip(b).map(|(x, y)| x + y).collect()
}

/// A backend of `kind` on `stream` (eager checks), in chunks of at most 64 rows and 128
/// classes, with `sparse` and `de_f16` (split dense's `d_e` from f16 `G` where it fits).
fn backend_on(
    stream: &Arc<CudaStream>,
    kind: StrategyKind,
    sparse: SparseMode,
    de_f16: bool,
) -> CudaBackend {
    CudaBackend::on_stream(stream.clone())
        .unwrap()
        .with_checks(Checks::Eager)
        .with_strategies(&[kind])
        .unwrap()
        .with_chunk_cap(64, 128)
        .unwrap()
        .with_sparse(sparse)
        .with_split_de_f16(de_f16)
}

/// One configuration: buffers filled with random `X` (each at its gradient's magnitude), an
/// accumulating forward-and-backward, then an accumulating backward from the saved forward,
/// each against the previous contents plus a plain call's gradients. The plain calls run on
/// a backend without the sparse backward (the accumulating one may not take it either); both
/// backends share one stream.
fn accumulates_like_a_sum(own: &CudaBackend, kind: StrategyKind, opts: &Options, de_f16: bool) {
    let stream = own.context().new_stream().unwrap();
    let acc_be = backend_on(&stream, kind, SparseMode::Always, de_f16);
    let plain_be = backend_on(&stream, kind, SparseMode::Off, de_f16);
    let mut rng = common::seeded();
    let (n, d, v) = SHAPE;
    let k = common::random_case(&mut rng, n, d, v, DType::BF16, true, 0.1, 8.0);
    let e = acc_be.upload(&k.e).unwrap();
    let c = acc_be.upload(&k.c).unwrap();
    let b = acc_be.upload(k.bias.as_ref().unwrap()).unwrap();
    let t = acc_be.upload(&k.targets).unwrap();
    let inputs = Inputs {
        e: &e,
        c: &c,
        bias: Some(&b),
        targets: &t,
    };
    let at = format!("{kind:?} filter {:?} de_f16 {de_f16}", opts.filter_eps);
    let mut plain = Bufs::new(&acc_be, opts);
    let mut acc = Bufs::new(&acc_be, opts);
    let st = plain.call(&plain_be, &inputs, opts, false, None);
    eprintln!("{at}: plain: {}", st.plan_reason);
    let g = plain.host(&plain_be);
    for (i, (t, gi)) in acc.grads.iter_mut().zip(&g).enumerate() {
        let scale = gi.iter().fold(1e-6f32, |m, q| m.max(q.abs()));
        acc_be.fill_randn(t, 1000 + i as u64, 0.0, scale).unwrap();
    }
    let x = acc.host(&acc_be);
    let st = acc.call(&acc_be, &inputs, opts, true, None);
    eprintln!("{at}: accumulating: {}", st.plan_reason);
    assert!(
        !st.plan_reason.starts_with("sparse backward:"),
        "{at}: an accumulating call took the sparse backward: {}",
        st.plan_reason
    );
    let got = acc.host(&acc_be);
    for (name, ((gt, xi), gi)) in ["d_e", "d_c", "d_bias"]
        .iter()
        .zip(got.iter().zip(&x).zip(&g))
    {
        assert_close(&format!("{at} forward_backward {name}"), gt, &sum(xi, gi));
    }
    // A second micro-batch: a backward from the saved forward adds again.
    plain.call(&plain_be, &inputs, opts, false, Some((&acc.lse, &acc.rest)));
    let g2 = plain.host(&plain_be);
    acc.call(
        &acc_be,
        &inputs,
        opts,
        true,
        Some((&plain.lse, &plain.rest)),
    );
    let got2 = acc.host(&acc_be);
    for (name, ((gt, prev), gi)) in ["d_e", "d_c", "d_bias"]
        .iter()
        .zip(got2.iter().zip(&got).zip(&g2))
    {
        assert_close(&format!("{at} backward {name}"), gt, &sum(prev, gi));
    }
    stream.synchronize().unwrap();
}

#[test]
fn accumulating_calls_add_their_gradients_to_the_buffers() {
    let Some(own) = common::backend("accumulating_calls_add_their_gradients_to_the_buffers") else {
        return;
    };
    let f32_grads = |base: Options| Options {
        grad_dtype: GradDType::F32,
        ..base
    };
    let filtered = f32_grads(Options::default());
    let exact = f32_grads(Options::exact());
    for opts in [&exact, &filtered] {
        accumulates_like_a_sum(&own, StrategyKind::ChunkedDense, opts, true);
        accumulates_like_a_sum(&own, StrategyKind::SplitDense, opts, true);
        accumulates_like_a_sum(&own, StrategyKind::SplitDense, opts, false);
    }
}

#[test]
fn accumulating_into_16_bit_gradients_is_a_typed_error() {
    let Some(be) = common::backend("accumulating_into_16_bit_gradients_is_a_typed_error") else {
        return;
    };
    let mut rng = common::seeded();
    let (n, d, v) = (64, 64, 300);
    let k = common::random_case(&mut rng, n, d, v, DType::BF16, false, 0.0, 1.0);
    let e = be.upload(&k.e).unwrap();
    let c = be.upload(&k.c).unwrap();
    let t = be.upload(&k.targets).unwrap();
    let inputs = Inputs {
        e: &e,
        c: &c,
        bias: None,
        targets: &t,
    };
    let opts = Options::default();
    assert_eq!(opts.grad_dtype, GradDType::Input);
    let mut loss = be.zeros(vec![], DType::F32).unwrap();
    let mut lse = be.zeros(vec![n], DType::F32).unwrap();
    let mut rest = be.zeros(vec![n], DType::F32).unwrap();
    let mut d_e = be.zeros(vec![n, d], DType::BF16).unwrap();
    let mut d_c = be.zeros(vec![v, d], DType::BF16).unwrap();
    let err = be
        .forward_backward_into(
            &inputs,
            &opts,
            &Upstream::default(),
            ForwardInto {
                loss: &mut loss,
                lse: &mut lse,
                rest_mass: &mut rest,
                entropy: None,
                argmax: None,
            },
            GradsInto {
                d_e: Some(&mut d_e),
                d_c: Some(&mut d_c),
                d_bias: None,
                accumulate: true,
            },
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            CceError::InvalidOption {
                name: "accumulate",
                ..
            }
        ),
        "{err}"
    );
    // Nothing was written.
    assert!(f32s(&be, &d_c).iter().all(|&x| x == 0.0));
}
