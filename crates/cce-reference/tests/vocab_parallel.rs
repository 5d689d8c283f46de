//! Vocabulary-parallel calls against the single-device CPU backend and the f64 oracle.
//!
//! - `sharded_equals_single_device` (proptest): `k ∈ {1, 2, 3, 4}` simulated ranks, `V` drawn
//!   freely (mostly not divisible by `k`; padded layouts too), every option, fresh random
//!   inputs per case, peaked logits and confident targets among them: per row, the sharded
//!   loss, lse, `d_e`, `d_c`, `d_bias` equal the single-device call within the conformance rule
//!   (`cce_core::tolerance`, twice the allowance of one call against the truth, plus what each
//!   call's filter skipped), every rank returns the same bits, and the per-row dropped mass
//!   summed over the shards stays within `max_dropped_mass`.
//!
//! Padded vocabularies and bad input: `vocab_parallel_layouts.rs`.

mod common;

use cce_core::options::{FilterEps, GradDType, Options, Reduction};
use cce_core::plan::TileShape;
use cce_core::tolerance::{kappa, max_row_norm, row_allowance, tau};
use cce_core::{Backend, DLoss, DType, HostTensor, Inputs, TensorMeta, Upstream};
use cce_reference::vocab_parallel::{CpuShard, SimulatedLayout, SimulatedVocabParallel};
use cce_reference::{naive, CpuBackend, OracleDLoss, Precision};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError};
use rand::{Rng, SeedableRng};

/// One drawn case: shapes, options, data kind and the seed of its values.
#[derive(Clone, Debug)]
struct Draw {
    ranks: usize,
    padded: Option<usize>,
    batch: usize,
    seq: usize,
    d: usize,
    v: usize,
    dtype: DType,
    reduction: Reduction,
    bias: bool,
    softcap: Option<f32>,
    z_loss: f32,
    label_smoothing: f32,
    shift: usize,
    ignored: f64,
    filter: bool,
    d_lse: bool,
    peaked: bool,
    confident: bool,
    grad_f32: bool,
    compute: (bool, bool),
    tile: (usize, usize),
    seed: u64,
}

fn draws() -> impl Strategy<Value = Draw> {
    (
        (
            1usize..=4,
            prop_oneof![3 => Just(None), 1 => (1usize..4).prop_map(Some)],
        ),
        (1usize..=3, 1usize..=24, 1usize..=40, 1usize..=300),
        prop::sample::select(vec![DType::F32, DType::F16, DType::BF16]),
        prop::sample::select(vec![Reduction::Mean, Reduction::Sum, Reduction::None]),
        (
            any::<bool>(),
            prop::option::of(prop::sample::select(vec![0.5f32, 5.0, 30.0])),
        ),
        (
            prop::sample::select(vec![0.0f32, 1e-3, 0.1]),
            prop::sample::select(vec![0.0f32, 0.1, 0.3]),
        ),
        (0usize..=2, prop::sample::select(vec![0.0f64, 0.2, 0.6])),
        (
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
        ),
        prop_oneof![4 => Just((true, true)), 1 => Just((true, false)), 1 => Just((false, true))],
        prop::sample::select(vec![(64usize, 256usize), (8, 16), (3, 7)]),
        any::<u64>(),
    )
        .prop_map(
            |(
                (ranks, padded),
                (batch, seq, d, v),
                dtype,
                reduction,
                (bias, softcap),
                (z_loss, label_smoothing),
                (shift, ignored),
                (filter, d_lse, peaked, confident, grad_f32),
                compute,
                tile,
                seed,
            )| Draw {
                ranks,
                padded,
                batch,
                seq,
                d,
                v,
                dtype,
                reduction,
                bias,
                softcap,
                z_loss,
                label_smoothing,
                shift,
                ignored,
                filter,
                d_lse,
                peaked,
                confident,
                grad_f32,
                compute,
                tile,
                seed,
            },
        )
}

/// The tensors of a drawn case: `e`, `c`, `bias`, `targets`, per-row `d_loss` (none) or its
/// scalar, `d_lse`.
struct Data {
    e: HostTensor,
    c: HostTensor,
    bias: Option<HostTensor>,
    targets: HostTensor,
    d_loss_rows: Option<HostTensor>,
    d_loss: f32,
    d_lse: Option<HostTensor>,
    opts: Options,
}

