//! Input generators (never zeros) and the real fixture, on top of crate `cce-data`.
//!
//! - [`Dist::Peaked`]: randn `e`, `c` scaled so the logits have std [`PEAKED_LOGIT_STD`] (16):
//!   a near one-hot softmax, where a filtered backward skips most entries; uniform targets.
//! - [`Dist::Flat`]: randn scaled to logit std [`FLAT_LOGIT_STD`] (0.5): a near-uniform softmax,
//!   where every entry matters; uniform targets.
//! - [`Dist::Iid`]: `cce_data`'s `iid` (Gaussian logits scaled to a mean softmax entropy of
//!   2.5 nats, capped at 60% of `ln V` for small `V`), targets sampled from the softmax.
//! - [`Dist::Lm`]: `cce_data`'s `lm` generator (calibrated to real LM logits, CASES.md),
//!   targets sampled from the softmax.
//!
//! A bias, when asked, is drawn here (N(0, 1) for peaked data, N(0, 0.2²) for flat, N(0, 0.3²)
//! otherwise). Exact zeros in generated values (the `lm` topic coordinates) are replaced by a
//! small nonzero value, so no term of any product is structurally absent.

use crate::harness::mix64;
use cce_core::{DType, HostTensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;

/// Logit standard deviation of [`Dist::Peaked`].
pub const PEAKED_LOGIT_STD: f64 = 16.0;
/// Logit standard deviation of [`Dist::Flat`].
pub const FLAT_LOGIT_STD: f64 = 0.5;
/// Target softmax entropy of [`Dist::Iid`] in nats.
pub const IID_ENTROPY: f64 = 2.5;

/// Distribution of the inputs of a case.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dist {
    /// randn, large logits: near one-hot softmax; uniform targets.
    Peaked,
    /// randn, small logits: near-uniform softmax; uniform targets.
    Flat,
    /// iid Gaussian logits at a mean entropy of 2.5 nats (`cce_data`); targets sampled from
    /// the softmax.
    Iid,
    /// LM-like logits (`cce_data`, calibrated to CASES.md); targets sampled from the softmax.
    Lm,
}

impl Dist {
    /// Short name (`peaked`, `flat`, `iid`, `lm`).
    pub fn name(self) -> &'static str {
        match self {
            Dist::Peaked => "peaked",
            Dist::Flat => "flat",
            Dist::Iid => "iid",
            Dist::Lm => "lm",
        }
    }
}

/// Raw generated values (f32, before rounding to the case dtype).
#[derive(Clone, Debug)]
pub struct RawInputs {
    /// `[N, D]` row-major.
    pub e: Vec<f32>,
    /// `[V, D]` row-major.
    pub c: Vec<f32>,
    /// `[V]` when asked.
    pub bias: Option<Vec<f32>>,
    /// `[N]` classes in `[0, V)` (ignored rows are applied later by the case).
    pub targets: Vec<i64>,
}

/// A seeded RNG for a stream `(seed, purpose)`.
pub fn rng(seed: u64, purpose: u64) -> StdRng {
    StdRng::seed_from_u64(mix64(seed ^ mix64(purpose)))
}

fn randn(r: &mut StdRng, k: usize, std: f64) -> Vec<f32> {
    (0..k)
        .map(|_| {
            let x: f64 = r.sample(StandardNormal);
            (x * std) as f32
        })
        .collect()
}

/// Replace exact zeros by a small value (2⁻¹⁰ of the RMS, at least 2⁻²⁰).
fn no_zeros(x: &mut [f32]) {
    let rms = (x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / x.len().max(1) as f64).sqrt();
    let tiny = ((rms / 1024.0) as f32).max(2f32.powi(-20));
    x.iter_mut().filter(|v| **v == 0.0).for_each(|v| *v = tiny);
}

