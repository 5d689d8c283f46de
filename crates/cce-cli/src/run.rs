//! `cce run`: one call on a file, a generated case or the shipped real fixture.

use std::collections::HashMap;
use std::time::Instant;

use cce_data::F32Tensor;
use cut_cross_entropy::tolerance::{
    g_range_allowance, max_row_norm, row_allowance, row_errors, worst_rows,
};
use cut_cross_entropy::{
    naive, CallStats, DType, FilterEps, HostResult, HostTensor, Options, OracleDLoss, Precision,
    PreparedTargets, Problem, Reduction, TensorMeta,
};

use crate::cli::{FloatDType, RunArgs};
use crate::error::{CliError, CliResult};
use crate::input::{self, Loaded, Tensors};
use crate::judge::{self, FilterBound, Verdict};
use crate::progress::with_spinner;
use crate::report::{
    available_memory_bytes, err_stats, fmt_bytes, fmt_ms, peak_rss_bytes, summary, ErrStats,
    RssDuring, RssProbe, Table,
};

/// Runs `cce run` and prints its report on stdout.
///
/// Errors: bad options, unreadable or inconsistent input, an unavailable backend, a failed
/// call, an oracle too large for the memory, an unwritable `--save-grads` file, a `--check`
/// that finds an output outside its tolerance ([`crate::judge`]).
pub fn main(args: &RunArgs) -> CliResult<()> {
    let opts = args.opts.options();
    opts.validate()?;
    let backward = !args.opts.no_backward;
    // An unwritable --save-grads path fails before any work, not after it.
    if let Some(path) = &args.save_grads {
        check_output_path("--save-grads", path)?;
        input::check_not_an_input("--save-grads", path, &args.input)?;
        // (clap already refuses --save-grads with --no-backward.)
        if args.opts.no_d_e && args.opts.no_d_c {
            return Err(CliError::msg(
                "--save-grads: no gradient would be computed (drop --no-d-e or --no-d-c)",
            ));
        }
    }
    // The backend first: a missing device should not wait for a large load.
    let crate::backend::Opened {
        backend,
        description,
    } = match args.vocab_parallel {
        Some(k) => crate::backend::vocab_parallel(&args.backend, k.into())?,
        None => crate::backend::open(&args.backend)?,
    };
    let loaded = input::load(&args.input)?;
    let ds = &loaded.ds;
    // The library pairs rows with targets within the sequences of a [..., T, D] e; --n that
    // cuts a sequence leaves no such shape, so a shift there would pair across sequences.
    if let (Some(t), true, None) = (ds.seq_len, opts.shift > 0, opts.seq_len) {
        if t > 0 && !ds.n.is_multiple_of(t) {
            return Err(CliError::msg(format!(
                "--shift {}: the file's e holds sequences of {t} rows and --n {} cuts one; pass a multiple of {t}, or --seq-len",
                opts.shift, ds.n
            )));
        }
    }
    let dtype = args
        .dtype
        .map(FloatDType::dtype)
        .or(loaded.file_dtype)
        .unwrap_or(DType::F32);
    let t = input::tensors(ds, dtype)?;
    let per_row = match (opts.reduction, backward) {
        (Reduction::None, true) => Some(HostTensor::from_f32(
            vec![ds.n],
            &vec![1.0; ds.n],
            DType::F32,
        )?),
        _ => None,
    };

    let what = if backward {
        "forward + backward"
    } else {
        "forward"
    };
    let rss = RssProbe::start();
    let t0 = Instant::now();
    let res = with_spinner(format!("{what} on {}", backend.name()), || {
        backend.run(
            &t.e,
            &t.c,
            t.bias.as_ref(),
            &t.targets,
            &opts,
            backward,
            1.0,
            per_row.as_ref(),
        )
    })?;
    let call_ms = t0.elapsed().as_secs_f64() * 1e3;
    let rss = rss.and_then(|p| p.finish());

    print_header(&loaded, dtype, args, &description, &opts);
    print_loss(&loaded, &res, &opts, dtype)?;
    print_side_outputs(&loaded, &t, &res, &opts)?;
    print_times_memory(&loaded, &t, &res, call_ms, rss.as_ref(), backend.name());
    print_stats("forward call", &res.forward_stats);
    if let Some(s) = &res.backward_stats {
        print_stats("backward call", s);
    }
    let verdicts = if args.check {
        check(&loaded, &t, &res, &opts, dtype, backward)?
    } else {
        Vec::new()
    };
    // The gradients are written even when the check fails: they are what to look at then.
    if let Some(path) = &args.save_grads {
        save_grads(path, &res, &loaded, backend.name(), dtype)?;
    }
    let failed: Vec<String> = verdicts
        .iter()
        .filter(|v| !v.pass())
        .map(|v| {
            if v.error.is_finite() {
                format!("{} ({:.2e} > {:.2e})", v.name, v.error, v.allowed)
            } else {
                format!("{} (non-finite values)", v.name)
            }
        })
        .collect();
    if !failed.is_empty() {
        return Err(CliError::msg(format!(
            "--check: {} of {} outputs outside their tolerance against the f64 oracle: {}",
            failed.len(),
            verdicts.len(),
            failed.join(", ")
        )));
    }
    Ok(())
}

