//! Vocabulary-parallel calls against the single-device CPU backend and the f64 oracle.
//!
//! - `sharded_equals_single_device` (proptest): `k ∈ {1, 2, 3, 4}` simulated ranks, `V` drawn
//!   freely (mostly not divisible by `k`; padded layouts too), every option, fresh random
//!   inputs per case, peaked logits and confident targets among them: per row, the sharded
//!   loss, lse, `d_e`, `d_c`, `d_bias` equal the single-device call within the conformance rule
//!   (`cce_core::tolerance`, twice the allowance of one call against the truth, plus what each
//!   call's filter skipped), every rank returns the same bits, and the per-row dropped mass
//!   summed over the shards stays within `max_dropped_mass`.
//! - padded vocabularies: targets equal to `ignore_index` (or any sentinel) never match a
//!   padding class, whose rows of `c` and `bias` hold NaN or huge values; the loss is finite
//!   and equal to the unpadded one; the padding's gradients are exactly 0.
//! - bad input: one test per typed error.

mod common;

use cce_core::options::{FilterEps, GradDType, Options, Reduction};
use cce_core::plan::TileShape;
use cce_core::tolerance::{kappa, max_row_norm, row_allowance, tau};
use cce_core::vocab_parallel::{ShardLayout, VocabParallelError, VocabShard};
use cce_core::{Backend, CceError, DLoss, DType, HostTensor, Inputs, Saved, TensorMeta, Upstream};
use cce_reference::vocab_parallel::{
    CpuShard, RankDriver, SimulatedLayout, SimulatedVocabParallel, ThreadComm,
};
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
    let dropped: Vec<f64> = bwd[0].dropped.iter().map(|m| m + delta).collect();
    for &m in &bwd[0].dropped {
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

/// Per-rank inputs of a hand-built group.
struct RankInputs {
    shard: VocabShard,
    e: HostTensor,
    c: HostTensor,
    bias: Option<HostTensor>,
    targets: HostTensor,
}

/// `f32` tensor of `shape` from values.
fn t32(shape: Vec<usize>, vals: &[f32], dtype: DType) -> HostTensor {
    HostTensor::from_f32(shape, vals, dtype).unwrap()
}

/// Rows `range` of a row-major `[_, width]` value list, with `pad` rows of `fill` after.
fn rows_of(
    vals: &[f32],
    width: usize,
    range: std::ops::Range<usize>,
    pad: usize,
    fill: f32,
) -> Vec<f32> {
    let mut out = vals[range.start * width..range.end * width].to_vec();
    out.extend(std::iter::repeat_n(fill, pad * width));
    out
}

/// Forward then backward (from the rank's own forward) on every rank of a hand-built group.
#[allow(clippy::type_complexity)]
fn run_group(
    ranks: &[RankInputs],
    opts: &Options,
) -> Vec<(
    cce_core::Result<cce_reference::vocab_parallel::RankForward>,
    Option<cce_core::Result<cce_reference::vocab_parallel::RankBackward>>,
)> {
    ThreadComm::run(ranks.len(), |comm| {
        use cce_core::vocab_parallel::Communicator;
        let r = &ranks[comm.rank()];
        let inputs = Inputs {
            e: &r.e,
            c: &r.c,
            bias: r.bias.as_ref(),
            targets: &r.targets,
        };
        let driver = RankDriver::from_shard(comm, r.shard);
        let fwd = driver.forward(&inputs, opts);
        let ones = per_row_ones(&r.targets);
        let bwd = match &fwd {
            Ok(f) => Some(driver.backward(&inputs, opts, f.output.saved(), &upstream(opts, &ones))),
            Err(_) => None,
        };
        (fwd, bwd)
    })
}

/// `[N]` ones, the per-row `d_loss` of `Reduction::None`.
fn per_row_ones(targets: &HostTensor) -> HostTensor {
    t32(
        vec![targets.numel()],
        &vec![1.0; targets.numel()],
        DType::F32,
    )
}

/// `d_loss = 1` (per row of ones for `Reduction::None`).
fn upstream<'a>(opts: &Options, ones: &'a HostTensor) -> Upstream<'a, HostTensor> {
    Upstream {
        d_loss: if opts.reduction == Reduction::None {
            DLoss::PerRow(ones)
        } else {
            DLoss::Scalar(1.0)
        },
        d_lse: None,
    }
}

