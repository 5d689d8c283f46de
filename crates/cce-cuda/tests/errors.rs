//! Bad inputs give typed errors on the device, never a panic or a silent NaN.

mod common;

use cce_core::{Backend, CceError, DType, HostTensor, Inputs, Options, Saved, Upstream};
use common::*;

#[test]
fn typed_errors() {
    let Some(be) = backend("typed_errors") else {
        return;
    };
    let mut rng = seeded();
    let case = random_case(&mut rng, 10, 8, 20, DType::F32, false, 0.0, 3.0);
    let (e, c) = (be.upload(&case.e).unwrap(), be.upload(&case.c).unwrap());
    // Target out of range names the row and value.
    let mut raw = case.targets.to_i64_vec().unwrap();
    raw[3] = 20;
    let bad_t = be.upload(&HostTensor::from_i64(raw)).unwrap();
    let inputs = Inputs {
        e: &e,
        c: &c,
        bias: None,
        targets: &bad_t,
    };
    match be.forward(&inputs, &Options::default()) {
        Err(CceError::TargetOutOfRange {
            row: 3,
            value: 20,
            vocab_size: 20,
            ..
        }) => {}
        other => panic!("expected TargetOutOfRange, got {other:?}"),
    }
    // NaN in e is located (row 6, column 2).
    let mut ev = case.e.to_f32_vec();
    ev[6 * 8 + 2] = f32::NAN;
    let e_nan = be
        .upload(&HostTensor::from_f32(vec![10, 8], &ev, DType::F32).unwrap())
        .unwrap();
    let t = be.upload(&case.targets).unwrap();
    let inputs = Inputs {
        e: &e_nan,
        c: &c,
        bias: None,
        targets: &t,
    };
    match be.forward(&inputs, &Options::default()) {
        Err(CceError::NonFinite {
            what: "e",
            index: 50,
            row: 6,
            ..
        }) => {}
        other => panic!("expected NonFinite in e, got {other:?}"),
    }
    // Inf in c is located too.
    let mut cv = case.c.to_f32_vec();
    cv[11 * 8 + 5] = f32::INFINITY;
    let c_inf = be
        .upload(&HostTensor::from_f32(vec![20, 8], &cv, DType::F32).unwrap())
        .unwrap();
    let inputs = Inputs {
        e: &e,
        c: &c_inf,
        bias: None,
        targets: &t,
    };
    match be.forward(&inputs, &Options::default()) {
        Err(CceError::NonFinite {
            what: "c",
            index: 93,
            row: 11,
            ..
        }) => {}
        other => panic!("expected NonFinite in c, got {other:?}"),
    }
    // Shape mismatch of c's D.
    let c_bad = be
        .upload(&HostTensor::from_f32(vec![20, 7], &vec![0.5; 140], DType::F32).unwrap())
        .unwrap();
    let inputs = Inputs {
        e: &e,
        c: &c_bad,
        bias: None,
        targets: &t,
    };
    assert!(matches!(
        be.forward(&inputs, &Options::default()),
        Err(CceError::ShapeMismatch { .. })
    ));
    // dtype mismatch.
    let c16 = be
        .upload(&HostTensor::from_f32(vec![20, 8], &case.c.to_f32_vec(), DType::BF16).unwrap())
        .unwrap();
    let inputs = Inputs {
        e: &e,
        c: &c16,
        bias: None,
        targets: &t,
    };
    assert!(matches!(
        be.forward(&inputs, &Options::default()),
        Err(CceError::DTypeMismatch { .. })
    ));
    // lse of the wrong shape in backward.
    let inputs = Inputs {
        e: &e,
        c: &c,
        bias: None,
        targets: &t,
    };
    let lse_bad = be
        .upload(&HostTensor::from_f32(vec![9], &[0.0; 9], DType::F32).unwrap())
        .unwrap();
    assert!(matches!(
        be.backward(
            &inputs,
            &Options::default(),
            Saved {
                lse: &lse_bad,
                rest_mass: &lse_bad,
            },
            &Upstream::default()
        ),
        Err(CceError::ShapeMismatch { what: "lse", .. })
    ));
    // A scalar upstream gradient for a per-row loss is rejected.
    let none = Options {
        reduction: cce_core::Reduction::None,
        ..Options::default()
    };
    let fwd = be.forward(&inputs, &none).unwrap();
    assert!(matches!(
        be.backward(&inputs, &none, fwd.saved(), &Upstream::default()),
        Err(CceError::ShapeMismatch { what: "d_loss", .. })
    ));
    // A too-small workspace budget is a resource error, not a crash.
    let tiny = Options {
        workspace_budget_bytes: 16,
        ..Options::default()
    };
    assert!(matches!(
        be.forward(&inputs, &tiny),
        Err(CceError::ResourceLimit { .. })
    ));
}

#[test]
fn construction_without_a_device_is_a_typed_error() {
    // On a machine without CUDA this is the NoDevice path; on a GPU machine a bad ordinal is.
    match cce_cuda::CudaBackend::new(1 << 20) {
        Err(CceError::NoDevice { reason, .. }) => eprintln!("NoDevice: {reason}"),
        other => panic!("expected NoDevice, got {other:?}"),
    }
}
