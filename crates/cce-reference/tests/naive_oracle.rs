//! The f64 oracle against central finite differences, for every option, and against the real
//! fixture's f64 reference.

use cce_core::options::{Options, Reduction};
use cce_core::problem::{PreparedTargets, Problem};
use cce_core::{CceError, DType, HostTensor};
use cce_reference::{naive, naive_values, OracleDLoss, Precision};
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

struct Case {
    n: usize,
    d: usize,
    v: usize,
    e: Vec<f64>,
    c: Vec<f64>,
    bias: Option<Vec<f64>>,
    targets: Vec<i64>,
}

fn random_case(rng: &mut impl Rng, n: usize, d: usize, v: usize, bias: bool, ignored: f64) -> Case {
    let normal = Normal::new(0.0, 1.0).unwrap();
    let mut draw = |k: usize| -> Vec<f64> { (0..k).map(|_| normal.sample(rng)).collect() };
    let e = draw(n * d);
    let c = draw(v * d);
    let bias = bias.then(|| draw(v));
    let mut targets: Vec<i64> = (0..n)
        .map(|_| {
            if rng.random::<f64>() < ignored {
                -100
            } else {
                rng.random_range(0..v as i64)
            }
        })
        .collect();
    // At least one row keeps a target when not every row is meant to be ignored: a mean over
    // no valid row is an error (CceError::AllTargetsIgnored), tested on its own.
    if ignored < 1.0 && targets.iter().all(|&t| t == -100) {
        if let Some(t) = targets.first_mut() {
            *t = rng.random_range(0..v as i64);
        }
    }
    Case {
        n,
        d,
        v,
        e,
        c,
        bias,
        targets,
    }
}

/// Objective whose gradient the oracle's backward computes: Σ d_loss·loss + Σ h_i lse_i.
fn objective(
    case: &Case,
    e: &[f64],
    c: &[f64],
    b: Option<&[f64]>,
    opts: &Options,
    dl: &OracleDLoss,
    h: &[f64],
) -> f64 {
    let (problem, prepared) = prepare(case, opts);
    let o = naive_values(
        &problem,
        e,
        c,
        b,
        &prepared,
        opts,
        dl,
        Some(h),
        Precision::F64,
    );
    let l: f64 = match dl {
        OracleDLoss::Scalar(s) => s * o.loss[0],
        OracleDLoss::PerRow(g) => g.iter().zip(&o.loss).map(|(a, b)| a * b).sum(),
    };
    l + h.iter().zip(&o.lse).map(|(a, b)| a * b).sum::<f64>()
}

fn prepare(case: &Case, opts: &Options) -> (Problem, PreparedTargets) {
    let e = HostTensor::from_f32(
        vec![case.n, case.d],
        &vec![1.0; case.n * case.d],
        DType::F32,
    )
    .unwrap();
    let c = HostTensor::from_f32(
        vec![case.v, case.d],
        &vec![1.0; case.v * case.d],
        DType::F32,
    )
    .unwrap();
    let b = case
        .bias
        .as_ref()
        .map(|_| HostTensor::from_f32(vec![case.v], &vec![1.0; case.v], DType::F32).unwrap());
    let t = HostTensor::from_i64(case.targets.clone());
    let problem = Problem::new(&e, &c, b.as_ref().map(|x| x as _), &t, opts).unwrap();
    let prepared = PreparedTargets::new(&case.targets, &problem, opts).unwrap();
    (problem, prepared)
}

