//! Bad-input checks: every invalid call must return the exact typed error (never panic, never
//! succeed), through the [`Backend`] API (host tensors uploaded, `forward` and `backward`
//! called).

use crate::case::Case;
use crate::checks::{case_seed, conclude, label, CheckResult};
use crate::config::SuiteConfig;
use crate::harness::check_seed;
use crate::matrix::DTYPES;
use crate::report::CaseReport;
use cce_core::options::{FilterEps, Reduction};
use cce_core::{
    Backend, CceError, DLoss, DType, HostData, HostTensor, Inputs, Options, Saved, TensorMeta,
    Upstream,
};
use rand::Rng;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

/// Which entry points a bad call goes through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Entry {
    Forward,
    Backward,
}

/// The upstream of a bad backward call.
#[derive(Clone, Debug)]
enum BadDLoss {
    Scalar(f32),
    PerRow(HostTensor),
}

/// One invalid call and the error it must produce.
struct Bad {
    label: String,
    e: HostTensor,
    c: HostTensor,
    bias: Option<HostTensor>,
    targets: HostTensor,
    opts: Options,
    lse: HostTensor,
    d_loss: BadDLoss,
    d_lse: Option<HostTensor>,
    entries: Vec<Entry>,
}

type Expect = Box<dyn Fn(&CceError) -> Result<(), String>>;

/// A valid base problem (N = 12, D = 8, V = 20, with bias) in `dtype`, from `seed`.
fn base(label: &str, dtype: DType, seed: u64) -> Bad {
    let case = Case::new(label, 12, 8, 20, dtype).bias(true);
    let data = case.materialize(seed);
    Bad {
        label: format!("{label} ({dtype})"),
        e: data.e,
        c: data.c,
        bias: data.bias,
        targets: data.targets,
        opts: Options::default(),
        lse: f32s(vec![12], 3.0),
        d_loss: BadDLoss::Scalar(1.0),
        d_lse: None,
        entries: vec![Entry::Forward, Entry::Backward],
    }
}

fn f32s(shape: Vec<usize>, x: f32) -> HostTensor {
    let n: usize = shape.iter().product();
    HostTensor::from_f32(shape, &vec![x; n], DType::F32).expect("f32 tensor")
}

/// A tensor of `shape` in `dtype` with nonzero values.
fn filled(shape: Vec<usize>, dtype: DType) -> HostTensor {
    let n: usize = shape.iter().product();
    let vals: Vec<f32> = (0..n).map(|k| 0.25 + (k % 7) as f32 * 0.125).collect();
    match dtype {
        DType::I32 => HostTensor::new(shape, HostData::I32(vec![1; n])).expect("i32"),
        DType::I64 => HostTensor::new(shape, HostData::I64(vec![1; n])).expect("i64"),
        _ => HostTensor::from_f32(shape, &vals, dtype).expect("float"),
    }
}

fn with_value(t: &HostTensor, index: usize, x: f32) -> HostTensor {
    let mut v = t.to_f32_vec();
    v[index] = x;
    HostTensor::from_f32(t.shape().to_vec(), &v, t.dtype()).expect("float tensor")
}

fn with_target(t: &HostTensor, row: usize, value: i64, as_i32: bool) -> HostTensor {
    let mut v = t.to_i64_vec().expect("integer targets");
    v[row] = value;
    let shape = t.shape().to_vec();
    let flat = if as_i32 {
        HostTensor::from_i32(v.iter().map(|&x| x as i32).collect())
    } else {
        HostTensor::from_i64(v)
    };
    flat.reshape(shape).expect("targets shape")
}

/// `NonFinite` naming the upstream gradient `what` at `row`.
fn non_finite(what: &'static str, row: usize) -> Expect {
    Box::new(move |e| match e {
        CceError::NonFinite {
            what: w, row: r, ..
        } if *w == what && *r == row => Ok(()),
        other => Err(format!(
            "expected CceError::NonFinite in {what} at row {row}, got {other:?}"
        )),
    })
}

fn variant_is(name: &'static str, f: impl Fn(&CceError) -> bool + 'static) -> Expect {
    Box::new(move |e| {
        if f(e) {
            Ok(())
        } else {
            Err(format!("expected CceError::{name}, got {e:?}"))
        }
    })
}

