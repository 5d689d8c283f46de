//! Seeded synthetic datasets: randn and its scaled variants, iid logits at a target entropy,
//! and `lm`, a generator calibrated to the statistics of real LM logits.

use std::fmt;
use std::str::FromStr;

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Exp1, StandardNormal};
use rayon::prelude::*;

use crate::dataset::Dataset;
use crate::error::{checked_len, try_zeroed, DataError, Result};
use crate::logits::{block_rows, logits_block};

/// The mean softmax entropy `iid` aims at by default, in nats (CASES.md).
pub const DEFAULT_IID_ENTROPY: f64 = 2.5;

/// Parameters of the `lm` generator (see [`Distribution::Lm`]).
///
/// The logits of row `i` and class `j` are the sum of
/// 1. a unigram prior `b_j`, shared by all rows: `-a·ln(rank_j)` of a random rank (a Zipf law
///    with exponent `a` = [`zipf_exponent`](Self::zipf_exponent), standard deviation ~`a`)
///    plus Gaussian jitter bringing the total standard deviation to
///    [`unigram_std`](Self::unigram_std). The jitter matters: scaling the Zipf part alone up to
///    std 2 puts the most frequent class ~20 nats above the mean (the real head: ~12) and
///    makes every row near one-hot;
/// 2. a topic term: class `j` belongs to one of [`clusters`](Self::clusters) clusters with a
///    weight `w_j ~ Exp(1)`; row `i` has a topic `t_i` (kept from row `i - 1` with
///    probability [`topic_keep`](Self::topic_keep), else drawn uniformly) and a slope
///    `s_i ~ LogNormal(slope_mu, slope_sigma)`, and adds `s_i · w_j` to the members of `t_i`;
/// 3. a peak: one class `k_i` per row, drawn from `softmax(peak_prior · b)`, gets a lift
///    `L_i ~ LogNormal(peak_mu, peak_sigma)`;
/// 4. Gaussian bulk noise of standard deviation [`bulk_std`](Self::bulk_std) over classes,
///    correlated between consecutive rows ([`row_corr`](Self::row_corr), an AR(1) along
///    the rows). Real rows of one text share most of their significant classes (16 x 64
///    tiles: 48% occupied with ~120 entries per row, where independent rows would fill
///    ~90%); without this correlation the 16 x 64 unsorted occupancy leaves its band.
///
/// The presets start from CASES.md's fit and differ in three places found by measuring with
/// [`crate::measure`]: the jittered prior (1.), `row_corr = 0.98` (4.), and
/// `peak_prior = 0.3`, `bulk_std = 3.0` to centre the entropy and lighten the tail.
/// Measured for [`SMALL_VOCAB`](Self::SMALL_VOCAB) at N = 4096, D = 576, V = 49152 (seeds
/// 1-3): entropy 2.24-2.43 nats, max probability 0.50-0.54, 108-119 entries `>= 2⁻¹²` per
/// row, 128 x 128 tiles 77-79% sorted / 99.8% unsorted, 16 x 64 tiles 32-33% / 54-56%, row
/// logit std 3.66, std of the class mean logit 2.06, tail mass 4.4-4.7%, entries to keep
/// 1130-1240 (1e-2) and 5300-5700 (1e-3): inside every band of CASES.md.
///
/// Realization in `e` and `c` (so any backend sees an ordinary `E·Cᵀ`): coordinate 0 carries
/// the prior, coordinates `1..=K` the topics, the remaining ones random unit directions for
/// the bulk, the peak class's direction added to `e_i`. Then `e` is multiplied and `c`
/// divided by [`magnitude`](Self::magnitude).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LmParams {
    /// Number of topic clusters.
    pub clusters: usize,
    /// Mean of the log of the topic slope.
    pub slope_mu: f64,
    /// Standard deviation of the log of the topic slope.
    pub slope_sigma: f64,
    /// Mean of the log of the peak lift (nats).
    pub peak_mu: f64,
    /// Standard deviation of the log of the peak lift.
    pub peak_sigma: f64,
    /// Standard deviation of the bulk noise (nats).
    pub bulk_std: f64,
    /// Standard deviation over classes of the unigram bias (nats).
    pub unigram_std: f64,
    /// Probability that a row keeps the previous row's topic.
    pub topic_keep: f64,
    /// Exponent `a` of the Zipf law of the unigram prior: its log part is `-a ln(rank)`.
    pub zipf_exponent: f64,
    /// Correlation of the bulk noise between consecutive rows (an AR(1) along the rows):
    /// neighbouring tokens of a text share much of their hidden state.
    pub row_corr: f64,
    /// The peak class of a row is drawn from `softmax(peak_prior · b)`: 1 follows the unigram
    /// prior, 0 is uniform over the vocabulary.
    pub peak_prior: f64,
    /// `e` is multiplied and `c` divided by this factor (a power of two keeps the logits
    /// bit-identical), for realistic magnitudes: `|e_i|` in the hundreds, `|c_j|` below ~1.
    pub magnitude: f32,
}

