//! The blocked CPU backend against the f64 oracle: hostile shapes, both strategies, the filter
//! bound, and the real fixture (loss, lse, filtered accuracy vs the original's default filter).

mod common;

use cce_core::options::{FilterEps, GradDType, Options, Reduction};
use cce_core::plan::{DeviceLimits, StrategyKind, TileShape};
use cce_core::{Backend, DType, HostTensor, Inputs, Upstream};
use cce_reference::{naive, CpuBackend, OracleDLoss, Precision};
use common::*;

fn rel(a: &[f64], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den.max(1e-300)).sqrt()
}

fn limits(strategy: StrategyKind, rows: usize, classes: usize) -> DeviceLimits {
    DeviceLimits {
        tile: TileShape {
            rows,
            classes,
            depth: 16,
        },
        strategies: vec![strategy],
        class_forward: false,
        ..DeviceLimits::cpu()
    }
}

#[test]
fn exact_mode_matches_oracle_on_hostile_shapes_both_strategies() {
    let mut rng = seeded();
    let shapes = [
        (1, 1, 1),
        (252, 123, 507),
        (65, 17, 257),
        (33, 300, 129),
        (7, 5, 127),
        (9, 3, 126),
        (64, 8, 256),
    ];
    for &(n, d, v) in &shapes {
        for bias in [false, true] {
            let case = random_case(&mut rng, n, d, v, bias, 0.2, 1.0);
            let opts = Options {
                softcap: bias.then_some(5.0),
                ..Options::exact()
            };
            let (e, c, b, t) = case.tensors(DType::F32);
            let gt = naive(
                &e,
                &c,
                b.as_ref(),
                &t,
                &opts,
                &OracleDLoss::Scalar(1.0),
                None,
                Precision::F64,
            )
            .unwrap();
            let mut first: Option<Vec<f32>> = None;
            for (kind, tr, tc) in [
                (StrategyKind::ChunkedDense, 64, 256),
                (StrategyKind::TileOwnership, 16, 64),
                (StrategyKind::TileOwnership, 64, 256),
            ] {
                let be = CpuBackend::with_limits(limits(kind, tr, tc));
                let inputs = Inputs {
                    e: &e,
                    c: &c,
                    bias: b.as_ref(),
                    targets: &t,
                };
                let (f, g) = be
                    .forward_backward(&inputs, &opts, &Upstream::default())
                    .unwrap();
                let loss = f.loss.to_f64_vec()[0];
                assert!(
                    (loss - gt.loss[0]).abs() <= 1e-5 * (1.0 + gt.loss[0].abs()),
                    "{n}x{d}x{v} loss {loss} vs {}",
                    gt.loss[0]
                );
                let d_e = g.d_e.unwrap().to_f64_vec();
                let d_c = g.d_c.unwrap().to_f64_vec();
                assert!(
                    rel(&d_e, &gt.d_e) < 1e-5,
                    "{n}x{d}x{v} {kind:?} d_e rel {}",
                    rel(&d_e, &gt.d_e)
                );
                assert!(
                    rel(&d_c, &gt.d_c) < 1e-5,
                    "{n}x{d}x{v} {kind:?} d_c rel {}",
                    rel(&d_c, &gt.d_c)
                );
                if bias {
                    let db = g.d_bias.unwrap().to_f64_vec();
                    assert!(rel(&db, gt.d_bias.as_ref().unwrap()) < 1e-5);
                }
                // Same tile shape: bitwise equal across strategies.
                if tr == 64 {
                    let bits = d_c.iter().map(|&x| x as f32).collect::<Vec<_>>();
                    match &first {
                        None => first = Some(bits),
                        Some(f0) => assert_eq!(f0, &bits, "strategies differ at {n}x{d}x{v}"),
                    }
                }
            }
        }
    }
}

/// Per row, `‖d_e − exact‖ ≤ dropped_max · max_j ‖c_j‖ (+1e-4)`: the skipped entries of a row
/// hold at most its dropped mass, each `|G_ij| ≤ |g_i| · g0_ij` with `|g_i| = 1` (sum reduction).
fn assert_de_within_dropped_mass(
    case: &common::Case,
    d_e: &[f64],
    exact: &[f64],
    s: &cce_core::CallStats,
    what: &str,
) {
    let d = case.d;
    let cmax = case
        .c
        .chunks(d)
        .map(|r| r.iter().map(|x| x * x).sum::<f64>().sqrt())
        .fold(0.0, f64::max);
    for i in 0..case.n {
        let err: f64 = (0..d)
            .map(|k| (d_e[i * d + k] - exact[i * d + k]).powi(2))
            .sum::<f64>()
            .sqrt();
        assert!(
            err <= s.dropped_mass_max * cmax + 1e-4,
            "{what}, row {i}: err {err} bound {}\n{s}",
            s.dropped_mass_max * cmax
        );
    }
}

