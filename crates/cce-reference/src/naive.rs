//! The naive oracle: logits materialized, MATH.md followed literally, exact (no filtering).
//!
//! Two precisions:
//! - [`Precision::F64`]: ground truth. Every input is widened exactly to f64 and every step is
//!   f64.
//! - [`Precision::SameDtype`]: what a user would otherwise run (PyTorch-style): logits computed
//!   with f32 accumulation and rounded to the input dtype, softmax and loss in f32, the logits
//!   gradient rounded to the input dtype, `d_e`/`d_c` with f32 accumulation rounded to the
//!   input dtype. The conformance rule compares a backend's error with this one's.
//!
//! Memory: `N x V` f64 logits (8·N·V bytes); meant for test sizes and the real fixture.

use cce_core::error::Result;
use cce_core::options::{Options, Reduction};
use cce_core::problem::{check_masked_targets, PreparedTargets, Problem};
use cce_core::{CceError, DType, HostTensor, TensorMeta};
use rayon::prelude::*;

/// Arithmetic of the oracle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// f64 throughout (the ground truth).
    F64,
    /// Logits and logits-gradient rounded to the input dtype, softmax in f32.
    SameDtype,
}

/// Upstream gradients for the oracle, f64.
#[derive(Clone, Debug, PartialEq)]
pub enum OracleDLoss {
    /// `∂L/∂loss` for mean/sum.
    Scalar(f64),
    /// `∂L/∂loss_i` `[N]` for `Reduction::None`.
    PerRow(Vec<f64>),
}

/// Everything the oracle computes, f64, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct Oracle {
    /// `[1]` for mean/sum, `[N]` for none.
    pub loss: Vec<f64>,
    /// Per-row loss `ℓ_i` `[N]` (0 at ignored rows).
    pub row_loss: Vec<f64>,
    /// `[N]` log-sum-exp (nats).
    pub lse: Vec<f64>,
    /// `[N]` probability of the non-target classes, `1 − p_y`, summed over `j ≠ y` (0 at
    /// ignored rows).
    pub rest_mass: Vec<f64>,
    /// `[N]` softmax entropy (nats).
    pub entropy: Vec<f64>,
    /// `[N]` argmax (lowest index on ties).
    pub argmax: Vec<i32>,
    /// `[N, D]`.
    pub d_e: Vec<f64>,
    /// `[V, D]`.
    pub d_c: Vec<f64>,
    /// `[V]` if a bias was given.
    pub d_bias: Option<Vec<f64>>,
    /// `[N]`: `Σ_j T_ij`, the size of the terms of row `i` of `d_e = G·C` (a per-row judge
    /// scales its tolerance by `Σ_j T_ij · max_j ‖c_j‖`). `T_ij ≥ |G_ij|` sums the sizes of
    /// the parts of `G_ij` an implementation adds in f32:
    /// `|g_i|·((1 + ζ_i)·p_ij + α/V) + |h_i|·p_ij`, and for the target
    /// `|g_i|·(α + (1 − p_y) + ζ_i·p_y + α/V) + |h_i|·p_y`, with the z-loss size
    /// `ζ_i = |2λ|·(|lse_i| + ‖e_i‖·max_j ‖c_j‖)` (an f32 lse errs by a rounding of the logits'
    /// scale, not of its own size, where the logits cancel) (the target's `p_y − 1` computed
    /// without cancellation, as `−(1 − p_y)`); taken before the softcap factor `1 − (z/s)²`
    /// (computed in f32 with an absolute error).
    pub g_terms_rows: Vec<f64>,
    /// `[V]`: `Σ_i T_ij` (likewise), the size of the terms of class row `j` of `d_c = Gᵀ·E`.
    pub g_terms_cols: Vec<f64>,
    /// Count of valid rows.
    pub n_valid: usize,
}

fn round_to(dtype: DType, x: f64) -> f64 {
    match dtype {
        DType::F32 => x as f32 as f64,
        DType::F16 => half::f16::from_f64(x).to_f64(),
        DType::BF16 => half::bf16::from_f64(x).to_f64(),
        _ => x,
    }
}