/// Generate inputs of distribution `dist` for `N x D x V` with `cce_data::generate`, plus a
/// bias when asked. Deterministic in `seed`.
///
/// # Panics
/// When `cce_data` rejects the parameters (the suite only asks for valid ones).
pub fn generate(dist: Dist, n: usize, d: usize, v: usize, bias: bool, seed: u64) -> RawInputs {
    let z_std = |std: f64| {
        // e·c over D terms: std = s_e · s_c · sqrt(D); split evenly.
        let s = (std / (d as f64).sqrt()).sqrt() as f32;
        cce_data::Distribution::Scaled {
            e_scale: s,
            c_scale: s,
        }
    };
    let spec = match dist {
        Dist::Peaked => z_std(PEAKED_LOGIT_STD),
        Dist::Flat => z_std(FLAT_LOGIT_STD),
        Dist::Iid => cce_data::Distribution::Iid {
            entropy_nats: IID_ENTROPY.min(0.6 * (v as f64).ln()).max(1e-3),
        },
        Dist::Lm => cce_data::Distribution::Lm,
    };
    let ds = cce_data::generate(&spec, n, d, v, mix64(seed ^ 0xda7a))
        .unwrap_or_else(|e| panic!("cce_data::generate({spec}, {n}, {d}, {v}): {e}"));
    let (mut e, mut c) = (ds.e, ds.c);
    no_zeros(&mut e);
    no_zeros(&mut c);
    let mut r = rng(seed, 0xb1a5);
    let b = bias.then(|| {
        let std = match dist {
            Dist::Peaked => 1.0,
            Dist::Flat => 0.2,
            _ => 0.3,
        };
        let mut b = randn(&mut r, v, std);
        no_zeros(&mut b);
        b
    });
    RawInputs {
        e,
        c,
        bias: b,
        targets: ds.targets,
    }
}

/// The shipped real fixture (`data/smollm2_lce_real_1k.safetensors`, SmolLM2-135M on real
/// text), `rows` rows taken evenly spread over its 1024 (both halves of the text), with `c`
/// rounded to bf16 so that `e` and `c` share the dtype a backend requires.
#[derive(Clone, Debug)]
pub struct Fixture {
    /// `[rows, 576]` bf16.
    pub e: HostTensor,
    /// `[49152, 576]` bf16 (the exact f32 dequantized head rounded to bf16).
    pub c: HostTensor,
    /// `[rows]` i32.
    pub targets: HostTensor,
    /// Which rows of the file were taken.
    pub rows: Vec<usize>,
}

/// Load `rows` rows of the real fixture (see [`Fixture`]) through
/// `cce_data::load_real_fixture`.
///
/// # Panics
/// When the shipped file is missing or malformed (it is part of the repository).
pub fn load_fixture(rows: usize) -> Fixture {
    let ds = cce_data::load_real_fixture()
        .unwrap_or_else(|e| panic!("loading the shipped real fixture: {e}"));
    let (n_all, d, v) = (ds.n, ds.d, ds.v);
    let rows = rows.clamp(1, n_all);
    let picked: Vec<usize> = (0..rows).map(|k| k * n_all / rows).collect();
    let mut e = Vec::with_capacity(rows * d);
    for &i in &picked {
        e.extend_from_slice(ds.e_row(i));
    }
    Fixture {
        e: HostTensor::from_f32(vec![rows, d], &e, DType::BF16).expect("bf16 e"),
        c: HostTensor::from_f32(vec![v, d], &ds.c, DType::BF16).expect("bf16 c"),
        targets: HostTensor::from_i32(picked.iter().map(|&i| ds.targets[i] as i32).collect()),
        rows: picked,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generators_are_deterministic_and_nonzero() {
        for dist in [Dist::Peaked, Dist::Flat, Dist::Iid, Dist::Lm] {
            let a = generate(dist, 7, 16, 33, true, 42);
            let b = generate(dist, 7, 16, 33, true, 42);
            assert_eq!(a.e, b.e);
            assert_eq!(a.targets, b.targets);
            assert!(
                a.e.iter()
                    .chain(&a.c)
                    .chain(a.bias.as_ref().unwrap())
                    .all(|&x| x != 0.0),
                "{dist:?}"
            );
            assert!(a.targets.iter().all(|&t| (0..33).contains(&t)));
        }
    }

    #[test]
    fn peaked_and_flat_have_their_logit_scale() {
        for (dist, want) in [
            (Dist::Peaked, PEAKED_LOGIT_STD),
            (Dist::Flat, FLAT_LOGIT_STD),
        ] {
            let raw = generate(dist, 64, 32, 256, false, 3);
            let mut sum2 = 0.0;
            for i in 0..64 {
                for j in 0..256 {
                    let x: f64 = (0..32)
                        .map(|k| raw.e[i * 32 + k] as f64 * raw.c[j * 32 + k] as f64)
                        .sum();
                    sum2 += x * x;
                }
            }
            let std = (sum2 / (64.0 * 256.0)).sqrt();
            assert!((std / want - 1.0).abs() < 0.2, "{dist:?}: logit std {std}");
        }
    }
}
