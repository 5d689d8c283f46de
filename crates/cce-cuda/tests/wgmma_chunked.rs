//! Chunked dense's row pass through the WGMMA epilogue (Hopper, `kernels/wgmma.cu` (3) and
//! `kernels/wgmma_rows.cu`): next to the cuBLAS row pass of the same inputs and against the
//! f64 oracle, with one gradient or both, and with f32 gradients (`d_c` from f16 `G`). Each test
//! prints "skipping: <reason>" and passes when no CUDA device or library is present; on other
//! architectures only the fallback is checked.

mod common;

use cce_core::{Backend, DType, HostTensor, Inputs, Options, SideOutputs, Upstream};
use cce_cuda::CudaBackend;
use cce_reference::{naive, OracleDLoss, Precision};
use common::spec::*;
use common::wgmma::*;
use common::*;

/// Chunked dense's row pass through the WGMMA epilogue (lse partials and f16 `e^{z − m}`,
/// then `G` in place, which both the `d_e` and the accumulating `d_c` GEMM read): next to the
/// cuBLAS row pass of the same inputs (switch off), every gradient, several row chunks
/// (cap 64 rows), bias and softcap; then options judged against the f64 oracle.
#[test]
fn wgmma_row_pass_in_chunked_dense() {
    use cce_core::StrategyKind::ChunkedDense;
    let Some(be) = backend("wgmma_row_pass_in_chunked_dense") else {
        return;
    };
    let expected = epilogue_expected(&be, "wgmma_row_pass_in_chunked_dense");
    let (on, off) = row_pass_pair(ChunkedDense, (64, 128), |be| be);
    let mut rng = seeded();
    for (i, &(n, d, v)) in [
        (1, 64, 7),
        (129, 128, 5003),
        (300, 576, 600),
        (130, 64, 257),
    ]
    .iter()
    .enumerate()
    {
        let bias = i % 2 == 1;
        // random_case keeps at least one row's target (a mean over none is an error).
        let case = random_case(&mut rng, n, d, v, DType::BF16, bias, 0.1, 3.0);
        let opts = Options {
            softcap: [None, Some(30.0), None, Some(8.0)][i],
            z_loss: if i == 2 { 1e-2 } else { 0.0 },
            ..Options::exact()
        };
        let what = |o: &str| format!("bf16 {n}x{d}x{v} {opts:?}: {o}");
        let run = |be: &CudaBackend| {
            let dev = DeviceCase::new(be, &case);
            let (f, g) = be
                .forward_backward(&dev.inputs(), &opts, &Upstream::default())
                .unwrap_or_else(|err| panic!("{}: {err}", what("forward_backward")));
            let db = g.d_bias.as_ref().map(|t| to_f64(be, t));
            (
                g.stats.plan_reason.clone(),
                [
                    to_f64(be, &f.lse),
                    to_f64(be, &f.loss),
                    to_f64(be, g.d_e.as_ref().unwrap()),
                    to_f64(be, g.d_c.as_ref().unwrap()),
                ],
                db,
            )
        };
        let (reason, got, db) = run(&on);
        assert!(
            reason.contains("chunked-dense"),
            "{}: {reason}",
            what("strategy")
        );
        assert_eq!(
            reason.contains("row pass: WGMMA GEMM with the lse partials"),
            expected,
            "{}: {reason}",
            what("plan_reason")
        );
        let (reason_off, want, db_off) = run(&off);
        assert!(
            reason_off.contains("row pass: cuBLAS f32 logits"),
            "{}: {reason_off}",
            what("switch off")
        );
        close_rows(&what("lse"), &got[0], &want[0], 1e-5);
        close_rows(&what("loss"), &got[1], &want[1], 1e-4);
        // Both round G to bf16 once; q's f16 rounding (2⁻¹²) and the summation order differ.
        close_max(&what("d_e"), &got[2], &want[2], 2e-2);
        close_max(&what("d_c"), &got[3], &want[3], 2e-2);
        if let (Some(a), Some(b)) = (db, db_off) {
            close_max(&what("d_bias"), &a, &b, 2e-2);
        }
        let vs = variants(n, d, v, DType::BF16);
        let count = vs.len();
        for (j, mut sp) in vs.into_iter().enumerate() {
            if (0..3).any(|k| (i + k * 5) % count == j) {
                sp.opts.side_outputs = SideOutputs::default();
                eprintln!("{}", check(&on, &mut rng, &sp));
            }
        }
    }
}

