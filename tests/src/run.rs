//! Running a case on a backend (upload, call, download) and judging it against the oracle.

use crate::case::{Api, Case, CaseData, DLossData, Ignored};
use crate::config::SuiteConfig;
use crate::judge::{self, FilterBound, Judged, TermScale};
use crate::report::CaseReport;
use cce_core::options::{GradDType, Reduction};
use cce_core::problem::{PreparedTargets, Problem};
use cce_core::tolerance::{max_row_norm, row_allowance, row_errors};
use cce_core::{
    Backend, CallStats, CceError, DLoss, DType, FilterRule, HostTensor, Inputs, TensorMeta,
    Upstream,
};
use cce_reference::{naive, Oracle, OracleDLoss, Precision};
use std::time::Instant;

/// The downloaded outputs of one call.
#[derive(Clone, Debug)]
pub struct Outputs {
    /// Loss.
    pub loss: HostTensor,
    /// lse.
    pub lse: HostTensor,
    /// Entropy, if returned.
    pub entropy: Option<HostTensor>,
    /// Argmax, if returned.
    pub argmax: Option<HostTensor>,
    /// `d_e`, if a backward ran and returned it.
    pub d_e: Option<HostTensor>,
    /// `d_c`, likewise.
    pub d_c: Option<HostTensor>,
    /// `d_bias`, likewise.
    pub d_bias: Option<HostTensor>,
    /// Forward statistics.
    pub fwd_stats: CallStats,
    /// Backward statistics (None for forward-only cases).
    pub bwd_stats: Option<CallStats>,
}

/// Upload the case's inputs, call the backend through the case's API, download the outputs.
pub fn call<B: Backend>(backend: &B, case: &Case, data: &CaseData) -> Result<Outputs, CceError> {
    let e = backend.upload(&data.e)?;
    let c = backend.upload(&data.c)?;
    let bias = data.bias.as_ref().map(|b| backend.upload(b)).transpose()?;
    let targets = backend.upload(&data.targets)?;
    let per_row = match &data.d_loss {
        DLossData::PerRow(g) => {
            Some(backend.upload(&HostTensor::from_f32(vec![g.len()], g, DType::F32)?)?)
        }
        DLossData::Scalar(_) => None,
    };
    let d_lse = data
        .d_lse
        .as_ref()
        .map(|h| backend.upload(&HostTensor::from_f32(vec![h.len()], h, DType::F32)?))
        .transpose()?;
    let inputs = Inputs {
        e: &e,
        c: &c,
        bias: bias.as_ref(),
        targets: &targets,
    };
    let upstream = Upstream {
        d_loss: match (&data.d_loss, &per_row) {
            (DLossData::Scalar(s), _) => DLoss::Scalar(*s),
            (DLossData::PerRow(_), Some(b)) => DLoss::PerRow(b),
            (DLossData::PerRow(_), None) => unreachable!("uploaded above"),
        },
        d_lse: d_lse.as_ref(),
    };
    let (fwd, bwd) = match case.api {
        Api::Fused => {
            let (f, b) = backend.forward_backward(&inputs, &case.opts, &upstream)?;
            (f, Some(b))
        }
        Api::Separate => {
            let f = backend.forward(&inputs, &case.opts)?;
            let b = backend.backward(&inputs, &case.opts, f.saved(), &upstream)?;
            (f, Some(b))
        }
        Api::ForwardOnly => (backend.forward(&inputs, &case.opts)?, None),
    };
    let dl = |x: &Option<B::Buffer>| x.as_ref().map(|b| backend.download(b)).transpose();
    Ok(Outputs {
        loss: backend.download(&fwd.loss)?,
        lse: backend.download(&fwd.lse)?,
        entropy: dl(&fwd.entropy)?,
        argmax: dl(&fwd.argmax)?,
        d_e: bwd.as_ref().map(|b| dl(&b.d_e)).transpose()?.flatten(),
        d_c: bwd.as_ref().map(|b| dl(&b.d_c)).transpose()?.flatten(),
        d_bias: bwd.as_ref().map(|b| dl(&b.d_bias)).transpose()?.flatten(),
        fwd_stats: fwd.stats,
        bwd_stats: bwd.map(|b| b.stats),
    })
}

