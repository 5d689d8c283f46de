#![doc = include_str!("../README.md")]
//!
//! # API
//!
//! - [`linear_cross_entropy`] / [`try_linear_cross_entropy`]: `e` `[N, D]`, `c` `[V, D]`,
//!   `targets` `[N]`; [`linear_cross_entropy_3d`] / [`try_linear_cross_entropy_3d`]: `e`
//!   `[B, T, D]`, `targets` `[B, T]`, flattened to `N = B·T` rows.
//! - [`LinearCrossEntropyConfig`]: bias, reduction, ignore_index, softcap, label smoothing,
//!   z-loss and every other field of our [`Options`]; exact gradients by default.
//! - [`LinearCrossEntropyBackend`]: the burn backend extension (implemented for `NdArray`,
//!   `Cube` (its wgpu and CUDA devices) and `Autodiff<B>`), and [`CceKernels`], the
//!   forward/backward of a concrete backend.
//! - `cube::init_wgpu` / `cube::register_wgpu` (feature `wgpu`): our kernels on burn's own
//!   wgpu device and queue, in burn's buffers.
//! - `cube::cuda_ready` / `cube::cuda_host_syncs` (feature `cuda`): our CUDA kernels in burn's
//!   CUDA buffers; whether they take a device, and the host synchronizations they made.
//! - [`host_copies`] counts the tensors that went through the host instead.

mod autodiff;
mod backend;
mod kernels;

#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub use backend::cube;
pub use backend::LinearCrossEntropyBackend;
pub use cce_core::{CceError, FilterEps, Options, Reduction};
pub use kernels::{host_backward, host_copies, host_forward, CceForward, CceGrads, CceKernels};

use burn::backend::Dispatch;
use burn::tensor::{Int, Tensor};

/// Everything that configures [`linear_cross_entropy`] besides `e`, `c` and the targets.
///
/// `Default` is exact (unfiltered) gradients, mean reduction, `ignore_index = -100`, no bias,
/// softcap, label smoothing or z-loss: the same loss as burn's `CrossEntropyLoss` on the
/// logits `e·cᵀ`, without the `N x V` logits.
#[derive(Clone, Debug)]
pub struct LinearCrossEntropyConfig {
    /// Optional bias `[V]` added to the logits (same float dtype as `e`); trainable when it
    /// requires grad.
    pub bias: Option<Tensor<1>>,
    /// Our options (`cce_core::Options`); side outputs and `grad_dtype` are ignored (gradients
    /// come back in each input's dtype), `compute_d_e` / `compute_d_c` are set from which inputs
    /// require grad.
    pub options: Options,
}

impl Default for LinearCrossEntropyConfig {
    fn default() -> Self {
        Self {
            bias: None,
            options: Options::exact(),
        }
    }
}

impl LinearCrossEntropyConfig {
    /// The default: exact gradients, mean reduction, ignore_index -100.
    pub fn new() -> Self {
        Self::default()
    }

    /// Add a bias `[V]` to the logits.
    pub fn with_bias(mut self, bias: Tensor<1>) -> Self {
        self.bias = Some(bias);
        self
    }

    /// Loss reduction: mean over valid rows (default), sum, or none (`[N]` per-row losses, 0
    /// at ignored rows).
    pub fn with_reduction(mut self, reduction: Reduction) -> Self {
        self.options.reduction = reduction;
        self
    }

    /// Targets equal to this are ignored (loss and gradient 0). Default -100.
    pub fn with_ignore_index(mut self, ignore_index: i64) -> Self {
        self.options.ignore_index = ignore_index;
        self
    }

    /// Softcap `s`: logits `z = s·tanh(x/s)`.
    pub fn with_softcap(mut self, softcap: f32) -> Self {
        self.options.softcap = Some(softcap);
        self
    }

    /// Label smoothing `α` in `[0, 1)`: the target distribution is `(1−α)·onehot + α/V`.
    pub fn with_label_smoothing(mut self, alpha: f32) -> Self {
        self.options.label_smoothing = alpha;
        self
    }

    /// z-loss weight `λ ≥ 0`: adds `λ·lse²` per valid row.
    pub fn with_z_loss(mut self, weight: f32) -> Self {
        self.options.z_loss = weight;
        self
    }

    /// Replace all of our options (e.g. `Options::default()` for the filtered backward, bounded
    /// per row by `max_dropped_mass`).
    pub fn with_options(mut self, options: Options) -> Self {
        self.options = options;
        self
    }
}