/// `Options` fields that differ from the default, for the report.
fn describe_options(o: &Options) -> String {
    let d = Options::default();
    let mut parts = vec![
        format!("reduction {:?}", o.reduction).to_lowercase(),
        match o.filter_eps {
            FilterEps::Auto => "filter_eps auto".into(),
            FilterEps::Off => "filter_eps off (exact)".into(),
            FilterEps::Value(v) => format!("filter_eps {v:e}"),
        },
        format!("max_dropped_mass {:e}", o.max_dropped_mass),
    ];
    if let Some(s) = o.softcap {
        parts.push(format!("softcap {s}"));
    }
    if o.shift != d.shift {
        parts.push(format!("shift {}", o.shift));
    }
    if let Some(t) = o.seq_len {
        parts.push(format!("seq_len {t}"));
    }
    if o.label_smoothing != 0.0 {
        parts.push(format!("label_smoothing {}", o.label_smoothing));
    }
    if o.z_loss != 0.0 {
        parts.push(format!("z_loss {}", o.z_loss));
    }
    if o.ignore_index != d.ignore_index {
        parts.push(format!("ignore_index {}", o.ignore_index));
    }
    if !o.filter_e_grad {
        parts.push("d_e unfiltered".into());
    }
    if !o.filter_c_grad {
        parts.push("d_c unfiltered".into());
    }
    if o.deterministic {
        parts.push("deterministic".into());
    }
    if o.workspace_budget_bytes != d.workspace_budget_bytes {
        parts.push(format!(
            "workspace budget {}",
            fmt_bytes(o.workspace_budget_bytes)
        ));
    }
    if o.grad_dtype != d.grad_dtype {
        parts.push("f32 gradients".into());
    }
    if !o.check_finite {
        parts.push("no finiteness check".into());
    }
    if !o.compute_d_e {
        parts.push("no d_e".into());
    }
    if !o.compute_d_c {
        parts.push("no d_c".into());
    }
    parts.join(", ")
}

fn print_header(l: &Loaded, dtype: DType, args: &RunArgs, backend: &str, opts: &Options) {
    let ds = &l.ds;
    let why = match (args.dtype, l.file_dtype) {
        (Some(_), _) => "from --dtype",
        (None, Some(_)) => "the file's",
        (None, None) if l.is_fixture => "default: keeps the Q8_0 head exact",
        (None, None) => "default",
    };
    outln!("input      {}", ds.name);
    outln!(
        "problem    N = {}, D = {}, V = {}, bias {}, dtype {dtype} ({why})",
        ds.n,
        ds.d,
        ds.v,
        if ds.bias.is_some() { "yes" } else { "no" }
    );
    if let [b, t, _] = input::e_shape(ds)[..] {
        outln!("sequences  e [{b}, {t}, {}]: {b} sequences of {t} rows (--shift pairs rows within each)", ds.d);
    }
    outln!("backend    {backend}");
    outln!("options    {}", describe_options(opts));
}

/// Rows whose target the reference `nll_ref` covers under these options, or why none.
fn reference_rows(l: &Loaded, opts: &Options) -> Result<Vec<usize>, &'static str> {
    if opts.softcap.is_some()
        || opts.label_smoothing != 0.0
        || opts.z_loss != 0.0
        || opts.shift != 0
    {
        return Err(
            "plain cross-entropy, not comparable with softcap, label smoothing, z-loss or shift",
        );
    }
    Ok((0..l.ds.n)
        .filter(|&i| l.ds.targets[i] != opts.ignore_index)
        .collect())
}

