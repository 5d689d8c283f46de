//! Bad input: one case per typed error, each a candle `Error::Wrapped` carrying our message
//! verbatim (never a panic).

mod common;

use candle_core::{DType, Device, Error, Result, Tensor, Var};
use cce_candle::{
    linear_cross_entropy, linear_cross_entropy_with_bias, CceCandleError, CceError, LceOptions,
    Reduction,
};
use common::{targets, values};

const N: usize = 6;
const D: usize = 4;
const V: usize = 9;

fn e() -> Tensor {
    Tensor::from_vec(values(N * D, 1, 1.0), (N, D), &Device::Cpu).unwrap()
}
fn c() -> Tensor {
    Tensor::from_vec(values(V * D, 2, 1.0), (V, D), &Device::Cpu).unwrap()
}
fn t(v: Vec<i64>) -> Tensor {
    let n = v.len();
    Tensor::from_vec(v, n, &Device::Cpu).unwrap()
}
fn good_t() -> Tensor {
    t(targets(N, V, 3, 0, -100))
}

/// The error is ours, wrapped (under a backtrace when RUST_BACKTRACE is set), with `want`'s
/// message.
fn assert_ours<T: std::fmt::Debug>(r: Result<T>, want: impl std::fmt::Display) {
    let err = r.expect_err("expected an error");
    let mut inner = &err;
    while let Error::WithBacktrace { inner: i, .. } = inner {
        inner = i;
    }
    assert!(matches!(inner, Error::Wrapped(_)), "not wrapped: {err:?}");
    assert_eq!(inner.to_string(), want.to_string());
}

fn cce(e: CceError) -> CceCandleError {
    CceCandleError::Cce(e)
}

#[test]
fn shape_mismatch() {
    let c5 = Tensor::zeros((V, D + 1), DType::F32, &Device::Cpu).unwrap();
    assert_ours(
        linear_cross_entropy(&e(), &c5, &good_t(), &LceOptions::default()),
        cce(CceError::ShapeMismatch {
            what: "c (hidden size D)",
            expected: format!("[V, {D}] (D of e)"),
            got: format!("{:?}", [V, D + 1]),
        }),
    );
    let short = t(vec![1, 2, 3]);
    assert_ours(
        linear_cross_entropy(&e(), &c(), &short, &LceOptions::default()),
        cce(CceError::ShapeMismatch {
            what: "targets",
            expected: format!("[{N}]"),
            got: "[3]".into(),
        }),
    );
    let bias = Tensor::zeros(V + 1, DType::F32, &Device::Cpu).unwrap();
    assert_ours(
        linear_cross_entropy_with_bias(&e(), &c(), &bias, &good_t(), &LceOptions::default()),
        cce(CceError::ShapeMismatch {
            what: "bias",
            expected: format!("[{V}]"),
            got: format!("{:?}", [V + 1]),
        }),
    );
}

#[test]
fn target_out_of_range() {
    let mut bad = targets(N, V, 3, 0, -100);
    bad[4] = V as i64;
    assert_ours(
        linear_cross_entropy(&e(), &c(), &t(bad), &LceOptions::default()),
        cce(CceError::TargetOutOfRange {
            row: 4,
            value: V as i64,
            vocab_size: V,
            ignore_index: -100,
        }),
    );
}

