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
        "check" => check(&engine, &stream),
        "bench" => bench(&engine, &ctx, &stream, &args),
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

// ------------------------------------------------------------------------------------------------
// check
// ------------------------------------------------------------------------------------------------

struct CheckCase {
    name: &'static str,
    shape: (usize, usize, usize),
    dt: DType,
    chunk_rows: usize,
    bias: bool,
    softcap: Option<f32>,
    ls: f32,
    z_loss: f32,
    reduction: Reduction,
    filter: bool,
    ignore_frac: f32,
    per_row: bool,
    d_lse: bool,
    side: bool,
    grad_f32: bool,
}

struct Outs {
    loss: Vec<f64>,
    lse: Vec<f64>,
    entropy: Vec<f64>,
    argmax: Vec<i32>,
    d_e: Vec<f64>,
    d_c: Vec<f64>,
    d_bias: Vec<f64>,
    stats: DenseStats,
    raw_de: Vec<u8>,
    raw_dc: Vec<u8>,
    raw_lse: Vec<u8>,
}

fn case_options(k: &CheckCase) -> Options {
    Options {
        softcap: k.softcap,
        reduction: k.reduction,
        label_smoothing: k.ls,
        z_loss: k.z_loss,
        filter_eps: if k.filter {
            FilterEps::Auto
        } else {
            FilterEps::Off
        },
        side_outputs: SideOutputs {
            entropy: k.side,
            argmax: k.side,
        },
        grad_dtype: if k.grad_f32 {
            cce_core::GradDType::F32
        } else {
            cce_core::GradDType::Input
        },
        ..Options::default()
    }
}

fn case_config(k: &CheckCase, rp: RowPass) -> DenseConfig {
    let (n, d, v) = k.shape;
    let opts = case_options(k);
    DenseConfig {
        n,
        d,
        v,
        dtype: k.dt,
        has_bias: k.bias,
        chunk_rows: k.chunk_rows,
        chunk_classes: None,
        de_f16: false,
        tile: (64, 128),
        softcap: k.softcap,
        label_smoothing: k.ls,
        z_loss: k.z_loss,
        reduction: k.reduction,
        filter: FilterRule::resolve(&opts, k.dt),
        grad_f32: k.grad_f32 || k.dt == DType::F32,
        compute_d_e: true,
        compute_d_c: true,
        want_entropy: k.side,
        want_argmax: k.side,
        row_pass: rp,
        sparse: None,
        // Row chunks: the check compares forward() + backward(lse) bitwise with
        // forward_backward(), which computes the lse in the row chunks.
        class_forward: None,
        wgmma_forward: false,
        wgmma_gcols: true,
        // forward_backward()'s row pass through the WGMMA epilogue computes G from f16
        // e^{z − m}, backward(lse)'s from the f32 logits: not bitwise equal.
        wgmma_rows: false,
    }
}

/// Upstream buffers of a case (host copies for the oracle).
struct Up {
    dl: Option<CudaSlice<u8>>,
    dl_host: Vec<f64>,
    dlse: Option<CudaSlice<u8>>,
    dlse_host: Vec<f64>,
}

fn make_up(engine: &DenseEngine, k: &CheckCase) -> Res<Up> {
    let s = engine.stream();
    let n = k.shape.0;
    let mut up = Up {
        dl: None,
        dl_host: vec![],
        dlse: None,
        dlse_host: vec![],
    };
    if k.per_row {
        let mut b = alloc(s, n * 4)?;
        engine.fill_randn(&mut b, DType::F32, n, 77, 0.5, 0.3)?;
        up.dl_host = to_f64(s, &b, DType::F32, n)?;
        up.dl = Some(b);
    }
    if k.d_lse {
        let mut b = alloc(s, n * 4)?;
        engine.fill_randn(&mut b, DType::F32, n, 78, 0.0, 0.01)?;
        up.dlse_host = to_f64(s, &b, DType::F32, n)?;
        up.dlse = Some(b);
    }
    Ok(up)
}

fn upstream<'a>(up: &'a Up) -> DenseUpstream<'a> {
    DenseUpstream {
        d_loss: match &up.dl {
            Some(b) => DenseDLoss::PerRow(b),
            None => DenseDLoss::Scalar(1.0),
        },
        d_lse: up.dlse.as_ref(),
    }
}

