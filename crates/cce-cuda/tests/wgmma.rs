//! The WGMMA paths of the CUDA backend (Hopper, `kernels/wgmma.cu`): the fused forward, split
//! dense's row pass and class pass through their epilogues, against the f64 oracle and the
//! cuBLAS paths of the same inputs. Each test prints "skipping: <reason>" and passes when no
//! CUDA device or library is present; on other architectures only the fallback is checked.

mod common;

use cce_core::{Backend, DLoss, DType, Inputs, Options, Reduction, SideOutputs, Upstream};
use cce_cuda::CudaBackend;
use cce_reference::{naive, OracleDLoss, Precision};
use common::spec::*;
use common::wgmma::*;
use common::*;

/// Whether forward-only dense calls should take the fused WGMMA forward on this device
/// (compute capability 9.0).
fn wgmma_expected(be: &CudaBackend) -> bool {
    be.arch() == "sm_90a"
}

/// The fused WGMMA forward (`kernels/wgmma.cu`) through the backend on hostile shapes (one row;
/// rows past a 128-row tile; classes under one 256-class tile, exactly one, several with a
/// partial last one; D = 64, 128, 576), bf16 and f16, 10% ignored targets, mean and none
/// reductions, both dense strategies: lse per row and the loss judged against the f64 oracle,
/// and next to the class-tiled / row-chunk forward of the same inputs with the switch off.
/// Where it should not apply (switch off, D = 40) the old path's `plan_reason`.
#[test]
fn wgmma_forward_lse_and_loss() {
    use cce_core::StrategyKind::{ChunkedDense, SplitDense};
    let Some(be) = backend("wgmma_forward_lse_and_loss") else {
        return;
    };
    let expected = wgmma_expected(&be);
    if !expected {
        eprintln!(
            "wgmma_forward_lse_and_loss: {} (or switched off): only the fallback is checked",
            be.arch()
        );
    }
    let make = |kind, on: bool| {
        CudaBackend::new(0)
            .unwrap()
            .with_strategies(&[kind])
            .unwrap()
            .with_wgmma_forward(on)
    };
    let split_on = make(SplitDense, true);
    let split_off = make(SplitDense, false);
    let chunked_on = make(ChunkedDense, true);
    let chunked_off = make(ChunkedDense, false);
    let mut rng = seeded();
    let shapes = [
        (1, 64, 7),
        (129, 128, 5003),
        (300, 576, 600),
        (300, 64, 256),
        (129, 576, 7),
        (1, 128, 5003),
        (300, 128, 1000),
    ];
    for (si, &(n, d, v)) in shapes.iter().enumerate() {
        for dtype in [DType::BF16, DType::F16] {
            let (on, off) = if si % 2 == 0 {
                (&split_on, &split_off)
            } else {
                (&chunked_on, &chunked_off)
            };
            // random_case keeps at least one row's target (a mean over none is an error).
            let case = random_case(&mut rng, n, d, v, dtype, false, 0.1, 3.0);
            let dev = DeviceCase::new(on, &case);
            let inputs = dev.inputs();
            for reduction in [Reduction::Mean, Reduction::None] {
                let opts = Options {
                    reduction,
                    ..Options::exact()
                };
                let what = |o: &str| format!("{dtype} {n}x{d}x{v} {reduction:?}: {o}");
                let f = on
                    .forward(&inputs, &opts)
                    .unwrap_or_else(|err| panic!("{}: {err}", what("forward")));
                let reason = &f.stats.plan_reason;
                assert_eq!(
                    reason.starts_with("forward: WGMMA GEMM with the lse in its epilogue"),
                    expected,
                    "{}: {reason}",
                    what("plan_reason")
                );
                // The oracle's upstream form follows the reduction (per row for none).
                let d_loss = match reduction {
                    Reduction::None => OracleDLoss::PerRow(vec![1.0; n]),
                    _ => OracleDLoss::Scalar(1.0),
                };
                let oracle = |p: Precision| {
                    naive(
                        &case.e,
                        &case.c,
                        None,
                        &case.targets,
                        &opts,
                        &d_loss,
                        None,
                        p,
                    )
                    .unwrap()
                };
                let (gt, rf) = (oracle(Precision::F64), oracle(Precision::SameDtype));
                let tol = dtype.tolerance();
                let lse = to_f64(on, &f.lse);
                let loss = to_f64(on, &f.loss);
                let r_lse = judge(&what("lse"), &lse, &gt.lse, &rf.lse, tol, true);
                let r_loss = judge(&what("loss"), &loss, &gt.loss, &rf.loss, tol, true);
                assert!(lse.iter().all(|x| x.is_finite()), "{}", what("finite lse"));
                // The same inputs through the old forward (class tiles or row chunks).
                let g = off
                    .forward(&inputs, &opts)
                    .unwrap_or_else(|err| panic!("{}: {err}", what("forward, switch off")));
                assert!(
                    !g.stats.plan_reason.starts_with("forward: WGMMA"),
                    "{}: {}",
                    what("switch off"),
                    g.stats.plan_reason
                );
                close_rows(&what("lse vs old path"), &lse, &to_f64(off, &g.lse), 1e-4);
                close_rows(
                    &what("loss vs old path"),
                    &loss,
                    &to_f64(off, &g.loss),
                    1e-4,
                );
                eprintln!("{:<48} rel: lse {r_lse:.1e} loss {r_loss:.1e}", what("ok"));
            }
        }
    }
    // Switched off: the class-tiled forward of the plan (2 row groups x 3 class tiles).
    let capped = |on: bool| make(SplitDense, on).with_chunk_cap(64, 128).unwrap();
    let case = random_case(&mut rng, 130, 64, 300, DType::BF16, false, 0.1, 3.0);
    let off = capped(false);
    let dev = DeviceCase::new(&off, &case);
    let inputs = dev.inputs();
    let f = off.forward(&inputs, &Options::exact()).unwrap();
    assert!(
        f.stats.plan_reason.starts_with("forward: 6 GEMM tile(s)"),
        "{}",
        f.stats.plan_reason
    );
    // The same call with it on: the WGMMA forward (on sm_90).
    let on = capped(true);
    let (e2, c2, t2) = (
        upload(&on, &case.e),
        upload(&on, &case.c),
        upload(&on, &case.targets),
    );
    let inputs2 = Inputs {
        e: &e2,
        c: &c2,
        bias: None,
        targets: &t2,
    };
    let g = on.forward(&inputs2, &Options::exact()).unwrap();
    assert_eq!(
        g.stats.plan_reason.starts_with("forward: WGMMA"),
        expected,
        "{}",
        g.stats.plan_reason
    );
    close_rows(
        "capped: lse vs class tiles",
        &to_f64(&on, &g.lse),
        &to_f64(&off, &f.lse),
        1e-4,
    );
    // A bias and a softcap in the epilogue (cce_wgmma_lse_x_*): lse and loss against the f64
    // oracle and next to the class tiles, on a partial last class tile and rows past a tile.
    for (k, &(n, d, v)) in [(129, 64, 300), (1, 128, 5003), (300, 576, 600)]
        .iter()
        .enumerate()
    {
        for dtype in [DType::BF16, DType::F16] {
            let case = random_case(&mut rng, n, d, v, dtype, k != 1, 0.1, 12.0);
            let dev = DeviceCase::new(&split_on, &case);
            let inputs = dev.inputs();
            let opts = Options {
                softcap: if k == 0 { None } else { Some(5.0) },
                reduction: Reduction::Sum,
                ..Options::exact()
            };
            let what = |o: &str| format!("{dtype} {n}x{d}x{v} bias/softcap: {o}");
            let f = split_on.forward(&inputs, &opts).unwrap();
            assert_eq!(
                f.stats.plan_reason.starts_with("forward: WGMMA"),
                expected,
                "{}: {}",
                what("plan_reason"),
                f.stats.plan_reason
            );
            let oracle = |p: Precision| unit_upstream_oracle(&case, &opts, p);
            let (gt, rf) = (oracle(Precision::F64), oracle(Precision::SameDtype));
            let tol = dtype.tolerance();
            let lse = to_f64(&split_on, &f.lse);
            let r_lse = judge(&what("lse"), &lse, &gt.lse, &rf.lse, tol, true);
            let loss = to_f64(&split_on, &f.loss);
            let r_loss = judge(&what("loss"), &loss, &gt.loss, &rf.loss, tol, true);
            let g = split_off.forward(&inputs, &opts).unwrap();
            close_rows(
                &what("lse vs old path"),
                &lse,
                &to_f64(&split_off, &g.lse),
                1e-4,
            );
            eprintln!("{:<48} rel: lse {r_lse:.1e} loss {r_loss:.1e}", what("ok"));
        }
    }
    // D = 40 (not a multiple of 64), entropy: the old path, still right.
    let fallback = [("D = 40", 40, false, false), ("entropy", 64, true, true)];
    for (label, d, bias, entropy) in fallback {
        let case = random_case(&mut rng, 129, d, 300, DType::BF16, bias, 0.1, 3.0);
        let dev = DeviceCase::new(&on, &case);
        let inputs = dev.inputs();
        let opts = Options {
            side_outputs: SideOutputs {
                entropy,
                argmax: false,
            },
            ..Options::exact()
        };
        let f = on.forward(&inputs, &opts).unwrap();
        assert!(
            !f.stats.plan_reason.starts_with("forward: WGMMA"),
            "{label}: {}",
            f.stats.plan_reason
        );
        let gt = unit_upstream_oracle(&case, &opts, Precision::F64);
        let rf = unit_upstream_oracle(&case, &opts, Precision::SameDtype);
        let tol = DType::BF16.tolerance();
        judge(label, &to_f64(&on, &f.lse), &gt.lse, &rf.lse, tol, true);
        judge(label, &to_f64(&on, &f.loss), &gt.loss, &rf.loss, tol, true);
    }
}

