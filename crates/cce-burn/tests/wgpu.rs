//! cce-burn on burn's wgpu backend (lavapipe in CI): the training test of `ndarray.rs` on
//! `Autodiff<Wgpu>`, our WGSL kernels doing the loss on burn's own device and queue
//! (`cube::init_wgpu`) with no tensor moved through the host (`host_copies` does not move),
//! and the host path of an unregistered wgpu device. Skips without an adapter unless
//! `CCE_REQUIRE_WGPU=1`.
#![cfg(feature = "wgpu")]

mod common;

use burn::tensor::{Device, DeviceKind};
use cce_burn::{
    host_copies, linear_cross_entropy, try_linear_cross_entropy, CceError,
    LinearCrossEntropyConfig, Reduction,
};
use common::*;
use std::sync::{Mutex, MutexGuard, OnceLock};

/// Serializes the tests of this file: each reads the process-wide `host_copies` before and
/// after its own calls.
fn lock() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// burn's default wgpu device, brought up by `cube::init_wgpu` (our kernels registered on its
/// device and queue) before any tensor touches it; `None` (skip) without an adapter.
fn device() -> Option<Device> {
    static DEVICE: OnceLock<Result<Device, String>> = OnceLock::new();
    let init = || cce_burn::cube::init_wgpu(Device::wgpu_options()).map_err(|e| e.to_string());
    match DEVICE.get_or_init(init) {
        Ok(d) => {
            let engine = cce_burn::cube::registered_engine(d).expect("registered");
            let info = engine.adapter_info();
            eprintln!(
                "our kernels on burn's device: {} ({:?})",
                info.name, info.backend
            );
            Some(d.clone())
        }
        Err(e) => {
            if std::env::var("CCE_REQUIRE_WGPU").as_deref() == Ok("1") {
                panic!("CCE_REQUIRE_WGPU=1 but no wgpu device: {e}");
            }
            eprintln!("skipped: {e}");
            None
        }
    }
}

#[test]
fn trains_an_lm_head_on_wgpu_without_host_copies() {
    let _serial = lock();
    let Some(device) = device() else { return };
    let before = host_copies();
    // Relative tolerance 2e-5 as on NdArray (measured 1.2e-6 on lavapipe).
    let worst = train_and_match(&device.autodiff(), 2e-5);
    eprintln!("wgpu: worst relative gradient error over 5 SGD steps {worst:e}");
    assert_eq!(host_copies(), before, "tensors went through the host");
}

#[test]
fn bias_and_options_on_wgpu() {
    let _serial = lock();
    let Some(device) = device() else { return };
    let before = host_copies();
    let device = device.autodiff();
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
    assert_eq!(host_copies(), before, "tensors went through the host");
}

#[test]
fn sum_and_per_row_losses_and_a_typed_error_on_wgpu() {
    let _serial = lock();
    let Some(device) = device() else { return };
    let before = host_copies();
    let device = device.autodiff();
    let (n, d, v) = (40, 24, 70);
    let t = targets(n, v, 6, -100);
    for r in [Reduction::Sum, Reduction::None] {
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
            2e-5,
            1e-7,
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
            assert_close(name, &a.unwrap(), &b.unwrap(), 2e-5, 1e-7);
        }
    }
    let e = float(uniform(4 * d, 33, 1.0), [4, d], &device);
    let c = float(uniform(v * d, 34, 0.5), [v, d], &device);
    let y = int(vec![1, v as i64, 3, 4], &device);
    let err = try_linear_cross_entropy(e, c, y, &Default::default()).unwrap_err();
    assert!(
        matches!(err, CceError::TargetOutOfRange { row: 1, .. }),
        "{err}"
    );
    assert_eq!(host_copies(), before, "tensors went through the host");
}

