//! Statistics of the softmax of a dataset's logits (the table of CASES.md), measured
//! blockwise without ever holding `N x V` logits.

use std::fmt;

use rayon::prelude::*;

use crate::dataset::Dataset;
use crate::error::Result;
use crate::logits::{block_rows, logits_block};

/// The probability from which an entry counts as significant: 2⁻¹² (bf16 machine epsilon
/// / 32, CCE's default gradient-filter threshold).
pub const SIGNIFICANT_P: f64 = 1.0 / 4096.0;

/// Histogram resolution for the "entries to keep" counts: bins of 1/16 nat of `-ln p` up to
/// 64 nats, then one overflow bin (the exact count is then resolved inside the critical bin).
const BINS_PER_NAT: f64 = 16.0;
const NBINS: usize = 64 * 16 + 1;

/// Statistics of `softmax(E·Cᵀ + bias)` per row, aggregated over rows (CASES.md's table).
///
/// Logits are computed in f32 (`matrixmultiply` sgemm, a block of rows at a time), the softmax
/// and everything after it in f64. Probabilities, fractions and tile occupancies are in
/// `[0, 1]`; entropies and logit statistics in nats.
#[derive(Clone, Debug, PartialEq)]
pub struct LogitStats {
    /// Rows measured.
    pub n: usize,
    /// Classes.
    pub v: usize,
    /// Mean softmax entropy per row.
    pub entropy_mean: f64,
    /// 5th percentile of the per-row entropy.
    pub entropy_p05: f64,
    /// Median per-row entropy.
    pub entropy_p50: f64,
    /// 95th percentile of the per-row entropy.
    pub entropy_p95: f64,
    /// Mean over rows of the largest probability.
    pub max_prob_mean: f64,
    /// Mean number of entries per row with `p >= 2⁻¹²`.
    pub significant_mean: f64,
    /// Median number of entries per row with `p >= 2⁻¹²`.
    pub significant_median: f64,
    /// `significant_mean / V`.
    pub significant_frac: f64,
    /// Fraction of 128 (rows) x 128 (classes) tiles holding an entry `>= 2⁻¹²`, with the
    /// vocabulary sorted by mean logit (descending).
    pub tiles_128_sorted: f64,
    /// Same, vocabulary in its own order.
    pub tiles_128_unsorted: f64,
    /// Fraction of 16 (rows) x 64 (classes) tiles holding an entry `>= 2⁻¹²`, sorted vocabulary.
    pub tiles_16x64_sorted: f64,
    /// Same, vocabulary in its own order.
    pub tiles_16x64_unsorted: f64,
    /// Mean over rows of the standard deviation of the row's logits over classes.
    pub row_logit_std: f64,
    /// Standard deviation over classes of the mean logit (mean over rows): the strength of a
    /// shared unigram prior.
    pub class_mean_logit_std: f64,
    /// Mean over rows of the probability mass carried by entries with `p < 2⁻¹²`.
    pub mass_below_mean: f64,
    /// 95th percentile over rows of that mass.
    pub mass_below_p95: f64,
    /// Mean over rows of the fewest entries to keep so that the dropped mass is `<= 1e-2`.
    pub keep_1e2_mean: f64,
    /// Median of that count.
    pub keep_1e2_median: f64,
    /// Mean over rows of the fewest entries to keep so that the dropped mass is `<= 1e-3`.
    pub keep_1e3_mean: f64,
    /// Median of that count.
    pub keep_1e3_median: f64,
    /// Mean `lse - logit[target]` over rows whose target is in `[0, V)` (NaN if none).
    pub mean_nll: f64,
    /// Fraction of rows (with a target in `[0, V)`) whose target is the argmax (NaN if none).
    pub top1_accuracy: f64,
}

/// One statistic of [`LogitStats`] compared with its acceptance band.
#[derive(Clone, Debug, PartialEq)]
pub struct BandCheck {
    /// What is measured, as in CASES.md.
    pub statistic: &'static str,
    /// The value measured.
    pub value: f64,
    /// Lower end of the band (inclusive).
    pub lo: f64,
    /// Upper end of the band (inclusive).
    pub hi: f64,
    /// The value the real model has (SmolLM2-135M, 16384 tokens).
    pub real: f64,
    /// `lo <= value <= hi`.
    pub ok: bool,
}

impl fmt::Display for BandCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<44} {:>10.4} in [{:.4}, {:.4}] (real {:.4}) {}",
            self.statistic,
            self.value,
            self.lo,
            self.hi,
            self.real,
            if self.ok { "ok" } else { "OUT" }
        )
    }
}