/// The WGMMA forward in row groups: through the engine with a one-row chunk the scratch holds
/// the partials of 128 rows (V a multiple of 256), so 300 rows run as 3 groups (128, 128,
/// 44); z-loss and sum reduction; lse, per-row loss and the sum judged against the oracle.
#[test]
fn wgmma_forward_row_groups() {
    use cce_cuda::dense::{
        DenseConfig, DenseEngine, DenseForwardOut, DenseInputs, DenseWorkspace, RowPass,
    };
    let Some(be) = backend("wgmma_forward_row_groups") else {
        return;
    };
    if !wgmma_expected(&be) {
        eprintln!(
            "skipping wgmma_forward_row_groups: {} (or switched off)",
            be.arch()
        );
        return;
    }
    let engine = DenseEngine::new(be.stream().clone()).unwrap();
    let mut rng = seeded();
    for (dtype, n, d, v) in [(DType::BF16, 300, 128, 5120), (DType::F16, 257, 64, 2560)] {
        let case = random_case(&mut rng, n, d, v, dtype, false, 0.1, 3.0);
        let opts = Options {
            reduction: Reduction::Sum,
            z_loss: 1e-2,
            ..Options::exact()
        };
        let cfg = DenseConfig {
            n,
            d,
            v,
            dtype,
            has_bias: false,
            chunk_rows: 1,
            chunk_classes: None,
            de_f16: false,
            tile: (128, 128),
            softcap: None,
            label_smoothing: 0.0,
            z_loss: opts.z_loss,
            reduction: opts.reduction,
            filter: cce_core::FilterRule::resolve(&opts, dtype),
            grad_f32: false,
            compute_d_e: false,
            compute_d_c: false,
            want_entropy: false,
            want_argmax: false,
            row_pass: RowPass::TwoPass,
            sparse: None,
            class_forward: None,
            wgmma_forward: true,
            wgmma_gcols: true,
            wgmma_rows: true,
            stop_on_give_way: false,
            dc_in_grad_dtype: false,
        };
        let mut ws = DenseWorkspace::new(&engine, &cfg).unwrap();
        let (e, c) = (upload(&be, &case.e), upload(&be, &case.c));
        let raw = case.targets.to_i64_vec().unwrap();
        let prepared: Vec<i32> = raw
            .iter()
            .map(|&y| if y < 0 { -1 } else { y as i32 })
            .collect();
        let n_valid = prepared.iter().filter(|&&y| y >= 0).count();
        let bytes: Vec<u8> = prepared.iter().flat_map(|y| y.to_le_bytes()).collect();
        let t = be.stream().clone_htod(&bytes).unwrap();
        let mut loss = be.alloc_tensor(vec![], DType::F32).unwrap();
        let mut lse = be.alloc_tensor(vec![n], DType::F32).unwrap();
        let mut rest = be.alloc_tensor(vec![n], DType::F32).unwrap();
        let inp = DenseInputs {
            e: e.slice(),
            c: c.slice(),
            bias: None,
            targets: &t,
            n_valid,
            device_status: 0,
        };
        let stats = {
            let mut out = DenseForwardOut {
                loss: loss.slice_mut(),
                lse: lse.slice_mut(),
                rest: rest.slice_mut(),
                entropy: None,
                argmax: None,
            };
            engine.forward(&cfg, &mut ws, &inp, &mut out).unwrap()
        };
        let note = stats.forward.unwrap_or_default();
        let groups = n.div_ceil(128);
        assert!(
            note.starts_with("forward: WGMMA GEMM")
                && note.contains(&format!("({groups} row group(s) of up to 128 rows")),
            "{note}"
        );
        let oracle = |p: Precision| unit_upstream_oracle(&case, &opts, p);
        let (gt, rf) = (oracle(Precision::F64), oracle(Precision::SameDtype));
        let what = |o: &str| format!("{dtype} {n}x{d}x{v} row groups: {o}");
        let tol = dtype.tolerance();
        let r_lse = judge(
            &what("lse"),
            &to_f64(&be, &lse),
            &gt.lse,
            &rf.lse,
            tol,
            true,
        );
        let r_loss = judge(
            &what("loss"),
            &to_f64(&be, &loss),
            &gt.loss,
            &rf.loss,
            tol,
            true,
        );
        eprintln!(
            "{:<48} rel: lse {r_lse:.1e} loss {r_loss:.1e}; {note}",
            what("ok")
        );
    }
}

