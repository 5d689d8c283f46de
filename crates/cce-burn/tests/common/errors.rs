//! One check per typed error, on an autodiff `device` of any backend: each backend's test file
//! calls them from its own tests (with its own device and serialization). `try_*` returns the
//! error; the plain functions panic with `linear_cross_entropy: <message>`.

use super::{float, int, to_vec, uniform};
use burn::tensor::{Device, Int, Tensor};
use cce_burn::{
    linear_cross_entropy, try_linear_cross_entropy, try_linear_cross_entropy_3d, CceError,
    LinearCrossEntropyConfig, Reduction,
};

/// `e` `[4, 8]` and `c` `[10, 8]`.
pub fn small(device: &Device) -> (Tensor<2>, Tensor<2>) {
    (
        float(uniform(4 * 8, 1, 1.0), [4, 8], device),
        float(uniform(10 * 8, 2, 0.5), [10, 8], device),
    )
}

/// `c` of another width, targets of the wrong length, 3-D targets not `[B, T]`.
pub fn shape_mismatch(device: &Device) {
    let (e, _) = small(device);
    let c = float(uniform(10 * 9, 2, 0.5), [10, 9], device);
    let err = try_linear_cross_entropy(e, c, int(vec![1, 2, 3, 4], device), &Default::default())
        .unwrap_err();
    assert!(matches!(err, CceError::ShapeMismatch { .. }), "{err}");
    let (e, c) = small(device);
    let err = try_linear_cross_entropy(e, c, int(vec![1, 2, 3], device), &Default::default())
        .unwrap_err();
    assert!(matches!(err, CceError::ShapeMismatch { .. }), "{err}");
    let e3 = float(uniform(2 * 3 * 8, 1, 1.0), [2, 3, 8], device);
    let t2 = Tensor::<2, Int>::zeros([3, 2], device);
    let err =
        try_linear_cross_entropy_3d(e3, small(device).1, t2, &Default::default()).unwrap_err();
    assert!(
        matches!(
            err,
            CceError::ShapeMismatch {
                what: "targets",
                ..
            }
        ),
        "{err}"
    );
}

/// A target past `V`, named with its row; the next good call is unaffected (a device backend
/// read and cleared the error).
pub fn target_out_of_range(device: &Device) {
    let (e, c) = small(device);
    let err = try_linear_cross_entropy(e, c, int(vec![1, 10, 3, 4], device), &Default::default())
        .unwrap_err();
    assert!(
        matches!(
            err,
            CceError::TargetOutOfRange {
                row: 1,
                value: 10,
                vocab_size: 10,
                ..
            }
        ),
        "{err}"
    );
    let (e, c) = small(device);
    let ok = try_linear_cross_entropy(e, c, int(vec![1, 2, 3, 4], device), &Default::default());
    assert!(to_vec(ok.unwrap())[0].is_finite());
}

/// A NaN in `e`.
pub fn non_finite_input(device: &Device) {
    let mut ev = uniform(4 * 8, 1, 1.0);
    ev[9] = f32::NAN;
    let e = float(ev, [4, 8], device);
    let (_, c) = small(device);
    let err = try_linear_cross_entropy(e, c, int(vec![1, 2, 3, 4], device), &Default::default())
        .unwrap_err();
    assert!(matches!(err, CceError::NonFinite { .. }), "{err}");
}

/// A mean over no valid row is an error; a sum accepts it (0).
pub fn all_targets_ignored(device: &Device) {
    let (e, c) = small(device);
    let t = int(vec![-100; 4], device);
    let err =
        try_linear_cross_entropy(e.clone(), c.clone(), t.clone(), &Default::default()).unwrap_err();
    assert!(
        matches!(err, CceError::AllTargetsIgnored { n: 4, .. }),
        "{err}"
    );
    let sum = LinearCrossEntropyConfig::new().with_reduction(Reduction::Sum);
    assert_eq!(to_vec(linear_cross_entropy(e, c, t, &sum)), [0.0]);
}

/// Label smoothing out of `[0, 1)`.
pub fn invalid_option(device: &Device) {
    let (e, c) = small(device);
    let cfg = LinearCrossEntropyConfig::new().with_label_smoothing(1.5);
    let err = try_linear_cross_entropy(e, c, int(vec![1, 2, 3, 4], device), &cfg).unwrap_err();
    assert!(
        matches!(
            err,
            CceError::InvalidOption {
                name: "label_smoothing",
                ..
            }
        ),
        "{err}"
    );
}

/// The plain function panics with the library's message.
pub fn plain_function_panics_with_the_message(device: &Device) {
    let (e, c) = small(device);
    let y = int(vec![1, 10, 3, 4], device);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        linear_cross_entropy(e, c, y, &Default::default())
    }));
    let payload = r.expect_err("a panic");
    let msg = payload
        .downcast_ref::<String>()
        .cloned()
        .unwrap_or_default();
    assert!(
        msg.starts_with("linear_cross_entropy: target out of range at row 1"),
        "{msg}"
    );
}
