//! Benchmark of the wgpu backend: forward and forward+backward at named shapes and data
//! distributions (CASES.md), as wall time (synchronized) and achieved TFLOP/s against the fp32
//! FMA peak of the device (`--peak-tflops`, default 67 for the H200).
//!
//! ```text
//! cce-bench-wgpu [--shapes gemma2,seed] [--data c/8,randn,lm] [--reps 3] [--deadline-s 240]
//!                [--dtype bf16] [--peak-tflops 67] [--exact] [--out results.jsonl] [--ab]
//!                [--adapter-report] [--softcap 30] [--target-workgroups 2048]
//!                [--configs 8:16,8:32,8:16:checked]
//! ```
//! (clap: `--help` lists the options with their defaults.)
//! Data: `randn` (e, c ~ N(0, 1)) and `c/8` (c scaled by 1/8) generated here with uniform
//! targets; any other name (`lm`, `iid`, ...) is a `cce_data::Distribution`, generated on the
//! CPU with targets sampled from the softmax.
//! FLOP: one logits GEMM is `2·N·V·D`. The forward executes 1; the backward executes 1 per
//! threshold pass (filter on) plus 2 per pass over the kept fraction of tiles (d_e and d_c).
//! "floor rate" divides the 3-GEMM floor (1 for forward only) by the time; "executed rate"
//! divides the FLOP actually executed. Rates print in TFLOP/s, or GFLOP/s below 1 TFLOP/s
//! (CPU adapters such as lavapipe).
//! `--ab` times every config of `--configs` in alternation instead (one call of each per
//! round, so that a shared, noisy machine slows them alike) and prints per config the median
//! wall time and process CPU time (all threads, from /proc/self/stat: the work of a CPU
//! adapter's threads, less sensitive to other processes than wall time) with the ratio to the
//! first config; after the forward's rounds, each config's loss from its latest forward and
//! the largest |Δ| of its lse over all rows against the first config's.
//! A config `wg:tk:checked` builds the shader modules with wgpu's runtime checks (bounds
//! checks, loop bounding); without the suffix they are built trusted (the backend's default).
//! `:fma` / `:coop` turn the cooperative-matrix forward off / on (built with the feature
//! `wgpu-coop`; it runs for f16 inputs on adapters that offer cooperative matrices);
//! `:coop64` / `:coop128` turn it on at 64 x 64 tiles (logits_coop.wgsl, needs wg = 8) / at
//! 128 x 128 tiles (logits_coop128.wgsl, the default tile of `:coop`; the backward keeps the
//! config's `wg:tk`); `:coop128w` at 128 x 128 tiles with 64 x 64 per subgroup
//! (logits_coop128w.wgsl), `:coop128w16` the same with 16-deep panels. The backward's products
//! run by cooperative matrices too where the forward's would (`KernelConfig::coop_backward`,
//! 128 x 128 tiles, f16 G, exact passes; off by default): `:coopbwd` turns it on, `:fmabwd`
//! keeps the FMA backward behind a coop forward (e.g. `8:8:coop128:fmabwd`). After the forward+backward rounds `--ab` prints each
//! config's loss and the largest |Δ| of its d_e and d_c against the first config's.
//! `:quad` / `:scalar` / `:named` pick the main loop of the FMA logits tile (`MainLoop`; quad
//! needs tk = 2·wg, e.g. `8:16:quad`; named: the scalar loop's staging with named
//! accumulators, in every FMA shader); without any, the adapter's default for that shape.
//! `:w<N>` sets the config's `target_workgroups` (e.g. `8:8:named:w65536`: one class tile per
//! forward workgroup at 8192 rows). `:det` (with `--ab`) runs that config's calls with
//! `Options::deterministic` (the backward's per-split slabs instead of its f32 atomics, on
//! devices with `SHADER_FLOAT32_ATOMIC`). `:co` turns the coalesced atomic adds on
//! and `:noco` off (`KernelConfig::coalesced_adds`, off by default: the backward's f32 atomics
//! through subgroup shuffles, or scattered). `--forward-only` (with `--ab`) skips forward+backward.
//! `--profile` (with `--ab`) then runs one more call of each config and pass with GPU
//! timestamps on (per dispatch where the adapter offers TIMESTAMP_QUERY_INSIDE_PASSES, else
//! per compute pass) and prints the GPU time per shader.

use cut_cross_entropy::cce_wgpu::{CoopTile, KernelConfig, MainLoop, WgpuBackend, WgpuTensor};
use cut_cross_entropy::{
    Backend, DType, ForwardOutput, HostData, HostTensor, Inputs, Options, TensorMeta, Upstream,
};
use std::cell::RefCell;
use std::io::Write;
use std::time::Instant;