/// Split dense's class pass through the WGMMA `G` epilogue (`kernels/wgmma.cu`
/// `cce_wgmma_gcols_*`) on hostile shapes: one row; rows past a 128-row tile; classes under one
/// 256-class tile, one more than a tile, several chunks with a partial last tile; D = 64, 128,
/// 192, 576; bias and label smoothing; chunks capped at 64 rows x 128 classes, and at 64 x 384
/// (softcap 50); bf16 and f16. The WGMMA chunks take what the scratch of 64-row chunks holds,
/// up to 8x the class cap (`DenseConfig::gcols_layout`, whose unit test pins these sizes);
/// classes per chunk, bf16 / f16: V = 5003: 1024 / 1024 (5 chunks, bf16's `d_c` in 512-class
/// sub-chunks; f16 has no f32 `d_c` temp, so one `d_c` GEMM per chunk); V = 600: 256 / 256
/// (bf16's `d_c` in 128-class sub-chunks); V = 257: 256 + 1 (`d_c` in 128-class sub-chunks) /
/// one chunk of 257; V = 1000: 256 / 512; at the 384 cap 768 / 768 (three tiles) and a last
/// chunk of 232, bf16's `d_c` in 384-class sub-chunks. Every option of `variants`
/// (bias, softcap, label smoothing, z-loss, per-row and lse upstreams, ignored rows, shift,
/// f32 gradients, peaked and flat rows) is judged against the f64 oracle by `check`, rotating
/// through them per shape (f16 with a softcap: `cce_wgmma_gcols_cap_*`). The backward's
/// `plan_reason` must name the epilogue on sm_90a (and the cuBLAS class pass with the switch
/// off), and `d_c` and `d_bias` must match the switched-off path's. A softcap above
/// `WGMMA_SOFTCAP_MAX` must keep the cuBLAS class pass and the class-tiled forward.
#[test]
fn wgmma_gcols_class_pass() {
    use cce_core::StrategyKind::SplitDense;
    let Some(be) = backend("wgmma_gcols_class_pass") else {
        return;
    };
    let expected = epilogue_expected(&be, "wgmma_gcols_class_pass");
    let make = |on: bool, classes: usize| {
        CudaBackend::new(0)
            .unwrap()
            .with_strategies(&[SplitDense])
            .unwrap()
            .with_chunk_cap(64, classes)
            .unwrap()
            .with_wgmma_gcols(on)
    };
    let (on128, off128) = (make(true, 128), make(false, 128));
    // 384-class chunks: WGMMA chunks of 768 classes (3 tiles: targets and bias in tiles 1-2 of
    // a chunk that starts past class 0), a last chunk of 232, d_c in 384-class sub-chunks
    // (bf16; f16 one d_c GEMM per chunk).
    let (on384, off384) = (make(true, 384), make(false, 384));
    let mut rng = seeded();
    let shapes = [
        (1, 64, 7, 128),
        (129, 128, 5003, 128),
        (300, 576, 600, 128),
        (130, 64, 257, 128),
        (257, 192, 1000, 128),
        (200, 128, 1000, 384),
    ];
    let mut k = 0usize;
    for &(n, d, v, classes) in &shapes {
        let (on, off) = if classes == 384 {
            (&on384, &off384)
        } else {
            (&on128, &off128)
        };
        for dtype in [DType::BF16, DType::F16] {
            // plan_reason and d_c against the cuBLAS class pass on the same inputs.
            // random_case keeps at least one row's target (a mean over none is an error).
            let case = random_case(&mut rng, n, d, v, dtype, true, 0.1, 3.0);
            let what = |o: &str| format!("{dtype} {n}x{d}x{v}: {o}");
            let run = |be: &CudaBackend| {
                let dev = DeviceCase::new(be, &case);
                let inputs = dev.inputs();
                let opts = Options {
                    label_smoothing: 0.1,
                    softcap: if classes == 384 {
                        Some(50.0)
                    } else {
                        (dtype == DType::F16).then_some(8.0)
                    },
                    ..Options::exact()
                };
                let up = Upstream {
                    d_loss: DLoss::Scalar(1.0),
                    d_lse: None,
                };
                let (_, g) = be
                    .forward_backward(&inputs, &opts, &up)
                    .unwrap_or_else(|err| panic!("{}: {err}", what("forward_backward")));
                let dc = to_f64(be, g.d_c.as_ref().unwrap());
                let db = to_f64(be, g.d_bias.as_ref().unwrap());
                (g.stats.plan_reason.clone(), dc, db)
            };
            let (reason, dc, db) = run(on);
            assert_eq!(
                reason.contains("class pass: WGMMA GEMM with G in its epilogue"),
                expected,
                "{}: {reason}",
                what("plan_reason")
            );
            let (reason_off, dc_off, db_off) = run(off);
            assert!(
                reason_off.contains("class pass: cuBLAS logits then G"),
                "{}: {reason_off}",
                what("switch off")
            );
            // Both round G to f16 once; only the logits' summation order differs.
            let scale = dc_off.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-30);
            for (i, (x, y)) in dc.iter().zip(&dc_off).enumerate() {
                assert!(
                    (x - y).abs() <= 2e-2 * scale,
                    "{}: d_c[{i}] {x} vs {y} (max |d_c| {scale})",
                    what("d_c vs cuBLAS class pass")
                );
            }
            close_rows(&what("d_bias vs cuBLAS class pass"), &db, &db_off, 1e-2);
            // The options, judged against the f64 oracle: all of them on the first shape,
            // three per shape after it.
            let vs = variants(n, d, v, dtype);
            let count = vs.len();
            // One row: every variant but "grad_f32+peaked", whose single row has a gradient of
            // ~1e-11 when its target is the argmax at 25σ logits, under f32's resolution of
            // 1 − p (6e-8): the batch-relative judge fails on rounding noise of the row pass's
            // d_e (seen once, f16, run 5); multi-row shapes judge that variant elsewhere.
            let picks: Vec<usize> = if n == 1 {
                (0..count).collect()
            } else {
                (0..3).map(|j| (k + j * 5) % count).collect()
            };
            k += 1;
            for (j, sp) in vs.into_iter().enumerate() {
                if picks.contains(&j) && !(n == 1 && sp.label == "grad_f32+peaked") {
                    eprintln!("{}", check(on, &mut rng, &sp));
                }
            }
        }
    }
    // A softcap above WGMMA_SOFTCAP_MAX keeps the cuBLAS class pass (tanhf), still right.
    let mut sp = spec(130, 64, 300, DType::BF16, "softcap 150");
    sp.opts.softcap = Some(150.0);
    sp.logit_std = 40.0;
    eprintln!("{}", check(&on128, &mut rng, &sp));
    let case = random_case(&mut rng, 130, 64, 300, DType::BF16, false, 0.1, 40.0);
    let dev = DeviceCase::new(&on128, &case);
    let inputs = dev.inputs();
    let (f, g) = on128
        .forward_backward(&inputs, &sp.opts, &Upstream::default())
        .unwrap();
    let reason = &g.stats.plan_reason;
    assert!(
        reason.contains("class pass: cuBLAS logits then G")
            && (!expected || reason.contains("softcap above 100")),
        "softcap 150: {reason}"
    );
    let fo = on128.forward(&inputs, &sp.opts).unwrap();
    assert!(
        !fo.stats.plan_reason.starts_with("forward: WGMMA"),
        "softcap 150 forward: {}",
        fo.stats.plan_reason
    );
    close_rows(
        "softcap 150: lse",
        &to_f64(&on128, &fo.lse),
        &to_f64(&on128, &f.lse),
        1e-5,
    );
}

