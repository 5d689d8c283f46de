//! Shared helpers: deterministic data and the materialized f64 reference (candle's own ops and
//! autograd in f64 over the full `N x V` logits).

#![allow(dead_code)]

use candle_core::{DType, Device, Result, Tensor, Var, D};
use cce_candle::{LceOptions, Reduction};

/// Deterministic pseudo-random values in `[-scale, scale)` (an LCG: no rand dependency).
pub fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// `n` targets in `[0, v)`, every `ignore_every`-th one `ignore` (none when 0).
pub fn targets(n: usize, v: usize, seed: u64, ignore_every: usize, ignore: i64) -> Vec<i64> {
    let mut s = seed.wrapping_add(99);
    (0..n)
        .map(|i| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            if ignore_every > 0 && i % ignore_every == ignore_every - 1 {
                ignore
            } else {
                ((s >> 33) % v as u64) as i64
            }
        })
        .collect()
}

/// Loss and gradients of the materialized computation, f64.
pub struct Reference {
    /// Loss (scalar, or the per-row losses for `Reduction::None`, flattened).
    pub loss: Vec<f64>,
    pub d_e: Vec<f64>,
    pub d_c: Vec<f64>,
    pub d_bias: Option<Vec<f64>>,
}

/// The loss of `opts` over materialized logits in f64 with candle's autograd: `e·cᵀ + bias`,
/// softcap, log-sum-exp, `lse − (1 − α)·z_y − α·mean_j z_j + λ·lse²` on valid rows, then the
/// reduction; `weights` (per row, flattened) are the upstream gradient of a `None` reduction.
pub fn reference(
    e: &Tensor,
    c: &Tensor,
    bias: Option<&Tensor>,
    targets: &[i64],
    opts: &LceOptions,
    weights: Option<&[f64]>,
) -> Result<Reference> {
    let dev = Device::Cpu;
    let d = *e.dims().last().unwrap();
    let e = Var::from_tensor(&e.to_dtype(DType::F64)?.reshape(((), d))?)?;
    let c = Var::from_tensor(&c.to_dtype(DType::F64)?)?;
    let bias = bias
        .map(|b| Var::from_tensor(&b.to_dtype(DType::F64)?))
        .transpose()?;
    let v = c.dims()[0];
    let mut z = e.matmul(&c.t()?)?;
    if let Some(b) = &bias {
        z = z.broadcast_add(b)?;
    }
    if let Some(s) = opts.softcap {
        z = ((z / s as f64)?.tanh()? * s as f64)?;
    }
    let lse = {
        let m = z.max_keepdim(D::Minus1)?.detach();
        (z.broadcast_sub(&m)?.exp()?.sum_keepdim(D::Minus1)?.log()? + m)?.squeeze(1)?
    };
    let valid: Vec<f64> = targets
        .iter()
        .map(|&t| if t == opts.ignore_index { 0.0 } else { 1.0 })
        .collect();
    let safe: Vec<u32> = targets
        .iter()
        .map(|&t| if t == opts.ignore_index { 0 } else { t as u32 })
        .collect();
    let n = targets.len();
    let safe = Tensor::from_vec(safe, (n, 1), &dev)?;
    let zy = z.gather(&safe, 1)?.squeeze(1)?;
    let zmean = (z.sum(1)? / v as f64)?;
    let a = opts.label_smoothing as f64;
    let lam = opts.z_loss as f64;
    let row = ((&lse - (zy * (1.0 - a))?)? - (zmean * a)?)?;
    let row = (&row + (lse.sqr()? * lam)?)?;
    let row = (row * Tensor::from_vec(valid.clone(), n, &dev)?)?;
    let n_valid: f64 = valid.iter().sum();
    let (loss, objective) = match opts.reduction {
        Reduction::Mean => {
            let l = (row.sum_all()? / n_valid)?;
            (vec![l.to_scalar::<f64>()?], l)
        }
        Reduction::Sum => {
            let l = row.sum_all()?;
            (vec![l.to_scalar::<f64>()?], l)
        }
        Reduction::None => {
            let w = Tensor::from_vec(weights.unwrap().to_vec(), n, &dev)?;
            (row.to_vec1::<f64>()?, (row * w)?.sum_all()?)
        }
    };
    let grads = objective.backward()?;
    let flat = |t: &Tensor| -> Result<Vec<f64>> { t.flatten_all()?.to_vec1::<f64>() };
    Ok(Reference {
        loss,
        d_e: flat(grads.get(&e).unwrap())?,
        d_c: flat(grads.get(&c).unwrap())?,
        d_bias: bias.map(|b| flat(grads.get(&b).unwrap())).transpose()?,
    })
}

/// `max |a − b| / max(max |b|, tiny)`: the error relative to the reference's scale.
pub fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-30);
    a.iter()
        .zip(b)
        .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

/// A tensor's values as f64, flattened.
pub fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}