fn run_case(engine: &DenseEngine, k: &CheckCase, data: &Data, up: &Up, rp: RowPass) -> Res<Outs> {
    let s = engine.stream();
    let (n, d, v) = k.shape;
    let cfg = case_config(k, rp);
    let gt = cfg.grad_dtype();
    let mut ws = DenseWorkspace::new(engine, &cfg)?;
    let loss_n = if k.reduction == Reduction::None { n } else { 1 };
    let mut loss = poisoned(s, loss_n * 4)?;
    let mut lse = poisoned(s, n * 4)?;
    let mut rest = poisoned(s, n * 4)?;
    let mut ent = poisoned(s, n * 4)?;
    let mut am = poisoned(s, n * 4)?;
    let mut de = poisoned(s, n * d * gt.size_bytes())?;
    let mut dc = poisoned(s, v * d * gt.size_bytes())?;
    let mut db = poisoned(s, v * gt.size_bytes())?;
    let stats = {
        let mut fo = DenseForwardOut {
            loss: &mut loss,
            lse: &mut lse,
            rest: &mut rest,
            entropy: if k.side { Some(&mut ent) } else { None },
            argmax: if k.side { Some(&mut am) } else { None },
        };
        let mut go = DenseGradOut {
            d_e: Some(&mut de),
            d_c: Some(&mut dc),
            d_bias: if k.bias { Some(&mut db) } else { None },
            accumulate: false,
        };
        engine.forward_backward(
            &cfg,
            &mut ws,
            &data.inputs(),
            &upstream(up),
            &mut fo,
            &mut go,
        )?
    };
    s.synchronize()?;
    let raw_lse = download(s, &lse, n * 4)?;
    Ok(Outs {
        loss: to_f64(s, &loss, DType::F32, loss_n)?,
        lse: to_f64(s, &lse, DType::F32, n)?,
        entropy: if k.side {
            to_f64(s, &ent, DType::F32, n)?
        } else {
            vec![]
        },
        argmax: if k.side {
            bytemuck::cast_slice::<u8, i32>(&download(s, &am, n * 4)?).to_vec()
        } else {
            vec![]
        },
        d_e: to_f64(s, &de, gt, n * d)?,
        d_c: to_f64(s, &dc, gt, v * d)?,
        d_bias: if k.bias {
            to_f64(s, &db, gt, v)?
        } else {
            vec![]
        },
        stats,
        raw_de: download(s, &de, n * d * gt.size_bytes())?,
        raw_dc: download(s, &dc, v * d * gt.size_bytes())?,
        raw_lse,
    })
}

fn oracle(engine: &DenseEngine, k: &CheckCase, data: &Data, up: &Up, p: Precision) -> Res<Oracle> {
    let s = engine.stream();
    let (n, d, v) = k.shape;
    let dt = k.dt;
    let e = HostTensor::from_bytes(
        vec![n, d],
        dt,
        &download(s, &data.e, n * d * dt.size_bytes())?,
    )?;
    let c = HostTensor::from_bytes(
        vec![v, d],
        dt,
        &download(s, &data.c, v * d * dt.size_bytes())?,
    )?;
    let bias = match &data.bias {
        Some(b) => Some(HostTensor::from_bytes(
            vec![v],
            dt,
            &download(s, b, v * dt.size_bytes())?,
        )?),
        None => None,
    };
    let t = download(s, &data.targets, n * 4)?;
    let t: Vec<i64> = bytemuck::cast_slice::<u8, i32>(&t)
        .iter()
        .map(|&x| if x < 0 { -100 } else { x as i64 })
        .collect();
    let targets = HostTensor::from_i64(t);
    let opts = Options {
        filter_eps: FilterEps::Off,
        ..case_options(k)
    };
    let dl = if k.per_row {
        OracleDLoss::PerRow(up.dl_host.clone())
    } else {
        OracleDLoss::Scalar(1.0)
    };
    let dlse = if k.d_lse {
        Some(up.dlse_host.as_slice())
    } else {
        None
    };
    Ok(naive(&e, &c, bias.as_ref(), &targets, &opts, &dl, dlse, p)?)
}

fn report(name: &str, ours: &Outs, gt: &Oracle, rf: &Oracle, tol: f64) -> usize {
    let mut total_bad = 0;
    let mut line = |what: &str, o: &[f64], g: &[f64], r: &[f64]| {
        if o.is_empty() {
            return;
        }
        let (bad, nonfin) = violations(o, r, g, tol);
        total_bad += bad + nonfin;
        println!(
            "  {name:<44} {what:<8} rel_err {:.3e}  same-dtype ref {:.3e}  violations {bad}{}",
            rel_err(o, g),
            rel_err(r, g),
            if nonfin > 0 {
                format!("  NON-FINITE {nonfin}")
            } else {
                String::new()
            }
        );
    };
    line("loss", &ours.loss, &gt.loss, &rf.loss);
    line("lse", &ours.lse, &gt.lse, &rf.lse);
    line("entropy", &ours.entropy, &gt.entropy, &rf.entropy);
    line("d_e", &ours.d_e, &gt.d_e, &rf.d_e);
    line("d_c", &ours.d_c, &gt.d_c, &rf.d_c);
    if let Some(b) = &gt.d_bias {
        line("d_bias", &ours.d_bias, b, rf.d_bias.as_deref().unwrap_or(b));
    }
    if !ours.argmax.is_empty() {
        let mism = ours
            .argmax
            .iter()
            .zip(&gt.argmax)
            .filter(|(a, b)| a != b)
            .count();
        println!(
            "  {name:<44} argmax   mismatches {mism} of {}",
            gt.argmax.len()
        );
    }
    total_bad
}

