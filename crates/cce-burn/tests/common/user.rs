//! A new user's checks on an autodiff device of any backend: views, dtypes, devices, gradient
//! accumulation, frozen parameters, repeated backward and determinism, each against burn's
//! materialized loss. `tests/newuser.rs` (NdArray) and `tests/wgpu.rs` call them.

/// Calls the macro `$m` with the name of every check of this module, so that each backend's
/// test file runs the same list (`tests/newuser.rs`, `tests/wgpu.rs`).
#[allow(unused_macros)]
macro_rules! with_user_checks {
    ($m:ident) => {
        $m!(
            sliced_and_transposed_inputs,
            f16_inputs,
            bf16_inputs,
            f64_inputs,
            mixed_float_dtypes_are_a_typed_error,
            bias_of_another_dtype_is_a_typed_error,
            bias_of_wrong_length_is_a_typed_error,
            targets_of_other_int_dtypes,
            inputs_on_a_plain_device_beside_an_autodiff_one,
            targets_on_a_plain_device,
            two_uses_in_one_graph_accumulate,
            embedding_lm_with_bias_and_gradient_accumulation,
            frozen_head_with_trained_bias,
            nothing_requires_grad_on_an_autodiff_device,
            backward_twice_panics_like_burns_own_ops,
            deterministic_repeat,
            all_ignored_sum_and_none_have_zero_gradients,
            empty_batch_is_a_typed_error,
            bad_softcap_is_a_typed_error,
            negative_target_that_is_not_ignore_index,
            per_row_losses_under_burns_reductions,
            three_d_views_with_shift_and_per_row_losses,
            wide_i64_targets,
        );
    };
}
#[allow(unused_imports)]
pub(crate) use with_user_checks;

use super::*;
use burn::module::{Module, Param};
use burn::optim::{GradientsAccumulator, GradientsParams, SgdConfig};
use burn::tensor::{DType, Device, Int, IntDType, Tensor, TensorData};
use cce_burn::{
    linear_cross_entropy, try_linear_cross_entropy, CceError, LinearCrossEntropyConfig, Reduction,
};

/// Relative tolerance in f32 (as in ndarray.rs).
const REL: f32 = 2e-5;

fn grads_match(
    what: &str,
    e: &Tensor<2>,
    c: &Tensor<2>,
    ga: &burn::tensor::Gradients,
    gb: &burn::tensor::Gradients,
) {
    assert_close(
        &format!("{what} d_e"),
        &to_vec(e.grad(ga).expect("our d_e")),
        &to_vec(e.grad(gb).expect("burn's d_e")),
        REL,
        1e-7,
    );
    assert_close(
        &format!("{what} d_c"),
        &to_vec(c.grad(ga).expect("our d_c")),
        &to_vec(c.grad(gb).expect("burn's d_c")),
        REL,
        1e-7,
    );
}

pub fn sliced_and_transposed_inputs(device: &Device) {
    let device = device.clone();
    let (n, d, v) = (12, 8, 20);
    let t = targets(n, v, 5, -100);
    // e: rows 2..2+n and columns 1..1+d of a bigger matrix; c: the transpose of a [D, V].
    let big = float(uniform((n + 4) * (d + 3), 21, 1.0), [n + 4, d + 3], &device).require_grad();
    let ct = float(uniform(d * v, 22, 0.5), [d, v], &device).require_grad();
    // Each side slices and transposes on its own (one backward consumes its graph).
    let e = || big.clone().slice([2..2 + n, 1..1 + d]);
    let c = || ct.clone().transpose();
    let cfg = LinearCrossEntropyConfig::new();
    let ours = linear_cross_entropy(e(), c(), int(t.clone(), &device), &cfg);
    let theirs = materialized(e(), c(), None, &t, &cfg.options);
    assert_close(
        "loss",
        &to_vec(ours.clone()),
        &to_vec(theirs.clone()),
        REL,
        0.0,
    );
    let (ga, gb) = (ours.backward(), theirs.backward());
    assert_close(
        "d_big",
        &to_vec(big.grad(&ga).unwrap()),
        &to_vec(big.grad(&gb).unwrap()),
        REL,
        1e-7,
    );
    assert_close(
        "d_ct",
        &to_vec(ct.grad(&ga).unwrap()),
        &to_vec(ct.grad(&gb).unwrap()),
        REL,
        1e-7,
    );
}

