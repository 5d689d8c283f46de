//! cce-burn on burn's CUDA backend: the training test of `ndarray.rs` on `Autodiff<Cuda>`, our
//! CUDA kernels doing the loss in burn's own buffers with no tensor moved through the host
//! (`host_copies` does not move) and two host synchronizations per forward and per backward
//! (`cube::cuda_host_syncs`), one test per typed error, and the host path of tensors the
//! in-place path does not take. Skips without a usable CUDA device unless `CCE_REQUIRE_CUDA=1`.
//!
//! Tolerance: burn's reference is its own materialized loss on the same device, whose f32
//! matmuls may run on TF32 tensor cores (burn-cubecl promotes f32 to tf32 where the tile matmul
//! needs an accelerator); ours keeps f32 products (cuBLAS `CUBLAS_COMPUTE_32F`). Relative
//! 5e-3 of the largest reference value covers TF32's 10-bit mantissa; the tests print the
//! worst error measured.
#![cfg(feature = "cuda")]

mod common;

use burn::tensor::{Device, FloatDType, IntDType};
use cce_burn::cube::{cuda_host_syncs, cuda_ready};
use cce_burn::{
    host_copies, linear_cross_entropy, try_linear_cross_entropy, CceError,
    LinearCrossEntropyConfig, Reduction,
};
use common::*;
use std::sync::{Mutex, MutexGuard, OnceLock};

/// Relative tolerance of losses and gradients (see the module docs).
const REL: f32 = 5e-3;

/// Serializes the tests of this file: each reads the process-wide counters before and after
/// its own calls.
fn lock() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// burn's CUDA device 0 once our backend for it is made (`cuda_ready`, which touches no burn
/// runtime: without a driver burn's own CUDA runtime would panic on first use); `None` (skip)
/// without one.
fn device() -> Option<Device> {
    static READY: OnceLock<Result<(), String>> = OnceLock::new();
    let device = Device::cuda(0usize);
    match READY.get_or_init(|| cuda_ready(&device).map_err(|e| e.to_string())) {
        Ok(()) => Some(device),
        Err(e) => {
            if std::env::var("CCE_REQUIRE_CUDA").as_deref() == Ok("1") {
                panic!("CCE_REQUIRE_CUDA=1 but our CUDA backend is not usable: {e}");
            }
            eprintln!("skipped: no usable CUDA device ({e})");
            None
        }
    }
}

/// The host copies and host synchronizations a closure made.
fn counted<R>(f: impl FnOnce() -> R) -> (R, u64, u64) {
    let (copies, syncs) = (host_copies(), cuda_host_syncs());
    let r = f();
    (r, host_copies() - copies, cuda_host_syncs() - syncs)
}

#[test]
fn trains_an_lm_head_on_cuda_without_host_copies() {
    let _serial = lock();
    let Some(device) = device() else { return };
    let (worst, copies, syncs) = counted(|| train_and_match(&device.autodiff(), REL));
    eprintln!("cuda: worst relative gradient error over 5 SGD steps {worst:e}");
    assert_eq!(copies, 0, "tensors went through the host");
    // 5 steps of a forward and a backward, two waits each.
    assert_eq!(syncs, 5 * 4, "host synchronizations");
}

#[test]
fn bias_and_options_on_cuda() {
    let _serial = lock();
    let Some(device) = device() else { return };
    let device = device.autodiff();
    let (n, d, v) = (24, 16, 50);
    let t = targets(n, v, 5, -100);
    let ((), copies, _) = counted(|| {
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
        let err = assert_close(
            "loss",
            &to_vec(ours.clone()),
            &to_vec(theirs.clone()),
            REL,
            0.0,
        );
        eprintln!("cuda, every option: loss relative error {err:e}");
        let (ga, gb) = (ours.backward(), theirs.backward());
        for (name, a, bb) in [
            ("d_e", e.grad(&ga).map(to_vec), e.grad(&gb).map(to_vec)),
            ("d_c", c.grad(&ga).map(to_vec), c.grad(&gb).map(to_vec)),
            ("d_bias", b.grad(&ga).map(to_vec), b.grad(&gb).map(to_vec)),
        ] {
            let err = assert_close(name, &a.unwrap(), &bb.unwrap(), REL, 1e-6);
            eprintln!("cuda, every option: {name} relative error {err:e}");
        }
    });
    assert_eq!(copies, 0, "tensors went through the host");
}