/// Run a bad call through each of its entry points and record whether the expected error came.
fn expect_error<B: Backend>(backend: &B, bad: &Bad, expect: &Expect, report: &mut CaseReport) {
    for &entry in &bad.entries {
        let outcome = catch_unwind(AssertUnwindSafe(|| -> Result<(), CceError> {
            let e = backend.upload(&bad.e)?;
            let c = backend.upload(&bad.c)?;
            let bias = bad.bias.as_ref().map(|b| backend.upload(b)).transpose()?;
            let targets = backend.upload(&bad.targets)?;
            let inputs = Inputs {
                e: &e,
                c: &c,
                bias: bias.as_ref(),
                targets: &targets,
            };
            match entry {
                Entry::Forward => backend.forward(&inputs, &bad.opts).map(|_| ()),
                Entry::Backward => {
                    let lse = backend.upload(&bad.lse)?;
                    let rest_mass = backend.upload(&HostTensor::from_f32(
                        bad.lse.shape().to_vec(),
                        &vec![0.0; bad.lse.numel()],
                        DType::F32,
                    )?)?;
                    let per_row = match &bad.d_loss {
                        BadDLoss::PerRow(t) => Some(backend.upload(t)?),
                        BadDLoss::Scalar(_) => None,
                    };
                    let d_lse = bad.d_lse.as_ref().map(|h| backend.upload(h)).transpose()?;
                    let up = Upstream {
                        d_loss: match (&bad.d_loss, &per_row) {
                            (BadDLoss::Scalar(s), _) => DLoss::Scalar(*s),
                            (_, Some(b)) => DLoss::PerRow(b),
                            (BadDLoss::PerRow(_), None) => unreachable!("uploaded"),
                        },
                        d_lse: d_lse.as_ref(),
                    };
                    backend
                        .backward(
                            &inputs,
                            &bad.opts,
                            Saved {
                                lse: &lse,
                                rest_mass: &rest_mass,
                            },
                            &up,
                        )
                        .map(|_| ())
                }
            }
        }));
        let what = format!("{} via {entry:?}", bad.label);
        match outcome {
            Err(_) => report.problem(format!(
                "{what}: the backend panicked instead of returning an error"
            )),
            Ok(Ok(())) => report.problem(format!(
                "{what}: accepted (returned Ok), an error was expected"
            )),
            Ok(Err(err)) => match expect(&err) {
                Ok(()) => {}
                Err(msg) => report.problem(format!("{what}: {msg}")),
            },
        }
    }
}

fn run_bad<B: Backend>(
    check: &str,
    backend: &B,
    cfg: &SuiteConfig,
    build: impl Fn(u64) -> Vec<(Bad, Expect)>,
) -> CheckResult {
    let started = Instant::now();
    let seed = check_seed(cfg);
    let mut reports = Vec::new();
    for (k, (bad, expect)) in build(seed).into_iter().enumerate() {
        let mut r = CaseReport::new(format!("[{check}] {}", bad.label), seed ^ k as u64);
        expect_error(backend, &bad, &expect, &mut r);
        reports.push(r);
    }
    conclude(check, &label(cfg, backend), seed, reports, started)
}

fn sub_seed(seed: u64, k: usize) -> u64 {
    case_seed(seed, &Case::new("bad", 1, 1, 1, DType::F32), k)
}

/// Shapes that do not fit: `c` with another `D`, `c` of rank 3, `bias` of length `V + 1`,
/// targets of length `N ± 1`, `e` of rank 1. Each must give `CceError::ShapeMismatch`.
pub fn rejects_shape_mismatch<B: Backend>(backend: &B, cfg: &SuiteConfig) -> CheckResult {
    run_bad("rejects_shape_mismatch", backend, cfg, |seed| {
        let is = || {
            variant_is("ShapeMismatch", |e| {
                matches!(e, CceError::ShapeMismatch { .. })
            })
        };
        let mut out: Vec<(Bad, Expect)> = Vec::new();
        for (k, dt) in DTYPES.into_iter().enumerate() {
            let s = sub_seed(seed, k);
            let mut b = base("c with D+1", dt, s);
            b.c = filled(vec![20, 9], dt);
            out.push((b, is()));
            let mut b = base("c of rank 3", dt, s);
            b.c = filled(vec![20, 8, 1], dt);
            out.push((b, is()));
            let mut b = base("bias of length V+1", dt, s);
            b.bias = Some(filled(vec![21], dt));
            out.push((b, is()));
            let mut b = base("targets of length N+1", dt, s);
            b.targets = HostTensor::from_i64(vec![1; 13]);
            out.push((b, is()));
            let mut b = base("targets of length N-1", dt, s);
            b.targets = HostTensor::from_i32(vec![1; 11]);
            out.push((b, is()));
            let mut b = base("e of rank 1", dt, s);
            b.e = filled(vec![96], dt);
            b.targets = HostTensor::from_i64(vec![1; 96]);
            out.push((b, is()));
        }
        out
    })
}