/// Run the oracle on host tensors.
///
/// `e` `[N, D]` (or `[..., T, D]`), `c` `[V, D]`, `bias` `[V]`, `targets` `[N]` i32/i64, as for
/// any backend. `d_loss` must be `PerRow` with `N` values for `Reduction::None`, `Scalar`
/// otherwise; `d_lse` is an optional `[N]` upstream gradient of the lse.
///
/// Errors: every validation error of [`Problem::new`] and [`PreparedTargets::new`] (among them
/// `AllTargetsIgnored` for a mean over no valid row); `TargetMasked` and `InvalidOption` from
/// [`check_masked_targets`] for a bias that masks a target (or any class under label smoothing);
/// `ShapeMismatch` for upstream gradients of the wrong form.
#[allow(clippy::too_many_arguments)]
pub fn naive(
    e: &HostTensor,
    c: &HostTensor,
    bias: Option<&HostTensor>,
    targets: &HostTensor,
    opts: &Options,
    d_loss: &OracleDLoss,
    d_lse: Option<&[f64]>,
    precision: Precision,
) -> Result<Oracle> {
    let problem = Problem::new(e, c, bias.map(|b| b as &dyn TensorMeta), targets, opts)?;
    let raw = targets.to_i64_vec().expect("validated integer targets");
    let prepared = PreparedTargets::new(&raw, &problem, opts)?;
    let n = problem.n;
    match (opts.reduction, d_loss) {
        (Reduction::None, OracleDLoss::PerRow(g)) if g.len() == n => {}
        (Reduction::Mean | Reduction::Sum, OracleDLoss::Scalar(_)) => {}
        _ => {
            return Err(CceError::ShapeMismatch {
                what: "d_loss",
                expected: "per-row [N] for reduction none, scalar otherwise".into(),
                got: format!("{d_loss:?}").chars().take(80).collect(),
            })
        }
    }
    if let Some(h) = d_lse {
        if h.len() != n {
            return Err(CceError::ShapeMismatch {
                what: "d_lse",
                expected: format!("[{n}]"),
                got: format!("[{}]", h.len()),
            });
        }
    }
    let ev = e.to_f64_vec();
    let cv = c.to_f64_vec();
    let bv = bias.map(|b| b.to_f64_vec());
    // Only the bias may hold −inf (a masked class).
    if let Some(b) = &bv {
        let any_masked = b.contains(&f64::NEG_INFINITY);
        check_masked_targets(&prepared, opts, |i| {
            let yi = prepared.classes[i] as usize;
            (b[yi] == f64::NEG_INFINITY, any_masked)
        })?;
    }
    Ok(naive_values(
        &problem,
        &ev,
        &cv,
        bv.as_deref(),
        &prepared,
        opts,
        d_loss,
        d_lse,
        precision,
    ))
}

