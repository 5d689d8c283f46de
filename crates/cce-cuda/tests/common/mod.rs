//! Shared helpers of the CUDA tests: device discovery with a clear skip, random cases, the
//! conformance judge of MATH.md, and the real fixture.
#![allow(dead_code)]

pub mod spec;
pub mod wgmma;

use cce_core::{CceError, DType, HostTensor};
use cce_cuda::CudaBackend;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

/// The backend, or `None` after printing "skipping: <reason>" when no CUDA device or library is
/// present. With `CCE_REQUIRE_CUDA=1` (the device runner sets it) a missing device fails.
pub fn backend(test: &str) -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(b) => Some(b),
        Err(CceError::NoDevice { reason, .. }) => {
            if std::env::var("CCE_REQUIRE_CUDA").as_deref() == Ok("1") {
                panic!("{test}: CCE_REQUIRE_CUDA=1 but no CUDA device: {reason}");
            }
            eprintln!("skipping {test}: {reason}");
            None
        }
        Err(e) => panic!("{test}: CUDA backend construction failed: {e}"),
    }
}

/// A fresh RNG; the seed is printed so a failure can be replayed with CCE_SEED.
pub fn seeded() -> rand::rngs::StdRng {
    let seed = std::env::var("CCE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    eprintln!("seed {seed} (replay with CCE_SEED={seed})");
    rand::rngs::StdRng::seed_from_u64(seed)
}

/// A random problem as host tensors of `dtype` (values rounded once), targets i64.
pub struct Case {
    pub n: usize,
    pub d: usize,
    pub v: usize,
    pub e: HostTensor,
    pub c: HostTensor,
    pub bias: Option<HostTensor>,
    pub targets: HostTensor,
}

/// e, c ~ N(0, s²) with s chosen so the logits have standard deviation `logit_std`
/// (s² √D = logit_std); bias ~ N(0, 1); a fraction `ignored` of targets is -100.
#[allow(clippy::too_many_arguments)]
pub fn random_case(
    rng: &mut impl Rng,
    n: usize,
    d: usize,
    v: usize,
    dtype: DType,
    bias: bool,
    ignored: f64,
    logit_std: f64,
) -> Case {
    let s = (logit_std / (d as f64).sqrt()).sqrt();
    let normal = Normal::new(0.0, s).unwrap();
    let gen = |k: usize, rng: &mut dyn rand::RngCore| -> Vec<f32> {
        (0..k).map(|_| normal.sample(rng) as f32).collect()
    };
    let e = gen(n * d, rng);
    let c = gen(v * d, rng);
    let b: Vec<f32> = (0..v)
        .map(|_| Normal::new(0.0, 1.0).unwrap().sample(rng) as f32)
        .collect();
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
        e: HostTensor::from_f32(vec![n, d], &e, dtype).unwrap(),
        c: HostTensor::from_f32(vec![v, d], &c, dtype).unwrap(),
        bias: bias.then(|| HostTensor::from_f32(vec![v], &b, dtype).unwrap()),
        targets: HostTensor::from_i64(targets),
    }
}

/// ‖a − b‖ / ‖b‖ (0 when both are 0).
pub fn rel(a: &[f64], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// The conformance rule (MATH.md): per element |ours − gt| ≤ |ref − gt| + tol · scale, with
/// `scale` = max(1, max |gt|) for values of order 1 (loss, lse) or max |gt| for gradients.
/// Returns the relative norm error; panics with the first 5 mismatches otherwise.
pub fn judge(
    what: &str,
    ours: &[f64],
    gt: &[f64],
    reference: &[f64],
    tol: f64,
    order_one: bool,
) -> f64 {
    assert_eq!(ours.len(), gt.len(), "{what}: length");
    let maxgt = gt.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    let scale = if order_one { maxgt.max(1.0) } else { maxgt };
    let mut bad = Vec::new();
    let mut n_bad = 0;
    for i in 0..gt.len() {
        let err = (ours[i] - gt[i]).abs();
        let allowed = (reference[i] - gt[i]).abs() + tol * scale;
        // NaN counts as a mismatch.
        if err.is_nan() || err > allowed {
            n_bad += 1;
            if bad.len() < 5 {
                bad.push(format!(
                    "  [{i}] ours {:.8e} gt {:.8e} ref {:.8e} |err| {:.3e} allowed {:.3e}",
                    ours[i], gt[i], reference[i], err, allowed
                ));
            }
        }
    }
    let r = rel(ours, gt);
    assert!(
        n_bad == 0,
        "{what}: {n_bad} of {} elements out of tolerance (tol {tol:e} x scale {scale:.3e}, rel err {r:.3e}):\n{}",
        gt.len(),
        bad.join("\n")
    );
    r
}

/// The shipped real fixture (data/smollm2_lce_real_1k.safetensors) as f32 values, or `None`
/// when the file is not found (looked up in $CCE_DATA_DIR, ./data, and the source tree).
pub struct Fixture {
    pub e: Vec<f32>,
    pub c: Vec<f32>,
    pub targets: Vec<i64>,
    pub lse_ref: Vec<f32>,
}

/// The shipped real fixture (`cce_data::load_real_fixture`; `$CCE_DATA_DIR` overrides the
/// compile-time path on the device), or `None` when it cannot be read.
pub fn load_fixture() -> Option<Fixture> {
    let ds = cce_data::load_real_fixture().ok()?;
    Some(Fixture {
        e: ds.e,
        c: ds.c,
        targets: ds.targets,
        lse_ref: ds.lse_ref?,
    })
}

/// Confident rows: `n` rows of `d` N(0, 1) values, `v` classes of N(0, 0.05²), row i's target
/// 15·i (mod v) lifted `margin` above the rest (c_y += margin · e_i / |e_i|²); `e`, `c` in
/// `dtype` and the targets.
pub fn confident_rows(
    rng: &mut impl Rng,
    (n, d, v): (usize, usize, usize),
    margin: f64,
    dtype: DType,
) -> (HostTensor, HostTensor, Vec<i64>) {
    let nrm = Normal::new(0.0, 1.0).unwrap();
    let e: Vec<f64> = (0..n * d).map(|_| nrm.sample(rng)).collect();
    let mut c: Vec<f64> = (0..v * d).map(|_| 0.05 * nrm.sample(rng)).collect();
    let targets: Vec<i64> = (0..n).map(|i| ((15 * i) % v) as i64).collect();
    for i in 0..n {
        let row = &e[i * d..(i + 1) * d];
        let sq: f64 = row.iter().map(|x| x * x).sum();
        let y = targets[i] as usize;
        for k in 0..d {
            c[y * d + k] += margin * row[k] / sq;
        }
    }
    let f = |x: &[f64]| x.iter().map(|&v| v as f32).collect::<Vec<f32>>();
    (
        HostTensor::from_f32(vec![n, d], &f(&e), dtype).unwrap(),
        HostTensor::from_f32(vec![v, d], &f(&c), dtype).unwrap(),
        targets,
    )
}