fn print_loss(l: &Loaded, res: &HostResult, opts: &Options, dtype: DType) -> CliResult<()> {
    let loss = res.loss.to_f32_vec();
    let n_valid = res.forward_stats.n_valid;
    let value = match opts.reduction {
        Reduction::Mean => {
            let x = loss.first().copied().unwrap_or(f32::NAN) as f64;
            outln!("loss       {x:.6}  (mean over {n_valid} valid rows)");
            x
        }
        Reduction::Sum => {
            let x = loss.first().copied().unwrap_or(f32::NAN) as f64;
            outln!("loss       {x:.6}  (sum over {n_valid} valid rows)");
            x
        }
        Reduction::None => {
            let sum: f64 = loss.iter().map(|&x| x as f64).sum();
            if n_valid == 0 {
                // A mean over no row is undefined: say so rather than print 0.
                outln!(
                    "loss       [{}] per row: no valid row (mean undefined), sum {sum:.6}",
                    loss.len()
                );
                return Ok(());
            }
            let mean = sum / n_valid as f64;
            outln!(
                "loss       [{}] per row: mean over {n_valid} valid rows {mean:.6}, sum {sum:.6}",
                loss.len()
            );
            mean
        }
    };
    let Some(nll) = &l.ds.nll_ref else {
        return Ok(());
    };
    match reference_rows(l, opts) {
        Err(why) => {
            let mean = nll.iter().map(|&x| x as f64).sum::<f64>() / nll.len().max(1) as f64;
            outln!("reference  {mean:.6}  (mean of the file's nll_ref: {why})");
        }
        Ok(rows) => {
            let sum: f64 = rows.iter().map(|&i| nll[i] as f64).sum();
            let (reference, kind) = match opts.reduction {
                Reduction::Sum => (sum, "sum"),
                _ => (sum / rows.len().max(1) as f64, "mean"),
            };
            let diff = (value - reference).abs();
            let (a, b) = (format!("{value:.4}"), format!("{reference:.4}"));
            let verdict = if a == b {
                format!("matches to 4 decimals: {a}")
            } else if dtype != DType::F32 {
                format!("differs at 4 decimals ({a} vs {b}): {dtype} rounds e and c, the reference uses the exact values")
            } else {
                format!("DIFFERS at 4 decimals ({a} vs {b})")
            };
            outln!(
                "reference  {reference:.6}  ({kind} of the file's nll_ref over {} rows; |loss - reference| = {diff:.1e}, {verdict})",
                rows.len()
            );
            if opts.reduction == Reduction::None {
                let got: Vec<f32> = rows.iter().map(|&i| loss[i]).collect();
                let want: Vec<f64> = rows.iter().map(|&i| nll[i] as f64).collect();
                let e = err_stats(&got, &want);
                outln!(
                    "           per-row max |loss_i - nll_ref_i| = {:.2e}",
                    e.max_abs
                );
            }
        }
    }
    Ok(())
}

/// The targets after `ignore_index` and `shift`: the class of each row, or -1.
fn prepared_targets(l: &Loaded, t: &Tensors, opts: &Options) -> CliResult<PreparedTargets> {
    let problem = Problem::new(
        &t.e,
        &t.c,
        t.bias.as_ref().map(|b| b as &dyn TensorMeta),
        &t.targets,
        opts,
    )?;
    Ok(PreparedTargets::new(&l.ds.targets, &problem, opts)?)
}

