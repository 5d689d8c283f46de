//! The burn backend extension: one operation, [`LinearCrossEntropyBackend::linear_cross_entropy`],
//! routed by burn's dispatch to the backend a tensor lives on.

// burn 0.22 deprecates NdArray in favour of Flex; NdArray is still its documented CPU backend
// for this release and the one the task targets (Flex is a next step: see the README).
#![allow(deprecated)]
// Without a backend feature the generated dispatch routes to no backend and uses nothing.
#![cfg_attr(
    not(any(feature = "ndarray", feature = "wgpu", feature = "cuda")),
    allow(unused_variables, unused_macros, dead_code)
)]

use burn::backend::backend_extension;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::Backend;
use cce_core::{CceError, Options};

/// A burn backend that computes the fused linear cross-entropy (arXiv 2411.09009) without
/// materializing the `N x V` logits.
///
/// Implemented for burn's `NdArray` (feature `ndarray`), burn's cubecl backend `Cube` (features
/// `wgpu` and `cuda`: its wgpu and CUDA devices) and `Autodiff<B>` of either (a hand-written backward: see the `autodiff` module). The
/// `#[backend_extension]` attribute generates the implementation for burn's `Dispatch`, which
/// routes a call to the backend its tensors live on; calling it on a backend not listed here
/// (e.g. burn's `Flex`) panics in that routing.
///
/// Most users call [`crate::linear_cross_entropy`] instead.
#[backend_extension(
    Autodiff,
    NdArray: cfg(feature = "ndarray"),
    Cube: cfg(any(feature = "wgpu", feature = "cuda"))
)]
pub trait LinearCrossEntropyBackend: Backend {
    /// The loss `CE(e·cᵀ (softcap), targets)` under `opts`.
    ///
    /// Shapes: `e` `[N, D]`, `c` `[V, D]` (float, one dtype), `targets` `[N]` (integer).
    /// Returns `(Some(loss), None)` with the loss `[1]` f32 for mean/sum and `[N]` f32 for
    /// `Reduction::None`, or `(None, Some(error))` for bad input: burn's extension operations
    /// cannot return a `Result`, so the error travels as a plain output.
    fn linear_cross_entropy(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        targets: IntTensor<Self>,
        opts: Options,
    ) -> (Option<FloatTensor<Self>>, Option<CceError>);

    /// [`Self::linear_cross_entropy`] with a bias `[V]` (same dtype as `e`) added to the
    /// logits. (A separate operation: burn 0.22's extension macro routes owned tensors, not
    /// `Option`s of them.)
    fn linear_cross_entropy_with_bias(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        targets: IntTensor<Self>,
        opts: Options,
    ) -> (Option<FloatTensor<Self>>, Option<CceError>);
}

/// The two extension methods of a concrete backend through its [`CceKernels`] forward.
macro_rules! concrete_extension {
    ($backend:ty) => {
        impl LinearCrossEntropyBackend for $backend {
            fn linear_cross_entropy(
                e: FloatTensor<Self>,
                c: FloatTensor<Self>,
                targets: IntTensor<Self>,
                opts: Options,
            ) -> (Option<FloatTensor<Self>>, Option<CceError>) {
                let (fwd, err) = split(Self::cce_forward(e, c, None, targets, &opts));
                (fwd.map(|f| f.loss), err)
            }

            fn linear_cross_entropy_with_bias(
                e: FloatTensor<Self>,
                c: FloatTensor<Self>,
                bias: FloatTensor<Self>,
                targets: IntTensor<Self>,
                opts: Options,
            ) -> (Option<FloatTensor<Self>>, Option<CceError>) {
                let (fwd, err) = split(Self::cce_forward(e, c, Some(bias), targets, &opts));
                (fwd.map(|f| f.loss), err)
            }
        }
    };
}

/// Split a forward result into the extension's `(loss, error)` pair.
pub(crate) fn split<T>(r: cce_core::Result<T>) -> (Option<T>, Option<CceError>) {
    match r {
        Ok(t) => (Some(t), None),
        Err(e) => (None, Some(e)),
    }
}

#[cfg(any(feature = "ndarray", feature = "wgpu", feature = "cuda"))]
use crate::kernels::CceKernels;

#[cfg(feature = "ndarray")]
mod ndarray {
    use super::*;
    use burn::backend::NdArray;

    /// NdArray runs on our CPU reference engine (the trait's provided methods).
    impl CceKernels for NdArray {}

    concrete_extension!(NdArray);
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub mod cube;