impl LogitStats {
    /// Compares these statistics with the acceptance bands CASES.md sets for the `lm`
    /// generator at V = 49152, D = 576, N >= 4096 (the bands describe SmolLM2-135M; at
    /// another V several of them, the fractions of V and the tile occupancies, do not apply).
    pub fn check_lm_bands(&self) -> Vec<BandCheck> {
        let b = |statistic, value: f64, lo, hi, real| BandCheck {
            statistic,
            value,
            lo,
            hi,
            real,
            ok: value >= lo && value <= hi,
        };
        vec![
            b(
                "mean softmax entropy per row (nats)",
                self.entropy_mean,
                2.0,
                2.9,
                2.38,
            ),
            b("mean max probability", self.max_prob_mean, 0.40, 0.60, 0.52),
            b(
                "entries with p >= 2^-12 per row (mean)",
                self.significant_mean,
                80.0,
                200.0,
                120.0,
            ),
            b(
                "fraction of V with p >= 2^-12",
                self.significant_frac,
                0.0015,
                0.0045,
                0.0024,
            ),
            b(
                "128x128 tiles kept, vocab sorted",
                self.tiles_128_sorted,
                0.65,
                0.90,
                0.74,
            ),
            b(
                "128x128 tiles kept, unsorted",
                self.tiles_128_unsorted,
                0.90,
                1.0,
                0.96,
            ),
            b(
                "16x64 tiles kept, vocab sorted",
                self.tiles_16x64_sorted,
                0.25,
                0.55,
                0.34,
            ),
            b(
                "16x64 tiles kept, unsorted",
                self.tiles_16x64_unsorted,
                0.40,
                0.65,
                0.48,
            ),
            b("row logit std", self.row_logit_std, 2.8, 4.2, 3.35),
            b(
                "std over classes of the mean logit",
                self.class_mean_logit_std,
                1.5,
                2.6,
                2.1,
            ),
            b(
                "mass per row below 2^-12 (mean)",
                self.mass_below_mean,
                0.025,
                0.06,
                0.041,
            ),
            b(
                "entries to keep, dropped mass <= 1e-2 (mean)",
                self.keep_1e2_mean,
                400.0,
                1800.0,
                779.0,
            ),
            b(
                "entries to keep, dropped mass <= 1e-3 (mean)",
                self.keep_1e3_mean,
                2500.0,
                7000.0,
                4154.0,
            ),
        ]
    }
}

impl fmt::Display for LogitStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let pct = |x: f64| format!("{:.2}%", 100.0 * x);
        let rows: Vec<(&str, String)> = vec![
            ("rows x classes", format!("{} x {}", self.n, self.v)),
            (
                "softmax entropy (nats): mean / p05 / p50 / p95",
                format!(
                    "{:.3} / {:.3} / {:.3} / {:.3}",
                    self.entropy_mean, self.entropy_p05, self.entropy_p50, self.entropy_p95
                ),
            ),
            ("mean max probability", format!("{:.3}", self.max_prob_mean)),
            (
                "entries p >= 2^-12 per row: mean / median",
                format!(
                    "{:.1} / {:.0}",
                    self.significant_mean, self.significant_median
                ),
            ),
            (
                "fraction of V with p >= 2^-12",
                format!("{:.3}%", 100.0 * self.significant_frac),
            ),
            (
                "128x128 tiles kept: sorted / unsorted",
                format!(
                    "{} / {}",
                    pct(self.tiles_128_sorted),
                    pct(self.tiles_128_unsorted)
                ),
            ),
            (
                "16x64 tiles kept: sorted / unsorted",
                format!(
                    "{} / {}",
                    pct(self.tiles_16x64_sorted),
                    pct(self.tiles_16x64_unsorted)
                ),
            ),
            ("row logit std", format!("{:.3}", self.row_logit_std)),
            (
                "std over classes of the mean logit",
                format!("{:.3}", self.class_mean_logit_std),
            ),
            (
                "mass below 2^-12 per row: mean / p95",
                format!(
                    "{} / {}",
                    pct(self.mass_below_mean),
                    pct(self.mass_below_p95)
                ),
            ),
            (
                "entries to keep, dropped <= 1e-2: mean / median",
                format!("{:.0} / {:.0}", self.keep_1e2_mean, self.keep_1e2_median),
            ),
            (
                "entries to keep, dropped <= 1e-3: mean / median",
                format!("{:.0} / {:.0}", self.keep_1e3_mean, self.keep_1e3_median),
            ),
            ("mean nll (nats)", format!("{:.4}", self.mean_nll)),
            ("top-1 accuracy", pct(self.top1_accuracy)),
        ];
        let w = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        writeln!(f, "| {:<w$} | value |", "statistic")?;
        writeln!(f, "|{}|-------|", "-".repeat(w + 2))?;
        for (k, v) in rows {
            writeln!(f, "| {k:<w$} | {v} |")?;
        }
        Ok(())
    }
}