fn print_side_outputs(l: &Loaded, t: &Tensors, res: &HostResult, opts: &Options) -> CliResult<()> {
    let lse = res.lse.to_f32_vec();
    if let Some(s) = summary(lse.iter().map(|&x| x as f64)) {
        out!(
            "lse        min {:.4}, mean {:.4}, max {:.4} (nats, {} rows)",
            s.min,
            s.mean,
            s.max,
            lse.len()
        );
        match (&l.ds.lse_ref, opts.softcap) {
            (Some(r), None) => {
                let want: Vec<f64> = r.iter().map(|&x| x as f64).collect();
                let e = err_stats(&lse, &want);
                outln!(
                    "; max |lse - lse_ref| = {:.2e} (row {})",
                    e.max_abs,
                    e.worst
                );
            }
            (Some(_), Some(_)) => outln!("; lse_ref not comparable under softcap"),
            _ => outln!(),
        }
    }
    if let Some(h) = &res.entropy {
        if let Some(s) = summary(h.to_f32_vec().iter().map(|&x| x as f64)) {
            outln!(
                "entropy    min {:.4}, mean {:.4}, max {:.4} (nats, softmax entropy per row)",
                s.min,
                s.mean,
                s.max
            );
        }
    }
    if let Some(am) = &res.argmax {
        let am = am.to_i64_vec().unwrap_or_default();
        let prepared = prepared_targets(l, t, opts)?;
        let (mut hit, mut valid) = (0usize, 0usize);
        for (i, &y) in prepared.classes.iter().enumerate() {
            if y >= 0 {
                valid += 1;
                hit += usize::from(am.get(i) == Some(&(y as i64)));
            }
        }
        if valid == 0 {
            outln!("argmax     top-1 accuracy undefined (no valid row)");
        } else {
            outln!(
                "argmax     top-1 accuracy {:.2}% ({hit} of {valid} valid rows)",
                100.0 * hit as f64 / valid as f64
            );
        }
    }
    Ok(())
}

fn print_times_memory(
    l: &Loaded,
    t: &Tensors,
    res: &HostResult,
    call_ms: f64,
    rss: Option<&RssDuring>,
    backend: &str,
) {
    let mut line = format!(
        "time       load {}, forward {}",
        fmt_ms(l.load_ms),
        fmt_ms(res.forward_ms)
    );
    if let Some(b) = res.backward_ms {
        line.push_str(&format!(", backward {}", fmt_ms(b)));
    }
    line.push_str(&format!(
        ", whole call {} (with uploads and downloads)",
        fmt_ms(call_ms)
    ));
    outln!("{line}");
    for line in memory_lines(t, res, rss, backend) {
        outln!("{line}");
    }
}

/// The `memory` lines: the process's peak RSS, the call's RSS growth (measured), and the
/// workspace of the call statistics, said for what it is. On the GPU backends that is the
/// device scratch they allocated beyond inputs and outputs; the CPU backend reports the plan's
/// figure, which it does not allocate as such (its forward goes tile by tile, its backward
/// holds the logits chunk besides f32 accumulators, the outputs and its own copy of the
/// inputs), so there the RSS growth is the figure to compare with the RSS.
fn memory_lines(
    t: &Tensors,
    res: &HostResult,
    rss: Option<&RssDuring>,
    backend: &str,
) -> Vec<String> {
    // The CPU backend, or its vocabulary-parallel simulation (`cpu-vocab-parallel`).
    let cpu = backend.starts_with("cpu");
    let mut lines = vec![format!(
        "memory     peak RSS {} (process VmHWM{}); inputs {} in {}",
        rss.map(|r| r.process_peak)
            .or_else(peak_rss_bytes)
            .map_or("unknown".into(), fmt_bytes),
        if cpu { "" } else { ", host memory" },
        fmt_bytes(t.bytes()),
        t.e.dtype(),
    )];
    if let Some(r) = rss {
        let what = if cpu && res.backward_stats.is_some() {
            "the cpu backend's host buffers (a copy of the inputs, f32 gradient accumulators, outputs, the backward's logits chunk)"
        } else if cpu {
            "the cpu backend's host buffers (a copy of the inputs, outputs, tiles of logits)"
        } else {
            "host memory (the driver, staging, downloaded outputs; a software driver's device memory, as lavapipe's, is host memory too)"
        };
        lines.push(if r.exact {
            format!(
                "           call RSS {} before, {} at its peak (+{}): {what}",
                fmt_bytes(r.before),
                fmt_bytes(r.peak),
                fmt_bytes(r.growth()),
            )
        } else {
            format!(
                "           call RSS {} before, its peak under the process's earlier {} (at most +{}): {what}",
                fmt_bytes(r.before),
                fmt_bytes(r.peak),
                fmt_bytes(r.growth()),
            )
        });
    }
    let ws_f = fmt_bytes(res.forward_stats.workspace_bytes);
    let ws = match &res.backward_stats {
        Some(s) => format!("forward {ws_f}, backward {}", fmt_bytes(s.workspace_bytes)),
        None => format!("forward {ws_f}"),
    };
    lines.push(if cpu {
        format!(
            "           plan workspace {ws}: scratch the plan budgets beyond inputs and outputs (a GPU's device memory); on cpu not allocated as such, the call RSS above is the measured figure"
        )
    } else {
        format!(
            "           workspace {ws}: device scratch the backend allocated beyond inputs and outputs (device memory = inputs + outputs + workspace)"
        )
    });
    lines
}

