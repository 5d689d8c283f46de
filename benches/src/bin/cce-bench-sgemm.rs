//! Reference SGEMM on the wgpu adapter (issue 21): does a textbook register-tiled WGSL SGEMM
//! reach a useful share of the fp32 peak through this driver, and how do cce-wgpu's own logits
//! main loops (softmax epilogue replaced by a plain store) compare on the same adapter?
//! `C = A·Bᵀ`, `A` `[m, k]`, `B` `[n, k]` (the logits GEMM's layout), f32 accumulation; the
//! kernels and their variant names are in `cce_benches::sgemm`.
//!
//! ```text
//! cce-bench-sgemm [--shapes 4096x4096x4096,8192x8192x2304] [--variants t128r8k8,ours-named,..]
//!                 [--warmup 2] [--reps 7] [--check 256x256x256,200x136x72]
//!                 [--dump-spirv DIR] [--spirv-only] [--out results.jsonl] [--peak-tflops 67]
//!                 [--deadline-s 100]
//! ```
//! Order: SPIR-V of every variant written to `--dump-spirv` and scanned (naga here, no device
//! needed); every variant built and checked against the f64 product on each `--check` shape
//! (all entries; a variant that fails is not timed; shapes a variant does not take are
//! skipped); then per shape fresh inputs, and per variant `--warmup` dispatches and `--reps`
//! timed ones (GPU timestamps around each compute pass where the adapter has
//! `TIMESTAMP_QUERY`, else wall time of a submit-and-wait), the median reported as TFLOP/s
//! (`2·m·n·k` per dispatch) and share of `--peak-tflops`, followed by a check of 256 sampled
//! entries of the timed output. The table prints last.

use cce_benches::sgemm::{gpu, host, spirv, Dtype, Variant};
use std::io::Write;
use std::time::Instant;

/// The variants of issue 21's experiment (`cce_benches::sgemm::Variant::parse` names).
const DEFAULT_VARIANTS: &str = "t128r8k8,t128r8k8n,t128r8k8u,t128r8k16,t128r8k8:checked,\
t64r8k8,t64r4k16,t64r4k8,ours-scalar,ours-named,ours-quad,ours-named:checked,t128r8k16:bf16,\
t128r8k16nu:bf16,ours-named:bf16";

/// Command line (formats in the module docs).
#[derive(clap::Parser, Debug)]
#[command(
    name = "cce-bench-sgemm",
    about = "Reference SGEMM on the wgpu adapter"
)]
struct Cli {
    /// Timed shapes, comma list of MxNxK.
    #[arg(long, default_value = "4096x4096x4096,8192x8192x2304")]
    shapes: String,
    /// Variants, comma list: `t{tile}r{micro}k{bk}[n][u]` or `ours-scalar|ours-named|ours-quad`,
    /// each with optional :checked and :bf16.
    #[arg(long, default_value = DEFAULT_VARIANTS)]
    variants: String,
    /// Untimed dispatches before the timed ones.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Timed dispatches per variant and shape.
    #[arg(long, default_value_t = 7)]
    reps: usize,
    /// Shapes checked entry by entry before any timing, comma list of MxNxK ("" for none).
    #[arg(long, default_value = "256x256x256,200x136x72")]
    check: String,
    /// Write each variant's SPIR-V (as naga emits it for Vulkan 1.3) into this directory.
    #[arg(long)]
    dump_spirv: Option<String>,
    /// Stop after the SPIR-V (no device needed).
    #[arg(long)]
    spirv_only: bool,
    /// Append JSON lines to this file.
    #[arg(long)]
    out: Option<String>,
    /// fp32 FMA peak of the device in TFLOP/s (67 for the H200).
    #[arg(long, default_value_t = 67.0)]
    peak_tflops: f64,
    /// Start no timing after this many seconds.
    #[arg(long, default_value_t = 100.0)]
    deadline_s: f64,
    /// Forward-pass variants (`cce_benches::sgemm::fwd`), comma list of
    /// `fwd-{real|nowrite|loopwg|loop}[:scalar][:t1][:f32]`, `fwd-real[..]:padN` ("" for none).
    #[arg(long, default_value = "")]
    fwd_variants: String,
    /// Chunks the forward variants are timed on, comma list of ROWSxCLASSESxD.
    #[arg(long, default_value = "8192x29120x2304,8192x8192x2304")]
    fwd_shapes: String,
    /// Workgroups the forward variants' split aims for (cce-wgpu's `target_workgroups`).
    #[arg(long, default_value_t = 2048)]
    fwd_target_workgroups: u32,
    /// Chunks every forward variant is checked on (all rows) before timing.
    #[arg(long, default_value = "200x300x72,70x136x264")]
    fwd_check: String,
    /// Ablations of the backward's d_e and d_c passes (`cce_benches::sgemm::bwd`), comma list
    /// of `bwd-{real|noslab|noprod|slab4|atomic}[:f32][:wN][:tN]` (d_e),
    /// `dc-{real|noslab|noprod|nobias|slab4|atomic}[:f32][:wN][:tN]` (d_c) ("" for none);
    /// `:tN` launches that variant for N target workgroups instead of
    /// `--fwd-target-workgroups`.
    #[arg(long, default_value = "")]
    bwd_variants: String,
    /// Chunks the backward variants are timed on, comma list of ROWSxCLASSESxD (not checked: the
    /// f64 reference of a whole chunk's d_e row is the check's, on `--bwd-check`).
    #[arg(long, default_value = "8192x29120x2304")]
    bwd_shapes: String,
    /// Chunks every backward variant is checked on (all rows of d_e, all classes of d_c)
    /// before timing.
    #[arg(long, default_value = "70x300x136")]
    bwd_check: String,
}