/// Chunked dense for f32 gradients of bf16 inputs (the `chunked_f32_grads` knob): `d_c`
/// accumulated in the f32 output (no accumulator in the workspace), the row pass through the
/// WGMMA epilogue in chunks of about twice the plan's rows (16-bit q in the region of the
/// plan's f32 logits), against the cuBLAS row pass at the plan's rows and against the f64
/// oracle, with a bias and a softcap.
#[test]
fn chunked_dense_f32_gradients_in_chunks_of_16_bit_q() {
    use cce_core::StrategyKind::ChunkedDense;
    let Some(be) = backend("chunked_dense_f32_gradients_in_chunks_of_16_bit_q") else {
        return;
    };
    let expected = epilogue_expected(&be, "chunked_dense_f32_gradients_in_chunks_of_16_bit_q");
    let (on, off) = row_pass_pair(ChunkedDense, (128, 256), |be| {
        be.with_chunked_f32_grads(true)
    });
    let mut rng = seeded();
    for (n, d, v, softcap) in [(700, 128, 3001, None), (517, 64, 700, Some(20.0f32))] {
        let case = random_case(&mut rng, n, d, v, DType::BF16, true, 0.1, 3.0);
        let opts = Options {
            softcap,
            grad_dtype: cce_core::GradDType::F32,
            ..Options::exact()
        };
        let what = |o: &str| format!("bf16 {n}x{d}x{v} f32 grads softcap {softcap:?}: {o}");
        let run = |be: &CudaBackend| {
            let dev = DeviceCase::new(be, &case);
            let (_, g) = be
                .forward_backward(&dev.inputs(), &opts, &Upstream::default())
                .unwrap_or_else(|err| panic!("{}: {err}", what("forward_backward")));
            assert_eq!(
                cce_core::TensorMeta::dtype(g.d_c.as_ref().unwrap()),
                DType::F32
            );
            (
                g.stats.clone(),
                [
                    to_f64(be, g.d_e.as_ref().unwrap()),
                    to_f64(be, g.d_c.as_ref().unwrap()),
                    to_f64(be, g.d_bias.as_ref().unwrap()),
                ],
            )
        };
        let (stats, got) = run(&on);
        let (stats_off, want) = run(&off);
        for s in [&stats, &stats_off] {
            assert!(
                s.plan_reason.contains("chunked-dense"),
                "{}: {}",
                what("strategy"),
                s.plan_reason
            );
        }
        if expected {
            let note = stats.plan_reason.clone();
            assert!(
                note.contains("row pass: WGMMA GEMM with the lse partials"),
                "{}: {note}",
                what("row pass")
            );
            // 128 rows of f32 logits hold about 250 rows of the epilogue's layout.
            assert!(
                note.contains("of up to 2") && !note.contains("of up to 128 rows"),
                "{}: {note}",
                what("chunk rows")
            );
        }
        // Both round G to bf16 once; q's bf16 rounding and the summation order differ.
        close_max(&what("d_e"), &got[0], &want[0], 2e-2);
        close_max(&what("d_c"), &got[1], &want[1], 2e-2);
        close_max(&what("d_bias"), &got[2], &want[2], 2e-2);
        let oracle = unit_upstream_oracle(&case, &opts, Precision::F64);
        close_max(&what("d_e vs f64"), &got[0], &oracle.d_e, 2e-2);
        close_max(&what("d_c vs f64"), &got[1], &oracle.d_c, 2e-2);
    }
}

