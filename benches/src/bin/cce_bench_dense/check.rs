//! `--mode check`: every dense path against the f64 oracle on small hostile cases (each row
//! pass, split and chunked dense, filtered and exact), printed as a table; the binary fails
//! when a case breaks the conformance rule.

use super::*;

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
        stop_on_give_way: false,
        dc_in_grad_dtype: false,
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

pub(super) fn check(engine: &DenseEngine, stream: &Arc<CudaStream>) -> Res<()> {
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
