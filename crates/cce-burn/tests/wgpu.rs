//! cce-burn on burn's wgpu backend (lavapipe in CI): the training test of `ndarray.rs` on
//! `Autodiff<Wgpu>`, our WGSL kernels doing the loss. Skips without an adapter unless
//! `CCE_REQUIRE_WGPU=1`.
#![cfg(feature = "wgpu")]

mod common;

use burn::tensor::{Device, DeviceKind};
use cce_burn::{linear_cross_entropy, LinearCrossEntropyConfig};
use common::*;

fn engine_or_skip() -> bool {
    if let Some(w) = cce_burn::cube::wgpu_engine() {
        let info = w.adapter_info();
        eprintln!("our kernels on: {} ({:?})", info.name, info.backend);
        return true;
    }
    if std::env::var("CCE_REQUIRE_WGPU").as_deref() == Ok("1") {
        panic!("CCE_REQUIRE_WGPU=1 but no wgpu adapter for our kernels");
    }
    eprintln!("skipped: no wgpu adapter");
    false
}

#[test]
fn trains_an_lm_head_on_wgpu() {
    if !engine_or_skip() {
        return;
    }
    let device = Device::wgpu(DeviceKind::DefaultDevice).autodiff();
    // Relative tolerance 2e-5 as on NdArray (measured 1.2e-6 on lavapipe).
    let worst = train_and_match(&device, 2e-5);
    eprintln!("wgpu: worst relative gradient error over 5 SGD steps {worst:e}");
}

#[test]
fn bias_and_options_on_wgpu() {
    if !engine_or_skip() {
        return;
    }
    let device = Device::wgpu(DeviceKind::DefaultDevice).autodiff();
    let (n, d, v) = (24, 16, 50);
    let t = targets(n, v, 5, -100);
    let e = float(uniform(n * d, 11, 1.0), [n, d], &device).require_grad();
    let c = float(uniform(v * d, 12, 0.5), [v, d], &device).require_grad();
    let b = float(uniform(v, 13, 0.5), [v], &device).require_grad();
    let cfg = LinearCrossEntropyConfig::new()
        .with_bias(b.clone())
        .with_softcap(2.0)
        .with_label_smoothing(0.1)
        .with_z_loss(1e-3);
    let ours = linear_cross_entropy(e.clone(), c.clone(), int(t.clone(), &device), &cfg);
    let theirs = materialized(e.clone(), c.clone(), Some(b.clone()), &t, &cfg.options);
    assert_close(
        "loss",
        &to_vec(ours.clone()),
        &to_vec(theirs.clone()),
        2e-5,
        0.0,
    );
    let (ga, gb) = (ours.backward(), theirs.backward());
    for (name, a, bb) in [
        ("d_e", e.grad(&ga).map(to_vec), e.grad(&gb).map(to_vec)),
        ("d_c", c.grad(&ga).map(to_vec), c.grad(&gb).map(to_vec)),
        ("d_bias", b.grad(&ga).map(to_vec), b.grad(&gb).map(to_vec)),
    ] {
        assert_close(name, &a.unwrap(), &bb.unwrap(), 2e-5, 1e-7);
    }
}