/// The oracle's view of the upstream gradients.
pub fn oracle_upstream(data: &CaseData) -> (OracleDLoss, Option<Vec<f64>>) {
    let dl = match &data.d_loss {
        DLossData::Scalar(s) => OracleDLoss::Scalar(*s as f64),
        DLossData::PerRow(g) => OracleDLoss::PerRow(g.iter().map(|&x| x as f64).collect()),
    };
    let h = data
        .d_lse
        .as_ref()
        .map(|h| h.iter().map(|&x| x as f64).collect());
    (dl, h)
}

/// Run the f64 ground truth (and the same-precision reference when `with_ref`).
///
/// # Panics
/// When the oracle rejects a case the suite built (a bug of the suite).
pub fn oracles(case: &Case, data: &CaseData, with_ref: bool) -> (Oracle, Option<Oracle>) {
    let (dl, h) = oracle_upstream(data);
    let run = |p| {
        naive(
            &data.e,
            &data.c,
            data.bias.as_ref(),
            &data.targets,
            &case.opts,
            &dl,
            h.as_deref(),
            p,
        )
        .unwrap_or_else(|e| panic!("oracle rejected the suite's own case {case}: {e}"))
    };
    let gt = run(Precision::F64);
    let reference = with_ref.then(|| run(Precision::SameDtype));
    (gt, reference)
}

/// Run a case end to end: materialize from `seed`, call, judge against gt and ref.
pub fn run_case<B: Backend>(backend: &B, case: &Case, seed: u64, cfg: &SuiteConfig) -> CaseReport {
    let t0 = Instant::now();
    let data = case.materialize(seed);
    let mut report = run_with_data(backend, case, &data, seed, cfg, true);
    report.times_ms[0] = t0.elapsed().as_secs_f64() * 1e3
        - report.times_ms[1]
        - report.times_ms[2]
        - report.times_ms[3];
    report
}

/// Call the backend on `data` and judge the outputs (see [`judge_outputs`]).
pub fn run_with_data<B: Backend>(
    backend: &B,
    case: &Case,
    data: &CaseData,
    seed: u64,
    cfg: &SuiteConfig,
    with_ref: bool,
) -> CaseReport {
    let mut report = CaseReport::new(case.to_string(), seed);
    let t0 = Instant::now();
    let called = call(backend, case, data);
    report.times_ms[1] = t0.elapsed().as_secs_f64() * 1e3;
    let outputs = match called {
        Err(CceError::Unsupported { backend: b, what }) if cfg.allow_unsupported => {
            report.skipped = true;
            report
                .notes
                .push(format!("skipped: {b} does not support {what}"));
            return report;
        }
        called if mean_over_no_valid_row(case, data).is_some() => {
            judge_all_ignored_error(case, data, called, &mut report);
            return report;
        }
        Ok(o) => o,
        Err(err) => {
            report.problem(format!(
                "backend returned an error for a valid case: {err} ({err:?})"
            ));
            return report;
        }
    };
    let t1 = Instant::now();
    let (gt, reference) = oracles(case, data, with_ref);
    let t2 = Instant::now();
    judge_outputs(case, data, &outputs, &gt, reference.as_ref(), &mut report);
    report.times_ms[2] = (t2 - t1).as_secs_f64() * 1e3;
    report.times_ms[3] = t2.elapsed().as_secs_f64() * 1e3;
    report
}

/// `Some(N)` when the case asks for `Reduction::Mean` and no row has a target (every target
/// `ignore_index`, or a shift at least `seq_len`): the call must then fail with
/// `CceError::AllTargetsIgnored`.
pub fn mean_over_no_valid_row(case: &Case, data: &CaseData) -> Option<usize> {
    if case.opts.reduction != Reduction::Mean {
        return None;
    }
    // Count the valid rows under sum (which accepts a batch with none).
    let mut opts = case.opts.clone();
    opts.reduction = Reduction::Sum;
    let problem = Problem::new(
        &data.e,
        &data.c,
        data.bias.as_ref().map(|b| b as &dyn TensorMeta),
        &data.targets,
        &opts,
    )
    .ok()?;
    let raw = data.targets.to_i64_vec()?;
    let prepared = PreparedTargets::new(&raw, &problem, &opts).ok()?;
    (prepared.n_valid == 0).then_some(problem.n)
}

