//! One call on device buffers (feature `cuda`): the loss and its gradients of
//! `CE(e·cᵀ + bias, targets)` from [`CudaTensor`]s, returned as [`CudaTensor`]s, on the
//! backend's stream, with no copy of the inputs or outputs through the host.
//!
//! The inputs may be a framework's own memory, borrowed in place ([`CudaTensor::borrowed`],
//! [`CudaTensor::borrowed_view`]), and the backend may run on the framework's stream
//! ([`CudaBackend::on_stream`], [`CudaBackend::on_raw_stream`]); [`CudaBackend::new`] opens a
//! device with a stream of its own. Everything is enqueued on the backend's stream: the caller
//! orders its producers before the call, and its consumers after it, with events.
//!
//! ```no_run
//! use cut_cross_entropy::cuda::{self, CudaBackend, CudaTensor};
//! use cut_cross_entropy::{Backend, DType, Options};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let backend = CudaBackend::new(0)?;
//! let stream = backend.stream().clone();
//! // The caller's device buffers (a framework's tensors; made here with cudarc):
//! // 3 tokens, hidden size 4, a vocabulary of 5 classes, f32.
//! let e_dev = stream.clone_htod(&[0.1f32; 12])?;
//! let c_dev = stream.clone_htod(&[0.2f32; 20])?;
//! let t_dev = stream.clone_htod(&[1i64, 4, -100])?;
//! // SAFETY: the buffers outlive the call's work on `stream`, where they were written.
//! let (e, c, targets) = unsafe {
//!     (
//!         CudaTensor::borrowed_view(&stream, &e_dev.as_view(), DType::F32, vec![3, 4])?,
//!         CudaTensor::borrowed_view(&stream, &c_dev.as_view(), DType::F32, vec![5, 4])?,
//!         CudaTensor::borrowed_view(&stream, &t_dev.as_view(), DType::I64, vec![3])?,
//!     )
//! };
//! let out = cuda::linear_cross_entropy(&backend, &e, &c, None, &targets, &Options::default())?;
//! let d_e = out.d_e.as_ref().expect("gradients asked"); // [3, 4] f32, on the device
//! assert_eq!(d_e.nbytes(), 48);
//! // Reading the loss back is the caller's choice (it synchronizes the stream).
//! let loss = backend.download(&out.loss)?.to_f32_vec()[0];
//! println!("loss {loss}; {}", out.forward_stats);
//! # Ok(())
//! # }
//! ```

use cce_core::{
    Backend, CallStats, DLoss, DType, HostTensor, Inputs, Options, Reduction, Result, TensorMeta,
    Upstream,
};

pub use cce_cuda::{cudarc, probe, CudaBackend, CudaSwitches, CudaTensor, SparseMode};

/// The outputs of [`linear_cross_entropy`], on the device (the backend's stream).
#[derive(Debug)]
pub struct CudaOutput {
    /// Loss: `[]` f32 for mean/sum, `[N]` f32 for `Reduction::None`.
    pub loss: CudaTensor,
    /// `[N]` f32 log-sum-exp per row, nats.
    pub lse: CudaTensor,
    /// `[N]` f32 `1 − p_y` per row without cancellation; with `lse`, the state a later
    /// [`Backend::backward`] takes ([`cce_core::Saved`]).
    pub rest_mass: CudaTensor,
    /// `[N]` f32 entropy (nats), if asked (`Options::side_outputs`).
    pub entropy: Option<CudaTensor>,
    /// `[N]` i32 argmax, if asked.
    pub argmax: Option<CudaTensor>,
    /// `[N, D]` gradient of `e` (the shape of `e`), if `Options::compute_d_e`; in the dtype of
    /// `e`, or f32 with `GradDType::F32`.
    pub d_e: Option<CudaTensor>,
    /// `[V, D]` gradient of `c`, if `Options::compute_d_c`.
    pub d_c: Option<CudaTensor>,
    /// `[V]` gradient of the bias, if a bias was given and `Options::compute_d_c`.
    pub d_bias: Option<CudaTensor>,
    /// What the forward did (strategy and why, tiles, memory).
    pub forward_stats: CallStats,
    /// What the backward did (filter figures), if it ran.
    pub backward_stats: Option<CallStats>,
}

/// One call on device buffers: the loss, lse and (with `compute_d_e` / `compute_d_c`, the
/// default) the gradients of the loss, i.e. of `loss.backward()` with an upstream gradient of
/// 1; with `Reduction::None`, of the sum of the per-row losses (the backward's `[N]` upstream
/// of ones is the one host-to-device copy, `4N` bytes). Forward only when neither gradient is
/// asked.
///
/// `e` `[N, D]` (or `[..., T, D]`), `c` `[V, D]`, `bias` `[V]` (f32/f16/bf16, one dtype),
/// `targets` `[N]` i32/i64 (`ignore_index`, default -100, skips a row); every tensor on the
/// backend's device. Math: Wijmans et al. 2024 (arXiv 2411.09009), see [`cce_core`]. For
/// another upstream gradient, or a backward from a saved lse, call the [`Backend`] methods of
/// [`CudaBackend`].
///
/// Errors: those of [`Backend::forward`] and [`Backend::backward`] (among them
/// `ShapeMismatch`, `DTypeMismatch`, `TargetOutOfRange`, `AllTargetsIgnored` for a mean over
/// no valid row, `NonFinite`, `OutOfMemory`), `ForeignBuffer` for a tensor of another device.
pub fn linear_cross_entropy(
    backend: &CudaBackend,
    e: &CudaTensor,
    c: &CudaTensor,
    bias: Option<&CudaTensor>,
    targets: &CudaTensor,
    opts: &Options,
) -> Result<CudaOutput> {
    let inputs = Inputs {
        e,
        c,
        bias,
        targets,
    };
    let (fwd, bwd) = if opts.compute_d_e || opts.compute_d_c {
        let ones = match opts.reduction {
            Reduction::None => {
                let n = targets.numel();
                Some(backend.upload(&HostTensor::from_f32(vec![n], &vec![1.0; n], DType::F32)?)?)
            }
            _ => None,
        };
        let upstream = Upstream {
            d_loss: match &ones {
                Some(t) => DLoss::PerRow(t),
                None => DLoss::Scalar(1.0),
            },
            d_lse: None,
        };
        let (fwd, bwd) = backend.forward_backward(&inputs, opts, &upstream)?;
        (fwd, Some(bwd))
    } else {
        (backend.forward(&inputs, opts)?, None)
    };
    let (d_e, d_c, d_bias, backward_stats) = match bwd {
        Some(b) => (b.d_e, b.d_c, b.d_bias, Some(b.stats)),
        None => (None, None, None, None),
    };
    Ok(CudaOutput {
        loss: fwd.loss,
        lse: fwd.lse,
        rest_mass: fwd.rest_mass,
        entropy: fwd.entropy,
        argmax: fwd.argmax,
        d_e,
        d_c,
        d_bias,
        forward_stats: fwd.stats,
        backward_stats,
    })
}
