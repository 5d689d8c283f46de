//! Property-based harness: random problems (shapes, dtypes, options, upstream gradients and
//! special values) on every backend available, each compared with the f64 oracle
//! (`cce_reference::naive`) by the conformance suite's judge (element by element and row by
//! row, `cce_conformance::run::judge_outputs`), or checked for the exact typed error where the
//! input is invalid.
//!
//! - Backends: the CPU always (default plan, and the tile-ownership plan with small GPU-like
//!   tiles); wgpu with feature `wgpu` (lavapipe in CI; skipped without an adapter unless
//!   `CCE_REQUIRE_WGPU=1`); CUDA with feature `cuda` (skipped with a message without a GPU
//!   unless `CCE_REQUIRE_CUDA=1`).
//! - Cases per backend: `CCE_FUZZ_CASES` (default [`DEFAULT_CASES`], sized for CI: a few
//!   seconds per backend on two cores); `CCE_FUZZ_CASES=2000` for a longer run.
//! - Every failure proptest finds (after shrinking) is appended to
//!   `tests/tests/fuzz.proptest-regressions`, which is committed: its cases run first, on every
//!   backend, in every later run.
//!
//! What a case draws ([`spec`]): `N` (1, odd, off every tile multiple, up to 129), `D` (1 to
//! 100), `V` (1 to 513, around 128 and 256), dtype f32 / f16 / bf16, data peaked or flat, a
//! bias, every reduction (a random per-row upstream for `none`, a random scalar otherwise), an
//! upstream of the lse, softcap log-uniform in [1e-3, 1e30], label smoothing up to 0.999,
//! z-loss, shift with a sequence length dividing `N` (or a `[B, T, D]` e), 20% ignored rows,
//! the filter on or off, f32 gradients, each API entry point; and one special value
//! ([`Special`]): a −inf bias entry (masking a class nobody targets, or a target: then
//! `TargetMasked`), NaN/±inf in `e`, `c`, `bias` (`NonFinite`), in the loss or lse upstream
//! (`NonFinite` naming `d_loss` / `d_lse` and the row), confident rows (`p_y → 1`), a large
//! common offset (bias + 1e4), every row ignored.

use cce_conformance::case::{Api, Case, CaseData, DLossData, Ignored};
use cce_conformance::data::Dist;
use cce_conformance::run::{call, run_with_data};
use cce_conformance::SuiteConfig;
use cce_core::options::{FilterEps, GradDType, Reduction};
use cce_core::plan::{DeviceLimits, StrategyKind, TileShape};
use cce_core::{Backend, CceError, DType, HostTensor, TensorMeta};
use cce_reference::{naive, CpuBackend, OracleDLoss, Precision};
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError, TestRunner};

/// Cases per backend without `CCE_FUZZ_CASES`.
pub const DEFAULT_CASES: u32 = 256;

/// Inputs whose fix is not on this branch yet, per backend (`"*"`: every backend): cases that
/// draw them are skipped (and counted in the test's output) instead of failing. Empty when
/// every backend handles every input.
pub const NOT_YET_FIXED: &[(&str, Gap)] = &[];

/// A kind of input a backend does not handle yet ([`NOT_YET_FIXED`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Gap {
    /// A special value.
    Special(SpecialKind),
    /// A softcap above this value.
    SoftcapAbove(f64),
    /// A softcap below this value.
    SoftcapBelow(f64),
    /// A z-loss with confident rows (`V = 1`, or [`SpecialKind::Confident`]).
    ZLossOnConfidentRows,
}

impl Gap {
    fn covers(self, s: &Spec) -> bool {
        let cap = s.softcap_log10.map(|x| 10f64.powf(x));
        match self {
            Gap::Special(k) => s.special == k,
            Gap::SoftcapAbove(x) => cap.is_some_and(|c| c > x),
            Gap::SoftcapBelow(x) => cap.is_some_and(|c| c < x),
            Gap::ZLossOnConfidentRows => {
                s.z_loss > 0.0 && (s.v == 1 || s.special == SpecialKind::Confident)
            }
        }
    }
}