fn shapes(list: &str) -> Result<Vec<(u32, u32, u32)>, String> {
    list.split(',')
        .filter(|s| !s.is_empty())
        .map(|s| {
            let d: Vec<u32> = s
                .split('x')
                .map(|x| x.parse().map_err(|e| format!("shape {s:?}: {e}")))
                .collect::<Result<_, _>>()?;
            match d[..] {
                [m, n, k] if m > 0 && n > 0 && k > 0 => Ok((m, n, k)),
                _ => Err(format!("shape {s:?}: want MxNxK, all positive")),
            }
        })
        .collect()
}

/// One row of the table.
struct Row {
    shape: (u32, u32, u32),
    name: String,
    result: Result<(f64, f64, f64), String>,
}

fn main() {
    use clap::Parser;
    let cli = Cli::parse();
    if let Err(e) = run(&cli) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run(cli: &Cli) -> Result<(), String> {
    let variants: Vec<Variant> = cli
        .variants
        .split(',')
        .filter(|s| !s.is_empty())
        .map(Variant::parse)
        .collect::<Result<_, _>>()?;
    let timed = shapes(&cli.shapes)?;
    let checks = shapes(&cli.check)?;
    if let Some(dir) = &cli.dump_spirv {
        std::fs::create_dir_all(dir).map_err(|e| format!("{dir}: {e}"))?;
        for v in &variants {
            let words = spirv::words(*v, (1, 6))?;
            let path =
                std::path::Path::new(dir).join(format!("{}.spv", v.name().replace(':', "_")));
            spirv::write(&path, &words).map_err(|e| format!("{}: {e}", path.display()))?;
            println!("spirv {}: {}", v.name(), spirv::scan(&words)?);
        }
    }
    if cli.spirv_only {
        return Ok(());
    }
    let start = Instant::now();
    let g = gpu::Gpu::open()?;
    println!(
        "adapter: {} ({:?}, {:?}, driver {} {}), timestamps: {}, workgroup memory {} B",
        g.info.name,
        g.info.device_type,
        g.info.backend,
        g.info.driver,
        g.info.driver_info,
        g.timestamps,
        g.limits.max_compute_workgroup_storage_size
    );
    let mut built = Vec::new();
    let mut rows = Vec::new();
    for &v in &variants {
        match g.build(v) {
            Ok(b) => {
                println!("built {} in {:.2} s", v.name(), b.build_s);
                built.push(b);
            }
            Err(e) => {
                println!("not built: {e}");
                for &s in &timed {
                    rows.push(Row {
                        shape: s,
                        name: v.name(),
                        result: Err("not built".into()),
                    });
                }
            }
        }
    }
    // Correctness first, entry by entry, fresh inputs per variant and shape.
    let mut failed = std::collections::HashSet::new();
    for (si, &(m, n, k)) in checks.iter().enumerate() {
        for (vi, b) in built.iter().enumerate() {
            let v = b.variant;
            if v.problem_error(m, n, k).is_some() {
                println!("check {m}x{n}x{k} {}: skipped (shape not taken)", v.name());
                continue;
            }
            let seed = (1000 * si + vi) as u64;
            let out = check_once(&g, b, (m, n, k), seed, usize::MAX);
            match out {
                Ok((err, tol)) if err <= tol => {
                    println!(
                        "check {m}x{n}x{k} {}: ok (error {err:.2e} <= {tol:.1e})",
                        v.name()
                    )
                }
                Ok((err, tol)) => {
                    println!(
                        "check {m}x{n}x{k} {}: FAIL (error {err:.2e} > {tol:.1e})",
                        v.name()
                    );
                    failed.insert(v.name());
                }
                Err(e) => {
                    println!("check {m}x{n}x{k} {}: FAIL ({e})", v.name());
                    failed.insert(v.name());
                }
            }
        }
    }
    let mut jsonl = match &cli.out {
        Some(p) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .map_err(|e| format!("{p}: {e}"))?,
        ),
        None => None,
    };
    for &(m, n, k) in &timed {
        let (mu, nu, ku) = (m as usize, n as usize, k as usize);
        let t0 = Instant::now();
        let (av, bv) = (host::uniform(mu * ku, 7), host::uniform(nu * ku, 8));
        let c = g.output(mu * nu)?;
        let mut inputs: Vec<(
            Dtype,
            host::Operand,
            host::Operand,
            wgpu::Buffer,
            wgpu::Buffer,
        )> = Vec::new();
        for dtype in [Dtype::F32, Dtype::Bf16] {
            if built.iter().any(|b| b.variant.dtype == dtype) {
                let (a, b) = (host::operand(&av, dtype), host::operand(&bv, dtype));
                let (ab, bb) = (g.upload("a", &a.bytes)?, g.upload("b", &b.bytes)?);
                inputs.push((dtype, a, b, ab, bb));
            }
        }
        drop((av, bv));
        println!(
            "{m}x{n}x{k}: inputs ready in {:.1} s",
            t0.elapsed().as_secs_f64()
        );
        for b in &built {
            let v = b.variant;
            let row = |result| Row {
                shape: (m, n, k),
                name: v.name(),
                result,
            };
            if failed.contains(&v.name()) {
                rows.push(row(Err("failed its check".into())));
                continue;
            }
            if let Some(e) = v.problem_error(m, n, k) {
                rows.push(row(Err(e)));
                continue;
            }
            if start.elapsed().as_secs_f64() > cli.deadline_s {
                rows.push(row(Err("deadline".into())));
                continue;
            }
            let (_, a, bo, ab, bb) = inputs.iter().find(|i| i.0 == v.dtype).unwrap();
            let result = (|| -> Result<(f64, f64, f64), String> {
                let l = g.launch(b, (ab, bb, &c), (m, n, k))?;
                let ms = g.time(&l, cli.warmup, cli.reps)?;
                let med = gpu::median(ms.clone());
                let min = ms.iter().copied().fold(f64::INFINITY, f64::min);
                let out = g.run(&l, &c, mu * nu)?;
                let (err, _) = host::worst_error(
                    &a.values,
                    &bo.values,
                    &out,
                    (nu, ku),
                    host::sample(mu, nu, 256),
                );
                if err > host::tolerance(ku) {
                    return Err(format!("timed output wrong: error {err:.2e}"));
                }
                Ok((med, min, err))
            })();
            match &result {
                Ok((med, _, _)) => println!(
                    "{m}x{n}x{k} {}: {med:.3} ms, {:.2} TFLOP/s",
                    v.name(),
                    2.0 * f64::from(m) * f64::from(n) * f64::from(k) / (med * 1e9)
                ),
                Err(e) => println!("{m}x{n}x{k} {}: {e}", v.name()),
            }
            if let (Some(f), Ok((med, min, err))) = (jsonl.as_mut(), &result) {
                let _ = writeln!(
                    f,
                    "{{\"bench\":\"sgemm\",\"adapter\":{:?},\"shape\":[{m},{n},{k}],\"variant\":{:?},\
                     \"median_ms\":{med},\"min_ms\":{min},\"reps\":{},\"timestamps\":{},\
                     \"tflops\":{},\"sample_error\":{err}}}",
                    g.info.name,
                    v.name(),
                    cli.reps,
                    g.timestamps,
                    2.0 * f64::from(m) * f64::from(n) * f64::from(k) / (med * 1e9)
                );
            }
            rows.push(row(result));
        }
    }
    let fwd_rows = forward(cli, &g, start)?;
    let bwd_rows = backward(cli, &g, start)?;
    println!();
    println!(
        "| shape | variant | median ms | min ms | TFLOP/s | % of {} | sampled error |",
        cli.peak_tflops
    );
    println!("|---|---|---|---|---|---|---|");
    for r in &rows {
        let (m, n, k) = r.shape;
        let flop = 2.0 * f64::from(m) * f64::from(n) * f64::from(k);
        match &r.result {
            Ok((med, min, err)) => {
                let tf = flop / (med * 1e9);
                println!(
                    "| {m}x{n}x{k} | {} | {med:.3} | {min:.3} | {tf:.2} | {:.1}% | {err:.1e} |",
                    r.name,
                    100.0 * tf / cli.peak_tflops
                );
            }
            Err(e) => println!("| {m}x{n}x{k} | {} | - | - | - | - | {e} |", r.name),
        }
    }
    if !fwd_rows.is_empty() {
        println!();
        println!(
            "| forward chunk | variant | grid (splits x row tiles), tiles per split | median ms | min ms | TFLOP/s | % of {} | sampled check (x tolerance) |",
            cli.peak_tflops
        );
        println!("|---|---|---|---|---|---|---|---|");
        for r in &fwd_rows {
            println!("{r}");
        }
    }
    if !bwd_rows.is_empty() {
        println!();
        println!(
            "| d_e chunk | variant | grid (splits x row tiles, or x class tiles for dc-), tiles per split | median ms | min ms | TFLOP/s of the real pass's 2 products | % of {} |",
            cli.peak_tflops
        );
        println!("|---|---|---|---|---|---|---|");
        for r in &bwd_rows {
            println!("{r}");
        }
    }
    Ok(())
}