/// Inputs cast to `dtype` (skipped where the backend lacks it), against burn in f32 on the
/// rounded inputs; gradients come back in `dtype`.
fn half_precision(device: &Device, dtype: DType, rel: f32) {
    if !device.supports_dtype(dtype) {
        eprintln!("skipped: {dtype:?} not supported on {device:?}");
        return;
    }
    let device = device.clone();
    let (n, d, v) = (10, 8, 24);
    let t = targets(n, v, 4, -100);
    let e32 = float(uniform(n * d, 31, 1.0), [n, d], &device);
    let c32 = float(uniform(v * d, 32, 0.5), [v, d], &device);
    let e = e32.clone().cast(dtype).require_grad();
    let c = c32.clone().cast(dtype).require_grad();
    let cfg = LinearCrossEntropyConfig::new();
    let ours = linear_cross_entropy(e.clone(), c.clone(), int(t.clone(), &device), &cfg);
    assert_eq!(ours.dtype(), DType::F32);
    // Reference: burn in f32 on the rounded inputs.
    let (er, cr) = (
        e.clone().cast(DType::F32).detach().require_grad(),
        c.clone().cast(DType::F32).detach().require_grad(),
    );
    let theirs = materialized(er.clone(), cr.clone(), None, &t, &cfg.options);
    assert_close(
        "loss",
        &to_vec(ours.clone()),
        &to_vec(theirs.clone()),
        rel,
        0.0,
    );
    let (ga, gb) = (ours.backward(), theirs.backward());
    let de = e.grad(&ga).expect("d_e");
    let dc = c.grad(&ga).expect("d_c");
    assert_eq!(de.dtype(), dtype);
    assert_eq!(dc.dtype(), dtype);
    assert_close(
        "d_e",
        &to_vec(de.cast(DType::F32)),
        &to_vec(er.grad(&gb).unwrap()),
        rel,
        0.0,
    );
    assert_close(
        "d_c",
        &to_vec(dc.cast(DType::F32)),
        &to_vec(cr.grad(&gb).unwrap()),
        rel,
        0.0,
    );
}

pub fn f16_inputs(device: &Device) {
    half_precision(device, DType::F16, 2e-3);
}

pub fn bf16_inputs(device: &Device) {
    half_precision(device, DType::BF16, 1e-2);
}

pub fn f64_inputs(device: &Device) {
    half_precision(device, DType::F64, REL);
}

pub fn mixed_float_dtypes_are_a_typed_error(device: &Device) {
    if !device.supports_dtype(DType::F16) {
        return;
    }
    let device = device.clone();
    let e = float(uniform(4 * 8, 1, 1.0), [4, 8], &device);
    let c = float(uniform(10 * 8, 2, 0.5), [10, 8], &device).cast(DType::F16);
    let r = try_linear_cross_entropy(e, c, int(vec![1, 2, 3, 4], &device), &Default::default());
    let err = r.unwrap_err();
    assert!(matches!(err, CceError::DTypeMismatch { .. }), "{err}");
}

pub fn bias_of_another_dtype_is_a_typed_error(device: &Device) {
    if !device.supports_dtype(DType::F16) {
        return;
    }
    let device = device.clone();
    let e = float(uniform(4 * 8, 1, 1.0), [4, 8], &device);
    let c = float(uniform(10 * 8, 2, 0.5), [10, 8], &device);
    let b = float(uniform(10, 3, 0.5), [10], &device).cast(DType::F16);
    let cfg = LinearCrossEntropyConfig::new().with_bias(b);
    let err = try_linear_cross_entropy(e, c, int(vec![1, 2, 3, 4], &device), &cfg).unwrap_err();
    assert!(matches!(err, CceError::DTypeMismatch { .. }), "{err}");
}

pub fn bias_of_wrong_length_is_a_typed_error(device: &Device) {
    let device = device.clone();
    let e = float(uniform(4 * 8, 1, 1.0), [4, 8], &device);
    let c = float(uniform(10 * 8, 2, 0.5), [10, 8], &device);
    let b = float(uniform(11, 3, 0.5), [11], &device);
    let cfg = LinearCrossEntropyConfig::new().with_bias(b);
    let err = try_linear_cross_entropy(e, c, int(vec![1, 2, 3, 4], &device), &cfg).unwrap_err();
    assert!(matches!(err, CceError::ShapeMismatch { .. }), "{err}");
}

