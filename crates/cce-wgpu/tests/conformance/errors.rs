//! Bad input, a doctored saved state and non-finite results on the wgpu backend: each a typed
//! error naming what the CPU backend names (part of the `conformance` test binary).

use super::*;

/// A 3 x 2 x 4 f32 problem for the error tests: `e`, `c`, and targets `[0, 3, -100]` (row 2
/// ignored).
fn tiny() -> (HostTensor, HostTensor, HostTensor) {
    let e = HostTensor::from_f32(vec![3, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], F32).unwrap();
    let c = HostTensor::from_f32(
        vec![4, 2],
        &[1.0, -1.0, 0.5, 0.25, 2.0, 1.0, -3.0, 0.1],
        F32,
    )
    .unwrap();
    (e, c, HostTensor::from_i64(vec![0, 3, -100]))
}

#[test]
fn bad_inputs_are_typed_errors() {
    let Some(b) = backend() else { return };
    let (e, c, _) = tiny();
    let (eb, cb) = (b.upload(&e).unwrap(), b.upload(&c).unwrap());
    let bad_y = b.upload(&HostTensor::from_i64(vec![0, 4, 1])).unwrap();
    let inputs = Inputs {
        e: &eb,
        c: &cb,
        bias: None,
        targets: &bad_y,
    };
    match b.forward(&inputs, &Options::default()) {
        Err(CceError::TargetOutOfRange {
            row: 1, value: 4, ..
        }) => {}
        other => panic!("expected TargetOutOfRange, got {other:?}"),
    }
    let mut ev = vec![1.0f32; 6];
    ev[3] = f32::NAN;
    let en = b
        .upload(&HostTensor::from_f32(vec![3, 2], &ev, F32).unwrap())
        .unwrap();
    let y = b.upload(&HostTensor::from_i32(vec![0, 1, 2])).unwrap();
    let inputs = Inputs {
        e: &en,
        c: &cb,
        bias: None,
        targets: &y,
    };
    match b.forward(&inputs, &Options::default()) {
        Err(CceError::NonFinite { row: 1, .. }) => {}
        other => panic!("expected NonFinite at row 1, got {other:?}"),
    }
    let c3 = b
        .upload(&HostTensor::from_f32(vec![4, 3], &[0.5; 12], F32).unwrap())
        .unwrap();
    let inputs = Inputs {
        e: &eb,
        c: &c3,
        bias: None,
        targets: &y,
    };
    assert!(matches!(
        b.forward(&inputs, &Options::default()),
        Err(CceError::ShapeMismatch { .. })
    ));
}

/// A saved state that a forward never writes (a doctored or stale `Saved`) is
/// `NonFinite` under `check_finite`, as on the CPU, not NaN gradients.
#[test]
fn non_finite_saved_state_is_an_error() {
    let Some(b) = backend() else { return };
    let (e, c, _) = tiny();
    let (eb, cb) = (b.upload(&e).unwrap(), b.upload(&c).unwrap());
    let y = b.upload(&HostTensor::from_i64(vec![0, 3, -100])).unwrap();
    let inputs = Inputs {
        e: &eb,
        c: &cb,
        bias: None,
        targets: &y,
    };
    let o = Options::exact();
    let fwd = b.forward(&inputs, &o).unwrap();
    let with = |t: &cce_wgpu::WgpuTensor, row: usize, value: f32| {
        let mut v = b.download(t).unwrap().to_f32_vec();
        v[row] = value;
        b.upload(&HostTensor::from_f32(vec![3], &v, F32).unwrap())
            .unwrap()
    };
    for value in [f32::NAN, f32::INFINITY] {
        let bad = with(&fwd.lse, 1, value);
        let saved = Saved {
            lse: &bad,
            rest_mass: &fwd.rest_mass,
        };
        match b.backward(&inputs, &o, saved, &Upstream::default()) {
            Err(CceError::NonFinite {
                what: "lse",
                row: 1,
                ..
            }) => {}
            other => panic!("lse {value}: expected NonFinite at row 1, got {other:?}"),
        }
        let bad = with(&fwd.rest_mass, 0, value);
        let saved = Saved {
            lse: &fwd.lse,
            rest_mass: &bad,
        };
        match b.backward(&inputs, &o, saved, &Upstream::default()) {
            Err(CceError::NonFinite {
                what: "rest_mass",
                row: 0,
                ..
            }) => {}
            other => panic!("rest_mass {value}: expected NonFinite at row 0, got {other:?}"),
        }
    }
}

