//! Shape and dtype validation, and target preparation (shift, ignore_index, range check).

use crate::dtype::DType;
use crate::error::{CceError, Result};
use crate::options::{Options, Reduction};
use crate::tensor::TensorMeta;

/// Sizes and dtype of a validated call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Problem {
    /// Rows (tokens): product of `e`'s leading dimensions.
    pub n: usize,
    /// Hidden size.
    pub d: usize,
    /// Vocabulary size (classes).
    pub v: usize,
    /// dtype of `e`, `c` and `bias`.
    pub dtype: DType,
    /// Whether a bias `[V]` is given.
    pub has_bias: bool,
    /// Rows per sequence (for `shift`): `Options::seq_len`, or `T` when `e` is `[B, T, D]`, or `N`.
    pub seq_len: usize,
}

impl Problem {
    /// Validate shapes and dtypes of the inputs and the options.
    ///
    /// `e`: `[N, D]` or `[..., T, D]`; `c`: `[V, D]`; `bias`: `[V]`; `targets`: `[N]` or the
    /// leading dims of `e`, i32 or i64. `e`, `c`, `bias` share a float dtype.
    ///
    /// Errors: `EmptyInput` (a zero-sized dimension), `ShapeMismatch`, `DTypeMismatch`,
    /// `InvalidOption`, `ResourceLimit` (N or V ≥ 2³¹: targets and indices are 32-bit on devices).
    pub fn new(
        e: &dyn TensorMeta,
        c: &dyn TensorMeta,
        bias: Option<&dyn TensorMeta>,
        targets: &dyn TensorMeta,
        opts: &Options,
    ) -> Result<Self> {
        opts.validate()?;
        let es = e.shape();
        let cs = c.shape();
        if es.len() < 2 {
            return Err(CceError::ShapeMismatch {
                what: "e",
                expected: "[N, D] or [..., T, D]".into(),
                got: format!("{es:?}"),
            });
        }
        if cs.len() != 2 {
            return Err(CceError::ShapeMismatch {
                what: "c",
                expected: "[V, D]".into(),
                got: format!("{cs:?}"),
            });
        }
        for (what, s) in [("e", es), ("c", cs), ("targets", targets.shape())] {
            // A scalar `targets` (shape `[]`, one element) is a `ShapeMismatch` below.
            if s.contains(&0) {
                return Err(CceError::EmptyInput {
                    what,
                    shape: s.to_vec(),
                });
            }
        }
        let d = es[es.len() - 1];
        let n = crate::tensor::checked_numel(&es[..es.len() - 1])?;
        let v = cs[0];
        if cs[1] != d {
            return Err(CceError::ShapeMismatch {
                what: "c (hidden size D)",
                expected: format!("[V, {d}] (D of e)"),
                got: format!("{cs:?}"),
            });
        }
        let dtype = e.dtype();
        if !dtype.is_float() {
            return Err(CceError::DTypeMismatch {
                what: "e",
                expected: "f32, f16 or bf16".into(),
                got: dtype,
            });
        }
        if c.dtype() != dtype {
            return Err(CceError::DTypeMismatch {
                what: "c",
                expected: format!("{dtype} (the dtype of e)"),
                got: c.dtype(),
            });
        }
        if let Some(b) = bias {
            if b.shape() != [v] {
                return Err(CceError::ShapeMismatch {
                    what: "bias",
                    expected: format!("[{v}]"),
                    got: format!("{:?}", b.shape()),
                });
            }
            if b.dtype() != dtype {
                return Err(CceError::DTypeMismatch {
                    what: "bias",
                    expected: format!("{dtype} (the dtype of e)"),
                    got: b.dtype(),
                });
            }
        }
        let ts = targets.shape();
        if !(ts == [n] || ts == &es[..es.len() - 1]) {
            let lead = &es[..es.len() - 1];
            return Err(CceError::ShapeMismatch {
                what: "targets",
                expected: if lead.len() == 1 {
                    format!("[{n}]")
                } else {
                    format!("[{n}] or {lead:?}")
                },
                got: format!("{ts:?}"),
            });
        }
        if !matches!(targets.dtype(), DType::I32 | DType::I64) {
            return Err(CceError::DTypeMismatch {
                what: "targets",
                expected: "i32 or i64".into(),
                got: targets.dtype(),
            });
        }
        check_index_limits(n, v)?;
        let seq_len = match (opts.seq_len, es.len()) {
            (Some(t), _) => t,
            (None, k) if k >= 3 => es[k - 2],
            (None, _) => n,
        };
        if !n.is_multiple_of(seq_len) {
            return Err(CceError::InvalidOption {
                name: "seq_len",
                reason: format!("N = {n} is not a multiple of seq_len = {seq_len}"),
            });
        }
        Ok(Self {
            n,
            d,
            v,
            dtype,
            has_bias: bias.is_some(),
            seq_len,
        })
    }