impl LmParams {
    /// Preset 1, fitted to SmolLM2-135M (V = 49152); used for V < 100000.
    pub const SMALL_VOCAB: LmParams = LmParams {
        clusters: 15,
        slope_mu: 0.52,
        slope_sigma: 0.22,
        peak_mu: 2.0,
        peak_sigma: 0.55,
        bulk_std: 3.0,
        unigram_std: 2.0,
        topic_keep: 0.5,
        zipf_exponent: 1.0,
        row_corr: 0.98,
        peak_prior: 0.3,
        magnitude: 2.0,
    };

    /// Preset 2, after CASES.md's fit to a real model with V = 262144, D = 640 (30 clusters,
    /// slope mu 0.65, peak mu 2.3, unigram std 3.5), with `row_corr = 0.99` and a uniform
    /// peak (`peak_prior = 0`); used for V >= 100000. Not tuned to bands (CASES.md sets none
    /// there). Measured at N = 512, D = 640, V = 262144: ~2.2 nats, ~104 entries `>= 2⁻¹²`
    /// per row, 128 x 128 tiles ~19-25% sorted / ~57-70% unsorted (the real model: 2.36 nats,
    /// 115 entries, 27% / 43%), ~6900 entries to keep for a dropped mass `<= 1e-3` (real 6517).
    pub const LARGE_VOCAB: LmParams = LmParams {
        clusters: 30,
        slope_mu: 0.65,
        slope_sigma: 0.22,
        peak_mu: 2.3,
        peak_sigma: 0.55,
        bulk_std: 3.0,
        unigram_std: 3.5,
        topic_keep: 0.5,
        zipf_exponent: 1.0,
        row_corr: 0.99,
        peak_prior: 0.0,
        magnitude: 2.0,
    };

    /// The preset for a vocabulary of `v` classes: [`Self::SMALL_VOCAB`] below 100000,
    /// [`Self::LARGE_VOCAB`] from there on.
    pub fn for_vocab(v: usize) -> LmParams {
        if v < 100_000 {
            Self::SMALL_VOCAB
        } else {
            Self::LARGE_VOCAB
        }
    }

    fn check(&self) -> Result<()> {
        let finite = [
            self.slope_mu,
            self.slope_sigma,
            self.peak_mu,
            self.peak_sigma,
            self.bulk_std,
            self.unigram_std,
            self.topic_keep,
            self.zipf_exponent,
            self.row_corr,
            self.peak_prior,
        ]
        .iter()
        .all(|x| x.is_finite());
        if !finite
            || self.slope_sigma < 0.0
            || self.peak_sigma < 0.0
            || self.bulk_std < 0.0
            || self.unigram_std < 0.0
            || !(0.0..=1.0).contains(&self.topic_keep)
            || !(0.0..1.0).contains(&self.row_corr)
            || !(self.magnitude.is_finite() && self.magnitude > 0.0)
        {
            return Err(DataError::InvalidParameter(format!(
                "bad lm parameters {self:?}"
            )));
        }
        Ok(())
    }
}

