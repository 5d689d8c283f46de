//! Input generators (never zeros) and the real fixture.
//!
//! - [`Dist::Peaked`]: randn `e`, `c` scaled so the logits have std [`PEAKED_LOGIT_STD`] (16):
//!   a near one-hot softmax, where a filtered backward skips most entries.
//! - [`Dist::Flat`]: randn scaled to logit std [`FLAT_LOGIT_STD`] (0.5): a near-uniform softmax,
//!   where every entry matters.
//! - [`Dist::Iid`]: randn logits, each row scaled (bisection) to a softmax entropy of 2.5 nats
//!   (CASES.md `iid`; capped at 60% of `ln V` for small `V`), targets sampled from the softmax.
//! - [`Dist::Lm`]: a small version of CASES.md's `lm` generator (Zipf unigram prior, topic
//!   clusters with persistence, one lifted peak class per row, Gaussian bulk noise), realized as
//!   `e` and `c`, targets sampled from the softmax. Needs `D >= 8` (falls back to `Iid` below).
//!
//! TODO(cce-data): switch `Iid` and `Lm` to `cce_data::generate` once crate cce-data is on main
//! (it is a placeholder there at the time of writing); these local generators are deliberately
//! small and uncalibrated beyond what the checks need (realistic shapes of softmax rows).

use crate::harness::mix64;
use cce_core::{DType, HostTensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Exp1, LogNormal, StandardNormal};

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
    /// iid logits scaled per row to 2.5 nats; targets sampled from the softmax.
    Iid,
    /// LM-like logits (CASES.md); targets sampled from the softmax.
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
            // Never exactly zero (a zero input hides missing terms).
            let x: f64 = r.sample(StandardNormal);
            let x = if x == 0.0 { 1e-3 } else { x };
            (x * std) as f32
        })
        .collect()
}

/// Round f32 values through `dtype` (exactly what the backend will see).
pub fn round_through(values: &[f32], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::F16 => values
            .iter()
            .map(|&x| half::f16::from_f32(x).to_f32())
            .collect(),
        DType::BF16 => values
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_f32())
            .collect(),
        _ => values.to_vec(),
    }
}

/// f64 logits `x = e·cᵀ + bias` of the rounded inputs (`[N, V]`, for target sampling).
fn logits_f64(
    e: &[f32],
    c: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    d: usize,
    v: usize,
) -> Vec<f64> {
    let mut z = vec![0.0f64; n * v];
    for (i, zi) in z.chunks_exact_mut(v).enumerate() {
        let ei = &e[i * d..(i + 1) * d];
        for (j, (out, cj)) in zi.iter_mut().zip(c.chunks_exact(d)).enumerate() {
            let s: f64 = ei.iter().zip(cj).map(|(&a, &b)| a as f64 * b as f64).sum();
            *out = s + bias.map_or(0.0, |b| b[j] as f64);
        }
    }
    z
}

/// Softmax entropy of `scale · row` (one exponential per entry).
fn entropy_of(row: &[f64], scale: f64) -> f64 {
    let m = row.iter().fold(f64::NEG_INFINITY, |a, &x| a.max(x * scale));
    let (mut s, mut sz) = (0.0f64, 0.0f64);
    for &x in row {
        let w = (x * scale - m).exp();
        s += w;
        sz += w * (x * scale - m);
    }
    // H = lse − Σ p z with lse = m + ln s and Σ p z = m + sz / s.
    s.ln() - sz / s
}

/// Sample one class per row from `softmax(row)` (Gumbel-max).
fn sample_targets(r: &mut StdRng, z: &[f64], n: usize, v: usize) -> Vec<i64> {
    (0..n)
        .map(|i| {
            let row = &z[i * v..(i + 1) * v];
            let mut best = (f64::NEG_INFINITY, 0usize);
            for (j, &x) in row.iter().enumerate() {
                let u: f64 = r.random_range(1e-300..1.0);
                let g = x - (-u.ln()).ln();
                if g > best.0 {
                    best = (g, j);
                }
            }
            best.1 as i64
        })
        .collect()
}