/// The fused linear cross-entropy `CE(e·cᵀ (+ bias, softcap), targets)` without the `N x V`
/// logits (Wijmans et al. 2024, arXiv 2411.09009): a blockwise log-sum-exp forward, and on an
/// autodiff device a backward that recomputes the logits tile by tile.
///
/// Shapes and dtypes: `e` `[N, D]` and `c` `[V, D]` float (f32, f16, bf16; f64 is computed in
/// f32), `targets` `[N]` integer in `[0, V)` or `ignore_index`, all on one device of a backend
/// implementing [`LinearCrossEntropyBackend`] (NdArray, wgpu, CUDA, autodiff of any). Returns the
/// loss as f32: `[1]` for mean/sum, `[N]` for `Reduction::None`. Gradients reach `e`, `c` and
/// the bias when they require grad.
///
/// Errors: [`CceError::ShapeMismatch`], [`CceError::DTypeMismatch`],
/// [`CceError::TargetOutOfRange`], [`CceError::TargetMasked`],
/// [`CceError::AllTargetsIgnored`] (mean over no valid row), [`CceError::NonFinite`] (NaN or
/// infinity in an input, when `check_finite`), [`CceError::EmptyInput`],
/// [`CceError::InvalidOption`], and device errors. The backward, which burn runs without a
/// way to return an error, panics on a non-finite upstream gradient or a device failure.
pub fn try_linear_cross_entropy(
    e: Tensor<2>,
    c: Tensor<2>,
    targets: Tensor<1, Int>,
    config: &LinearCrossEntropyConfig,
) -> Result<Tensor<1>, CceError> {
    config.options.validate()?;
    one_device(&e, &c, config.bias.as_ref(), &targets)?;
    let (e, c, t, opts) = (
        e.into_dispatch(),
        c.into_dispatch(),
        targets.into_dispatch(),
        config.options.clone(),
    );
    let (loss, err) = match &config.bias {
        Some(b) => <Dispatch as LinearCrossEntropyBackend>::linear_cross_entropy_with_bias(
            e,
            c,
            b.clone().into_dispatch(),
            t,
            opts,
        ),
        None => <Dispatch as LinearCrossEntropyBackend>::linear_cross_entropy(e, c, t, opts),
    };
    match (loss, err) {
        (_, Some(err)) => Err(err),
        (Some(loss), None) => Ok(Tensor::from_dispatch(loss)),
        (None, None) => Err(CceError::backend(
            kernels::NAME,
            "the backend returned neither a loss nor an error",
        )),
    }
}

/// Whether the inputs of one call are on one device: burn's dispatch routing panics ("input
/// tensor `c` is on the wrong backend") on inputs of two backends, and our engines take one
/// device. Inputs on different devices are [`CceError::Unsupported`]: moving a tensor between
/// devices is the caller's choice (`Tensor::to_device`). A mix of one device with and without
/// autodiff (a frozen head loaded without it, targets made on the plain device) is one device:
/// burn's routing takes it, as its own operations do.
fn one_device(
    e: &Tensor<2>,
    c: &Tensor<2>,
    bias: Option<&Tensor<1>>,
    targets: &Tensor<1, Int>,
) -> Result<(), CceError> {
    let home = e.device();
    let foreign = |what: &str, device: burn::tensor::Device| CceError::Unsupported {
        backend: kernels::NAME,
        what: format!(
            "{what} on {device:?} while e is on {home:?} (one device for all inputs: move them \
             with `Tensor::to_device`)"
        ),
    };
    // `Device`'s equality is the hardware's, not the autodiff context's.
    if c.device() != home {
        return Err(foreign("c", c.device()));
    }
    if let Some(b) = bias.filter(|b| b.device() != home) {
        return Err(foreign("bias", b.device()));
    }
    if targets.device() != home {
        return Err(foreign("targets", targets.device()));
    }
    Ok(())
}

/// [`try_linear_cross_entropy`], panicking with the error's message on bad input (burn's own
/// tensor operations panic on invalid arguments too; see the crate docs for the policy).
///
/// # Panics
///
/// On every error [`try_linear_cross_entropy`] returns, with `linear_cross_entropy: <message>`.
#[track_caller]
pub fn linear_cross_entropy(
    e: Tensor<2>,
    c: Tensor<2>,
    targets: Tensor<1, Int>,
    config: &LinearCrossEntropyConfig,
) -> Tensor<1> {
    try_linear_cross_entropy(e, c, targets, config)
        .unwrap_or_else(|err| panic!("linear_cross_entropy: {err}"))
}

/// [`try_linear_cross_entropy`] on a batch of sequences: `e` `[B, T, D]`, `targets` `[B, T]`,
/// flattened to `N = B·T` rows. With `options.shift > 0` and no `seq_len`, `seq_len` is set to
/// `T`, so row `(b, t)` predicts target `(b, t + shift)` within its sequence. Returns `[1]` for
/// mean/sum, `[B·T]` for `Reduction::None`.
///
/// Errors: those of [`try_linear_cross_entropy`], and `ShapeMismatch` when `targets` is not
/// `[B, T]`.
pub fn try_linear_cross_entropy_3d(
    e: Tensor<3>,
    c: Tensor<2>,
    targets: Tensor<2, Int>,
    config: &LinearCrossEntropyConfig,
) -> Result<Tensor<1>, CceError> {
    let [b, t, d] = e.dims();
    if targets.dims() != [b, t] {
        return Err(CceError::ShapeMismatch {
            what: "targets",
            expected: format!("[{b}, {t}] (the first two dimensions of e)"),
            got: format!("{:?}", targets.dims()),
        });
    }
    let mut config = config.clone();
    if config.options.shift > 0 && config.options.seq_len.is_none() {
        config.options.seq_len = Some(t);
    }
    try_linear_cross_entropy(e.reshape([b * t, d]), c, targets.reshape([b * t]), &config)
}

/// [`try_linear_cross_entropy_3d`], panicking with the error's message.
///
/// # Panics
///
/// On every error [`try_linear_cross_entropy_3d`] returns.
#[track_caller]
pub fn linear_cross_entropy_3d(
    e: Tensor<3>,
    c: Tensor<2>,
    targets: Tensor<2, Int>,
    config: &LinearCrossEntropyConfig,
) -> Tensor<1> {
    try_linear_cross_entropy_3d(e, c, targets, config)
        .unwrap_or_else(|err| panic!("linear_cross_entropy: {err}"))
}