fn build(dr: &Draw) -> Data {
    let mut rng = rand::rngs::StdRng::seed_from_u64(dr.seed);
    let n = dr.batch * dr.seq;
    let scale = if dr.peaked { 1.6 } else { 0.4 };
    let mut case = common::random_case(&mut rng, n, dr.d, dr.v, dr.bias, dr.ignored, scale);
    if dr.confident {
        // Half the rows target their own argmax (p_y → 1 on peaked data).
        for i in (0..n).step_by(2) {
            let logit = |j: usize| -> f64 {
                let dot: f64 = (0..dr.d)
                    .map(|k| case.e[i * dr.d + k] * case.c[j * dr.d + k])
                    .sum();
                dot + case.bias.as_ref().map_or(0.0, |b| b[j])
            };
            let best = (0..dr.v)
                .max_by(|&a, &b| logit(a).total_cmp(&logit(b)))
                .unwrap();
            case.targets[i] = best as i64;
        }
    }
    let (e, c, bias, targets) = case.tensors(dr.dtype);
    let f32s = |vals: Vec<f32>| HostTensor::from_f32(vec![vals.len()], &vals, DType::F32).unwrap();
    let d_loss_rows = (dr.reduction == Reduction::None)
        .then(|| f32s((0..n).map(|_| rng.random_range(-1.0f32..2.0)).collect()));
    let d_lse = dr
        .d_lse
        .then(|| f32s((0..n).map(|_| rng.random_range(-0.5f32..0.5)).collect()));
    let opts = Options {
        reduction: dr.reduction,
        softcap: dr.softcap,
        z_loss: dr.z_loss,
        label_smoothing: dr.label_smoothing,
        shift: dr.shift,
        seq_len: Some(dr.seq),
        filter_eps: if dr.filter {
            FilterEps::Auto
        } else {
            FilterEps::Off
        },
        grad_dtype: if dr.grad_f32 {
            GradDType::F32
        } else {
            GradDType::Input
        },
        compute_d_e: dr.compute.0,
        compute_d_c: dr.compute.1,
        ..Options::default()
    };
    Data {
        e,
        c,
        bias,
        targets,
        d_loss_rows,
        d_loss: rng.random_range(0.5f32..2.0),
        d_lse,
        opts,
    }
}

fn group(dr: &Draw) -> SimulatedVocabParallel {
    let g = SimulatedVocabParallel::new(dr.ranks).with_cpu(CpuShard::with_tile(TileShape {
        rows: dr.tile.0,
        classes: dr.tile.1,
        depth: 32,
    }));
    match dr.padded {
        Some(multiple) => g.with_layout(SimulatedLayout::Padded { multiple }),
        None => g,
    }
}

fn vals(t: &Option<HostTensor>) -> Vec<f64> {
    t.as_ref().map(|t| t.to_f64_vec()).unwrap_or_default()
}

