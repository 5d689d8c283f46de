//! `cce repro`: the seed's experiment. The same base inputs (randn e and c, one seed) run
//! regular and scaled (c/8, e/8, c*8, e*8), plus the `lm` generator calibrated to real LM
//! logits; per case the forward+backward time, its ratio to the regular case, the mean
//! softmax entropy and what the gradient filter skipped.

use std::time::Instant;

use cce_data::Distribution;
use cut_cross_entropy::{HostBackend, Options, SideOutputs};

use crate::cli::ReproArgs;
use crate::error::{CliError, CliResult};
use crate::input::{self, parse_distribution, Tensors};
use crate::plot::{self, Point};
use crate::progress::bar;
use crate::report::{fmt_bytes, peak_rss_bytes, summary, Table};

/// What one case measured.
#[derive(Clone, Debug)]
pub struct CaseResult {
    /// Case label as given (`regular`, `c/8`, ...).
    pub label: String,
    /// Mean softmax entropy per row, nats (from the forward's entropy side output).
    pub entropy: f64,
    /// Median forward time, ms.
    pub fwd_ms: f64,
    /// Median backward time, ms.
    pub bwd_ms: f64,
    /// Median of forward + backward per run, ms.
    pub total_ms: f64,
    /// Fraction of backward tiles skipped by the filter.
    pub tiles_skipped: f64,
    /// Fraction of `(row, class)` entries whose gradient was computed.
    pub entries_kept: f64,
    /// Largest per-row dropped mass.
    pub dropped_max: f64,
    /// Mean per-row dropped mass.
    pub dropped_mean: f64,
    /// Loss (mean over rows).
    pub loss: f64,
}

fn median(mut x: Vec<f64>) -> f64 {
    x.sort_by(f64::total_cmp);
    let k = x.len();
    if k == 0 {
        f64::NAN
    } else if k % 2 == 1 {
        x[k / 2]
    } else {
        0.5 * (x[k / 2 - 1] + x[k / 2])
    }
}

fn call(
    backend: &dyn HostBackend,
    t: &Tensors,
    opts: &Options,
) -> CliResult<cut_cross_entropy::HostResult> {
    Ok(backend.run(
        &t.e,
        &t.c,
        t.bias.as_ref(),
        &t.targets,
        opts,
        true,
        1.0,
        None,
    )?)
}