pub fn targets_of_other_int_dtypes(device: &Device) {
    let device = device.clone();
    let (n, d, v) = (8, 8, 20);
    let t = targets(n, v, 0, -100);
    let e = float(uniform(n * d, 41, 1.0), [n, d], &device);
    let c = float(uniform(v * d, 42, 0.5), [v, d], &device);
    let cfg = LinearCrossEntropyConfig::new();
    let want = to_vec(materialized(e.clone(), c.clone(), None, &t, &cfg.options));
    for dt in [
        IntDType::I32,
        IntDType::I64,
        IntDType::U8,
        IntDType::U32,
        IntDType::I16,
    ] {
        if !device.supports_dtype(DType::from(dt)) {
            continue;
        }
        let y = int(t.clone(), &device).cast(dt);
        let got = to_vec(linear_cross_entropy(e.clone(), c.clone(), y, &cfg));
        assert_close(&format!("{dt:?}"), &got, &want, REL, 0.0);
    }
}

pub fn inputs_on_a_plain_device_beside_an_autodiff_one(device: &Device) {
    // A frozen head loaded without autodiff beside trained hidden states, and frozen hidden
    // states (computed without autodiff) beside a trained head: burn's own ops take such a mix,
    // so does the loss, with the gradients of the inputs that have them.
    let plain = device.clone().without_autodiff();
    let device = device.clone();
    let (n, d, v) = (6, 8, 12);
    let t = targets(n, v, 0, -100);
    let cfg = LinearCrossEntropyConfig::new();
    for plain_e in [false, true] {
        let (de, dc) = if plain_e {
            (&plain, &device)
        } else {
            (&device, &plain)
        };
        let e = float(uniform(n * d, 51, 1.0), [n, d], de);
        let c = float(uniform(v * d, 52, 0.5), [v, d], dc);
        let (e, c) = if plain_e {
            (e, c.require_grad())
        } else {
            (e.require_grad(), c)
        };
        let ours = linear_cross_entropy(e.clone(), c.clone(), int(t.clone(), &device), &cfg);
        let theirs = materialized(e.clone(), c.clone(), None, &t, &cfg.options);
        assert_close(
            "loss",
            &to_vec(ours.clone()),
            &to_vec(theirs.clone()),
            REL,
            0.0,
        );
        let (ga, gb) = (ours.backward(), theirs.backward());
        let trained = if plain_e { &c } else { &e };
        assert_close(
            &format!("plain_e {plain_e}: gradient"),
            &to_vec(trained.grad(&ga).expect("our gradient")),
            &to_vec(trained.grad(&gb).expect("burn's gradient")),
            REL,
            1e-7,
        );
    }
}

pub fn targets_on_a_plain_device(device: &Device) {
    let plain = device.clone().without_autodiff();
    let device = device.clone();
    let (n, d, v) = (6, 8, 12);
    let t = targets(n, v, 0, -100);
    let e = float(uniform(n * d, 51, 1.0), [n, d], &device).require_grad();
    let c = float(uniform(v * d, 52, 0.5), [v, d], &device).require_grad();
    let cfg = LinearCrossEntropyConfig::new();
    let ours = linear_cross_entropy(e.clone(), c.clone(), int(t.clone(), &plain), &cfg);
    let theirs = materialized(e.clone(), c.clone(), None, &t, &cfg.options);
    assert_close(
        "loss",
        &to_vec(ours.clone()),
        &to_vec(theirs.clone()),
        REL,
        0.0,
    );
    grads_match(
        "plain targets",
        &e,
        &c,
        &ours.backward(),
        &theirs.backward(),
    );
}

