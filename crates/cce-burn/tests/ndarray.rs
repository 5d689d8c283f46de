//! cce-burn on burn's NdArray backend (CPU), with and without autodiff, against burn's own
//! materialized loss and gradients in f32.
#![cfg(feature = "ndarray")]
// burn 0.22 deprecates NdArray (for Flex); it is the backend under test here.
#![allow(deprecated)]

mod common;

use burn::tensor::{Device, Tensor};
use cce_burn::{
    linear_cross_entropy, linear_cross_entropy_3d, LinearCrossEntropyConfig, Reduction,
};
use common::*;

/// Relative tolerance of losses and gradients (max |diff| over max |reference|) in f32: both
/// sides round differently (blockwise online softmax vs. burn's log_softmax); measured 3.2e-7
/// over the 5 training steps.
const REL: f32 = 2e-5;

fn ad() -> Device {
    Device::ndarray().autodiff()
}

#[test]
fn trains_an_lm_head_like_burns_materialized_loss() {
    let worst = train_and_match(&ad(), REL);
    eprintln!("ndarray: worst relative gradient error over 5 SGD steps {worst:e}");
}

/// One configuration: loss and the gradients of e, c (and bias) against the materialized
/// reference.
fn check(cfg: LinearCrossEntropyConfig, t: Vec<i64>, with_bias: bool) {
    let device = ad();
    let (n, d, v) = (t.len(), 16, 50);
    let e = float(uniform(n * d, 11, 1.0), [n, d], &device).require_grad();
    let c = float(uniform(v * d, 12, 0.5), [v, d], &device).require_grad();
    let b = float(uniform(v, 13, 0.5), [v], &device).require_grad();
    let cfg = if with_bias {
        cfg.with_bias(b.clone())
    } else {
        cfg
    };
    let ours = linear_cross_entropy(e.clone(), c.clone(), int(t.clone(), &device), &cfg);
    let theirs = materialized(
        e.clone(),
        c.clone(),
        with_bias.then(|| b.clone()),
        &t,
        &cfg.options,
    );
    assert_eq!(ours.dims(), theirs.dims());
    assert_close(
        "loss",
        &to_vec(ours.clone()),
        &to_vec(theirs.clone()),
        REL,
        1e-7,
    );
    // A per-row loss is reduced with weights so that every row's gradient is exercised with
    // its own upstream value.
    let (ours, theirs) = if cfg.options.reduction == Reduction::None {
        let w = float(
            (0..n).map(|i| 0.5 + i as f32 / n as f32).collect(),
            [n],
            &device,
        );
        ((ours * w.clone()).sum(), (theirs * w).sum())
    } else {
        (ours, theirs)
    };
    let (ga, gb) = (ours.backward(), theirs.backward());
    let g = |t: Option<Tensor<2>>| to_vec(t.expect("gradient"));
    let gb1 = |t: Option<Tensor<1>>| to_vec(t.expect("gradient"));
    assert_close("d_e", &g(e.grad(&ga)), &g(e.grad(&gb)), REL, 1e-7);
    assert_close("d_c", &g(c.grad(&ga)), &g(c.grad(&gb)), REL, 1e-7);
    if with_bias {
        assert_close("d_bias", &gb1(b.grad(&ga)), &gb1(b.grad(&gb)), REL, 1e-7);
    }
}

#[test]
fn reductions() {
    for r in [Reduction::Mean, Reduction::Sum, Reduction::None] {
        check(
            LinearCrossEntropyConfig::new().with_reduction(r),
            targets(24, 50, 5, -100),
            false,
        );
    }
}

#[test]
fn custom_ignore_index() {
    check(
        LinearCrossEntropyConfig::new().with_ignore_index(-1),
        targets(24, 50, 4, -1),
        false,
    );
}

#[test]
fn bias_is_trained() {
    check(
        LinearCrossEntropyConfig::new(),
        targets(24, 50, 5, -100),
        true,
    );
}

#[test]
fn softcap() {
    check(
        LinearCrossEntropyConfig::new().with_softcap(1.5),
        targets(24, 50, 5, -100),
        true,
    );
}

#[test]
fn label_smoothing() {
    check(
        LinearCrossEntropyConfig::new().with_label_smoothing(0.1),
        targets(24, 50, 5, -100),
        false,
    );
}

#[test]
fn z_loss() {
    check(
        LinearCrossEntropyConfig::new()
            .with_z_loss(1e-2)
            .with_reduction(Reduction::Sum),
        targets(24, 50, 5, -100),
        false,
    );
}