/// What one row contributes.
#[derive(Clone, Copy, Default)]
struct RowOut {
    entropy: f64,
    max_prob: f64,
    significant: u32,
    mass_below: f64,
    std: f64,
    keep_1e2: u32,
    keep_1e3: u32,
    /// `Some((nll, target is argmax))` for a target in `[0, V)`.
    scored: Option<(f64, bool)>,
}

/// Scratch of one worker.
struct Scratch {
    logits: Vec<f32>,
    w: Vec<f64>,
    mass: Vec<f64>,
    count: Vec<u32>,
    tmp: Vec<f64>,
}

fn bin(q: f64) -> usize {
    // q = -ln p >= 0 (tiny negative rounding is clamped by the cast).
    ((q * BINS_PER_NAT) as usize).min(NBINS - 1)
}

/// Fewest entries to keep so that the dropped (smallest) probabilities sum to at most
/// `delta` of the row's mass `s` (weights `w`, bins `mass`/`count` already filled).
fn keep_count(x: &[f32], m: f64, ls: f64, s: f64, sc: &mut Scratch, delta: f64) -> u32 {
    let Scratch {
        w,
        mass,
        count,
        tmp,
        ..
    } = sc;
    let budget = delta * s;
    let mut dropped_mass = 0.0;
    let mut dropped = 0usize;
    let mut critical = None;
    for b in (0..NBINS).rev() {
        if dropped_mass + mass[b] <= budget {
            dropped_mass += mass[b];
            dropped += count[b] as usize;
        } else {
            critical = Some(b);
            break;
        }
    }
    if let Some(cb) = critical {
        tmp.clear();
        for (&xj, &wj) in x.iter().zip(w.iter()) {
            if bin(ls - (xj as f64 - m)) == cb {
                tmp.push(wj);
            }
        }
        tmp.sort_unstable_by(f64::total_cmp);
        for &wj in tmp.iter() {
            if dropped_mass + wj <= budget {
                dropped_mass += wj;
                dropped += 1;
            } else {
                break;
            }
        }
    }
    (x.len() - dropped) as u32
}

/// Statistics of one row of logits; sets bits of the significant classes' 64-wide tiles in
/// `sorted_bits` (positions `pos[j]`) and `unsorted_bits` (positions `j`).
fn row_stats(
    x: &[f32],
    target: i64,
    pos: &[u32],
    sorted_bits: &mut [u64],
    unsorted_bits: &mut [u64],
    sc: &mut Scratch,
) -> RowOut {
    let v = x.len();
    let mut m = f32::NEG_INFINITY;
    let mut arg = 0usize;
    let (mut sum, mut sumsq) = (0.0f64, 0.0f64);
    let x0 = x[0] as f64;
    for (j, &xj) in x.iter().enumerate() {
        if xj > m {
            m = xj;
            arg = j;
        }
        let y = xj as f64 - x0;
        sum += y;
        sumsq += y * y;
    }
    let mean = sum / v as f64;
    let std = (sumsq / v as f64 - mean * mean).max(0.0).sqrt();
    if !m.is_finite() {
        return RowOut {
            entropy: f64::NAN,
            max_prob: f64::NAN,
            mass_below: f64::NAN,
            std: f64::NAN,
            ..RowOut::default()
        };
    }
    let m = m as f64;
    let (mut s, mut t) = (0.0f64, 0.0f64);
    for (wj, &xj) in sc.w.iter_mut().zip(x) {
        let z = xj as f64 - m;
        *wj = z.exp();
        s += *wj;
        t += *wj * z;
    }
    let ls = s.ln();
    let entropy = ls - t / s;
    let cut = s * SIGNIFICANT_P;
    sc.mass.fill(0.0);
    sc.count.fill(0);
    let mut significant = 0u32;
    let mut below = 0.0f64;
    for (j, (&xj, &wj)) in x.iter().zip(&sc.w).enumerate() {
        let b = bin(ls - (xj as f64 - m));
        sc.mass[b] += wj;
        sc.count[b] += 1;
        if wj >= cut {
            significant += 1;
            let (pj, uj) = (pos[j] as usize / 64, j / 64);
            sorted_bits[pj / 64] |= 1 << (pj % 64);
            unsorted_bits[uj / 64] |= 1 << (uj % 64);
        } else {
            below += wj;
        }
    }
    let keep_1e2 = keep_count(x, m, ls, s, sc, 1e-2);
    let keep_1e3 = keep_count(x, m, ls, s, sc, 1e-3);
    let scored = (target >= 0 && (target as u64) < v as u64).then(|| {
        let y = target as usize;
        (m + ls - x[y] as f64, y == arg)
    });
    RowOut {
        entropy,
        max_prob: 1.0 / s,
        significant,
        mass_below: below / s,
        std,
        keep_1e2,
        keep_1e3,
        scored,
    }
}

