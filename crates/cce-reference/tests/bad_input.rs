//! One test per class of bad input, each asserting the exact error variant (CPU backend).

use cce_core::options::{FilterEps, Options, Reduction};
use cce_core::{Backend, CceError, DLoss, DType, HostTensor, Inputs, Saved, TensorMeta, Upstream};
use cce_reference::CpuBackend;

fn t(shape: &[usize], dt: DType, seed: f32) -> HostTensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| ((i as f32 + seed) * 0.7).sin()).collect();
    HostTensor::from_f32(shape.to_vec(), &v, dt).unwrap()
}

fn fwd(
    e: &HostTensor,
    c: &HostTensor,
    b: Option<&HostTensor>,
    y: &HostTensor,
    o: &Options,
) -> Result<(), CceError> {
    CpuBackend::new()
        .forward(
            &Inputs {
                e,
                c,
                bias: b,
                targets: y,
            },
            o,
        )
        .map(|_| ())
}

#[test]
fn shape_mismatch_in_hidden_size() {
    let r = fwd(
        &t(&[4, 8], DType::F32, 1.0),
        &t(&[10, 7], DType::F32, 2.0),
        None,
        &HostTensor::from_i64(vec![1; 4]),
        &Options::default(),
    );
    assert!(
        matches!(
            r,
            Err(CceError::ShapeMismatch {
                what: "c (hidden size D)",
                ..
            })
        ),
        "{r:?}"
    );
}

#[test]
fn shape_mismatch_in_targets_and_bias() {
    let (e, c) = (t(&[4, 8], DType::F32, 1.0), t(&[10, 8], DType::F32, 2.0));
    let r = fwd(
        &e,
        &c,
        None,
        &HostTensor::from_i64(vec![1; 5]),
        &Options::default(),
    );
    assert!(
        matches!(
            r,
            Err(CceError::ShapeMismatch {
                what: "targets",
                ..
            })
        ),
        "{r:?}"
    );
    let r = fwd(
        &e,
        &c,
        Some(&t(&[9], DType::F32, 0.0)),
        &HostTensor::from_i64(vec![1; 4]),
        &Options::default(),
    );
    assert!(
        matches!(r, Err(CceError::ShapeMismatch { what: "bias", .. })),
        "{r:?}"
    );
}

#[test]
fn dtype_mismatch() {
    let r = fwd(
        &t(&[4, 8], DType::F32, 1.0),
        &t(&[10, 8], DType::BF16, 2.0),
        None,
        &HostTensor::from_i64(vec![1; 4]),
        &Options::default(),
    );
    assert!(
        matches!(
            r,
            Err(CceError::DTypeMismatch {
                what: "c",
                got: DType::BF16,
                ..
            })
        ),
        "{r:?}"
    );
    let y = t(&[4], DType::F32, 0.0);
    let r = fwd(
        &t(&[4, 8], DType::F32, 1.0),
        &t(&[10, 8], DType::F32, 2.0),
        None,
        &y,
        &Options::default(),
    );
    assert!(
        matches!(
            r,
            Err(CceError::DTypeMismatch {
                what: "targets",
                ..
            })
        ),
        "{r:?}"
    );
}