/// The f64 oracle of a call (upstream 1) and the same call on the blocked CPU backend with
/// tile ownership in 8 x 32 tiles.
fn oracle_and_tile_filtered(
    e: &HostTensor,
    c: &HostTensor,
    bias: Option<&HostTensor>,
    t: &HostTensor,
    opts: &Options,
) -> (cce_reference::Oracle, cce_core::BackwardOutput<HostTensor>) {
    let exact = naive(
        e,
        c,
        bias,
        t,
        opts,
        &OracleDLoss::Scalar(1.0),
        None,
        Precision::F64,
    )
    .unwrap();
    let be = CpuBackend::with_limits(limits(StrategyKind::TileOwnership, 8, 32));
    let inputs = Inputs {
        e,
        c,
        bias,
        targets: t,
    };
    let (_, g) = be
        .forward_backward(&inputs, opts, &Upstream::default())
        .unwrap();
    (exact, g)
}

#[test]
fn filtered_error_is_bounded_by_the_dropped_mass() {
    let mut rng = seeded();
    for scale in [0.3, 1.0, 2.0] {
        let (n, d, v) = (96, 64, 1500);
        let case = random_case(&mut rng, n, d, v, false, 0.1, scale);
        let (e, c, b, t) = case.tensors(DType::F32);
        let opts = Options {
            filter_eps: FilterEps::Value(1e-3),
            max_dropped_mass: 2e-2,
            reduction: Reduction::Sum,
            ..Default::default()
        };
        let (exact, g) = oracle_and_tile_filtered(&e, &c, b.as_ref(), &t, &opts);
        let s = &g.stats;
        assert!(
            s.dropped_mass_max <= 2e-2 + 1e-7,
            "dropped {}",
            s.dropped_mass_max
        );
        assert!(
            s.tiles_skipped > 0 || scale < 2.0,
            "scale {scale}: nothing skipped: {s}"
        );
        let d_e = g.d_e.unwrap().to_f64_vec();
        assert_de_within_dropped_mass(&case, &d_e, &exact.d_e, s, &format!("scale {scale}"));
        eprintln!("scale {scale}: {s}");
    }
}

#[test]
fn real_fixture_loss_lse_and_filtered_accuracy() {
    let fx = load_fixture();
    let be = CpuBackend::new();
    // f32 (exact inputs): loss and lse against the file's f64 reference.
    let t = HostTensor::from_i64(fx.targets.clone());
    let e32 = HostTensor::from_f32(vec![1024, 576], &fx.e, DType::F32).unwrap();
    let c32 = HostTensor::from_f32(vec![49152, 576], &fx.c, DType::F32).unwrap();
    let fwd = be
        .forward(
            &Inputs {
                e: &e32,
                c: &c32,
                bias: None,
                targets: &t,
            },
            &Options::default(),
        )
        .unwrap();
    let loss = fwd.loss.to_f64_vec()[0];
    assert!(((loss - 2.142760) / 2.142760).abs() < 1e-5, "loss {loss}");
    let lse = fwd.lse.to_f64_vec();
    let worst = lse
        .iter()
        .zip(&fx.lse_ref)
        .map(|(a, b)| (a - *b as f64).abs())
        .fold(0.0, f64::max);
    assert!(worst < 2e-5, "lse max abs error {worst}");
    eprintln!("real fixture (f32): loss {loss:.6}, worst lse error {worst:.2e}");

    // bf16 inputs, default filtered mode, f32 gradients: vs the f64 oracle of the rounded inputs.
    let e16 = HostTensor::from_f32(vec![1024, 576], &fx.e, DType::BF16).unwrap();
    let c16 = HostTensor::from_f32(vec![49152, 576], &fx.c, DType::BF16).unwrap();
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
    let inputs16 = Inputs {
        e: &e16,
        c: &c16,
        bias: None,
        targets: &t,
    };
    let t0 = std::time::Instant::now();
    let (_, g) = be
        .forward_backward(&inputs16, &opts, &Upstream::default())
        .unwrap();
    eprintln!(
        "blocked forward+backward on the real fixture (bf16, filtered): {:.2} s",
        t0.elapsed().as_secs_f64()
    );
    let re = rel(&g.d_e.unwrap().to_f64_vec(), &gt.d_e);
    let rc = rel(&g.d_c.unwrap().to_f64_vec(), &gt.d_c);
    eprintln!(
        "real fixture bf16 filtered: d_e rel {re:.3e}, d_c rel {rc:.3e}\n{}",
        g.stats
    );
    assert!(
        re <= 0.0027,
        "d_e rel error {re} above the original's 0.27%"
    );
    assert!(
        rc <= 0.0005,
        "d_c rel error {rc} above the original's 0.05%"
    );
    assert!(g.stats.dropped_mass_max <= 1e-3);
    // Each row's budget spent on a suffix of whole tiles, the classes by batch-mean logit and
    // the rows by kept tiles (cce_core::tile_budget, cce_core::vocab_order): 61.7% of the
    // 64 x 256 tiles skipped on these rows (docs/perf-log.md, session 23), where a per-row
    // threshold skipped 0.2% and the same rule in class-id order 25.6%. A floor well under the
    // measured share guards the rule and the orders, not a speed.
    let skipped = g.stats.skipped_fraction();
    assert!(skipped >= 0.5, "skipped {skipped}: {}", g.stats);
    let (_, natural) = be
        .clone()
        .with_vocab_order(false)
        .forward_backward(&inputs16, &opts, &Upstream::default())
        .unwrap();
    let rc_natural = rel(&natural.d_c.unwrap().to_f64_vec(), &gt.d_c);
    let re_natural = rel(&natural.d_e.unwrap().to_f64_vec(), &gt.d_e);
    eprintln!(
        "id order: d_e rel {re_natural:.3e}, d_c rel {rc_natural:.3e}\n{}",
        natural.stats
    );
    assert!(natural.stats.dropped_mass_max <= 1e-3);
    assert!(
        natural.stats.skipped_fraction() < skipped,
        "id order skipped {} of the tiles, the mean-logit order {skipped}",
        natural.stats.skipped_fraction()
    );
    // Not a default: in id order the rows drop their mass over other classes (d_c 7.7e-4),
    // held to issue 23's accuracy goal (4e-3 from an exact truth) rather than the original's.
    assert!(
        rc_natural <= 4e-3 && re_natural <= 4e-3,
        "d_e / d_c rel error {re_natural} / {rc_natural} in id order"
    );
}