/// The oracle on f64 values (exact widenings of the inputs), for callers that perturb inputs
/// (finite differences) or already hold f64 data. `problem` and `prepared` come from
/// [`Problem::new`] and [`PreparedTargets::new`]; `d_loss` and `d_lse` must have been checked
/// as in [`naive`] (this function does not validate). A hand-built `prepared` with no valid row
/// under `Reduction::Mean` (which [`PreparedTargets::new`] rejects) gives a NaN loss.
#[allow(clippy::too_many_arguments)]
pub fn naive_values(
    problem: &Problem,
    ev: &[f64],
    cv: &[f64],
    bv: Option<&[f64]>,
    prepared: &PreparedTargets,
    opts: &Options,
    d_loss: &OracleDLoss,
    d_lse: Option<&[f64]>,
    precision: Precision,
) -> Oracle {
    let Problem { n, d, v, dtype, .. } = *problem;
    let same = precision == Precision::SameDtype;
    let alpha = opts.label_smoothing as f64;
    let lambda = opts.z_loss as f64;
    let softcap = opts.softcap.map(|s| s as f64);
    let y = &prepared.classes;

    // Logits z [N, V]: x = e · cᵀ (+ bias), then softcap. A −inf logit (a class masked by the
    // bias) stays −inf under the softcap: masked means p = 0 with or without a cap.
    let mut z = vec![0.0f64; n * v];
    matmul(
        same,
        n,
        d,
        v,
        ev,
        Layout::RowMajor(d),
        cv,
        Layout::ColMajor(d),
        &mut z,
    );
    z.par_chunks_mut(v).for_each(|row| {
        for (j, out) in row.iter_mut().enumerate() {
            let mut x = *out;
            if let Some(b) = bv {
                x += b[j];
            }
            *out = if same { round_to(dtype, x) } else { x };
        }
    });
    // The softcap's derivative `1 − tanh²(x/s)` per entry from the uncapped `x`, for the ground
    // truth: `4w / (1 + w)²` with `w = e^{−2|x/s|}`, which never cancels (`1 − (z/s)²` does
    // once `|x/s|` is large). The same-dtype path keeps `1 − (z/s)²`, as autograd computes it.
    let mut dcap = Vec::new();
    if let Some(s) = softcap {
        if !same {
            dcap = z
                .par_iter()
                .map(|&x| {
                    let w = (-2.0 * (x / s).abs()).exp();
                    4.0 * w / ((1.0 + w) * (1.0 + w))
                })
                .collect();
        }
        z.par_iter_mut().filter(|x| x.is_finite()).for_each(|x| {
            *x = s * (*x / s).tanh();
            if same {
                *x = round_to(dtype, *x);
            }
        });
    }

    // `e^{x − m}` with a −inf logit (masked, p = 0) giving 0 also when `m` is −inf (a row whose
    // every class is masked), never NaN.
    let ex = |x: f64, m: f64| -> f64 {
        if x == f64::NEG_INFINITY {
            0.0
        } else if same {
            ((x - m) as f32).exp() as f64
        } else {
            (x - m).exp()
        }
    };

    // Per-row forward quantities: (lse, entropy, loss, argmax, rest mass).
    let fwd: Vec<(f64, f64, f64, i32, f64)> = (0..n)
        .into_par_iter()
        .map(|i| {
            let row = &z[i * v..(i + 1) * v];
            let (mut m, mut am) = (f64::NEG_INFINITY, 0i32);
            for (j, &x) in row.iter().enumerate() {
                if x > m {
                    m = x;
                    am = j as i32;
                }
            }
            let yi = y[i];
            let (mut s, mut rest) = (0.0f64, 0.0f64);
            for (j, &x) in row.iter().enumerate() {
                let w = ex(x, m);
                s += w;
                if j as i32 != yi {
                    rest += w;
                }
            }
            let rest = if yi < 0 { 0.0 } else { rest / s };
            let lse = if same {
                (m as f32 + (s as f32).ln()) as f64
            } else {
                m + s.ln()
            };
            let pz: f64 = row
                .iter()
                .filter(|x| x.is_finite())
                .map(|&x| ex(x, lse) * x)
                .sum();
            let entropy = if s > 0.0 { lse - pz } else { 0.0 };
            let loss = if yi < 0 {
                0.0
            } else {
                let zy = row[yi as usize];
                // −log p_y: exactly `−log1p(−rest)` where `lse − z_y` would cancel (p_y ≥ 1/2;
                // ground truth only, the same-dtype path subtracts as a user would).
                let ce = if rest < 0.5 && !same {
                    -(-rest).ln_1p()
                } else {
                    lse - zy
                };
                let smooth = if alpha == 0.0 {
                    0.0
                } else {
                    let zsum: f64 = row.iter().sum();
                    alpha * (zy - zsum / v as f64)
                };
                ce + smooth + lambda * lse * lse
            };
            (lse, entropy, loss, am, rest)
        })
        .collect();
    let lse: Vec<f64> = fwd.iter().map(|t| t.0).collect();
    let row_loss: Vec<f64> = fwd.iter().map(|t| t.2).collect();
    let rest_mass: Vec<f64> = fwd.iter().map(|t| t.4).collect();
    let n_valid = prepared.n_valid;
    let total: f64 = row_loss.iter().sum();
    let loss = match opts.reduction {
        Reduction::None => row_loss.clone(),
        Reduction::Sum => vec![total],
        // `PreparedTargets::new` rejects a mean over no valid row (`AllTargetsIgnored`); a
        // hand-built `prepared` that gets here has an undefined mean: NaN, never a silent 0.
        Reduction::Mean => vec![if n_valid == 0 {
            f64::NAN
        } else {
            total / n_valid as f64
        }],
    };

    // Upstream g_i.
    let g: Vec<f64> = (0..n)
        .map(|i| {
            if y[i] < 0 {
                return 0.0;
            }
            match d_loss {
                OracleDLoss::PerRow(gv) => gv[i],
                OracleDLoss::Scalar(s) => match opts.reduction {
                    Reduction::Mean => s / n_valid as f64,
                    _ => *s,
                },
            }
        })
        .collect();

    // G [N, V], overwriting z. In f64 the target entry takes `p_y = 1 − rest` and the bracket
    // `(1 + 2λ lse) p_y − (1 − α) = α − rest + 2λ lse p_y`, so a confident row does not cancel.
    // Also the term sizes (`Oracle::g_terms_rows`) per row and per class, taken before the
    // softcap factor `1 − (z/s)²`: that factor is computed in f32 with an absolute error of
    // ~2⁻²³, so an entry's error scales with its size before it, not after.
    // The scale of row i's logits, `‖e_i‖ · max_j ‖c_j‖` (≥ Σ_k |e_ik c_jk|): an f32 lse errs
    // by up to ~2⁻²⁴ of it where the logits cancel, which the z-loss term `2λ lse p` carries.
    let row_norm = |x: &[f64]| x.iter().map(|a| a * a).sum::<f64>().sqrt();
    let c_max = cv.chunks(d.max(1)).map(row_norm).fold(0.0f64, f64::max);
    let logit_scale: Vec<f64> = ev.chunks(d.max(1)).map(|r| row_norm(r) * c_max).collect();
    let mut gm = z;
    type Sums = (Vec<(usize, f64)>, Vec<f64>);
    let (mut abs_rows, g_terms_cols): Sums = gm
        .par_chunks_mut(v)
        .enumerate()
        .fold(
            || (Vec::new(), vec![0.0f64; v]),
            |(mut rows, mut cols): Sums, (i, row)| {
                let l = lse[i];
                let h = d_lse.map_or(0.0, |h| h[i]);
                let mut row_abs = 0.0f64;
                for (j, zz) in row.iter_mut().enumerate() {
                    let x = *zz;
                    let target = y[i] == j as i32;
                    let p = if target && !same {
                        1.0 - rest_mass[i]
                    } else {
                        ex(x, l)
                    };
                    let mut gij = if y[i] < 0 {
                        0.0
                    } else if target && !same {
                        g[i] * ((alpha - rest_mass[i]) + 2.0 * lambda * l * p - alpha / v as f64)
                    } else {
                        let onehot = if target { 1.0 } else { 0.0 };
                        g[i] * ((1.0 + 2.0 * lambda * l) * p
                            - (1.0 - alpha) * onehot
                            - alpha / v as f64)
                    };
                    gij += h * p;
                    // The sizes of the parts of G_ij an implementation adds in f32: for the target
                    // `α − (1 − p_y)` (never `p_y − 1`, which cancels), the z-loss and smoothing
                    // terms, the lse upstream.
                    let zl = (2.0 * lambda).abs() * (l.abs() + logit_scale[i]);
                    let term = if y[i] < 0 {
                        h.abs() * p
                    } else {
                        let core = if target {
                            alpha + rest_mass[i] + zl * p
                        } else {
                            (1.0 + zl) * p
                        };
                        g[i].abs() * (core + alpha / v as f64) + h.abs() * p
                    };
                    row_abs += term;
                    cols[j] += term;
                    if let Some(s) = softcap {
                        gij *= if !same {
                            dcap[i * v + j]
                        } else if x == f64::NEG_INFINITY {
                            0.0
                        } else {
                            1.0 - (x / s) * (x / s)
                        };
                    }
                    *zz = if same { round_to(dtype, gij) } else { gij };
                }
                rows.push((i, row_abs));
                (rows, cols)
            },
        )
        .reduce(
            || (Vec::new(), vec![0.0f64; v]),
            |(mut ra, mut ca), (rb, cb)| {
                ra.extend(rb);
                ca.iter_mut().zip(cb).for_each(|(a, b)| *a += b);
                (ra, ca)
            },
        );
    abs_rows.sort_unstable_by_key(|r| r.0);
    let g_terms_rows: Vec<f64> = abs_rows.into_iter().map(|r| r.1).collect();

    let out_round = |x: f64| if same { round_to(dtype, x) } else { x };
    // d_e = G · C  [N, V] x [V, D].
    let mut d_e = vec![0.0; n * d];
    matmul(
        same,
        n,
        v,
        d,
        &gm,
        Layout::RowMajor(v),
        cv,
        Layout::RowMajor(d),
        &mut d_e,
    );
    // d_c = Gᵀ · E  [V, N] x [N, D].
    let mut d_c = vec![0.0; v * d];
    matmul(
        same,
        v,
        n,
        d,
        &gm,
        Layout::ColMajor(v),
        ev,
        Layout::RowMajor(d),
        &mut d_c,
    );
    d_e.iter_mut()
        .chain(d_c.iter_mut())
        .for_each(|x| *x = out_round(*x));
    let d_bias_raw: Vec<f64> = (0..v)
        .into_par_iter()
        .map(|j| {
            let sb: f64 = if same {
                (0..n).map(|i| gm[i * v + j] as f32).sum::<f32>() as f64
            } else {
                (0..n).map(|i| gm[i * v + j]).sum()
            };
            out_round(sb)
        })
        .collect();
    Oracle {
        g_terms_rows,
        g_terms_cols,
        loss,
        row_loss,
        lse,
        rest_mass,
        entropy: fwd.iter().map(|t| t.1).collect(),
        argmax: fwd.iter().map(|t| t.3).collect(),
        d_e,
        d_c,
        d_bias: bv.map(|_| d_bias_raw),
        n_valid,
    }
}