fn check(engine: &DenseEngine, stream: &Arc<CudaStream>) -> Res<()> {
    let base = CheckCase {
        name: "",
        shape: (512, 256, 4096),
        dt: DType::BF16,
        chunk_rows: 128,
        bias: false,
        softcap: None,
        ls: 0.0,
        z_loss: 0.0,
        reduction: Reduction::Mean,
        filter: false,
        ignore_frac: 0.0,
        per_row: false,
        d_lse: false,
        side: false,
        grad_f32: false,
    };
    let cases = [
        CheckCase {
            name: "bf16 512x256x4096 exact mean",
            ..base
        },
        CheckCase {
            name: "bf16 512x256x4096 filtered (auto eps, 1e-3)",
            filter: true,
            ..base
        },
        CheckCase {
            name: "bf16 251x123x507 bias cap30 ls.1 z1e-4 sum side",
            shape: (251, 123, 507),
            chunk_rows: 64,
            bias: true,
            softcap: Some(30.0),
            ls: 0.1,
            z_loss: 1e-4,
            reduction: Reduction::Sum,
            ignore_frac: 0.2,
            side: true,
            ..base
        },
        CheckCase {
            name: "f16 300x96x1001 none per-row dlse ls.1 filt",
            shape: (300, 96, 1001),
            dt: DType::F16,
            chunk_rows: 128,
            ls: 0.1,
            reduction: Reduction::None,
            filter: true,
            ignore_frac: 0.2,
            per_row: true,
            d_lse: true,
            ..base
        },
        CheckCase {
            name: "f32 128x64x777 bias mean side",
            shape: (128, 64, 777),
            dt: DType::F32,
            chunk_rows: 64,
            bias: true,
            side: true,
            ..base
        },
        CheckCase {
            name: "bf16 96x128x20000 grads f32 bias",
            shape: (96, 128, 20000),
            chunk_rows: 64,
            bias: true,
            grad_f32: true,
            ..base
        },
    ];
    let passes = [
        RowPass::TwoPass,
        RowPass::Fused { cluster: None },
        RowPass::Fused { cluster: Some(1) },
        RowPass::Fused { cluster: Some(4) },
        RowPass::Fused { cluster: Some(16) },
    ];
    let mut total_bad = 0usize;
    for (ci, k) in cases.iter().enumerate() {
        let (n, d, v) = k.shape;
        let c_std = 3.0 / (d as f32).sqrt();
        let data = make_data(
            engine,
            (n, d, v),
            k.dt,
            1000 + ci as u64 * 10,
            1.0,
            c_std,
            k.bias.then_some(0.5),
            k.ignore_frac,
        )?;
        let up = make_up(engine, k)?;
        let t = Instant::now();
        let gt = oracle(engine, k, &data, &up, Precision::F64)?;
        let rf = oracle(engine, k, &data, &up, Precision::SameDtype)?;
        println!(
            "case {}: N={n} D={d} V={v} valid {} (oracle {:.1} s)",
            k.name,
            data.n_valid,
            t.elapsed().as_secs_f64()
        );
        let tol = k.dt.tolerance();
        let mut first: Option<Outs> = None;
        for rp in passes {
            let cfg = case_config(k, rp);
            let label = format!("{} [{}]", k.name, row_pass_name(rp));
            if matches!(rp, RowPass::Fused { .. }) && engine.fused_layout(&cfg).is_none() {
                println!("  {label}: fused layout n/a, skipped");
                continue;
            }
            let o = match run_case(engine, k, &data, &up, rp) {
                Ok(o) => o,
                Err(e) => {
                    println!("  {label}: ERROR {e}");
                    total_bad += 1;
                    continue;
                }
            };
            total_bad += report(&label, &o, &gt, &rf, tol);
            if k.filter {
                let st = &o.stats;
                println!(
                    "  {label:<44} filter   kept {} skipped {} entries ({:.2}% kept), tiles {}/{} kept, dropped mass max {:.3e} mean {:.3e} (bound {:.1e}){}",
                    st.entries_kept,
                    st.entries_skipped,
                    100.0 * st.entries_kept as f64 / (st.entries_kept + st.entries_skipped).max(1) as f64,
                    st.tiles_visited,
                    st.tiles_visited + st.tiles_skipped,
                    st.dropped_mass_max,
                    st.dropped_mass_mean,
                    1e-3,
                    if st.dropped_mass_max > 1e-3 { "  BOUND VIOLATED" } else { "" }
                );
                if st.dropped_mass_max > 1e-3 {
                    total_bad += 1;
                }
            }
            if let Some(f) = &first {
                let de_diff = rel_err(&o.d_e, &f.d_e);
                let lse_diff = rel_err(&o.lse, &f.lse);
                println!(
                    "  {label:<44} vs two-pass: lse rel diff {lse_diff:.2e}, d_e rel diff {de_diff:.2e}"
                );
            } else {
                // Determinism, forward-only and backward-only consistency (two-pass).
                let o2 = run_case(engine, k, &data, &up, rp)?;
                let det = o2.raw_de == o.raw_de && o2.raw_dc == o.raw_dc && o2.raw_lse == o.raw_lse;
                println!("  {label:<44} repeat   bitwise identical: {det}");
                if !det {
                    total_bad += 1;
                }
                let cfg = case_config(k, rp);
                let gtd = cfg.grad_dtype();
                let mut ws = DenseWorkspace::new(engine, &cfg)?;
                let loss_n = if k.reduction == Reduction::None { n } else { 1 };
                let mut loss = poisoned(stream, loss_n * 4)?;
                let mut lse = poisoned(stream, n * 4)?;
                let mut rest = poisoned(stream, n * 4)?;
                {
                    let mut fo = DenseForwardOut {
                        loss: &mut loss,
                        lse: &mut lse,
                        rest: &mut rest,
                        entropy: None,
                        argmax: None,
                    };
                    engine.forward(&cfg, &mut ws, &data.inputs(), &mut fo)?;
                }
                let lse_f = download(stream, &lse, n * 4)?;
                let loss_f = to_f64(stream, &loss, DType::F32, loss_n)?;
                let mut de = poisoned(stream, n * d * gtd.size_bytes())?;
                let mut dc = poisoned(stream, v * d * gtd.size_bytes())?;
                let mut db = poisoned(stream, v * gtd.size_bytes())?;
                {
                    let mut go = DenseGradOut {
                        d_e: Some(&mut de),
                        d_c: Some(&mut dc),
                        d_bias: if k.bias { Some(&mut db) } else { None },
                        accumulate: false,
                    };
                    engine.backward(
                        &cfg,
                        &mut ws,
                        &data.inputs(),
                        (&lse, &rest),
                        &upstream(&up),
                        &mut go,
                    )?;
                }
                let de_b = download(stream, &de, n * d * gtd.size_bytes())?;
                let dc_b = download(stream, &dc, v * d * gtd.size_bytes())?;
                let same =
                    lse_f == o.raw_lse && loss_f == o.loss && de_b == o.raw_de && dc_b == o.raw_dc;
                println!(
                    "  {label:<44} forward() + backward(lse) bitwise equal to forward_backward(): {same}"
                );
                if !same {
                    total_bad += 1;
                }
                first = Some(o);
            }
        }
        if k.filter {
            // Filtered error against exact (ours, two-pass).
            let exact_case = CheckCase {
                filter: false,
                ..*k
            };
            let ex = run_case(engine, &exact_case, &data, &up, RowPass::TwoPass)?;
            if let Some(f) = &first {
                println!(
                    "  {:<44} filtered vs exact: d_e rel {:.3e}, d_c rel {:.3e}; exact vs f64: d_e {:.3e}, d_c {:.3e}",
                    k.name,
                    rel_err(&f.d_e, &ex.d_e),
                    rel_err(&f.d_c, &ex.d_c),
                    rel_err(&ex.d_e, &gt.d_e),
                    rel_err(&ex.d_c, &gt.d_c)
                );
            }
        }
    }
    println!("CHECK SUMMARY: {total_bad} problems");
    Ok(())
}