#[test]
fn non_finite_input_with_check_finite() {
    let mut vals = values(N * D, 1, 1.0);
    vals[2 * D + 1] = f32::NAN;
    let e_nan = Tensor::from_vec(vals, (N, D), &Device::Cpu).unwrap();
    let r = linear_cross_entropy(&e_nan, &c(), &good_t(), &LceOptions::default());
    let msg = r.as_ref().unwrap_err().to_string();
    assert!(
        msg.contains("non-finite value in e") && msg.contains("(row 2)"),
        "{msg}"
    );
    assert_ours(
        r,
        cce(CceError::NonFinite {
            what: "e",
            index: 2 * D + 1,
            row: 2,
            value: f32::NAN,
        }),
    );
    // With the check off, the NaN propagates instead.
    let loss = linear_cross_entropy(
        &e_nan,
        &c(),
        &good_t(),
        &LceOptions {
            check_finite: false,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(loss.to_scalar::<f32>().unwrap().is_nan());
}

#[test]
fn non_finite_upstream_gradient() {
    let e = Var::from_tensor(&e()).unwrap();
    let loss = linear_cross_entropy(&e, &c(), &good_t(), &LceOptions::default()).unwrap();
    let r = (loss * f64::NAN).unwrap().backward();
    let msg = match r {
        Err(err) => err.to_string(),
        Ok(_) => panic!("a NaN upstream gradient passed"),
    };
    assert!(msg.contains("non-finite value in d_loss"), "{msg}");
}

#[test]
fn dtype_mismatch() {
    let c16 = c().to_dtype(DType::F16).unwrap();
    assert_ours(
        linear_cross_entropy(&e(), &c16, &good_t(), &LceOptions::default()),
        cce(CceError::DTypeMismatch {
            what: "c",
            expected: "f32 (the dtype of e)".into(),
            got: cce_core::DType::F16,
        }),
    );
    let e64 = e().to_dtype(DType::F64).unwrap();
    assert_ours(
        linear_cross_entropy(&e64, &c(), &good_t(), &LceOptions::default()),
        CceCandleError::UnsupportedDType {
            what: "e",
            expected: "f32, f16 or bf16 (the dtype of e)",
            got: DType::F64,
        },
    );
    let tf = good_t().to_dtype(DType::F32).unwrap();
    assert_ours(
        linear_cross_entropy(&e(), &c(), &tf, &LceOptions::default()),
        CceCandleError::UnsupportedDType {
            what: "targets",
            expected: "u32, i32 or i64",
            got: DType::F32,
        },
    );
}

#[test]
fn all_targets_ignored() {
    let ignored = t(vec![-100; N]);
    assert_ours(
        linear_cross_entropy(&e(), &c(), &ignored, &LceOptions::default()),
        cce(CceError::AllTargetsIgnored {
            n: N,
            ignore_index: -100,
            shift: 0,
        }),
    );
    // Sum and none accept it: 0 and zeros.
    for (reduction, want) in [(Reduction::Sum, vec![0.0]), (Reduction::None, vec![0.0; N])] {
        let opts = LceOptions {
            reduction,
            ..Default::default()
        };
        let l = linear_cross_entropy(&e(), &c(), &ignored, &opts).unwrap();
        assert_eq!(l.flatten_all().unwrap().to_vec1::<f32>().unwrap(), want);
    }
}

#[test]
fn invalid_option_and_empty_input() {
    let opts = LceOptions {
        label_smoothing: 1.0,
        ..Default::default()
    };
    assert_ours(
        linear_cross_entropy(&e(), &c(), &good_t(), &opts),
        cce(CceError::InvalidOption {
            name: "label_smoothing",
            reason: "must be in [0, 1), got 1".into(),
        }),
    );
    let empty = Tensor::zeros((0, D), DType::F32, &Device::Cpu).unwrap();
    assert_ours(
        linear_cross_entropy(&empty, &c(), &t(vec![]), &LceOptions::default()),
        cce(CceError::EmptyInput {
            what: "e",
            shape: vec![0, D],
        }),
    );
}

#[test]
fn masked_target() {
    let mut b = vec![0.0f32; V];
    let tv = targets(N, V, 3, 0, -100);
    b[tv[1] as usize] = f32::NEG_INFINITY;
    let bias = Tensor::from_vec(b, V, &Device::Cpu).unwrap();
    let opts = LceOptions {
        check_finite: false,
        ..Default::default()
    };
    assert_ours(
        linear_cross_entropy_with_bias(&e(), &c(), &bias, &t(tv.clone()), &opts),
        cce(CceError::TargetMasked {
            row: 1,
            target: tv[1],
        }),
    );
}