/// Under `check_finite` the wgpu backward rejects the saved state and per-row upstream
/// gradients exactly where the CPU backend does (`check_saved_finite`,
/// `check_upstream_finite`: the same error, tensor and row, the first check in the CPU's order
/// winning; −inf lse only at an ignored row), and passes the rest; with it off, nothing.
#[test]
fn saved_and_upstream_checks_match_the_cpu() {
    let Some(b) = backend() else { return };
    let cpu = cce_reference::blocked::CpuBackend::new();
    let (e, c, y) = tiny();
    let (eb, cb, yb) = (
        b.upload(&e).unwrap(),
        b.upload(&c).unwrap(),
        b.upload(&y).unwrap(),
    );
    let gi = Inputs {
        e: &eb,
        c: &cb,
        bias: None,
        targets: &yb,
    };
    let ci = Inputs {
        e: &e,
        c: &c,
        bias: None,
        targets: &y,
    };
    const NAN: f32 = f32::NAN;
    const INF: f32 = f32::INFINITY;
    const NINF: f32 = f32::NEG_INFINITY;
    // (lse, rest_mass, d_loss, d_lse) edits as (row, value); row 2 is ignored.
    type Edit = &'static [(usize, f32)];
    let cases: &[(Edit, Edit, Edit, Edit)] = &[
        (&[(1, NAN)], &[], &[], &[]),
        (&[(0, NINF)], &[], &[], &[]),
        (&[(2, NINF)], &[], &[], &[]),
        (&[(2, NAN)], &[], &[], &[]),
        (&[(2, INF)], &[], &[], &[]),
        (&[], &[(2, INF)], &[], &[]),
        (&[], &[(1, NINF)], &[], &[]),
        (&[(2, NAN)], &[(0, NAN)], &[], &[]),
        (&[], &[(0, NAN)], &[(1, NAN)], &[]),
        (&[], &[], &[(2, NAN)], &[]),
        (&[], &[], &[(1, INF)], &[(0, NAN)]),
        (&[], &[], &[], &[(2, NINF)]),
        (&[(2, NINF)], &[], &[], &[(1, INF), (2, NAN)]),
    ];
    for check_finite in [true, false] {
        let o = Options {
            reduction: Reduction::None,
            check_finite,
            ..Options::exact()
        };
        let fwd = cpu.forward(&ci, &o).unwrap();
        let edit = |t: &HostTensor, edits: Edit| {
            let mut v = t.to_f32_vec();
            for &(row, value) in edits {
                v[row] = value;
            }
            HostTensor::from_f32(vec![3], &v, F32).unwrap()
        };
        for (k, &(l, r, g, h)) in cases.iter().enumerate() {
            let (lse, rest) = (edit(&fwd.lse, l), edit(&fwd.rest_mass, r));
            let ones = HostTensor::from_f32(vec![3], &[1.0; 3], F32).unwrap();
            let (dl, dh) = (edit(&ones, g), edit(&ones, h));
            let up = Upstream {
                d_loss: DLoss::PerRow(&dl),
                d_lse: Some(&dh),
            };
            let want = cpu.backward(
                &ci,
                &o,
                Saved {
                    lse: &lse,
                    rest_mass: &rest,
                },
                &up,
            );
            let [lse_b, rest_b, dl_b, dh_b] = [&lse, &rest, &dl, &dh].map(|t| b.upload(t).unwrap());
            let got = b.backward(
                &gi,
                &o,
                Saved {
                    lse: &lse_b,
                    rest_mass: &rest_b,
                },
                &Upstream {
                    d_loss: DLoss::PerRow(&dl_b),
                    d_lse: Some(&dh_b),
                },
            );
            let key = |r: Result<(), &CceError>| match r {
                Ok(()) => None,
                Err(CceError::NonFinite {
                    what,
                    index,
                    row,
                    value,
                }) => Some((*what, *index, *row, value.to_bits())),
                Err(e) => panic!("case {k}: {e}"),
            };
            assert_eq!(
                key(got.as_ref().map(|_| ())),
                key(want.as_ref().map(|_| ())),
                "case {k} check_finite {check_finite}: wgpu {got:?}, cpu {want:?}",
                got = got.as_ref().err(),
                want = want.as_ref().err()
            );
            // Every case fails a check but case 2 (−inf lse at an ignored row), whose d_lse
            // of 1 then makes the gradients NaN: the CPU's overflow error, not a saved-state one.
            let what = match &want {
                Err(CceError::NonFinite { what, .. }) => Some(*what),
                _ => None,
            };
            if check_finite {
                let overflow = Some("lse or gradients (overflow)");
                assert_eq!(what == overflow, k == 2, "case {k}: {what:?}");
                assert!(what.is_some(), "case {k}");
            }
        }
    }
}