/// Random rows aimed at their target class, `e_i = 4·c_{y_i} + 0.1·e_i`: `p_target` rounds to
/// 1 in f32.
fn aimed_case(n: usize, d: usize, v: usize) -> common::Case {
    let mut rng = seeded();
    let mut case = random_case(&mut rng, n, d, v, false, 0.0, 1.0);
    for i in 0..n {
        let y = case.targets[i] as usize;
        for k in 0..d {
            case.e[i * d + k] = 4.0 * case.c[y * d + k] + 0.1 * case.e[i * d + k];
        }
    }
    case
}

#[test]
fn label_smoothing_never_skips_a_confident_target() {
    // Rows aimed at their target class (p_target rounds to 1 in f32, so |1 − p| = 0): with label
    // smoothing the target's entry of G is g·(p − (1 − α)) ≈ g·α, which no filter may drop. The
    // filter magnitude at the target is |(1 − α) − p| (cce-core filter.rs); with |1 − p| whole
    // tiles holding the target were skipped and d_e lost α·c_target per row.
    let (n, d, v) = (64, 32, 512);
    let case = aimed_case(n, d, v);
    let (e, c, _, t) = case.tensors(DType::F32);
    for alpha in [0.0f32, 0.1] {
        let opts = Options {
            filter_eps: FilterEps::Value(1e-3),
            max_dropped_mass: 2e-2,
            label_smoothing: alpha,
            reduction: Reduction::Sum,
            ..Default::default()
        };
        let (exact, g) = oracle_and_tile_filtered(&e, &c, None, &t, &opts);
        let s = &g.stats;
        // Peaked rows: tiles away from the target are skipped either way.
        assert!(s.tiles_skipped > 0, "alpha {alpha}: nothing skipped: {s}");
        let d_e = g.d_e.unwrap().to_f64_vec();
        assert_de_within_dropped_mass(&case, &d_e, &exact.d_e, s, &format!("alpha {alpha}"));
    }
}