/// Linear-interpolation quantile of `x` (sorted in place; NaN last), `q` in [0, 1].
fn quantile(x: &mut [f64], q: f64) -> f64 {
    if x.is_empty() {
        return f64::NAN;
    }
    x.sort_unstable_by(f64::total_cmp);
    let p = q * (x.len() - 1) as f64;
    let (lo, hi) = (p.floor() as usize, p.ceil() as usize);
    x[lo] + (x[hi] - x[lo]) * (p - lo as f64)
}

fn mean(x: impl Iterator<Item = f64>) -> f64 {
    let (s, k) = x.fold((0.0, 0usize), |(s, k), y| (s + y, k + 1));
    if k == 0 {
        f64::NAN
    } else {
        s / k as f64
    }
}

/// Measures [`LogitStats`] on all rows of `ds`.
///
/// Blockwise and parallel (rayon): a block of rows x all classes of f32 logits per worker
/// (at most 32 MiB, and at least 16 rows), f64 softmax per row. Memory beyond the dataset:
/// those blocks plus `O(N + V)`. Cost: one `N x V x D` f32 matmul plus ~one `exp` per logit.
/// Rows whose logits are not all finite give NaN entries. Targets outside `[0, V)` (ignored
/// rows) count in every statistic except `mean_nll` and `top1_accuracy`.
///
/// # Errors
/// [`DataError::SizeMismatch`](crate::DataError::SizeMismatch) if the dataset is
/// inconsistent ([`Dataset::validate`]).
pub fn measure(ds: &Dataset) -> Result<LogitStats> {
    ds.validate()?;
    let (n, d, v) = (ds.n, ds.d, ds.v);
    let bias = ds.bias.as_deref();

    // Mean logit per class, exactly by linearity: mean_i(e_i)·c_j + bias_j.
    let mut ebar = vec![0f64; d];
    for row in ds.e.chunks_exact(d.max(1)).take(n) {
        for (a, &x) in ebar.iter_mut().zip(row) {
            *a += x as f64;
        }
    }
    ebar.iter_mut().for_each(|a| *a /= n.max(1) as f64);
    let class_mean: Vec<f64> = (0..v)
        .into_par_iter()
        .map(|j| {
            let dot: f64 = ds.c[j * d..(j + 1) * d]
                .iter()
                .zip(&ebar)
                .map(|(&c, &e)| c as f64 * e)
                .sum();
            dot + bias.map_or(0.0, |b| b[j] as f64)
        })
        .collect();
    let cm = mean(class_mean.iter().copied());
    let class_mean_logit_std = mean(class_mean.iter().map(|x| (x - cm).powi(2))).sqrt();
    let mut order: Vec<u32> = (0..v as u32).collect();
    order.sort_by(|&a, &b| class_mean[b as usize].total_cmp(&class_mean[a as usize]));
    let mut pos = vec![0u32; v];
    for (p, &j) in order.iter().enumerate() {
        pos[j as usize] = p as u32;
    }

    // One pass over blocks of rows (a multiple of 16, so 16-row groups never straddle blocks).
    let rows = block_rows(v, 128).max(16) / 16 * 16;
    let tiles64 = v.div_ceil(64);
    let words = tiles64.div_ceil(64);
    let blocks: Vec<(Vec<RowOut>, Vec<u64>, Vec<u64>)> = (0..n.div_ceil(rows))
        .into_par_iter()
        .map_init(
            || Scratch {
                logits: vec![0f32; rows * v],
                w: vec![0f64; v],
                mass: vec![0f64; NBINS],
                count: vec![0u32; NBINS],
                tmp: Vec::new(),
            },
            |sc, b| {
                let r0 = b * rows;
                let m = rows.min(n - r0);
                let mut logits = std::mem::take(&mut sc.logits);
                logits_block(
                    &ds.e[r0 * d..(r0 + m) * d],
                    m,
                    d,
                    &ds.c,
                    v,
                    bias,
                    &mut logits[..m * v],
                );
                let groups = m.div_ceil(16);
                let mut sorted_bits = vec![0u64; groups * words];
                let mut unsorted_bits = vec![0u64; groups * words];
                let out = (0..m)
                    .map(|r| {
                        let g = r / 16;
                        row_stats(
                            &logits[r * v..(r + 1) * v],
                            ds.targets[r0 + r],
                            &pos,
                            &mut sorted_bits[g * words..(g + 1) * words],
                            &mut unsorted_bits[g * words..(g + 1) * words],
                            sc,
                        )
                    })
                    .collect();
                sc.logits = logits;
                (out, sorted_bits, unsorted_bits)
            },
        )
        .collect();

    let mut rows_out = Vec::with_capacity(n);
    let mut sorted_bits = Vec::with_capacity(n.div_ceil(16) * words);
    let mut unsorted_bits = Vec::with_capacity(n.div_ceil(16) * words);
    for (r, s, u) in blocks {
        rows_out.extend(r);
        sorted_bits.extend(s);
        unsorted_bits.extend(u);
    }
    let groups = n.div_ceil(16);
    let occ16 = |bits: &[u64]| -> f64 {
        let set: u64 = bits.iter().map(|w| w.count_ones() as u64).sum();
        set as f64 / (groups * tiles64) as f64
    };
    let occ128 = |bits: &[u64]| -> f64 {
        let mut set = 0u64;
        let mut merged = vec![0u64; words];
        for tile in bits.chunks(8 * words) {
            merged.fill(0);
            for g in tile.chunks(words) {
                for (a, &b) in merged.iter_mut().zip(g) {
                    *a |= b;
                }
            }
            // A 128-wide tile is a pair of aligned 64-wide tiles (bits 2t, 2t + 1).
            set += merged
                .iter()
                .map(|&w| ((w | (w >> 1)) & 0x5555_5555_5555_5555).count_ones() as u64)
                .sum::<u64>();
        }
        set as f64 / (n.div_ceil(128) * v.div_ceil(128)) as f64
    };

    let col = |f: fn(&RowOut) -> f64| -> Vec<f64> { rows_out.iter().map(f).collect() };
    let mut entropy = col(|r| r.entropy);
    let mut significant = col(|r| r.significant as f64);
    let mut below = col(|r| r.mass_below);
    let mut k2 = col(|r| r.keep_1e2 as f64);
    let mut k3 = col(|r| r.keep_1e3 as f64);
    let scored: Vec<(f64, bool)> = rows_out.iter().filter_map(|r| r.scored).collect();
    let significant_mean = mean(significant.iter().copied());
    Ok(LogitStats {
        n,
        v,
        entropy_mean: mean(entropy.iter().copied()),
        entropy_p05: quantile(&mut entropy, 0.05),
        entropy_p50: quantile(&mut entropy, 0.5),
        entropy_p95: quantile(&mut entropy, 0.95),
        max_prob_mean: mean(rows_out.iter().map(|r| r.max_prob)),
        significant_mean,
        significant_median: quantile(&mut significant, 0.5),
        significant_frac: significant_mean / v as f64,
        tiles_128_sorted: occ128(&sorted_bits),
        tiles_128_unsorted: occ128(&unsorted_bits),
        tiles_16x64_sorted: occ16(&sorted_bits),
        tiles_16x64_unsorted: occ16(&unsorted_bits),
        row_logit_std: mean(rows_out.iter().map(|r| r.std)),
        class_mean_logit_std,
        mass_below_mean: mean(below.iter().copied()),
        mass_below_p95: quantile(&mut below, 0.95),
        keep_1e2_mean: mean(k2.iter().copied()),
        keep_1e2_median: quantile(&mut k2, 0.5),
        keep_1e3_mean: mean(k3.iter().copied()),
        keep_1e3_median: quantile(&mut k3, 0.5),
        mean_nll: mean(scored.iter().map(|s| s.0)),
        top1_accuracy: mean(scored.iter().map(|s| s.1 as u8 as f64)),
    })
}