/// How a synthetic dataset is drawn (the distributions of CASES.md).
///
/// Parsed from and displayed as: `randn`, `c/8`, `e/8`, `c*8`, `e*8` (any positive number
/// after `/` or `*`; both factors as `e*2,c/4`), `iid` (2.5 nats) or `iid:H` (`H` nats),
/// `lm` (the preset for `V`), `lm:small`, `lm:large` (a fixed preset). Other
/// [`LmWith`](Self::LmWith) parameters display as `lm:custom(...)`, which does not parse.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Distribution {
    /// `e`, `c` ~ N(0, 1) elementwise, targets uniform: the seed's inputs (logit std ~ √D, a
    /// near one-hot softmax, entropy ~0.1 nats).
    Randn,
    /// Like [`Randn`](Self::Randn) with `e` multiplied by `e_scale` and `c` by `c_scale`
    /// (the seed's `c/8` is `c_scale = 0.125`), targets uniform.
    Scaled {
        /// Factor applied to `e`.
        e_scale: f32,
        /// Factor applied to `c`.
        c_scale: f32,
    },
    /// iid Gaussian logits: `c ~ N(0, 1/D)`, `e` Gaussian directions of norm `a·√D` (so each
    /// row's logits are N(0, a²) over classes), with `a` solved by bisection on a sample of rows so that the mean softmax entropy is `entropy_nats`; targets sampled
    /// from the softmax. The worst case for filtering.
    Iid {
        /// Target mean softmax entropy per row, nats, in `(0, ln V)`.
        entropy_nats: f64,
    },
    /// The generator calibrated to real LM logits ([`LmParams`]), with the preset of
    /// [`LmParams::for_vocab`]; targets sampled from the softmax.
    Lm,
    /// The `lm` generator with explicit parameters.
    LmWith(LmParams),
}

impl fmt::Display for Distribution {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Distribution::Randn => write!(f, "randn"),
            Distribution::Scaled { e_scale, c_scale } => {
                let one = |f: &mut fmt::Formatter<'_>, name: &str, s: f32| {
                    if s >= 1.0 {
                        write!(f, "{name}*{s}")
                    } else {
                        write!(f, "{name}/{}", 1.0 / s)
                    }
                };
                match (*e_scale == 1.0, *c_scale == 1.0) {
                    (true, true) => write!(f, "randn"),
                    (true, false) => one(f, "c", *c_scale),
                    (false, true) => one(f, "e", *e_scale),
                    (false, false) => {
                        one(f, "e", *e_scale)?;
                        write!(f, ",")?;
                        one(f, "c", *c_scale)
                    }
                }
            }
            Distribution::Iid { entropy_nats } => write!(f, "iid:{entropy_nats}"),
            Distribution::Lm => write!(f, "lm"),
            Distribution::LmWith(p) if *p == LmParams::SMALL_VOCAB => write!(f, "lm:small"),
            Distribution::LmWith(p) if *p == LmParams::LARGE_VOCAB => write!(f, "lm:large"),
            Distribution::LmWith(p) => write!(f, "lm:custom({p:?})"),
        }
    }
}

impl FromStr for Distribution {
    type Err = DataError;