/// One special value per case (at most one, so that the expected error is unambiguous).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpecialKind {
    /// Nothing special.
    None,
    /// A −inf bias entry on a class no valid row targets (valid: masked class, `p = 0`).
    BiasMasksClass,
    /// A −inf bias entry on a valid row's target (`TargetMasked`).
    BiasMasksTarget,
    /// NaN, +inf or −inf in `e`.
    NonFiniteE,
    /// NaN, +inf or −inf in `c`.
    NonFiniteC,
    /// NaN or +inf in the bias.
    NonFiniteBias,
    /// NaN or ±inf in the upstream gradient of the loss.
    NonFiniteDLoss,
    /// NaN or ±inf in the upstream gradient of the lse.
    NonFiniteDLse,
    /// Every valid row's target logit raised by 30 (`p_y → 1`, `1 − p_y ≈ e^-30`).
    Confident,
    /// Bias + 1e4 on every class (a common offset: loss and gradients unchanged).
    CommonOffset,
    /// Every row ignored.
    AllIgnored,
}

const SPECIALS: [SpecialKind; 11] = [
    SpecialKind::None,
    SpecialKind::BiasMasksClass,
    SpecialKind::BiasMasksTarget,
    SpecialKind::NonFiniteE,
    SpecialKind::NonFiniteC,
    SpecialKind::NonFiniteBias,
    SpecialKind::NonFiniteDLoss,
    SpecialKind::NonFiniteDLse,
    SpecialKind::Confident,
    SpecialKind::CommonOffset,
    SpecialKind::AllIgnored,
];

/// Everything a case draws (shrinks towards small, plain cases).
#[derive(Clone, Debug)]
pub struct Spec {
    n: usize,
    d: usize,
    v: usize,
    dtype: DType,
    flat: bool,
    bias: bool,
    reduction: Reduction,
    /// log10 of the softcap.
    softcap_log10: Option<f64>,
    label_smoothing: f32,
    z_loss: f32,
    /// (shift, index of the sequence length among the divisors of N, as [B, T, D]).
    shift: Option<(usize, usize, bool)>,
    d_lse: bool,
    ignored_some: bool,
    filtered: bool,
    grads_f32: bool,
    api: Api,
    special: SpecialKind,
    /// Where the special value goes (an index, reduced modulo the tensor's length).
    at: usize,
    /// Which non-finite value: 0 NaN, 1 +inf, 2 −inf.
    which: u8,
    seed: u64,
}

fn dim(small: usize, extra: &'static [usize]) -> impl Strategy<Value = usize> {
    prop_oneof![
        3 => 1..=small,
        1 => proptest::sample::select(extra),
    ]
}

/// The strategy of [`Spec`].
fn spec() -> impl Strategy<Value = Spec> {
    let sizes = (
        dim(40, &[1, 17, 33, 63, 65, 127, 129]),
        dim(24, &[1, 31, 33, 64, 65, 100]),
        dim(40, &[1, 2, 127, 128, 129, 255, 257, 511, 513]),
    );
    let kinds = (
        proptest::sample::select(vec![DType::F32, DType::F16, DType::BF16]),
        any::<bool>(),
        any::<bool>(),
        proptest::sample::select(vec![Reduction::Mean, Reduction::Sum, Reduction::None]),
        proptest::option::of(-3.0f64..30.0),
        prop_oneof![2 => Just(0.0f32), 1 => 0.0f32..0.999],
        prop_oneof![2 => Just(0.0f32), 1 => 1e-5f32..0.1],
        proptest::option::of((1usize..4, 0usize..8, any::<bool>())),
    );
    let flags = (
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        proptest::sample::select(vec![Api::Fused, Api::Separate, Api::ForwardOnly]),
        prop_oneof![3 => Just(SpecialKind::None), 7 => proptest::sample::select(SPECIALS.to_vec())],
        any::<usize>(),
        0u8..3,
        any::<u64>(),
    );
    (sizes, kinds, flags).prop_map(
        |(
            (n, d, v),
            (dtype, flat, bias, reduction, softcap_log10, label_smoothing, z_loss, shift),
            (d_lse, ignored_some, filtered, grads_f32, api, special, at, which, seed),
        )| Spec {
            n,
            d,
            v,
            dtype,
            flat,
            bias,
            reduction,
            softcap_log10,
            label_smoothing,
            z_loss,
            shift,
            d_lse,
            ignored_some,
            filtered,
            grads_f32,
            api,
            special,
            at,
            which,
            seed,
        },
    )
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|t| n.is_multiple_of(*t)).collect()
}