fn print_stats(title: &str, s: &CallStats) {
    outln!("{title}");
    for line in s.to_string().lines() {
        // The CPU backend reports the plan's workspace, not an allocation (`memory_lines`).
        match line.strip_prefix("workspace ") {
            Some(rest) if s.backend.starts_with("cpu") => {
                outln!(
                    "  plan workspace    {} (the plan's figure, not an allocation on cpu: see memory)",
                    rest.trim_start()
                )
            }
            _ => outln!("  {line}"),
        }
    }
}

/// Bytes the f64 oracle needs: logits `N x V` plus f64 copies of inputs and gradients.
fn oracle_bytes(t: &Tensors) -> u64 {
    let d = t.c.shape()[1] as u64;
    let n = t.e.numel() as u64 / d.max(1);
    let v = t.c.shape()[0] as u64;
    8 * n * v + 16 * (n + v) * d + 64 * (n + v)
}

/// Compares every output with the f64 oracle, prints the table and returns each output's
/// verdict under the rule of [`crate::judge`].
fn check(
    l: &Loaded,
    t: &Tensors,
    res: &HostResult,
    opts: &Options,
    dtype: DType,
    backward: bool,
) -> CliResult<Vec<Verdict>> {
    let need = oracle_bytes(t);
    if let Some(avail) = available_memory_bytes() {
        if need > avail {
            return Err(CliError::msg(format!(
                "--check: the f64 oracle needs about {} (N x V f64 logits), only {} is available; use a smaller --n",
                fmt_bytes(need),
                fmt_bytes(avail)
            )));
        }
    }
    let (d, v) = (t.c.shape()[1], t.c.shape()[0]);
    let n = t.e.numel() / d.max(1);
    let d_loss = match opts.reduction {
        Reduction::None => OracleDLoss::PerRow(vec![1.0; n]),
        _ => OracleDLoss::Scalar(1.0),
    };
    let t0 = Instant::now();
    let oracle = with_spinner(
        format!("f64 oracle (materializes {})", fmt_bytes(need)),
        || {
            naive(
                &t.e,
                &t.c,
                t.bias.as_ref(),
                &t.targets,
                opts,
                &d_loss,
                None,
                Precision::F64,
            )
        },
    )?;
    let oracle_ms = t0.elapsed().as_secs_f64() * 1e3;
    outln!(
        "check      against the f64 naive oracle on the same {dtype} inputs ({oracle_ms:.0} ms)"
    );
    // Under a softcap s, an absolute logit error δx becomes a relative gradient error 2δx/s, so
    // logits accumulated in f32 (every GPU backend) err by more than the dtype's tolerance for
    // small caps (cce_core docs, "Accuracy on hard inputs"): as the conformance rule does, the
    // gradients may be as far from the truth as the same-precision reference is.
    let same = match opts.softcap {
        Some(s) => {
            let r = with_spinner("same-precision reference (softcap)".to_string(), || {
                naive(
                    &t.e,
                    &t.c,
                    t.bias.as_ref(),
                    &t.targets,
                    opts,
                    &d_loss,
                    None,
                    Precision::SameDtype,
                )
            })?;
            outln!(
                "           softcap {s}: a gradient's tolerance adds the {dtype} reference's own error (f32 logits, amplified by 2/s)"
            );
            Some(r)
        }
        None => None,
    };
    // The same-precision reference's relative L2 error of one output (0 without a softcap).
    let ref_err = |pick: fn(&cut_cross_entropy::Oracle) -> &[f64], want: &[f64]| -> f64 {
        same.as_ref().map_or(0.0, |r| {
            let v: Vec<f32> = pick(r).iter().map(|&x| x as f32).collect();
            err_stats(&v, want).rel_l2
        })
    };
    let zmag = judge::zmag(&oracle.lse);
    let kappa = judge::kappa(zmag, d);
    let n_valid = oracle.n_valid;
    // What the filter's skipped entries may explain, per gradient (None: it did not apply).
    let bound = res
        .backward_stats
        .as_ref()
        .filter(|s| s.filter_eps > 0.0 && s.dropped_mass_max > 0.0)
        .map(|s| -> CliResult<FilterBound> {
            let prepared = prepared_targets(l, t, opts)?;
            let valid: Vec<bool> = prepared.classes.iter().map(|&y| y >= 0).collect();
            let g = match opts.reduction {
                Reduction::Mean => 1.0 / n_valid.max(1) as f64,
                _ => 1.0,
            };
            Ok(FilterBound::new(
                &valid,
                g,
                opts.z_loss as f64,
                &oracle.lse,
                s.dropped_mass_max,
                s.filter_eps as f64,
            ))
        })
        .transpose()?;
    let mut table = Table::new(&[
        "output",
        "rel L2 error",
        "max|err| / max|ref|",
        "max|err|",
        "at index",
        "judged error",
        "tolerance",
        "verdict",
    ]);
    let mut verdicts = Vec::new();
    // `unit`: what "order 1" means for the output; `len`: its reduction length; `filter`: the
    // absolute bound on what the filter skipped.
    let mut add = |name: &str, got: &[f32], want: &[f64], unit: f64, tau: f64, filter: f64| {
        let e: ErrStats = err_stats(got, want);
        let error = judge::judged_error(got, want, unit);
        let want_norm = judge::norm(want);
        let allowed = tau
            + if want_norm > 0.0 {
                filter / want_norm
            } else {
                filter
            };
        let verdict = Verdict {
            name: name.to_string(),
            error,
            allowed,
        };
        table.row(vec![
            name.to_string(),
            format!("{:.3e}", e.rel_l2),
            format!("{:.3e}", e.rel_max),
            format!("{:.3e}", e.max_abs),
            e.worst.to_string(),
            if error.is_finite() {
                format!("{error:.3e}")
            } else {
                "non-finite".to_string()
            },
            format!("{allowed:.3e}"),
            if verdict.pass() { "pass" } else { "FAIL" }.to_string(),
        ]);
        verdicts.push(verdict);
    };
    let tau_v = judge::tau(dtype, v, 1.0);
    let loss_unit = match opts.reduction {
        Reduction::Sum => zmag * (n_valid as f64).sqrt(),
        _ => zmag,
    };
    add(
        "loss",
        &res.loss.to_f32_vec(),
        &oracle.loss,
        loss_unit,
        tau_v,
        0.0,
    );
    add("lse", &res.lse.to_f32_vec(), &oracle.lse, zmag, tau_v, 0.0);
    if let Some(h) = &res.entropy {
        add(
            "entropy",
            &h.to_f32_vec(),
            &oracle.entropy,
            zmag,
            tau_v,
            0.0,
        );
    }
    if backward {
        let e_filtered = bound.as_ref().filter(|_| opts.filter_e_grad);
        let c_filtered = bound.as_ref().filter(|_| opts.filter_c_grad);
        if let Some(g) = &res.d_e {
            let filter = e_filtered.map_or(0.0, |b| b.d_e(&t.c.to_f32_vec(), d));
            let tau = judge::tau(dtype, v, kappa) + ref_err(|o| &o.d_e, &oracle.d_e);
            add("d_e", &g.to_f32_vec(), &oracle.d_e, 0.0, tau, filter);
        }
        let tau_n = judge::tau(dtype, n, kappa);
        if let Some(g) = &res.d_c {
            let filter = c_filtered.map_or(0.0, |b| b.d_c(&t.e.to_f32_vec(), d));
            let tau = tau_n + ref_err(|o| &o.d_c, &oracle.d_c);
            add("d_c", &g.to_f32_vec(), &oracle.d_c, 0.0, tau, filter);
        }
        if let (Some(g), Some(w)) = (&res.d_bias, &oracle.d_bias) {
            let filter = c_filtered.map_or(0.0, FilterBound::d_bias);
            add("d_bias", &g.to_f32_vec(), w, 0.0, tau_n, filter);
        }
    }
    for line in table.render().lines() {
        outln!("  {line}");
    }
    if backward {
        let out_dtype = res
            .d_e
            .as_ref()
            .or(res.d_c.as_ref())
            .map_or(dtype, |t| t.dtype());
        let e32 = t.e.to_f32_vec();
        let c32 = t.c.to_f32_vec();
        let widen = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<f64>>();
        let (e64, c64) = (widen(&e32), widen(&c32));
        let e_filtered = bound.as_ref().filter(|_| opts.filter_e_grad);
        let c_filtered = bound.as_ref().filter(|_| opts.filter_c_grad);
        let mut rows_table = Table::new(&[
            "rows of",
            "rows out",
            "worst row",
            "|ours|",
            "|oracle|",
            "|ours - oracle|",
            "allowed",
            "verdict",
        ]);
        let g_max = oracle.g_terms_rows.iter().fold(0.0f64, |a, &x| a.max(x));
        let mut add_rows = |name: &str,
                            terms_len: usize,
                            got: &HostTensor,
                            want: &[f64],
                            sums: &[f64],
                            m_other: f64,
                            tau: f64,
                            filter: &dyn Fn(usize) -> f64,
                            reference: Option<&[f64]>| {
            let ours = widen(&got.to_f32_vec());
            let rows = row_errors(&ours, want, d, |i, truth_norm| {
                // As far from the truth as the same-precision reference's row (softcap).
                let same = reference.map_or(0.0, |r| {
                    let row = i * d..(i + 1) * d;
                    judge::norm(
                        &r[row.clone()]
                            .iter()
                            .zip(&want[row])
                            .map(|(a, b)| a - b)
                            .collect::<Vec<_>>(),
                    )
                });
                // A GPU may flush subnormal entries of G (FTZ) or hold G in f16 with one
                // power-of-two scale (16-bit inputs): each of the row's `terms_len` entries
                // (V for d_e, N for d_c) may lose max(2^-126, 2^-38 max|G|).
                let ftz = g_range_allowance(dtype, terms_len, m_other, g_max);
                row_allowance(
                    tau,
                    truth_norm,
                    sums[i] * m_other,
                    filter(i) + ftz + same,
                    d,
                    out_dtype,
                )
            });
            let bad = rows.iter().filter(|r| !r.pass()).count();
            for (k, r) in worst_rows(&rows, 3).iter().enumerate() {
                rows_table.row(vec![
                    if k == 0 {
                        name.to_string()
                    } else {
                        String::new()
                    },
                    if k == 0 {
                        format!("{bad} of {}", rows.len())
                    } else {
                        String::new()
                    },
                    r.row.to_string(),
                    format!("{:.3e}", r.ours_norm),
                    format!("{:.3e}", r.truth_norm),
                    if r.error.is_finite() {
                        format!("{:.3e}", r.error)
                    } else {
                        "non-finite".into()
                    },
                    format!("{:.3e}", r.allowed),
                    if r.pass() { "pass" } else { "FAIL" }.into(),
                ]);
            }
            // A failing row is its own verdict where the output as a whole passed (a norm
            // over every row hides it); an output that fails already says so.
            let whole_passed = verdicts.iter().any(|v| v.name == name && v.pass());
            if let Some(w) = worst_rows(&rows, 1)
                .first()
                .filter(|w| !w.pass() && whole_passed)
            {
                verdicts.push(Verdict {
                    name: format!("{name} row {} (worst of {bad} rows)", w.row),
                    error: w.error,
                    allowed: w.allowed,
                });
            }
        };
        if let Some(g) = &res.d_e {
            let tau = judge::tau(dtype, v, kappa);
            let c_max = max_row_norm(&c64, d);
            let filter = |i: usize| e_filtered.map_or(0.0, |b| b.d_e_row(i, c_max));
            add_rows(
                "d_e",
                v,
                g,
                &oracle.d_e,
                &oracle.g_terms_rows,
                c_max,
                tau,
                &filter,
                same.as_ref().map(|r| r.d_e.as_slice()),
            );
        }
        if let Some(g) = &res.d_c {
            let tau = judge::tau(dtype, n, kappa);
            let per_row = c_filtered.map_or(0.0, |b| b.d_c_row(&e32, d));
            let filter = |_: usize| per_row;
            let e_max = max_row_norm(&e64, d);
            add_rows(
                "d_c",
                n,
                g,
                &oracle.d_c,
                &oracle.g_terms_cols,
                e_max,
                tau,
                &filter,
                same.as_ref().map(|r| r.d_c.as_slice()),
            );
        }
        for line in rows_table.render().lines() {
            outln!("  {line}");
        }
        outln!(
            "  per row: |ours_i - oracle_i| <= tolerance * (|oracle_i| + sum_j |G_ij| * max row norm of c (d_e) or e (d_c)) [+ filter], the worst 3 rows shown"
        );
    }
    if let Some(am) = &res.argmax {
        let got = am.to_i64_vec().unwrap_or_default();
        let diff = got
            .iter()
            .zip(&oracle.argmax)
            .filter(|(a, b)| **a != **b as i64)
            .count();
        outln!(
            "  argmax: {diff} of {} rows differ from the oracle (ties and near-ties can; not judged)",
            got.len()
        );
    }
    outln!(
        "  judged error = |ours - oracle| / (|oracle| + unit * sqrt(len)) in L2, unit = max(1, max|lse|) = {zmag:.3} for loss, lse, entropy, 0 for gradients"
    );
    outln!(
        "  tolerance = {dtype}'s {:.0e} on values of order 1, grown for long f32 sums and, for gradients, large logits{}",
        dtype.tolerance(),
        if bound.is_some() {
            "; filtered gradients add what the skipped entries can explain (from the reported dropped mass; --filter-eps off for the exact gradient)"
        } else {
            ""
        }
    );
    if kappa > 1.0 {
        outln!(
            "  gradient tolerance widened x{kappa:.1} (max|lse| {zmag:.3e}, D {d}): the saved f32 lse and the f32 logits carry ~max|lse|·2^-24 of absolute error, a relative error of every p; a common logit offset (e.g. the same bias on every class) is not cancelled (cce_core docs, \"Accuracy on hard inputs\")"
        );
    }
    let bad = verdicts.iter().filter(|v| !v.pass()).count();
    if bad == 0 {
        outln!("  verdict: pass (every output within its tolerance)");
    } else {
        outln!(
            "  verdict: FAIL ({bad} of {} outputs outside their tolerance)",
            verdicts.len()
        );
    }
    Ok(verdicts)
}