struct Args {
    shapes: Vec<String>,
    data: Vec<String>,
    reps: usize,
    deadline_s: f64,
    dtype: DType,
    peak: f64,
    exact: bool,
    ab: bool,
    adapter_report: bool,
    softcap: Option<f32>,
    target_workgroups: Option<u32>,
    out: Option<String>,
    /// Kernel configs `(wg, tk, runtime checks)` to compare on the first forward; the fastest
    /// is kept.
    configs: Vec<ConfigSpec>,
    /// GPU timestamps per shader after the A/B rounds.
    profile: bool,
    /// `--ab` times the forward only (no forward+backward).
    forward_only: bool,
}

/// Command line (formats in the module docs).
#[derive(clap::Parser, Debug)]
#[command(
    name = "cce-bench-wgpu",
    about = "The wgpu backend at named shapes and data"
)]
struct Cli {
    /// Shapes, comma list: gemma2, seed, llama3, small or NxDxV.
    #[arg(long, default_value = "gemma2")]
    shapes: String,
    /// Data, comma list: randn, c/8 or a cce_data distribution (lm, iid, ...).
    #[arg(long, default_value = "c/8,randn,lm")]
    data: String,
    /// Timed runs per measurement.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Stop starting new cases after this many seconds.
    #[arg(long, default_value_t = 240.0)]
    deadline_s: f64,
    /// Input dtype: bf16, f16, f32.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// fp32 FMA peak of the device in TFLOP/s (67 for the H200).
    #[arg(long, default_value_t = 67.0)]
    peak_tflops: f64,
    /// Exact mode (filter off) instead of the default filter.
    #[arg(long)]
    exact: bool,
    /// Time the configs of --configs in alternation (A/B) instead of keeping the fastest.
    #[arg(long)]
    ab: bool,
    /// Print the adapter report (features, limits, cooperative-matrix configurations) and exit.
    #[arg(long)]
    adapter_report: bool,
    /// Softcap of the logits (e.g. 30 for Gemma 2), none by default.
    #[arg(long)]
    softcap: Option<f32>,
    /// KernelConfig::target_workgroups for every config (the adapter's default otherwise).
    #[arg(long)]
    target_workgroups: Option<u32>,
    /// Append JSON lines to this file.
    #[arg(long)]
    out: Option<String>,
    /// Kernel configs, comma list, compared on the first forward:
    /// `wg:tk[:checked][:fma|:coop|:coop64|:coop128|:coop128w|:coop128w16]`
    /// `[:quad|:scalar|:named][:wN][:det][:noco|:co][:fmabwd|:coopbwd]`.
    #[arg(long)]
    configs: Option<String>,
    /// With --ab: one more call per config and pass with GPU timestamps, time per shader.
    #[arg(long)]
    profile: bool,
    /// With --ab: time the forward only (no forward+backward pass).
    #[arg(long)]
    forward_only: bool,
}

/// One `--configs` entry: `wg:tk`, then optionally `:checked` (wgpu's runtime checks on) and
/// `:fma` / `:coop` (the cooperative-matrix forward off / on; it runs only where the backend
/// can: the `wgpu-coop` build, f16 inputs, an adapter that offers it), `:coop64` / `:coop128`
/// / `:coop128w` / `:coop128w16` (on, at that tile: `KernelConfig::coop_tile`).
#[derive(Clone, Copy, Debug)]
struct ConfigSpec {
    wg: u32,
    tk: u32,
    checked: bool,
    coop: Option<bool>,
    /// `:coop64` / `:coop128` / `:coop128w` / `:coop128w16`: `KernelConfig::coop_tile` (else the base config's).
    coop_tile: Option<CoopTile>,
    main_loop: Option<MainLoop>,
    /// `:w<N>`: `KernelConfig::target_workgroups` (else the base config's).
    target_workgroups: Option<u32>,
    /// `:det`: calls with `Options::deterministic` (`--ab` only).
    deterministic: bool,
    /// `:noco`: `KernelConfig::coalesced_adds` off.
    scattered: bool,
    /// `:co`: `KernelConfig::coalesced_adds` on (off by default).
    coalesced: bool,
    /// `:fmabwd` / `:coopbwd`: `KernelConfig::coop_backward` off / on (the FMA or the
    /// cooperative-matrix backward behind a coop forward; else the base config's, off).
    coop_bwd: Option<bool>,
}