/// Memory layout of a GEMM operand with `m` rows: `RowMajor(ld)` stores row `r` at `r·ld`,
/// `ColMajor(ld)` stores element `(r, k)` at `k·ld + r` (a transposed row-major matrix).
#[derive(Clone, Copy)]
enum Layout {
    RowMajor(usize),
    ColMajor(usize),
}

impl Layout {
    /// (row stride, column stride) in elements.
    fn strides(self) -> (isize, isize) {
        match self {
            Layout::RowMajor(ld) => (ld as isize, 1),
            Layout::ColMajor(ld) => (1, ld as isize),
        }
    }
}

/// `out [m, n] = a [m, k] · b [k, n]`, `out` row-major. f64 arithmetic, or f32 operands with
/// f32 accumulation when `f32_acc`. Rows of `out` are split over threads.
#[allow(clippy::too_many_arguments)]
fn matmul(
    f32_acc: bool,
    m: usize,
    k: usize,
    n: usize,
    a: &[f64],
    la: Layout,
    b: &[f64],
    lb: Layout,
    out: &mut [f64],
) {
    const ROWS: usize = 64;
    debug_assert_eq!(out.len(), m * n);
    let (rsa, csa) = la.strides();
    let (rsb, csb) = lb.strides();
    let a32: Vec<f32> = if f32_acc {
        a.iter().map(|&x| x as f32).collect()
    } else {
        Vec::new()
    };
    let b32: Vec<f32> = if f32_acc {
        b.iter().map(|&x| x as f32).collect()
    } else {
        Vec::new()
    };
    out.par_chunks_mut(ROWS * n)
        .enumerate()
        .for_each(|(blk, o)| {
            let r0 = blk * ROWS;
            let rows = o.len() / n;
            let a_off = r0 as isize * rsa;
            if f32_acc {
                let mut o32 = vec![0.0f32; rows * n];
                // SAFETY: a32 holds m x k elements reachable with strides (rsa, csa) from offset
                // a_off for `rows` rows; b32 holds k x n with (rsb, csb); o32 is rows x n row-major.
                unsafe {
                    matrixmultiply::sgemm(
                        rows,
                        k,
                        n,
                        1.0,
                        a32.as_ptr().offset(a_off),
                        rsa,
                        csa,
                        b32.as_ptr(),
                        rsb,
                        csb,
                        0.0,
                        o32.as_mut_ptr(),
                        n as isize,
                        1,
                    );
                }
                o.iter_mut().zip(&o32).for_each(|(x, y)| *x = *y as f64);
            } else {
                // SAFETY: as above, with the f64 operands and `o` (rows x n, row-major).
                unsafe {
                    matrixmultiply::dgemm(
                        rows,
                        k,
                        n,
                        1.0,
                        a.as_ptr().offset(a_off),
                        rsa,
                        csa,
                        b.as_ptr(),
                        rsb,
                        csb,
                        0.0,
                        o.as_mut_ptr(),
                        n as isize,
                        1,
                    );
                }
            }
        });
}