/// A mean over no valid row: the call must have failed with exactly
/// `AllTargetsIgnored { n, ignore_index, shift }` (a loss of 0 or NaN is a silent answer).
fn judge_all_ignored_error(
    case: &Case,
    data: &CaseData,
    called: Result<Outputs, CceError>,
    report: &mut CaseReport,
) {
    let n = mean_over_no_valid_row(case, data).unwrap_or(case.n);
    let (ii, shift) = (case.opts.ignore_index, case.opts.shift);
    let want =
        format!("CceError::AllTargetsIgnored {{ n: {n}, ignore_index: {ii}, shift: {shift} }}");
    match called {
        Err(CceError::AllTargetsIgnored {
            n: got_n,
            ignore_index,
            shift: got_shift,
        }) if got_n == n && ignore_index == ii && got_shift == shift => {
            report
                .notes
                .push("every row is ignored under mean: AllTargetsIgnored, as required".into());
        }
        Err(err) => report.problem(format!(
            "every row is ignored under reduction mean: expected {want}, got {err:?}"
        )),
        Ok(out) => {
            let loss = out.loss.to_f64_vec();
            report.problem(format!(
                "every row is ignored under reduction mean: the call must fail with {want}, \
                 it returned loss {:?}",
                &loss[..loss.len().min(5)]
            ));
        }
    }
}

fn expect_shape(report: &mut CaseReport, name: &str, t: &HostTensor, shapes: &[&[usize]]) {
    if !shapes.contains(&t.shape()) {
        report.problem(format!(
            "{name}: shape {:?}, expected one of {shapes:?}",
            t.shape()
        ));
    }
}

fn expect_dtype(report: &mut CaseReport, name: &str, t: &HostTensor, dtype: DType) {
    if t.dtype() != dtype {
        report.problem(format!("{name}: dtype {}, expected {dtype}", t.dtype()));
    }
}

/// Per-row upstream weights: `g_i` (0 at ignored rows), `h_i`, and the prepared classes
/// (`-1` at ignored rows).
pub fn row_weights(case: &Case, data: &CaseData) -> (Vec<f64>, Vec<f64>, Vec<i32>) {
    let problem = Problem::new(
        &data.e,
        &data.c,
        data.bias.as_ref().map(|b| b as &dyn TensorMeta),
        &data.targets,
        &case.opts,
    )
    .expect("valid case");
    let raw = data.targets.to_i64_vec().expect("integer targets");
    let prepared = PreparedTargets::new(&raw, &problem, &case.opts).expect("valid targets");
    let n_valid = prepared.n_valid;
    let valid: Vec<bool> = prepared.classes.iter().map(|&y| y >= 0).collect();
    let g = (0..problem.n)
        .map(|i| {
            if !valid[i] {
                return 0.0;
            }
            match &data.d_loss {
                DLossData::PerRow(v) => v[i] as f64,
                DLossData::Scalar(s) => match case.opts.reduction {
                    Reduction::Mean => *s as f64 / n_valid as f64,
                    _ => *s as f64,
                },
            }
        })
        .collect();
    let h = data.d_lse.as_ref().map_or(vec![0.0; problem.n], |h| {
        h.iter().map(|&x| x as f64).collect()
    });
    (g, h, prepared.classes)
}

/// Per-row bound of `|G_ij| / p_ij` (the weight the filter bound scales a row's dropped mass
/// by): `|g_i| · (|1 + 2λ lse_i| + 1) + |h_i|`.
pub fn bound_weights(g: &[f64], h: &[f64], lse: &[f64], lambda: f64) -> Vec<f64> {
    (0..g.len())
        .map(|i| g[i].abs() * ((1.0 + 2.0 * lambda * lse[i]).abs() + 1.0) + h[i].abs())
        .collect()
}