/// The forward variants (`--fwd-variants`): each built, checked on every `--fwd-check`
/// chunk (all rows), then timed on every `--fwd-shapes` chunk (GPU timestamps around each
/// dispatch, `--warmup` + `--reps`) and checked again on 4 sampled rows. Table rows.
fn forward(cli: &Cli, g: &gpu::Gpu, start: Instant) -> Result<Vec<String>, String> {
    use cce_benches::sgemm::fwd;
    let variants: Vec<fwd::FwdVariant> = cli
        .fwd_variants
        .split(',')
        .filter(|s| !s.is_empty())
        .map(fwd::FwdVariant::parse)
        .collect::<Result<_, _>>()?;
    let built = build_all(&variants, |v| v.name(), |v| fwd::FwdBuilt::new(g, v));
    let mut failed = std::collections::HashSet::new();
    for (si, &shape) in shapes(&cli.fwd_check)?.iter().enumerate() {
        for (vi, b) in built.iter().enumerate() {
            let v = b.variant;
            let res = (|| -> Result<(f64, String), String> {
                let chunk = fwd::Chunk::new(g, shape, v.dtype, (100 * si + vi) as u64)?;
                let l = b.launch(g, &chunk, cli.fwd_target_workgroups.min(8))?;
                let out = l.run(g, shape.0)?;
                let rows: Vec<usize> = (0..shape.0 as usize).collect();
                Ok(fwd::check(v, &chunk, l.splits, &out, &rows))
            })();
            note_check(res, shape, &v.name(), &mut failed);
        }
    }
    let one = |b: &fwd::FwdBuilt, chunk: &fwd::Chunk, name: &str| -> Result<String, String> {
        let (m, n, k) = chunk.shape;
        let l = b.launch(g, chunk, cli.fwd_target_workgroups)?;
        let (med, min, tf) = timed(cli, g, &l.timed)?;
        let out = l.run(g, m)?;
        let at = [0, m as usize / 3, 2 * m as usize / 3, m as usize - 1];
        let (ratio, what) = fwd::check(b.variant, chunk, l.splits, &out, &at);
        println!("{m}x{n}x{k} {name}: {med:.3} ms, {tf:.2} TFLOP/s, check {ratio:.2} ({what})");
        Ok(format!(
            "| {m}x{n}x{k} | {name} | {} x {}, {} | {med:.3} | {min:.3} | {tf:.2} | {:.1}% | {ratio:.2}{} |",
            l.splits.0,
            m.div_ceil(b.variant.shape.tile()),
            l.splits.1,
            100.0 * tf / cli.peak_tflops,
            if ratio <= 1.0 { "" } else { " FAIL" }
        ))
    };
    let variants = built.iter().map(|b| (b.variant.dtype, b.variant.name(), b));
    time_chunks(
        cli,
        (g, start),
        &cli.fwd_shapes,
        variants.collect(),
        &failed,
        5,
        one,
    )
}