/// Split dense's row pass through the WGMMA epilogue (`kernels/wgmma.cu` (3):
/// `cce_wgmma_lseq*`, the combine, `cce_wgmma_qrows_g*`) on hostile shapes: one row and seven
/// classes, rows past a 128-row tile and off the 64-row chunks, V under one 256-class tile,
/// exactly one, 5003 (a partial last tile, odd), D = 64-576; bias, softcap 8 / 30 / 50 and
/// z-loss in turn. Per shape: `plan_reason`, then lse, loss and `d_e` next to the cuBLAS row
/// pass of the same inputs (switch off), then three of the option variants (side outputs off,
/// so that the epilogue applies where it can) judged against the f64 oracle. Also: a filtered
/// call on flat data whose sparse backward gives way to the dense passes; the epilogue's row
/// pass with the cuBLAS class pass after filtered calls (τ); and where it must not apply (f16
/// G, f16 inputs, label smoothing, entropy) the old path's reason.
#[test]
fn wgmma_row_pass() {
    use cce_core::StrategyKind::SplitDense;
    let Some(be) = backend("wgmma_row_pass") else {
        return;
    };
    let expected = epilogue_expected(&be, "wgmma_row_pass");
    // bf16 G for d_e (what the default budget takes at large shapes; small ones have room
    // for the f16 copy of c, whose f16 G keeps the cuBLAS row pass).
    let (on, off) = row_pass_pair(SplitDense, (64, 128), |be| be.with_split_de_f16(false));
    let mut rng = seeded();
    let shapes = [
        (1, 64, 7),
        (129, 128, 5003),
        (300, 576, 600),
        (130, 64, 257),
        (257, 192, 1000),
        (64, 64, 256),
    ];
    let run = |be: &CudaBackend, case: &Case, opts: &Options| {
        let dev = DeviceCase::new(be, case);
        let inputs = dev.inputs();
        let up = Upstream {
            d_loss: DLoss::Scalar(1.0),
            d_lse: None,
        };
        let (f, g) = be
            .forward_backward(&inputs, opts, &up)
            .unwrap_or_else(|err| panic!("forward_backward: {err}"));
        (
            g.stats.plan_reason.clone(),
            to_f64(be, &f.lse),
            to_f64(be, &f.loss),
            to_f64(be, g.d_e.as_ref().unwrap()),
        )
    };
    for (i, &(n, d, v)) in shapes.iter().enumerate() {
        let bias = i % 2 == 1;
        // random_case keeps at least one row's target (a mean over none is an error).
        let case = random_case(&mut rng, n, d, v, DType::BF16, bias, 0.1, 3.0);
        let opts = Options {
            softcap: [None, Some(30.0), None, Some(8.0), None, Some(50.0)][i],
            z_loss: if i == 2 { 1e-2 } else { 0.0 },
            ..Options::exact()
        };
        let what = |o: &str| format!("bf16 {n}x{d}x{v} {opts:?}: {o}");
        let (reason, lse, loss, de) = run(&on, &case, &opts);
        assert_eq!(
            reason.contains("row pass: WGMMA GEMM with the lse partials"),
            expected,
            "{}: {reason}",
            what("plan_reason")
        );
        let (reason_off, lse_off, loss_off, de_off) = run(&off, &case, &opts);
        assert!(
            reason_off.contains("row pass: cuBLAS f32 logits")
                && reason_off.contains("switched off"),
            "{}: {reason_off}",
            what("switch off")
        );
        close_rows(&what("lse vs cuBLAS row pass"), &lse, &lse_off, 1e-5);
        close_rows(&what("loss vs cuBLAS row pass"), &loss, &loss_off, 1e-4);
        // Both round G to bf16 once; q's f16 rounding (2⁻¹²) and the summation order differ.
        close_max(&what("d_e vs cuBLAS row pass"), &de, &de_off, 2e-2);
        // The options, judged against the f64 oracle: all of them on the first shape, three per
        // shape after it.
        let vs = variants(n, d, v, DType::BF16);
        let count = vs.len();
        let picks: Vec<usize> = if n == 1 {
            (0..count).collect()
        } else {
            (0..3).map(|j| (i + j * 5) % count).collect()
        };
        for (j, mut sp) in vs.into_iter().enumerate() {
            if picks.contains(&j) && !(n == 1 && sp.label == "grad_f32+peaked") {
                sp.opts.side_outputs = SideOutputs::default();
                eprintln!("{}", check(&on, &mut rng, &sp));
            }
        }
    }
    // A filtered call on flat data: the sparse backward's probe keeps every class, so it gives
    // way to the dense passes (a probe that fits one row chunk leaves its f32 logits to the row
    // kernels; the other chunks take the epilogue). Nothing is skipped: the exact result.
    let case = random_case(&mut rng, 200, 128, 5003, DType::BF16, false, 0.0, 0.05);
    let (reason, lse, _, de) = run(&on, &case, &Options::default());
    let (_, lse_x, _, de_x) = run(&off, &case, &Options::exact());
    assert!(
        !expected || reason.contains("row pass: WGMMA GEMM with the lse partials"),
        "filtered flat: {reason}"
    );
    eprintln!("filtered flat: {reason}");
    close_rows("filtered flat: lse", &lse, &lse_x, 1e-5);
    close_max("filtered flat: d_e vs exact", &de, &de_x, 2e-2);
    // The epilogue's row pass with the cuBLAS class pass, which reads every row's τ (the row
    // kernels write 0 there, the epilogue's chunks nothing: the engine zeroes it). A filtered
    // call first: its sparse probe writes thresholds into a workspace that the stream-ordered
    // pool may hand to the next call. Then exact calls judged against f64.
    let mixed = CudaBackend::new(0)
        .unwrap()
        .with_strategies(&[SplitDense])
        .unwrap()
        .with_chunk_cap(64, 128)
        .unwrap()
        .with_split_de_f16(false)
        .with_wgmma_gcols(false)
        .with_sparse(cce_cuda::SparseMode::Always);
    for _ in 0..2 {
        let peaked = random_case(&mut rng, 257, 192, 1000, DType::BF16, false, 0.0, 25.0);
        let (rf, ..) = run(&mixed, &peaked, &Options::default());
        eprintln!("mixed, filtered first: {rf}");
        let mut sp = spec(257, 192, 1000, DType::BF16, "mean, cuBLAS class pass");
        sp.opts.side_outputs = SideOutputs::default();
        eprintln!("{}", check(&mixed, &mut rng, &sp));
    }
    let plain = random_case(&mut rng, 257, 192, 1000, DType::BF16, false, 0.0, 3.0);
    let (rm, ..) = run(&mixed, &plain, &Options::exact());
    assert!(
        rm.contains("class pass: cuBLAS logits then G")
            && (!expected || rm.contains("row pass: WGMMA GEMM with the lse partials")),
        "mixed: {rm}"
    );
    // Where the epilogue must not run: f16 G for d_e, f16 inputs, label smoothing, entropy.
    let de16 = CudaBackend::new(0)
        .unwrap()
        .with_strategies(&[SplitDense])
        .unwrap()
        .with_chunk_cap(64, 128)
        .unwrap();
    let case_b = random_case(&mut rng, 70, 64, 300, DType::BF16, false, 0.0, 3.0);
    let (rd, ..) = run(&de16, &case_b, &Options::exact());
    assert!(
        rd.contains("row pass: cuBLAS f32 logits") && (!expected || rd.contains("f16 G for d_e")),
        "f16 G for d_e: {rd}"
    );
    let case16 = random_case(&mut rng, 70, 64, 300, DType::F16, false, 0.0, 3.0);
    let (r16, ..) = run(&on, &case16, &Options::exact());
    assert!(
        r16.contains("row pass: cuBLAS f32 logits") && (!expected || r16.contains("f16 inputs")),
        "f16: {r16}"
    );
    let smooth = Options {
        label_smoothing: 0.1,
        ..Options::exact()
    };
    let (rs, ..) = run(&on, &case_b, &smooth);
    assert!(
        rs.contains("row pass: cuBLAS f32 logits") && (!expected || rs.contains("label smoothing")),
        "label smoothing: {rs}"
    );
    let ent = Options {
        side_outputs: SideOutputs {
            entropy: true,
            argmax: false,
        },
        ..Options::exact()
    };
    let (re, ..) = run(&on, &case_b, &ent);
    assert!(
        re.contains("row pass: cuBLAS f32 logits") && (!expected || re.contains("entropy")),
        "entropy: {re}"
    );
}
