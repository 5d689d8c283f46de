#![doc = include_str!("../../../README.md")]
//!
//! # This crate
//!
//! The facade users depend on: re-exports of the contract ([`cce_core`]), the CPU backend
//! ([`cce_reference::CpuBackend`]), the CUDA backend (feature `cuda`) and the wgpu backend
//! (feature `wgpu`), plus a one-call API on host tensors ([`linear_cross_entropy`]), one on
//! CUDA device buffers (`cuda::linear_cross_entropy`, feature `cuda`) and a backend chosen by
//! name at run time ([`backend_by_name`]).

pub use cce_core::*;
/// The vocabulary-parallel call on the CPU: `k` ranks as threads behind the [`Backend`] trait,
/// one rank's driver over any [`vocab_parallel::Communicator`], the in-process communicator
/// (`cce_reference::vocab_parallel`; the math and the wire format: [`vocab_parallel`]).
pub use cce_reference::vocab_parallel::{RankDriver, SimulatedVocabParallel, ThreadComm};
pub use cce_reference::{naive, CpuBackend, Oracle, OracleDLoss, Precision};

#[cfg(feature = "cuda")]
pub use cce_cuda;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "wgpu")]
pub use cce_wgpu;

use std::time::Instant;

/// Loss, lse, side outputs and gradients of one call, on the host.
#[derive(Debug)]
pub struct HostResult {
    /// Loss: `[]` f32 for mean/sum, `[N]` f32 for `Reduction::None`.
    pub loss: HostTensor,
    /// `[N]` f32 log-sum-exp, nats.
    pub lse: HostTensor,
    /// `[N]` f32 entropy (nats), if asked.
    pub entropy: Option<HostTensor>,
    /// `[N]` i32 argmax, if asked.
    pub argmax: Option<HostTensor>,
    /// `[N, D]` gradient of `e`, if the backward ran.
    pub d_e: Option<HostTensor>,
    /// `[V, D]` gradient of `c`, if the backward ran.
    pub d_c: Option<HostTensor>,
    /// `[V]` gradient of the bias, if a bias was given and the backward ran.
    pub d_bias: Option<HostTensor>,
    /// Statistics of the forward.
    pub forward_stats: CallStats,
    /// Statistics of the backward (filter figures), if it ran.
    pub backward_stats: Option<CallStats>,
    /// Wall time of the forward, milliseconds (uploads and downloads excluded).
    pub forward_ms: f64,
    /// Wall time of the backward, milliseconds, if it ran.
    pub backward_ms: Option<f64>,
}

/// A backend driven with host tensors, object-safe so a backend can be picked at run time.
/// Every [`Backend`] implements it.
pub trait HostBackend {
    /// Backend name.
    fn name(&self) -> &'static str;
    /// Device limits (for the plan and reports).
    fn device_limits(&self) -> DeviceLimits;
    /// Upload, forward (and backward with `upstream_scalar` / `upstream_per_row` when
    /// `backward`), download. `d_loss_per_row` (`[N]` f32) is required for `Reduction::None`
    /// when `backward`; mean/sum use `d_loss` (usually 1.0).
    ///
    /// Errors: those of [`Backend::forward`] and [`Backend::backward`].
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        e: &HostTensor,
        c: &HostTensor,
        bias: Option<&HostTensor>,
        targets: &HostTensor,
        opts: &Options,
        backward: bool,
        d_loss: f32,
        d_loss_per_row: Option<&HostTensor>,
    ) -> Result<HostResult>;
}