/// Chunked dense through the WGMMA row pass when only one gradient is asked for: `d_c` and
/// `d_bias` alone (`compute_d_e` off: the G pass must still turn q into G, which `d_c` and the
/// column sums read) and `d_e` alone, against the cuBLAS row pass and the f64 oracle.
#[test]
fn chunked_dense_wgmma_row_pass_with_one_gradient() {
    use cce_core::StrategyKind::ChunkedDense;
    let Some(be) = backend("chunked_dense_wgmma_row_pass_with_one_gradient") else {
        return;
    };
    let expected = epilogue_expected(&be, "chunked_dense_wgmma_row_pass_with_one_gradient");
    let (on, off) = row_pass_pair(ChunkedDense, (128, 256), |be| be);
    let mut rng = seeded();
    let (n, d, v) = (300, 128, 1500);
    let case = random_case(&mut rng, n, d, v, DType::BF16, true, 0.1, 3.0);
    for (compute_d_e, compute_d_c) in [(false, true), (true, false)] {
        let opts = Options {
            compute_d_e,
            compute_d_c,
            ..Options::exact()
        };
        let what = |o: &str| format!("bf16 {n}x{d}x{v} d_e {compute_d_e} d_c {compute_d_c}: {o}");
        let run = |be: &CudaBackend| {
            let dev = DeviceCase::new(be, &case);
            let (_, g) = be
                .forward_backward(&dev.inputs(), &opts, &Upstream::default())
                .unwrap_or_else(|err| panic!("{}: {err}", what("forward_backward")));
            assert_eq!(g.d_e.is_some(), compute_d_e, "{}", what("d_e output"));
            assert_eq!(g.d_c.is_some(), compute_d_c, "{}", what("d_c output"));
            let grads = [g.d_e.as_ref(), g.d_c.as_ref(), g.d_bias.as_ref()]
                .map(|t| t.map(|t| to_f64(be, t)));
            (g.stats.plan_reason.clone(), grads)
        };
        let (note, got) = run(&on);
        let (_, want) = run(&off);
        assert!(
            note.contains("chunked-dense"),
            "{}: {note}",
            what("strategy")
        );
        if expected {
            assert!(
                note.contains("row pass: WGMMA GEMM with the lse partials"),
                "{}: {note}",
                what("row pass")
            );
        }
        let oracle = unit_upstream_oracle(&case, &opts, Precision::F64);
        let truth = [Some(&oracle.d_e), Some(&oracle.d_c), oracle.d_bias.as_ref()];
        for (k, name) in ["d_e", "d_c", "d_bias"].iter().enumerate() {
            let (Some(g), Some(w)) = (&got[k], &want[k]) else {
                continue;
            };
            close_max(&what(name), g, w, 2e-2);
            if let Some(t) = truth[k] {
                close_max(&what(&format!("{name} vs f64")), g, t, 2e-2);
            }
        }
    }
}

