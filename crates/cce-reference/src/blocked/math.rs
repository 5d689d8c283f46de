//! The arithmetic kernels of the CPU backend: the two GEMMs (f64 logits, f32 products) and
//! the softcap and its derivative. Plain functions on slices; the blocked passes call them per
//! tile.

/// `out[m, n] = a[m, k] · b[n, k]ᵀ`, f64, row-major `a`, `b` and `out`.
pub(crate) fn dgemm(m: usize, k: usize, n: usize, a: &[f64], b: &[f64], out: &mut [f64]) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(a.len() >= m * k && b.len() >= n * k && out.len() >= m * n);
    // SAFETY: the assert bounds every element addressed: a (m x k, strides (k, 1)),
    // b read as k x n with strides (1, k), out (m x n, strides (n, 1)).
    unsafe {
        matrixmultiply::dgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            k as isize,
            1,
            b.as_ptr(),
            1,
            k as isize,
            0.0,
            out.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

/// `out[m, n] (+)= a[m, k] · b[k, n]` with explicit strides, f32.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgemm(
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    (rsa, csa): (usize, usize),
    b: &[f32],
    (rsb, csb): (usize, usize),
    beta: f32,
    out: &mut [f32],
    rso: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(a.len() > (m - 1) * rsa + (k.max(1) - 1) * csa || k == 0);
    assert!(b.len() > (k.max(1) - 1) * rsb + (n - 1) * csb || k == 0);
    assert!(out.len() >= (m - 1) * rso + n);
    // SAFETY: the asserts above bound every element the strided operands address:
    // a: (m-1)·rsa + (k-1)·csa, b: (k-1)·rsb + (n-1)·csb, out: (m-1)·rso + (n-1).
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            rsa as isize,
            csa as isize,
            b.as_ptr(),
            rsb as isize,
            csb as isize,
            beta,
            out.as_mut_ptr(),
            rso as isize,
            1,
        );
    }
}

/// `z = s·tanh(x/s)`. Only finite logits are capped: one that overflowed f32 stays infinite,
/// so the lse check reports the overflow (capped, it would be a silent ±s), and a −inf
/// (masked) logit stays masked.
pub(crate) fn cap(x: f32, s: f32) -> f32 {
    if x.is_finite() {
        s * (x / s).tanh()
    } else {
        x
    }
}

/// `dz/dx = 1 − tanh²(x/s)` as `4w/(1 + w)²`, `w = e^{−2|x/s|}` (f64): `1 − (z/s)²` would
/// cancel once `|x/s|` is large (small caps); this keeps full relative accuracy. 0 at a −inf
/// logit.
pub(crate) fn dcap(x: f32, s: f32) -> f32 {
    let w = (-2.0 * (x as f64 / s as f64).abs()).exp();
    (4.0 * w / ((1.0 + w) * (1.0 + w))) as f32
}