/// Judge downloaded outputs against the ground truth `gt` and reference `reference` with the
/// rule of [`crate::judge`], plus the structural checks (presence, shapes, dtypes, stats,
/// exact zeros at ignored rows, the filter's dropped-mass bound).
pub fn judge_outputs(
    case: &Case,
    data: &CaseData,
    out: &Outputs,
    gt: &Oracle,
    reference: Option<&Oracle>,
    report: &mut CaseReport,
) {
    let opts = &case.opts;
    let (n, d, v) = (case.n, case.d, case.v);
    let dtype = case.dtype;
    let e_shape = data.e.shape().to_vec();
    let lead = &e_shape[..e_shape.len() - 1];
    let zmag = gt.lse.iter().fold(1.0f64, |a, &x| a.max(x.abs()));
    let (g, h, classes) = row_weights(case, data);
    let valid: Vec<bool> = classes.iter().map(|&y| y >= 0).collect();
    let lambda = opts.z_loss as f64;
    let w = bound_weights(&g, &h, &gt.lse, lambda);
    let w_max = w.iter().fold(0.0f64, |a, &x| a.max(x));
    let ev = data.e.to_f64_vec();
    let cv = data.c.to_f64_vec();
    let n_valid = gt.n_valid;

    // ---- forward outputs
    expect_dtype(report, "loss", &out.loss, DType::F32);
    let loss = out.loss.to_f64_vec();
    match opts.reduction {
        Reduction::None => expect_shape(report, "loss", &out.loss, &[&[n], lead]),
        _ => expect_shape(report, "loss", &out.loss, &[&[]]),
    }
    if loss.len() == gt.loss.len() {
        let unit = match opts.reduction {
            Reduction::Sum => zmag * (n_valid.max(1) as f64).sqrt(),
            _ => zmag,
        };
        report.outputs.push(
            Judged {
                name: "loss",
                ours: &loss,
                gt: &gt.loss,
                reference: reference.map(|r| r.loss.as_slice()),
                cols: 1,
                tau: judge::tau(dtype, v, 1.0),
                unit,
                unit_elem: None,
                extra: None,
            }
            .verdict(),
        );
        if opts.reduction == Reduction::None {
            let nonzero: Vec<usize> = (0..n).filter(|&i| !valid[i] && loss[i] != 0.0).collect();
            if !nonzero.is_empty() {
                report.problem(format!(
                    "loss must be exactly 0 at ignored rows; rows {:?} are not",
                    &nonzero[..nonzero.len().min(5)]
                ));
            }
        }
    }
    if n_valid == 0 && loss.iter().any(|&x| x != 0.0) {
        report.problem(format!(
            "every row is ignored (reduction {:?}): the loss must be exactly 0, got {:?}",
            opts.reduction,
            &loss[..loss.len().min(5)]
        ));
    }
    expect_dtype(report, "lse", &out.lse, DType::F32);
    expect_shape(report, "lse", &out.lse, &[&[n], lead]);
    let lse = out.lse.to_f64_vec();
    if lse.len() == n {
        report.outputs.push(
            Judged {
                name: "lse",
                ours: &lse,
                gt: &gt.lse,
                reference: reference.map(|r| r.lse.as_slice()),
                cols: 1,
                tau: judge::tau(dtype, v, 1.0),
                unit: zmag,
                unit_elem: None,
                extra: None,
            }
            .verdict(),
        );
    }
    match (&out.entropy, opts.side_outputs.entropy) {
        (Some(t), true) => {
            expect_dtype(report, "entropy", t, DType::F32);
            expect_shape(report, "entropy", t, &[&[n], lead]);
            let ent = t.to_f64_vec();
            if ent.len() == n {
                report.outputs.push(
                    Judged {
                        name: "entropy",
                        ours: &ent,
                        gt: &gt.entropy,
                        reference: reference.map(|r| r.entropy.as_slice()),
                        cols: 1,
                        tau: judge::tau(dtype, v, 1.0),
                        unit: zmag,
                        unit_elem: None,
                        extra: None,
                    }
                    .verdict(),
                );
            }
        }
        (None, true) => report.problem("entropy was asked for but not returned"),
        (Some(_), false) => report.notes.push("entropy returned unasked".into()),
        (None, false) => {}
    }
    match (&out.argmax, opts.side_outputs.argmax) {
        (Some(t), true) => {
            expect_dtype(report, "argmax", t, DType::I32);
            expect_shape(report, "argmax", t, &[&[n], lead]);
            let am = t.to_i64_vec().unwrap_or_default();
            if am.len() == n {
                judge_argmax(case, data, &am, gt, zmag, report);
            }
        }
        (None, true) => report.problem("argmax was asked for but not returned"),
        (Some(_), false) => report.notes.push("argmax returned unasked".into()),
        (None, false) => {}
    }
    if out.fwd_stats.n_valid != n_valid {
        report.problem(format!(
            "forward stats.n_valid = {}, expected {n_valid}",
            out.fwd_stats.n_valid
        ));
    }

    // ---- backward outputs
    let Some(bstats) = &out.bwd_stats else {
        return;
    };
    if bstats.n_valid != n_valid {
        report.problem(format!(
            "backward stats.n_valid = {}, expected {n_valid}",
            bstats.n_valid
        ));
    }
    let rule = FilterRule::resolve(opts, dtype);
    let m = bstats.dropped_mass_max;
    if !rule.enabled {
        if m != 0.0 || bstats.entries_skipped != 0 || bstats.tiles_skipped != 0 {
            report.problem(format!(
                "filter is off for this case but the backward skipped work: dropped_mass_max {m:e}, \
                 entries_skipped {}, tiles_skipped {}",
                bstats.entries_skipped, bstats.tiles_skipped
            ));
        }
    } else {
        let bound = rule.max_dropped_mass as f64;
        if !(m.is_finite() && m >= 0.0 && m <= bound * (1.0 + 1e-6) + 1e-12) {
            report.problem(format!(
                "stats.dropped_mass_max = {m:e} exceeds max_dropped_mass = {bound:e}"
            ));
        }
        if !(bstats.dropped_mass_mean >= 0.0 && bstats.dropped_mass_mean <= m * (1.0 + 1e-9)) {
            report.problem(format!(
                "stats.dropped_mass_mean = {:e} is not in [0, dropped_mass_max = {m:e}]",
                bstats.dropped_mass_mean
            ));
        }
        if bstats.filter_eps > rule.eps * (1.0 + 1e-6) {
            report.problem(format!(
                "stats.filter_eps = {:e} is larger than the resolved filter_eps {:e}",
                bstats.filter_eps, rule.eps
            ));
        }
        report.notes.push(format!(
            "filter: dropped max {:.2e} mean {:.2e}, tiles skipped {:.0}%, entries kept {} skipped {}",
            m,
            bstats.dropped_mass_mean,
            100.0 * bstats.skipped_fraction(),
            bstats.entries_kept,
            bstats.entries_skipped
        ));
    }
    // The reported dropped mass covers the rows with a target; a row without one but with an
    // lse upstream (`G = h·p`) is filtered too, under the rule's per-row bound
    // `max_dropped_mass`, which then bounds its skipped mass.
    let untargeted_upstream = (0..n).any(|i| !valid[i] && h[i] != 0.0);
    let m_used = match (rule.enabled, untargeted_upstream) {
        (false, _) => 0.0,
        (true, false) => m.max(0.0),
        (true, true) => m.max(rule.max_dropped_mass as f64),
    };
    let fb = FilterBound::new(
        &w,
        &ev,
        &cv,
        d,
        m_used,
        rule.eps as f64,
        rule.filter_e_grad,
        rule.filter_c_grad,
        data.bias.is_some(),
    );
    let grad_dtype = match opts.grad_dtype {
        GradDType::Input => dtype,
        GradDType::F32 => DType::F32,
    };
    // The gradients' logit magnitude: under a softcap, the raw logits' dot-product error over
    // the softcap (cce_core::tolerance::softcapped_zmag).
    let zmag_grad = cce_core::tolerance::softcapped_zmag(
        zmag,
        opts.softcap.map(f64::from),
        max_row_norm(&ev, d),
        max_row_norm(&cv, d),
    );
    let rms_e = judge::rms(&ev);
    let rms_c = judge::rms(&cv);
    // Per-element term magnitudes (module docs of `judge`), for every input dtype; 16-bit
    // inputs add the RMS of the ground truth.
    let scale = Some({
        let bv = data.bias.as_ref().map(|b| b.to_f64_vec());
        TermScale::new(
            &ev,
            &cv,
            bv.as_deref(),
            d,
            opts.softcap.map(f64::from),
            &gt.lse,
            &classes,
            &g,
            &w,
            opts.label_smoothing as f64,
        )
    });
    let grads = [
        GradSpec {
            name: "d_e",
            got: &out.d_e,
            wanted: opts.compute_d_e,
            shape: e_shape.clone(),
            len: v,
            gt: &gt.d_e,
            scale: scale.as_ref().map(|s| s.d_e.as_slice()),
            floor: w_max * rms_c * 1e-2,
            bound: &fb.d_e,
        },
        GradSpec {
            name: "d_c",
            got: &out.d_c,
            wanted: opts.compute_d_c,
            shape: vec![v, d],
            len: n,
            gt: &gt.d_c,
            scale: scale.as_ref().map(|s| s.d_c.as_slice()),
            floor: w_max * rms_e * 1e-2,
            bound: &fb.d_c,
        },
        GradSpec {
            name: "d_bias",
            got: &out.d_bias,
            wanted: opts.compute_d_c && data.bias.is_some(),
            shape: vec![v],
            len: n,
            gt: gt.d_bias.as_deref().unwrap_or(&[]),
            scale: scale.as_ref().map(|s| s.d_bias.as_slice()),
            floor: w_max * 1e-2,
            bound: &fb.d_bias,
        },
    ];
    for GradSpec {
        name,
        got,
        wanted,
        shape,
        len,
        gt: gtv,
        scale: term_scale,
        floor,
        bound,
    } in grads
    {
        match (got, wanted) {
            (None, true) => report.problem(format!("{name} was asked for but not returned")),
            (Some(_), false) => report.problem(format!(
                "{name} returned although not asked for (compute flags / no bias)"
            )),
            (None, false) => {}
            (Some(t), true) => {
                expect_dtype(report, name, t, grad_dtype);
                expect_shape(report, name, t, &[&shape]);
                let ours = t.to_f64_vec();
                if ours.len() != gtv.len() {
                    continue;
                }
                let refv = reference.map(|r| match name {
                    "d_e" => r.d_e.as_slice(),
                    "d_c" => r.d_c.as_slice(),
                    _ => r.d_bias.as_deref().unwrap_or(&[]),
                });
                let extra = |k: usize| bound[k];
                report.outputs.push(
                    Judged {
                        name,
                        ours: &ours,
                        gt: gtv,
                        reference: refv,
                        cols: if name == "d_bias" { 1 } else { d },
                        tau: judge::tau(dtype, len, judge::kappa(zmag_grad, d)),
                        unit: if dtype == DType::F32 {
                            0.0
                        } else {
                            judge::rms(gtv)
                        } + floor,
                        unit_elem: term_scale,
                        extra: (!bound.is_empty()).then_some(&extra as &dyn Fn(usize) -> f64),
                    }
                    .verdict(),
                );
                // Per row (d_e rows, d_c class rows): each row against the size of its own
                // terms (cce_core::tolerance::RowError), which the per-element rule above,
                // whose term scale is p + onehot, does not resolve on confident rows.
                let rows = match name {
                    "d_e" => Some(("d_e rows", &gt.g_terms_rows, max_row_norm(&cv, d))),
                    "d_c" => Some(("d_c rows", &gt.g_terms_cols, max_row_norm(&ev, d))),
                    _ => None,
                };
                if let Some((row_name, sums, m_other)) = rows {
                    let tau = judge::tau(dtype, len, judge::kappa(zmag_grad, d));
                    let g_max = gt.g_terms_rows.iter().fold(0.0f64, |a, &x| a.max(x));
                    let errors = row_errors(&ours, gtv, d, |i, truth_norm| {
                        let row = i * d..(i + 1) * d;
                        let filter = if bound.is_empty() {
                            0.0
                        } else {
                            judge::norm(&bound[row.clone()])
                        };
                        // A GPU may flush subnormal entries of G (FTZ) or hold G in f16 with
                        // one power-of-two scale (16-bit inputs).
                        let range =
                            cce_core::tolerance::g_range_allowance(dtype, len, m_other, g_max);
                        // Under a softcap, as bad as the same-precision reference (f32 logits'
                        // error amplified by 2/s, cce_core docs); not elsewhere, where the naive
                        // reference's own cancellation on confident rows would hide that defect.
                        let reference = refv
                            .filter(|r| r.len() == gtv.len() && opts.softcap.is_some())
                            .map(|r| judge::row_distance(&r[row.clone()], &gtv[row]))
                            .filter(|x| x.is_finite())
                            .unwrap_or(0.0);
                        row_allowance(
                            tau,
                            truth_norm,
                            sums[i] * m_other,
                            filter + range + reference,
                            d,
                            grad_dtype,
                        )
                    });
                    report
                        .outputs
                        .push(judge::row_verdict(row_name, &errors, &ours, gtv, tau));
                }
                if (case.ignored == Ignored::All || n_valid == 0)
                    && data.d_lse.is_none()
                    && ours.iter().any(|&x| x != 0.0)
                {
                    report.problem(format!("every row is ignored: {name} must be exactly 0"));
                }
            }
        }
    }
}