#[test]
fn target_out_of_range_names_row_and_value() {
    for (bad, row) in [(10i64, 2usize), (-1, 0), (1 << 40, 3)] {
        let mut y = vec![3i64; 4];
        y[row] = bad;
        let r = fwd(
            &t(&[4, 8], DType::F32, 1.0),
            &t(&[10, 8], DType::F32, 2.0),
            None,
            &HostTensor::from_i64(y),
            &Options::default(),
        );
        match r {
            Err(CceError::TargetOutOfRange {
                row: r0,
                value,
                vocab_size: 10,
                ignore_index: -100,
            }) => {
                assert_eq!((r0, value), (row, bad))
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn non_finite_inputs_are_named() {
    let y = HostTensor::from_i64(vec![1; 4]);
    let mut ev = t(&[4, 8], DType::F32, 1.0).to_f32_vec();
    ev[13] = f32::NAN;
    let e = HostTensor::from_f32(vec![4, 8], &ev, DType::F32).unwrap();
    let r = fwd(
        &e,
        &t(&[10, 8], DType::F32, 2.0),
        None,
        &y,
        &Options::default(),
    );
    assert!(
        matches!(
            r,
            Err(CceError::NonFinite {
                what: "e",
                index: 13,
                row: 1,
                ..
            })
        ),
        "{r:?}"
    );
    let mut cv = t(&[10, 8], DType::F32, 2.0).to_f32_vec();
    cv[77] = f32::INFINITY;
    let c = HostTensor::from_f32(vec![10, 8], &cv, DType::F32).unwrap();
    let r = fwd(
        &t(&[4, 8], DType::F32, 1.0),
        &c,
        None,
        &y,
        &Options::default(),
    );
    assert!(
        matches!(
            r,
            Err(CceError::NonFinite {
                what: "c",
                index: 77,
                row: 9,
                ..
            })
        ),
        "{r:?}"
    );
}

#[test]
fn empty_batch_is_an_error() {
    let r = fwd(
        &t(&[0, 8], DType::F32, 1.0),
        &t(&[10, 8], DType::F32, 2.0),
        None,
        &HostTensor::from_i64(vec![]),
        &Options::default(),
    );
    assert!(
        matches!(r, Err(CceError::EmptyInput { what: "e", .. })),
        "{r:?}"
    );
    let r = fwd(
        &t(&[3, 8], DType::F32, 1.0),
        &t(&[0, 8], DType::F32, 2.0),
        None,
        &HostTensor::from_i64(vec![0; 3]),
        &Options::default(),
    );
    assert!(
        matches!(r, Err(CceError::EmptyInput { what: "c", .. })),
        "{r:?}"
    );
}

/// Whether `r` is `AllTargetsIgnored` with these fields.
fn is_all_ignored<T>(r: &Result<T, CceError>, n: usize, opts: &Options) -> bool {
    matches!(
        r,
        Err(CceError::AllTargetsIgnored { n: gn, ignore_index, shift })
            if *gn == n && *ignore_index == opts.ignore_index && *shift == opts.shift
    )
}

#[test]
fn all_targets_ignored_under_mean_is_an_error_from_every_entry_point() {
    let (e, c) = (t(&[4, 8], DType::BF16, 1.0), t(&[10, 8], DType::BF16, 2.0));
    let lse = HostTensor::from_f32(vec![4], &[1.0; 4], DType::F32).unwrap();
    let rest = HostTensor::from_f32(vec![4], &[0.0; 4], DType::F32).unwrap();
    let saved = Saved {
        lse: &lse,
        rest_mass: &rest,
    };
    let be = CpuBackend::new();
    let by_index = Options::default();
    let by_index_m1_exact = Options {
        ignore_index: -1,
        ..Options::exact()
    };
    let by_shift = Options {
        shift: 2,
        seq_len: Some(2),
        ..Options::default()
    };
    for (opts, y) in [
        (&by_index, HostTensor::from_i64(vec![-100; 4])),
        (&by_index, HostTensor::from_i32(vec![-100; 4])),
        (&by_index_m1_exact, HostTensor::from_i64(vec![-1; 4])),
        (&by_shift, HostTensor::from_i64(vec![1, 2, 3, 4])),
        (&by_shift, HostTensor::from_i32(vec![1, 2, 3, 4])),
    ] {
        assert_eq!(opts.reduction, Reduction::Mean);
        let inputs = Inputs {
            e: &e,
            c: &c,
            bias: None,
            targets: &y,
        };
        let up = Upstream::default();
        let f = be.forward(&inputs, opts);
        assert!(
            is_all_ignored(&f, 4, opts),
            "forward {opts:?}: {:?}",
            f.err()
        );
        let b = be.backward(&inputs, opts, saved, &up);
        assert!(
            is_all_ignored(&b, 4, opts),
            "backward {opts:?}: {:?}",
            b.err()
        );
        let fb = be.forward_backward(&inputs, opts, &up);
        assert!(
            is_all_ignored(&fb, 4, opts),
            "forward_backward {opts:?}: {:?}",
            fb.err()
        );
        // An lse upstream gradient does not make the mean defined.
        let h = HostTensor::from_f32(vec![4], &[0.5; 4], DType::F32).unwrap();
        let with_h = Upstream {
            d_loss: DLoss::Scalar(1.0),
            d_lse: Some(&h),
        };
        let b = be.backward(&inputs, opts, saved, &with_h);
        assert!(is_all_ignored(&b, 4, opts), "backward + d_lse {opts:?}");
    }
    let msg = be
        .forward(
            &Inputs {
                e: &e,
                c: &c,
                bias: None,
                targets: &HostTensor::from_i64(vec![-100; 4]),
            },
            &by_index,
        )
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("none of the 4 rows has a target") && msg.contains("reduction = sum"),
        "{msg}"
    );
}

#[test]
fn all_targets_ignored_under_sum_or_none_is_zero_not_nan() {
    let (e, c) = (t(&[4, 8], DType::BF16, 1.0), t(&[10, 8], DType::BF16, 2.0));
    let be = CpuBackend::new();
    for (reduction, shift) in [
        (Reduction::Sum, 0),
        (Reduction::None, 0),
        (Reduction::Sum, 4),
        (Reduction::None, 7),
    ] {
        let y = if shift == 0 {
            HostTensor::from_i64(vec![-100; 4])
        } else {
            HostTensor::from_i32(vec![1, 2, 3, 4])
        };
        let opts = Options {
            reduction,
            shift,
            ..Options::default()
        };
        let per_row = HostTensor::from_f32(vec![4], &[1.0; 4], DType::F32).unwrap();
        let up = Upstream {
            d_loss: if reduction == Reduction::None {
                DLoss::PerRow(&per_row)
            } else {
                DLoss::Scalar(1.0)
            },
            d_lse: None,
        };
        let (f, g) = be
            .forward_backward(
                &Inputs {
                    e: &e,
                    c: &c,
                    bias: None,
                    targets: &y,
                },
                &opts,
                &up,
            )
            .unwrap_or_else(|err| panic!("{reduction:?} shift {shift}: {err}"));
        let want = if reduction == Reduction::None {
            vec![0.0; 4]
        } else {
            vec![0.0]
        };
        assert_eq!(f.loss.to_f32_vec(), want, "{reduction:?} shift {shift}");
        assert_eq!(f.stats.n_valid, 0);
        assert!(g
            .d_e
            .unwrap()
            .to_f32_vec()
            .iter()
            .chain(&g.d_c.unwrap().to_f32_vec())
            .all(|&x| x == 0.0));
    }
}

#[test]
fn invalid_options_are_named() {
    let (e, c, y) = (
        t(&[4, 8], DType::F32, 1.0),
        t(&[10, 8], DType::F32, 2.0),
        HostTensor::from_i64(vec![1; 4]),
    );
    let o = Options {
        filter_eps: FilterEps::Value(-1.0),
        ..Default::default()
    };
    assert!(matches!(
        fwd(&e, &c, None, &y, &o),
        Err(CceError::InvalidOption {
            name: "filter_eps",
            ..
        })
    ));
    let o = Options {
        shift: 1,
        seq_len: Some(3),
        ..Default::default()
    };
    assert!(matches!(
        fwd(&e, &c, None, &y, &o),
        Err(CceError::InvalidOption {
            name: "seq_len",
            ..
        })
    ));
}

#[test]
fn budget_too_small_is_a_resource_limit() {
    let (e, c, y) = (
        t(&[4, 8], DType::F32, 1.0),
        t(&[10, 8], DType::F32, 2.0),
        HostTensor::from_i64(vec![1; 4]),
    );
    let o = Options {
        workspace_budget_bytes: 16,
        ..Default::default()
    };
    assert!(matches!(
        fwd(&e, &c, None, &y, &o),
        Err(CceError::ResourceLimit { .. })
    ));
}

#[test]
fn backward_checks_lse_and_upstream_shapes() {
    let (e, c, y) = (
        t(&[4, 8], DType::F32, 1.0),
        t(&[10, 8], DType::F32, 2.0),
        HostTensor::from_i64(vec![1; 4]),
    );
    let be = CpuBackend::new();
    let inputs = Inputs {
        e: &e,
        c: &c,
        bias: None,
        targets: &y,
    };
    let bad_lse = t(&[5], DType::F32, 0.0);
    let lse = t(&[4], DType::F32, 0.0);
    for (saved, what) in [
        (
            Saved {
                lse: &bad_lse,
                rest_mass: &lse,
            },
            "lse",
        ),
        (
            Saved {
                lse: &lse,
                rest_mass: &bad_lse,
            },
            "rest_mass",
        ),
    ] {
        let r = be.backward(&inputs, &Options::default(), saved, &Upstream::default());
        assert!(
            matches!(r, Err(CceError::ShapeMismatch { what: w, .. }) if w == what),
            "{r:?}"
        );
    }
    let o = Options {
        reduction: Reduction::None,
        ..Default::default()
    };
    let r = be.backward(
        &inputs,
        &o,
        Saved {
            lse: &lse,
            rest_mass: &lse,
        },
        &Upstream {
            d_loss: DLoss::Scalar(1.0),
            d_lse: None,
        },
    );
    assert!(
        matches!(r, Err(CceError::ShapeMismatch { what: "d_loss", .. })),
        "{r:?}"
    );
}

#[test]
fn backward_names_a_non_finite_input_even_with_a_finite_lse() {
    let y = HostTensor::from_i64(vec![1; 4]);
    let c = t(&[10, 8], DType::F32, 2.0);
    let e_ok = t(&[4, 8], DType::F32, 1.0);
    let be = CpuBackend::new();
    let fwd = be
        .forward(
            &Inputs {
                e: &e_ok,
                c: &c,
                bias: None,
                targets: &y,
            },
            &Options::default(),
        )
        .unwrap();
    let mut ev = e_ok.to_f32_vec();
    ev[5] = f32::NEG_INFINITY;
    let e = HostTensor::from_f32(vec![4, 8], &ev, DType::F32).unwrap();
    let r = be.backward(
        &Inputs {
            e: &e,
            c: &c,
            bias: None,
            targets: &y,
        },
        &Options::default(),
        fwd.saved(),
        &Upstream::default(),
    );
    assert!(
        matches!(
            r,
            Err(CceError::NonFinite {
                what: "e",
                index: 5,
                row: 0,
                ..
            })
        ),
        "{r:?}"
    );
}

#[test]
fn softcap_does_not_hide_an_overflow_of_the_logits() {
    // Finite inputs whose products overflow f32: logits of ±inf. Softcap maps finite logits
    // into (−s, s); an infinite one must stay infinite and fail the lse check, not become ±s.
    let big = |shape: &[usize], seed: f32| {
        let v: Vec<f32> = t(shape, DType::F32, seed)
            .to_f32_vec()
            .iter()
            .map(|x| x.signum() * 1e20 + x * 1e19)
            .collect();
        HostTensor::from_f32(shape.to_vec(), &v, DType::F32).unwrap()
    };
    let (e, c) = (big(&[5, 4], 1.0), big(&[7, 4], 2.0));
    let y = HostTensor::from_i64(vec![1, 6, 2, 0, 3]);
    for softcap in [None, Some(30.0)] {
        let o = Options {
            softcap,
            ..Default::default()
        };
        let r = fwd(&e, &c, None, &y, &o);
        assert!(
            matches!(
                r,
                Err(CceError::NonFinite {
                    what: "lse or gradients (overflow)",
                    ..
                })
            ),
            "softcap {softcap:?}: {r:?}"
        );
    }
}

/// Environment variable that turns [`oom_child_widening_copy`] on (MiB of bf16 `e`).
const OOM_CHILD_ENV: &str = "CCE_OOM_CHILD_E_MIB";

/// Child half of [`f32_copy_of_bf16_inputs_past_the_memory_limit_is_out_of_memory`]: a
/// forward on a bf16 `e` of `$CCE_OOM_CHILD_E_MIB` MiB, run by the parent under an
/// address-space limit that holds the bf16 input but not its f32 copy. Does nothing when the
/// variable is unset (a plain test run).
#[test]
fn oom_child_widening_copy() {
    let Some(mib) = std::env::var(OOM_CHILD_ENV)
        .ok()
        .and_then(|m| m.parse::<usize>().ok())
    else {
        return;
    };
    let d = 64;
    let n = (mib << 20) / 2 / d;
    let e = HostTensor::new(
        vec![n, d],
        cce_core::HostData::BF16(vec![half::bf16::ONE; n * d]),
    )
    .unwrap();
    let c = t(&[3, d], DType::BF16, 1.0);
    let y = HostTensor::from_i64(vec![0; n]);
    match fwd(&e, &c, None, &y, &Options::default()) {
        Err(CceError::OutOfMemory {
            requested_bytes, ..
        }) => {
            assert_eq!(requested_bytes, 4 * (n * d) as u64);
            println!("OOM-OK {requested_bytes}");
        }
        other => panic!("expected OutOfMemory for the f32 copy of e, got {other:?}"),
    }
}

/// The CPU backend's f32 copy of bf16/f16 inputs is allocated fallibly: past the memory limit
/// the call returns `OutOfMemory`, as for its other buffers, instead of aborting the process.
/// The child (this test binary, under `ulimit -v`) holds a 192 MiB bf16 `e` within a limit
/// 256 MiB above it, so its 384 MiB f32 copy cannot fit whatever the process's base size.
#[cfg(unix)]
#[test]
fn f32_copy_of_bf16_inputs_past_the_memory_limit_is_out_of_memory() {
    let e_mib = 192usize;
    let limit_kib = (e_mib + 256) << 10;
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -v {limit_kib} && exec \"$0\" \"$@\""))
        .arg(&exe)
        .args([
            "--exact",
            "oom_child_widening_copy",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(OOM_CHILD_ENV, e_mib.to_string())
        .env("MALLOC_ARENA_MAX", "1")
        .output()
        .unwrap();
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success() && so.contains("OOM-OK"),
        "child {:?} (a signal, e.g. SIGABRT, is an abort on allocation failure)\nstdout:\n{so}\nstderr:\n{se}",
        out.status
    );
}

/// A 4 x 8 x 10 problem with its forward (reduction `o`), for the backward's checks.
fn saved_call(o: &Options) -> (HostTensor, HostTensor, HostTensor, HostTensor, HostTensor) {
    let (e, c, y) = (
        t(&[4, 8], DType::F32, 1.0),
        t(&[10, 8], DType::F32, 2.0),
        HostTensor::from_i64(vec![1, 3, -100, 7]),
    );
    let f = CpuBackend::new()
        .forward(
            &Inputs {
                e: &e,
                c: &c,
                bias: None,
                targets: &y,
            },
            o,
        )
        .unwrap();
    (e, c, y, f.lse, f.rest_mass)
}

#[test]
fn backward_rejects_upstream_gradients_that_are_not_f32() {
    // The contract (`DLoss::PerRow`, `Upstream::d_lse`): `[N]` f32, as the GPU backends
    // require; a CPU that widened other dtypes would accept calls the GPUs refuse.
    let none = Options {
        reduction: Reduction::None,
        ..Options::exact()
    };
    let (e, c, y, lse, rest) = saved_call(&none);
    let inputs = Inputs {
        e: &e,
        c: &c,
        bias: None,
        targets: &y,
    };
    let saved = Saved {
        lse: &lse,
        rest_mass: &rest,
    };
    let be = CpuBackend::new();
    for bad in [
        HostTensor::from_i64(vec![1; 4]),
        HostTensor::from_i32(vec![1; 4]),
        t(&[4], DType::BF16, 0.0),
        t(&[4], DType::F16, 0.0),
    ] {
        let r = be.backward(
            &inputs,
            &none,
            saved,
            &Upstream {
                d_loss: DLoss::PerRow(&bad),
                d_lse: None,
            },
        );
        assert!(
            matches!(r, Err(CceError::ShapeMismatch { what: "d_loss", ref got, .. }) if got.contains(&bad.dtype().to_string())),
            "d_loss {}: {r:?}",
            bad.dtype()
        );
        let ones = t(&[4], DType::F32, 0.0);
        let r = be.backward(
            &inputs,
            &none,
            saved,
            &Upstream {
                d_loss: DLoss::PerRow(&ones),
                d_lse: Some(&bad),
            },
        );
        assert!(
            matches!(r, Err(CceError::ShapeMismatch { what: "d_lse", .. })),
            "d_lse {}: {r:?}",
            bad.dtype()
        );
    }
}

#[test]
fn backward_names_a_non_finite_saved_lse_or_rest_mass() {
    let o = Options::exact();
    let (e, c, y, lse, rest) = saved_call(&o);
    let inputs = Inputs {
        e: &e,
        c: &c,
        bias: None,
        targets: &y,
    };
    let be = CpuBackend::new();
    let with = |x: &HostTensor, row: usize, value: f32| {
        let mut v = x.to_f32_vec();
        v[row] = value;
        HostTensor::from_f32(vec![4], &v, DType::F32).unwrap()
    };
    for value in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        for (what, row) in [("rest_mass", 3), ("lse", 1)] {
            let in_lse = what == "lse";
            let bad = with(if in_lse { &lse } else { &rest }, row, value);
            let saved = Saved {
                lse: if in_lse { &bad } else { &lse },
                rest_mass: if in_lse { &rest } else { &bad },
            };
            let r = be.backward(&inputs, &o, saved, &Upstream::default());
            let named = match &r {
                Err(CceError::NonFinite {
                    what: w, row: at, ..
                }) => (*w, *at) == (what, row),
                _ => false,
            };
            assert!(named, "{what} {value}: {r:?}");
        }
    }
}

#[test]
fn degenerate_device_limits_are_an_error_not_a_panic() {
    use cce_core::plan::DeviceLimits;
    let (e, c, y) = (
        t(&[4, 8], DType::F32, 1.0),
        t(&[10, 8], DType::F32, 2.0),
        HostTensor::from_i64(vec![1, 3, -100, 7]),
    );
    let inputs = Inputs {
        e: &e,
        c: &c,
        bias: None,
        targets: &y,
    };
    let base = DeviceLimits::cpu();
    let mut cases: Vec<(&str, DeviceLimits)> = Vec::new();
    let mut l = base.clone();
    l.tile.rows = 0;
    cases.push(("tile rows 0", l));
    let mut l = base.clone();
    l.tile.classes = 0;
    cases.push(("tile classes 0", l));
    let mut l = base.clone();
    l.tile.depth = 0;
    cases.push(("tile depth 0", l));
    for bits in [0, 1] {
        let mut l = base.clone();
        l.index_bits = bits;
        cases.push(("index bits 0 / 1", l));
    }
    let mut l = base.clone();
    l.strategies.clear();
    cases.push(("no strategy", l));
    let mut l = base.clone();
    l.max_buffer_bytes = 0;
    cases.push(("buffer 0", l));
    for (what, limits) in cases {
        let be = CpuBackend::with_limits(limits);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            be.forward(&inputs, &Options::default()).map(|_| ())
        }));
        match r {
            Ok(Err(CceError::InvalidOption { name, .. })) if name.starts_with("DeviceLimits::") => {
            }
            Ok(Err(CceError::ResourceLimit { .. })) => {}
            other => panic!("{what}: expected a typed error, got {other:?}"),
        }
    }
}