    /// Parses the names listed on [`Distribution`] (case-insensitive, surrounding spaces
    /// ignored).
    ///
    /// # Errors
    /// [`DataError::InvalidParameter`] for an unknown name or a non-positive factor.
    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim().to_ascii_lowercase();
        let bad = || {
            DataError::InvalidParameter(format!(
            "unknown distribution `{s}` (expected randn, c/8, e/8, c*8, e*8, iid, iid:H, lm, lm:small, lm:large)"
        ))
        };
        match t.as_str() {
            "randn" => return Ok(Distribution::Randn),
            "iid" => {
                return Ok(Distribution::Iid {
                    entropy_nats: DEFAULT_IID_ENTROPY,
                })
            }
            "lm" => return Ok(Distribution::Lm),
            "lm:small" => return Ok(Distribution::LmWith(LmParams::SMALL_VOCAB)),
            "lm:large" => return Ok(Distribution::LmWith(LmParams::LARGE_VOCAB)),
            _ => {}
        }
        if let Some(h) = t.strip_prefix("iid:").or_else(|| t.strip_prefix("iid=")) {
            let h: f64 = h.trim().parse().map_err(|_| {
                DataError::InvalidParameter(format!(
                    "`{s}`: iid:H takes an entropy H in nats, a positive number"
                ))
            })?;
            if !(h.is_finite() && h > 0.0) {
                return Err(DataError::InvalidParameter(format!(
                    "`{s}`: the iid entropy must be positive and finite (nats), got {h}"
                )));
            }
            return Ok(Distribution::Iid { entropy_nats: h });
        }
        let (mut e_scale, mut c_scale) = (1.0f32, 1.0f32);
        for part in t.split(',') {
            let part = part.trim();
            let (which, rest) = part.split_at_checked(1).ok_or_else(bad)?;
            let (op, num) = rest.split_at_checked(1).ok_or_else(bad)?;
            let x: f32 = num.trim().parse().map_err(|_| bad())?;
            if !(x.is_finite() && x > 0.0) {
                return Err(bad());
            }
            let factor = match op {
                "*" => x,
                "/" => 1.0 / x,
                _ => return Err(bad()),
            };
            match which {
                "e" => e_scale = factor,
                "c" => c_scale = factor,
                _ => return Err(bad()),
            }
        }
        Ok(Distribution::Scaled { e_scale, c_scale })
    }
}

// Independent random streams: one per purpose and index, so that results do not depend on
// the number of threads or on how work is split.
const STREAM_E: u64 = 1;
const STREAM_C: u64 = 2;
const STREAM_TARGETS: u64 = 3;
const STREAM_ROWS: u64 = 4;
const STREAM_CLASSES: u64 = 5;

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The random stream of `(seed, purpose, index)`.
fn rng_for(seed: u64, stream: u64, index: u64) -> ChaCha8Rng {
    let h = splitmix(splitmix(splitmix(seed) ^ stream) ^ index);
    ChaCha8Rng::seed_from_u64(h)
}

/// Fills `rows` (consecutive rows of `width` values) with N(0, scale²) values, row `r` from
/// the stream `(seed, stream, r)`.
fn fill_normal(x: &mut [f32], width: usize, scale: f32, seed: u64, stream: u64) {
    if width == 0 {
        return;
    }
    x.par_chunks_mut(width).enumerate().for_each(|(r, row)| {
        let mut rng = rng_for(seed, stream, r as u64);
        for v in row {
            let z: f32 = rng.sample(StandardNormal);
            *v = scale * z;
        }
    });
}

/// Samples one class from `softmax(x)` by inverse CDF in f64 (`u` uniform in [0, 1)); `w` is
/// scratch of `x.len()`. Rows whose logits are not finite get the argmax.
fn sample_softmax(x: &[f32], w: &mut [f64], u: f64) -> usize {
    let mut m = f32::NEG_INFINITY;
    let mut arg = 0;
    for (j, &xj) in x.iter().enumerate() {
        if xj > m {
            m = xj;
            arg = j;
        }
    }
    if !m.is_finite() {
        return arg;
    }
    let m = m as f64;
    let mut s = 0.0;
    for (wj, &xj) in w.iter_mut().zip(x) {
        *wj = (xj as f64 - m).exp();
        s += *wj;
    }
    let goal = u * s;
    let mut acc = 0.0;
    for (j, &wj) in w.iter().enumerate() {
        acc += wj;
        if acc > goal {
            return j;
        }
    }
    arg
}