    /// FLOP of one logits GEMM, `2·N·V·D`.
    pub fn gemm_flop(&self) -> f64 {
        2.0 * self.n as f64 * self.v as f64 * self.d as f64
    }
}

/// The largest `N` and `V` a call accepts: row and class indices are 32-bit signed on devices.
pub const MAX_ROWS_OR_CLASSES: usize = i32::MAX as usize;

/// `ResourceLimit` when `n` rows or `v` classes exceed [`MAX_ROWS_OR_CLASSES`]: the check of
/// [`Problem::new`], for callers (a CLI generating data) that want it before building any
/// tensor.
pub fn check_index_limits(n: usize, v: usize) -> Result<()> {
    for (what, size) in [("rows N", n), ("vocabulary V", v)] {
        if size > MAX_ROWS_OR_CLASSES {
            return Err(CceError::ResourceLimit {
                resource: format!("{what} (32-bit row/class indices)"),
                requested: size as u64,
                max: MAX_ROWS_OR_CLASSES as u64,
            });
        }
    }
    Ok(())
}

/// Targets after shift and validation: one class index per row of `e`, `-1` for ignored rows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreparedTargets {
    /// `[N]` class of each row in `[0, V)`, or `-1` (ignored: by `ignore_index` or by shift).
    pub classes: Vec<i32>,
    /// Count of rows with a class.
    pub n_valid: usize,
}

impl PreparedTargets {
    /// Apply `shift` (row `(b, t)` takes target `(b, t + shift)`, the last `shift` rows of each
    /// sequence are ignored) and check every used target is in `[0, V)` or `ignore_index`.
    ///
    /// `raw`: `[N]` targets as given. Errors: `ShapeMismatch` if `raw.len() != N`;
    /// `TargetOutOfRange` naming the first bad row (the row in `raw`) and value;
    /// `AllTargetsIgnored` when no row is left with a target (every target is `ignore_index`,
    /// or `shift` is at least the sequence length) under `Reduction::Mean`, whose mean over zero
    /// rows is undefined. `Reduction::Sum` and `Reduction::None` accept such a batch
    /// (`n_valid == 0`: loss 0 or per-row zeros).
    ///
    /// Every backend prepares its targets here in both `forward` and `backward` before any
    /// device work, so this is the one place the all-ignored rule is enforced.
    pub fn new(raw: &[i64], problem: &Problem, opts: &Options) -> Result<Self> {
        if raw.len() != problem.n {
            return Err(CceError::ShapeMismatch {
                what: "targets",
                expected: format!("[{}]", problem.n),
                got: format!("[{}]", raw.len()),
            });
        }
        // Every target is checked, also those a shift drops: a bad value is a bug upstream.
        for (row, &value) in raw.iter().enumerate() {
            if value != opts.ignore_index && !(0..problem.v as i64).contains(&value) {
                return Err(CceError::TargetOutOfRange {
                    row,
                    value,
                    vocab_size: problem.v,
                    ignore_index: opts.ignore_index,
                });
            }
        }
        let t = problem.seq_len;
        let s = opts.shift;
        let mut n_valid = 0;
        let classes = (0..problem.n)
            .map(|i| {
                let pos = i % t;
                // `s >= t - pos` rather than `pos + s >= t`: no overflow for any shift.
                if s >= t - pos {
                    return -1;
                }
                let y = raw[i + s];
                if y == opts.ignore_index {
                    -1
                } else {
                    n_valid += 1;
                    y as i32
                }
            })
            .collect();
        if n_valid == 0 && opts.reduction == Reduction::Mean {
            return Err(CceError::all_targets_ignored(problem.n, opts));
        }
        Ok(Self { classes, n_valid })
    }

