//! Blocks of logits `E[rows]·Cᵀ + bias` in f32 through `matrixmultiply`'s sgemm.

/// Bytes of logits one worker holds at a time (a block of rows x all classes).
pub(crate) const BLOCK_BYTES: usize = 32 << 20;

/// Rows per block so that one block of logits (`rows x v` f32) stays within [`BLOCK_BYTES`]:
/// between 1 and `max_rows`, rounded down to a multiple of 16 when at least 16.
pub(crate) fn block_rows(v: usize, max_rows: usize) -> usize {
    let r = (BLOCK_BYTES / (4 * v.max(1))).clamp(1, max_rows.max(1));
    if r >= 16 {
        r / 16 * 16
    } else {
        r
    }
}

/// Computes `out[r * v + j] = Σ_k e[r * d + k] · c[j * d + k] (+ bias[j])` for the `m` rows of
/// `e` (f32 accumulation; `out` must hold `m * v` values, `e` `m * d`, `c` `v * d`).
pub(crate) fn logits_block(
    e: &[f32],
    m: usize,
    d: usize,
    c: &[f32],
    v: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    assert!(e.len() >= m * d && c.len() >= v * d && out.len() >= m * v);
    if m == 0 || v == 0 {
        return;
    }
    if d == 0 {
        out[..m * v].fill(0.0);
    } else {
        // SAFETY: `e` holds m x d values (row stride d, column stride 1), `c` read as the
        // d x v matrix Cᵀ holds v x d values (row stride 1, column stride d), and `out` holds
        // m x v values (row stride v, column stride 1); the assert above checks all three
        // lengths, the slices do not alias (`out` is the only mutable one), and beta = 0 so
        // the initial contents of `out` are never read.
        unsafe {
            matrixmultiply::sgemm(
                m,
                d,
                v,
                1.0,
                e.as_ptr(),
                d as isize,
                1,
                c.as_ptr(),
                1,
                d as isize,
                0.0,
                out.as_mut_ptr(),
                v as isize,
                1,
            );
        }
    }
    if let Some(b) = bias {
        for row in out[..m * v].chunks_exact_mut(v) {
            for (x, &bj) in row.iter_mut().zip(b) {
                *x += bj;
            }
        }
    }
}
