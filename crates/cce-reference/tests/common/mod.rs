//! Shared test helpers: random cases and the real fixture.
#![allow(dead_code)]

use cce_core::{DType, HostTensor};
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

/// A fresh RNG; the seed is printed so a failure can be replayed with CCE_SEED.
pub fn seeded() -> rand::rngs::StdRng {
    let seed = std::env::var("CCE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    eprintln!("seed {seed} (replay with CCE_SEED={seed})");
    rand::rngs::StdRng::seed_from_u64(seed)
}

/// A random problem in f64 values.
pub struct Case {
    pub n: usize,
    pub d: usize,
    pub v: usize,
    pub e: Vec<f64>,
    pub c: Vec<f64>,
    pub bias: Option<Vec<f64>>,
    pub targets: Vec<i64>,
}

/// e ~ N(0, scale), c ~ N(0, 1)·scale (logit std ≈ scale²·√D), a fraction of targets ignored.
pub fn random_case(
    rng: &mut impl Rng,
    n: usize,
    d: usize,
    v: usize,
    bias: bool,
    ignored: f64,
    scale: f64,
) -> Case {
    let normal = Normal::new(0.0, scale).unwrap();
    let e = (0..n * d).map(|_| normal.sample(rng)).collect();
    let c = (0..v * d).map(|_| normal.sample(rng)).collect();
    let bias = bias.then(|| (0..v).map(|_| normal.sample(rng)).collect());
    let mut targets: Vec<i64> = (0..n)
        .map(|_| {
            if rng.random::<f64>() < ignored {
                -100
            } else {
                rng.random_range(0..v as i64)
            }
        })
        .collect();
    // At least one row keeps a target when not every row is meant to be ignored: a mean over
    // no valid row is an error (CceError::AllTargetsIgnored), tested on its own.
    if ignored < 1.0 && targets.iter().all(|&t| t == -100) {
        if let Some(t) = targets.first_mut() {
            *t = rng.random_range(0..v as i64);
        }
    }
    Case {
        n,
        d,
        v,
        e,
        c,
        bias,
        targets,
    }
}

impl Case {
    /// Host tensors in `dtype` (values rounded), targets i64.
    pub fn tensors(
        &self,
        dtype: DType,
    ) -> (HostTensor, HostTensor, Option<HostTensor>, HostTensor) {
        let f = |v: &[f64], shape: Vec<usize>| {
            HostTensor::from_f32(
                shape,
                &v.iter().map(|&x| x as f32).collect::<Vec<_>>(),
                dtype,
            )
            .unwrap()
        };
        (
            f(&self.e, vec![self.n, self.d]),
            f(&self.c, vec![self.v, self.d]),
            self.bias.as_ref().map(|b| f(b, vec![self.v])),
            HostTensor::from_i64(self.targets.clone()),
        )
    }
}

/// The shipped real fixture as f32 values.
pub struct Fixture {
    pub e: Vec<f32>,
    pub c: Vec<f32>,
    pub targets: Vec<i64>,
    pub lse_ref: Vec<f32>,
    pub nll_ref: Vec<f32>,
}

/// The shipped real fixture (E bf16 widened, C = C_scale · C_q8 exact in f32).
pub fn load_fixture() -> Fixture {
    let ds = cce_data::load_real_fixture()
        .expect("shipped fixture data/smollm2_lce_real_1k.safetensors");
    Fixture {
        e: ds.e,
        c: ds.c,
        targets: ds.targets,
        lse_ref: ds.lse_ref.expect("lse_ref in the fixture"),
        nll_ref: ds.nll_ref.expect("nll_ref in the fixture"),
    }
}
