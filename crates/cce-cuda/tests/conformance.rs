//! Conformance of the CUDA backend against the f64 naive oracle (MATH.md, "How results are
//! judged"), on hostile shapes, every option, every dtype, fresh random inputs (never zeros).
//! Each test prints "skipping: <reason>" and passes when no CUDA device or library is present.

mod common;

use cce_core::{
    Backend, DType, FilterEps, GradDType, HostTensor, Inputs, Options, Reduction, SideOutputs,
    TensorMeta, Upstream,
};
use cce_cuda::{CudaBackend, CudaTensor};
use cce_reference::{naive, OracleDLoss, Precision};
use common::*;
use rand::Rng;

use common::spec::*;

#[test]
fn exact_mode_every_option_every_dtype() {
    let Some(be) = backend("exact_mode_every_option_every_dtype") else {
        return;
    };
    let mut rng = seeded();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for sp in variants(252, 123, 507, dtype) {
            eprintln!("{}", check(&be, &mut rng, &sp));
        }
    }
}

#[test]
fn exact_mode_hostile_shapes() {
    let Some(be) = backend("exact_mode_hostile_shapes") else {
        return;
    };
    let mut rng = seeded();
    // 1x1x1; off every tile multiple; one tile + 1; V mod 128 in {1, 126, 127}; D > 256 with
    // bias; D not a multiple of the 16-byte vector width.
    let shapes = [
        (1, 1, 1, false),
        (252, 123, 507, false),
        (129, 64, 129, false),
        (200, 40, 385, true),
        (130, 72, 382, false),
        (70, 48, 383, false),
        (150, 300, 300, true),
        (33, 7, 1000, false),
        (300, 16, 2, true),
    ];
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (k, &(n, d, v, bias)) in shapes.iter().enumerate() {
            let vs = variants(n, d, v, dtype);
            let mut base = spec(n, d, v, dtype, "mean");
            base.bias = bias;
            eprintln!("{}", check(&be, &mut rng, &base));
            // One more option per shape, rotating through the variants.
            let mut extra = vs.into_iter().nth((k * 3 + dtype as usize) % 11).unwrap();
            extra.bias |= bias;
            eprintln!("{}", check(&be, &mut rng, &extra));
        }
    }
}

#[test]
fn three_dim_e_and_i32_targets() {
    let Some(be) = backend("three_dim_e_and_i32_targets") else {
        return;
    };
    let mut rng = seeded();
    let case = random_case(&mut rng, 2 * 37, 40, 300, DType::BF16, false, 0.1, 3.0);
    let e3 = case.e.clone().reshape(vec![2, 37, 40]).unwrap();
    let t32 = HostTensor::from_i32(
        case.targets
            .to_i64_vec()
            .unwrap()
            .iter()
            .map(|&x| x as i32)
            .collect(),
    )
    .reshape(vec![2, 37])
    .unwrap();
    let opts = Options {
        shift: 1,
        ..Options::exact()
    };
    let (e, c, t) = (upload(&be, &e3), upload(&be, &case.c), upload(&be, &t32));
    let inputs = Inputs {
        e: &e,
        c: &c,
        bias: None,
        targets: &t,
    };
    let (fwd, bwd) = be
        .forward_backward(&inputs, &opts, &Upstream::default())
        .unwrap();
    let gt = naive(
        &e3,
        &case.c,
        None,
        &t32,
        &opts,
        &OracleDLoss::Scalar(1.0),
        None,
        Precision::F64,
    )
    .unwrap();
    let rf = naive(
        &e3,
        &case.c,
        None,
        &t32,
        &opts,
        &OracleDLoss::Scalar(1.0),
        None,
        Precision::SameDtype,
    )
    .unwrap();
    judge(
        "3-d loss",
        &to_f64(&be, &fwd.loss),
        &gt.loss,
        &rf.loss,
        1e-2,
        true,
    );
    let d_e = bwd.d_e.unwrap();
    assert_eq!(d_e.shape(), &[2, 37, 40]);
    judge("3-d d_e", &to_f64(&be, &d_e), &gt.d_e, &rf.d_e, 1e-2, false);
}