pub fn two_uses_in_one_graph_accumulate(device: &Device) {
    let device = device.clone();
    let (n, d, v) = (10, 8, 16);
    let t1 = targets(n, v, 4, -100);
    let t2: Vec<i64> = t1
        .iter()
        .map(|&x| if x < 0 { 0 } else { (x + 3) % v as i64 })
        .collect();
    let e = float(uniform(n * d, 61, 1.0), [n, d], &device).require_grad();
    let c = float(uniform(v * d, 62, 0.5), [v, d], &device).require_grad();
    let cfg = LinearCrossEntropyConfig::new();
    let sum = LinearCrossEntropyConfig::new().with_reduction(Reduction::Sum);
    let ours = linear_cross_entropy(e.clone(), c.clone(), int(t1.clone(), &device), &cfg)
        + linear_cross_entropy(e.clone() * 2.0, c.clone(), int(t2.clone(), &device), &sum)
            .mul_scalar(0.25);
    let theirs = materialized(e.clone(), c.clone(), None, &t1, &cfg.options)
        + materialized(e.clone() * 2.0, c.clone(), None, &t2, &sum.options).mul_scalar(0.25);
    assert_close(
        "loss",
        &to_vec(ours.clone()),
        &to_vec(theirs.clone()),
        REL,
        0.0,
    );
    grads_match("two uses", &e, &c, &ours.backward(), &theirs.backward());
}

#[derive(Module, Debug)]
struct Lm {
    emb: Param<Tensor<2>>,  // [V, D]
    head: Param<Tensor<2>>, // [V, D]
    bias: Param<Tensor<1>>, // [V]
}

impl Lm {
    fn new(d: usize, v: usize, device: &Device) -> Self {
        Self {
            emb: Param::from_tensor(float(uniform(v * d, 71, 1.0), [v, d], device)),
            head: Param::from_tensor(float(uniform(v * d, 72, 0.3), [v, d], device)),
            bias: Param::from_tensor(float(uniform(v, 73, 0.1), [v], device)),
        }
    }

    /// Embedding lookup of `tokens` `[N]`, then a nonlinearity: the hidden states `[N, D]`.
    fn hidden(&self, tokens: &[i64]) -> Tensor<2> {
        let device = self.emb.val().device();
        let idx = int(tokens.to_vec(), &device);
        self.emb.val().select(0, idx).tanh()
    }
}

/// Embedding + LM head with bias, gradient accumulation over two micro-batches, SGD with
/// momentum: our loss and burn's materialized one give the same parameters after 3 steps.
pub fn embedding_lm_with_bias_and_gradient_accumulation(device: &Device) {
    let device = device.clone();
    let (n, d, v) = (16, 8, 30);
    let tokens: Vec<i64> = (0..2 * n).map(|i| ((i * 13 + 5) % v) as i64).collect();
    let next: Vec<i64> = (0..2 * n)
        .map(|i| {
            if i % 7 == 2 {
                -100
            } else {
                tokens[(i + 1) % (2 * n)]
            }
        })
        .collect();
    let mut a = Lm::new(d, v, &device);
    let mut b = Lm::new(d, v, &device);
    let cfg_for = |m: &Lm| LinearCrossEntropyConfig::new().with_bias(m.bias.val());
    let sgd = SgdConfig::new().with_momentum(Some(burn::optim::momentum::MomentumConfig::new()));
    let (mut oa, mut ob) = (sgd.init(), sgd.init());
    for step in 0..3 {
        let (mut acc_a, mut acc_b) = (GradientsAccumulator::new(), GradientsAccumulator::new());
        for mb in 0..2 {
            let tok = &tokens[mb * n..(mb + 1) * n];
            let y = &next[mb * n..(mb + 1) * n];
            let la = linear_cross_entropy(
                a.hidden(tok),
                a.head.val(),
                int(y.to_vec(), &device),
                &cfg_for(&a),
            );
            let lb = materialized(
                b.hidden(tok),
                b.head.val(),
                Some(b.bias.val()),
                y,
                &cfg_for(&b).options,
            );
            assert_close(
                &format!("step {step} mb {mb} loss"),
                &to_vec(la.clone()),
                &to_vec(lb.clone()),
                REL,
                0.0,
            );
            acc_a.accumulate(&a, GradientsParams::from_grads(la.backward(), &a));
            acc_b.accumulate(&b, GradientsParams::from_grads(lb.backward(), &b));
        }
        a = oa.step(0.3, a, acc_a.grads());
        b = ob.step(0.3, b, acc_b.grads());
        for (name, x, y) in [
            ("emb", a.emb.val(), b.emb.val()),
            ("head", a.head.val(), b.head.val()),
        ] {
            assert_close(
                &format!("step {step} {name}"),
                &to_vec(x),
                &to_vec(y),
                REL,
                1e-6,
            );
        }
        assert_close(
            &format!("step {step} bias"),
            &to_vec(a.bias.val()),
            &to_vec(b.bias.val()),
            REL,
            1e-6,
        );
    }
}