/// Each of `variants` built (`build`), with its build time or why it was not built printed;
/// the built ones in order.
fn build_all<V: Copy, B>(
    variants: &[V],
    name: impl Fn(V) -> String,
    build: impl Fn(V) -> Result<B, String>,
) -> Vec<B> {
    let mut built = Vec::new();
    for &v in variants {
        let t = Instant::now();
        match build(v) {
            Ok(b) => {
                println!("built {} in {:.2} s", name(v), t.elapsed().as_secs_f64());
                built.push(b);
            }
            Err(e) => println!("not built: {}: {e}", name(v)),
        }
    }
    built
}

/// Prints a variant's check on one chunk shape (`res`: its worst error as a multiple of the
/// tolerance and where, or why it did not run); a failed variant goes into `failed`.
fn note_check(
    res: Result<(f64, String), String>,
    (m, n, k): (u32, u32, u32),
    name: &str,
    failed: &mut std::collections::HashSet<String>,
) {
    match res {
        Ok((ratio, _)) if ratio <= 1.0 => {
            println!("check {m}x{n}x{k} {name}: ok ({ratio:.2} x tolerance)")
        }
        Ok((ratio, what)) => {
            println!("check {m}x{n}x{k} {name}: FAIL ({ratio:.2} x tolerance at {what})");
            failed.insert(name.to_string());
        }
        Err(e) => {
            println!("check {m}x{n}x{k} {name}: FAIL ({e})");
            failed.insert(name.to_string());
        }
    }
}