/// dtypes that do not fit: `c` (or `bias`) in another float dtype than `e`, integer `e`/`c`,
/// float targets. Each must give `CceError::DTypeMismatch`.
pub fn rejects_dtype_mismatch<B: Backend>(backend: &B, cfg: &SuiteConfig) -> CheckResult {
    run_bad("rejects_dtype_mismatch", backend, cfg, |seed| {
        let is = || {
            variant_is("DTypeMismatch", |e| {
                matches!(e, CceError::DTypeMismatch { .. })
            })
        };
        let mut out: Vec<(Bad, Expect)> = Vec::new();
        for (k, dt) in DTYPES.into_iter().enumerate() {
            let s = sub_seed(seed, k);
            let other = DTYPES[(k + 1) % 3];
            let mut b = base(&format!("c in {other}"), dt, s);
            b.c = filled(vec![20, 8], other);
            out.push((b, is()));
            let mut b = base(&format!("bias in {other}"), dt, s);
            b.bias = Some(filled(vec![20], other));
            out.push((b, is()));
            let mut b = base("targets as float", dt, s);
            b.targets = filled(vec![12], dt);
            out.push((b, is()));
        }
        let mut b = base("integer e and c", DType::F32, sub_seed(seed, 9));
        b.e = filled(vec![12, 8], DType::I32);
        b.c = filled(vec![20, 8], DType::I32);
        b.bias = None;
        out.push((b, is()));
        out
    })
}

/// Targets neither in `[0, V)` nor `ignore_index`: `V`, a negative value, `i64::MAX`, -100
/// under `ignore_index = -1`, two bad rows (the first is named), and a bad target in a position
/// a shift drops (still an error). Each must give `CceError::TargetOutOfRange` naming exactly
/// the row and the value.
pub fn rejects_target_out_of_range<B: Backend>(backend: &B, cfg: &SuiteConfig) -> CheckResult {
    run_bad("rejects_target_out_of_range", backend, cfg, |seed| {
        let mut rng = crate::data::rng(seed, 0xbad);
        let mut out: Vec<(Bad, Expect)> = Vec::new();
        let expect = |row: usize, value: i64| -> Expect {
            Box::new(move |e| {
                match e {
                CceError::TargetOutOfRange {
                    row: r,
                    value: v,
                    vocab_size: 20,
                    ..
                } if *r == row && *v == value => Ok(()),
                other => Err(format!(
                    "expected CceError::TargetOutOfRange {{ row: {row}, value: {value}, vocab_size: 20 }}, got {other:?}"
                )),
            }
            })
        };
        for (k, dt) in DTYPES.into_iter().enumerate() {
            let s = sub_seed(seed, k);
            let row = rng.random_range(0..12usize);
            let mut b = base(&format!("target V at row {row}"), dt, s);
            b.targets = with_target(&b.targets, row, 20, false);
            out.push((b, expect(row, 20)));
            let row = rng.random_range(0..12usize);
            let mut b = base(&format!("target -5 at row {row} (i32)"), dt, s);
            b.targets = with_target(&b.targets, row, -5, true);
            out.push((b, expect(row, -5)));
        }
        let s = sub_seed(seed, 7);
        let row = rng.random_range(0..12usize);
        let mut b = base(&format!("target i64::MAX at row {row}"), DType::F32, s);
        b.targets = with_target(&b.targets, row, i64::MAX, false);
        out.push((b, expect(row, i64::MAX)));
        let mut b = base("target -100 at row 3 with ignore_index -1", DType::BF16, s);
        b.targets = with_target(&b.targets, 3, -100, false);
        b.opts.ignore_index = -1;
        out.push((b, expect(3, -100)));
        let mut b = base("two bad rows 4 and 9", DType::F16, s);
        b.targets = with_target(&with_target(&b.targets, 9, 99, false), 4, 20, false);
        out.push((b, expect(4, 20)));
        let mut b = base(
            "bad target at row 5, dropped by shift 1 / seq_len 6",
            DType::F32,
            s,
        );
        b.targets = with_target(&b.targets, 5, 21, false);
        b.opts.shift = 1;
        b.opts.seq_len = Some(6);
        out.push((b, expect(5, 21)));
        out
    })
}