fn check_fd(case: &Case, opts: &Options, rng: &mut impl Rng) {
    let (problem, prepared) = prepare(case, opts);
    let dl = match opts.reduction {
        Reduction::None => {
            OracleDLoss::PerRow((0..case.n).map(|_| rng.random_range(-1.0..1.0)).collect())
        }
        _ => OracleDLoss::Scalar(rng.random_range(0.5..2.0)),
    };
    let h: Vec<f64> = (0..case.n).map(|_| rng.random_range(-0.5..0.5)).collect();
    let o = naive_values(
        &problem,
        &case.e,
        &case.c,
        case.bias.as_deref(),
        &prepared,
        opts,
        &dl,
        Some(&h),
        Precision::F64,
    );
    let step = 1e-5;
    let mut worst: f64 = 0.0;
    let mut check = |analytic: f64, f: &dyn Fn(f64) -> f64, what: &str, idx: usize| {
        let numeric = (f(step) - f(-step)) / (2.0 * step);
        let err = (analytic - numeric).abs() / (1.0 + numeric.abs());
        worst = worst.max(err);
        assert!(
            err < 1e-6,
            "{what}[{idx}]: analytic {analytic}, numeric {numeric}, opts {opts:?}"
        );
    };
    for idx in 0..case.e.len() {
        let f = |dx: f64| {
            let mut e = case.e.clone();
            e[idx] += dx;
            objective(case, &e, &case.c, case.bias.as_deref(), opts, &dl, &h)
        };
        check(o.d_e[idx], &f, "d_e", idx);
    }
    for idx in 0..case.c.len() {
        let f = |dx: f64| {
            let mut c = case.c.clone();
            c[idx] += dx;
            objective(case, &case.e, &c, case.bias.as_deref(), opts, &dl, &h)
        };
        check(o.d_c[idx], &f, "d_c", idx);
    }
    if let Some(b0) = &case.bias {
        for idx in 0..b0.len() {
            let f = |dx: f64| {
                let mut b = b0.clone();
                b[idx] += dx;
                objective(case, &case.e, &case.c, Some(&b), opts, &dl, &h)
            };
            check(o.d_bias.as_ref().unwrap()[idx], &f, "d_bias", idx);
        }
    }
    assert!(worst.is_finite());
}

#[test]
fn gradients_match_finite_differences_for_every_option() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed_0001);
    let variants: Vec<(&str, Options, bool, f64)> = vec![
        ("plain mean", Options::exact(), false, 0.0),
        ("bias", Options::exact(), true, 0.0),
        (
            "softcap",
            Options {
                softcap: Some(2.0),
                ..Options::exact()
            },
            true,
            0.0,
        ),
        (
            "label smoothing",
            Options {
                label_smoothing: 0.2,
                ..Options::exact()
            },
            false,
            0.0,
        ),
        (
            "ls + softcap",
            Options {
                label_smoothing: 0.1,
                softcap: Some(3.0),
                ..Options::exact()
            },
            true,
            0.0,
        ),
        (
            "z-loss",
            Options {
                z_loss: 0.05,
                ..Options::exact()
            },
            false,
            0.0,
        ),
        (
            "sum",
            Options {
                reduction: Reduction::Sum,
                ..Options::exact()
            },
            false,
            0.0,
        ),
        (
            "none",
            Options {
                reduction: Reduction::None,
                ..Options::exact()
            },
            true,
            0.0,
        ),
        (
            "shift",
            Options {
                shift: 1,
                seq_len: Some(3),
                ..Options::exact()
            },
            false,
            0.0,
        ),
        ("ignored rows", Options::exact(), false, 0.4),
        (
            "everything",
            Options {
                softcap: Some(4.0),
                z_loss: 0.01,
                label_smoothing: 0.1,
                shift: 2,
                seq_len: Some(6),
                reduction: Reduction::None,
                ..Options::exact()
            },
            true,
            0.2,
        ),
    ];
    for (name, opts, bias, ignored) in variants {
        for _ in 0..2 {
            let case = random_case(&mut rng, 6, 5, 9, bias, ignored);
            check_fd(&case, &opts, &mut rng);
        }
        eprintln!("finite differences ok: {name}");
    }
}