/// Draws `targets[i] ~ softmax(e_i · Cᵀ + bias)`, blockwise (never `n x v` logits at once).
fn sample_targets(
    e: &[f32],
    c: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    d: usize,
    v: usize,
    seed: u64,
) -> Vec<i64> {
    let rows = block_rows(v, 128);
    let mut t = vec![0i64; n];
    t.par_chunks_mut(rows).enumerate().for_each_init(
        || (vec![0f32; rows * v], vec![0f64; v]),
        |(buf, w), (b, out)| {
            let r0 = b * rows;
            let m = out.len();
            logits_block(
                &e[r0 * d..(r0 + m) * d],
                m,
                d,
                c,
                v,
                bias,
                &mut buf[..m * v],
            );
            for (r, o) in out.iter_mut().enumerate() {
                let mut rng = rng_for(seed, STREAM_TARGETS, (r0 + r) as u64);
                let u: f64 = rng.random();
                *o = sample_softmax(&buf[r * v..(r + 1) * v], w, u) as i64;
            }
        },
    );
    t
}

fn uniform_targets(n: usize, v: usize, seed: u64) -> Vec<i64> {
    let mut rng = rng_for(seed, STREAM_TARGETS, 0);
    (0..n).map(|_| rng.random_range(0..v) as i64).collect()
}

/// Mean softmax entropy (nats) of the rows of `x` (`rows x v`) scaled by `a`, and its
/// derivative in `a` (`-a Var_p(x)` per row), in f64.
fn mean_entropy(x: &[f32], v: usize, a: f64) -> (f64, f64) {
    let rows = x.len() / v;
    let (h, dh) = x
        .par_chunks(v)
        .map(|row| {
            let mx = row.iter().fold(f32::NEG_INFINITY, |m, &y| m.max(y)) as f64;
            let (mut s, mut t1, mut t2) = (0.0f64, 0.0f64, 0.0f64);
            for &y in row {
                let y = y as f64 - mx;
                let w = (a * y).exp();
                s += w;
                t1 += w * y;
                t2 += w * y * y;
            }
            let (m1, m2) = (t1 / s, t2 / s);
            (s.ln() - a * m1, -a * (m2 - m1 * m1).max(0.0))
        })
        .reduce(|| (0.0, 0.0), |p, q| (p.0 + q.0, p.1 + q.1));
    (h / rows as f64, dh / rows as f64)
}