impl Clone for CheckCase {
    fn clone(&self) -> Self {
        *self
    }
}
impl Copy for CheckCase {}

// ------------------------------------------------------------------------------------------------
// bench
// ------------------------------------------------------------------------------------------------

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

fn bench(
    engine: &DenseEngine,
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    args: &Args,
) -> Res<()> {
    let dt = DType::BF16;
    let mut table = Vec::new();
    for &(n, d, v, softcap, budget) in &args.shapes {
        let budget_gib = budget.unwrap_or(args.budget_gib);
        let budget_bytes = (budget_gib * (1u64 << 30) as f64) as u64;
        println!("== shape N={n} D={d} V={v} softcap {softcap:?} budget {budget_gib} GiB");
        let mut data = make_data(engine, (n, d, v), dt, 7, 1.0, 1.0, None, 0.0)?;
        let e_ptr = data.e.device_ptr(stream).0;
        let c_ptr = data.c.device_ptr(stream).0;
        // Outputs (gradients in bf16; they are not "extra" memory).
        let mut loss = alloc(stream, 4)?;
        let mut lse = alloc(stream, n * 4)?;
        let mut de = alloc(stream, n * d * 2)?;
        let mut dc = alloc(stream, v * d * 2)?;
        stream.synchronize()?;

        // Floors: the three GEMMs of the full problem, measured here.
        let floors = {
            let ld = v.div_ceil(8) * 8;
            let bytes = n * ld * 4;
            let mut buf = alloc(stream, bytes)?;
            engine.fill_randn(&mut buf, DType::BF16, bytes / 2, 99, 0.0, 1e-3)?;
            let p = buf.device_ptr(stream).0;
            let de_p = de.device_ptr(stream).0;
            let dc_f32 = alloc(stream, v * d * 4)?;
            let dcf_p = dc_f32.device_ptr(stream).0;
            let t_de = time_ms(stream, args.warmup, args.iters, || {
                Ok(engine.gemm_de(
                    (v, d, n),
                    (dt, dt, dt),
                    (c_ptr, p, de_p),
                    2 * ld,
                    (1.0, 0.0),
                )?)
            })?;
            let t_dc = time_ms(stream, args.warmup, args.iters, || {
                Ok(engine.gemm_dc(
                    (v, d, n),
                    (dt, dt, DType::F32),
                    (e_ptr, p, dcf_p),
                    2 * ld,
                    (1.0, 0.0),
                )?)
            })?;
            let t_l16 = {
                // bf16-output logits GEMM (what torch's e @ c.T does), for reference.
                let o = alloc(stream, n * v * 2)?;
                let op = o.device_ptr(stream).0;
                time_ms(stream, args.warmup, args.iters, || {
                    Ok(engine.gemm(
                        true,
                        false,
                        (v, n, d),
                        (c_ptr, dt, d),
                        (e_ptr, dt, d),
                        (1.0, 0.0),
                        (op, dt, v),
                    )?)
                })?
            };
            let t_l = time_ms(stream, args.warmup, args.iters, || {
                Ok(engine.gemm_logits((v, d, n), dt, (c_ptr, e_ptr, p), ld)?)
            })?;
            stream.synchronize()?;
            (t_l.0, t_de.0, t_dc.0, t_l16.0)
        };
        let floor1 = floors.0;
        let floor3 = floors.0 + floors.1 + floors.2;
        let tflops = 2.0 * n as f64 * v as f64 * d as f64 / (floor1 * 1e-3) / 1e12;
        println!(
            "  floor: logits GEMM f32-out {:.2} ms ({tflops:.0} TFLOP/s), bf16-out {:.2} ms, d_e GEMM {:.2} ms, d_c GEMM {:.2} ms; 3-GEMM floor {:.2} ms (3 x logits {:.2})",
            floors.0, floors.3, floors.1, floors.2, floor3, 3.0 * floor1
        );

        let rp = args.row_pass.first().copied().unwrap_or(RowPass::TwoPass);
        let problem = Problem {
            n,
            d,
            v,
            dtype: dt,
            has_bias: false,
            seq_len: n,
        };
        for data_name in &args.data {
            let (e_std, c_std) = match data_name.as_str() {
                "randn" => (1.0f32, 1.0f32),
                "c/8" => (1.0, 0.125),
                "e/8" => (0.125, 1.0),
                "e/11" => (1.0 / 11.0, 1.0),
                o => return Err(format!("unknown data {o}").into()),
            };
            engine.fill_randn(&mut data.e, dt, n * d, 7, 0.0, e_std)?;
            engine.fill_randn(&mut data.c, dt, v * d, 8, 0.0, c_std)?;
            for &(kind, kind_gib) in &args.strategies {
                let res = bench_one(
                    engine,
                    ctx,
                    stream,
                    &data,
                    &problem,
                    softcap,
                    kind_gib.map_or(budget_bytes, |g| (g * (1u64 << 30) as f64) as u64),
                    (kind, rp),
                    args,
                    (&mut loss, &mut lse, &mut de, &mut dc),
                    data_name == &args.data[0],
                );
                match res {
                    Ok(r) => {
                        let line = format!(
                            "| {n}x{d}x{v}{} | {data_name} | {:.2} | {} | {} | {:.2} | {:.2} | {:.2} | {:.3}x | {} | {:.2} | {:.3}x | {:.2} | {:.3}x | {:.2e} / {:.2e} | {:.0} | {:.2e} / {:.2e} | {:.3} | {:.3} |",
                            softcap.map(|s| format!(" cap{s}")).unwrap_or_default(),
                            r.entropy,
                            r.strategy,
                            r.chunks,
                            r.budget_gib,
                            floor1,
                            r.fwd_ms.map_or(f64::NAN, |x| x),
                            r.fwd_ms.map_or(f64::NAN, |x| x / floor1),
                            r.exact_ms.map_or("-".into(), |x| format!("{x:.2}")),
                            floor3,
                            r.exact_ms.map_or(f64::NAN, |x| x / floor3),
                            r.filt_ms,
                            r.filt_ms / floor3,
                            r.err_de,
                            r.err_dc,
                            r.kept_per_row,
                            r.dropped_max,
                            r.dropped_mean,
                            gib(r.ws_bytes),
                            r.mem_delta_gib,
                        );
                        println!("{line}");
                        table.push(line);
                    }
                    Err(e) => println!("  {kind:?} {data_name}: ERROR {e}"),
                }
            }
        }
        drop(data);
        stream.synchronize()?;
    }
    println!();
    println!("| shape | data | entropy nats | strategy | chunks | budget GiB | 1-GEMM floor ms | fwd ms | fwd / 1 GEMM | fwd+bwd exact ms | 3-GEMM floor ms | exact / floor | fwd+bwd filtered ms | filtered / floor | filtered vs exact rel. err d_e / d_c | kept entries/row | dropped mass max / mean | workspace GiB (tally) | measured extra GiB |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for l in table {
        println!("{l}");
    }
    Ok(())
}