/// The conformance case a spec describes (before its special value).
fn case_of(s: &Spec) -> Case {
    let needs_bias = matches!(
        s.special,
        SpecialKind::BiasMasksClass
            | SpecialKind::BiasMasksTarget
            | SpecialKind::NonFiniteBias
            | SpecialKind::CommonOffset
    );
    let ignored = match (s.special, s.ignored_some) {
        (SpecialKind::AllIgnored, _) => Ignored::All,
        (_, true) => Ignored::Fraction(0.2),
        _ => Ignored::No,
    };
    let mut case = Case::new("fuzz", s.n, s.d, s.v, s.dtype)
        .bias(s.bias || needs_bias)
        .dist(if s.flat { Dist::Flat } else { Dist::Peaked })
        .ignored(ignored)
        .d_lse(s.d_lse || s.special == SpecialKind::NonFiniteDLse)
        .api(match s.special {
            // The upstream gradients are read by the backward only.
            SpecialKind::NonFiniteDLoss | SpecialKind::NonFiniteDLse
                if s.api == Api::ForwardOnly =>
            {
                Api::Separate
            }
            _ => s.api,
        });
    if s.filtered {
        case = case.filtered();
    }
    if let Some((shift, k, batched)) = s.shift {
        let divs = divisors(s.n);
        let t = divs[k % divs.len()];
        if batched && t < s.n {
            case.batch = Some(s.n / t);
        } else {
            case.opts.seq_len = Some(t);
        }
        case.opts.shift = shift;
    }
    case.with(|o| {
        o.reduction = s.reduction;
        o.softcap = s.softcap_log10.map(|x| 10f64.powf(x) as f32);
        o.label_smoothing = s.label_smoothing;
        // A common offset of 1e4 cancels in the loss but not in a z-loss (λ·lse² with lse ~
        // 1e4), whose gradients then pass f16's largest value: the offset goes without.
        o.z_loss = if s.special == SpecialKind::CommonOffset {
            0.0
        } else {
            s.z_loss
        };
        o.grad_dtype = if s.grads_f32 {
            GradDType::F32
        } else {
            GradDType::Input
        };
        if o.filter_eps != FilterEps::Off {
            o.filter_eps = FilterEps::Auto;
        }
    })
}

fn non_finite(which: u8) -> f32 {
    [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][which as usize % 3]
}

fn edit(t: &HostTensor, f: impl FnOnce(&mut Vec<f32>)) -> HostTensor {
    let mut v = t.to_f32_vec();
    f(&mut v);
    HostTensor::from_f32(t.shape().to_vec(), &v, t.dtype()).expect("float tensor")
}

/// The rows' prepared classes (`-1` ignored), as the library sees them.
fn classes(case: &Case, data: &CaseData) -> Vec<i32> {
    let mut opts = case.opts.clone();
    opts.reduction = Reduction::Sum;
    let p = cce_core::Problem::new(
        &data.e,
        &data.c,
        data.bias.as_ref().map(|b| b as &dyn TensorMeta),
        &data.targets,
        &opts,
    )
    .expect("valid case");
    let raw = data.targets.to_i64_vec().expect("integer targets");
    cce_core::PreparedTargets::new(&raw, &p, &opts)
        .expect("valid targets")
        .classes
}