    /// Same as [`PreparedTargets::new`] for i32 targets (same errors).
    pub fn from_i32(raw: &[i32], problem: &Problem, opts: &Options) -> Result<Self> {
        let wide: Vec<i64> = raw.iter().map(|&x| x as i64).collect();
        Self::new(&wide, problem, opts)
    }
}

/// Checks an upstream gradient of the backward for NaN and infinities: `what` is `"d_loss"`
/// (the scalar of a mean/sum reduction, as one value, or the `[N]` per-row values of
/// `Reduction::None`) or `"d_lse"` (`[N]`).
///
/// Errors: `NonFinite { what, index, row, value }` naming the first non-finite value (`index`
/// and `row` are its row; 0 for a scalar). Every backend calls this before any work: a
/// non-finite scalar always, per-row values when `Options::check_finite` is on (the wgpu
/// backend applies the same rule on the device, in the pass that reads them, and reports it
/// after its passes).
pub fn check_upstream_finite(
    what: &'static str,
    values: impl IntoIterator<Item = f32>,
) -> Result<()> {
    match first_non_finite(values) {
        Some((index, value)) => Err(CceError::NonFinite {
            what,
            index,
            row: index,
            value,
        }),
        None => Ok(()),
    }
}

/// `g_i`, the upstream gradient of each row's loss (MATH.md "Backward"): 0 at a row without a
/// target (`classes[i] < 0`: ignored or shifted out), else `d_loss(i)` (the row's own
/// `∂L/∂loss_i` for reduction none, the weight of [`scalar_loss_grad`] for mean and sum).
/// One value per entry of `classes` (`N`).
pub fn loss_grad_rows(classes: &[i32], d_loss: impl Fn(usize) -> f32) -> Vec<f32> {
    classes
        .iter()
        .enumerate()
        .map(|(i, &y)| if y < 0 { 0.0 } else { d_loss(i) })
        .collect()
}

/// Each valid row's weight from the upstream scalar `s` of a mean or sum: `s / n_valid` for a
/// mean over `n_valid > 0` valid rows, else `s` (a sum, or a mean without a valid row, whose
/// rows all get 0 from [`loss_grad_rows`] anyway).
pub fn scalar_loss_grad(reduction: Reduction, s: f32, n_valid: usize) -> f32 {
    if reduction == Reduction::Mean && n_valid > 0 {
        s / n_valid as f32
    } else {
        s
    }
}

/// The `ShapeMismatch` of a `d_loss` that does not fit `reduction` over `n` rows (per-row
/// `[N]` f32 for reduction none, a scalar otherwise); `got` says what was given.
pub fn d_loss_mismatch(n: usize, reduction: Reduction, got: &str) -> CceError {
    CceError::ShapeMismatch {
        what: "d_loss",
        expected: format!("per-row [{n}] f32 for reduction none, a scalar otherwise"),
        got: format!("{got} with reduction {reduction:?}"),
    }
}

/// The `ShapeMismatch` of a `d_lse` of shape `shape` where `[n]` was expected.
pub fn d_lse_mismatch(n: usize, shape: &[usize]) -> CceError {
    CceError::ShapeMismatch {
        what: "d_lse",
        expected: format!("[{n}]"),
        got: format!("{shape:?}"),
    }
}