/// Chunked dense with f32 gradients of bf16 inputs (`with_chunked_f32_grads`), several chunks
/// of the WGMMA row pass: its `d_c` from f16 `G` against an f16 copy of the chunk's `e` is as
/// exact as split dense's on the shipped real rows (`d_c` within the original CCE's 0.05%,
/// `d_e` within its 0.27%, as `real_fixture_loss_lse_and_default_filter_accuracy` asks of
/// split dense; bf16 `G` gave 0.13%). On confident rows each target's `d_c` row stays within
/// 2e-3 at margin 20 (H200 with q as its q9 code, 2⁻¹⁰ relative: 7.5e-4 to 1.08e-3 in three
/// runs; bf16 q gave 3.3e-3) and 5e-2 at margin 40 (8.9e-4, 1.17e-2, 2.30e-2: f16 `G`'s one
/// power of two per chunk flushes part of rows that small; the suite's `confident_rows`
/// allowance holds).
#[test]
fn chunked_f32_gradients_take_d_c_from_f16_g() {
    use cce_core::StrategyKind::ChunkedDense;
    let test = "chunked_f32_gradients_take_d_c_from_f16_g";
    let Some(be) = backend(test) else {
        return;
    };
    let expected = epilogue_expected(&be, test);
    let chunked = CudaBackend::new(0)
        .unwrap()
        .with_strategies(&[ChunkedDense])
        .unwrap()
        .with_chunk_cap(128, 256)
        .unwrap()
        .with_chunked_f32_grads(true);
    let opts = Options {
        grad_dtype: cce_core::GradDType::F32,
        ..Options::exact()
    };
    let run = |what: &str, e: &HostTensor, c: &HostTensor, t: &[i64]| {
        let (e_d, c_d) = (upload(&chunked, e), upload(&chunked, c));
        let t_d = upload(&chunked, &HostTensor::from_i64(t.to_vec()));
        let inputs = Inputs {
            e: &e_d,
            c: &c_d,
            bias: None,
            targets: &t_d,
        };
        let (_, g) = chunked
            .forward_backward(&inputs, &opts, &Upstream::default())
            .unwrap_or_else(|err| panic!("{what}: {err}"));
        let note = g.stats.plan_reason.clone();
        assert!(note.contains("chunked-dense"), "{what}: {note}");
        if expected {
            assert!(
                note.contains("row pass: WGMMA GEMM with the lse partials"),
                "{what}: {note}"
            );
        }
        let oracle = naive(
            e,
            c,
            None,
            &HostTensor::from_i64(t.to_vec()),
            &opts,
            &OracleDLoss::Scalar(1.0),
            None,
            Precision::F64,
        )
        .unwrap();
        let d_e = to_f64(&chunked, g.d_e.as_ref().unwrap());
        let d_c = to_f64(&chunked, g.d_c.as_ref().unwrap());
        (d_e, d_c, oracle, note)
    };
    match load_fixture() {
        None => {
            eprintln!("{test}: data/smollm2_lce_real_1k.safetensors not found: real rows skipped")
        }
        Some(fx) => {
            let e = HostTensor::from_f32(vec![1024, 576], &fx.e, DType::BF16).unwrap();
            let c = HostTensor::from_f32(vec![49152, 576], &fx.c, DType::BF16).unwrap();
            let (d_e, d_c, oracle, note) = run("real rows", &e, &c, &fx.targets);
            let (re, rc) = (rel(&d_e, &oracle.d_e), rel(&d_c, &oracle.d_c));
            eprintln!(
                "{test}: real rows 1024 x 576 x 49152: d_e rel {re:.3e}, d_c rel {rc:.3e}\n{note}"
            );
            assert!(re <= 0.0027, "real rows: d_e rel {re}");
            assert!(rc <= 0.0005, "real rows: d_c rel {rc}");
        }
    }
    let mut rng = seeded();
    for margin in [20.0, 40.0] {
        // 300 rows, each target 15·i (mod V) lifted `margin` above the rest.
        let (n, d, v) = (300, 64, 1000);
        let (e, c, targets) = confident_rows(&mut rng, (n, d, v), margin, DType::BF16);
        let what = format!("confident rows, margin {margin}");
        let (_, d_c, oracle, _) = run(&what, &e, &c, &targets);
        // f16 G keeps one power of two per chunk: an entry 2^24 below its chunk's largest
        // |G| is flushed. That floor, from the largest |G| of the whole call (an upper bound
        // on each chunk's; the scale a power of two up to twice it), bounds what any d_c entry
        // loses: rows x 2^-23 x max|G| x max|e|.
        let (ev, cv) = (e.to_f64_vec(), c.to_f64_vec());
        let g_max = max_abs_g(&ev, &cv, &targets, (n, d, v));
        let e_max = ev.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        let floor = (d as f64).sqrt() * n as f64 * 2f64.powi(-23) * g_max * e_max;
        let (mut worst, mut worst_over) = (0.0f64, 0.0f64);
        for &y in &targets {
            let y = y as usize;
            let r = y * d..(y + 1) * d;
            worst = worst.max(rel(&d_c[r.clone()], &oracle.d_c[r.clone()]));
            let err = norm_diff(&d_c[r.clone()], &oracle.d_c[r.clone()]);
            let allowed = 2e-3 * norm_diff(&oracle.d_c[r], &vec![0.0; d]) + floor;
            worst_over = worst_over.max(err / allowed);
        }
        eprintln!(
            "{test}: {what}: worst target d_c row rel {worst:.3e}, error / (2e-3 of the row + \
             the f16 flush floor {floor:.2e}) {worst_over:.2}"
        );
        // Simulated in f64 (docs/perf-log.md, session 18): margin 20 ~1.0e-3 with q9 (bf16 q:
        // 3.2e-3, measured 3.3e-3); margin 40 ~1e-2 to 0.15 (measured on the H200), where the
        // flush takes part of such tiny rows: there the bound is the flush floor.
        if margin < 30.0 {
            assert!(worst <= 2e-3, "{what}: a target's d_c row off by {worst}");
        }
        assert!(
            worst_over <= 1.0,
            "{what}: a target's d_c row off by {worst_over} of its bound"
        );
    }
}