pub fn frozen_head_with_trained_bias(device: &Device) {
    let device = device.clone();
    let (n, d, v) = (8, 8, 16);
    let t = targets(n, v, 3, -100);
    let e = float(uniform(n * d, 81, 1.0), [n, d], &device).require_grad();
    let c = float(uniform(v * d, 82, 0.5), [v, d], &device);
    let bias = float(uniform(v, 83, 0.5), [v], &device).require_grad();
    let cfg = LinearCrossEntropyConfig::new().with_bias(bias.clone());
    let ours = linear_cross_entropy(e.clone(), c.clone(), int(t.clone(), &device), &cfg);
    let theirs = materialized(e.clone(), c.clone(), Some(bias.clone()), &t, &cfg.options);
    let (ga, gb) = (ours.backward(), theirs.backward());
    assert!(c.grad(&ga).is_none());
    assert_close(
        "d_e",
        &to_vec(e.grad(&ga).unwrap()),
        &to_vec(e.grad(&gb).unwrap()),
        REL,
        1e-7,
    );
    assert_close(
        "d_bias",
        &to_vec(bias.grad(&ga).unwrap()),
        &to_vec(bias.grad(&gb).unwrap()),
        REL,
        1e-7,
    );
}

pub fn nothing_requires_grad_on_an_autodiff_device(device: &Device) {
    let device = device.clone();
    let (n, d, v) = (8, 8, 16);
    let t = targets(n, v, 3, -100);
    let e = float(uniform(n * d, 81, 1.0), [n, d], &device);
    let c = float(uniform(v * d, 82, 0.5), [v, d], &device);
    let cfg = LinearCrossEntropyConfig::new();
    let ours = linear_cross_entropy(e.clone(), c.clone(), int(t.clone(), &device), &cfg);
    let theirs = materialized(e, c, None, &t, &cfg.options);
    assert_close("loss", &to_vec(ours), &to_vec(theirs), REL, 0.0);
}

pub fn backward_twice_panics_like_burns_own_ops(device: &Device) {
    let device = device.clone();
    let (n, d, v) = (8, 8, 16);
    let t = targets(n, v, 3, -100);
    let e = float(uniform(n * d, 91, 1.0), [n, d], &device).require_grad();
    let c = float(uniform(v * d, 92, 0.5), [v, d], &device).require_grad();
    let cfg = LinearCrossEntropyConfig::new();
    let ours = linear_cross_entropy(e.clone(), c.clone(), int(t.clone(), &device), &cfg);
    let theirs = materialized(e.clone(), c.clone(), None, &t, &cfg.options);
    grads_match("first", &e, &c, &ours.backward(), &theirs.backward());
    let second = |l: Tensor<1>| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| l.backward())).is_err()
    };
    assert_eq!(
        second(ours),
        second(theirs),
        "ours and burn's differ on a second backward"
    );
    // A fresh forward on the same leaves works.
    let ours = linear_cross_entropy(e.clone(), c.clone(), int(t.clone(), &device), &cfg);
    let theirs = materialized(e.clone(), c.clone(), None, &t, &cfg.options);
    grads_match("fresh", &e, &c, &ours.backward(), &theirs.backward());
}

pub fn deterministic_repeat(device: &Device) {
    let device = device.clone();
    let (n, d, v) = (20, 16, 40);
    let t = targets(n, v, 3, -100);
    let e = float(uniform(n * d, 93, 1.0), [n, d], &device).require_grad();
    let c = float(uniform(v * d, 94, 0.5), [v, d], &device).require_grad();
    let cfg = LinearCrossEntropyConfig::new()
        .with_softcap(5.0)
        .with_z_loss(1e-3);
    let run = || {
        let l = linear_cross_entropy(e.clone(), c.clone(), int(t.clone(), &device), &cfg);
        let g = l.backward();
        (
            to_vec(l),
            to_vec(e.grad(&g).unwrap()),
            to_vec(c.grad(&g).unwrap()),
        )
    };
    let a = run();
    let b = run();
    assert!(a
        .0
        .iter()
        .zip(&b.0)
        .all(|(x, y)| x.to_bits() == y.to_bits()));
    assert!(a
        .1
        .iter()
        .zip(&b.1)
        .all(|(x, y)| x.to_bits() == y.to_bits()));
    assert!(a
        .2
        .iter()
        .zip(&b.2)
        .all(|(x, y)| x.to_bits() == y.to_bits()));
}