/// Checks the saved state of a forward ([`crate::Saved`]) that a backward reads, under
/// `Options::check_finite`: `lse` may be −inf only at an ignored row (one whose every class is
/// masked), never NaN or +inf; `rest_mass` (`1 − p_y`, 0 at ignored rows) is finite at every
/// row. A forward of the same inputs never saves anything else, so a value outside this is a
/// doctored or stale `Saved`, which would turn every gradient of its row into NaN or inf.
///
/// `classes`: the prepared targets ([`PreparedTargets::classes`], `-1` at ignored rows); all
/// three slices have `N` values.
///
/// Errors: `NonFinite { what: "lse" | "rest_mass", index, row, value }` naming the first bad
/// row (`lse` checked first).
pub fn check_saved_finite(lse: &[f32], rest_mass: &[f32], classes: &[i32]) -> Result<()> {
    let bad_lse = lse.iter().zip(classes).position(|(&x, &y)| {
        x.is_nan() || x == f32::INFINITY || (x == f32::NEG_INFINITY && y >= 0)
    });
    let bad = bad_lse
        .map(|i| ("lse", i, lse[i]))
        .or_else(|| first_non_finite(rest_mass.iter().copied()).map(|(i, x)| ("rest_mass", i, x)));
    match bad {
        Some((what, index, value)) => Err(CceError::NonFinite {
            what,
            index,
            row: index,
            value,
        }),
        None => Ok(()),
    }
}

/// The rule for masked classes (a −inf logit, e.g. from a −inf `bias` entry, means `p = 0`),
/// checked per valid row. `row_of(i)` tells whether row `i`'s target logit is −inf and
/// whether any logit of the row is.
///
/// Errors: `TargetMasked` for the first valid row whose target is masked (a row whose every
/// class is masked is one): its loss would be infinite. With `label_smoothing > 0`,
/// `InvalidOption` for the first valid row with any masked class: the smoothing puts `α/V` on
/// every class, masked ones too, so that loss would be infinite as well. Ignored rows may have
/// any mask.
pub fn check_masked_targets(
    targets: &PreparedTargets,
    opts: &Options,
    row_of: impl Fn(usize) -> (bool, bool),
) -> Result<()> {
    for (i, &yi) in targets.classes.iter().enumerate() {
        if yi < 0 {
            continue;
        }
        let (target_masked, any_masked) = row_of(i);
        if target_masked {
            return Err(CceError::TargetMasked {
                row: i,
                target: yi as i64,
            });
        }
        if any_masked && opts.label_smoothing > 0.0 {
            return Err(CceError::InvalidOption {
                name: "label_smoothing",
                reason: format!(
                    "row {i} has a class masked by a -inf logit; label smoothing {} puts \
                     {}/V on every class, masked ones too, so the loss would be infinite",
                    opts.label_smoothing, opts.label_smoothing
                ),
            });
        }
    }
    Ok(())
}

/// The first input value `check_finite` rejects: a NaN or ±inf in `e` or `c` (`[rows, d]`
/// row-major, f32 values), a NaN or +inf in `bias` (`[V]`; a −inf entry masks its class, see
/// [`check_masked_targets`]).
///
/// Returns `NonFinite { what: "e" | "c" | "bias", index, row, value }` with `index` the flat
/// index and `row` its row (`index / d` for `e` and `c`), or `None` when every value passes.
pub fn non_finite_input(e: &[f32], c: &[f32], bias: Option<&[f32]>, d: usize) -> Option<CceError> {
    let scan = |what: &'static str, vals: &[f32], width: usize| {
        first_non_finite(vals.iter().copied()).map(|(index, value)| CceError::NonFinite {
            what,
            index,
            row: index / width.max(1),
            value,
        })
    };
    scan("e", e, d).or_else(|| scan("c", c, d)).or_else(|| {
        let (index, value) = first_bad_bias(bias?.iter().copied())?;
        Some(CceError::NonFinite {
            what: "bias",
            index,
            row: index,
            value,
        })
    })
}

