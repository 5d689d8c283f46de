//! `cce-bench-dense`: the dense strategies on CUDA ([`cce_core::Strategy::ChunkedDense`],
//! [`cce_core::Strategy::SplitDense`]).
//!
//! - `--mode compile`: compile the kernels into the NVRTC cache (`CCE_CUDA_CACHE_DIR`); no GPU.
//! - `--mode check`: correctness on small shapes against the f64 oracle of `cce-reference`
//!   (and the same-dtype oracle, the conformance rule of MATH.md), both row passes, several
//!   cluster sizes, forward-only / backward-only consistency, determinism, filter bound.
//! - `--mode bench`: per shape, the cuBLAS floor measured in the same run (one bf16 GEMM of the
//!   logits shape with f32 output; the d_e and d_c GEMMs of the full problem), then forward,
//!   forward+backward exact and filtered (randn and c/8 data), CUDA events, median of
//!   `--iters` after `--warmup`; workspace from `cce_core::Plan` with `--budget-gib`.
//!
//! Options (clap; `--help` lists them with their defaults): `--row-pass two-pass|fused|fused-cN` (comma list in bench mode), `--shapes
//! "N,D,V[,softcap[,budget_gib]];..."`, `--iters 5`, `--warmup 2`, `--budget-gib 8`,
//! `--strategy chunked,split,split@4` (bench mode; `@G` sets that strategy's budget in GiB,
//! split dense defaults to 0.5 GiB), `--data randn,c/8,e/8,e/11` (bench mode: e, c ~
//! N(0, 1) with c or e scaled; e/11 gives ~2.5 nats at V = 256000, iid logits over classes).
//! `--grad-f32`: f32 gradients of the bf16 inputs (`d_e`, `d_c` in f32; chunked dense
//! accumulates `d_c` in the output, so it needs no `V·D` f32 accumulator in the workspace).
//! Bench rows report the mean softmax entropy of the data (the forward's side output), the
//! filtered gradients' relative error against exact mode, and the dropped mass.

use cce_core::filter::FilterRule;
use cce_core::plan::{DeviceLimits, Plan, StrategyKind, TileShape};
use cce_core::{DType, FilterEps, HostTensor, Options, Problem, Reduction, SideOutputs};
use cce_cuda::dense::{
    compile_cubin, DenseConfig, DenseDLoss, DenseEngine, DenseForwardOut, DenseGradOut,
    DenseInputs, DenseStats, DenseUpstream, DenseWorkspace, RowPass,
};
use cce_reference::naive::{naive, Oracle, OracleDLoss, Precision};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use std::error::Error;
use std::sync::Arc;
use std::time::Instant;

type Res<T> = std::result::Result<T, Box<dyn Error>>;

#[path = "cce_bench_dense/bench.rs"]
mod bench;
#[path = "cce_bench_dense/check.rs"]
mod check;

/// `(N, D, V, softcap, budget GiB)`.
type Shape = (usize, usize, usize, Option<f32>, Option<f64>);

struct Args {
    mode: String,
    row_pass: Vec<RowPass>,
    shapes: Vec<Shape>,
    iters: usize,
    warmup: usize,
    budget_gib: f64,
    /// Strategy and its budget in GiB (None: the shape's or `--budget-gib`).
    strategies: Vec<(StrategyKind, Option<f64>)>,
    data: Vec<String>,
    /// The backend's switches (`--profile`, `--no-wgmma-*`, ...).
    switches: cce_cuda::CudaSwitches,
    /// f32 gradients (`--grad-f32`): `d_e` and `d_c` in f32, chunked dense accumulating `d_c`
    /// in the output.
    grad_f32: bool,
}

fn parse_row_pass(s: &str) -> Res<RowPass> {
    Ok(match s {
        "two-pass" => RowPass::TwoPass,
        "fused" => RowPass::Fused { cluster: None },
        x if x.starts_with("fused-c") => RowPass::Fused {
            cluster: Some(x["fused-c".len()..].parse()?),
        },
        x => return Err(format!("unknown row pass {x}").into()),
    })
}

fn row_pass_name(r: RowPass) -> String {
    match r {
        RowPass::TwoPass => "two-pass".into(),
        RowPass::Fused { cluster: None } => "fused".into(),
        RowPass::Fused { cluster: Some(c) } => format!("fused-c{c}"),
    }
}