pub fn all_ignored_sum_and_none_have_zero_gradients(device: &Device) {
    let device = device.clone();
    let (n, d, v) = (5, 8, 16);
    let e = float(uniform(n * d, 95, 1.0), [n, d], &device).require_grad();
    let c = float(uniform(v * d, 96, 0.5), [v, d], &device).require_grad();
    for red in [Reduction::Sum, Reduction::None] {
        let cfg = LinearCrossEntropyConfig::new()
            .with_reduction(red)
            .with_label_smoothing(0.1)
            .with_z_loss(1e-2);
        let l = linear_cross_entropy(e.clone(), c.clone(), int(vec![-100; n], &device), &cfg);
        assert!(to_vec(l.clone()).iter().all(|&x| x == 0.0), "{red:?}");
        let g = l.sum().backward();
        assert!(to_vec(e.grad(&g).unwrap()).iter().all(|&x| x == 0.0));
        assert!(to_vec(c.grad(&g).unwrap()).iter().all(|&x| x == 0.0));
    }
}

pub fn empty_batch_is_a_typed_error(device: &Device) {
    let device = device.clone();
    let e = Tensor::<2>::zeros([0, 8], &device);
    let c = float(uniform(10 * 8, 2, 0.5), [10, 8], &device);
    let y = Tensor::<1, Int>::from_data(TensorData::new(Vec::<i64>::new(), [0]), &device);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        try_linear_cross_entropy(
            e,
            c,
            y,
            &LinearCrossEntropyConfig::new().with_reduction(Reduction::Sum),
        )
    }));
    let r = r.expect("no panic");
    eprintln!("{r:?}");
    if let Err(err) = r {
        assert!(matches!(err, CceError::EmptyInput { .. }), "{err}");
    }
}

pub fn bad_softcap_is_a_typed_error(device: &Device) {
    let device = device.clone();
    let e = float(uniform(4 * 8, 1, 1.0), [4, 8], &device);
    let c = float(uniform(10 * 8, 2, 0.5), [10, 8], &device);
    for s in [0.0, -1.0, f32::NAN] {
        let cfg = LinearCrossEntropyConfig::new().with_softcap(s);
        let err =
            try_linear_cross_entropy(e.clone(), c.clone(), int(vec![1, 2, 3, 4], &device), &cfg)
                .unwrap_err();
        assert!(matches!(err, CceError::InvalidOption { .. }), "{s}: {err}");
    }
}

pub fn negative_target_that_is_not_ignore_index(device: &Device) {
    let device = device.clone();
    let e = float(uniform(4 * 8, 1, 1.0), [4, 8], &device);
    let c = float(uniform(10 * 8, 2, 0.5), [10, 8], &device);
    let err = try_linear_cross_entropy(e, c, int(vec![1, -1, 3, 4], &device), &Default::default())
        .unwrap_err();
    assert!(
        matches!(err, CceError::TargetOutOfRange { row: 1, .. }),
        "{err}"
    );
}

/// Per-row losses reduced in the ways a training loop does (`sum`, `mean`, a slice, a
/// per-sequence mean through a reshape, a broadcast weight): burn's upstream gradients of
/// those can be strided or broadcast views.
pub fn per_row_losses_under_burns_reductions(device: &Device) {
    let device = device.clone();
    let (b, t, d, v) = (3, 6, 8, 20);
    let n = b * t;
    let y = targets(n, v, 5, -100);
    let cfg = LinearCrossEntropyConfig::new().with_reduction(Reduction::None);
    type Reduce = fn(Tensor<1>) -> Tensor<1>;
    let ways: [(&str, Reduce); 5] = [
        ("sum", |l| l.sum()),
        ("mean", |l| l.mean()),
        ("slice", |l| l.slice(4..11).sum()),
        ("per sequence", |l| {
            l.reshape([3, 6]).mean_dim(1).reshape([3]).sum()
        }),
        ("broadcast", |l| {
            let w = l
                .clone()
                .detach()
                .ones_like()
                .reshape([3, 6])
                .sum_dim(0)
                .reshape([6]);
            (l.reshape([3, 6]) * w.unsqueeze::<2>()).sum()
        }),
    ];
    for (name, reduce) in ways {
        let e = float(uniform(n * d, 97, 1.0), [n, d], &device).require_grad();
        let c = float(uniform(v * d, 98, 0.5), [v, d], &device).require_grad();
        let ours = reduce(linear_cross_entropy(
            e.clone(),
            c.clone(),
            int(y.clone(), &device),
            &cfg,
        ));
        let theirs = reduce(materialized(e.clone(), c.clone(), None, &y, &cfg.options));
        assert_close(
            name,
            &to_vec(ours.clone()),
            &to_vec(theirs.clone()),
            REL,
            1e-7,
        );
        grads_match(name, &e, &c, &ours.backward(), &theirs.backward());
    }
}