/// Whether there is a CPU adapter (lavapipe), on which burn brings up a second, unregistered
/// runtime for `DeviceKind::Cpu`.
fn has_cpu_adapter() -> bool {
    use burn::tensor::wgpu::wgpu;
    let instance =
        wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
    let adapters = block_on(instance.enumerate_adapters(wgpu::Backends::all()));
    adapters
        .iter()
        .any(|a| a.get_info().device_type == wgpu::DeviceType::Cpu)
}

/// Drive a future that completes without waiting (wgpu's adapter enumeration on native).
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    loop {
        if let std::task::Poll::Ready(out) = f.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::yield_now();
    }
}

#[test]
fn an_unregistered_wgpu_device_goes_through_the_host() {
    let _serial = lock();
    if device().is_none() {
        return;
    }
    if !has_cpu_adapter() {
        eprintln!("skipped: no CPU adapter for a second, unregistered wgpu device");
        return;
    }
    let device = Device::wgpu(DeviceKind::Cpu).autodiff();
    assert!(cce_burn::cube::registered_engine(&device).is_none());
    let before = host_copies();
    let (n, d, v) = (20, 8, 30);
    let t = targets(n, v, 4, -100);
    let e = float(uniform(n * d, 21, 1.0), [n, d], &device).require_grad();
    let c = float(uniform(v * d, 22, 0.5), [v, d], &device).require_grad();
    let cfg = LinearCrossEntropyConfig::new();
    let ours = linear_cross_entropy(e.clone(), c.clone(), int(t.clone(), &device), &cfg);
    let ga = ours.clone().backward();
    // Forward: e, c, targets in, loss, lse, rest_mass out; backward: those three inputs, lse,
    // rest_mass and d_loss in, d_e and d_c out.
    assert_eq!(host_copies() - before, 6 + 8);
    let theirs = materialized(e.clone(), c.clone(), None, &t, &cfg.options);
    assert_close("loss", &to_vec(ours), &to_vec(theirs.clone()), 2e-5, 0.0);
    let gb = theirs.backward();
    let (a, b) = (e.grad(&ga).map(to_vec), e.grad(&gb).map(to_vec));
    assert_close("d_e", &a.unwrap(), &b.unwrap(), 2e-5, 1e-7);
}

/// A new user's checks (`common/user.rs`) on `Autodiff<Wgpu>` on the registered device.
macro_rules! on_wgpu {
    ($($name:ident),* $(,)?) => {
        mod user_checks {
            use super::*;
            $(#[test] fn $name() {
                let _serial = lock();
                let Some(device) = device() else { return };
                common::user::$name(&device.autodiff());
            })*
        }
    };
}

common::user::with_user_checks!(on_wgpu);

/// Views (a slice of `e`, a transposed `c`) stay on the device: copied there, not through the
/// host.
#[test]
fn views_stay_on_the_device() {
    let _serial = lock();
    let Some(device) = device() else { return };
    let before = host_copies();
    common::user::sliced_and_transposed_inputs(&device.autodiff());
    assert_eq!(host_copies(), before, "tensors went through the host");
}

/// Inputs on two backends (`e` on wgpu, `c` on NdArray): a typed error, not a panic in burn's
/// routing.
#[cfg(feature = "ndarray")]
#[test]
#[allow(deprecated)] // NdArray: burn 0.22's documented CPU backend, deprecated for Flex.
fn inputs_on_two_backends_are_a_typed_error() {
    let _serial = lock();
    let Some(device) = device() else { return };
    let cpu = Device::ndarray();
    let (e, _) = errors::small(&device);
    let (_, c) = errors::small(&cpu);
    for (e, c, y) in [
        (e.clone(), c.clone(), int(vec![1, 2, 3, 4], &device)),
        (
            e.clone(),
            errors::small(&device).1,
            int(vec![1, 2, 3, 4], &cpu),
        ),
    ] {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            try_linear_cross_entropy(e, c, y, &Default::default())
        }));
        let err = r.expect("no panic").unwrap_err();
        assert!(matches!(err, CceError::Unsupported { .. }), "{err}");
        assert!(err.to_string().contains("to_device"), "{err}");
    }
}