/// Finite inputs whose gradients overflow f32 (`z_loss = f32::MAX`), and a NaN input behind a
/// finite saved state, are the CPU backend's typed error on wgpu too (were NaN gradients).
#[test]
fn non_finite_gradients_are_the_cpus_error() {
    let Some(b) = backend() else { return };
    let cpu = cce_reference::blocked::CpuBackend::new();
    let (e, c, y) = tiny();
    let mut e_nan = e.to_f32_vec();
    e_nan[3] = f32::NAN;
    let e_nan = HostTensor::from_f32(vec![3, 2], &e_nan, F32).unwrap();
    let yb = b.upload(&y).unwrap();
    for (z_loss, doctored) in [(f32::MAX, false), (0.0, true), (1e20, false)] {
        for reduction in [Reduction::Mean, Reduction::Sum] {
            let o = Options {
                z_loss,
                reduction,
                ..Options::exact()
            };
            let ci = Inputs {
                e: &e,
                c: &c,
                bias: None,
                targets: &y,
            };
            let fwd = cpu.forward(&ci, &o).unwrap();
            let e_bwd = if doctored { &e_nan } else { &e };
            let ci = Inputs { e: e_bwd, ..ci };
            let want = cpu.backward(&ci, &o, fwd.saved(), &Upstream::default());
            let (eb, cb) = (b.upload(e_bwd).unwrap(), b.upload(&c).unwrap());
            let (lse, rest) = (
                b.upload(&fwd.lse).unwrap(),
                b.upload(&fwd.rest_mass).unwrap(),
            );
            let gi = Inputs {
                e: &eb,
                c: &cb,
                bias: None,
                targets: &yb,
            };
            let saved = Saved {
                lse: &lse,
                rest_mass: &rest,
            };
            let got = b.backward(&gi, &o, saved, &Upstream::default());
            let case = format!("z_loss {z_loss} doctored {doctored} {reduction:?}");
            match (&got, &want) {
                (Ok(_), Ok(_)) => assert_eq!(z_loss, 1e20, "{case}"),
                (
                    Err(CceError::NonFinite {
                        what: w1, row: r1, ..
                    }),
                    Err(CceError::NonFinite {
                        what: w2, row: r2, ..
                    }),
                ) => {
                    assert_eq!((w1, r1), (w2, r2), "{case}");
                    let expect = if doctored {
                        "e"
                    } else {
                        "lse or gradients (overflow)"
                    };
                    assert_eq!(*w1, expect, "{case}");
                }
                _ => panic!("{case}: wgpu {:?}, cpu {:?}", got.err(), want.err()),
            }
        }
    }
}