/// Generates a synthetic dataset of `n` rows, hidden size `d` and `v` classes, drawn from
/// `dist` with `seed`. Deterministic for a given seed and independent of the number of
/// threads (each row of `e`, each row of `c` and each target has its own random stream).
///
/// Values are f32 with `bias = None`. For `iid` and `lm` the targets are drawn exactly from
/// `softmax(e_i · Cᵀ)`: the f32 logits of a block of rows x all classes, then per row one
/// uniform number and an inverse-CDF scan in f64 (the same law as Gumbel-max, with one `exp`
/// per logit instead of a random number and two logs). Memory: the result holds `4·(n·d + v·d) + 8·n` bytes
/// (the seed shape N = 32768, D = 4096, V = 256000 takes 4.5 GiB), plus, for `iid` and `lm`
/// whose targets are sampled from the softmax, up to 32 MiB of logits per thread. Time is
/// dominated by that sampling, a full `n x v x d` f32 matmul (for `iid` and `lm` only).
///
/// # Errors
/// - [`DataError::InvalidParameter`]: `d` or `v` is 0 (or `v >= 2^32`), a scale is not positive and finite,
///   an `iid` entropy not in `(0, ln v)`, or bad [`LmParams`];
/// - [`DataError::OutOfMemory`]: the arrays cannot be allocated.
pub fn generate(dist: &Distribution, n: usize, d: usize, v: usize, seed: u64) -> Result<Dataset> {
    if d == 0 || v == 0 {
        return Err(DataError::InvalidParameter(format!(
            "D and V must be >= 1 (got N = {n}, D = {d}, V = {v})"
        )));
    }
    if v > u32::MAX as usize {
        return Err(DataError::InvalidParameter(format!(
            "V = {v} too large (at most 2^32 - 1)"
        )));
    }
    let ne = checked_len(n, d, "e")?;
    let nc = checked_len(v, d, "c")?;
    let mut e: Vec<f32> = try_zeroed(ne, "e")?;
    let mut c: Vec<f32> = try_zeroed(nc, "c")?;
    let targets = match *dist {
        Distribution::Randn => {
            fill_normal(&mut e, d, 1.0, seed, STREAM_E);
            fill_normal(&mut c, d, 1.0, seed, STREAM_C);
            uniform_targets(n, v, seed)
        }
        Distribution::Scaled { e_scale, c_scale } => {
            for s in [e_scale, c_scale] {
                if !(s.is_finite() && s > 0.0) {
                    return Err(DataError::InvalidParameter(format!(
                        "scale {s} must be positive"
                    )));
                }
            }
            fill_normal(&mut e, d, e_scale, seed, STREAM_E);
            fill_normal(&mut c, d, c_scale, seed, STREAM_C);
            uniform_targets(n, v, seed)
        }
        Distribution::Iid { entropy_nats } => {
            let max = (v as f64).ln();
            if !(entropy_nats > 0.0 && entropy_nats < max) {
                return Err(DataError::InvalidParameter(format!(
                    "iid entropy {entropy_nats} nats must lie in (0, ln V = {max:.3})"
                )));
            }
            fill_normal(&mut e, d, 1.0, seed, STREAM_E);
            fill_normal(&mut c, d, 1.0 / (d as f32).sqrt(), seed, STREAM_C);
            // Every row of e gets the norm sqrt(D), so every row's logits are N(0, 1) over
            // the classes (given e) and one scale fits all rows.
            e.par_chunks_mut(d).for_each(|row| {
                let norm = row.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
                if norm > 0.0 {
                    let s = ((d as f64).sqrt() / norm) as f32;
                    row.iter_mut().for_each(|x| *x *= s);
                }
            });
            if n > 0 {
                let a = solve_iid_scale(&e, &c, n, d, v, entropy_nats)?;
                e.par_iter_mut().for_each(|x| *x *= a);
            }
            sample_targets(&e, &c, None, n, d, v, seed)
        }
        Distribution::Lm => {
            fill_lm(&mut e, &mut c, n, d, v, &LmParams::for_vocab(v), seed)?;
            sample_targets(&e, &c, None, n, d, v, seed)
        }
        Distribution::LmWith(p) => {
            fill_lm(&mut e, &mut c, n, d, v, &p, seed)?;
            sample_targets(&e, &c, None, n, d, v, seed)
        }
    };
    Ok(Dataset {
        name: format!("{dist} N={n} D={d} V={v} seed={seed}"),
        n,
        d,
        v,
        e,
        c,
        bias: None,
        targets,
        lse_ref: None,
        nll_ref: None,
        seq_len: None,
    })
}

/// Bytes of logits the `iid` calibration may hold (its sample of rows x all classes).
const IID_SAMPLE_BYTES: usize = 256 << 20;

