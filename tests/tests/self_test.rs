//! Self-test of the suite: the oracle backend passes every check (stamped by the macro), and
//! deliberately broken backends fail the checks meant to catch them. A check that cannot fail
//! is a defect.

use cce_conformance::{checks, CheckResult, OracleBackend, SuiteConfig};
use cce_core::options::{GradDType, Reduction};
use cce_core::{
    Backend, BackwardOutput, CceError, DLoss, DType, FilterRule, ForwardOutput, HostData,
    HostTensor, Inputs, Options, Result, Saved, TensorMeta, Upstream,
};
use std::sync::atomic::{AtomicU64, Ordering};

// The suite on the oracle itself: every check must pass.
cce_conformance::conformance_suite!(
    oracle,
    OracleBackend::new(),
    require = true,
    max_work_flop = 3e9,
    fixture_max_rows = 48,
);

// A backend whose constructor reports no device: every test prints "skipping" and passes.
cce_conformance::conformance_suite!(
    absent,
    Err::<OracleBackend, CceError>(CceError::NoDevice {
        backend: "absent",
        reason: "self-test of the skip path".into(),
    }),
    require_env = "CCE_REQUIRE_ABSENT_SELFTEST",
);

/// A deliberate defect.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    /// `d_c` off by a relative 1e-3.
    DcRelative,
    /// `d_e` off by a relative 1e-3.
    DeRelative,
    /// With 16-bit inputs, `d_c` and `d_e` off by a relative 3% (what a tolerance sized for
    /// 16-bit G rounding must still catch).
    GradsPercent16,
    /// `d_bias` not returned.
    DropBiasGrad,
    /// `d_bias` all zero.
    ZeroBiasGrad,
    /// lse of one row (the middle one) off by a relative 1e-3.
    LseOneRow,
    /// lse wrong only on the first row past one tile (`limits().tile.rows`).
    LseFirstRowOfSecondTile,
    /// Mean over all rows instead of the valid ones.
    MeanOverAllRows,
    /// NaN loss when every row is ignored under sum or none (what peers do under mean).
    NanWhenAllIgnored,
    /// A mean over no valid row returns loss 0 and zero gradients (the old contract) instead
    /// of `AllTargetsIgnored`.
    ZeroMeanWhenAllIgnored,
    /// Only the forward rejects a mean over no valid row; the backward returns zeros.
    AllIgnoredOnlyInForward,
    /// `AllTargetsIgnored` reports shift 0 whatever the shift.
    WrongShiftInAllIgnored,
    /// Argmax of row 0 shifted by one class.
    ArgmaxOff,
    /// Entropy off by a relative 1e-3.
    EntropyOff,
    /// Softcap ignored.
    IgnoreSoftcap,
    /// Label smoothing ignored.
    IgnoreLabelSmoothing,
    /// z-loss ignored.
    IgnoreZLoss,
    /// Shift ignored.
    IgnoreShift,
    /// lse upstream gradient ignored.
    IgnoreDLse,
    /// Filtered mode: `d_c` error of 1e-3 while reporting (almost) no dropped mass.
    UnexplainedFilterError,
    /// Filtered mode: reported dropped mass over `max_dropped_mass`.
    DroppedMassOverBound,
    /// Exact mode: reports skipped entries.
    SkipsInExactMode,
    /// Out-of-range targets clamped instead of rejected.
    AcceptOutOfRange,
    /// TargetOutOfRange names the wrong row.
    WrongRowInError,
    /// Every error turned into a generic backend error.
    WrongVariant,
    /// check_finite ignored.
    IgnoreCheckFinite,
    /// Panics on empty inputs.
    PanicOnEmpty,
    /// lse differs by one ulp between calls.
    NonDeterministic,
    /// Gradients always f32.
    GradDTypeIgnored,
    /// Gradients computed although not asked for.
    ComputeFlagsIgnored,
    /// Rows of `d_e` whose norm is below 1e-4 (confident rows) off by a relative 1%: below
    /// any batch-wide tolerance.
    TinyRowsOff,
    /// NaN loss when the bias masks a class with −inf (what a −inf-unsafe online
    /// log-sum-exp gives).
    NanWithMaskedClasses,
    /// Zero gradients under a softcap below 0.01 (what `1 − (z/s)²` gives once `tanh`
    /// rounds to 1).
    SmallCapZeroGrads,
}