#[test]
fn all_rows_ignored_gives_zero_loss_and_gradients() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for reduction in [Reduction::Sum, Reduction::None] {
        let mut case = random_case(&mut rng, 5, 4, 7, true, 0.0);
        case.targets = vec![-100; 5];
        let opts = Options {
            reduction,
            ..Options::exact()
        };
        let (problem, prepared) = prepare(&case, &opts);
        assert_eq!(prepared.n_valid, 0);
        let dl = match reduction {
            Reduction::None => OracleDLoss::PerRow(vec![1.0; 5]),
            _ => OracleDLoss::Scalar(1.0),
        };
        let o = naive_values(
            &problem,
            &case.e,
            &case.c,
            case.bias.as_deref(),
            &prepared,
            &opts,
            &dl,
            None,
            Precision::F64,
        );
        assert!(o.loss.iter().all(|&x| x == 0.0), "{reduction:?}");
        assert!(o
            .d_e
            .iter()
            .chain(&o.d_c)
            .chain(o.d_bias.as_ref().unwrap())
            .all(|&x| x == 0.0));
        assert!(o.lse.iter().all(|x| x.is_finite()));
    }
}

fn f32s(x: &[f64]) -> Vec<f32> {
    x.iter().map(|&v| v as f32).collect()
}

#[test]
fn all_rows_ignored_under_mean_is_an_error_of_the_oracle() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(8);
    let case = random_case(&mut rng, 6, 4, 7, true, 0.0);
    let e = HostTensor::from_f32(vec![case.n, case.d], &f32s(&case.e), DType::F32).unwrap();
    let c = HostTensor::from_f32(vec![case.v, case.d], &f32s(&case.c), DType::F32).unwrap();
    // Every target ignore_index (i64 and i32), or a shift as long as the sequence.
    let ignored = Options {
        ignore_index: -1,
        ..Options::exact()
    };
    let shifted = Options {
        shift: 3,
        seq_len: Some(3),
        ..Options::exact()
    };
    let valid: Vec<i64> = case.targets.iter().map(|&y| y.max(0)).collect();
    for (opts, y) in [
        (&ignored, HostTensor::from_i64(vec![-1; 6])),
        (&ignored, HostTensor::from_i32(vec![-1; 6])),
        (&shifted, HostTensor::from_i64(valid.clone())),
        (
            &shifted,
            HostTensor::from_i32(valid.iter().map(|&x| x as i32).collect()),
        ),
    ] {
        let r = naive(
            &e,
            &c,
            None,
            &y,
            opts,
            &OracleDLoss::Scalar(1.0),
            None,
            Precision::F64,
        );
        match r {
            Err(CceError::AllTargetsIgnored {
                n: 6,
                ignore_index,
                shift,
            }) if ignore_index == opts.ignore_index && shift == opts.shift => {}
            other => panic!(
                "{opts:?}: expected AllTargetsIgnored, got {:?}",
                other.err()
            ),
        }
    }
}

#[test]
fn oracle_reproduces_the_real_fixture() {
    let ds = cce_data::load_real_fixture().expect("shipped fixture");
    let (t, lse_ref, nll_ref) = (ds.targets, ds.lse_ref.unwrap(), ds.nll_ref.unwrap());
    let e32 = HostTensor::from_f32(vec![ds.n, ds.d], &ds.e, DType::F32).unwrap();
    let c = HostTensor::from_f32(vec![ds.v, ds.d], &ds.c, DType::F32).unwrap();
    let targets = HostTensor::from_i64(t);
    let opts = Options {
        reduction: Reduction::None,
        ..Options::exact()
    };
    let o = naive(
        &e32,
        &c,
        None,
        &targets,
        &opts,
        &OracleDLoss::PerRow(vec![1.0; 1024]),
        None,
        Precision::F64,
    )
    .unwrap();
    let mean: f64 = o.loss.iter().sum::<f64>() / 1024.0;
    assert!(
        ((mean - 2.142760) / 2.142760).abs() < 1e-5,
        "mean nll {mean}"
    );
    for i in 0..1024 {
        assert!(
            (o.lse[i] - lse_ref[i] as f64).abs() < 1e-5,
            "lse row {i}: {} vs {}",
            o.lse[i],
            lse_ref[i]
        );
        assert!((o.loss[i] - nll_ref[i] as f64).abs() < 1e-4, "nll row {i}");
    }
    eprintln!("real fixture: mean nll {mean:.6} (reference 2.142760)");
}