/// One filtered forward+backward of a random case (sum reduction, f32 gradients, 10% ignored
/// rows), judged against the f64 oracle: per row, the `d_e` error beyond the exact call's is at
/// most `dropped_i · max ‖c_j‖`; the `d_c` error at most `N · mean dropped · max ‖e_i‖`.
/// Returns the filtered call's statistics.
#[allow(clippy::too_many_arguments)]
fn filtered_check(
    be: &CudaBackend,
    rng: &mut impl Rng,
    dtype: DType,
    logit_std: f64,
    (n, d, v): (usize, usize, usize),
    bias: bool,
    softcap: Option<f32>,
    delta: f32,
    filter_eps: f32,
) -> cce_core::CallStats {
    filtered_check_hot(
        be,
        rng,
        dtype,
        logit_std,
        (n, d, v),
        bias,
        softcap,
        delta,
        filter_eps,
        (0, 0),
    )
}

/// [`filtered_check`] with the first `hot_rows` rows' targets on one class (chosen at
/// random), so that class gathers `hot_rows` records in the sparse backward's `d_c` (above
/// 128: the heavy-class kernel).
#[allow(clippy::too_many_arguments)]
fn filtered_check_hot(
    be: &CudaBackend,
    rng: &mut impl Rng,
    dtype: DType,
    logit_std: f64,
    (n, d, v): (usize, usize, usize),
    bias: bool,
    softcap: Option<f32>,
    delta: f32,
    filter_eps: f32,
    (hot_rows, flat_rows): (usize, usize),
) -> cce_core::CallStats {
    let mut case = random_case(rng, n, d, v, dtype, bias, 0.1, logit_std);
    if flat_rows > 0 {
        // The first rows' logits at a quarter of the scale: flatter softmax, lse − max larger
        // than in the rows after them.
        let mut ev = case.e.to_f64_vec();
        ev.iter_mut().take(flat_rows * d).for_each(|x| *x *= 0.25);
        let ev: Vec<f32> = ev.iter().map(|&x| x as f32).collect();
        case.e = HostTensor::from_f32(case.e.shape().to_vec(), &ev, dtype).unwrap();
    }
    if hot_rows > 0 {
        let hot = rng.random_range(0..v as i64);
        let mut t = case.targets.to_i64_vec().unwrap();
        t.iter_mut().take(hot_rows).for_each(|x| *x = hot);
        case.targets = HostTensor::from_i64(t);
    }
    let opts = Options {
        filter_eps: FilterEps::Value(filter_eps),
        max_dropped_mass: delta,
        reduction: Reduction::Sum,
        grad_dtype: GradDType::F32,
        softcap,
        ..Default::default()
    };
    let exact_opts = Options {
        filter_eps: FilterEps::Off,
        ..opts.clone()
    };
    let dev = DeviceCase::new(be, &case);
    let inputs = dev.inputs();
    let (fo, g) = be
        .forward_backward(&inputs, &opts, &Upstream::default())
        .unwrap();
    let (fox, gx) = be
        .forward_backward(&inputs, &exact_opts, &Upstream::default())
        .unwrap();
    let s = g.stats.clone();
    assert!(s.dropped_mass_max <= delta as f64 + 1e-6, "{s}");
    let gt = unit_upstream_oracle(&case, &opts, Precision::F64);
    // The forward outputs of the filtered call (on the sparse path, select computes them) are
    // as close to f64 as the exact call's: lse per row, and the summed loss.
    let (lse, lsex) = (to_f64(be, &fo.lse), to_f64(be, &fox.lse));
    for i in 0..n {
        let (err, base) = ((lse[i] - gt.lse[i]).abs(), (lsex[i] - gt.lse[i]).abs());
        let bound = 2.0 * base + 1e-5 * (1.0 + gt.lse[i].abs());
        assert!(
            err <= bound,
            "{dtype} std {logit_std} row {i}: lse {} vs f64 {} (exact call {})\n{s}",
            lse[i],
            gt.lse[i],
            lsex[i]
        );
    }
    let (loss, lossx) = (to_f64(be, &fo.loss)[0], to_f64(be, &fox.loss)[0]);
    let loss_bound = 2.0 * (lossx - gt.loss[0]).abs() + 1e-5 * (1.0 + gt.loss[0].abs());
    assert!(
        (loss - gt.loss[0]).abs() <= loss_bound,
        "{dtype} std {logit_std}: loss {loss} vs f64 {} (exact call {lossx})\n{s}",
        gt.loss[0]
    );
    let cv = case.c.to_f64_vec();
    let ev = case.e.to_f64_vec();
    let norm_max = |m: &[f64]| {
        m.chunks(d)
            .map(|r| r.iter().map(|x| x * x).sum::<f64>().sqrt())
            .fold(0.0, f64::max)
    };
    let (cmax, emax) = (norm_max(&cv), norm_max(&ev));
    let d_e = to_f64(be, g.d_e.as_ref().unwrap());
    let d_ex = to_f64(be, gx.d_e.as_ref().unwrap());
    // Softcap scales an entry by 1 − (z/s)² ≤ 1, so the same bounds hold.
    for i in 0..n {
        let row_err = |m: &[f64]| {
            (0..d)
                .map(|k| (m[i * d + k] - gt.d_e[i * d + k]).powi(2))
                .sum::<f64>()
                .sqrt()
        };
        // ‖Σ_skipped G_ij c_j‖ ≤ dropped_i · max ‖c_j‖ (|g_i| = 1, sum reduction).
        let (err, base) = (row_err(&d_e), row_err(&d_ex));
        let bound = s.dropped_mass_max * cmax + base + 1e-5;
        assert!(
            err <= bound,
            "{dtype} std {logit_std} row {i}: err {err} > {bound}\n{s}"
        );
    }
    // d_c: ‖Σ_skipped G_ij e_i‖ ≤ Σ_i dropped_i · max ‖e_i‖ = N · mean dropped · max ‖e‖.
    let d_c = to_f64(be, g.d_c.as_ref().unwrap());
    let d_cx = to_f64(be, gx.d_c.as_ref().unwrap());
    let tot = |m: &[f64], gt: &[f64]| {
        m.iter()
            .zip(gt)
            .map(|(a, b)| (a - b) * (a - b))
            .sum::<f64>()
            .sqrt()
    };
    let bound = n as f64 * s.dropped_mass_mean * emax + tot(&d_cx, &gt.d_c) + 1e-5;
    assert!(
        tot(&d_c, &gt.d_c) <= bound,
        "{dtype} std {logit_std}: d_c err {} > {bound}\n{s}",
        tot(&d_c, &gt.d_c)
    );
    if let (Some(db), Some(dbx), Some(gtb)) =
        (g.d_bias.as_ref(), gx.d_bias.as_ref(), gt.d_bias.as_ref())
    {
        let (db, dbx) = (to_f64(be, db), to_f64(be, dbx));
        let bound = n as f64 * s.dropped_mass_mean + tot(&dbx, gtb) + 1e-5;
        assert!(
            tot(&db, gtb) <= bound,
            "{dtype} std {logit_std}: d_bias\n{s}"
        );
    }
    eprintln!(
        "{dtype} logit std {logit_std} {n}x{d}x{v}: d_e rel {:.2e} (exact {:.2e}), d_c rel {:.2e} (exact {:.2e}), skipped {}/{} tiles, kept {} entries, dropped max {:.2e} mean {:.2e}",
        rel(&d_e, &gt.d_e),
        rel(&d_ex, &gt.d_e),
        rel(&d_c, &gt.d_c),
        rel(&d_cx, &gt.d_c),
        s.tiles_skipped,
        s.tiles_visited + s.tiles_skipped,
        s.entries_kept,
        s.dropped_mass_max,
        s.dropped_mass_mean
    );
    s
}