/// A mean over no valid row: every target `ignore_index` (the default -100, and -1; i64 and
/// i32 targets; exact and filtered; with an lse upstream gradient), or every row dropped by a
/// shift (`shift = seq_len`, `shift = N`, `shift = usize::MAX`). Each must give
/// `CceError::AllTargetsIgnored` with the call's `n`, `ignore_index` and `shift`, from both
/// `forward` and `backward` (a loss of 0 or NaN, or zero gradients, is a silent answer).
pub fn rejects_all_targets_ignored<B: Backend>(backend: &B, cfg: &SuiteConfig) -> CheckResult {
    run_bad("rejects_all_targets_ignored", backend, cfg, |seed| {
        let expect = |ignore_index: i64, shift: usize| -> Expect {
            Box::new(move |e| match e {
                CceError::AllTargetsIgnored {
                    n: 12,
                    ignore_index: ii,
                    shift: s,
                } if *ii == ignore_index && *s == shift => Ok(()),
                other => Err(format!(
                    "expected CceError::AllTargetsIgnored {{ n: 12, ignore_index: {ignore_index}, \
                     shift: {shift} }}, got {other:?}"
                )),
            })
        };
        let all = |t: &HostTensor, value: i64, as_i32: bool| {
            (0..12).fold(t.clone(), |acc, row| with_target(&acc, row, value, as_i32))
        };
        let mut out: Vec<(Bad, Expect)> = Vec::new();
        for (k, dt) in DTYPES.into_iter().enumerate() {
            let s = sub_seed(seed, k);
            let mut b = base("every target -100 (i64)", dt, s);
            b.targets = all(&b.targets, -100, false);
            out.push((b, expect(-100, 0)));
            let mut b = base("every target -1 (i32), ignore_index -1, exact", dt, s);
            b.opts.ignore_index = -1;
            b.opts.filter_eps = FilterEps::Off;
            b.targets = all(&b.targets, -1, true);
            out.push((b, expect(-1, 0)));
            let mut b = base("shift 4 = seq_len 4", dt, s);
            b.opts.shift = 4;
            b.opts.seq_len = Some(4);
            out.push((b, expect(-100, 4)));
        }
        let s = sub_seed(seed, 5);
        let mut b = base("shift N = 12 (i32 targets)", DType::F32, s);
        b.targets = all(&b.targets, 3, true);
        b.opts.shift = 12;
        out.push((b, expect(-100, 12)));
        let mut b = base("shift usize::MAX", DType::BF16, s);
        b.opts.shift = usize::MAX;
        out.push((b, expect(-100, usize::MAX)));
        let mut b = base("every target -100, with d_lse", DType::F16, s);
        b.targets = all(&b.targets, -100, false);
        b.d_lse = Some(f32s(vec![12], 0.5));
        out.push((b, expect(-100, 0)));
        out
    })
}

/// NaN or ±Inf in `e`, `c` or `bias` with `check_finite` (the default). The forward must give
/// `CceError::NonFinite` with a non-finite `value`. (Only the forward is held to it: the
/// contract checks finiteness "through the lse of every row", and a backward is handed the lse
/// of a forward that already failed; a stand-alone backward on bad inputs with a finite lse is
/// not required to notice.)
pub fn rejects_non_finite<B: Backend>(backend: &B, cfg: &SuiteConfig) -> CheckResult {
    run_bad("rejects_non_finite", backend, cfg, |seed| {
        let mut rng = crate::data::rng(seed, 0xf1f1);
        let is = || {
            Box::new(|e: &CceError| match e {
                CceError::NonFinite { value, .. } if !value.is_finite() => Ok(()),
                other => Err(format!(
                    "expected CceError::NonFinite with the non-finite value, got {other:?}"
                )),
            }) as Expect
        };
        let mut out: Vec<(Bad, Expect)> = Vec::new();
        let base = |label: &str, dt, s| {
            let mut b = base(label, dt, s);
            b.entries = vec![Entry::Forward];
            b
        };
        for (k, dt) in DTYPES.into_iter().enumerate() {
            let s = sub_seed(seed, k);
            let i = rng.random_range(0..96usize);
            let mut b = base(&format!("NaN in e at {i}"), dt, s);
            b.e = with_value(&b.e, i, f32::NAN);
            out.push((b, is()));
            let i = rng.random_range(0..96usize);
            let mut b = base(&format!("-inf in e at {i}"), dt, s);
            b.e = with_value(&b.e, i, f32::NEG_INFINITY);
            out.push((b, is()));
            let j = rng.random_range(0..160usize);
            let mut b = base(&format!("+inf in c at {j}"), dt, s);
            b.c = with_value(&b.c, j, f32::INFINITY);
            out.push((b, is()));
            let j = rng.random_range(0..20usize);
            let mut b = base(&format!("NaN in bias at {j}"), dt, s);
            b.bias = Some(with_value(b.bias.as_ref().expect("bias"), j, f32::NAN));
            out.push((b, is()));
        }
        out
    })
}