/// A small problem: `e` `[n, d]`, `c` `[v, d]`, `bias` `[v]` as f32 values.
fn small_problem(n: usize, d: usize, v: usize, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let case = common::random_case(&mut rng, n, d, v, true, 0.0, 0.8);
    let f = |x: &[f64]| x.iter().map(|&v| v as f32).collect::<Vec<f32>>();
    (f(&case.e), f(&case.c), f(case.bias.as_ref().unwrap()))
}

/// The whole problem, before it is split over ranks.
struct Whole<'a> {
    v: usize,
    d: usize,
    c: &'a [f32],
    bias: &'a [f32],
    e: &'a HostTensor,
    targets: &'a HostTensor,
}

/// Split `c` and `bias` over `ranges` (padding past `v` filled with `fill`).
fn split(w: &Whole, ranges: &[std::ops::Range<usize>], fill: f32) -> Vec<RankInputs> {
    let (v, d) = (w.v, w.d);
    ranges
        .iter()
        .map(|r| {
            let real = r.start.min(v)..r.end.min(v);
            let pad = r.len() - real.len();
            RankInputs {
                shard: VocabShard::new(v, r.start, r.end).unwrap(),
                e: w.e.clone(),
                c: t32(
                    vec![r.len(), d],
                    &rows_of(w.c, d, real.clone(), pad, fill),
                    DType::F32,
                ),
                bias: Some(t32(
                    vec![r.len()],
                    &rows_of(w.bias, 1, real, pad, fill),
                    DType::F32,
                )),
                targets: w.targets.clone(),
            }
        })
        .collect()
}

