//! Host side of the SGEMM benchmark: random operands, their bytes in each dtype, and the f64
//! reference `C = A·Bᵀ` with the standard error bound (pure functions).

use super::Dtype;

/// Deterministic uniform values in [-1, 1) (splitmix64), `len` of them.
pub fn uniform(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..len)
        .map(|_| {
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            ((z >> 40) as f32) / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// bf16 bits of `x`, rounded to nearest even (NaN kept quiet).
pub fn bf16_bits(x: f32) -> u16 {
    let u = x.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return ((u >> 16) | 0x40) as u16;
    }
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

/// An operand as the kernels read it: its bytes (little-endian, length rounded up to 16) and
/// the values those bytes hold, as f32 (bf16 rounding applied).
pub struct Operand {
    /// Bytes to upload: f32 words, or bf16 pairs with element `2w` in the low half.
    pub bytes: Vec<u8>,
    /// The values the GPU sees.
    pub values: Vec<f32>,
}

/// `values` stored in `dtype`.
pub fn operand(values: &[f32], dtype: Dtype) -> Operand {
    let (mut bytes, values): (Vec<u8>, Vec<f32>) = match dtype {
        Dtype::F32 => (
            values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            values.to_vec(),
        ),
        Dtype::Bf16 => {
            let bits: Vec<u16> = values.iter().map(|&v| bf16_bits(v)).collect();
            (
                bits.iter().flat_map(|b| b.to_le_bytes()).collect(),
                bits.iter()
                    .map(|&b| f32::from_bits(u32::from(b) << 16))
                    .collect(),
            )
        }
    };
    bytes.resize(bytes.len().div_ceil(16).max(1) * 16, 0);
    Operand { bytes, values }
}

/// Entry `(i, j)` of `A·Bᵀ` in f64 (`a` `[m, k]`, `b` `[n, k]`) and `Σ_t |a_it·b_jt|`.
pub fn dot(a: &[f32], b: &[f32], k: usize, i: usize, j: usize) -> (f64, f64) {
    let (ra, rb) = (&a[i * k..(i + 1) * k], &b[j * k..(j + 1) * k]);
    ra.iter().zip(rb).fold((0.0, 0.0), |(s, m), (&x, &y)| {
        let p = f64::from(x) * f64::from(y);
        (s + p, m + p.abs())
    })
}

/// Largest error of `c` (`[m, n]`, as computed) over the entries `at`, relative to the bound
/// scale `Σ_t |a_it·b_jt|` of each entry, with the entry where it occurs.
pub fn worst_error(
    a: &[f32],
    b: &[f32],
    c: &[f32],
    (n, k): (usize, usize),
    at: impl IntoIterator<Item = (usize, usize)>,
) -> (f64, (usize, usize)) {
    let mut worst = (0.0, (0, 0));
    for (i, j) in at {
        let (exact, scale) = dot(a, b, k, i, j);
        let got = f64::from(c[i * n + j]);
        let e = if got.is_finite() {
            (got - exact).abs() / scale.max(f64::MIN_POSITIVE)
        } else {
            f64::INFINITY
        };
        if e > worst.0 || e.is_nan() {
            worst = (e, (i, j));
        }
    }
    worst
}

/// Entries to check in an `m x n` product: all of them up to 2^16 entries, else `samples`
/// spread over the matrix (every tile corner class included: first and last rows and
/// columns) by a fixed stride.
pub fn sample(m: usize, n: usize, samples: usize) -> Vec<(usize, usize)> {
    if m * n <= 1 << 16 {
        return (0..m).flat_map(|i| (0..n).map(move |j| (i, j))).collect();
    }
    let mut at = vec![(0, 0), (0, n - 1), (m - 1, 0), (m - 1, n - 1)];
    let step = (m * n / samples.max(1)).max(1) | 1;
    at.extend((0..samples).map(|s| {
        let f = (s * step + s * s * 7919) % (m * n);
        (f / n, f % n)
    }));
    at
}

/// Error bound of an f32 dot product of depth `k` relative to `Σ|a·b|`, with margin: the
/// accumulation error grows like √k·ε for random signs; `k·ε` is the worst case, and a wrong
/// index or a lost panel gives errors of order 1.
pub fn tolerance(k: usize) -> f64 {
    (4.0 * (k as f64).sqrt() * f64::from(f32::EPSILON)).max(1e-6)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(bf16_bits(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: even (1.0) wins.
        assert_eq!(bf16_bits(1.0 + 1.0 / 256.0), 0x3f80);
        assert_eq!(bf16_bits(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(bf16_bits(-2.0), 0xc000);
        assert!(f32::from_bits(u32::from(bf16_bits(f32::NAN)) << 16).is_nan());
    }

    #[test]
    fn bf16_operands_pack_element_2w_low() {
        let op = operand(&[1.0, -2.0, 0.5], Dtype::Bf16);
        assert_eq!(&op.bytes[..6], &[0x80, 0x3f, 0x00, 0xc0, 0x00, 0x3f]);
        assert_eq!(op.bytes.len(), 16);
        assert_eq!(op.values, vec![1.0, -2.0, 0.5]);
    }

    #[test]
    fn uniform_values_stay_in_range_and_vary() {
        let v = uniform(10_000, 3);
        assert!(v.iter().all(|x| (-1.0..1.0).contains(x)));
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.05, "{mean}");
        assert_ne!(uniform(4, 1), uniform(4, 2));
    }

    #[test]
    fn samples_stay_inside_and_include_corners() {
        let s = sample(8192, 8192, 500);
        assert!(s.iter().all(|&(i, j)| i < 8192 && j < 8192));
        assert!(s.contains(&(8191, 8191)));
        assert_eq!(sample(16, 8, 10).len(), 128);
    }
}