struct Faulty {
    inner: OracleBackend,
    fault: Fault,
    calls: AtomicU64,
}

impl Faulty {
    fn new(fault: Fault) -> Self {
        Self {
            inner: OracleBackend::default(),
            fault,
            calls: AtomicU64::new(0),
        }
    }
}

/// Apply `f` to every value of a float tensor, keeping its dtype.
fn map(t: &HostTensor, f: impl Fn(usize, f64) -> f64) -> HostTensor {
    let v: Vec<f64> = t
        .to_f64_vec()
        .into_iter()
        .enumerate()
        .map(|(k, x)| f(k, x))
        .collect();
    let data = match t.dtype() {
        DType::F16 => HostData::F16(v.iter().map(|&x| half::f16::from_f64(x)).collect()),
        DType::BF16 => HostData::BF16(v.iter().map(|&x| half::bf16::from_f64(x)).collect()),
        _ => HostData::F32(v.iter().map(|&x| x as f32).collect()),
    };
    HostTensor::new(t.shape().to_vec(), data).unwrap()
}

impl Faulty {
    fn opts(&self, opts: &Options) -> Options {
        let mut o = opts.clone();
        match self.fault {
            Fault::IgnoreSoftcap => o.softcap = None,
            Fault::IgnoreLabelSmoothing => o.label_smoothing = 0.0,
            Fault::IgnoreZLoss => o.z_loss = 0.0,
            Fault::IgnoreShift => {
                o.shift = 0;
            }
            Fault::IgnoreCheckFinite => o.check_finite = false,
            Fault::GradDTypeIgnored => o.grad_dtype = GradDType::F32,
            Fault::ComputeFlagsIgnored => {
                o.compute_d_e = true;
                o.compute_d_c = true;
            }
            _ => {}
        }
        o
    }

    fn guard(&self, inputs: &Inputs<'_, HostTensor>, opts: &Options) -> Option<HostTensor> {
        if self.fault == Fault::PanicOnEmpty && (inputs.e.numel() == 0 || inputs.c.numel() == 0) {
            panic!("faulty backend: index out of bounds on an empty input");
        }
        if self.fault == Fault::AcceptOutOfRange {
            let v = inputs.c.shape()[0] as i64;
            let t = inputs.targets.to_i64_vec()?;
            let fixed: Vec<i64> = t
                .iter()
                .map(|&x| {
                    if x == opts.ignore_index {
                        x
                    } else {
                        x.clamp(0, v - 1)
                    }
                })
                .collect();
            return HostTensor::from_i64(fixed)
                .reshape(inputs.targets.shape().to_vec())
                .ok();
        }
        None
    }

    fn map_err(&self, e: CceError) -> CceError {
        match (self.fault, e) {
            (Fault::WrongVariant, e) => CceError::backend("faulty", e.to_string()),
            (
                Fault::WrongRowInError,
                CceError::TargetOutOfRange {
                    row,
                    value,
                    vocab_size,
                    ignore_index,
                },
            ) => CceError::TargetOutOfRange {
                row: row + 1,
                value,
                vocab_size,
                ignore_index,
            },
            (
                Fault::WrongShiftInAllIgnored,
                CceError::AllTargetsIgnored {
                    n, ignore_index, ..
                },
            ) => CceError::AllTargetsIgnored {
                n,
                ignore_index,
                shift: 0,
            },
            (_, e) => e,
        }
    }

    /// Whether this fault answers a mean over no valid row as the sum (0) in `backward` (else
    /// only in `forward`, or not at all).
    fn silent_mean(&self, backward: bool) -> bool {
        match self.fault {
            Fault::ZeroMeanWhenAllIgnored => true,
            Fault::AllIgnoredOnlyInForward => backward,
            _ => false,
        }
    }
}

/// The options with `Reduction::Sum`: the answer of a backend that averages over no row as 0.
fn as_sum(o: &Options) -> Options {
    Options {
        reduction: Reduction::Sum,
        ..o.clone()
    }
}

impl Backend for Faulty {
    type Buffer = HostTensor;