/// Finds the factor `a` for `e` such that the mean softmax entropy of a sample of rows
/// (all rows when their logits fit in 256 MiB, else an evenly spread subset of at least 16)
/// is `h`: safeguarded Newton iterations inside a bisection bracket (entropy decreases with
/// `a`). Per-row entropies of iid logits spread widely (p05-p95 ~0.8-4.2 nats at 2.5 nats), so
/// a small sample would miss the mean.
fn solve_iid_scale(e: &[f32], c: &[f32], n: usize, d: usize, v: usize, h: f64) -> Result<f32> {
    let s = n.min((IID_SAMPLE_BYTES / (4 * v)).max(16)).max(1);
    let mut sample = vec![0f32; s * d];
    for (t, row) in sample.chunks_mut(d).enumerate() {
        let i = t * n / s;
        row.copy_from_slice(&e[i * d..(i + 1) * d]);
    }
    let mut x: Vec<f32> = try_zeroed(checked_len(s, v, "iid sample logits")?, "iid sample logits")?;
    let rows = block_rows(v, 128);
    x.par_chunks_mut(rows * v)
        .zip(sample.par_chunks(rows * d))
        .for_each(|(out, ein)| logits_block(ein, ein.len() / d, d, c, v, None, out));
    let (mut lo, mut hi) = (0.0f64, f64::INFINITY);
    let mut a = 1.0f64;
    for _ in 0..200 {
        let (ha, dh) = mean_entropy(&x, v, a);
        if (ha - h).abs() < 1e-4 {
            return Ok(a as f32);
        }
        if ha > h {
            lo = a;
        } else {
            hi = a;
        }
        let newton = a - (ha - h) / dh;
        a = if newton.is_finite() && newton > lo && newton < hi {
            newton
        } else if hi.is_finite() {
            0.5 * (lo + hi)
        } else {
            2.0 * a
        };
        if a > 1e30 || (hi - lo) < 1e-12 * hi {
            break;
        }
    }
    if hi.is_finite() && (hi - lo) < 1e-6 * hi {
        return Ok(a as f32);
    }
    Err(DataError::InvalidParameter(format!(
        "iid entropy {h} nats cannot be reached at D = {d}, V = {v}"
    )))
}