/// Median and fastest GPU time of `timed` (`--warmup` + `--reps` dispatches) and the rate of
/// its FLOPs at the median: (ms, ms, TFLOP/s).
fn timed(cli: &Cli, g: &gpu::Gpu, timed: &gpu::Launch) -> Result<(f64, f64, f64), String> {
    let ms = g.time(timed, cli.warmup, cli.reps)?;
    let med = gpu::median(ms.clone());
    let min = ms.iter().copied().fold(f64::INFINITY, f64::min);
    Ok((med, min, timed.flop / (med * 1e9)))
}

/// The timing loop the forward and backward ablations share: per chunk shape of `shape_list`
/// and per dtype some variant needs, one chunk of inputs, then `one(variant, chunk, name)`'s
/// table row for each variant of that dtype (`variants`: dtype, name, variant); a variant that
/// failed its check, one past `--deadline-s`, or one whose run fails gets a row with `blanks`
/// empty columns and the reason.
fn time_chunks<B>(
    cli: &Cli,
    (g, start): (&gpu::Gpu, Instant),
    shape_list: &str,
    variants: Vec<(Dtype, String, &B)>,
    failed: &std::collections::HashSet<String>,
    blanks: usize,
    mut one: impl FnMut(&B, &cce_benches::sgemm::fwd::Chunk, &str) -> Result<String, String>,
) -> Result<Vec<String>, String> {
    use cce_benches::sgemm::fwd;
    let mut rows = Vec::new();
    let empty = "- | ".repeat(blanks);
    for &shape in &shapes(shape_list)? {
        let (m, n, k) = shape;
        for dtype in [Dtype::Bf16, Dtype::F32] {
            if !variants.iter().any(|v| v.0 == dtype) {
                continue;
            }
            let t0 = Instant::now();
            let chunk = fwd::Chunk::new(g, shape, dtype, 7)?;
            println!(
                "{m}x{n}x{k} {}: chunk ready in {:.1} s",
                dtype.name(),
                t0.elapsed().as_secs_f64()
            );
            for (_, name, b) in variants.iter().filter(|v| v.0 == dtype) {
                let why = if failed.contains(name) {
                    Some("failed its check".to_string())
                } else if start.elapsed().as_secs_f64() > cli.deadline_s {
                    Some("deadline".to_string())
                } else {
                    None
                };
                let row = match why {
                    Some(why) => Err(why),
                    None => {
                        one(b, &chunk, name).inspect_err(|e| println!("{m}x{n}x{k} {name}: {e}"))
                    }
                };
                rows.push(row.unwrap_or_else(|e| format!("| {m}x{n}x{k} | {name} | {empty}{e} |")));
            }
        }
    }
    Ok(rows)
}