/// Give the stream-ordered allocator's unused memory back to the driver, so that
/// `cuMemGetInfo` sees the next allocation.
fn trim_pool(ctx: &Arc<CudaContext>) -> Res<()> {
    use cudarc::driver::sys;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: the context is current (bound by cudarc on every call); `pool` is valid for
    // writes; trimming only releases memory no allocation holds.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()).result()?;
        sys::cuMemPoolTrimTo(pool, 0).result()?;
    }
    Ok(())
}

struct BenchResult {
    strategy: String,
    chunks: String,
    entropy: f64,
    fwd_ms: Option<f64>,
    exact_ms: Option<f64>,
    filt_ms: f64,
    err_de: f64,
    err_dc: f64,
    kept_per_row: f64,
    dropped_max: f64,
    dropped_mean: f64,
    ws_bytes: u64,
    mem_delta_gib: f64,
    budget_gib: f64,
}

type GradBufs<'a> = (
    &'a mut CudaSlice<u8>,
    &'a mut CudaSlice<u8>,
    &'a mut CudaSlice<u8>,
    &'a mut CudaSlice<u8>,
);

/// The buffers of one forward-and-backward call: loss, lse, rest mass, d_e, d_c.
type FbBufs<'a> = (
    &'a mut CudaSlice<u8>,
    &'a mut CudaSlice<u8>,
    &'a mut CudaSlice<u8>,
    &'a mut CudaSlice<u8>,
    &'a mut CudaSlice<u8>,
);

