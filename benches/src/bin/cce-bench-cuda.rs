//! CUDA benchmark: forward and forward+backward time of the CUDA backend per case, against a
//! cuBLAS GEMM of the same shape measured in the same run, with peak extra device memory and
//! the call statistics.
//!
//! ```text
//! cce-bench-cuda [--filter SUBSTR]... [--reps 5] [--warmup 1] [--out FILE]
//! ```
//! Times are CUDA events around the whole call on the backend's stream (host-side validation
//! included), after warm-up; the median of `--reps` runs is reported. The GEMM floor is the
//! logits product `e · cᵀ` (`2·N·V·D` FLOP) through cuBLAS (bf16 in, f32 compute, bf16 out), in
//! row chunks of 4096 so its output fits; floor(fwd) = 1 GEMM, floor(fwd+bwd) = 3 GEMMs.

use cce_core::{
    Backend, CallStats, DType, FilterEps, HostTensor, Inputs, Options, TensorMeta, Upstream,
};
use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::sys as dsys;
use cut_cross_entropy::cce_cuda::{CudaBackend, CudaTensor};
use std::ffi::c_void;
use std::time::Instant;

#[derive(Clone, Copy, Debug)]
enum Data {
    Randn,
    CDiv8,
    EDiv8,
    /// cce-data's `lm` generator (preset for V), generated on the host, rounded to bf16.
    Lm,
    /// The 12k-row real file of SmolLM2-135M (`cce_data::e12k_path`: `$CCE_E12K` or
    /// `shared/data/`) with the shipped fixture's head; the case is skipped where it is missing.
    Real,
}

struct Case {
    name: &'static str,
    n: usize,
    d: usize,
    v: usize,
    data: Data,
    softcap: Option<f32>,
}

const CASES: &[Case] = &[
    Case {
        name: "seed-randn",
        n: 32768,
        d: 4096,
        v: 256000,
        data: Data::Randn,
        softcap: None,
    },
    Case {
        name: "seed-c/8",
        n: 32768,
        d: 4096,
        v: 256000,
        data: Data::CDiv8,
        softcap: None,
    },
    Case {
        name: "seed-e/8",
        n: 32768,
        d: 4096,
        v: 256000,
        data: Data::EDiv8,
        softcap: None,
    },
    Case {
        name: "seed-lm",
        n: 32768,
        d: 4096,
        v: 256000,
        data: Data::Lm,
        softcap: None,
    },
    Case {
        name: "gemma2-lm",
        n: 8192,
        d: 2304,
        v: 256000,
        data: Data::Lm,
        softcap: None,
    },
    Case {
        name: "llama3-lm",
        n: 8192,
        d: 4096,
        v: 128256,
        data: Data::Lm,
        softcap: None,
    },
    Case {
        name: "smollm2-real",
        n: 12288,
        d: 576,
        v: 49152,
        data: Data::Real,
        softcap: None,
    },
    Case {
        name: "gemma2-randn-softcap30",
        n: 8192,
        d: 2304,
        v: 256000,
        data: Data::Randn,
        softcap: Some(30.0),
    },
    Case {
        name: "llama3-randn",
        n: 8192,
        d: 4096,
        v: 128256,
        data: Data::Randn,
        softcap: None,
    },
];

/// `‖a − b‖₂ / ‖b‖₂` in f64 (NaN when the lengths differ or `b` is zero).
fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() {
        return f64::NAN;
    }
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        num += (x as f64 - y as f64).powi(2);
        den += (y as f64).powi(2);
    }
    (num / den).sqrt()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

struct Pool(dsys::CUmemoryPool);