/// What is judged of one gradient output.
struct GradSpec<'a> {
    name: &'static str,
    got: &'a Option<HostTensor>,
    wanted: bool,
    shape: Vec<usize>,
    /// Reduction length.
    len: usize,
    gt: &'a [f64],
    /// Per-element unit (f32 cases), else the RMS of `gt` is used.
    scale: Option<&'a [f64]>,
    /// Floor of the unit.
    floor: f64,
    /// Filter allowance per element (empty: none).
    bound: &'a [f64],
}

/// Argmax: equal to the oracle's, or (near-ties) pointing at a logit within f32 error of the
/// maximum (checked with f64 logits of the two classes).
fn judge_argmax(
    case: &Case,
    data: &CaseData,
    am: &[i64],
    gt: &Oracle,
    zmag: f64,
    report: &mut CaseReport,
) {
    let (d, v) = (case.d, case.v);
    let ev = data.e.to_f64_vec();
    let cv = data.c.to_f64_vec();
    let bv = data.bias.as_ref().map(|b| b.to_f64_vec());
    let logit = |i: usize, j: usize| {
        let x: f64 = (0..d).map(|k| ev[i * d + k] * cv[j * d + k]).sum::<f64>()
            + bv.as_ref().map_or(0.0, |b| b[j]);
        match case.opts.softcap {
            Some(s) => s as f64 * (x / s as f64).tanh(),
            None => x,
        }
    };
    let allowed = judge::tau(DType::F32, d, judge::kappa(zmag, d)) * zmag;
    let mut bad = Vec::new();
    for (i, (&ours, &want)) in am.iter().zip(&gt.argmax).enumerate() {
        if ours == want as i64 {
            continue;
        }
        if !(0..v as i64).contains(&ours) {
            bad.push(format!("row {i}: argmax {ours} out of [0, {v})"));
            continue;
        }
        let gap = logit(i, want as usize) - logit(i, ours as usize);
        if gap > allowed {
            bad.push(format!(
                "row {i}: argmax {ours} (logit lower by {gap:.3e} > allowed {allowed:.1e}), gt {want}"
            ));
        }
    }
    if !bad.is_empty() {
        report.problem(format!(
            "argmax wrong on {} rows: {}",
            bad.len(),
            bad[..bad.len().min(5)].join("; ")
        ));
    }
}