#[allow(clippy::too_many_arguments)]
fn bench_one(
    engine: &DenseEngine,
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    data: &Data,
    problem: &Problem,
    softcap: Option<f32>,
    budget_bytes: u64,
    (kind, rp): (StrategyKind, RowPass),
    args: &Args,
    (loss, lse, de, dc): GradBufs<'_>,
    print_plan: bool,
) -> Res<BenchResult> {
    let (n, d, v) = (problem.n, problem.d, problem.v);
    let mut rest = alloc(stream, n * 4)?;
    let opts = Options {
        softcap,
        workspace_budget_bytes: budget_bytes,
        ..Options::default()
    };
    // As the backend plans: within the budget less the cuBLAS workspace.
    let share = Options {
        workspace_budget_bytes: cce_cuda::dense::plan_budget(budget_bytes),
        ..opts.clone()
    };
    let plan = Plan::new(problem, &share, &cuda_limits(128, kind))?;
    let mut cfg = DenseConfig::from_plan(&plan, &opts)?;
    cfg.row_pass = rp;
    cfg.wgmma_forward = args.switches.wgmma_forward;
    cfg.wgmma_gcols = args.switches.wgmma_gcols;
    cfg.wgmma_rows = args.switches.wgmma_rows;
    let mut cfg_exact = cfg.clone();
    cfg_exact.filter = FilterRule::resolve(&Options::exact(), problem.dtype);
    stream.synchronize()?;
    trim_pool(ctx)?;
    let (free0, _) = ctx.mem_get_info()?;
    let mut ws = DenseWorkspace::new(engine, &cfg)?;
    stream.synchronize()?;
    let (free1, _) = ctx.mem_get_info()?;
    let mem_delta_gib = gib(free0.saturating_sub(free1) as u64 + engine.own_bytes());
    let ws_bytes = ws.bytes() + engine.own_bytes();
    if print_plan {
        println!(
            "  [{kind:?}] plan: {} ; workspace tally {:.3} GiB (+ cuBLAS {} MiB)",
            plan.reason,
            gib(ws.bytes()),
            engine.own_bytes() >> 20,
        );
    }
    let up = DenseUpstream {
        d_loss: DenseDLoss::Scalar(1.0),
        d_lse: None,
    };
    let inp = data.inputs();
    let run_fb = |c: &DenseConfig,
                  ws: &mut DenseWorkspace,
                  (loss, lse, rest, de, dc): FbBufs<'_>|
     -> Res<DenseStats> {
        let mut fo = DenseForwardOut {
            loss,
            lse,
            rest,
            entropy: None,
            argmax: None,
        };
        let mut go = DenseGradOut {
            d_e: Some(de),
            d_c: Some(dc),
            d_bias: None,
            accumulate: false,
        };
        Ok(engine.forward_backward(c, ws, &inp, &up, &mut fo, &mut go)?)
    };
    // Exact mode on every data set (GEMM speed depends on the data: a G of zeros, as on randn
    // rows, runs the gradient GEMMs faster than dense G).
    let mut exact_stats = DenseStats::default();
    let exact_ms = time_ms(stream, args.warmup, args.iters, || {
        exact_stats = run_fb(
            &cfg_exact,
            &mut ws,
            (&mut *loss, &mut *lse, &mut rest, &mut *de, &mut *dc),
        )?;
        Ok(())
    })?
    .0;
    stream.synchronize()?;
    let de_exact = to_f64(stream, &*de, problem.dtype, n * d)?;
    let dc_exact = to_f64(stream, &*dc, problem.dtype, v * d)?;
    // Split dense's WGMMA epilogues against the cuBLAS path of the same pass in the same run
    // (the class pass: G in the epilogue; the row pass: lse partials and f16 e^(z - max)), and
    // how far the gradient that pass computes (d_c, d_e) is from the epilogue's.
    for class in [true, false] {
        let note = if class {
            exact_stats.class_pass.as_deref()
        } else {
            exact_stats.row_pass_note.as_deref()
        };
        let Some(note) = note else { continue };
        // The fallback notes read "... (no WGMMA epilogue: why)".
        if !note.starts_with("class pass: WGMMA") && !note.starts_with("row pass: WGMMA") {
            println!("  exact: {note}");
            continue;
        }
        let mut cfg_old = cfg_exact.clone();
        if class {
            cfg_old.wgmma_gcols = false;
        } else {
            cfg_old.wgmma_rows = false;
        }
        let old_ms = time_ms(stream, args.warmup, args.iters, || {
            run_fb(
                &cfg_old,
                &mut ws,
                (&mut *loss, &mut *lse, &mut rest, &mut *de, &mut *dc),
            )
            .map(|_| ())
        })?
        .0;
        stream.synchronize()?;
        let (pass, name, grad, count, exact) = if class {
            ("class", "d_c", &*dc, v * d, &dc_exact)
        } else {
            ("row", "d_e", &*de, n * d, &de_exact)
        };
        let old = to_f64(stream, grad, problem.dtype, count)?;
        println!(
            "  exact: {exact_ms:.2} ms as configured, {old_ms:.2} ms with the cuBLAS {pass} \
             pass; {name} rel. difference {:.2e}; {note}",
            rel_err(exact, &old)
        );
    }
    // Poison the gradients (all-ones bits: NaN in every float dtype), so that entries the
    // filtered call leaves unwritten show as NaN in its error against exact mode.
    stream.memcpy_htod(&vec![0xffu8; de.len()][..], &mut *de)?;
    stream.memcpy_htod(&vec![0xffu8; dc.len()][..], &mut *dc)?;
    let mut last = DenseStats::default();
    let filt_ms = time_ms(stream, args.warmup, args.iters, || {
        last = run_fb(
            &cfg,
            &mut ws,
            (&mut *loss, &mut *lse, &mut rest, &mut *de, &mut *dc),
        )?;
        Ok(())
    })?
    .0;
    stream.synchronize()?;
    let err_de = rel_err(&to_f64(stream, &*de, problem.dtype, n * d)?, &de_exact);
    let err_dc = rel_err(&to_f64(stream, &*dc, problem.dtype, v * d)?, &dc_exact);
    drop((de_exact, dc_exact));
    // Forward only as the backend runs it (its own configuration and workspace within the
    // forward-only cap, `DenseConfig::forward_only`), and the data's mean softmax entropy (the
    // forward's side output).
    let cfg_fwd = cfg_exact.clone().forward_only(budget_bytes);
    let mut ws_fwd = DenseWorkspace::new(engine, &cfg_fwd)?;
    let mut lse2 = alloc(stream, n * 4)?;
    let mut rest2 = alloc(stream, n * 4)?;
    let mut loss2 = alloc(stream, 4)?;
    let mut ent = alloc(stream, n * 4)?;
    let fwd_ms = time_ms(stream, args.warmup, args.iters, || {
        let mut fo = DenseForwardOut {
            loss: &mut loss2,
            lse: &mut lse2,
            rest: &mut rest2,
            entropy: None,
            argmax: None,
        };
        engine.forward(&cfg_fwd, &mut ws_fwd, &inp, &mut fo)?;
        Ok(())
    })?
    .0;
    // The same forward in the row chunks (what a plan without class tiles does), same run.
    // With the fused WGMMA forward on (`fwd_ms` is then its time), the class tiles with it off
    // too.
    if cfg_fwd.wgmma_forward {
        let mut cfg_cls = cfg_fwd.clone();
        cfg_cls.wgmma_forward = false;
        let cls_ms = time_ms(stream, args.warmup, args.iters, || {
            let mut fo = DenseForwardOut {
                loss: &mut loss2,
                lse: &mut lse2,
                rest: &mut rest2,
                entropy: None,
                argmax: None,
            };
            engine.forward(&cfg_cls, &mut ws_fwd, &inp, &mut fo)?;
            Ok(())
        })?
        .0;
        println!(
            "  forward: {fwd_ms:.2} ms as configured, {cls_ms:.2} ms without the WGMMA forward"
        );
    }
    if cfg_fwd.class_forward.is_some() {
        let mut cfg_rows = cfg_fwd.clone();
        cfg_rows.class_forward = None;
        cfg_rows.wgmma_forward = false;
        let rows_ms = time_ms(stream, args.warmup, args.iters, || {
            let mut fo = DenseForwardOut {
                loss: &mut loss2,
                lse: &mut lse2,
                rest: &mut rest2,
                entropy: None,
                argmax: None,
            };
            engine.forward(&cfg_rows, &mut ws_fwd, &inp, &mut fo)?;
            Ok(())
        })?
        .0;
        let note = {
            let mut fo = DenseForwardOut {
                loss: &mut loss2,
                lse: &mut lse2,
                rest: &mut rest2,
                entropy: None,
                argmax: None,
            };
            engine
                .forward(&cfg_fwd, &mut ws_fwd, &inp, &mut fo)?
                .forward
        };
        println!(
            "  forward: as configured {:.2} ms, row chunks {rows_ms:.2} ms; {}",
            fwd_ms,
            note.unwrap_or_default()
        );
    }
    let mut cfg_ent = cfg_fwd.clone();
    cfg_ent.want_entropy = true;
    {
        let mut fo = DenseForwardOut {
            loss: &mut loss2,
            lse: &mut lse2,
            rest: &mut rest2,
            entropy: Some(&mut ent),
            argmax: None,
        };
        engine.forward(&cfg_ent, &mut ws_fwd, &inp, &mut fo)?;
    }
    if let Some(note) = &last.sparse {
        println!("  filtered backward: {note}");
    }
    if let Some(note) = &last.class_pass {
        println!("  filtered backward, dense passes: {note}");
    }
    let entv = to_f64(stream, &ent, DType::F32, n)?;
    let entropy = entv.iter().sum::<f64>() / n as f64;
    let active = last.active_rows.max(1) as f64;
    let chunks = match plan.strategy {
        cce_core::Strategy::SplitDense {
            chunk_rows,
            chunk_classes,
            de_f16,
        } => format!(
            "{chunk_rows} rows ({}) / {chunk_classes} classes",
            if de_f16 { "f16 G, f16 c" } else { "bf16 G" }
        ),
        cce_core::Strategy::ChunkedDense { chunk_rows } => format!("{chunk_rows} rows"),
        other => other.to_string(),
    };
    Ok(BenchResult {
        strategy: match kind {
            StrategyKind::SplitDense
                if last
                    .sparse
                    .as_deref()
                    .is_some_and(|x| x.starts_with("sparse")) =>
            {
                "split (filtered: sparse)".into()
            }
            StrategyKind::SplitDense => "split".into(),
            StrategyKind::ChunkedDense => "chunked".into(),
            k => format!("{k:?}"),
        },
        chunks,
        entropy,
        fwd_ms: Some(fwd_ms),
        exact_ms: Some(exact_ms),
        filt_ms,
        err_de,
        err_dc,
        kept_per_row: last.entries_kept as f64 / 2.0 / active,
        dropped_max: last.dropped_mass_max,
        dropped_mean: last.dropped_mass_mean,
        ws_bytes,
        mem_delta_gib,
        budget_gib: gib(budget_bytes),
    })
}