/// `d_c` accumulated in the bf16 output (`with_dc_in_grad_dtype`): exact bf16 calls whose
/// budget holds no f32 `V x D` accumulator take chunked dense (3 GEMMs) instead of split dense
/// and add each row chunk's product to the running bf16 `d_c` (one rounding per chunk). On
/// the shipped real rows (8 chunks) and on random rows (16 chunks) each gradient is judged
/// against the f64 oracle beside split dense's error on the same inputs. `d_c`'s error grows
/// with the number of chunks (H200: 3.3e-3 at 8 chunks, 3.9e-3 at 16, against split dense's
/// 1.7e-3), so the bound is 6e-3, over the 4e-3 issue 23 asks of bf16 gradients: the mode
/// meets that only up to ~10-16 chunks.
#[test]
fn chunked_dense_accumulates_d_c_in_bf16() {
    let test = "chunked_dense_accumulates_d_c_in_bf16";
    let Some(be) = backend(test) else {
        return;
    };
    let expected = epilogue_expected(&be, test);
    let low = be
        .with_chunk_cap(128, 256)
        .unwrap()
        .with_dc_in_grad_dtype(true);
    let split = CudaBackend::new(0).unwrap();
    let run = |be: &CudaBackend, case: &Case, budget_mib: u64| {
        let opts = Options {
            workspace_budget_bytes: budget_mib << 20,
            ..Options::exact()
        };
        let dev = DeviceCase::new(be, case);
        let (_, g) = be
            .forward_backward(&dev.inputs(), &opts, &Upstream::default())
            .unwrap_or_else(|err| panic!("{test}: {err}"));
        let oracle = naive(
            &case.e,
            &case.c,
            None,
            &case.targets,
            &opts,
            &OracleDLoss::Scalar(1.0),
            None,
            Precision::F64,
        )
        .unwrap();
        let d_e = rel(&to_f64(be, g.d_e.as_ref().unwrap()), &oracle.d_e);
        let d_c = rel(&to_f64(be, g.d_c.as_ref().unwrap()), &oracle.d_c);
        (d_e, d_c, g.stats.plan_reason.clone())
    };
    let mut cases = Vec::new();
    match load_fixture() {
        None => {
            eprintln!("{test}: data/smollm2_lce_real_1k.safetensors not found: real rows skipped")
        }
        Some(fx) => cases.push((
            "real rows 1024 x 576 x 49152",
            Case {
                n: 1024,
                d: 576,
                v: 49152,
                e: HostTensor::from_f32(vec![1024, 576], &fx.e, DType::BF16).unwrap(),
                c: HostTensor::from_f32(vec![49152, 576], &fx.c, DType::BF16).unwrap(),
                bias: None,
                targets: HostTensor::from_i64(fx.targets.clone()),
            },
            // 96 MiB after cuBLAS's workspace: under the 113 MB f32 accumulator.
            128,
        )),
    }
    let mut rng = seeded();
    let mut flat = random_case(&mut rng, 2048, 512, 8192, DType::BF16, false, 0.0, 3.0);
    flat.bias = None;
    // 12 MiB after cuBLAS's workspace: no room for the 16 MiB f32 accumulator, room for 256-row
    // chunks of f32 logits (chunked dense's plan: `chunked_f32_grads_pay` asks for 256) and
    // for split dense.
    cases.push(("random rows 2048 x 512 x 8192", flat, 44));
    for (what, case, budget) in &cases {
        let (de, dc, note) = run(&low, case, *budget);
        let (de_s, dc_s, note_s) = run(&split, case, *budget);
        eprintln!(
            "{test}: {what}: d_e rel {de:.3e}, d_c rel {dc:.3e} (split dense: {de_s:.3e}, \
             {dc_s:.3e})\n  {note}\n  split: {note_s}"
        );
        assert!(
            note.contains("chunked-dense") && note.contains("dc_in_grad_dtype"),
            "{note}"
        );
        if expected {
            assert!(note.contains("row pass: WGMMA GEMM"), "{note}");
        }
        assert!(note_s.contains("split-dense"), "{note_s}");
        assert!(de <= 4e-3, "{what}: d_e rel {de}");
        assert!(dc <= 6e-3, "{what}: d_c rel {dc}");
    }
}

/// The largest `|softmax − onehot|` of `e·cᵀ` over all rows, in f64 (row-major `e [n, d]`,
/// `c [v, d]`).
fn max_abs_g(e: &[f64], c: &[f64], targets: &[i64], (n, d, v): (usize, usize, usize)) -> f64 {
    let mut g_max = 0.0f64;
    for i in 0..n {
        let row = &e[i * d..(i + 1) * d];
        let z: Vec<f64> = (0..v)
            .map(|j| {
                row.iter()
                    .zip(&c[j * d..(j + 1) * d])
                    .map(|(a, b)| a * b)
                    .sum()
            })
            .collect();
        let m = z.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
        let s: f64 = z.iter().map(|x| (x - m).exp()).sum();
        for (j, x) in z.iter().enumerate() {
            let p = (x - m).exp() / s;
            let g = if j as i64 == targets[i] { p - 1.0 } else { p };
            g_max = g_max.max(g.abs());
        }
    }
    g_max
}

/// `‖a − b‖₂`.
fn norm_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y) * (x - y))
        .sum::<f64>()
        .sqrt()
}