#[test]
fn z_loss_never_skips_a_confident_target() {
    // The same rows with z-loss: the target's G = g·((1 + 2λ·lse)·p − 1) stays ≈ g·2λ·lse as
    // p → 1 (|1 − p| = 0 in f32). Its filter magnitude is |w − p| with w = 1 / (1 + 2λ·lse)
    // (cce-core filter.rs, w = cy / cp); with w = 1 it was 0 and the target was dropped.
    let (n, d, v) = (64, 32, 512);
    let case = aimed_case(n, d, v);
    let (e, c, _, t) = case.tensors(DType::F32);
    let lambda = 0.01f32;
    let opts = Options {
        filter_eps: FilterEps::Value(1e-3),
        max_dropped_mass: 2e-2,
        z_loss: lambda,
        reduction: Reduction::Sum,
        ..Default::default()
    };
    let (exact, g) = oracle_and_tile_filtered(&e, &c, None, &t, &opts);
    let s = &g.stats;
    assert!(s.tiles_skipped > 0, "nothing skipped: {s}");
    let d_e = g.d_e.unwrap().to_f64_vec();
    let cmax = case
        .c
        .chunks(d)
        .map(|r| r.iter().map(|x| x * x).sum::<f64>().sqrt())
        .fold(0.0, f64::max);
    for i in 0..n {
        // Off the target |G| = (1 + 2λ·lse)·p: the dropped mass bound scales by that factor.
        let scale = 1.0 + 2.0 * lambda as f64 * exact.lse[i].abs();
        let err: f64 = (0..d)
            .map(|k| (d_e[i * d + k] - exact.d_e[i * d + k]).powi(2))
            .sum::<f64>()
            .sqrt();
        let bound = s.dropped_mass_max * scale * cmax + 1e-4;
        assert!(
            err <= bound,
            "row {i}: err {err} bound {bound} (lse {})\n{s}",
            exact.lse[i]
        );
    }
}

/// A filtered `forward_backward` decides its skips from its forward's per-tile statistics, with
/// the classes by batch-mean logit: its forward must be the separate forward's (argmax as a
/// class id, lowest on ties), its skips must hold the per-row bound, and its `d_e` must stay
/// within what the dropped mass explains, for both strategies.
#[test]
fn fused_forward_backward_keeps_the_separate_forward_and_the_bound() {
    let mut rng = seeded();
    for (kind, tr, tc) in [
        (StrategyKind::ChunkedDense, 16, 64),
        (StrategyKind::TileOwnership, 8, 32),
    ] {
        for (bias, scale) in [(false, 2.0), (true, 1.0)] {
            let (n, d, v) = (70, 48, 1100);
            let mut case = random_case(&mut rng, n, d, v, bias, 0.1, scale);
            // Two equal classes, large enough to be many rows' largest logit: the argmax's ties
            // come back as the lower class id.
            let (a, b) = (3 * d, 900 * d);
            for k in 0..d {
                case.c[a + k] *= 6.0;
                case.c[b + k] = case.c[a + k];
            }
            if let Some(bias) = case.bias.as_mut() {
                bias[900] = bias[3];
            }
            let (e, c, bt, t) = case.tensors(DType::F32);
            let opts = Options {
                filter_eps: FilterEps::Value(1e-3),
                max_dropped_mass: 1e-2,
                side_outputs: cce_core::SideOutputs {
                    entropy: true,
                    argmax: true,
                },
                ..Default::default()
            };
            let be = CpuBackend::with_limits(limits(kind, tr, tc));
            let inputs = Inputs {
                e: &e,
                c: &c,
                bias: bt.as_ref(),
                targets: &t,
            };
            let sep = be.forward(&inputs, &opts).unwrap();
            let (fwd, g) = be
                .forward_backward(&inputs, &opts, &Upstream::default())
                .unwrap();
            let what = format!("{kind:?} bias {bias} scale {scale}");
            let (l0, l1) = (sep.loss.to_f64_vec()[0], fwd.loss.to_f64_vec()[0]);
            assert!(
                (l0 - l1).abs() <= 1e-6 * l0.abs().max(1.0),
                "{what}: loss {l0} {l1}"
            );
            for (x, y) in sep.lse.to_f64_vec().iter().zip(fwd.lse.to_f64_vec()) {
                assert!(
                    (x - y).abs() <= 1e-5 * x.abs().max(1.0),
                    "{what}: lse {x} {y}"
                );
            }
            let (a0, a1) = (sep.argmax.unwrap(), fwd.argmax.unwrap());
            assert_eq!(a0.to_f64_vec(), a1.to_f64_vec(), "{what}: argmax");
            let ties = a1.to_f64_vec().iter().filter(|&&j| j == 3.0).count();
            assert!(ties > 0, "{what}: no row's largest logit is the tied class");
            for (x, y) in
                (sep.entropy.unwrap().to_f64_vec().iter()).zip(fwd.entropy.unwrap().to_f64_vec())
            {
                assert!((x - y).abs() <= 1e-4, "{what}: entropy {x} {y}");
            }
            let s = &g.stats;
            assert!(s.dropped_mass_max <= 1e-2 + 1e-7, "{what}: {s}");
            assert!(s.tiles_skipped > 0, "{what}: nothing skipped: {s}");
            let exact = naive(
                &e,
                &c,
                bt.as_ref(),
                &t,
                &opts,
                &OracleDLoss::Scalar(1.0),
                None,
                Precision::F64,
            )
            .unwrap();
            let d_e = g.d_e.unwrap().to_f64_vec();
            assert_de_within_dropped_mass(&case, &d_e, &exact.d_e, s, &what);
        }
    }
}