/// Zero-sized dimensions: `N = 0`, `V = 0`, `D = 0`, a `[B, 0, D]` `e`. Each must give
/// `CceError::EmptyInput`.
pub fn rejects_empty_input<B: Backend>(backend: &B, cfg: &SuiteConfig) -> CheckResult {
    run_bad("rejects_empty_input", backend, cfg, |seed| {
        let is = || variant_is("EmptyInput", |e| matches!(e, CceError::EmptyInput { .. }));
        let mut out: Vec<(Bad, Expect)> = Vec::new();
        for (k, dt) in DTYPES.into_iter().enumerate() {
            let s = sub_seed(seed, k);
            let mut b = base("N = 0", dt, s);
            b.e = filled(vec![0, 8], dt);
            b.targets = HostTensor::from_i64(vec![]);
            b.lse = f32s(vec![0], 1.0);
            out.push((b, is()));
            let mut b = base("V = 0", dt, s);
            b.c = filled(vec![0, 8], dt);
            b.bias = None;
            out.push((b, is()));
            let mut b = base("D = 0", dt, s);
            b.e = filled(vec![12, 0], dt);
            b.c = filled(vec![20, 0], dt);
            out.push((b, is()));
            let mut b = base("e [2, 0, 8]", dt, s);
            b.e = filled(vec![2, 0, 8], dt);
            b.targets = HostTensor::new(vec![2, 0], HostData::I64(vec![])).expect("empty");
            b.lse = f32s(vec![0], 1.0);
            out.push((b, is()));
        }
        out
    })
}

/// Options outside their domain. Each must give `CceError::InvalidOption` naming the field.
pub fn rejects_invalid_options<B: Backend>(backend: &B, cfg: &SuiteConfig) -> CheckResult {
    run_bad("rejects_invalid_options", backend, cfg, |seed| {
        let bad_opts: Vec<(&'static str, &str, Options)> = vec![
            (
                "softcap",
                "softcap 0",
                Options {
                    softcap: Some(0.0),
                    ..Default::default()
                },
            ),
            (
                "softcap",
                "softcap -3",
                Options {
                    softcap: Some(-3.0),
                    ..Default::default()
                },
            ),
            (
                "softcap",
                "softcap NaN",
                Options {
                    softcap: Some(f32::NAN),
                    ..Default::default()
                },
            ),
            (
                "softcap",
                "softcap inf",
                Options {
                    softcap: Some(f32::INFINITY),
                    ..Default::default()
                },
            ),
            (
                "label_smoothing",
                "label_smoothing 1",
                Options {
                    label_smoothing: 1.0,
                    ..Default::default()
                },
            ),
            (
                "label_smoothing",
                "label_smoothing -0.1",
                Options {
                    label_smoothing: -0.1,
                    ..Default::default()
                },
            ),
            (
                "z_loss",
                "z_loss -1",
                Options {
                    z_loss: -1.0,
                    ..Default::default()
                },
            ),
            (
                "z_loss",
                "z_loss NaN",
                Options {
                    z_loss: f32::NAN,
                    ..Default::default()
                },
            ),
            (
                "filter_eps",
                "filter_eps 0",
                Options {
                    filter_eps: FilterEps::Value(0.0),
                    ..Default::default()
                },
            ),
            (
                "filter_eps",
                "filter_eps 2",
                Options {
                    filter_eps: FilterEps::Value(2.0),
                    ..Default::default()
                },
            ),
            (
                "max_dropped_mass",
                "max_dropped_mass 2",
                Options {
                    max_dropped_mass: 2.0,
                    ..Default::default()
                },
            ),
            (
                "max_dropped_mass",
                "max_dropped_mass NaN",
                Options {
                    max_dropped_mass: f32::NAN,
                    ..Default::default()
                },
            ),
            (
                "seq_len",
                "seq_len 0",
                Options {
                    seq_len: Some(0),
                    ..Default::default()
                },
            ),
            (
                "seq_len",
                "seq_len 5 does not divide N = 12",
                Options {
                    seq_len: Some(5),
                    shift: 1,
                    ..Default::default()
                },
            ),
        ];
        bad_opts
            .into_iter()
            .enumerate()
            .map(|(k, (name, label, opts))| {
                let mut b = base(label, DTYPES[k % 3], sub_seed(seed, k));
                b.opts = opts;
                let expect: Expect = Box::new(move |e| match e {
                    CceError::InvalidOption { name: got, .. } if *got == name => Ok(()),
                    other => Err(format!(
                        "expected CceError::InvalidOption {{ name: \"{name}\" }}, got {other:?}"
                    )),
                });
                (b, expect)
            })
            .collect()
    })
}