/// Generate inputs of distribution `dist` for `N x D x V`, rounded through `dtype` where the
/// targets depend on the values. Deterministic in `seed`.
pub fn generate(
    dist: Dist,
    n: usize,
    d: usize,
    v: usize,
    bias: bool,
    dtype: DType,
    seed: u64,
) -> RawInputs {
    let dist = if dist == Dist::Lm && d < 8 {
        Dist::Iid
    } else {
        dist
    };
    let mut r = rng(seed, dist as u64 + 1);
    match dist {
        Dist::Peaked | Dist::Flat => {
            let z_std = if dist == Dist::Peaked {
                PEAKED_LOGIT_STD
            } else {
                FLAT_LOGIT_STD
            };
            // e·c over D terms: std = s_e · s_c · sqrt(D); split evenly.
            let s = (z_std / (d as f64).sqrt()).sqrt();
            let e = randn(&mut r, n * d, s);
            let c = randn(&mut r, v * d, s);
            let b = bias.then(|| randn(&mut r, v, if dist == Dist::Peaked { 1.0 } else { 0.2 }));
            let targets = (0..n).map(|_| r.random_range(0..v as i64)).collect();
            RawInputs {
                e,
                c,
                bias: b,
                targets,
            }
        }
        Dist::Iid => {
            let s = (1.0 / (d as f64).sqrt()).sqrt();
            let mut e = randn(&mut r, n * d, s);
            let c = round_through(&randn(&mut r, v * d, s), dtype);
            let b = bias.then(|| round_through(&randn(&mut r, v, 0.3), dtype));
            let target_h = IID_ENTROPY.min(0.6 * (v as f64).ln());
            let er = round_through(&e, dtype);
            let z = logits_f64(&er, &c, None, n, d, v);
            for i in 0..n {
                let row = &z[i * v..(i + 1) * v];
                // Entropy falls as the scale grows: bisect on log-scale.
                let (mut lo, mut hi) = (1e-3f64, 1e3f64);
                for _ in 0..32 {
                    let mid = (lo * hi).sqrt();
                    if entropy_of(row, mid) > target_h {
                        lo = mid;
                    } else {
                        hi = mid;
                    }
                }
                let t = (lo * hi).sqrt() as f32;
                e[i * d..(i + 1) * d].iter_mut().for_each(|x| *x *= t);
            }
            let er = round_through(&e, dtype);
            let z = logits_f64(&er, &c, b.as_deref(), n, d, v);
            let targets = sample_targets(&mut r, &z, n, v);
            RawInputs {
                e,
                c,
                bias: b,
                targets,
            }
        }
        Dist::Lm => lm(&mut r, n, d, v, bias, dtype),
    }
}