/// Runs `cce repro`: prints the table and, with `--plot`, writes the PNG.
///
/// Errors: bad options or case names, an unavailable backend, generation or call failures, an
/// unwritable plot file.
pub fn main(args: &ReproArgs) -> CliResult<()> {
    let opts = Options {
        filter_eps: args.filter_eps,
        max_dropped_mass: args.max_dropped_mass,
        workspace_budget_bytes: args.workspace_budget_mib.saturating_mul(1 << 20),
        ..Options::default()
    };
    opts.validate()?;
    // An unwritable --plot path fails before the cases run, not after them.
    if let Some(path) = &args.plot {
        crate::run::check_output_path("--plot", path)?;
        let png = path
            .extension()
            .is_some_and(|x| x.eq_ignore_ascii_case("png"));
        if !png {
            return Err(CliError::msg(format!(
                "--plot {}: the plot is a PNG image; give a path ending in .png",
                path.display()
            )));
        }
    }
    if args.n == 0 || args.d == 0 || args.v == 0 {
        return Err(CliError::msg(format!(
            "--n, --d and --v must be >= 1 (got {} x {} x {})",
            args.n, args.d, args.v
        )));
    }
    let cases: Vec<(String, Distribution)> = args
        .cases
        .iter()
        .map(|c| {
            let dist = parse_distribution(c).map_err(|e| e.context("--cases"))?;
            Ok((c.trim().to_string(), dist))
        })
        .collect::<CliResult<_>>()?;
    if cases.is_empty() {
        return Err(CliError::msg("--cases: no case given"));
    }
    let crate::backend::Opened {
        backend,
        description,
    } = crate::backend::open(&args.backend)?;
    let dtype = args.dtype.dtype();
    outln!(
        "repro      N = {}, D = {}, V = {}, dtype {dtype}, backend {}, seed {}, median of {} run{} after 1 warm-up",
        args.n,
        args.d,
        args.v,
        description,
        args.seed,
        args.repeats,
        if args.repeats == 1 { "" } else { "s" }
    );

    let steps = cases.len() as u64 * (u64::from(args.repeats) + 2);
    let pb = bar(steps, "repro");
    let t_all = Instant::now();
    let mut results = Vec::with_capacity(cases.len());
    let mut filter_line = None;
    for (label, dist) in &cases {
        pb.set_message(format!("{label}: generating"));
        let ds = cce_data::generate(dist, args.n, args.d, args.v, args.seed)
            .map_err(|e| CliError::from(e).context(&format!("case {label}")))?;
        let t = input::tensors(&ds, dtype)?;
        drop(ds);
        pb.inc(1);
        pb.set_message(format!("{label}: warm-up"));
        // The warm-up also gives the entropy; the timed runs compute no side outputs.
        let warm = call(
            backend.as_ref(),
            &t,
            &Options {
                side_outputs: SideOutputs {
                    entropy: true,
                    argmax: false,
                },
                ..opts.clone()
            },
        )
        .map_err(|e| e.context(&format!("case {label}")))?;
        pb.inc(1);
        let entropy = warm
            .entropy
            .as_ref()
            .and_then(|h| summary(h.to_f32_vec().iter().map(|&x| x as f64)))
            .map_or(f64::NAN, |s| s.mean);
        let (mut fwd, mut bwd, mut tot) = (Vec::new(), Vec::new(), Vec::new());
        let mut last = warm;
        for r in 0..args.repeats {
            pb.set_message(format!("{label}: run {}/{}", r + 1, args.repeats));
            let res = call(backend.as_ref(), &t, &opts)
                .map_err(|e| e.context(&format!("case {label}")))?;
            let b = res.backward_ms.unwrap_or(0.0);
            fwd.push(res.forward_ms);
            bwd.push(b);
            tot.push(res.forward_ms + b);
            last = res;
            pb.inc(1);
        }
        let s = last
            .backward_stats
            .clone()
            .unwrap_or(last.forward_stats.clone());
        if filter_line.is_none() {
            filter_line = Some(if s.filter_eps > 0.0 {
                format!(
                    "filter     eps {:.3e}, max dropped mass {:.1e} per row; strategy {}",
                    s.filter_eps, s.max_dropped_mass, s.strategy
                )
            } else {
                format!("filter     off (exact); strategy {}", s.strategy)
            });
        }
        let entries = s.entries_kept + s.entries_skipped;
        results.push(CaseResult {
            label: label.clone(),
            entropy,
            fwd_ms: median(fwd),
            bwd_ms: median(bwd),
            total_ms: median(tot),
            tiles_skipped: s.skipped_fraction(),
            entries_kept: if entries == 0 {
                1.0
            } else {
                s.entries_kept as f64 / entries as f64
            },
            dropped_max: s.dropped_mass_max,
            dropped_mean: s.dropped_mass_mean,
            loss: last.loss.to_f32_vec().first().copied().unwrap_or(f32::NAN) as f64,
        });
    }
    pb.finish_and_clear();
    if let Some(f) = filter_line {
        outln!("{f}");
    }

    let base_idx = results
        .iter()
        .position(|r| {
            r.label.eq_ignore_ascii_case("regular") || r.label.eq_ignore_ascii_case("randn")
        })
        .unwrap_or(0);
    let base = results[base_idx].total_ms;
    let base_name = results[base_idx].label.clone();
    let mut table = Table::new(&[
        "case",
        "entropy (nats)",
        "fwd ms",
        "bwd ms",
        "fwd+bwd ms",
        &format!("vs {base_name}"),
        "tiles skipped",
        "entries kept",
        "dropped max",
        "dropped mean",
        "loss",
    ]);
    for r in &results {
        table.row(vec![
            r.label.clone(),
            format!("{:.3}", r.entropy),
            format!("{:.2}", r.fwd_ms),
            format!("{:.2}", r.bwd_ms),
            format!("{:.2}", r.total_ms),
            format!("{:.2}x", r.total_ms / base),
            format!("{:.1}%", 100.0 * r.tiles_skipped),
            format!("{:.2}%", 100.0 * r.entries_kept),
            format!("{:.1e}", r.dropped_max),
            format!("{:.1e}", r.dropped_mean),
            format!("{:.4}", r.loss),
        ]);
    }
    outln!("{}", table.render());
    outln!(
        "total {:.1} s; peak RSS {}",
        t_all.elapsed().as_secs_f64(),
        peak_rss_bytes().map_or("unknown".into(), fmt_bytes)
    );

    if let Some(path) = &args.plot {
        let points: Vec<Point> = results
            .iter()
            .map(|r| Point {
                label: r.label.clone(),
                entropy: r.entropy,
                time_ms: r.total_ms,
                tiles_kept: 1.0 - r.tiles_skipped,
                entries_kept: r.entries_kept,
            })
            .collect();
        let title = format!(
            "cce repro: N={} D={} V={} {dtype} on {}",
            args.n,
            args.d,
            args.v,
            backend.name()
        );
        plot::draw(path, &title, &points)
            .map_err(|e| e.context(&format!("--plot {}", path.display())))?;
        outln!("plot       {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn median_odd_even() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(vec![]).is_nan());
    }
}