#[test]
fn sparse_backward_is_bounded_by_the_dropped_mass_and_gives_way_when_it_does_not_pay() {
    if backend("sparse_backward_is_bounded_by_the_dropped_mass_and_gives_way_when_it_does_not_pay")
        .is_none()
    {
        return;
    }
    use cce_core::StrategyKind::SplitDense;
    use cce_cuda::SparseMode;
    let mut rng = seeded();
    // Auto on peaked rows of a wide vocabulary (a few kept entries per row, under V / 256):
    // the sparse backward runs; several row chunks (cap 128 rows), odd D, bias and softcap.
    let auto = || {
        CudaBackend::new(0)
            .unwrap()
            .with_strategies(&[SplitDense])
            .unwrap()
            .with_chunk_cap(128, 128)
            .unwrap()
    };
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for (n, d, v, bias, softcap) in [
            (300, 64, 8192, false, None),
            (257, 37, 5003, true, None),
            (130, 40, 4099, true, Some(100.0)),
        ] {
            let s = filtered_check(
                &auto(),
                &mut rng,
                dtype,
                30.0,
                (n, d, v),
                bias,
                softcap,
                1e-3,
                2f32.powi(-12),
            );
            assert!(s.plan_reason.starts_with("sparse backward:"), "{s}");
            let active = (s.entries_kept + s.entries_skipped) / (2 * v as u64);
            assert!(
                s.entries_kept < 2 * active * (v as u64 / 64),
                "peaked rows keep few entries\n{s}"
            );
        }
    }
    // d_c's class lists: one class with the targets of 600 rows (> 128 records: the heavy
    // kernel) beside light ones; 16-byte loads (D = 40) and scalar ones (D = 37).
    for dtype in [DType::F32, DType::BF16] {
        for d in [40, 37] {
            let s = filtered_check_hot(
                &auto(),
                &mut rng,
                dtype,
                30.0,
                (900, d, 6001),
                true,
                None,
                1e-3,
                2f32.powi(-12),
                (600, 0),
            );
            assert!(s.plan_reason.starts_with("sparse backward:"), "{s}");
        }
    }
    // The folded forward's cut uses the probe's lse − max: a flatter probe (the first 128
    // rows) than the rows after it makes those rows' check fail, and they take the full
    // pass (exact); judged the same way, lse and loss included.
    for dtype in [DType::F32, DType::BF16] {
        let s = filtered_check_hot(
            &auto().with_sparse(SparseMode::Always),
            &mut rng,
            dtype,
            30.0,
            (300, 48, 3000),
            false,
            None,
            1e-3,
            2f32.powi(-12),
            (0, 128),
        );
        assert!(s.plan_reason.starts_with("sparse backward:"), "{s}");
    }
    // Auto on flat rows: most entries are kept, the dense passes run (and say why).
    for dtype in [DType::F32, DType::BF16] {
        let s = filtered_check(
            &auto(),
            &mut rng,
            dtype,
            1.0,
            (200, 48, 3000),
            false,
            None,
            1e-3,
            2f32.powi(-12),
        );
        // The probe chunk's logits and forward rows are reused where they sit where the row
        // pass wants them (no f16 copy of c in front: f32 inputs here).
        let reused = "dense passes (the first chunk's logits reused): the first";
        if dtype == DType::F32 {
            assert!(s.plan_reason.starts_with(reused), "{s}");
        } else {
            assert!(
                s.plan_reason.starts_with(reused)
                    || s.plan_reason.starts_with("dense passes: the first"),
                "{s}"
            );
        }
    }
    // Always on moderately peaked rows (hostile shapes, one row, V below one tile): sparse at
    // any density, judged the same way. d_e per chunk where the rows keep 2 pairs per class
    // or more, else in one launch after the row pass: the last two cases keep hundreds of
    // pairs per row (several 32-record batches) on few rows, the last one with D past one
    // 256-column slice of 16-bit loads.
    let always = || auto().with_sparse(SparseMode::Always);
    for dtype in [DType::F32, DType::BF16] {
        for (n, d, v, std) in [
            (1, 5, 7, 4.0),
            (129, 33, 1000, 4.0),
            (64, 16, 300, 8.0),
            (8, 40, 3000, 3.0),
            (8, 264, 3000, 3.0),
        ] {
            let s = filtered_check(
                &always(),
                &mut rng,
                dtype,
                std,
                (n, d, v),
                true,
                None,
                2e-2,
                1e-2,
            );
            assert!(s.plan_reason.starts_with("sparse backward:"), "{s}");
        }
    }
    // Always on flat rows of a long batch: every entry is kept, the pairs outgrow the
    // capacity, and the dense passes run instead.
    let s = filtered_check(
        &always(),
        &mut rng,
        DType::BF16,
        0.05,
        (2048, 16, 3000),
        false,
        None,
        1e-3,
        2f32.powi(-12),
    );
    assert!(s.plan_reason.starts_with("dense passes"), "{s}");
    // Flat rows over 16384 classes: each select warp sees 1024 candidates, more than its
    // slots (the folded select compacts them, then takes the full pass; the pairs may outgrow
    // the capacity and the dense passes finish the call). Under racecheck (session 7 run 2)
    // this case showed no hazard in our kernels, one in a cuBLAS split-K kernel: it lives here,
    // not in sanitizer_smoke.
    let s = filtered_check(
        &always(),
        &mut rng,
        DType::BF16,
        1.0,
        (64, 16, 16384),
        false,
        None,
        1e-3,
        2f32.powi(-12),
    );
    eprintln!("flat rows, 16384 classes: {}", s.plan_reason);
    // Off: the dense passes.
    let s = filtered_check(
        &auto().with_sparse(SparseMode::Off),
        &mut rng,
        DType::BF16,
        30.0,
        (300, 64, 8192),
        false,
        None,
        1e-3,
        2f32.powi(-12),
    );
    assert!(!s.plan_reason.contains("sparse backward:"), "{s}");
}

