//! The check of a backend's composed shard primitives (`BackendShard`), shared by the CPU test
//! (`cce-reference/tests/vocab_parallel_backend_shard.rs`, over `CpuBackend`) and the CUDA
//! test (`cce-cuda/tests/vocab_parallel.rs`, included by path): `k ∈ {1, 2, 3, 4}` simulated
//! ranks (threads, one backend per rank), even layouts with `V` not divisible by `k` and
//! padded ones, every option, fresh random inputs, peaked and flat logits; per row the
//! sharded loss, lse, entropy, argmax, `d_e`, `d_c`, `d_bias` against the same backend's
//! unsharded call, within the conformance rule's relative tolerance (`cce_core::tolerance`,
//! four times one call's, plus what each call's filter may skip).

use cce_core::options::{FilterEps, GradDType, Options, Reduction, SideOutputs};
use cce_core::tolerance::{kappa, tau};
use cce_core::vocab_parallel::{ShardLayout, ShardRows};
use cce_core::{DLoss, DType, HostTensor, Inputs, TensorMeta, Upstream};
use cce_reference::vocab_parallel::simulate_over_backends;
use rand::{Rng, SeedableRng};

/// One case of the sweep.
#[derive(Clone, Debug)]
pub struct Case {
    pub ranks: usize,
    pub padded: Option<usize>,
    pub n: usize,
    pub d: usize,
    pub v: usize,
    pub dtype: DType,
    pub opts: Options,
    pub bias: bool,
    pub peaked: bool,
    pub d_lse: bool,
    pub seed: u64,
}

/// The sweep: every option on its own and several together, for k = 1..=4, V not divisible by
/// k (and padded layouts), f32 and bf16.
pub fn cases(big: bool) -> Vec<Case> {
    let (n, d, v) = if big { (98, 64, 1003) } else { (14, 8, 37) };
    let base = Options {
        filter_eps: FilterEps::Off,
        ..Options::default()
    };
    let variants: Vec<(&str, Options, bool, bool)> = vec![
        ("mean", base.clone(), false, false),
        (
            "sum+bias",
            Options {
                reduction: Reduction::Sum,
                ..base.clone()
            },
            true,
            false,
        ),
        (
            "none+d_lse",
            Options {
                reduction: Reduction::None,
                ..base.clone()
            },
            false,
            true,
        ),
        (
            "softcap",
            Options {
                softcap: Some(5.0),
                ..base.clone()
            },
            true,
            false,
        ),
        (
            "z_loss",
            Options {
                z_loss: 1e-3,
                ..base.clone()
            },
            false,
            true,
        ),
        (
            "label_smoothing",
            Options {
                label_smoothing: 0.1,
                ..base.clone()
            },
            true,
            false,
        ),
        (
            "ls+softcap+zloss",
            Options {
                label_smoothing: 0.2,
                softcap: Some(10.0),
                z_loss: 1e-2,
                ..base.clone()
            },
            true,
            true,
        ),
        (
            "shift+ignore",
            Options {
                shift: 1,
                seq_len: Some(n.min(7)),
                ignore_index: -7,
                ..base.clone()
            },
            false,
            false,
        ),
        (
            "side outputs",
            Options {
                side_outputs: SideOutputs {
                    entropy: true,
                    argmax: true,
                },
                ..base.clone()
            },
            true,
            false,
        ),
        (
            "filtered",
            Options {
                filter_eps: FilterEps::Auto,
                ..base.clone()
            },
            false,
            false,
        ),
        (
            "filtered+ls",
            Options {
                filter_eps: FilterEps::Auto,
                label_smoothing: 0.1,
                ..base.clone()
            },
            true,
            false,
        ),
        (
            "grad f32, d_e only",
            Options {
                grad_dtype: GradDType::F32,
                compute_d_c: false,
                ..base.clone()
            },
            true,
            false,
        ),
        (
            "d_c only",
            Options {
                compute_d_e: false,
                ..base.clone()
            },
            true,
            false,
        ),
    ];
    let mut out = Vec::new();
    let mut seed = 1u64;
    for ranks in 1..=4usize {
        for (i, (_, opts, bias, d_lse)) in variants.iter().enumerate() {
            for dtype in [DType::F32, DType::BF16] {
                seed += 1;
                let padded = (i % 3 == 2).then_some(1 + i % 4);
                // V not divisible by k (k > 1).
                let v = if ranks > 1 && v % ranks == 0 {
                    v + 1
                } else {
                    v
                };
                out.push(Case {
                    ranks,
                    padded,
                    n,
                    d,
                    v,
                    dtype,
                    opts: opts.clone(),
                    bias: *bias,
                    peaked: seed.is_multiple_of(2),
                    d_lse: *d_lse,
                    seed,
                });
            }
        }
    }
    // A small vocabulary over 4 padded ranks: the last shard is padding only.
    for (i, (_, opts, bias, d_lse)) in variants.iter().enumerate().take(7) {
        out.push(Case {
            ranks: 4,
            padded: Some(4),
            n,
            d,
            v: 5,
            dtype: DType::F32,
            opts: opts.clone(),
            bias: *bias,
            peaked: i % 2 == 0,
            d_lse: *d_lse,
            seed: 1000 + i as u64,
        });
    }
    out
}