impl ConfigSpec {
    fn parse(c: &str) -> Result<Self, String> {
        let bad = |why: String| {
            format!(
                "--configs {c:?}: {why} (want \
                 wg:tk[:checked][:fma|:coop|:coop64|:coop128|:coop128w|:coop128w16]\
                 [:quad|:scalar|:named][:wN][:det][:noco|:co][:fmabwd|:coopbwd])"
            )
        };
        let mut parts = c.split(':');
        let mut num = |what: &str| -> Result<u32, String> {
            parts
                .next()
                .ok_or_else(|| bad(format!("no {what}")))?
                .parse()
                .map_err(|e| bad(format!("{what}: {e}")))
        };
        let (wg, tk) = (num("wg")?, num("tk")?);
        let mut spec = ConfigSpec {
            wg,
            tk,
            checked: false,
            coop: None,
            coop_tile: None,
            main_loop: None,
            target_workgroups: None,
            deterministic: false,
            scattered: false,
            coalesced: false,
            coop_bwd: None,
        };
        for flag in parts {
            match flag {
                "checked" => spec.checked = true,
                "fma" => spec.coop = Some(false),
                "coop" => spec.coop = Some(true),
                "coop64" | "coop128" | "coop128w" | "coop128w16" => {
                    spec.coop = Some(true);
                    spec.coop_tile = Some(match flag {
                        "coop64" => CoopTile::T64,
                        "coop128" => CoopTile::T128,
                        "coop128w" => CoopTile::T128W,
                        _ => CoopTile::T128W16,
                    });
                }
                "quad" => spec.main_loop = Some(MainLoop::Quad),
                "scalar" => spec.main_loop = Some(MainLoop::Scalar),
                "named" => spec.main_loop = Some(MainLoop::Named),
                "det" => spec.deterministic = true,
                "noco" => spec.scattered = true,
                "co" => spec.coalesced = true,
                "fmabwd" => spec.coop_bwd = Some(false),
                "coopbwd" => spec.coop_bwd = Some(true),
                w if w.starts_with('w') && w.len() > 1 => {
                    spec.target_workgroups =
                        Some(w[1..].parse().map_err(|e| bad(format!("{w}: {e}")))?)
                }
                other => return Err(bad(format!("unknown flag {other:?}"))),
            }
        }
        Ok(spec)
    }

    fn apply(&self, base: KernelConfig) -> KernelConfig {
        KernelConfig {
            wg: self.wg,
            tk: self.tk,
            runtime_checks: self.checked,
            cooperative_matrix: self.coop.unwrap_or(base.cooperative_matrix),
            coop_tile: self.coop_tile.unwrap_or(base.coop_tile),
            target_workgroups: self.target_workgroups.unwrap_or(base.target_workgroups),
            coalesced_adds: (base.coalesced_adds || self.coalesced) && !self.scattered,
            coop_backward: self.coop_bwd.unwrap_or(base.coop_backward),
            // Without a choice: the quad loop where the shape allows it and the adapter's
            // default has it, else the scalar loop.
            main_loop: self.main_loop.unwrap_or(
                if base.main_loop == MainLoop::Quad && self.tk == 2 * self.wg {
                    MainLoop::Quad
                } else {
                    MainLoop::Scalar
                },
            ),
            ..base
        }
    }

    fn name(&self) -> String {
        let mut n = format!("{}:{}", self.wg, self.tk);
        if self.checked {
            n += ":checked";
        }
        match (self.coop, self.coop_tile) {
            (Some(true), Some(t)) => {
                n += ":";
                n += t.name();
            }
            (Some(true), None) => n += ":coop",
            (Some(false), _) => n += ":fma",
            (None, _) => {}
        }
        if let Some(ml) = self.main_loop {
            n += ":";
            n += ml.name();
        }
        if let Some(w) = self.target_workgroups {
            n += &format!(":w{w}");
        }
        if self.deterministic {
            n += ":det";
        }
        if self.scattered {
            n += ":noco";
        }
        if self.coalesced {
            n += ":co";
        }
        match self.coop_bwd {
            Some(false) => n += ":fmabwd",
            Some(true) => n += ":coopbwd",
            None => {}
        }
        n
    }
}

fn parse() -> Result<Args, String> {
    let cli = <Cli as clap::Parser>::parse();
    let list = |s: &str| s.split(',').map(String::from).collect::<Vec<_>>();
    let configs = match &cli.configs {
        None => vec![],
        Some(c) => c
            .split(',')
            .map(ConfigSpec::parse)
            .collect::<Result<Vec<_>, String>>()?,
    };
    let shapes = list(&cli.shapes);
    for s in &shapes {
        shape(s)?;
    }
    Ok(Args {
        shapes,
        data: list(&cli.data),
        reps: cli.reps,
        deadline_s: cli.deadline_s,
        dtype: cli
            .dtype
            .parse()
            .map_err(|e| format!("--dtype {:?}: {e}", cli.dtype))?,
        peak: cli.peak_tflops,
        exact: cli.exact,
        ab: cli.ab,
        adapter_report: cli.adapter_report,
        softcap: cli.softcap,
        target_workgroups: cli.target_workgroups,
        out: cli.out,
        configs,
        profile: cli.profile,
        forward_only: cli.forward_only,
    })
}