impl<B: Backend> HostBackend for B {
    fn name(&self) -> &'static str {
        Backend::name(self)
    }

    fn device_limits(&self) -> DeviceLimits {
        self.limits()
    }

    fn run(
        &self,
        e: &HostTensor,
        c: &HostTensor,
        bias: Option<&HostTensor>,
        targets: &HostTensor,
        opts: &Options,
        backward: bool,
        d_loss: f32,
        d_loss_per_row: Option<&HostTensor>,
    ) -> Result<HostResult> {
        let e_b = self.upload(e)?;
        let c_b = self.upload(c)?;
        let bias_b = bias.map(|b| self.upload(b)).transpose()?;
        let t_b = self.upload(targets)?;
        let inputs = Inputs {
            e: &e_b,
            c: &c_b,
            bias: bias_b.as_ref(),
            targets: &t_b,
        };
        let t0 = Instant::now();
        let fwd = self.forward(&inputs, opts)?;
        let forward_ms = t0.elapsed().as_secs_f64() * 1e3;
        let mut out = HostResult {
            loss: self.download(&fwd.loss)?,
            lse: self.download(&fwd.lse)?,
            entropy: fwd.entropy.as_ref().map(|t| self.download(t)).transpose()?,
            argmax: fwd.argmax.as_ref().map(|t| self.download(t)).transpose()?,
            d_e: None,
            d_c: None,
            d_bias: None,
            forward_stats: fwd.stats.clone(),
            backward_stats: None,
            forward_ms,
            backward_ms: None,
        };
        if backward {
            let per_row = d_loss_per_row.map(|t| self.upload(t)).transpose()?;
            let upstream = Upstream {
                d_loss: match &per_row {
                    Some(t) => DLoss::PerRow(t),
                    None => DLoss::Scalar(d_loss),
                },
                d_lse: None,
            };
            let t1 = Instant::now();
            let bwd = self.backward(&inputs, opts, fwd.saved(), &upstream)?;
            out.backward_ms = Some(t1.elapsed().as_secs_f64() * 1e3);
            out.d_e = bwd.d_e.as_ref().map(|t| self.download(t)).transpose()?;
            out.d_c = bwd.d_c.as_ref().map(|t| self.download(t)).transpose()?;
            out.d_bias = bwd.d_bias.as_ref().map(|t| self.download(t)).transpose()?;
            out.backward_stats = Some(bwd.stats);
        }
        Ok(out)
    }
}

/// One call on the CPU backend: loss, lse and gradients of `CE(e·cᵀ + bias, targets)`.
///
/// `e` `[N, D]`, `c` `[V, D]`, `bias` `[V]` (f32/f16/bf16, one dtype), `targets` `[N]` i32/i64.
/// With `Reduction::None` the backward uses an upstream gradient of 1 per row.
/// Math: Wijmans et al. 2024 (arXiv 2411.09009), sections 3-4; see [`cce_core`].
///
/// Errors: every input error of [`Problem::new`] and [`PreparedTargets::new`], `NonFinite`.
pub fn linear_cross_entropy(
    e: &HostTensor,
    c: &HostTensor,
    bias: Option<&HostTensor>,
    targets: &HostTensor,
    opts: &Options,
) -> Result<HostResult> {
    let per_row = match opts.reduction {
        Reduction::None => Some(HostTensor::from_f32(
            vec![targets.numel()],
            &vec![1.0; targets.numel()],
            DType::F32,
        )?),
        _ => None,
    };
    CpuBackend::new().run(e, c, bias, targets, opts, true, 1.0, per_row.as_ref())
}

/// Names accepted by [`backend_by_name`].
pub const BACKEND_NAMES: &[&str] = &["cpu", "cuda", "wgpu", "auto"];

/// A backend by name: `cpu`, `cuda` (feature `cuda`), `wgpu` (feature `wgpu`), or `auto` (the
/// first of cuda, wgpu, cpu that is built and present).
///
/// Errors: `Unsupported` for a backend not compiled in or an unknown name; `NoDevice` when the
/// backend is built but no device is present.
pub fn backend_by_name(name: &str) -> Result<Box<dyn HostBackend>> {
    match name {
        "cpu" => Ok(Box::new(CpuBackend::new())),
        #[cfg(feature = "cuda")]
        "cuda" => Ok(Box::new(cce_cuda::CudaBackend::new(0)?)),
        #[cfg(feature = "wgpu")]
        "wgpu" => Ok(Box::new(cce_wgpu::WgpuBackend::new()?)),
        "auto" => {
            #[cfg(feature = "cuda")]
            if let Ok(b) = cce_cuda::CudaBackend::new(0) {
                return Ok(Box::new(b));
            }
            #[cfg(feature = "wgpu")]
            if let Ok(b) = cce_wgpu::WgpuBackend::new() {
                return Ok(Box::new(b));
            }
            Ok(Box::new(CpuBackend::new()))
        }
        // Reached for the backends not compiled in (unreachable when all features are on).
        #[allow(unreachable_patterns)]
        "cuda" | "wgpu" => Err(CceError::Unsupported {
            backend: "cut-cross-entropy",
            what: format!("backend '{name}': rebuild with `--features {name}`"),
        }),
        other => Err(CceError::Unsupported {
            backend: "cut-cross-entropy",
            what: format!("unknown backend '{other}' (expected one of {BACKEND_NAMES:?})"),
        }),
    }
}