fn check(dr: &Draw) -> Result<(), TestCaseError> {
    let data = build(dr);
    let opts = &data.opts;
    let inputs = Inputs {
        e: &data.e,
        c: &data.c,
        bias: data.bias.as_ref(),
        targets: &data.targets,
    };
    let upstream = Upstream {
        d_loss: match &data.d_loss_rows {
            Some(t) => DLoss::PerRow(t),
            None => DLoss::Scalar(data.d_loss),
        },
        d_lse: data.d_lse.as_ref(),
    };
    let cpu = CpuBackend::new();
    let single = cpu.forward(&inputs, opts);
    let sim = group(dr);
    let ranks_fwd = sim.forward_ranks(&inputs, opts).unwrap();
    // A mean over no valid row: the same typed error on every rank and on one device.
    let Ok(single) = single else {
        let err = single.unwrap_err();
        for r in &ranks_fwd {
            prop_assert!(
                std::mem::discriminant(r.as_ref().unwrap_err()) == std::mem::discriminant(&err),
                "single device: {err:?}, rank: {r:?}"
            );
        }
        return Ok(());
    };
    let fwd: Vec<_> = ranks_fwd.into_iter().map(|r| r.unwrap()).collect();
    for f in &fwd[1..] {
        prop_assert_eq!(f.output.lse.as_bytes(), fwd[0].output.lse.as_bytes());
        prop_assert_eq!(f.output.loss.as_bytes(), fwd[0].output.loss.as_bytes());
    }
    let sfwd = &fwd[0].output;
    let (layout, ranks_bwd) = sim
        .backward_ranks(&inputs, opts, sfwd.saved(), &upstream)
        .unwrap();
    let bwd: Vec<_> = ranks_bwd.into_iter().map(|r| r.unwrap()).collect();
    for b in &bwd[1..] {
        prop_assert_eq!(
            b.d_e.as_ref().map(|t| t.as_bytes().to_vec()),
            bwd[0].d_e.as_ref().map(|t| t.as_bytes().to_vec())
        );
        prop_assert_eq!(&b.dropped, &bwd[0].dropped);
        prop_assert!(b.dropped.is_some());
    }
    let sbwd = cpu
        .backward(&inputs, opts, single.saved(), &upstream)
        .unwrap();
    let simulated = sim
        .backward(&inputs, opts, sfwd.saved(), &upstream)
        .unwrap();

    // The truth and the scales of the conformance rule.
    let (n, d, v) = (data.targets.numel(), dr.d, dr.v);
    let oracle_dloss = match &data.d_loss_rows {
        Some(t) => OracleDLoss::PerRow(t.to_f64_vec()),
        None => OracleDLoss::Scalar(data.d_loss as f64),
    };
    let h = data.d_lse.as_ref().map(|t| t.to_f64_vec());
    let gt = naive(
        &data.e,
        &data.c,
        data.bias.as_ref(),
        &data.targets,
        opts,
        &oracle_dloss,
        h.as_deref(),
        Precision::F64,
    )
    .unwrap();
    let zmag = gt.lse.iter().fold(1.0f64, |a, x| a.max(x.abs()));
    let kap = kappa(zmag, d);
    let out_dtype = if dr.grad_f32 { DType::F32 } else { dr.dtype };
    let ev = data.e.to_f64_vec();
    let cv = data.c.to_f64_vec();
    let (m_c, m_e) = (max_row_norm(&cv, d), max_row_norm(&ev, d));

    // Forward, per row: lse, and the loss (per row or reduced), in units of the logits.
    let t_fwd = 2.0 * tau(dr.dtype, v, 1.0);
    let (ls, lc) = (sfwd.lse.to_f64_vec(), single.lse.to_f64_vec());
    for i in 0..n {
        prop_assert!(
            (ls[i] - lc[i]).abs() <= t_fwd * zmag,
            "lse row {i}: sharded {} single {}",
            ls[i],
            lc[i]
        );
    }
    let (a, b) = (sfwd.loss.to_f64_vec(), single.loss.to_f64_vec());
    prop_assert_eq!(a.len(), b.len());
    let n_valid = gt.n_valid.max(1) as f64;
    let loss_unit = match dr.reduction {
        Reduction::Sum => zmag * n_valid.sqrt(),
        _ => zmag,
    };
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        prop_assert!(
            (x - y).abs() <= t_fwd * loss_unit,
            "loss {i}: sharded {x} single {y}"
        );
    }

    // What each call's filter may have skipped, per row of d_e and per class of d_c.
    let rule = cce_core::FilterRule::resolve(opts, dr.dtype);
    let g: Vec<f64> = match (&data.d_loss_rows, dr.reduction) {
        (Some(t), _) => t.to_f64_vec(),
        (None, Reduction::Mean) => vec![data.d_loss as f64 / n_valid; n],
        (None, _) => vec![data.d_loss as f64; n],
    };
    let hv = h.clone().unwrap_or_else(|| vec![0.0; n]);
    let w: Vec<f64> = (0..n)
        .map(|i| {
            let gi = if gt.row_loss[i] == 0.0 && gt.rest_mass[i] == 0.0 {
                0.0
            } else {
                g[i].abs()
            };
            gi * (1.0 + 2.0 * dr.z_loss as f64 * gt.lse[i].abs()) + hv[i].abs()
        })
        .collect();
    let delta = rule.max_dropped_mass as f64;
    let per_row = bwd[0]
        .dropped
        .as_ref()
        .expect("the CPU shard reports dropped mass per row");
    let dropped: Vec<f64> = per_row.iter().map(|m| m + delta).collect();
    for &m in per_row {
        prop_assert!(
            m <= delta * (1.0 + 1e-9) + 1e-15,
            "dropped {m} over {delta}"
        );
    }
    let skip = |on: bool| if rule.enabled && on { 1.0 } else { 0.0 };
    let e_norm: Vec<f64> = ev
        .chunks(d)
        .map(|r| r.iter().map(|x| x * x).sum::<f64>().sqrt())
        .collect();
    let eps = rule.eps as f64;

    // d_e, per row.
    if opts.compute_d_e {
        let (ds, dc) = (vals(&simulated.d_e), vals(&sbwd.d_e));
        let t = 2.0 * tau(dr.dtype, v, kap);
        for i in 0..n {
            let row = |x: &[f64]| x[i * d..(i + 1) * d].to_vec();
            let (s, c1, truth) = (row(&ds), row(&dc), row(&gt.d_e));
            let err = s
                .iter()
                .zip(&c1)
                .map(|(a, b)| (a - b) * (a - b))
                .sum::<f64>()
                .sqrt();
            let tn = truth.iter().map(|x| x * x).sum::<f64>().sqrt();
            let f = skip(rule.filter_e_grad) * w[i] * dropped[i] * m_c;
            let allowed = row_allowance(t, tn, gt.g_terms_rows[i] * m_c, f, d, out_dtype);
            prop_assert!(
                err <= allowed,
                "d_e row {i}: |sharded − single| {err:e} > {allowed:e}"
            );
        }
    }
    // d_c per class row and d_bias per class.
    if opts.compute_d_c {
        let (ds, dc) = (vals(&simulated.d_c), vals(&sbwd.d_c));
        let t = 2.0 * tau(dr.dtype, n, kap);
        let fc: f64 = (0..n)
            .map(|i| w[i] * eps.min(dropped[i]) * e_norm[i])
            .sum::<f64>()
            * skip(rule.filter_c_grad);
        let fb: f64 =
            (0..n).map(|i| w[i] * eps.min(dropped[i])).sum::<f64>() * skip(rule.filter_c_grad);
        for j in 0..v {
            let row = |x: &[f64]| x[j * d..(j + 1) * d].to_vec();
            let (s, c1, truth) = (row(&ds), row(&dc), row(&gt.d_c));
            let err = s
                .iter()
                .zip(&c1)
                .map(|(a, b)| (a - b) * (a - b))
                .sum::<f64>()
                .sqrt();
            let tn = truth.iter().map(|x| x * x).sum::<f64>().sqrt();
            let allowed = row_allowance(t, tn, gt.g_terms_cols[j] * m_e, fc, d, out_dtype);
            prop_assert!(
                err <= allowed,
                "d_c row {j}: |sharded − single| {err:e} > {allowed:e}"
            );
        }
        prop_assert_eq!(simulated.d_bias.is_some(), sbwd.d_bias.is_some());
        if let (Some(s), Some(c1), Some(truth)) = (&simulated.d_bias, &sbwd.d_bias, &gt.d_bias) {
            let (s, c1) = (s.to_f64_vec(), c1.to_f64_vec());
            for j in 0..v {
                let allowed =
                    row_allowance(t, truth[j].abs(), gt.g_terms_cols[j], fb, 1, out_dtype);
                prop_assert!(
                    (s[j] - c1[j]).abs() <= allowed,
                    "d_bias {j}: sharded {} single {} allowed {allowed:e}",
                    s[j],
                    c1[j]
                );
            }
        }
        // Each shard's d_c has exactly the shard's rows, zeros in the padding.
        for (shard, b) in layout.shards().iter().zip(&bwd) {
            let dcs = vals(&b.d_c);
            prop_assert_eq!(dcs.len(), shard.len() * d);
            prop_assert!(dcs[shard.real_len() * d..].iter().all(|&x| x == 0.0));
        }
    } else {
        prop_assert!(simulated.d_c.is_none() && simulated.d_bias.is_none());
    }
    prop_assert!(simulated.stats.dropped_mass_max <= delta * (1.0 + 1e-9) + 1e-15);
    Ok(())
}

proptest! {
    #![proptest_config(Config { cases: 256, failure_persistence: None, ..Config::default() })]

    #[test]
    fn sharded_equals_single_device(dr in draws()) {
        check(&dr)?;
    }
}