fn shape(name: &str) -> Result<(usize, usize, usize), String> {
    Ok(match name {
        "gemma2" => (8192, 2304, 256000),
        "seed" => (32768, 4096, 256000),
        "llama3" => (8192, 4096, 128256),
        "small" => (2048, 1024, 32000),
        other => {
            let v = other
                .split('x')
                .map(|x| x.parse::<usize>())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("shape {other:?}: {e}"))?;
            match v[..] {
                [n, d, v] => (n, d, v),
                _ => return Err(format!("shape {other:?}: want a name or NxDxV")),
            }
        }
    })
}

/// `n` normals times `scale` as bf16/f16/f32, generated on all cores (xorshift + Box-Muller).
fn normals(n: usize, scale: f32, dtype: DType, seed: u64) -> HostTensor {
    let threads = std::thread::available_parallelism().map_or(8, |x| x.get());
    let chunk = n.div_ceil(threads).max(1);
    let mut vals = vec![0f32; n];
    std::thread::scope(|s| {
        for (k, part) in vals.chunks_mut(chunk).enumerate() {
            s.spawn(move || {
                let mut x = (seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (k as u64 + 1) << 20) | 1;
                let mut u = || {
                    x ^= x >> 12;
                    x ^= x << 25;
                    x ^= x >> 27;
                    ((x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 + 0.5)
                        / (1u64 << 53) as f64
                };
                for pair in part.chunks_mut(2) {
                    let (a, b) = (u(), u());
                    let r = (-2.0 * a.ln()).sqrt();
                    let t = std::f64::consts::TAU * b;
                    pair[0] = (r * t.cos()) as f32 * scale;
                    if pair.len() > 1 {
                        pair[1] = (r * t.sin()) as f32 * scale;
                    }
                }
            });
        }
    });
    HostTensor::from_f32(vec![n], &vals, dtype).unwrap()
}

fn sync_ms(b: &WgpuBackend, f: impl FnOnce()) -> f64 {
    b.synchronize().unwrap();
    let t = Instant::now();
    f();
    b.synchronize().unwrap();
    t.elapsed().as_secs_f64() * 1e3
}

/// CPU time of this process (user + system, all threads) in ms, from /proc/self/stat
/// (`None` where it cannot be read).
fn process_cpu_ms() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces) start at field 3.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    // Linux reports in USER_HZ, 100 on every supported architecture.
    Some(ticks * 10.0)
}

/// Wall and process CPU ms of `f`, synchronized before and after.
fn timed(b: &WgpuBackend, f: impl FnOnce()) -> (f64, f64) {
    b.synchronize().unwrap();
    let c0 = process_cpu_ms().unwrap_or(f64::NAN);
    let ms = sync_ms(b, f);
    (ms, process_cpu_ms().unwrap_or(f64::NAN) - c0)
}