    fn name(&self) -> &'static str {
        "faulty-oracle"
    }

    fn limits(&self) -> cce_core::DeviceLimits {
        self.inner.limits()
    }

    fn upload(&self, host: &HostTensor) -> Result<HostTensor> {
        Ok(host.clone())
    }

    fn download(&self, buf: &HostTensor) -> Result<HostTensor> {
        Ok(buf.clone())
    }

    fn forward(
        &self,
        inputs: &Inputs<'_, HostTensor>,
        opts: &Options,
    ) -> Result<ForwardOutput<HostTensor>> {
        let o = self.opts(opts);
        let fixed = self.guard(inputs, opts);
        let inputs = Inputs {
            targets: fixed.as_ref().unwrap_or(inputs.targets),
            ..*inputs
        };
        let mut out = match self.inner.forward(&inputs, &o) {
            Err(CceError::AllTargetsIgnored { .. }) if self.silent_mean(false) => {
                self.inner.forward(&inputs, &as_sum(&o))
            }
            r => r,
        }
        .map_err(|e| self.map_err(e))?;
        let n = out.lse.numel();
        let k = self.calls.fetch_add(1, Ordering::Relaxed);
        let masked = inputs
            .bias
            .is_some_and(|b| b.to_f32_vec().contains(&f32::NEG_INFINITY));
        if self.fault == Fault::NanWithMaskedClasses && masked {
            out.loss = map(&out.loss, |_, _| f64::NAN);
        }
        match self.fault {
            Fault::LseOneRow => {
                out.lse = map(&out.lse, |i, x| {
                    if i == n / 2 {
                        x + 1e-3 * x.abs().max(1.0)
                    } else {
                        x
                    }
                })
            }
            Fault::LseFirstRowOfSecondTile => {
                let r = self.limits().tile.rows;
                out.lse = map(&out.lse, |i, x| {
                    if i == r {
                        x + 1e-3 * x.abs().max(1.0)
                    } else {
                        x
                    }
                })
            }
            Fault::MeanOverAllRows if opts.reduction == Reduction::Mean => {
                let scale = out.stats.n_valid as f64 / n as f64;
                out.loss = map(&out.loss, |_, x| x * scale);
            }
            Fault::NanWhenAllIgnored if out.stats.n_valid == 0 => {
                out.loss = map(&out.loss, |_, _| f64::NAN);
            }
            Fault::ArgmaxOff => {
                let v = inputs.c.shape()[0] as i32;
                if let Some(a) = &out.argmax {
                    let mut x = a.to_i64_vec().unwrap();
                    x[0] = (x[0] + 1) % v as i64;
                    out.argmax = Some(HostTensor::from_i32(x.iter().map(|&y| y as i32).collect()));
                }
            }
            Fault::EntropyOff => {
                out.entropy = out
                    .entropy
                    .as_ref()
                    .map(|t| map(t, |_, x| x * (1.0 + 1e-3)));
            }
            Fault::NonDeterministic if k % 2 == 1 => {
                out.lse = map(&out.lse, |i, x| {
                    if i == 0 {
                        f32::from_bits((x as f32).to_bits() + 1) as f64
                    } else {
                        x
                    }
                });
            }
            _ => {}
        }
        Ok(out)
    }

    fn backward(
        &self,
        inputs: &Inputs<'_, HostTensor>,
        opts: &Options,
        saved: Saved<'_, HostTensor>,
        upstream: &Upstream<'_, HostTensor>,
    ) -> Result<BackwardOutput<HostTensor>> {
        let o = self.opts(opts);
        let fixed = self.guard(inputs, opts);
        let inputs = Inputs {
            targets: fixed.as_ref().unwrap_or(inputs.targets),
            ..*inputs
        };
        let up = Upstream {
            d_loss: match &upstream.d_loss {
                DLoss::Scalar(s) => DLoss::Scalar(*s),
                DLoss::PerRow(b) => DLoss::PerRow(*b),
            },
            d_lse: if self.fault == Fault::IgnoreDLse {
                None
            } else {
                upstream.d_lse
            },
        };
        let mut out = match self.inner.backward(&inputs, &o, saved, &up) {
            Err(CceError::AllTargetsIgnored { .. }) if self.silent_mean(true) => {
                self.inner.backward(&inputs, &as_sum(&o), saved, &up)
            }
            r => r,
        }
        .map_err(|e| self.map_err(e))?;
        let rule = FilterRule::resolve(opts, inputs.e.dtype());
        match self.fault {
            Fault::DcRelative => {
                out.d_c = out.d_c.as_ref().map(|t| map(t, |_, x| x * (1.0 + 1e-3)))
            }
            Fault::DeRelative => {
                out.d_e = out.d_e.as_ref().map(|t| map(t, |_, x| x * (1.0 + 1e-3)))
            }
            Fault::GradsPercent16 if inputs.e.dtype() != cce_core::DType::F32 => {
                out.d_c = out.d_c.as_ref().map(|t| map(t, |_, x| x * 1.03));
                out.d_e = out.d_e.as_ref().map(|t| map(t, |_, x| x * 1.03));
            }
            Fault::DropBiasGrad => out.d_bias = None,
            Fault::ZeroBiasGrad => out.d_bias = out.d_bias.as_ref().map(|t| map(t, |_, _| 0.0)),
            Fault::UnexplainedFilterError if rule.enabled => {
                out.d_c = out.d_c.as_ref().map(|t| map(t, |_, x| x * (1.0 + 1e-3)));
                out.stats.dropped_mass_max = 1e-7;
                out.stats.dropped_mass_mean = 1e-8;
            }
            Fault::DroppedMassOverBound if rule.enabled => {
                out.stats.dropped_mass_max = 2.0 * rule.max_dropped_mass as f64;
            }
            Fault::SkipsInExactMode if !rule.enabled => out.stats.entries_skipped = 3,
            Fault::TinyRowsOff => {
                let d = *inputs.e.shape().last().unwrap_or(&1);
                out.d_e = out.d_e.as_ref().map(|t| {
                    let v = t.to_f64_vec();
                    map(t, |k, x| {
                        let row = &v[(k / d) * d..(k / d + 1) * d];
                        let norm = row.iter().map(|y| y * y).sum::<f64>().sqrt();
                        if norm < 1e-4 {
                            x * 1.01
                        } else {
                            x
                        }
                    })
                });
            }
            Fault::SmallCapZeroGrads if opts.softcap.is_some_and(|s| s < 0.01) => {
                out.d_e = out.d_e.as_ref().map(|t| map(t, |_, _| 0.0));
                out.d_c = out.d_c.as_ref().map(|t| map(t, |_, _| 0.0));
            }
            _ => {}
        }
        Ok(out)
    }
}