/// Backward upstream of the wrong shape or form: `lse` of length `N + 1`, per-row `d_loss` of
/// length `N + 1`, `d_lse` of length `N − 1` (each `CceError::ShapeMismatch`), and a scalar
/// `d_loss` for reduction none / a per-row one for mean (some error).
pub fn rejects_bad_upstream<B: Backend>(backend: &B, cfg: &SuiteConfig) -> CheckResult {
    run_bad("rejects_bad_upstream", backend, cfg, |seed| {
        let is = || {
            variant_is("ShapeMismatch", |e| {
                matches!(e, CceError::ShapeMismatch { .. })
            })
        };
        let any = || Box::new(|_: &CceError| Ok(())) as Expect;
        let mut out: Vec<(Bad, Expect)> = Vec::new();
        for (k, dt) in DTYPES.into_iter().enumerate() {
            let s = sub_seed(seed, k);
            let only_bwd = |mut b: Bad| {
                b.entries = vec![Entry::Backward];
                b
            };
            let mut b = only_bwd(base("lse of length N+1", dt, s));
            b.lse = f32s(vec![13], 3.0);
            out.push((b, is()));
            let mut b = only_bwd(base("per-row d_loss of length N+1", dt, s));
            b.opts.reduction = Reduction::None;
            b.d_loss = BadDLoss::PerRow(f32s(vec![13], 1.0));
            out.push((b, is()));
            let mut b = only_bwd(base("d_lse of length N-1", dt, s));
            b.d_lse = Some(f32s(vec![11], 0.5));
            out.push((b, is()));
            let mut b = only_bwd(base("scalar d_loss with reduction none", dt, s));
            b.opts.reduction = Reduction::None;
            out.push((b, any()));
            let mut b = only_bwd(base("per-row d_loss with reduction mean", dt, s));
            b.d_loss = BadDLoss::PerRow(f32s(vec![12], 1.0));
            out.push((b, any()));
            // Non-finite upstream gradients: an error naming the upstream and the row.
            for x in [f32::NAN, f32::INFINITY] {
                let mut b = only_bwd(base(&format!("scalar d_loss {x}"), dt, s));
                b.d_loss = BadDLoss::Scalar(x);
                out.push((b, non_finite("d_loss", 0)));
            }
            for (row, x) in [(5, f32::NAN), (0, f32::NEG_INFINITY)] {
                let mut b = only_bwd(base(&format!("per-row d_loss {x} at row {row}"), dt, s));
                b.opts.reduction = Reduction::None;
                b.d_loss = BadDLoss::PerRow(with_value(&f32s(vec![12], 1.0), row, x));
                out.push((b, non_finite("d_loss", row)));
            }
            for (row, x) in [(7, f32::NAN), (11, f32::INFINITY)] {
                let mut b = only_bwd(base(&format!("d_lse {x} at row {row}"), dt, s));
                b.d_lse = Some(with_value(&f32s(vec![12], 0.5), row, x));
                out.push((b, non_finite("d_lse", row)));
            }
        }
        out
    })
}