#[test]
fn padding_never_matches_an_ignored_target_or_a_sentinel() {
    let (n, d, v) = (12, 16, 10);
    let (e, c, bias) = small_problem(n, d, v, common::seeded().random());
    let e_t = t32(vec![n, d], &e, DType::F32);
    let full_c = t32(vec![v, d], &c, DType::F32);
    let full_bias = t32(vec![v], &bias, DType::F32);
    // V = 10 over 3 ranks padded to 12: shard 2 holds classes 8, 9 and padding 10, 11.
    let layout = ShardLayout::padded(v, 3, 4).unwrap();
    assert_eq!(layout.padded_vocab_size(), 12);
    let ranges: Vec<_> = layout.shards().iter().map(|s| s.start()..s.end()).collect();
    // ignore_index in the padding (10, 11), at its usual -100, and at -1; huge, NaN padding.
    for ignore_index in [10i64, 11, -100, -1] {
        for fill in [f32::NAN, 1e4, f32::NEG_INFINITY] {
            for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
                let targets: Vec<i64> = (0..n)
                    .map(|i| {
                        if i % 3 == 0 {
                            ignore_index
                        } else {
                            ((i * 7) % v) as i64
                        }
                    })
                    .collect();
                let targets = HostTensor::from_i64(targets);
                let opts = Options {
                    ignore_index,
                    reduction,
                    label_smoothing: 0.1,
                    z_loss: 1e-3,
                    ..Options::exact()
                };
                let ranks = split(
                    &Whole {
                        v,
                        d,
                        c: &c,
                        bias: &bias,
                        e: &e_t,
                        targets: &targets,
                    },
                    &ranges,
                    fill,
                );
                let out = run_group(&ranks, &opts);
                let inputs = Inputs {
                    e: &e_t,
                    c: &full_c,
                    bias: Some(&full_bias),
                    targets: &targets,
                };
                let cpu = CpuBackend::new();
                let ones = per_row_ones(&targets);
                let (single, single_b) = cpu
                    .forward_backward(&inputs, &opts, &upstream(&opts, &ones))
                    .unwrap();
                let want = single.loss.to_f64_vec();
                for (rank, (fwd, bwd)) in out.into_iter().enumerate() {
                    let what = format!(
                        "ignore_index {ignore_index}, fill {fill}, {reduction:?}, rank {rank}"
                    );
                    let fwd = fwd.unwrap_or_else(|e| panic!("{what}: {e}"));
                    let got = fwd.output.loss.to_f64_vec();
                    assert_eq!(got.len(), want.len());
                    for (a, b) in got.iter().zip(&want) {
                        assert!(a.is_finite(), "{what}: loss {a}");
                        assert!(
                            (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                            "{what}: {a} vs {b}"
                        );
                    }
                    let bwd = bwd.unwrap().unwrap_or_else(|e| panic!("{what}: {e}"));
                    let shard = layout.shard(rank).unwrap();
                    let (dc, db) = (vals(&bwd.d_c), vals(&bwd.d_bias));
                    assert!(
                        dc[shard.real_len() * d..].iter().all(|&x| x == 0.0),
                        "{what}"
                    );
                    assert!(db[shard.real_len()..].iter().all(|&x| x == 0.0), "{what}");
                    assert!(dc.iter().chain(&db).all(|x| x.is_finite()), "{what}");
                    let want_dc = vals(&single_b.d_c);
                    let lo = shard.real_classes().start * d;
                    for (k, x) in dc[..shard.real_len() * d].iter().enumerate() {
                        let y = want_dc[lo + k];
                        assert!(
                            (x - y).abs() <= 1e-5 * y.abs().max(1e-2),
                            "{what}: d_c {x} vs {y}"
                        );
                    }
                    let (de, want_de) = (vals(&bwd.d_e), vals(&single_b.d_e));
                    for (x, y) in de.iter().zip(&want_de) {
                        assert!(
                            (x - y).abs() <= 1e-5 * y.abs().max(1e-2),
                            "{what}: d_e {x} vs {y}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn a_target_in_the_padding_is_out_of_range_on_every_rank() {
    let (n, d, v) = (4, 8, 10);
    let (e, c, bias) = small_problem(n, d, v, 7);
    let e_t = t32(vec![n, d], &e, DType::F32);
    let targets = HostTensor::from_i64(vec![1, 11, 3, -100]);
    let whole = Whole {
        v,
        d,
        c: &c,
        bias: &bias,
        e: &e_t,
        targets: &targets,
    };
    let ranks = split(&whole, &[0..4, 4..8, 8..12], f32::NAN);
    for (fwd, _) in run_group(&ranks, &Options::default()) {
        assert!(
            matches!(
                fwd,
                Err(CceError::TargetOutOfRange {
                    row: 1,
                    value: 11,
                    vocab_size: 10,
                    ..
                })
            ),
            "{fwd:?}"
        );
    }
}

/// The errors of every rank of a group whose rank `r` holds `ranges[r]`, `c` rows to fit.
fn tiling_errors(v: usize, ranges: &[std::ops::Range<usize>], shard_v: &[usize]) -> Vec<CceError> {
    let (n, d) = (3, 4);
    let (e, c, bias) = small_problem(n, d, v + 4, 3);
    let e_t = t32(vec![n, d], &e, DType::F32);
    let targets = HostTensor::from_i64(vec![0, 1, 2]);
    let mut ranks = split(
        &Whole {
            v: v + 4,
            d,
            c: &c,
            bias: &bias,
            e: &e_t,
            targets: &targets,
        },
        ranges,
        0.0,
    );
    for (r, s) in ranks.iter_mut().zip(shard_v) {
        r.shard = VocabShard::new(*s, r.shard.start(), r.shard.end()).unwrap();
    }
    run_group(&ranks, &Options::default())
        .into_iter()
        .map(|(f, _)| f.unwrap_err())
        .collect()
}

#[test]
fn shards_that_do_not_tile_are_typed_errors_on_every_rank() {
    use VocabParallelError as E;
    let check = |ranges: &[std::ops::Range<usize>], vs: &[usize], is: &dyn Fn(&E) -> bool| {
        for err in tiling_errors(10, ranges, vs) {
            match &err {
                CceError::VocabParallel(e) if is(e) => {}
                other => panic!("{ranges:?}: {other:?}"),
            }
        }
    };
    check(&[0..4, 5..10], &[10, 10], &|e| {
        matches!(
            e,
            E::Gap {
                shard: 1,
                expected_start: 4,
                start: 5
            }
        )
    });
    check(&[1..4, 4..10], &[10, 10], &|e| {
        matches!(e, E::Gap { shard: 0, .. })
    });
    check(&[0..6, 4..10], &[10, 10], &|e| {
        matches!(
            e,
            E::Overlap {
                shard: 1,
                previous_end: 6,
                start: 4
            }
        )
    });
    check(&[5..10, 0..5], &[10, 10], &|e| {
        matches!(e, E::OutOfOrder { shard: 1, .. })
    });
    check(&[0..4, 4..9], &[10, 10], &|e| {
        matches!(
            e,
            E::DoesNotCover {
                vocab_size: 10,
                covered_end: 9
            }
        )
    });
    check(&[0..4, 4..11], &[10, 11], &|e| {
        matches!(e, E::VocabSizeMismatch { shard: 1, .. })
    });
}

#[test]
fn a_layout_for_another_group_size_is_a_typed_error() {
    let layout = ShardLayout::even(10, 3).unwrap();
    let out = ThreadComm::run(2, |comm| RankDriver::new(comm, &layout).map(|d| d.shard()));
    for r in out {
        assert!(
            matches!(
                r,
                Err(CceError::VocabParallel(VocabParallelError::RankCount {
                    ranks: 2,
                    shards: 3
                }))
            ),
            "{r:?}"
        );
    }
}

/// A 3-rank group over `V = 10` (shards 0..4, 4..7, 7..10) with `edit` applied to its inputs.
fn edited_group(edit: impl Fn(&mut [RankInputs])) -> Vec<RankInputs> {
    let (n, d, v) = (5, 6, 10);
    let (e, c, bias) = small_problem(n, d, v, 11);
    let e_t = t32(vec![n, d], &e, DType::F32);
    let targets = HostTensor::from_i64(vec![0, 9, 5, -100, 3]);
    let mut ranks = split(
        &Whole {
            v,
            d,
            c: &c,
            bias: &bias,
            e: &e_t,
            targets: &targets,
        },
        &[0..4, 4..7, 7..10],
        0.0,
    );
    edit(&mut ranks);
    ranks
}

/// Rank `bad`'s forward error satisfies `own`; every other rank reports `PeerFailed([bad])`.
fn one_rank_fails(ranks: &[RankInputs], bad: usize, own: impl Fn(&CceError) -> bool) {
    for (rank, (fwd, _)) in run_group(ranks, &Options::default())
        .into_iter()
        .enumerate()
    {
        let err = fwd.unwrap_err();
        if rank == bad {
            assert!(own(&err), "rank {rank}: {err:?}");
        } else {
            assert!(
                matches!(&err, CceError::VocabParallel(VocabParallelError::PeerFailed { ranks }) if ranks == &[bad]),
                "rank {rank}: {err:?}"
            );
        }
    }
}

#[test]
fn a_shard_of_the_wrong_shape_fails_its_rank_and_stops_the_others() {
    let ranks = edited_group(|r| r[1].c = t32(vec![4, 6], &[0.5; 24], DType::F32));
    one_rank_fails(&ranks, 1, |e| {
        matches!(
            e,
            CceError::ShapeMismatch {
                what: "c (rows of the shard)",
                ..
            }
        )
    });
    let ranks = edited_group(|r| r[2].bias = Some(t32(vec![2], &[0.5; 2], DType::F32)));
    one_rank_fails(&ranks, 2, |e| {
        matches!(e, CceError::ShapeMismatch { what: "bias", .. })
    });
    let ranks = edited_group(|r| r[0].c = t32(vec![4, 5], &[0.5; 20], DType::F32));
    one_rank_fails(&ranks, 0, |e| matches!(e, CceError::ShapeMismatch { .. }));
}

#[test]
fn a_non_finite_shard_is_named_with_its_global_index() {
    let ranks = edited_group(|r| {
        let mut c = r[2].c.to_f32_vec();
        c[6 + 4] = f32::INFINITY; // row 1 of shard [7, 10): class 8, column 4
        r[2].c = t32(vec![3, 6], &c, DType::F32);
    });
    one_rank_fails(&ranks, 2, |e| {
        matches!(
            e,
            CceError::NonFinite {
                what: "c",
                index: 52,
                row: 8,
                ..
            }
        )
    });
    let ranks = edited_group(|r| {
        r[1].bias = Some(t32(vec![3], &[0.0, f32::NAN, 0.0], DType::F32));
    });
    one_rank_fails(&ranks, 1, |e| {
        matches!(
            e,
            CceError::NonFinite {
                what: "bias",
                index: 5,
                ..
            }
        )
    });
}

#[test]
fn ranks_with_different_replicated_inputs_are_typed_errors() {
    let ranks = edited_group(|r| r[1].targets = HostTensor::from_i64(vec![0, 9, 5, -100, 4]));
    for (fwd, _) in run_group(&ranks, &Options::default()) {
        assert!(
            matches!(
                fwd,
                Err(CceError::VocabParallel(
                    VocabParallelError::ReplicaMismatch {
                        what: "targets",
                        ..
                    }
                ))
            ),
            "{fwd:?}"
        );
    }
    // Another N on one rank: the collective's lengths differ; an error, never a hang.
    let ranks = edited_group(|r| {
        r[2].e = t32(vec![4, 6], &[0.25; 24], DType::F32);
        r[2].targets = HostTensor::from_i64(vec![0, 9, 5, -100]);
    });
    for (fwd, _) in run_group(&ranks, &Options::default()) {
        assert!(
            matches!(
                fwd,
                Err(CceError::VocabParallel(
                    VocabParallelError::CollectiveMismatch { .. }
                ))
            ),
            "{fwd:?}"
        );
    }
}

#[test]
fn a_masked_target_is_reported_by_every_rank() {
    // Row 1's target is 9, in shard [7, 10), masked by its bias.
    let ranks = edited_group(|r| {
        r[2].bias = Some(t32(vec![3], &[0.0, 0.0, f32::NEG_INFINITY], DType::F32));
    });
    for (fwd, _) in run_group(&ranks, &Options::default()) {
        assert!(
            matches!(fwd, Err(CceError::TargetMasked { row: 1, target: 9 })),
            "{fwd:?}"
        );
    }
}

#[test]
fn bad_saved_or_upstream_buffers_are_errors_on_every_rank() {
    let ranks = edited_group(|_| {});
    let opts = Options::default();
    let out = ThreadComm::run(ranks.len(), |comm| {
        use cce_core::vocab_parallel::Communicator;
        let r = &ranks[comm.rank()];
        let inputs = Inputs {
            e: &r.e,
            c: &r.c,
            bias: r.bias.as_ref(),
            targets: &r.targets,
        };
        let driver = RankDriver::from_shard(comm, r.shard);
        let short = t32(vec![4], &[0.0; 4], DType::F32);
        let saved = Saved {
            lse: &short,
            rest_mass: &short,
        };
        let bad_lse = driver.backward(&inputs, &opts, saved, &Upstream::<HostTensor>::default());
        let fwd = driver.forward(&inputs, &opts).unwrap();
        let per_row = t32(vec![5], &[1.0; 5], DType::F32);
        let upstream = Upstream {
            d_loss: DLoss::PerRow(&per_row),
            d_lse: None,
        };
        let bad_dloss = driver.backward(&inputs, &opts, fwd.output.saved(), &upstream);
        let nan = Upstream::<HostTensor> {
            d_loss: DLoss::Scalar(f32::NAN),
            d_lse: None,
        };
        let nan_dloss = driver.backward(&inputs, &opts, fwd.output.saved(), &nan);
        (bad_lse, bad_dloss, nan_dloss)
    });
    for (bad_lse, bad_dloss, nan_dloss) in out {
        assert!(
            matches!(bad_lse, Err(CceError::ShapeMismatch { what: "lse", .. })),
            "{bad_lse:?}"
        );
        assert!(
            matches!(
                bad_dloss,
                Err(CceError::ShapeMismatch { what: "d_loss", .. })
            ),
            "{bad_dloss:?}"
        );
        assert!(
            matches!(nan_dloss, Err(CceError::NonFinite { what: "d_loss", .. })),
            "{nan_dloss:?}"
        );
    }
}

#[test]
fn a_rank_that_stops_early_never_hangs_the_group() {
    let ranks = edited_group(|_| {});
    let out = ThreadComm::run(ranks.len(), |comm| {
        use cce_core::vocab_parallel::Communicator;
        if comm.rank() == 1 {
            return None;
        }
        let r = &ranks[comm.rank()];
        let inputs = Inputs {
            e: &r.e,
            c: &r.c,
            bias: r.bias.as_ref(),
            targets: &r.targets,
        };
        Some(RankDriver::from_shard(comm, r.shard).forward(&inputs, &Options::default()))
    });
    for r in out.into_iter().flatten() {
        assert!(
            matches!(
                r,
                Err(CceError::VocabParallel(VocabParallelError::PeerLost {
                    rank: 1
                }))
            ),
            "{r:?}"
        );
    }
}