fn cfg() -> SuiteConfig {
    SuiteConfig {
        max_work_flop: 3e9,
        fixture_max_rows: 48,
        ..SuiteConfig::new("faulty")
    }
}

type Check = fn(&Faulty, &SuiteConfig) -> CheckResult;

/// Run `check` on a backend with `fault` and require it to fail; return the report text.
fn must_fail(fault: Fault, name: &str, check: Check) -> String {
    let b = Faulty::new(fault);
    match check(&b, &cfg()) {
        Ok(report) => panic!(
            "check {name} PASSED a backend with fault {fault:?}: the check cannot catch it\n{report}"
        ),
        Err(f) => {
            let text = f.to_string();
            eprintln!(
                "fault {fault:?} caught by {name}: {}",
                text.lines().next().unwrap_or("")
            );
            text
        }
    }
}

#[test]
fn wrong_d_c_fails_reductions_and_the_real_fixture() {
    let text = must_fail(Fault::DcRelative, "reductions", checks::reductions);
    // The report in burn's style: indices, values, errors, tolerance, case and seed.
    for needle in [
        "d_c",
        "(row, col)",
        "ours",
        "gt",
        "ref",
        "allowed",
        "CCE_SEED=",
        "case seed",
        "N=96 D=64 V=300",
    ] {
        assert!(text.contains(needle), "report lacks '{needle}':\n{text}");
    }
    eprintln!("{text}");
    let text = must_fail(Fault::DcRelative, "real_fixture", checks::real_fixture);
    assert!(
        text.contains("exceeds the original CCE's default"),
        "{text}"
    );
}

#[test]
fn percent_errors_in_16_bit_gradients_fail_distributions() {
    // Only the f16 / bf16 cases carry the defect: their per-element allowance (RMS plus term
    // magnitude, τ = 1e-3 / 1e-2) must still be under a 3% error.
    let text = must_fail(
        Fault::GradsPercent16,
        "distributions",
        checks::distributions,
    );
    assert!(text.contains("bf16") || text.contains("f16"), "{text}");
    assert!(
        !text.contains("FAIL [distribution] N=192 D=128 V=2000 f32"),
        "{text}"
    );
}