/// What the call must return.
enum Expect {
    /// Outputs judged against the oracle.
    Valid,
    /// An error of the same variant as this one (the oracle's own, for masked targets or a
    /// mean over no row).
    SameVariant(CceError),
    /// `NonFinite` on an input (any `what`: backends name the tensor or the row's lse).
    NonFiniteInput,
    /// `NonFinite { what, row }` for an upstream gradient.
    NonFiniteUpstream(&'static str, usize),
}

/// Put the spec's special value into the data; say what the call must return.
fn apply_special(s: &Spec, case: &Case, data: &mut CaseData) -> Expect {
    let (n, d, v) = (case.n, case.d, case.v);
    // A mean over no valid row is refused before anything else is looked at.
    if let Some(rows) = cce_conformance::run::mean_over_no_valid_row(case, data) {
        return Expect::SameVariant(CceError::all_targets_ignored(rows, &case.opts));
    }
    let x = non_finite(s.which);
    let ys = classes(case, data);
    let valid: Vec<usize> = (0..n).filter(|&i| ys[i] >= 0).collect();
    match s.special {
        SpecialKind::None | SpecialKind::AllIgnored => {}
        // One class masked of at least two (a row whose every class is masked has lse −inf,
        // which the judge does not compare).
        SpecialKind::BiasMasksClass if v >= 2 => {
            let targeted: Vec<bool> = (0..v).map(|j| ys.contains(&(j as i32))).collect();
            if let Some(j) = (0..v).map(|k| (s.at + k) % v).find(|&j| !targeted[j]) {
                let b = data.bias.as_ref().expect("bias");
                data.bias = Some(edit(b, |b| b[j] = f32::NEG_INFINITY));
            }
        }
        SpecialKind::BiasMasksClass => {}
        SpecialKind::BiasMasksTarget => {
            if let Some(&i) = valid.get(s.at % valid.len().max(1)) {
                let j = ys[i] as usize;
                let b = data.bias.as_ref().expect("bias");
                data.bias = Some(edit(b, |b| b[j] = f32::NEG_INFINITY));
            }
        }
        SpecialKind::NonFiniteE => {
            data.e = edit(&data.e, |e| e[s.at % (n * d)] = x);
            return Expect::NonFiniteInput;
        }
        SpecialKind::NonFiniteC => {
            data.c = edit(&data.c, |c| c[s.at % (v * d)] = x);
            return Expect::NonFiniteInput;
        }
        SpecialKind::NonFiniteBias => {
            let b = data.bias.as_ref().expect("bias");
            let x = if x == f32::NEG_INFINITY { f32::NAN } else { x };
            data.bias = Some(edit(b, |b| b[s.at % v] = x));
            return Expect::NonFiniteInput;
        }
        SpecialKind::NonFiniteDLoss => match &mut data.d_loss {
            DLossData::Scalar(g) => {
                *g = x;
                return Expect::NonFiniteUpstream("d_loss", 0);
            }
            DLossData::PerRow(g) => {
                let row = s.at % n;
                g[row] = x;
                return Expect::NonFiniteUpstream("d_loss", row);
            }
        },
        SpecialKind::NonFiniteDLse => {
            let row = s.at % n;
            data.d_lse.as_mut().expect("d_lse")[row] = x;
            return Expect::NonFiniteUpstream("d_lse", row);
        }
        SpecialKind::Confident => {
            let c = data.c.to_f32_vec();
            // A row whose pushed values would leave a quarter of e's range (a tiny c_y in f16)
            // stays as it was: the case must be a valid input.
            let limit = match data.e.dtype() {
                DType::F16 => 65504.0 / 4.0,
                _ => f32::MAX / 4.0,
            };
            data.e = edit(&data.e, |e| {
                for &i in &valid {
                    let cy = &c[ys[i] as usize * d..(ys[i] as usize + 1) * d];
                    let norm2: f32 = cy.iter().map(|x| x * x).sum();
                    let row = &mut e[i * d..(i + 1) * d];
                    let pushed: Vec<f32> = row
                        .iter()
                        .zip(cy)
                        .map(|(ek, ck)| ek + 30.0 / norm2 * ck)
                        .collect();
                    if norm2 > 0.0 && pushed.iter().all(|x| x.abs() <= limit) {
                        row.copy_from_slice(&pushed);
                    }
                }
            });
        }
        SpecialKind::CommonOffset => {
            let b = data.bias.as_ref().expect("bias");
            data.bias = Some(edit(b, |b| b.iter_mut().for_each(|x| *x += 1e4)));
        }
    }
    // Valid input so far: the oracle says whether the call must fail (masked target, label
    // smoothing over a masked class, a mean over no row) and how.
    let dl = match &data.d_loss {
        DLossData::Scalar(g) => OracleDLoss::Scalar(*g as f64),
        DLossData::PerRow(g) => OracleDLoss::PerRow(g.iter().map(|&x| x as f64).collect()),
    };
    match naive(
        &data.e,
        &data.c,
        data.bias.as_ref(),
        &data.targets,
        &case.opts,
        &dl,
        None,
        Precision::F64,
    ) {
        Ok(_) => Expect::Valid,
        Err(e) => Expect::SameVariant(e),
    }
}

/// Cases skipped by [`NOT_YET_FIXED`] (or not judged: f16 gradients past f16's range) in
/// this process.
static GATED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Run one spec on one backend: `Err` describes the failure.
fn check<B: Backend>(backend: &B, name: &str, s: &Spec) -> Result<(), String> {
    let base = name.split('_').next().unwrap_or(name);
    if NOT_YET_FIXED
        .iter()
        .any(|(b, gap)| (*b == "*" || *b == base) && gap.covers(s))
    {
        GATED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return Ok(());
    }
    let case = case_of(s);
    let mut data = case.materialize(s.seed);
    let expect = apply_special(s, &case, &mut data);
    let what = format!(
        "{name}: {case} special {:?} (seed {:#x})",
        s.special, s.seed
    );
    let cfg = SuiteConfig::new("fuzz");
    let got_error = |r: Result<_, CceError>| r.err();
    match expect {
        Expect::Valid if f16_overflow(&case, &data) => {
            // Gradients past f16's largest value cannot be returned in f16 (f32 gradients
            // can): not an accuracy question, so not judged.
            GATED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(())
        }
        Expect::Valid => {
            let report = run_with_data(backend, &case, &data, s.seed, &cfg, true);
            if report.passed() || report.skipped {
                Ok(())
            } else {
                Err(format!("{what}\n{report}"))
            }
        }
        Expect::SameVariant(want) => match got_error(call(backend, &case, &data)) {
            Some(e) if std::mem::discriminant(&e) == std::mem::discriminant(&want) => Ok(()),
            Some(CceError::Unsupported { .. }) => Ok(()),
            other => Err(format!("{what}: expected {want:?}, got {other:?}")),
        },
        Expect::NonFiniteInput => match got_error(call(backend, &case, &data)) {
            Some(CceError::NonFinite { .. } | CceError::Unsupported { .. }) => Ok(()),
            other => Err(format!("{what}: expected NonFinite, got {other:?}")),
        },
        Expect::NonFiniteUpstream(w, r) => match got_error(call(backend, &case, &data)) {
            Some(CceError::NonFinite { what: ww, row, .. }) if ww == w && row == r => Ok(()),
            Some(CceError::Unsupported { .. }) => Ok(()),
            other => Err(format!(
                "{what}: expected NonFinite {{ what: {w:?}, row: {r} }}, got {other:?}"
            )),
        },
    }
}

/// Whether a valid case returns f16 gradients whose f64 truth passes f16's largest value.
fn f16_overflow(case: &Case, data: &CaseData) -> bool {
    if case.dtype != DType::F16 || case.opts.grad_dtype == GradDType::F32 {
        return false;
    }
    let (dl, h) = cce_conformance::run::oracle_upstream(data);
    let Ok(o) = naive(
        &data.e,
        &data.c,
        data.bias.as_ref(),
        &data.targets,
        &case.opts,
        &dl,
        h.as_deref(),
        Precision::F64,
    ) else {
        return false;
    };
    let max = half::f16::MAX.to_f64();
    o.d_e
        .iter()
        .chain(&o.d_c)
        .chain(o.d_bias.iter().flatten())
        .any(|x| x.abs() >= max)
}

/// Cases per backend: `CCE_FUZZ_CASES` or [`DEFAULT_CASES`].
fn cases() -> u32 {
    std::env::var("CCE_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_CASES)
}

/// Run the property on `backend`; failures are kept in the committed regression file.
fn fuzz<B: Backend>(name: &str, backend: &B) {
    let mut config = Config::with_cases(cases());
    config.failure_persistence = Some(Box::new(FileFailurePersistence::Direct(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fuzz.proptest-regressions"
    ))));
    config.max_shrink_iters = 256;
    let mut runner = TestRunner::new(config);
    let ran = std::sync::atomic::AtomicUsize::new(0);
    let result = runner.run(&spec(), |s| {
        ran.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        check(backend, name, &s).map_err(TestCaseError::fail)
    });
    if let Err(e) = result {
        panic!("fuzz on {name}: {e}");
    }
    eprintln!(
        "fuzz on {name}: {} cases passed ({} skipped in this process: NOT_YET_FIXED, or f16 gradients past f16's range)",
        ran.into_inner(),
        GATED.load(std::sync::atomic::Ordering::Relaxed)
    );
}

#[test]
fn fuzz_cpu() {
    fuzz("cpu", &CpuBackend::new());
}

#[test]
fn fuzz_cpu_tile_ownership() {
    let limits = DeviceLimits {
        name: "cpu (tile-ownership, 16 x 128 tiles)".into(),
        tile: TileShape {
            rows: 16,
            classes: 128,
            depth: 32,
        },
        strategies: vec![StrategyKind::TileOwnership],
        ..DeviceLimits::cpu()
    };
    fuzz("cpu_tile_ownership", &CpuBackend::with_limits(limits));
}

#[cfg(feature = "wgpu")]
#[test]
fn fuzz_wgpu() {
    let cfg = SuiteConfig::new("wgpu");
    let made = cut_cross_entropy::cce_wgpu::WgpuBackend::new();
    if let Some(b) = cce_conformance::harness::acquire(&cfg, made) {
        fuzz("wgpu", &b);
    }
}

#[cfg(feature = "cuda")]
#[test]
fn fuzz_cuda() {
    let cfg = SuiteConfig::new("cuda");
    let made = cut_cross_entropy::cce_cuda::CudaBackend::new(0);
    if let Some(b) = cce_conformance::harness::acquire(&cfg, made) {
        fuzz("cuda", &b);
    }
}