impl Pool {
    fn new(be: &CudaBackend) -> Self {
        let mut pool = std::ptr::null_mut();
        // SAFETY: the context is current (backend constructed); valid out pointer.
        unsafe { dsys::cuDeviceGetDefaultMemPool(&mut pool, be.context().cu_device()) }
            .result()
            .expect("default memory pool");
        let p = Pool(pool);
        // Keep freed blocks in the pool between calls (as a caching allocator does).
        let mut thr: u64 = u64::MAX;
        p.set(
            dsys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut thr,
        );
        p
    }
    fn set(&self, attr: dsys::CUmemPool_attribute, v: &mut u64) {
        // SAFETY: the attribute takes a u64 (cuuint64_t).
        unsafe { dsys::cuMemPoolSetAttribute(self.0, attr, v as *mut u64 as *mut c_void) }
            .result()
            .expect("pool attribute");
    }
    fn get(&self, attr: dsys::CUmemPool_attribute) -> u64 {
        let mut v: u64 = 0;
        // SAFETY: the attribute is a u64 (cuuint64_t).
        unsafe { dsys::cuMemPoolGetAttribute(self.0, attr, &mut v as *mut u64 as *mut c_void) }
            .result()
            .expect("pool attribute");
        v
    }
    fn used(&self) -> u64 {
        self.get(dsys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
    }
    fn reset_high(&self) {
        let mut z = 0u64;
        self.set(
            dsys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            &mut z,
        );
    }
    fn high(&self) -> u64 {
        self.get(dsys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)
    }
}

/// Milliseconds of `f` on the backend's stream, by CUDA events.
fn time_ms(be: &CudaBackend, mut f: impl FnMut()) -> f64 {
    let ctx = be.context();
    let start = ctx
        .new_event(Some(dsys::CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap();
    let end = ctx
        .new_event(Some(dsys::CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap();
    start.record(be.stream()).unwrap();
    f();
    end.record(be.stream()).unwrap();
    end.synchronize().unwrap();
    start.elapsed_ms(&end).unwrap() as f64
}

/// The logits GEMM `z = e · cᵀ` in row chunks (cuBLAS column-major: zᵀ = c · eᵀ).
fn gemm_floor(
    be: &CudaBackend,
    blas: &CudaBlas,
    e: &CudaTensor,
    c: &CudaTensor,
    n: usize,
    d: usize,
    v: usize,
) -> f64 {
    let chunk = 4096.min(n);
    let out = be.alloc_tensor(vec![chunk, v], DType::BF16).unwrap();
    let (alpha, beta) = (1.0f32, 0.0f32);
    time_ms(be, || {
        let mut r = 0;
        while r < n {
            let rows = chunk.min(n - r);
            // SAFETY: c is [V, D] bf16 (lda D), e rows r.. are [rows, D] bf16 (ldb D), out is
            // [chunk, V] bf16 (ldc V); all on the backend's stream (the handle's stream).
            unsafe {
                blas::gemm_ex(
                    *blas.handle(),
                    blas_sys::cublasOperation_t::CUBLAS_OP_T,
                    blas_sys::cublasOperation_t::CUBLAS_OP_N,
                    v as i32,
                    rows as i32,
                    d as i32,
                    &alpha as *const f32 as *const c_void,
                    c.device_ptr() as *const c_void,
                    blas_sys::cudaDataType_t::CUDA_R_16BF,
                    d as i32,
                    (e.device_ptr() + (r * d * 2) as u64) as *const c_void,
                    blas_sys::cudaDataType_t::CUDA_R_16BF,
                    d as i32,
                    &beta as *const f32 as *const c_void,
                    out.device_ptr() as *mut c_void,
                    blas_sys::cudaDataType_t::CUDA_R_16BF,
                    v as i32,
                    blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .expect("cublas gemm");
            r += rows;
        }
    })
}

struct Row {
    case: String,
    mode: &'static str,
    fwd_ms: f64,
    fb_ms: f64,
    gemm_ms: f64,
    peak_extra_bytes: u64,
    stats: CallStats,
    loss: f32,
    /// A filtered call's `d_e` and `d_c` relative distance from the exact call's.
    vs_exact: Option<(f64, f64)>,
}

/// Command line.
#[derive(clap::Parser, Debug)]
#[command(
    name = "cce-bench-cuda",
    about = "The CUDA backend's strategies on the issue's cases"
)]
struct Cli {
    /// Run only the "case mode" labels containing this (repeatable; e.g. "seed-c/8 filtered").
    #[arg(long)]
    filter: Vec<String>,
    /// Timed runs per measurement (median reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Untimed runs before them.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Also write the table to this file.
    #[arg(long)]
    out: Option<String>,
    #[command(flatten)]
    switches: cce_benches::SwitchArgs,
}

fn main() {
    let cases = CASES.iter().map(|c| c.name).collect::<Vec<_>>().join(", ");
    let cli = {
        use clap::{CommandFactory, FromArgMatches};
        let cmd = Cli::command().after_help(format!("cases: {cases}"));
        match Cli::from_arg_matches(&cmd.get_matches()) {
            Ok(c) => c,
            Err(e) => e.exit(),
        }
    };
    let (filters, reps, warmup, out_path) =
        (cli.filter.clone(), cli.reps, cli.warmup, cli.out.clone());
    let be = match CudaBackend::new(0) {
        Ok(b) => b.with_switches(cli.switches.switches()),
        Err(e) => {
            eprintln!("cce-bench-cuda: no CUDA backend: {e}");
            std::process::exit(2);
        }
    };
    let blas = if cce_cuda::libs::present("cublas") {
        Some(CudaBlas::new(be.stream().clone()).expect("cublas handle"))
    } else {
        eprintln!("libcublas not found: GEMM floor not measured");
        None
    };
    let pool = Pool::new(&be);
    println!("device: {}", be.limits().name);
    let mut rows: Vec<Row> = vec![];
    for case in CASES {
        let modes: Vec<&'static str> = ["exact", "filtered"]
            .into_iter()
            .filter(|mode| {
                let label = format!("{} {mode}", case.name);
                filters.is_empty() || filters.iter().any(|f| label.contains(f.as_str()))
            })
            .collect();
        if modes.is_empty() {
            continue;
        }
        // The data of a case is generated once for all its modes.
        let t_data = Instant::now();
        let (n, d, v) = (case.n, case.d, case.v);
        let (e, c, t) = match case.data {
            Data::Lm | Data::Real => {
                // Host-side data (the generator samples targets from the softmax), then bf16.
                let ds = if matches!(case.data, Data::Lm) {
                    cce_data::generate(&cce_data::Distribution::Lm, n, d, v, 7)
                        .expect("lm generator")
                } else {
                    let Some(path) = cce_data::e12k_path() else {
                        eprintln!(
                            "{}: skipped (no 12k-row real file; set CCE_E12K)",
                            case.name
                        );
                        continue;
                    };
                    let ds = cce_data::load_real_e12k(path, cce_data::fixture_path())
                        .expect("real data");
                    assert_eq!((ds.n, ds.d, ds.v), (n, d, v), "real file's shape");
                    ds
                };
                eprintln!(
                    "{}: data ready in {:.1} s",
                    case.name,
                    t_data.elapsed().as_secs_f64()
                );
                let up = |x: &[f32], shape: Vec<usize>| {
                    be.upload(&HostTensor::from_f32(shape, x, DType::BF16).unwrap())
                        .unwrap()
                };
                let e = up(&ds.e, vec![n, d]);
                let c = up(&ds.c, vec![v, d]);
                let t = be
                    .upload(&HostTensor::from_i64(ds.targets.clone()))
                    .unwrap();
                (e, c, t)
            }
            _ => {
                let mut e = be.alloc_tensor(vec![n, d], DType::BF16).unwrap();
                let mut c = be.alloc_tensor(vec![v, d], DType::BF16).unwrap();
                let (se, sc) = match case.data {
                    Data::CDiv8 => (1.0, 0.125),
                    Data::EDiv8 => (0.125, 1.0),
                    _ => (1.0, 1.0),
                };
                be.fill_randn(&mut e, 11, 0.0, se).unwrap();
                be.fill_randn(&mut c, 12, 0.0, sc).unwrap();
                let t = be.random_targets(n, v, 0.0, -100, 13).unwrap();
                (e, c, t)
            }
        };
        // The exact call's gradients (host f32), to give each filtered call's distance from them.
        let mut exact_grads: Option<(Vec<f32>, Vec<f32>)> = None;
        for mode in modes {
            let label = format!("{} {mode}", case.name);
            let t0 = Instant::now();
            let inputs = Inputs {
                e: &e,
                c: &c,
                bias: None,
                targets: &t,
            };
            let opts = Options {
                softcap: case.softcap,
                filter_eps: if mode == "exact" {
                    FilterEps::Off
                } else {
                    FilterEps::Auto
                },
                ..Options::default()
            };
            let up = Upstream::default();
            for _ in 0..warmup {
                be.forward(&inputs, &opts).unwrap();
                be.forward_backward(&inputs, &opts, &up).unwrap();
            }
            let fwd_ms = median(
                (0..reps)
                    .map(|_| {
                        time_ms(&be, || {
                            be.forward(&inputs, &opts).unwrap();
                        })
                    })
                    .collect(),
            );
            let before = pool.used();
            pool.reset_high();
            let mut last = None;
            let fb_all: Vec<f64> = (0..reps)
                .map(|_| {
                    // Free the previous call's outputs first: the peak is one call's.
                    last = None;
                    let mut r = None;
                    let ms = time_ms(&be, || {
                        r = Some(be.forward_backward(&inputs, &opts, &up).unwrap())
                    });
                    last = r;
                    ms
                })
                .collect();
            let high = pool.high();
            let fb_ms = median(fb_all);
            let (fwd, bwd) = last.unwrap();
            let grads = [&bwd.d_e, &bwd.d_c]
                .into_iter()
                .flatten()
                .map(|g| g.nbytes() as u64)
                .sum::<u64>();
            let peak_extra = high.saturating_sub(before).saturating_sub(grads);
            let loss = be.download(&fwd.loss).unwrap().to_f32_vec()[0];
            let host = |g: &Option<CudaTensor>| {
                g.as_ref()
                    .map(|g| be.download(g).unwrap().to_f32_vec())
                    .unwrap_or_default()
            };
            let (d_e, d_c) = (host(&bwd.d_e), host(&bwd.d_c));
            let vs_exact = match (&exact_grads, mode) {
                (Some((xe, xc)), "filtered") => Some((rel_diff(&d_e, xe), rel_diff(&d_c, xc))),
                _ => None,
            };
            if mode == "exact" {
                exact_grads = Some((d_e, d_c));
            }
            drop((fwd, bwd.d_e, bwd.d_c));
            let gemm_ms = blas.as_ref().map_or(f64::NAN, |b| {
                gemm_floor(&be, b, &e, &c, n, d, v);
                median(
                    (0..reps)
                        .map(|_| gemm_floor(&be, b, &e, &c, n, d, v))
                        .collect(),
                )
            });
            let row = Row {
                case: case.name.to_string(),
                mode,
                fwd_ms,
                fb_ms,
                gemm_ms,
                peak_extra_bytes: peak_extra,
                stats: bwd.stats,
                loss,
                vs_exact,
            };
            println!(
                "{label}: fwd {:.1} ms ({:.2}x GEMM), fwd+bwd {:.1} ms ({:.2}x 3 GEMMs), GEMM {:.1} ms, peak extra {:.2} GiB, loss {:.4}, case wall {:.0} s\n{}",
                row.fwd_ms,
                row.fwd_ms / row.gemm_ms,
                row.fb_ms,
                row.fb_ms / (3.0 * row.gemm_ms),
                row.gemm_ms,
                row.peak_extra_bytes as f64 / (1u64 << 30) as f64,
                row.loss,
                t0.elapsed().as_secs_f64(),
                row.stats
            );
            let _ = e.dtype();
            rows.push(row);
        }
    }
    let mut table = String::new();
    table.push_str("| case | mode | fwd ms | fwd / GEMM | fwd+bwd ms | fwd+bwd / 3 GEMM | GEMM ms | TFLOP/s GEMM | peak extra GiB | tiles skipped | dropped max | d_e / d_c from exact | workspace MiB |\n");
    table.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for r in &rows {
        let case = CASES.iter().find(|c| c.name == r.case).unwrap();
        let flop = 2.0 * case.n as f64 * case.v as f64 * case.d as f64;
        table.push_str(&format!(
            "| {} | {} | {:.1} | {:.2} | {:.1} | {:.2} | {:.1} | {:.0} | {:.2} | {:.1}% | {:.2e} | {} | {:.0} |\n",
            r.case,
            r.mode,
            r.fwd_ms,
            r.fwd_ms / r.gemm_ms,
            r.fb_ms,
            r.fb_ms / (3.0 * r.gemm_ms),
            r.gemm_ms,
            flop / (r.gemm_ms * 1e9),
            r.peak_extra_bytes as f64 / (1u64 << 30) as f64,
            100.0 * r.stats.skipped_fraction(),
            r.stats.dropped_mass_max,
            r.vs_exact
                .map_or("".to_string(), |(a, b)| format!("{a:.1e} / {b:.1e}")),
            r.stats.workspace_bytes as f64 / (1u64 << 20) as f64,
        ));
    }
    // The path each filtered call took, in its own words (the staircase's kept share).
    for r in rows.iter().filter(|r| r.mode == "filtered") {
        let note = r
            .stats
            .plan_reason
            .split("; ")
            .find(|p| p.contains("% of the logits"));
        table.push_str(&format!("\n{} filtered: {}", r.case, note.unwrap_or("-")));
    }
    table.push('\n');
    println!("\n{table}");
    if let Some(p) = out_path {
        std::fs::write(p, &table).expect("write --out");
    }
}
