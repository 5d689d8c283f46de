//! The CPU backend on real rows: exact, filtered with the classes in id order, and filtered
//! with the classes by batch-mean logit (`CpuBackend::with_vocab_order`). Per case the median
//! time (after a warm-up) of the backward alone and of `forward_backward` (whose filtered calls
//! decide their skips from the forward's per-tile statistics), the tiles skipped, the dropped
//! mass per row, and the filtered gradients' distance from the exact call's
//! (`‖Δ‖_F / ‖exact‖_F`, bf16 inputs, f32 gradients; from the `forward_backward` calls).
//!
//! `cargo run --release -p cce-benches --bin cce-bench-cpu -- [--e12k] [--rows N] [--repeats K]`

use std::time::Instant;

use cce_core::{
    Backend, BackwardOutput, CallStats, DType, FilterEps, GradDType, HostTensor, Inputs, Options,
    Upstream,
};
use cce_reference::CpuBackend;
use clap::Parser;

/// Command line.
#[derive(Parser, Debug)]
#[command(about = "CPU backward on real rows: exact, filtered in id order, filtered by mean logit")]
struct Args {
    /// Use the 12288-row real file (shared/data) instead of the shipped 1024-row fixture.
    #[arg(long)]
    e12k: bool,
    /// Take the first N rows (all when absent).
    #[arg(long)]
    rows: Option<usize>,
    /// Per-row bound on the filtered calls' dropped probability mass (`max_dropped_mass`).
    #[arg(long, default_value_t = Options::default().max_dropped_mass)]
    max_dropped_mass: f32,
    /// Timed runs per case (after one warm-up).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
    (num / den.max(1e-300)).sqrt()
}

struct Case {
    label: &'static str,
    /// Median of the backward alone (after a separate forward), ms.
    bwd_ms: f64,
    /// Median of `forward_backward` (the fused path where it applies), ms.
    ms: f64,
    stats: CallStats,
    d_e: Vec<f32>,
    d_c: Vec<f32>,
}

/// Median wall time of `repeats` runs of `f` after a warm-up, and the last run's result.
fn median_ms<R>(
    repeats: usize,
    f: impl Fn() -> cce_core::Result<R>,
) -> Result<(f64, R), Box<dyn std::error::Error>> {
    let mut last = f()?;
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats.max(1) {
        let t0 = Instant::now();
        last = f()?;
        times.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok((times[times.len() / 2], last))
}

fn grads(out: &BackwardOutput<HostTensor>) -> (Vec<f32>, Vec<f32>) {
    let get = |t: &Option<HostTensor>| t.as_ref().map(|t| t.to_f32_vec()).unwrap_or_default();
    (get(&out.d_e), get(&out.d_c))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let mut ds = if args.e12k {
        let path = cce_data::e12k_path().ok_or("the 12k-row real file was not found")?;
        cce_data::load_real_e12k(path, cce_data::fixture_path())?
    } else {
        cce_data::load_real_fixture()?
    };
    if let Some(n) = args.rows {
        ds = ds.rows(0, n.min(ds.n));
    }
    let e = HostTensor::from_f32(vec![ds.n, ds.d], &ds.e, DType::BF16)?;
    let c = HostTensor::from_f32(vec![ds.v, ds.d], &ds.c, DType::BF16)?;
    let t = HostTensor::from_i64(ds.targets.clone());
    let inputs = Inputs {
        e: &e,
        c: &c,
        bias: None,
        targets: &t,
    };
    let exact = Options {
        grad_dtype: GradDType::F32,
        filter_eps: FilterEps::Off,
        ..Options::default()
    };
    let filtered = Options {
        filter_eps: FilterEps::Auto,
        max_dropped_mass: args.max_dropped_mass,
        ..exact.clone()
    };
    let cases = [
        ("exact", CpuBackend::new(), &exact),
        (
            "filtered, id order",
            CpuBackend::new().with_vocab_order(false),
            &filtered,
        ),
        ("filtered, by mean logit", CpuBackend::new(), &filtered),
    ];
    println!(
        "{}: N = {}, D = {}, V = {}, bf16 inputs, f32 gradients, max_dropped_mass {:e}, median of {} after a warm-up",
        ds.name, ds.n, ds.d, ds.v, args.max_dropped_mass, args.repeats
    );
    let mut done: Vec<Case> = Vec::new();
    for (label, be, opts) in cases {
        let fwd = be.forward(&inputs, opts)?;
        let backward = || be.backward(&inputs, opts, fwd.saved(), &Upstream::default());
        let (bwd_ms, _) = median_ms(args.repeats, backward)?;
        let both = || be.forward_backward(&inputs, opts, &Upstream::default());
        let (ms, (_, out)) = median_ms(args.repeats, both)?;
        let (d_e, d_c) = grads(&out);
        done.push(Case {
            label,
            bwd_ms,
            ms,
            stats: out.stats,
            d_e,
            d_c,
        });
    }
    println!(
        "| case | backward ms | forward+backward ms | tiles skipped | dropped mass max / mean | d_e vs exact | d_c vs exact |"
    );
    println!("|---|---|---|---|---|---|---|");
    for case in &done {
        let s = &case.stats;
        println!(
            "| {} | {:.0} | {:.0} | {:.1}% | {:.2e} / {:.2e} | {:.2e} | {:.2e} |",
            case.label,
            case.bwd_ms,
            case.ms,
            100.0 * s.skipped_fraction(),
            s.dropped_mass_max,
            s.dropped_mass_mean,
            rel(&case.d_e, &done[0].d_e),
            rel(&case.d_c, &done[0].d_c),
        );
    }
    Ok(())
}