/// A case's host tensors.
pub struct Data {
    pub e: HostTensor,
    pub c: HostTensor,
    pub bias: Option<HostTensor>,
    pub targets: HostTensor,
    pub d_loss_rows: Option<HostTensor>,
    pub d_loss: f32,
    pub d_lse: Option<HostTensor>,
}

pub fn build(case: &Case) -> Data {
    let mut rng = rand::rngs::StdRng::seed_from_u64(case.seed);
    let (n, d, v) = (case.n, case.d, case.v);
    let scale = if case.peaked { 1.5 } else { 0.3 };
    let mut gauss = |k: usize, s: f32| -> Vec<f32> {
        (0..k)
            .map(|_| (rng.random::<f32>() + rng.random::<f32>() + rng.random::<f32>() - 1.5) * s)
            .collect()
    };
    let e = gauss(n * d, scale);
    let c = gauss(v * d, scale);
    let bias = case.bias.then(|| gauss(v, 1.0));
    let ignore = case.opts.ignore_index;
    let targets: Vec<i64> = (0..n)
        .map(|i| {
            if i % 5 == 3 {
                ignore
            } else {
                ((i * 7919 + case.seed as usize) % v) as i64
            }
        })
        .collect();
    let f32s = |vals: Vec<f32>| HostTensor::from_f32(vec![vals.len()], &vals, DType::F32).unwrap();
    let d_loss_rows = (case.opts.reduction == Reduction::None)
        .then(|| f32s((0..n).map(|i| 0.5 + (i % 3) as f32 * 0.25).collect()));
    let d_lse = case
        .d_lse
        .then(|| f32s((0..n).map(|i| ((i % 4) as f32 - 1.5) * 0.1).collect()));
    Data {
        e: HostTensor::from_f32(vec![n, d], &e, case.dtype).unwrap(),
        c: HostTensor::from_f32(vec![v, d], &c, case.dtype).unwrap(),
        bias: bias.map(|b| HostTensor::from_f32(vec![v], &b, case.dtype).unwrap()),
        targets: HostTensor::from_i64(targets),
        d_loss_rows,
        d_loss: 1.25,
        d_lse,
    }
}

fn layout(case: &Case) -> ShardLayout {
    match case.padded {
        Some(m) => ShardLayout::padded(case.v, case.ranks, m).unwrap(),
        None => ShardLayout::even(case.v, case.ranks).unwrap(),
    }
}

fn rows(t: &HostTensor, width: usize) -> Vec<Vec<f64>> {
    t.to_f64_vec()
        .chunks(width.max(1))
        .map(|r| r.to_vec())
        .collect()
}

fn norm(x: &[f64]) -> f64 {
    x.iter().map(|v| v * v).sum::<f64>().sqrt()
}

/// Compare two `[R, width]` outputs row by row: `‖a_i − b_i‖ ≤ t (‖b_i‖ + floor) + slack`.
fn close(
    what: &str,
    case: &Case,
    a: &HostTensor,
    b: &HostTensor,
    width: usize,
    t: f64,
    slack: f64,
) {
    assert_eq!(a.shape(), b.shape(), "{what} shape, {case:?}");
    let (ra, rb) = (rows(a, width), rows(b, width));
    let floor = rb.iter().map(|r| norm(r)).fold(0.0, f64::max) * 1e-3;
    for (i, (x, y)) in ra.iter().zip(&rb).enumerate() {
        let diff: Vec<f64> = x.iter().zip(y).map(|(p, q)| p - q).collect();
        let err = norm(&diff);
        let allowed = t * (norm(y) + floor) + slack;
        assert!(
            err <= allowed,
            "{what} row {i}: error {err:e} > allowed {allowed:e}\n sharded {:?}\n single  {:?}\n{case:?}",
            &x[..x.len().min(6)],
            &y[..y.len().min(6)]
        );
    }
}