#[test]
fn wrong_d_e_fails_distributions() {
    let text = must_fail(Fault::DeRelative, "distributions", checks::distributions);
    assert!(text.contains("d_e"), "{text}");
}

/// Every check of the suite is shown to fail on some defect (the tests of this file).
#[test]
fn every_check_has_a_defect_it_catches() {
    let this_file = include_str!("self_test.rs");
    for check in cce_conformance::CHECKS {
        assert!(
            this_file.contains(&format!("checks::{check})"))
                || this_file.contains(&format!("checks::{check},")),
            "no self-test shows that check '{check}' can fail"
        );
    }
}

#[test]
fn missing_or_zero_bias_gradient_fails() {
    let text = must_fail(
        Fault::DropBiasGrad,
        "hostile_shapes",
        checks::hostile_shapes,
    );
    assert!(
        text.contains("d_bias was asked for but not returned"),
        "{text}"
    );
    must_fail(Fault::ZeroBiasGrad, "softcap", checks::softcap);
}

#[test]
fn wrong_lse_on_one_row_fails() {
    let text = must_fail(Fault::LseOneRow, "reductions", checks::reductions);
    assert!(text.contains("lse"), "{text}");
    must_fail(
        Fault::LseFirstRowOfSecondTile,
        "one_tile_plus_one",
        checks::one_tile_plus_one,
    );
}

#[test]
fn wrong_reduction_and_ignored_rows_fail() {
    must_fail(Fault::MeanOverAllRows, "reductions", checks::reductions);
    must_fail(Fault::MeanOverAllRows, "ignored_rows", checks::ignored_rows);
    // Under sum and none an all-ignored batch is valid and must give exact zeros.
    let text = must_fail(
        Fault::NanWhenAllIgnored,
        "ignored_rows",
        checks::ignored_rows,
    );
    assert!(text.contains("all-ignored"), "{text}");
    assert!(text.contains("must be exactly 0"), "{text}");
    // Under mean it is an error, from forward and backward, naming ignore_index and shift.
    let text = must_fail(
        Fault::ZeroMeanWhenAllIgnored,
        "ignored_rows",
        checks::ignored_rows,
    );
    assert!(
        text.contains("the call must fail with CceError::AllTargetsIgnored"),
        "{text}"
    );
    let text = must_fail(
        Fault::ZeroMeanWhenAllIgnored,
        "rejects_all_targets_ignored",
        checks::rejects_all_targets_ignored,
    );
    assert!(text.contains("via Forward"), "{text}");
    let text = must_fail(
        Fault::AllIgnoredOnlyInForward,
        "rejects_all_targets_ignored",
        checks::rejects_all_targets_ignored,
    );
    assert!(
        text.contains("via Backward") && !text.contains("via Forward"),
        "{text}"
    );
    let text = must_fail(
        Fault::WrongShiftInAllIgnored,
        "rejects_all_targets_ignored",
        checks::rejects_all_targets_ignored,
    );
    assert!(text.contains("shift 4 = seq_len 4"), "{text}");
    let text = must_fail(
        Fault::WrongShiftInAllIgnored,
        "ignored_rows",
        checks::ignored_rows,
    );
    assert!(text.contains("shift=seq_len"), "{text}");
}

#[test]
fn ignored_options_fail() {
    must_fail(Fault::IgnoreSoftcap, "softcap", checks::softcap);
    must_fail(
        Fault::IgnoreLabelSmoothing,
        "label_smoothing",
        checks::label_smoothing,
    );
    must_fail(Fault::IgnoreZLoss, "z_loss", checks::z_loss);
    must_fail(Fault::IgnoreShift, "shift", checks::shift);
    must_fail(Fault::IgnoreDLse, "d_lse_upstream", checks::d_lse_upstream);
    must_fail(Fault::GradDTypeIgnored, "api_paths", checks::api_paths);
    must_fail(Fault::ComputeFlagsIgnored, "api_paths", checks::api_paths);
}

#[test]
fn wrong_side_outputs_fail() {
    must_fail(Fault::ArgmaxOff, "side_outputs", checks::side_outputs);
    must_fail(Fault::EntropyOff, "side_outputs", checks::side_outputs);
}