/// `--ab`: the configs of `--configs` timed in alternation, forward then forward+backward.
fn ab(
    b: &WgpuBackend,
    args: &Args,
    start: Instant,
    inputs: &Inputs<'_, cut_cross_entropy::cce_wgpu::WgpuTensor>,
    opts: &Options,
    label: &str,
) {
    let backends: Vec<(String, WgpuBackend, Options)> = args
        .configs
        .iter()
        .filter_map(|spec| {
            let name = spec.name();
            let o = Options {
                deterministic: spec.deterministic || opts.deterministic,
                ..opts.clone()
            };
            match b.with_config(spec.apply(b.config())) {
                Ok(bc) => Some((name, bc, o)),
                Err(e) => {
                    println!("  config {name}: {e}");
                    None
                }
            }
        })
        .collect();
    // The latest forward output of each config (lse [N] and the loss stay on the device
    // until the comparison reads them back).
    let outs: RefCell<Vec<Option<ForwardOutput<WgpuTensor>>>> =
        RefCell::new((0..backends.len()).map(|_| None).collect());
    // The latest forward+backward output of each config (loss, d_e, d_c on the device).
    let grads: RefCell<Vec<Option<FwdBwd>>> =
        RefCell::new((0..backends.len()).map(|_| None).collect());
    let passes: [(&str, Call<'_>); 2] = [
        ("forward", &|k: usize, bc: &WgpuBackend, o: &Options| {
            let out = bc.forward(inputs, o).unwrap();
            outs.borrow_mut()[k] = Some(out);
        }),
        ("fwd+bwd", &|k: usize, bc: &WgpuBackend, o: &Options| {
            let (f, g) = bc
                .forward_backward(inputs, o, &Upstream::default())
                .unwrap();
            grads.borrow_mut()[k] = Some((f.loss, g.d_e, g.d_c));
        }),
    ];
    for (pass, call) in passes {
        if args.forward_only && pass != "forward" {
            continue;
        }
        if args.deadline_s - start.elapsed().as_secs_f64() < 10.0 {
            println!("| {label} | {pass} | skipped, deadline |");
            continue;
        }
        let mut wall = vec![Vec::new(); backends.len()];
        let mut cpu = vec![Vec::new(); backends.len()];
        for r in 0..=args.reps {
            let round = Instant::now();
            for (k, (name, bc, o)) in backends.iter().enumerate() {
                let (w, c) = timed(bc, || call(k, bc, o));
                println!("  {pass} {name} round {r}: {w:.1} ms wall, {c:.0} ms cpu");
                if r > 0 {
                    wall[k].push(w);
                    cpu[k].push(c);
                }
            }
            // Another round (and the other pass) must fit the deadline; the warm-up round,
            // which compiles the pipelines, does not predict the others.
            let left = args.deadline_s - start.elapsed().as_secs_f64();
            if left < 5.0 || (r > 0 && left < 3.0 * round.elapsed().as_secs_f64() + 5.0) {
                println!("  {pass}: deadline after round {r}");
                break;
            }
        }
        if wall.iter().any(|w| w.is_empty()) {
            println!("| {label} | {pass} | only the warm-up round fitted the deadline |");
            continue;
        }
        let (w0, c0) = (median(wall[0].clone()), median(cpu[0].clone()));
        for (k, (name, _, _)) in backends.iter().enumerate() {
            let (w, c) = (median(wall[k].clone()), median(cpu[k].clone()));
            println!(
                "| {label} | {pass} | {name} | {w:.1} ms wall ({:.3}x) | {c:.0} ms cpu ({:.3}x) | median of {} |",
                w / w0,
                c / c0,
                wall[k].len()
            );
        }
        if pass == "forward" {
            compare_forwards(b, &backends, &outs.borrow(), label);
        } else {
            compare_grads(b, &backends, &grads.borrow(), label);
        }
        if args.profile {
            profile(&backends, label, pass, call, args, start);
        }
    }
}

/// A forward+backward's loss, d_e and d_c, kept on the device for [`compare_grads`].
type FwdBwd = (WgpuTensor, Option<WgpuTensor>, Option<WgpuTensor>);

/// `--ab`: each config's loss from its latest forward+backward, and the largest |Δ| of its d_e
/// and d_c against the first config's (with the largest |value| of the first's, for scale);
/// one read-back of each gradient per config.
fn compare_grads(
    b: &WgpuBackend,
    backends: &[(String, WgpuBackend, Options)],
    outs: &[Option<FwdBwd>],
    label: &str,
) {
    let read = |t: &Option<WgpuTensor>| -> Option<Vec<f32>> {
        t.as_ref()
            .and_then(|t| b.download(t).ok())
            .map(|h| h.to_f32_vec())
    };
    // Largest |a − r| (NaN counted apart), its index, and the largest |r|.
    let diff = |a: &[f32], r: &[f32]| {
        let (mut worst, mut at, mut nan, mut scale) = (0f32, 0usize, 0usize, 0f32);
        for (i, (x, y)) in a.iter().zip(r).enumerate() {
            scale = scale.max(y.abs());
            let d = (x - y).abs();
            if d.is_nan() {
                nan += 1;
            } else if d > worst {
                (worst, at) = (d, i);
            }
        }
        format!(
            "{worst:.3e} (at {at}; max |ref| {scale:.3e}{})",
            if nan > 0 {
                format!(", {nan} NaN")
            } else {
                String::new()
            }
        )
    };
    let mut first: Option<(Vec<f32>, Vec<f32>)> = None;
    for ((name, _, _), out) in backends.iter().zip(outs) {
        let Some((loss, de, dc)) = out else {
            println!("| {label} | fwd+bwd grads | {name} | no forward+backward ran |");
            continue;
        };
        let loss = b.download(loss).map(|h| h.to_f32_vec()).unwrap_or_default();
        let loss_v = loss.iter().map(|&x| x as f64).sum::<f64>() / loss.len().max(1) as f64;
        let (de, dc) = (read(de).unwrap_or_default(), read(dc).unwrap_or_default());
        let vs = match &first {
            None => {
                first = Some((de, dc));
                "reference".to_string()
            }
            Some((de0, dc0)) => format!(
                "max |Δ d_e| {} | max |Δ d_c| {}",
                diff(&de, de0),
                diff(&dc, dc0)
            ),
        };
        println!("| {label} | fwd+bwd grads | {name} | loss {loss_v:.7} | {vs} |");
    }
}

/// A call of one `--ab` pass: (config index, backend, options).
type Call<'a> = &'a dyn Fn(usize, &WgpuBackend, &Options);

/// `--ab`: each config's loss from its latest forward, and the largest |Δ| of its lse over all
/// rows (and the row where it occurs) against the first config's (one read-back of the lse
/// and the loss per config).
fn compare_forwards(
    b: &WgpuBackend,
    backends: &[(String, WgpuBackend, Options)],
    outs: &[Option<ForwardOutput<WgpuTensor>>],
    label: &str,
) {
    let read = |t: &WgpuTensor| b.download(t).map(|h| h.to_f32_vec());
    let mut first: Option<Vec<f32>> = None;
    for ((name, _, _), out) in backends.iter().zip(outs) {
        let Some(out) = out else {
            println!("| {label} | forward loss | {name} | no forward ran |");
            continue;
        };
        let (loss, lse) = match (read(&out.loss), read(&out.lse)) {
            (Ok(l), Ok(z)) => (l, z),
            (Err(e), _) | (_, Err(e)) => {
                println!("| {label} | forward loss | {name} | read-back failed: {e} |");
                continue;
            }
        };
        // Mean/sum: the scalar; reduction none: the mean of the per-row losses.
        let loss_v = loss.iter().map(|&x| x as f64).sum::<f64>() / loss.len().max(1) as f64;
        let vs = match &first {
            None => {
                first = Some(lse.clone());
                "reference".to_string()
            }
            Some(z0) => {
                let (mut worst, mut at, mut bad) = (0f32, 0usize, 0usize);
                for (i, (a, r)) in lse.iter().zip(z0).enumerate() {
                    let d = (a - r).abs();
                    if d.is_nan() {
                        bad += 1;
                    } else if d > worst {
                        (worst, at) = (d, i);
                    }
                }
                format!(
                    "max |Δ lse| {worst:.3e} (row {at}, lse {:.6}){}",
                    z0.get(at).copied().unwrap_or(f32::NAN),
                    if bad > 0 {
                        format!(", {bad} rows NaN")
                    } else {
                        String::new()
                    }
                )
            }
        };
        println!("| {label} | forward loss | {name} | loss {loss_v:.7} | {vs} |");
    }
}

/// `--profile`: one call of `call` per config with GPU timestamps, printed per shader.
fn profile(
    backends: &[(String, WgpuBackend, Options)],
    label: &str,
    pass: &str,
    call: Call<'_>,
    args: &Args,
    start: Instant,
) {
    for (k, (name, bc, o)) in backends.iter().enumerate() {
        if args.deadline_s - start.elapsed().as_secs_f64() < 10.0 {
            println!("  profile {pass} {name}: skipped, deadline");
            continue;
        }
        if !bc.set_profiling(true) {
            println!("  profile: the adapter offers no TIMESTAMP_QUERY");
            return;
        }
        let _ = bc.take_pass_times();
        let ms = sync_ms(bc, || call(k, bc, o));
        let times = bc.take_pass_times();
        bc.set_profiling(false);
        match times {
            Ok((times, dropped)) => {
                let gpu: f64 = times.iter().map(|t| t.ms).sum();
                let parts: Vec<String> = times
                    .iter()
                    .map(|t| format!("{} {:.1} ms ({}x)", t.label, t.ms, t.count))
                    .collect();
                println!(
                    "| {label} | {pass} profile | {name} | {ms:.1} ms wall, {gpu:.1} ms GPU | {} |{}",
                    parts.join(", "),
                    if dropped > 0 {
                        format!(" {dropped} pairs not recorded |")
                    } else {
                        String::new()
                    }
                );
            }
            Err(e) => println!("  profile {pass} {name}: {e}"),
        }
    }
}

/// A rate in FLOP/s as text: TFLOP/s, or GFLOP/s below 1 TFLOP/s.
fn rate(flop_per_s: f64) -> String {
    if flop_per_s >= 1e12 {
        format!("{:.2} TFLOP/s", flop_per_s / 1e12)
    } else {
        format!("{:.3} GFLOP/s", flop_per_s / 1e9)
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("cce-bench-wgpu: {e}");
            std::process::exit(2);
        }
    };
    let start = Instant::now();
    let mut b = WgpuBackend::new().expect("wgpu backend");
    if args.adapter_report {
        print!("{}", b.adapter_report());
        return;
    }
    if let Some(tw) = args.target_workgroups {
        let cfg = cut_cross_entropy::cce_wgpu::KernelConfig {
            target_workgroups: tw,
            ..b.config()
        };
        b = b.with_config(cfg).expect("--target-workgroups");
    }
    let mut tuned = args.configs.is_empty();
    let info = b.adapter_info();
    println!(
        "adapter: {} ({:?}, driver {} {}), config {:?}",
        info.name,
        info.backend,
        info.driver,
        info.driver_info,
        b.config()
    );
    let mut out = args
        .out
        .as_ref()
        .map(|p| std::fs::File::create(p).expect("out file"));
    let mut table = Vec::new();
    for sname in &args.shapes {
        let (n, d, v) = shape(sname).expect("shapes are checked by parse()");
        let gemm = 2.0 * n as f64 * v as f64 * d as f64;
        for data in &args.data {
            let left = args.deadline_s - start.elapsed().as_secs_f64();
            if left < 5.0 {
                println!("{sname} {data}: skipped, deadline");
                continue;
            }
            let tg = Instant::now();
            let (e, c, yt) = if data == "randn" || data == "c/8" {
                // Cheap inputs straight in the benchmark dtype (no f32 copy of c kept).
                let c_scale = if data == "c/8" { 0.125 } else { 1.0 };
                let e = normals(n * d, 1.0, args.dtype, 1)
                    .reshape(vec![n, d])
                    .unwrap();
                let c = normals(v * d, c_scale, args.dtype, 2)
                    .reshape(vec![v, d])
                    .unwrap();
                let mut y = 0x1234_5678u64;
                let targets: Vec<i32> = (0..n)
                    .map(|_| {
                        y ^= y << 13;
                        y ^= y >> 7;
                        y ^= y << 17;
                        (y % v as u64) as i32
                    })
                    .collect();
                (
                    e,
                    c,
                    HostTensor::new(vec![n], HostData::I32(targets)).unwrap(),
                )
            } else {
                // cce-data generators (lm, iid, e*8, ...): targets sampled from the softmax on
                // the CPU (one N x V x D pass).
                let dist: cce_data::Distribution = data.parse().expect("distribution");
                let ds = cce_data::generate(&dist, n, d, v, 7).expect("generate");
                (
                    HostTensor::from_f32(vec![n, d], &ds.e, args.dtype).unwrap(),
                    HostTensor::from_f32(vec![v, d], &ds.c, args.dtype).unwrap(),
                    HostTensor::from_i64(ds.targets),
                )
            };
            let (eb, cb, ybuf) = (
                b.upload(&e).unwrap(),
                b.upload(&c).unwrap(),
                b.upload(&yt).unwrap(),
            );
            drop((e, c));
            b.synchronize().unwrap();
            println!(
                "{sname} {n}x{d}x{v} {data} {}: data ready in {:.1} s",
                args.dtype,
                tg.elapsed().as_secs_f64()
            );
            let inputs = Inputs {
                e: &eb,
                c: &cb,
                bias: None,
                targets: &ybuf,
            };
            let opts = Options {
                softcap: args.softcap,
                ..if args.exact {
                    Options::exact()
                } else {
                    Options::default()
                }
            };
            if args.ab {
                ab(
                    &b,
                    &args,
                    start,
                    &inputs,
                    &opts,
                    &format!("{sname} {n}x{d}x{v} {data}"),
                );
                continue;
            }
            if !tuned {
                tuned = true;
                let mut best = (f64::MAX, b.config());
                for spec in &args.configs {
                    let cfg = spec.apply(b.config());
                    let name = spec.name();
                    let Ok(bc) = b.with_config(cfg) else {
                        println!("  config {name}: not supported here");
                        continue;
                    };
                    let mut t = f64::MAX;
                    for _ in 0..2 {
                        t = sync_ms(&bc, || {
                            bc.forward(&inputs, &opts).unwrap();
                        });
                    }
                    println!("  config {name}: forward {t:.1} ms");
                    table.push(format!(
                        "| {sname} | {data} | forward, config {name} | {t:.1} ms | {} | | tuning |",
                        rate(gemm / (t * 1e-3))
                    ));
                    if t < best.0 {
                        best = (t, cfg);
                    }
                }
                b = b.with_config(best.1).unwrap();
                println!("  using {:?}", b.config());
            }
            let mode = if args.exact { "exact" } else { "filtered" };
            // Forward.
            let mut fwd_ms = Vec::new();
            let mut lse = None;
            for r in 0..=args.reps {
                let ms = sync_ms(&b, || {
                    lse = Some(b.forward(&inputs, &opts).unwrap().lse);
                });
                println!("  forward rep {r}: {ms:.1} ms");
                if r > 0 {
                    fwd_ms.push(ms);
                }
                if args.deadline_s - start.elapsed().as_secs_f64() < 4.0 * ms / 1e3 + 10.0 {
                    break;
                }
            }
            if fwd_ms.is_empty() {
                println!("  forward: only the warm-up fitted the deadline");
                continue;
            }
            let f_ms = median(fwd_ms.clone());
            let f_rate = gemm / (f_ms * 1e-3) / 1e12;
            let row = format!(
                "| {sname} {n}x{d}x{v} | {data} | forward | {f_ms:.1} ms | {} | {:.1}% | 1 GEMM |",
                rate(f_rate * 1e12),
                100.0 * f_rate / args.peak
            );
            println!("{row}");
            table.push(row);
            let cfg = b.config();
            let json_head = format!(
                "{{\"shape\":\"{sname}\",\"n\":{n},\"d\":{d},\"v\":{v},\"data\":\"{data}\",\"dtype\":\"{}\",\"mode\":\"{mode}\",\"softcap\":{},\"config\":\"{}:{}{}{}\",\"target_workgroups\":{},\"forward_ms\":{f_ms:.3},\"forward_tflops\":{f_rate:.3}",
                args.dtype,
                args.softcap.map_or("null".into(), |s| s.to_string()),
                cfg.wg,
                cfg.tk,
                if cfg.runtime_checks { ":checked" } else { "" },
                if cfg.cooperative_matrix {
                    format!(":{}", cfg.coop_tile.name())
                } else {
                    String::new()
                },
                cfg.target_workgroups,
            );
            // Forward + backward.
            let left = args.deadline_s - start.elapsed().as_secs_f64();
            if left < 6.0 * f_ms / 1e3 + 10.0 {
                println!("  forward+backward: skipped, deadline");
                if let Some(f) = out.as_mut() {
                    writeln!(f, "{json_head}}}").unwrap();
                }
                continue;
            }
            let mut fb_ms = Vec::new();
            let mut stats = None;
            for r in 0..=args.reps {
                let ms = sync_ms(&b, || {
                    let (_, g) = b
                        .forward_backward(&inputs, &opts, &Upstream::default())
                        .unwrap();
                    stats = Some(g.stats);
                });
                println!("  forward+backward rep {r}: {ms:.1} ms");
                if r > 0 {
                    fb_ms.push(ms);
                }
                if args.deadline_s - start.elapsed().as_secs_f64() < 2.0 * ms / 1e3 + 5.0 {
                    break;
                }
            }
            let st = stats.unwrap();
            println!("{st}");
            if fb_ms.is_empty() {
                println!("  forward+backward: only the warm-up fitted the deadline");
                if let Some(f) = out.as_mut() {
                    writeln!(f, "{json_head}}}").unwrap();
                }
                continue;
            }
            let fb = median(fb_ms);
            let t_all = (st.tiles_visited + st.tiles_skipped).max(1) as f64;
            let kept = st.tiles_visited as f64 / t_all;
            let threshold_pass = if st.filter_eps > 0.0 { 1.0 } else { 0.0 };
            let kept = if st.filter_eps > 0.0 { kept } else { 1.0 };
            let executed = gemm * (1.0 + threshold_pass + 4.0 * kept);
            let floor_rate = 3.0 * gemm / (fb * 1e-3) / 1e12;
            let exec_rate = executed / (fb * 1e-3) / 1e12;
            let row = format!(
                "| {sname} {n}x{d}x{v} | {data} | fwd+bwd {mode} | {fb:.1} ms | {} executed ({:.1}% of peak); floor rate {} | {:.1}% | {:.0}% tiles kept, dropped mass max {:.1e} |",
                rate(exec_rate * 1e12),
                100.0 * exec_rate / args.peak,
                rate(floor_rate * 1e12),
                100.0 * floor_rate / args.peak,
                100.0 * kept,
                st.dropped_mass_max
            );
            println!("{row}");
            table.push(row);
            if let Some(f) = out.as_mut() {
                writeln!(
                    f,
                    "{json_head},\"fwd_bwd_ms\":{fb:.3},\"tiles_kept\":{kept:.4},\"dropped_mass_max\":{:.3e},\"fwd_bwd_exec_tflops\":{exec_rate:.3},\"fwd_bwd_floor_tflops\":{floor_rate:.3}}}",
                    st.dropped_mass_max
                )
                .unwrap();
            }
            let _ = lse.map(|l| l.numel());
        }
    }
    println!(
        "\n| shape | data | pass | time (median) | rate | % of {} TFLOP/s | notes |",
        args.peak
    );
    println!("|---|---|---|---|---|---|---|");
    for r in &table {
        println!("{r}");
    }
}