/// 3-D inputs that are views (`[T, B, D]` hidden states transposed to `[B, T, D]`), shift 1,
/// per-row losses: row `(b, t)` against target `(b, t + 1)`, the last position 0.
pub fn three_d_views_with_shift_and_per_row_losses(device: &Device) {
    let device = device.clone();
    let (b, t, d, v) = (2, 5, 8, 16);
    let tok: Vec<i64> = (0..b * t).map(|i| ((i * 7 + 3) % v) as i64).collect();
    let tbd = float(uniform(t * b * d, 99, 1.0), [t, b, d], &device).require_grad();
    let c = float(uniform(v * d, 100, 0.5), [v, d], &device).require_grad();
    let mut cfg = LinearCrossEntropyConfig::new().with_reduction(Reduction::None);
    cfg.options.shift = 1;
    let y2 = Tensor::<2, Int>::from_data(TensorData::new(tok.clone(), [b, t]), &device);
    let ours = cce_burn::linear_cross_entropy_3d(tbd.clone().swap_dims(0, 1), c.clone(), y2, &cfg);
    assert_eq!(ours.dims(), [b * t]);
    let shifted: Vec<i64> = (0..b * t)
        .map(|i| if i % t == t - 1 { -100 } else { tok[i + 1] })
        .collect();
    let mut plain = cfg.options.clone();
    plain.shift = 0;
    let e2 = tbd.clone().swap_dims(0, 1).reshape([b * t, d]);
    let theirs = materialized(e2, c.clone(), None, &shifted, &plain);
    let (lo, lt) = (to_vec(ours.clone()), to_vec(theirs.clone()));
    assert_close("loss", &lo, &lt, REL, 1e-7);
    assert!((0..b).all(|s| lo[s * t + t - 1] == 0.0));
    let w = float(
        (0..b * t).map(|i| 1.0 + i as f32).collect(),
        [b * t],
        &device,
    );
    let (ga, gb) = (
        (ours * w.clone()).sum().backward(),
        (theirs * w).sum().backward(),
    );
    assert_close(
        "d_tbd",
        &to_vec(tbd.grad(&ga).unwrap()),
        &to_vec(tbd.grad(&gb).unwrap()),
        REL,
        1e-7,
    );
}

/// i64 targets past `i32`: out of range, never truncated to a valid class (`2^32 + 1` would
/// be class 1 in 32 bits); an `ignore_index` past `i32` ignores only its own value.
pub fn wide_i64_targets(device: &Device) {
    if !device.supports_dtype(DType::I64) {
        eprintln!("skipped: i64 not supported on {device:?}");
        return;
    }
    let device = device.clone();
    let (e, c) = errors::small(&device);
    let wide = (1i64 << 32) + 1;
    let i64s =
        |v: Vec<i64>| Tensor::<1, Int>::from_data(TensorData::new(v, [4]), (&device, DType::I64));
    let y = i64s(vec![1, wide, 3, 4]);
    assert_eq!(y.dtype(), DType::I64);
    let err = try_linear_cross_entropy(e.clone(), c.clone(), y, &Default::default()).unwrap_err();
    assert!(
        matches!(err, CceError::TargetOutOfRange { row: 1, value, .. } if value == wide),
        "{err}"
    );
    let cfg = LinearCrossEntropyConfig::new().with_ignore_index(wide);
    let y = i64s(vec![1, wide, 3, 4]);
    let ours = to_vec(linear_cross_entropy(e.clone(), c.clone(), y, &cfg));
    let mut opts = cfg.options.clone();
    opts.ignore_index = -100;
    let theirs = to_vec(materialized(e, c, None, &[1, -100, 3, 4], &opts));
    assert_close("loss", &ours, &theirs, REL, 0.0);
}