#[test]
fn real_fixture_loss_lse_and_default_filter_accuracy() {
    let Some(be) = backend("real_fixture_loss_lse_and_default_filter_accuracy") else {
        return;
    };
    let Some(fx) = load_fixture() else {
        eprintln!("skipping real_fixture: data/smollm2_lce_real_1k.safetensors not found");
        return;
    };
    let t = HostTensor::from_i64(fx.targets.clone());
    let e32 = HostTensor::from_f32(vec![1024, 576], &fx.e, DType::F32).unwrap();
    let c32 = HostTensor::from_f32(vec![49152, 576], &fx.c, DType::F32).unwrap();
    let td = upload(&be, &t);
    let (e, c) = (upload(&be, &e32), upload(&be, &c32));
    let inputs = Inputs {
        e: &e,
        c: &c,
        bias: None,
        targets: &td,
    };
    let fwd = be.forward(&inputs, &Options::default()).unwrap();
    let loss = to_f64(&be, &fwd.loss)[0];
    assert!(((loss - 2.142760) / 2.142760).abs() < 1e-5, "loss {loss}");
    let worst = to_f64(&be, &fwd.lse)
        .iter()
        .zip(&fx.lse_ref)
        .map(|(a, b)| (a - *b as f64).abs())
        .fold(0.0, f64::max);
    // f32 accumulation over D = 576 of products up to ~10^2 (|e| ~ 50-1000): ~1e-4 absolute.
    assert!(worst < 1.5e-4, "lse max abs error {worst}");
    eprintln!("real fixture f32: loss {loss:.6} (ref 2.142760), worst lse error {worst:.2e}");

    let e16 = HostTensor::from_f32(vec![1024, 576], &fx.e, DType::BF16).unwrap();
    let c16 = HostTensor::from_f32(vec![49152, 576], &fx.c, DType::BF16).unwrap();
    let (e, c) = (upload(&be, &e16), upload(&be, &c16));
    let inputs = Inputs {
        e: &e,
        c: &c,
        bias: None,
        targets: &td,
    };
    let opts = Options {
        grad_dtype: GradDType::F32,
        ..Default::default()
    };
    let gt = naive(
        &e16,
        &c16,
        None,
        &t,
        &opts,
        &OracleDLoss::Scalar(1.0),
        None,
        Precision::F64,
    )
    .unwrap();
    let (_, g) = be
        .forward_backward(&inputs, &opts, &Upstream::default())
        .unwrap();
    let re = rel(&to_f64(&be, g.d_e.as_ref().unwrap()), &gt.d_e);
    let rc = rel(&to_f64(&be, g.d_c.as_ref().unwrap()), &gt.d_c);
    eprintln!(
        "real fixture bf16, default filter: d_e rel {re:.3e}, d_c rel {rc:.3e}\n{}",
        g.stats
    );
    assert!(g.stats.dropped_mass_max <= 1e-3 + 1e-7);
    assert!(
        re <= 0.0027,
        "d_e rel error {re} above the original's 0.27%"
    );
    assert!(
        rc <= 0.0005,
        "d_c rel error {rc} above the original's 0.05%"
    );
    let (_, gx) = be
        .forward_backward(
            &inputs,
            &Options {
                filter_eps: FilterEps::Off,
                ..opts
            },
            &Upstream::default(),
        )
        .unwrap();
    let rex = rel(&to_f64(&be, gx.d_e.as_ref().unwrap()), &gt.d_e);
    let rcx = rel(&to_f64(&be, gx.d_c.as_ref().unwrap()), &gt.d_c);
    eprintln!("real fixture bf16, exact: d_e rel {rex:.3e}, d_c rel {rcx:.3e}");
    assert!(rex <= 5e-3 && rcx <= 5e-3);
}