#[test]
fn filter_defects_fail() {
    must_fail(
        Fault::UnexplainedFilterError,
        "filtered_mode",
        checks::filtered_mode,
    );
    let text = must_fail(
        Fault::DroppedMassOverBound,
        "filtered_mode",
        checks::filtered_mode,
    );
    assert!(text.contains("exceeds max_dropped_mass"), "{text}");
    must_fail(
        Fault::SkipsInExactMode,
        "hostile_shapes",
        checks::hostile_shapes,
    );
}

#[test]
fn nondeterminism_fails() {
    must_fail(
        Fault::NonDeterministic,
        "deterministic",
        checks::deterministic,
    );
}

#[test]
fn bad_input_defects_fail() {
    must_fail(
        Fault::AcceptOutOfRange,
        "rejects_target_out_of_range",
        checks::rejects_target_out_of_range,
    );
    must_fail(
        Fault::WrongRowInError,
        "rejects_target_out_of_range",
        checks::rejects_target_out_of_range,
    );
    let wrong: [(&str, Check); 7] = [
        ("rejects_shape_mismatch", checks::rejects_shape_mismatch),
        (
            "rejects_all_targets_ignored",
            checks::rejects_all_targets_ignored,
        ),
        ("rejects_dtype_mismatch", checks::rejects_dtype_mismatch),
        ("rejects_non_finite", checks::rejects_non_finite),
        ("rejects_empty_input", checks::rejects_empty_input),
        ("rejects_invalid_options", checks::rejects_invalid_options),
        ("rejects_bad_upstream", checks::rejects_bad_upstream),
    ];
    for (name, check) in wrong {
        must_fail(Fault::WrongVariant, name, check);
    }
    must_fail(
        Fault::IgnoreCheckFinite,
        "rejects_non_finite",
        checks::rejects_non_finite,
    );
    let text = must_fail(
        Fault::PanicOnEmpty,
        "rejects_empty_input",
        checks::rejects_empty_input,
    );
    assert!(text.contains("panicked"), "{text}");
}

#[test]
fn constructor_forms_and_required_backends() {
    use cce_conformance::harness::{acquire, Ctor, ResolveInfallible};
    // A plain backend and a Result both resolve.
    assert!(Ctor(OracleBackend::default()).resolve().is_ok());
    assert!(Ctor(OracleBackend::new()).resolve().is_ok());
    let no_device = || {
        Err::<OracleBackend, _>(CceError::NoDevice {
            backend: "x",
            reason: "none".into(),
        })
    };
    let optional = SuiteConfig::new("selftest_optional");
    assert!(acquire(&optional, no_device()).is_none());
    let required = SuiteConfig {
        require: true,
        ..SuiteConfig::new("selftest_required")
    };
    let r = std::panic::catch_unwind(|| acquire(&required, no_device()));
    assert!(r.is_err(), "a required backend without device must fail");
    let other = std::panic::catch_unwind(|| {
        acquire(
            &optional,
            Err::<OracleBackend, _>(CceError::Unsupported {
                backend: "x",
                what: "y".into(),
            }),
        )
    });
    assert!(
        other.is_err(),
        "constructor errors other than NoDevice must fail"
    );
}

#[test]
fn per_row_defects_fail_the_numerics_checks() {
    let text = must_fail(Fault::TinyRowsOff, "confident_rows", checks::confident_rows);
    assert!(text.contains("per-row error above"), "{text}");
    let text = must_fail(
        Fault::NanWithMaskedClasses,
        "masked_classes",
        checks::masked_classes,
    );
    assert!(text.contains("-inf bias"), "{text}");
    let text = must_fail(
        Fault::SmallCapZeroGrads,
        "softcap_extremes",
        checks::softcap_extremes,
    );
    assert!(text.contains("softcap 1e-3"), "{text}");
}

/// The general judge's per-row rule (`d_e rows`) sees a 1% error on confident rows, which the
/// per-element rule (term scale `p + onehot`) lets pass, and names the worst rows.
#[test]
fn the_per_row_rule_sees_confident_rows_off() {
    let text = must_fail(Fault::TinyRowsOff, "confident_rows", checks::confident_rows);
    assert!(
        text.contains("d_e rows") && text.contains("rows (worst first) out of tolerance"),
        "{text}"
    );
}