/// Command line (see the module docs for the formats).
#[derive(clap::Parser, Debug)]
#[command(
    name = "cce-bench-dense",
    about = "The dense CUDA strategies: compile, check, bench"
)]
struct Cli {
    /// compile | check | bench.
    #[arg(long, default_value = "check")]
    mode: String,
    /// Row passes, comma list: two-pass, fused, fused-cN.
    #[arg(long, default_value = "two-pass,fused")]
    row_pass: String,
    /// Shapes `N,D,V[,softcap[,budget_gib]]`, separated by semicolons.
    #[arg(
        long,
        default_value = "4096,4096,128256;8192,4096,128256;8192,2304,256000,30;32768,4096,256000"
    )]
    shapes: String,
    /// Timed runs per measurement (median reported).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Untimed runs before them.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Workspace budget in GiB where neither the strategy nor the shape gives one.
    #[arg(long, default_value_t = 8.0)]
    budget_gib: f64,
    /// Strategies, comma list: chunked, split, name@GiB.
    #[arg(long, default_value = "chunked,split")]
    strategy: String,
    /// Data sets, comma list: randn, c/8, e/8, e/11.
    #[arg(long, default_value = "randn,c/8")]
    data: String,
    /// f32 gradients of the bf16 inputs (chunked dense then needs no f32 accumulator).
    #[arg(long)]
    grad_f32: bool,
    #[command(flatten)]
    switches: cce_benches::SwitchArgs,
}

fn parse_args() -> Res<Args> {
    let cli = <Cli as clap::Parser>::parse();
    let shapes = cli
        .shapes
        .split(';')
        .filter(|s| !s.is_empty())
        .map(|s| -> Res<Shape> {
            let f: Vec<&str> = s.split(',').collect();
            if f.len() < 3 {
                return Err(format!("shape {s:?}: want N,D,V[,softcap[,budget_gib]]").into());
            }
            let cap = f
                .get(3)
                .and_then(|x| x.parse::<f32>().ok())
                .filter(|&x| x > 0.0);
            let bud = f.get(4).and_then(|x| x.parse::<f64>().ok());
            Ok((f[0].parse()?, f[1].parse()?, f[2].parse()?, cap, bud))
        })
        .collect::<Res<Vec<_>>>()?;
    let strategies = cli
        .strategy
        .split(',')
        .map(|x| -> Res<(StrategyKind, Option<f64>)> {
            let (name, gib) = match x.split_once('@') {
                Some((a, b)) => (a, Some(b.parse::<f64>()?)),
                None => (x, None),
            };
            match name {
                "chunked" => Ok((StrategyKind::ChunkedDense, gib)),
                // Split dense runs within the default budget unless told.
                "split" => Ok((StrategyKind::SplitDense, gib.or(Some(0.5)))),
                o => Err(format!("unknown strategy {o}").into()),
            }
        })
        .collect::<Res<Vec<_>>>()?;
    Ok(Args {
        mode: cli.mode,
        row_pass: cli
            .row_pass
            .split(',')
            .map(parse_row_pass)
            .collect::<Res<Vec<_>>>()?,
        shapes,
        iters: cli.iters,
        warmup: cli.warmup,
        budget_gib: cli.budget_gib,
        strategies,
        data: cli.data.split(',').map(String::from).collect(),
        switches: cli.switches.switches(),
        grad_f32: cli.grad_f32,
    })
}

fn main() -> Res<()> {
    let args = parse_args()?;
    if args.mode == "compile" {
        let t = Instant::now();
        let cubin = compile_cubin("sm_90a")?;
        println!(
            "compiled the dense kernels for sm_90a: {} bytes in {:.1} s (cache {:?})",
            cubin.len(),
            t.elapsed().as_secs_f64(),
            std::env::var("CCE_CUDA_CACHE_DIR").ok()
        );
        return Ok(());
    }
    let ctx = CudaContext::new(0)?;
    // SAFETY: one stream only; buffers outlive every launch that uses them.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.default_stream();
    let t = Instant::now();
    let engine = DenseEngine::new(stream.clone())?.with_switches(args.switches);
    println!(
        "device {} ({}), engine ready in {:.2} s",
        ctx.name()?,
        engine.arch(),
        t.elapsed().as_secs_f64()
    );
    match args.mode.as_str() {
        "check" => check::check(&engine, &stream),
        "bench" => bench::bench(&engine, &ctx, &stream, &args),
        m => Err(format!("unknown mode {m}").into()),
    }
}

// ------------------------------------------------------------------------------------------------
// Shared helpers
// ------------------------------------------------------------------------------------------------

fn alloc(stream: &Arc<CudaStream>, bytes: usize) -> Res<CudaSlice<u8>> {
    // SAFETY: every buffer is written (filled, poisoned or computed) before it is read.
    Ok(unsafe { stream.alloc::<u8>(bytes.max(4)) }?)
}

fn poisoned(stream: &Arc<CudaStream>, bytes: usize) -> Res<CudaSlice<u8>> {
    let mut s = alloc(stream, bytes)?;
    stream.memcpy_htod(&vec![0xffu8; bytes.max(4)][..], &mut s)?;
    Ok(s)
}