#[test]
fn bitwise_repeatable() {
    let Some(be) = backend("bitwise_repeatable") else {
        return;
    };
    let mut rng = seeded();
    let case = random_case(&mut rng, 300, 96, 1000, DType::BF16, true, 0.1, 4.0);
    let dev = DeviceCase::new(&be, &case);
    let inputs = dev.inputs();
    let run = || {
        let (f, g) = be
            .forward_backward(&inputs, &Options::default(), &Upstream::default())
            .unwrap();
        let dl = |x: &CudaTensor| be.download(x).unwrap();
        (
            dl(&f.loss),
            dl(&f.lse),
            dl(g.d_e.as_ref().unwrap()),
            dl(g.d_c.as_ref().unwrap()),
            dl(g.d_bias.as_ref().unwrap()),
        )
    };
    assert_eq!(run(), run());
}

/// Small cases for compute-sanitizer (memcheck, racecheck): every dtype, exact and filtered,
/// bias, analytic label smoothing, softcap, partial tiles, D off the vector width.
#[test]
fn sanitizer_smoke() {
    let Some(be) = backend("sanitizer_smoke") else {
        return;
    };
    let sparse_be = CudaBackend::new(0)
        .unwrap()
        .with_strategies(&[cce_core::StrategyKind::SplitDense])
        .unwrap()
        .with_chunk_cap(64, 128)
        .unwrap()
        .with_sparse(cce_cuda::SparseMode::Always);
    let mut rng = seeded();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let mut s = spec(130, 36, 260, dtype, "exact+bias+ls");
        s.bias = true;
        s.opts.label_smoothing = 0.1;
        s.ignored = 0.2;
        eprintln!("{}", check(&be, &mut rng, &s));
        let mut s = spec(130, 33, 300, dtype, "filtered+softcap+peaked");
        s.opts.filter_eps = FilterEps::Value(1e-2);
        s.opts.max_dropped_mass = 0.05;
        s.opts.softcap = Some(20.0);
        s.logit_std = 30.0;
        // Filtered: only check that it runs clean; accuracy is judged elsewhere.
        let case = random_case(&mut rng, s.n, s.d, s.v, dtype, true, 0.1, s.logit_std);
        let dev = DeviceCase::new(&be, &case);
        let inputs = dev.inputs();
        let (_, g) = be
            .forward_backward(&inputs, &s.opts, &Upstream::default())
            .unwrap();
        eprintln!(
            "{dtype} filtered smoke: {} skipped of {}",
            g.stats.tiles_skipped,
            g.stats.tiles_visited + g.stats.tiles_skipped
        );
        // The sparse backward's kernels (select, gathers, regrouping by class) on the same
        // inputs, in 64-row chunks.
        let (_, g) = sparse_be
            .forward_backward(&inputs, &s.opts, &Upstream::default())
            .unwrap();
        assert!(
            g.stats.plan_reason.starts_with("sparse backward:"),
            "{}",
            g.stats
        );
        eprintln!("{dtype} sparse smoke: {} kept", g.stats.entries_kept);
        // The class-tiled forward (two streams, 128-row x 128-class tiles: 2 row groups of 3
        // tiles) on the same inputs: its lse next to the row chunks' one.
        let (f_rows, _) = sparse_be
            .forward_backward(&inputs, &s.opts, &Upstream::default())
            .unwrap();
        let f = sparse_be.forward(&inputs, &s.opts).unwrap();
        assert!(
            f.stats.plan_reason.starts_with("forward: 6 GEMM tile(s)"),
            "{}",
            f.stats.plan_reason
        );
        // lse and loss (the target logit carried across tiles in the row state) agree.
        for (what, a, b) in [
            ("lse", to_f64(&be, &f.lse), to_f64(&be, &f_rows.lse)),
            ("loss", to_f64(&be, &f.loss), to_f64(&be, &f_rows.loss)),
        ] {
            assert_eq!(a.len(), b.len());
            for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                assert!(
                    (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                    "row {i}: {what} {x} vs {y}"
                );
            }
        }
        // The WGMMA kernels (sm_90a, 16-bit, D % 64 == 0): split dense's class pass with G in
        // the epilogue (with bias + softcap, then plain: both kernels), and the fused forward.
        if dtype != DType::F32 && be.arch() == "sm_90a" {
            let split_be = CudaBackend::new(0)
                .unwrap()
                .with_strategies(&[cce_core::StrategyKind::SplitDense])
                .unwrap()
                .with_chunk_cap(64, 128)
                .unwrap();
            let mut s = spec(130, 64, 300, dtype, "wgmma class pass+bias+ls+z_loss(+cap)");
            s.bias = true;
            s.opts.label_smoothing = 0.1;
            s.opts.z_loss = 1e-3;
            s.opts.softcap = (dtype == DType::BF16).then_some(10.0);
            s.ignored = 0.1;
            eprintln!("{}", check(&split_be, &mut rng, &s));
            let mut s = spec(130, 64, 300, dtype, "wgmma class pass+forward");
            s.opts.side_outputs = SideOutputs::default();
            eprintln!("{}", check(&split_be, &mut rng, &s));
            // The row pass's epilogue (bf16 G for d_e): q through TMA stores, the combine and
            // G from q, with bias + softcap (the _x and _cap kernels), then plain.
            if dtype == DType::BF16 {
                let rows_be = CudaBackend::new(0)
                    .unwrap()
                    .with_strategies(&[cce_core::StrategyKind::SplitDense])
                    .unwrap()
                    .with_chunk_cap(64, 128)
                    .unwrap()
                    .with_split_de_f16(false);
                let mut s = spec(130, 64, 300, dtype, "wgmma row pass+bias+softcap+z_loss");
                s.opts.side_outputs = SideOutputs::default();
                s.bias = true;
                s.opts.z_loss = 1e-3;
                s.opts.softcap = Some(10.0);
                s.ignored = 0.1;
                eprintln!("{}", check(&rows_be, &mut rng, &s));
                let mut s = spec(130, 64, 301, dtype, "wgmma row pass");
                s.opts.side_outputs = SideOutputs::default();
                eprintln!("{}", check(&rows_be, &mut rng, &s));
                // Chunked dense's row pass through the same epilogue (the default backend,
                // several 64-row chunks accumulating d_c), and a filtered call on flat rows
                // whose sparse backward gives way and runs again on that plan, its workspace
                // kept in the engine's pool in between.
                let chunked_be = CudaBackend::new(0)
                    .unwrap()
                    .with_chunk_cap(64, 128)
                    .unwrap();
                let mut s = spec(130, 64, 300, dtype, "chunked wgmma row pass+bias+softcap");
                s.opts.side_outputs = SideOutputs::default();
                s.bias = true;
                s.opts.softcap = Some(10.0);
                eprintln!("{}", check(&chunked_be, &mut rng, &s));
                let flat = random_case(&mut rng, 200, 64, 3000, dtype, false, 0.1, 1.0);
                let dev = DeviceCase::new(&chunked_be, &flat);
                let (_, g) = chunked_be
                    .forward_backward(&dev.inputs(), &Options::default(), &Upstream::default())
                    .unwrap();
                eprintln!("give-way smoke: {}", g.stats.plan_reason);
            }
        }
    }
}