/// The error for a non-finite lse or gradient found after the work, under `check_finite`:
/// the first rejected input ([`non_finite_input`]) when there is one (it caused the NaN or
/// inf), else `NonFinite { what: "lse or gradients (overflow)", index: row, row, value: inf }`
/// (finite inputs whose result overflows f32, e.g. a `z_loss` near `f32::MAX`). `row` is the
/// row the caller found (0 when it does not know one).
pub fn locate_non_finite(
    e: &[f32],
    c: &[f32],
    bias: Option<&[f32]>,
    d: usize,
    row: usize,
) -> CceError {
    non_finite_input(e, c, bias, d).unwrap_or(CceError::NonFinite {
        what: "lse or gradients (overflow)",
        index: row,
        row,
        value: f32::INFINITY,
    })
}

/// First value of a bias that `check_finite` rejects, as `(index, value)`: a NaN or +inf
/// (a −inf entry masks its class, see [`check_masked_targets`]).
pub fn first_bad_bias(values: impl IntoIterator<Item = f32>) -> Option<(usize, f32)> {
    values
        .into_iter()
        .enumerate()
        .find(|(_, x)| x.is_nan() || *x == f32::INFINITY)
}

/// First non-finite value of a slice, as `(index, value)`.
pub fn first_non_finite(values: impl IntoIterator<Item = f32>) -> Option<(usize, f32)> {
    values.into_iter().enumerate().find(|(_, x)| !x.is_finite())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::HostTensor;

    fn t(shape: &[usize], dt: DType) -> HostTensor {
        let n: usize = shape.iter().product();
        HostTensor::from_f32(shape.to_vec(), &vec![0.5; n], dt).unwrap()
    }

    #[test]
    fn three_dim_e_sets_seq_len() {
        let e = t(&[2, 5, 3], DType::F32);
        let c = t(&[7, 3], DType::F32);
        let y = HostTensor::from_i64(vec![1; 10]);
        let p = Problem::new(&e, &c, None, &y, &Options::default()).unwrap();
        assert_eq!((p.n, p.d, p.v, p.seq_len), (10, 3, 7, 5));
    }

    #[test]
    fn shift_pairs_rows_with_later_targets() {
        let e = t(&[6, 2], DType::F32);
        let c = t(&[9, 2], DType::F32);
        let y = HostTensor::from_i64(vec![0; 6]);
        let opts = Options {
            shift: 1,
            seq_len: Some(3),
            ..Default::default()
        };
        let p = Problem::new(&e, &c, None, &y, &opts).unwrap();
        let pt = PreparedTargets::new(&[1, 2, 3, 4, -100, 6], &p, &opts).unwrap();
        assert_eq!(pt.classes, vec![2, 3, -1, -1, 6, -1]);
        assert_eq!(pt.n_valid, 3);
    }

    #[test]
    fn a_huge_shift_ignores_every_row() {
        let e = t(&[6, 2], DType::F32);
        let c = t(&[9, 2], DType::F32);
        let y = HostTensor::from_i64(vec![0; 6]);
        for reduction in [Reduction::Sum, Reduction::None] {
            for seq_len in [None, Some(3)] {
                let opts = Options {
                    shift: usize::MAX,
                    seq_len,
                    reduction,
                    ..Default::default()
                };
                let p = Problem::new(&e, &c, None, &y, &opts).unwrap();
                let pt = PreparedTargets::new(&[1, 2, 3, 4, 5, 6], &p, &opts).unwrap();
                assert_eq!(pt.classes, vec![-1; 6]);
                assert_eq!(pt.n_valid, 0);
            }
        }
    }

    /// A 6-row problem (V = 9) under `opts`.
    fn six_rows(opts: &Options) -> Problem {
        let e = t(&[6, 2], DType::F32);
        let c = t(&[9, 2], DType::F32);
        let y = HostTensor::from_i64(vec![0; 6]);
        Problem::new(&e, &c, None, &y, opts).unwrap()
    }

    #[test]
    fn mean_with_every_target_ignored_is_an_error() {
        for ignore_index in [-100, -1, 4] {
            let opts = Options {
                ignore_index,
                ..Default::default()
            };
            assert_eq!(opts.reduction, Reduction::Mean);
            let p = six_rows(&opts);
            let raw = vec![ignore_index; 6];
            let wide = PreparedTargets::new(&raw, &p, &opts);
            let narrow = PreparedTargets::from_i32(&[ignore_index as i32; 6], &p, &opts);
            for r in [wide, narrow] {
                match r {
                    Err(CceError::AllTargetsIgnored {
                        n: 6,
                        ignore_index: ii,
                        shift: 0,
                    }) if ii == ignore_index => {}
                    other => panic!("ignore_index {ignore_index}: {other:?}"),
                }
            }
        }
        // One valid row is enough.
        let opts = Options::default();
        let pt = PreparedTargets::new(&[-100, -100, 3, -100, -100, -100], &six_rows(&opts), &opts)
            .unwrap();
        assert_eq!(pt.n_valid, 1);
        assert_eq!(pt.classes, vec![-1, -1, 3, -1, -1, -1]);
    }

    #[test]
    fn mean_with_a_shift_past_the_sequence_is_an_error() {
        // shift = seq_len drops every row exactly; larger shifts (usize::MAX) too.
        for (shift, seq_len) in [(3, Some(3)), (6, None), (7, Some(3)), (usize::MAX, None)] {
            let opts = Options {
                shift,
                seq_len,
                ..Default::default()
            };
            let p = six_rows(&opts);
            for r in [
                PreparedTargets::new(&[1, 2, 3, 4, 5, 6], &p, &opts),
                PreparedTargets::from_i32(&[1, 2, 3, 4, 5, 6], &p, &opts),
            ] {
                match r {
                    Err(CceError::AllTargetsIgnored {
                        n: 6,
                        ignore_index: -100,
                        shift: s,
                    }) if s == shift => {}
                    other => panic!("shift {shift} seq_len {seq_len:?}: {other:?}"),
                }
            }
        }
        // shift = seq_len - 1 keeps one row per sequence.
        let opts = Options {
            shift: 2,
            seq_len: Some(3),
            ..Default::default()
        };
        let pt = PreparedTargets::new(&[1, 2, 3, 4, 5, 6], &six_rows(&opts), &opts).unwrap();
        assert_eq!(pt.classes, vec![3, -1, -1, 6, -1, -1]);
        assert_eq!(pt.n_valid, 2);
    }

    #[test]
    fn sum_and_none_accept_a_batch_with_no_target() {
        for reduction in [Reduction::Sum, Reduction::None] {
            for (shift, raw) in [(0, [-100i64; 6]), (6, [1, 2, 3, 4, 5, 6])] {
                let opts = Options {
                    reduction,
                    shift,
                    ..Default::default()
                };
                let p = six_rows(&opts);
                let pt = PreparedTargets::new(&raw, &p, &opts)
                    .unwrap_or_else(|e| panic!("{reduction:?} shift {shift}: {e}"));
                assert_eq!(pt.n_valid, 0);
                assert_eq!(pt.classes, vec![-1; 6]);
                let raw32: Vec<i32> = raw.iter().map(|&x| x as i32).collect();
                let pt32 = PreparedTargets::from_i32(&raw32, &p, &opts).unwrap();
                assert_eq!(pt32, pt);
            }
        }
    }

    #[test]
    fn a_bad_target_is_named_before_all_ignored() {
        // Every row dropped by the shift, but one dropped target is out of range: that error
        // comes first (a bad value is a bug upstream).
        let opts = Options {
            shift: 6,
            ..Default::default()
        };
        let r = PreparedTargets::new(&[1, 2, 3, 9, 5, 6], &six_rows(&opts), &opts);
        assert!(
            matches!(
                r,
                Err(CceError::TargetOutOfRange {
                    row: 3,
                    value: 9,
                    ..
                })
            ),
            "{r:?}"
        );
    }

    #[test]
    fn all_targets_ignored_message_names_the_batch_and_the_way_out() {
        let opts = Options {
            ignore_index: -1,
            shift: 2,
            ..Default::default()
        };
        let msg = CceError::all_targets_ignored(6, &opts).to_string();
        for needle in [
            "all targets ignored",
            "none of the 6 rows has a target",
            "ignore_index -1",
            "shift 2",
            "mean over valid rows is undefined",
            "reduction = sum",
            "none",
        ] {
            assert!(msg.contains(needle), "{needle:?} not in {msg:?}");
        }
    }

    #[test]
    fn scalar_targets_are_a_shape_mismatch_not_an_empty_input() {
        // A scalar has one element and no zero-sized dimension: naming it "empty" misleads.
        let e = t(&[1, 3], DType::F32);
        let c = t(&[7, 3], DType::F32);
        let y = HostTensor::new(vec![], crate::tensor::HostData::I64(vec![2])).unwrap();
        match Problem::new(&e, &c, None, &y, &Options::default()) {
            Err(CceError::ShapeMismatch {
                what: "targets",
                ref expected,
                ref got,
            }) if expected == "[1]" && got == "[]" => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn saved_state_checks_name_the_first_bad_row() {
        let classes = [2, -1, 0];
        assert!(
            check_saved_finite(&[1.0, f32::NEG_INFINITY, 3.0], &[0.5, 0.0, 0.1], &classes).is_ok()
        );
        let cases: [(&[f32], &[f32], &str, usize); 5] = [
            (&[1.0, 2.0, f32::NAN], &[0.5, 0.0, 0.1], "lse", 2),
            (&[f32::INFINITY, 2.0, 3.0], &[0.5, 0.0, 0.1], "lse", 0),
            (&[f32::NEG_INFINITY, 2.0, 3.0], &[0.5, 0.0, 0.1], "lse", 0),
            (&[1.0, 2.0, 3.0], &[0.5, f32::NAN, 0.1], "rest_mass", 1),
            (&[1.0, 2.0, 3.0], &[0.5, 0.0, f32::INFINITY], "rest_mass", 2),
        ];
        for (lse, rest, what, row) in cases {
            match check_saved_finite(lse, rest, &classes) {
                Err(CceError::NonFinite {
                    what: w, row: r, ..
                }) if w == what && r == row => {}
                other => panic!("{lse:?} {rest:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn out_of_range_names_row_and_value() {
        let e = t(&[3, 2], DType::F32);
        let c = t(&[4, 2], DType::F32);
        let y = HostTensor::from_i64(vec![0; 3]);
        let o = Options::default();
        let p = Problem::new(&e, &c, None, &y, &o).unwrap();
        match PreparedTargets::new(&[0, 4, 1], &p, &o) {
            Err(CceError::TargetOutOfRange {
                row: 1,
                value: 4,
                vocab_size: 4,
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            PreparedTargets::new(&[0, -1, 1], &p, &o),
            Err(CceError::TargetOutOfRange {
                row: 1,
                value: -1,
                ..
            })
        ));
    }

    #[test]
    fn loss_grad_rows_are_zero_at_rows_without_a_target() {
        let classes = [2, -1, 0, -1];
        assert_eq!(
            loss_grad_rows(&classes, |i| i as f32 + 1.0),
            vec![1.0, 0.0, 3.0, 0.0]
        );
        let s = scalar_loss_grad(Reduction::Mean, 3.0, 2);
        assert_eq!(s, 1.5);
        assert_eq!(scalar_loss_grad(Reduction::Sum, 3.0, 2), 3.0);
        assert_eq!(scalar_loss_grad(Reduction::Mean, 3.0, 0), 3.0);
        assert_eq!(loss_grad_rows(&classes, |_| s), vec![1.5, 0.0, 1.5, 0.0]);
    }
}