/// Writes the `lm` construction into `e` (`n x d`) and `c` (`v x d`).
///
/// Coordinates: 0 carries the unigram bias (`e[i, 0] = 1`, `c[j, 0] = b_j`); `1..=K` the
/// topics (`e[i, 1 + t_i] = s_i`, `c[j, 1 + cluster_j] = w_j`); the remaining `D - 1 - K`
/// the bulk: `c_j` a random unit direction `u_j`, `e_i = σ_i √(D') ẑ_i + L_i u_{k_i}` with
/// `ẑ_i` a random unit direction, so `e_i · c_j` has standard deviation `σ_i` over classes and
/// the peak class gets `+L_i`; `σ_i² = bulk_std² − L_i²/D'` compensates the noise the peak
/// direction adds to other classes. `K = min(clusters, (D − 1) / 2)`: at small `D` the topic
/// count shrinks, and with `D = 1` only the bias is left.
fn fill_lm(
    e: &mut [f32],
    c: &mut [f32],
    n: usize,
    d: usize,
    v: usize,
    p: &LmParams,
    seed: u64,
) -> Result<()> {
    p.check()?;
    let k = p.clusters.min((d - 1) / 2);
    let b0 = 1 + k;
    let db = d - b0;

    // Classes: unigram bias from random Zipf ranks, cluster membership and weight.
    let mut rng = rng_for(seed, STREAM_CLASSES, 0);
    let mut rank: Vec<u32> = (1..=v as u32).collect();
    rank.shuffle(&mut rng);
    // Zipf part: -a ln(rank), centered; then Gaussian jitter so that the total has the
    // standard deviation asked for (or the Zipf part scaled down if it alone is wider).
    let raw: Vec<f64> = rank
        .iter()
        .map(|&r| -p.zipf_exponent * (r as f64).ln())
        .collect();
    let mean = raw.iter().sum::<f64>() / v as f64;
    let var = raw.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v as f64;
    let target = p.unigram_std * p.unigram_std;
    let (shrink, jitter) = if var > target {
        ((target / var).sqrt(), 0.0)
    } else {
        (1.0, (target - var).sqrt())
    };
    let bias: Vec<f64> = raw
        .iter()
        .map(|x| {
            let z: f64 = rng.sample(StandardNormal);
            (x - mean) * shrink + jitter * z
        })
        .collect();
    let member: Vec<(usize, f64)> = (0..v)
        .map(|_| {
            let cl = if k > 0 { rng.random_range(0..k) } else { 0 };
            let w: f64 = rng.sample(Exp1);
            (cl, w)
        })
        .collect();

    // Rows: sticky topic, slope, peak class (drawn from softmax(peak_prior * bias)), lift.
    let mut cdf = Vec::with_capacity(v);
    let bmax = bias.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let mut acc = 0.0;
    for b in &bias {
        acc += (p.peak_prior * (b - bmax)).exp();
        cdf.push(acc);
    }
    let mut rng = rng_for(seed, STREAM_ROWS, 0);
    let mut topic = 0usize;
    let rows: Vec<(usize, f64, usize, f64)> = (0..n)
        .map(|i| {
            if k > 0 && (i == 0 || rng.random::<f64>() >= p.topic_keep) {
                topic = rng.random_range(0..k);
            }
            let z1: f64 = rng.sample(StandardNormal);
            let slope = (p.slope_mu + p.slope_sigma * z1).exp();
            let u: f64 = rng.random::<f64>() * acc;
            let peak = cdf.partition_point(|&c| c <= u).min(v - 1);
            let z2: f64 = rng.sample(StandardNormal);
            let lift = (p.peak_mu + p.peak_sigma * z2).exp();
            (topic, slope, peak, lift)
        })
        .collect();

    let f = p.magnitude;
    c.par_chunks_mut(d).enumerate().for_each(|(j, row)| {
        row[0] = bias[j] as f32 / f;
        if k > 0 {
            row[1 + member[j].0] = member[j].1 as f32 / f;
        }
        if db > 0 {
            let mut rng = rng_for(seed, STREAM_C, j as u64);
            let bulk = &mut row[b0..];
            let mut norm = 0.0f64;
            for x in bulk.iter_mut() {
                let z: f64 = rng.sample(StandardNormal);
                *x = z as f32;
                norm += z * z;
            }
            let s = if norm > 0.0 { 1.0 / norm.sqrt() } else { 0.0 };
            for x in bulk.iter_mut() {
                *x = (*x as f64 * s) as f32 / f;
            }
        }
    });
    // Bulk directions of the rows: iid Gaussian, then (optionally) an AR(1) along the rows
    // so that neighbouring tokens share their bulk.
    if db > 0 {
        e.par_chunks_mut(d).enumerate().for_each(|(i, row)| {
            let mut rng = rng_for(seed, STREAM_E, i as u64);
            for x in &mut row[b0..] {
                *x = rng.sample(StandardNormal);
            }
        });
        if p.row_corr > 0.0 {
            let (r, q) = (
                p.row_corr as f32,
                (1.0 - p.row_corr * p.row_corr).sqrt() as f32,
            );
            for i in 1..n {
                let (prev, cur) = e[(i - 1) * d..(i + 1) * d].split_at_mut(d);
                for (x, &y) in cur[b0..].iter_mut().zip(&prev[b0..]) {
                    *x = r * y + q * *x;
                }
            }
        }
    }
    let cr = &*c;
    e.par_chunks_mut(d).enumerate().for_each(|(i, row)| {
        let (t, slope, peak, lift) = rows[i];
        row[0] = f;
        if k > 0 {
            row[1 + t] = (slope * f as f64) as f32;
        }
        if db > 0 {
            let var = (p.bulk_std * p.bulk_std - lift * lift / db as f64).max(0.0);
            let bulk = &mut row[b0..];
            let norm: f64 = bulk.iter().map(|&z| z as f64 * z as f64).sum();
            let s = if norm > 0.0 {
                var.sqrt() * (db as f64).sqrt() / norm.sqrt()
            } else {
                0.0
            };
            // The peak direction: c's bulk part of the peak class (unit norm times 1/f).
            let u = &cr[peak * d + b0..(peak + 1) * d];
            for (x, &uk) in bulk.iter_mut().zip(u) {
                *x = ((*x as f64 * s + lift * uk as f64 * f as f64) * f as f64) as f32;
            }
        }
    });
    Ok(())
}