/// The small LM-like generator (CASES.md, first preset, at test sizes).
fn lm(r: &mut StdRng, n: usize, d: usize, v: usize, bias: bool, dtype: DType) -> RawInputs {
    let k_clusters = 15.min((d - 3) / 3).max(1);
    let d_noise = d - 1 - k_clusters;
    let bulk_std = 2.85 / (d_noise as f64).sqrt();
    // Unigram prior from a Zipf rank (exponent 1), standardized to std 2.
    let mut ranks: Vec<usize> = (0..v).collect();
    for i in (1..v).rev() {
        ranks.swap(i, r.random_range(0..=i));
    }
    let raw_u: Vec<f64> = ranks.iter().map(|&k| -((k + 1) as f64).ln()).collect();
    let mean = raw_u.iter().sum::<f64>() / v as f64;
    let var = raw_u.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v as f64;
    let u: Vec<f64> = raw_u
        .iter()
        .map(|x| 2.0 * (x - mean) / var.sqrt().max(1e-9))
        .collect();
    let mut c = vec![0f32; v * d];
    for j in 0..v {
        let row = &mut c[j * d..(j + 1) * d];
        row[0] = u[j] as f32;
        for x in row[1..1 + k_clusters].iter_mut() {
            *x = 1e-3; // never exactly zero
        }
        let cluster = r.random_range(0..k_clusters);
        let w: f64 = r.sample(Exp1);
        row[1 + cluster] = w.max(1e-3) as f32;
        for x in row[1 + k_clusters..].iter_mut() {
            let g: f64 = r.sample(StandardNormal);
            *x = (g * bulk_std) as f32;
        }
    }
    let slope = LogNormal::new(0.52, 0.22).expect("valid lognormal");
    let lift = LogNormal::new(2.0, 0.55).expect("valid lognormal");
    let mut e = vec![0f32; n * d];
    let mut topic = r.random_range(0..k_clusters);
    for i in 0..n {
        if r.random::<f64>() >= 0.5 {
            topic = r.random_range(0..k_clusters);
        }
        let peak = r.random_range(0..v);
        let lift_i: f64 = lift.sample(r);
        let cp = &c[peak * d + 1 + k_clusters..(peak + 1) * d];
        let norm2: f64 = cp
            .iter()
            .map(|&x| (x as f64).powi(2))
            .sum::<f64>()
            .max(1e-12);
        let row = &mut e[i * d..(i + 1) * d];
        row[0] = 1.0;
        for x in row[1..1 + k_clusters].iter_mut() {
            *x = 1e-3; // never exactly zero
        }
        row[1 + topic] = slope.sample(r) as f32;
        for (k, x) in row[1 + k_clusters..].iter_mut().enumerate() {
            let g: f64 = r.sample(StandardNormal);
            *x = (g + lift_i * cp[k] as f64 / norm2) as f32;
        }
    }
    // Realistic magnitudes: e up, c down by the same factor (|e| large, |c| small).
    let scale = 8.0f32;
    e.iter_mut().for_each(|x| *x *= scale);
    c.iter_mut().for_each(|x| *x /= scale);
    let b = bias.then(|| round_through(&randn(r, v, 0.3), dtype));
    let z = logits_f64(
        &round_through(&e, dtype),
        &round_through(&c, dtype),
        b.as_deref(),
        n,
        d,
        v,
    );
    let targets = sample_targets(r, &z, n, v);
    RawInputs {
        e,
        c,
        bias: b,
        targets,
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

/// Path of the shipped fixture.
pub fn fixture_path() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/smollm2_lce_real_1k.safetensors")
}

/// Load `rows` rows of the real fixture (see [`Fixture`]).
///
/// # Panics
/// When the shipped file is missing or malformed (it is part of the repository).
pub fn load_fixture(rows: usize) -> Fixture {
    let path = fixture_path();
    let bytes = std::fs::read(&path)
        .unwrap_or_else(|e| panic!("reading the shipped fixture {}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("fixture is safetensors");
    let get = |name: &str| {
        st.tensor(name)
            .unwrap_or_else(|e| panic!("fixture tensor {name}: {e}"))
    };
    let e_all = get("E");
    let (n_all, d) = (e_all.shape()[0], e_all.shape()[1]);
    let e_all = HostTensor::from_bytes(vec![n_all, d], DType::BF16, e_all.data())
        .expect("E is bf16 [N, D]")
        .to_f32_vec();
    let q8 = get("C_q8");
    let v = q8.shape()[0];
    assert_eq!(q8.shape()[1], d, "C_q8 [V, D]");
    let scale = HostTensor::from_bytes(vec![v, d / 32], DType::F16, get("C_scale").data())
        .expect("C_scale f16 [V, D/32]")
        .to_f32_vec();
    let c: Vec<f32> = q8
        .data()
        .iter()
        .enumerate()
        .map(|(i, &q)| scale[(i / d) * (d / 32) + (i % d) / 32] * (q as i8) as f32)
        .collect();
    let t_all = HostTensor::from_bytes(vec![n_all], DType::I32, get("targets").data())
        .expect("targets i32 [N]")
        .to_i64_vec()
        .expect("integer targets");
    let rows = rows.clamp(1, n_all);
    let picked: Vec<usize> = (0..rows).map(|k| k * n_all / rows).collect();
    let mut e = Vec::with_capacity(rows * d);
    for &i in &picked {
        e.extend_from_slice(&e_all[i * d..(i + 1) * d]);
    }
    Fixture {
        e: HostTensor::from_f32(vec![rows, d], &e, DType::BF16).expect("bf16 e"),
        c: HostTensor::from_f32(vec![v, d], &c, DType::BF16).expect("bf16 c"),
        targets: HostTensor::from_i32(picked.iter().map(|&i| t_all[i] as i32).collect()),
        rows: picked,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generators_are_deterministic_and_nonzero() {
        for dist in [Dist::Peaked, Dist::Flat, Dist::Iid, Dist::Lm] {
            let a = generate(dist, 7, 16, 33, true, DType::BF16, 42);
            let b = generate(dist, 7, 16, 33, true, DType::BF16, 42);
            assert_eq!(a.e, b.e);
            assert_eq!(a.targets, b.targets);
            assert!(a.e.iter().chain(&a.c).all(|&x| x != 0.0), "{dist:?}");
            assert!(a.targets.iter().all(|&t| (0..33).contains(&t)));
        }
    }

    #[test]
    fn iid_rows_hit_the_target_entropy() {
        let raw = generate(Dist::Iid, 8, 32, 2000, false, DType::F32, 1);
        let z = logits_f64(&raw.e, &raw.c, None, 8, 32, 2000);
        for i in 0..8 {
            let h = entropy_of(&z[i * 2000..(i + 1) * 2000], 1.0);
            assert!((h - IID_ENTROPY).abs() < 0.05, "row {i}: {h}");
        }
    }
}