fn save_grads(
    path: &std::path::Path,
    res: &HostResult,
    l: &Loaded,
    backend: &str,
    dtype: DType,
) -> CliResult<()> {
    let grads: Vec<(&str, &HostTensor)> = [
        ("d_e", res.d_e.as_ref()),
        ("d_c", res.d_c.as_ref()),
        ("d_bias", res.d_bias.as_ref()),
    ]
    .into_iter()
    .filter_map(|(n, t)| t.map(|t| (n, t)))
    .collect();
    if grads.is_empty() {
        return Err(CliError::msg(
            "--save-grads: no gradient was computed (drop --no-d-e / --no-d-c)",
        ));
    }
    let values: Vec<Vec<f32>> = grads.iter().map(|(_, t)| t.to_f32_vec()).collect();
    let tensors: Vec<F32Tensor<'_>> = grads
        .iter()
        .zip(&values)
        .map(|((name, t), v)| F32Tensor {
            name,
            shape: t.shape(),
            data: v,
        })
        .collect();
    let mut meta = HashMap::new();
    meta.insert("input".to_string(), l.ds.name.clone());
    meta.insert("backend".to_string(), backend.to_string());
    meta.insert("dtype".to_string(), dtype.to_string());
    meta.insert(
        "loss".to_string(),
        format!(
            "{:?}",
            res.loss.to_f32_vec().first().copied().unwrap_or(f32::NAN)
        ),
    );
    cce_data::save_safetensors(path, &tensors, Some(meta))
        .map_err(|e| CliError::from(e).context("--save-grads"))?;
    let names: Vec<String> = grads
        .iter()
        .map(|(n, t)| format!("{n} {:?}", t.shape()))
        .collect();
    outln!(
        "saved      {} to {} (f32 safetensors)",
        names.join(", "),
        path.display()
    );
    Ok(())
}

/// An output file path (`flag` names it in the error) that cannot be written because it is a
/// directory or its folder does not exist: checked before any work, so that a typo does not
/// cost a whole run.
pub fn check_output_path(flag: &str, path: &std::path::Path) -> CliResult<()> {
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
    if path.is_dir() || parent.is_some_and(|p| !p.is_dir()) {
        return Err(CliError::msg(format!(
            "{flag} {}: not a writable file path (a directory, or its folder does not exist)",
            path.display()
        )));
    }
    Ok(())
}