/// Every output of `a` and `b` has the same bytes (`what` names the call in the message).
fn assert_same_bytes(be: &CudaBackend, a: &CudaTensor, b: &CudaTensor, what: &str) {
    let (ha, hb) = (be.download(a).unwrap(), be.download(b).unwrap());
    assert!(ha.as_bytes() == hb.as_bytes(), "{what}: the bytes differ");
}

#[test]
fn a_filtered_call_whose_sparse_backward_gives_way_runs_as_the_exact_call() {
    let Some(be) =
        backend("a_filtered_call_whose_sparse_backward_gives_way_runs_as_the_exact_call")
    else {
        return;
    };
    use cce_core::Strategy;
    // With the staircase off: where it is on, a bf16 call whose sparse try gave way takes the
    // staircase instead (the suite judges those calls).
    let be = {
        let s = be.switches();
        be.with_switches(cce_cuda::CudaSwitches {
            staircase: false,
            ..s
        })
    };
    let mut rng = seeded();
    // Flat rows (logit std 1): the probe keeps most entries and the sparse backward gives way.
    // The exact call of these shapes runs chunked dense (bf16 and f32 gradients in the input
    // dtype), so the filtered call runs again on that plan: the same bytes as the exact call,
    // nothing dropped, and its statistics say why.
    for dtype in [DType::F32, DType::BF16] {
        for (n, d, v, bias, softcap) in [
            (600, 64, 4099, false, None),
            (333, 37, 5003, true, Some(30.0)),
        ] {
            let case = random_case(&mut rng, n, d, v, dtype, bias, 0.1, 1.0);
            let opts = Options {
                softcap,
                ..Default::default()
            };
            let exact = Options {
                filter_eps: FilterEps::Off,
                ..opts.clone()
            };
            let dev = DeviceCase::new(&be, &case);
            let up = Upstream::default();
            let (fo, g) = be.forward_backward(&dev.inputs(), &opts, &up).unwrap();
            let (fx, gx) = be.forward_backward(&dev.inputs(), &exact, &up).unwrap();
            let s = &g.stats;
            let what = format!("{dtype} {n}x{d}x{v} bias {bias} softcap {softcap:?}");
            assert!(
                matches!(s.strategy, Strategy::ChunkedDense { .. }),
                "{what}\n{s}"
            );
            assert!(
                s.plan_reason.contains("sparse backward gave way"),
                "{what}\n{s}"
            );
            assert_eq!(s.dropped_mass_max, 0.0, "{what}\n{s}");
            assert_eq!(s.entries_skipped, 0, "{what}\n{s}");
            for (a, b, name) in [
                (&fo.loss, &fx.loss, "loss"),
                (&fo.lse, &fx.lse, "lse"),
                (g.d_e.as_ref().unwrap(), gx.d_e.as_ref().unwrap(), "d_e"),
                (g.d_c.as_ref().unwrap(), gx.d_c.as_ref().unwrap(), "d_c"),
            ] {
                assert_same_bytes(&be, a, b, &format!("{what} {name}"));
            }
            if let (Some(a), Some(b)) = (g.d_bias.as_ref(), gx.d_bias.as_ref()) {
                assert_same_bytes(&be, a, b, &format!("{what} d_bias"));
            }
            eprintln!("{what}: {s}");
        }
    }
}
