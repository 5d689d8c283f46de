//! Shared helpers: deterministic data, burn's own materialized loss, comparisons.
#![allow(dead_code)]

pub mod errors;
pub mod user;

use burn::module::{Module, Param};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::{activation, Device, Int, Tensor, TensorData};
use cce_burn::{linear_cross_entropy, LinearCrossEntropyConfig, Options, Reduction};

/// Uniform values in [-scale, scale) from a fixed-seed xorshift.
pub fn uniform(len: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Targets in [0, v), with every `ignore_every`-th row set to `ignore` (0: none ignored).
pub fn targets(n: usize, v: usize, ignore_every: usize, ignore: i64) -> Vec<i64> {
    (0..n)
        .map(|i| {
            if ignore_every > 0 && i % ignore_every == 3 {
                ignore
            } else {
                ((i * 7919 + 13) % v) as i64
            }
        })
        .collect()
}

pub fn float<const D: usize>(values: Vec<f32>, shape: [usize; D], device: &Device) -> Tensor<D> {
    Tensor::from_data(TensorData::new(values, shape), device)
}

pub fn int(values: Vec<i64>, device: &Device) -> Tensor<1, Int> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), device)
}

pub fn to_vec<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_into_vec_as::<f32>().unwrap()
}

/// burn's own loss on the materialized logits `z = e·cᵀ (+ bias)` (softcap `s·tanh(z/s)`):
/// per valid row `−(1−α)·log p_y − (α/V)·Σ_j log p_j + λ·lse²`, 0 at rows whose target is
/// `ignore_index`; reduced as `opts.reduction` says. Gradients are burn's autodiff of this.
pub fn materialized(
    e: Tensor<2>,
    c: Tensor<2>,
    bias: Option<Tensor<1>>,
    targets: &[i64],
    opts: &Options,
) -> Tensor<1> {
    let device = e.device();
    let n = targets.len();
    let v = c.dims()[0];
    let mut z = e.matmul(c.transpose());
    if let Some(b) = bias {
        z = z + b.unsqueeze::<2>();
    }
    if let Some(s) = opts.softcap {
        z = z.div_scalar(s).tanh().mul_scalar(s);
    }
    let logp = activation::log_softmax(z.clone(), 1);
    let lse = (z - logp.clone()).mean_dim(1); // every column of z − log p is the lse
    let valid: Vec<f32> = targets
        .iter()
        .map(|&t| if t == opts.ignore_index { 0.0 } else { 1.0 })
        .collect();
    let count: f32 = valid.iter().sum();
    let safe: Vec<i64> = targets
        .iter()
        .map(|&t| if t == opts.ignore_index { 0 } else { t })
        .collect();
    let y = Tensor::<2, Int>::from_data(TensorData::new(safe, [n, 1]), &device);
    let alpha = opts.label_smoothing;
    let logp_y = logp.clone().gather(1, y);
    let mut row = logp_y.mul_scalar(-(1.0 - alpha));
    if alpha > 0.0 {
        row = row - logp.sum_dim(1).mul_scalar(alpha / v as f32);
    }
    if opts.z_loss > 0.0 {
        row = row + lse.clone().mul(lse).mul_scalar(opts.z_loss);
    }
    let row = row.reshape([n]) * float(valid, [n], &device);
    match opts.reduction {
        Reduction::None => row,
        Reduction::Sum => row.sum(),
        Reduction::Mean => row.sum().div_scalar(count),
    }
}

/// `max |a − b| ≤ rel · max |b| + abs`, with the figures in the message.
pub fn assert_close(what: &str, a: &[f32], b: &[f32], rel: f32, abs: f32) -> f32 {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let err = a
        .iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        err <= rel * scale + abs,
        "{what}: max |diff| {err:e} > {rel:e} · max |ref| {scale:e} + {abs:e}"
    );
    err / scale.max(f32::MIN_POSITIVE)
}

/// A tiny LM head: hidden states `e` (trained too, standing in for the layers below) and the
/// classifier `c`.
#[derive(Module, Debug)]
pub struct Head {
    pub e: Param<Tensor<2>>,
    pub c: Param<Tensor<2>>,
}

impl Head {
    pub fn new(n: usize, d: usize, v: usize, device: &Device) -> Self {
        Self {
            e: Param::from_tensor(float(uniform(n * d, 1, 1.0), [n, d], device)),
            c: Param::from_tensor(float(uniform(v * d, 2, 0.3), [v, d], device)),
        }
    }
}

/// Train two copies of a head (N=64, D=32, V=300) for 5 SGD steps, one on our loss and one on
/// burn's materialized loss, and match losses and gradients at every step. Returns the worst
/// relative gradient error seen.
pub fn train_and_match(device: &Device, rel: f32) -> f32 {
    let (n, d, v) = (64, 32, 300);
    let t = targets(n, v, 9, -100);
    let cfg = LinearCrossEntropyConfig::new();
    let mut ours = Head::new(n, d, v, device);
    let mut theirs = Head::new(n, d, v, device);
    let mut opt_ours = SgdConfig::new().init();
    let mut opt_theirs = SgdConfig::new().init();
    let lr = 0.5;
    let mut worst = 0.0f32;
    let mut losses = Vec::new();
    for step in 0..5 {
        let la = linear_cross_entropy(ours.e.val(), ours.c.val(), int(t.clone(), device), &cfg);
        let lb = materialized(theirs.e.val(), theirs.c.val(), None, &t, &cfg.options);
        assert_eq!(la.dims(), [1]);
        let (va, vb) = (to_vec(la.clone()), to_vec(lb.clone()));
        assert_close(&format!("step {step} loss"), &va, &vb, rel, 0.0);
        losses.push(va[0]);
        let ga = la.backward();
        let gb = lb.backward();
        for (name, a, b) in [
            ("d_e", ours.e.val().grad(&ga), theirs.e.val().grad(&gb)),
            ("d_c", ours.c.val().grad(&ga), theirs.c.val().grad(&gb)),
        ] {
            let (a, b) = (a.expect("our gradient"), b.expect("burn's gradient"));
            assert_eq!(a.dims(), b.dims());
            let r = assert_close(
                &format!("step {step} {name}"),
                &to_vec(a),
                &to_vec(b),
                rel,
                0.0,
            );
            worst = worst.max(r);
        }
        let pa = GradientsParams::from_grads(ga, &ours);
        let pb = GradientsParams::from_grads(gb, &theirs);
        ours = opt_ours.step(lr, ours, pa);
        theirs = opt_theirs.step(lr, theirs, pb);
    }
    assert!(
        losses[4] < losses[0],
        "training lowers the loss: {losses:?}"
    );
    worst
}