fn download(stream: &Arc<CudaStream>, s: &CudaSlice<u8>, bytes: usize) -> Res<Vec<u8>> {
    let mut host = vec![0u8; s.len()];
    stream.memcpy_dtoh(s, &mut host[..])?;
    stream.synchronize()?;
    host.truncate(bytes);
    Ok(host)
}

fn to_f64(stream: &Arc<CudaStream>, s: &CudaSlice<u8>, dt: DType, n: usize) -> Res<Vec<f64>> {
    let b = download(stream, s, n * dt.size_bytes())?;
    Ok(HostTensor::from_bytes(vec![n], dt, &b)?.to_f64_vec())
}

fn rel_err(x: &[f64], gt: &[f64]) -> f64 {
    let num: f64 = x.iter().zip(gt).map(|(a, b)| (a - b) * (a - b)).sum();
    let den: f64 = gt.iter().map(|b| b * b).sum();
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// Conformance rule (MATH.md): |ours − gt| ≤ |ref − gt| + tol·max|gt|. Returns the number of
/// violations and the count of non-finite values.
fn violations(ours: &[f64], rf: &[f64], gt: &[f64], tol: f64) -> (usize, usize) {
    let scale = gt.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-30);
    let mut bad = 0;
    let mut nonfinite = 0;
    for ((o, r), g) in ours.iter().zip(rf).zip(gt) {
        if !o.is_finite() {
            nonfinite += 1;
        }
        let ok = (o - g).abs() <= (r - g).abs() + tol * scale;
        if !ok {
            bad += 1;
        }
    }
    (bad, nonfinite)
}

fn time_ms(
    stream: &Arc<CudaStream>,
    warmup: usize,
    iters: usize,
    mut f: impl FnMut() -> Res<()>,
) -> Res<(f64, f64)> {
    for _ in 0..warmup {
        f()?;
    }
    stream.synchronize()?;
    let mut v = Vec::with_capacity(iters);
    for _ in 0..iters {
        let a = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        f()?;
        let b = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        v.push(a.elapsed_ms(&b)? as f64);
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Ok((v[v.len() / 2], v[0]))
}

fn cuda_limits(budget_rows_tile: usize, kind: StrategyKind) -> DeviceLimits {
    DeviceLimits {
        name: "cuda".into(),
        max_buffer_bytes: 1 << 40,
        max_block_memory_bytes: 227 << 10,
        max_threads_per_block: 1024,
        max_grid: [i32::MAX as u32, 65535, 65535],
        index_bits: 32,
        tile: TileShape {
            rows: budget_rows_tile,
            classes: 128,
            depth: 64,
        },
        strategies: vec![kind],
        class_forward: true,
    }
}

struct Data {
    e: CudaSlice<u8>,
    c: CudaSlice<u8>,
    bias: Option<CudaSlice<u8>>,
    targets: CudaSlice<u8>,
    n_valid: usize,
}

#[allow(clippy::too_many_arguments)]
fn make_data(
    engine: &DenseEngine,
    (n, d, v): (usize, usize, usize),
    dt: DType,
    seed: u64,
    e_std: f32,
    c_std: f32,
    bias_std: Option<f32>,
    ignore_frac: f32,
) -> Res<Data> {
    let s = engine.stream();
    let mut e = alloc(s, n * d * dt.size_bytes())?;
    let mut c = alloc(s, v * d * dt.size_bytes())?;
    engine.fill_randn(&mut e, dt, n * d, seed, 0.0, e_std)?;
    engine.fill_randn(&mut c, dt, v * d, seed + 1, 0.0, c_std)?;
    let bias = match bias_std {
        Some(sd) => {
            let mut b = alloc(s, v * dt.size_bytes())?;
            engine.fill_randn(&mut b, dt, v, seed + 2, 0.0, sd)?;
            Some(b)
        }
        None => None,
    };
    let mut targets = alloc(s, n * 4)?;
    engine.random_targets(&mut targets, n, v, seed + 3, ignore_frac)?;
    let t = download(s, &targets, n * 4)?;
    let n_valid = bytemuck::cast_slice::<u8, i32>(&t)
        .iter()
        .filter(|&&x| x >= 0)
        .count();
    Ok(Data {
        e,
        c,
        bias,
        targets,
        n_valid,
    })
}

impl Data {
    fn inputs(&self) -> DenseInputs<'_> {
        DenseInputs {
            e: &self.e,
            c: &self.c,
            bias: self.bias.as_ref(),
            targets: &self.targets,
            n_valid: self.n_valid,
            device_status: 0,
        }
    }
}