/// Run one case and compare: `backends[0]` makes the unsharded call, `backends[1..=k]` are
/// the ranks (at least 5 backends).
pub fn check<B: ShardRows + Sync>(case: &Case, backends: &[B]) {
    let data = build(case);
    let opts = &case.opts;
    let host_inputs = Inputs {
        e: &data.e,
        c: &data.c,
        bias: data.bias.as_ref(),
        targets: &data.targets,
    };
    let host_up = Upstream {
        d_loss: match &data.d_loss_rows {
            Some(t) => DLoss::PerRow(t),
            None => DLoss::Scalar(data.d_loss),
        },
        d_lse: data.d_lse.as_ref(),
    };
    // The unsharded call on the same backend.
    let one = &backends[0];
    let up = |t: &HostTensor| one.upload(t).unwrap();
    let (e, c, t) = (up(&data.e), up(&data.c), up(&data.targets));
    let b = data.bias.as_ref().map(up);
    let inputs = Inputs {
        e: &e,
        c: &c,
        bias: b.as_ref(),
        targets: &t,
    };
    let fwd = one.forward(&inputs, opts).unwrap();
    let dl = data.d_loss_rows.as_ref().map(up);
    let dlse = data.d_lse.as_ref().map(up);
    let upstream = Upstream {
        d_loss: match &dl {
            Some(x) => DLoss::PerRow(x),
            None => DLoss::Scalar(data.d_loss),
        },
        d_lse: dlse.as_ref(),
    };
    let bwd = one.backward(&inputs, opts, fwd.saved(), &upstream).unwrap();
    let down = |x: &B::Buffer| one.download(x).unwrap();

    let ranks = &backends[1..=case.ranks];
    let sim = simulate_over_backends(ranks, &layout(case), &host_inputs, opts, &host_up)
        .unwrap_or_else(|e| panic!("sharded call failed: {e:?}\n{case:?}"));
    assert!(sim.padding_zero, "padding gradients not zero, {case:?}");

    let lse = down(&fwd.lse).to_f64_vec();
    let zmag = lse.iter().fold(1.0f64, |a, x| a.max(x.abs()));
    let t_fwd = 4.0 * tau(case.dtype, case.v, 1.0);
    let out_dtype = match opts.grad_dtype {
        GradDType::F32 => DType::F32,
        GradDType::Input => case.dtype,
    };
    let t_bwd = 4.0 * tau(out_dtype, case.v.max(case.n), kappa(zmag, case.d));
    let sl = sim.forward.lse.to_f64_vec();
    for i in 0..case.n {
        assert!(
            (sl[i] - lse[i]).abs() <= t_fwd * zmag,
            "lse row {i}: sharded {} single {}, {case:?}",
            sl[i],
            lse[i]
        );
    }
    let (la, lb) = (sim.forward.loss.to_f64_vec(), down(&fwd.loss).to_f64_vec());
    assert_eq!(la.len(), lb.len());
    for (i, (x, y)) in la.iter().zip(&lb).enumerate() {
        let unit = if la.len() == 1 {
            zmag * (case.n as f64).sqrt()
        } else {
            zmag
        };
        assert!(
            (x - y).abs() <= t_fwd * unit,
            "loss {i}: sharded {x} single {y}, {case:?}"
        );
    }
    if let (Some(a), Some(b)) = (&sim.forward.entropy, &fwd.entropy) {
        close("entropy", case, a, &down(b), 1, t_fwd, t_fwd * zmag);
    }
    if let (Some(a), Some(b)) = (&sim.forward.argmax, &fwd.argmax) {
        // The same class, or one whose logit ties the unsharded argmax's within rounding.
        let (a, b) = (a.to_i64_vec().unwrap(), down(b).to_i64_vec().unwrap());
        let (ev, cv) = (data.e.to_f64_vec(), data.c.to_f64_vec());
        let bv = data.bias.as_ref().map(|b| b.to_f64_vec());
        let logit = |i: usize, j: usize| -> f64 {
            let z: f64 = (0..case.d)
                .map(|k| ev[i * case.d + k] * cv[j * case.d + k])
                .sum::<f64>()
                + bv.as_ref().map_or(0.0, |b| b[j]);
            opts.softcap.map_or(z, |s| s as f64 * (z / s as f64).tanh())
        };
        for i in 0..case.n {
            if a[i] != b[i] {
                let gap = (logit(i, a[i] as usize) - logit(i, b[i] as usize)).abs();
                assert!(
                    gap <= t_fwd * zmag,
                    "argmax row {i}: sharded {} single {}",
                    a[i],
                    b[i]
                );
            }
        }
    }
    // What a filter may skip: the row's dropped-mass bound times the other operand's norm.
    let filtered = cce_core::FilterRule::resolve(opts, case.dtype).enabled;
    let m = |t: &HostTensor| rows(t, case.d).iter().map(|r| norm(r)).fold(0.0, f64::max);
    let skip = if filtered {
        2.0 * opts.max_dropped_mass as f64 * 4.0
    } else {
        0.0
    };
    if let (Some(a), Some(b)) = (&sim.d_e, &bwd.d_e) {
        close(
            "d_e",
            case,
            a,
            &down(b),
            case.d,
            t_bwd,
            skip * m(&data.c) * 2.0,
        );
    }
    if let (Some(a), Some(b)) = (&sim.d_c, &bwd.d_c) {
        close(
            "d_c",
            case,
            a,
            &down(b),
            case.d,
            t_bwd,
            skip * m(&data.e) * case.n as f64,
        );
    }
    if let (Some(a), Some(b)) = (&sim.d_bias, &bwd.d_bias) {
        close(
            "d_bias",
            case,
            a,
            &down(b),
            1,
            t_bwd,
            skip * case.n as f64 + t_bwd * 1e-3,
        );
    }
    assert_eq!(sim.d_e.is_some(), bwd.d_e.is_some(), "{case:?}");
    assert_eq!(sim.d_c.is_some(), bwd.d_c.is_some(), "{case:?}");
    assert_eq!(sim.d_bias.is_some(), bwd.d_bias.is_some(), "{case:?}");
}