#[test]
fn every_option_at_once() {
    check(
        LinearCrossEntropyConfig::new()
            .with_softcap(2.0)
            .with_label_smoothing(0.05)
            .with_z_loss(1e-3)
            .with_reduction(Reduction::None),
        targets(24, 50, 5, -100),
        true,
    );
}

#[test]
fn only_c_requires_grad() {
    // A frozen e (no gradient asked) and a trainable classifier.
    let device = ad();
    let (n, d, v) = (16, 8, 40);
    let t = targets(n, v, 0, -100);
    let e = float(uniform(n * d, 3, 1.0), [n, d], &device);
    let c = float(uniform(v * d, 4, 0.5), [v, d], &device).require_grad();
    let cfg = LinearCrossEntropyConfig::new();
    let g = linear_cross_entropy(e.clone(), c.clone(), int(t.clone(), &device), &cfg).backward();
    let gb = materialized(e.clone(), c.clone(), None, &t, &cfg.options).backward();
    assert!(e.grad(&g).is_none());
    assert_close(
        "d_c",
        &to_vec(c.grad(&g).unwrap()),
        &to_vec(c.grad(&gb).unwrap()),
        REL,
        1e-7,
    );
}

#[test]
fn forward_without_autodiff() {
    let device = Device::ndarray();
    let (n, d, v) = (20, 8, 30);
    let t = targets(n, v, 6, -100);
    let e = float(uniform(n * d, 5, 1.0), [n, d], &device);
    let c = float(uniform(v * d, 6, 0.5), [v, d], &device);
    let cfg = LinearCrossEntropyConfig::new();
    let ours = linear_cross_entropy(e.clone(), c.clone(), int(t.clone(), &device), &cfg);
    let theirs = materialized(e, c, None, &t, &cfg.options);
    assert_close("loss", &to_vec(ours), &to_vec(theirs), REL, 0.0);
}

#[test]
fn three_d_with_shift() {
    // e [B, T, D], targets [B, T]; shift 1: row (b, t) predicts token (b, t + 1), the last
    // position of each sequence has no target.
    let device = ad();
    let (bsz, len, d, v) = (3, 8, 8, 30);
    let tok: Vec<i64> = (0..bsz * len).map(|i| ((i * 31 + 7) % v) as i64).collect();
    let e3 = float(uniform(bsz * len * d, 7, 1.0), [bsz, len, d], &device).require_grad();
    let c = float(uniform(v * d, 8, 0.5), [v, d], &device).require_grad();
    let mut cfg = LinearCrossEntropyConfig::new();
    cfg.options.shift = 1;
    let t2 = Tensor::<2, burn::tensor::Int>::from_data(
        burn::tensor::TensorData::new(tok.clone(), [bsz, len]),
        &device,
    );
    let ours = linear_cross_entropy_3d(e3.clone(), c.clone(), t2, &cfg);
    // Reference: the shifted targets written out, last position of each sequence ignored.
    let shifted: Vec<i64> = (0..bsz * len)
        .map(|i| if i % len == len - 1 { -100 } else { tok[i + 1] })
        .collect();
    let mut plain = cfg.options.clone();
    plain.shift = 0;
    let theirs = materialized(
        e3.clone().reshape([bsz * len, d]),
        c.clone(),
        None,
        &shifted,
        &plain,
    );
    assert_close(
        "loss",
        &to_vec(ours.clone()),
        &to_vec(theirs.clone()),
        REL,
        0.0,
    );
    let (ga, gb) = (ours.backward(), theirs.backward());
    assert_close(
        "d_e",
        &to_vec(e3.grad(&ga).unwrap().reshape([bsz * len, d])),
        &to_vec(e3.grad(&gb).unwrap().reshape([bsz * len, d])),
        REL,
        1e-7,
    );
}

// ---- Bad input: one test per typed error (common/errors.rs).

#[test]
fn shape_mismatch() {
    errors::shape_mismatch(&ad());
}

#[test]
fn target_out_of_range() {
    errors::target_out_of_range(&ad());
}

#[test]
fn non_finite_input() {
    errors::non_finite_input(&ad());
}

#[test]
fn all_targets_ignored() {
    errors::all_targets_ignored(&ad());
}

#[test]
fn invalid_option() {
    errors::invalid_option(&ad());
}

#[test]
fn plain_function_panics_with_the_message() {
    errors::plain_function_panics_with_the_message(&ad());
}