#[test]
fn sum_and_per_row_losses_on_cuda() {
    let _serial = lock();
    let Some(device) = device() else { return };
    let device = device.autodiff();
    let (n, d, v) = (40, 24, 70);
    let t = targets(n, v, 6, -100);
    for r in [Reduction::Sum, Reduction::None] {
        let ((), copies, _) = counted(|| {
            let e = float(uniform(n * d, 31, 1.0), [n, d], &device).require_grad();
            let c = float(uniform(v * d, 32, 0.5), [v, d], &device).require_grad();
            let cfg = LinearCrossEntropyConfig::new().with_reduction(r);
            let ours = linear_cross_entropy(e.clone(), c.clone(), int(t.clone(), &device), &cfg);
            let theirs = materialized(e.clone(), c.clone(), None, &t, &cfg.options);
            assert_eq!(ours.dims(), theirs.dims());
            let what = format!("{r:?} loss");
            assert_close(
                &what,
                &to_vec(ours.clone()),
                &to_vec(theirs.clone()),
                REL,
                1e-6,
            );
            // Per-row losses weighted, so that every row has its own upstream gradient.
            let (ours, theirs) = if r == Reduction::None {
                let w: Vec<f32> = (0..n).map(|i| 0.5 + i as f32 / n as f32).collect();
                let w = float(w, [n], &device);
                ((ours * w.clone()).sum(), (theirs * w).sum())
            } else {
                (ours, theirs)
            };
            let (ga, gb) = (ours.backward(), theirs.backward());
            for (name, a, b) in [
                ("d_e", e.grad(&ga).map(to_vec), e.grad(&gb).map(to_vec)),
                ("d_c", c.grad(&ga).map(to_vec), c.grad(&gb).map(to_vec)),
            ] {
                assert_close(name, &a.unwrap(), &b.unwrap(), REL, 1e-6);
            }
        });
        assert_eq!(copies, 0, "{r:?}: tensors went through the host");
    }
}

#[test]
fn targets_of_another_integer_dtype_go_through_the_host() {
    let _serial = lock();
    let Some(device) = device() else { return };
    let device = device.autodiff();
    let (n, d, v) = (20, 8, 30);
    let t = targets(n, v, 0, -100);
    let e = float(uniform(n * d, 21, 1.0), [n, d], &device).require_grad();
    let c = float(uniform(v * d, 22, 0.5), [v, d], &device).require_grad();
    let cfg = LinearCrossEntropyConfig::new();
    let y = int(t.clone(), &device).cast(IntDType::U32);
    let ((ours, ga), copies, syncs) = counted(|| {
        let ours = linear_cross_entropy(e.clone(), c.clone(), y, &cfg);
        let ga = ours.clone().backward();
        (ours, ga)
    });
    // Forward: e, c, targets in, loss, lse, rest_mass out; backward: those three inputs, lse,
    // rest_mass and d_loss in, d_e and d_c out. Our backend on its own stream, eager checks.
    assert_eq!(copies, 6 + 8);
    assert_eq!(
        syncs, 0,
        "the host path makes none of the in-place path's waits"
    );
    let theirs = materialized(e.clone(), c.clone(), None, &t, &cfg.options);
    assert_close("loss", &to_vec(ours), &to_vec(theirs.clone()), REL, 0.0);
    let gb = theirs.backward();
    let (a, b) = (e.grad(&ga).map(to_vec), e.grad(&gb).map(to_vec));
    assert_close("d_e", &a.unwrap(), &b.unwrap(), REL, 1e-6);
}

// ---- Bad input: one test per typed error (common/errors.rs), on the in-place path (the checks run
// on the device and reach the call through our backend's status) unless the test says otherwise.

#[test]
fn shape_mismatch() {
    let _serial = lock();
    let Some(device) = device() else { return };
    errors::shape_mismatch(&device.autodiff());
}

#[test]
fn target_out_of_range() {
    let _serial = lock();
    let Some(device) = device() else { return };
    errors::target_out_of_range(&device.autodiff());
}

#[test]
fn non_finite_input() {
    let _serial = lock();
    let Some(device) = device() else { return };
    errors::non_finite_input(&device.autodiff());
}

#[test]
fn all_targets_ignored() {
    let _serial = lock();
    let Some(device) = device() else { return };
    errors::all_targets_ignored(&device.autodiff());
}

#[test]
fn invalid_option() {
    let _serial = lock();
    let Some(device) = device() else { return };
    errors::invalid_option(&device.autodiff());
}

#[test]
fn plain_function_panics_with_the_message() {
    let _serial = lock();
    let Some(device) = device() else { return };
    errors::plain_function_panics_with_the_message(&device.autodiff());
}

#[test]
fn dtype_mismatch_through_the_host() {
    let _serial = lock();
    let Some(device) = device() else { return };
    let device = device.autodiff();
    let (e, c) = errors::small(&device);
    // Mixed dtypes are not the in-place path's: the host path's engine (our backend) refuses.
    let (r, copies, _) = counted(|| {
        try_linear_cross_entropy(
            e.cast(FloatDType::F16),
            c,
            int(vec![1, 2, 3, 4], &device),
            &Default::default(),
        )
    });
    let err = r.unwrap_err();
    assert!(matches!(err, CceError::DTypeMismatch { .. }), "{err}");
    assert!(copies > 0, "the host path was taken");
}