/// The d_e and d_c variants (`--bwd-variants`): each built, checked on every `--bwd-check`
/// chunk (all rows of d_e, all classes of d_c, f64), then timed on every `--bwd-shapes` chunk (GPU timestamps around each
/// dispatch, `--warmup` + `--reps`). Table rows.
fn backward(cli: &Cli, g: &gpu::Gpu, start: Instant) -> Result<Vec<String>, String> {
    use cce_benches::sgemm::{bwd, fwd};
    let variants: Vec<bwd::BwdVariant> = cli
        .bwd_variants
        .split(',')
        .filter(|s| !s.is_empty())
        .map(bwd::BwdVariant::parse)
        .collect::<Result<_, _>>()?;
    let built = build_all(&variants, |v| v.name(), |v| bwd::BwdBuilt::new(g, v));
    let mut failed = std::collections::HashSet::new();
    for (si, &shape) in shapes(&cli.bwd_check)?.iter().enumerate() {
        for (vi, b) in built.iter().enumerate() {
            let v = b.variant;
            let res = (|| -> Result<(f64, String), String> {
                let chunk = fwd::Chunk::new(g, shape, v.dtype, (100 * si + vi) as u64)?;
                let l = b.launch(g, &chunk, cli.fwd_target_workgroups.min(8))?;
                let slab = l.run(g)?;
                Ok(bwd::check_all(v, &chunk, l.slabs, &slab))
            })();
            note_check(res, shape, &v.name(), &mut failed);
        }
    }
    if built.is_empty() {
        return Ok(Vec::new());
    }
    let one = |b: &bwd::BwdBuilt, chunk: &fwd::Chunk, name: &str| -> Result<String, String> {
        let (m, n, k) = chunk.shape;
        let l = b.launch(g, chunk, cli.fwd_target_workgroups)?;
        let (med, min, tf) = timed(cli, g, &l.timed)?;
        println!("{m}x{n}x{k} {name}: {med:.3} ms, {tf:.2} TFLOP/s (2 products)");
        Ok(format!(
            "| {m}x{n}x{k} | {name} | {} x {}, {} | {med:.3} | {min:.3} | {tf:.2} | {:.1}% |",
            l.splits.0,
            match b.variant.pass {
                bwd::BwdPass::De => m.div_ceil(b.variant.shape.tile()),
                bwd::BwdPass::Dc => n.div_ceil(b.variant.shape.tile()),
            },
            l.splits.1,
            100.0 * tf / cli.peak_tflops
        ))
    };
    let variants = built.iter().map(|b| (b.variant.dtype, b.variant.name(), b));
    time_chunks(
        cli,
        (g, start),
        &cli.bwd_shapes,
        variants.collect(),
        &failed,
        4,
        one,
    )
}

/// Run `b` once on fresh inputs of `m x n x k` and compare with the f64 product (every
/// entry, or `samples` of them): the worst relative error and the tolerance.
fn check_once(
    g: &gpu::Gpu,
    b: &gpu::Built,
    (m, n, k): (u32, u32, u32),
    seed: u64,
    samples: usize,
) -> Result<(f64, f64), String> {
    let (mu, nu, ku) = (m as usize, n as usize, k as usize);
    let dtype = b.variant.dtype;
    let a = host::operand(&host::uniform(mu * ku, 2 * seed + 1), dtype);
    let bo = host::operand(&host::uniform(nu * ku, 2 * seed + 2), dtype);
    let (ab, bb) = (g.upload("a", &a.bytes)?, g.upload("b", &bo.bytes)?);
    let c = g.output(mu * nu)?;
    let l = g.launch(b, (&ab, &bb, &c), (m, n, k))?;
    let out = g.run(&l, &c, mu * nu)?;
    let at = if samples == usize::MAX {
        (0..mu).flat_map(|i| (0..nu).map(move |j| (i, j))).collect()
    } else {
        host::sample(mu, nu, samples)
    };
    let (err, _) = host::worst_error(&a.values, &bo.values, &out, (nu, ku), at);
    Ok((err, host::tolerance(ku)))
}
