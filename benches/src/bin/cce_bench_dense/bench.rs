//! `--mode bench`: the dense strategies timed against the same run's cuBLAS GEMMs at the
//! given shapes and data, with the filtered-vs-exact errors, the kept entries and the memory.

use super::*;

/// dtype of the benchmarked gradients: bf16, f32 with `--grad-f32`.
fn grad_dtype(args: &Args) -> DType {
    if args.grad_f32 {
        DType::F32
    } else {
        DType::BF16
    }
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

pub(super) fn bench(
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
        // Outputs (gradients in bf16, or f32 with --grad-f32; they are not "extra" memory).
        let gsz = grad_dtype(args).size_bytes();
        let mut loss = alloc(stream, 4)?;
        let mut lse = alloc(stream, n * 4)?;
        let mut de = alloc(stream, n * d * gsz)?;
        let mut dc = alloc(stream, v * d * gsz)?;
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
        grad_dtype: if args.grad_f32 {
            cce_core::GradDType::F32
        } else {
            cce_core::GradDType::Input
        },
        ..Options::default()
    };
    let gdt = grad_dtype(args);
    // As the backend plans: within the budget less the cuBLAS workspace.
    let share = Options {
        workspace_budget_bytes: cce_cuda::dense::plan_budget(budget_bytes),
        ..opts.clone()
    };
    // d_c in the gradient dtype: chunked dense planned without the f32 accumulator where the
    // backend's rule takes it for the exact call (`cce_cuda::CudaSwitches::dc_in_grad_dtype`).
    let exact_opts = Options {
        filter_eps: FilterEps::Off,
        ..opts.clone()
    };
    let dc_low = kind == StrategyKind::ChunkedDense
        && cce_cuda::dense::dc_in_grad_dtype(problem, &exact_opts, args.switches.dc_in_grad_dtype);
    let plan_opts = Options {
        grad_dtype: if dc_low {
            cce_core::GradDType::F32
        } else {
            share.grad_dtype
        },
        ..share.clone()
    };
    let plan = Plan::new(problem, &plan_opts, &cuda_limits(128, kind))?;
    let mut cfg = DenseConfig::from_plan(&plan, &opts)?;
    cfg.dc_in_grad_dtype = dc_low;
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
    let de_exact = to_f64(stream, &*de, gdt, n * d)?;
    let dc_exact = to_f64(stream, &*dc, gdt, v * d)?;
    if cfg_exact.dc_in_grad_dtype {
        // The same call with the f32 accumulator (its own workspace, over the budget): how far
        // the bf16 running sum moved d_c.
        let mut cfg_ref = cfg_exact.clone();
        cfg_ref.dc_in_grad_dtype = false;
        let mut ws_ref = DenseWorkspace::new(engine, &cfg_ref)?;
        run_fb(
            &cfg_ref,
            &mut ws_ref,
            (&mut *loss, &mut *lse, &mut rest, &mut *de, &mut *dc),
        )?;
        stream.synchronize()?;
        let dc_ref = to_f64(stream, &*dc, gdt, v * d)?;
        println!(
            "  exact, d_c accumulated in bf16: rel. difference from the f32 accumulator {:.2e} \
             ({})",
            rel_err(&dc_exact, &dc_ref),
            exact_stats.row_pass_note.as_deref().unwrap_or("")
        );
    }
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
        let old = to_f64(stream, grad, gdt, count)?;
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
    let err_de = rel_err(&to_f64(stream, &*de, gdt, n * d)?, &de_exact);
    let err_dc = rel_err(&to_f64(stream, &*dc, gdt, v * d)?, &dc_exact);
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
