//! The backend trait: what CPU, CUDA and wgpu implement.
//!
//! Buffers are the backend's own (`Backend::Buffer`): host tensors for the CPU reference,
//! device allocations for GPUs, so a caller holding device memory never copies `e`, `c`,
//! `bias` or the gradients through the host. Targets (`[N]` integers) are read back by GPU
//! backends to validate them and name a bad row; that is `4N` or `8N` bytes.

use crate::error::Result;
use crate::options::Options;
use crate::stats::CallStats;
use crate::tensor::{HostTensor, TensorMeta};

/// The inputs of a call, as buffers of backend `B`.
#[derive(Debug)]
pub struct Inputs<'a, B> {
    /// Hidden states `[N, D]` (or `[..., T, D]`), f32/f16/bf16.
    pub e: &'a B,
    /// Classifier `[V, D]`, same dtype as `e`.
    pub c: &'a B,
    /// Optional bias `[V]`, same dtype as `e`.
    pub bias: Option<&'a B>,
    /// Targets `[N]`, i32 or i64.
    pub targets: &'a B,
}

/// Output of the forward pass.
#[derive(Debug)]
pub struct ForwardOutput<B> {
    /// Loss: shape `[]` f32 for mean/sum, `[N]` f32 for `Reduction::None`.
    pub loss: B,
    /// Log-sum-exp per row `[N]` f32 (nats); also saved for the backward. Ignored rows still
    /// get their lse.
    pub lse: B,
    /// Probability of the non-target classes per row, `[N]` f32:
    /// `rest_mass_i = Σ_{j≠y_i} e^{z_ij − m_i} / Σ_j e^{z_ij − m_i} = 1 − p_{i,y_i}`, computed
    /// without cancellation (the non-target sum is accumulated on its own, never as
    /// `1 − p_y`), with `m_i` the row's running max. 0 at ignored rows. Saved for the backward
    /// (see [`Saved`]): a confident row (`p_y → 1`) has a target gradient `g_i(p_y − 1)` that
    /// the f32 lse cannot resolve once `1 − p_y` is below its rounding (`~lse · 2⁻²⁴`), while
    /// `rest_mass` keeps its full relative accuracy down to f32's smallest normal.
    pub rest_mass: B,
    /// Entropy per row `[N]` f32 (nats), if asked.
    pub entropy: Option<B>,
    /// Argmax per row `[N]` i32, if asked.
    pub argmax: Option<B>,
    /// What the call did.
    pub stats: CallStats,
}

/// What the backward reads from its forward (both `[N]` f32, from a forward with the same
/// inputs and options): the lse and the non-target probability mass.
#[derive(Debug)]
pub struct Saved<'a, B> {
    /// Log-sum-exp per row, [`ForwardOutput::lse`].
    pub lse: &'a B,
    /// `1 − p_y` per row without cancellation, [`ForwardOutput::rest_mass`].
    pub rest_mass: &'a B,
}

impl<B: TensorMeta> Inputs<'_, B> {
    /// The problem these inputs pose under `opts` ([`crate::Problem::new`]: shapes, dtypes and
    /// options validated; its errors).
    pub fn problem(&self, opts: &Options) -> Result<crate::Problem> {
        crate::Problem::new(
            self.e,
            self.c,
            self.bias.map(|b| b as &dyn TensorMeta),
            self.targets,
            opts,
        )
    }
}

impl<B: TensorMeta> Saved<'_, B> {
    /// `ShapeMismatch` unless `lse` and `rest_mass` are both `[n]` f32.
    pub fn check(&self, n: usize) -> Result<()> {
        for (what, t) in [("lse", self.lse), ("rest_mass", self.rest_mass)] {
            if t.shape() != [n] || t.dtype() != crate::dtype::DType::F32 {
                return Err(crate::error::CceError::ShapeMismatch {
                    what,
                    expected: format!("[{n}] f32"),
                    got: format!("{:?} {}", t.shape(), t.dtype()),
                });
            }
        }
        Ok(())
    }
}

impl<B> ForwardOutput<B> {
    /// The buffers the backward needs from this forward.
    pub fn saved(&self) -> Saved<'_, B> {
        Saved {
            lse: &self.lse,
            rest_mass: &self.rest_mass,
        }
    }
}

/// Upstream gradient of the loss.
#[derive(Debug)]
pub enum DLoss<'a, B> {
    /// `∂L/∂loss` for mean/sum reductions (1.0 for a plain `loss.backward()`).
    Scalar(f32),
    /// `∂L/∂loss_i`, `[N]` f32, for `Reduction::None`.
    PerRow(&'a B),
}

/// Upstream gradients of the outputs of the forward.
#[derive(Debug)]
pub struct Upstream<'a, B> {
    /// Gradient of the loss.
    pub d_loss: DLoss<'a, B>,
    /// Optional gradient of the lse output `[N]` f32 (`h_i` in MATH.md).
    pub d_lse: Option<&'a B>,
}

impl<B> Clone for DLoss<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B> Copy for DLoss<'_, B> {}
impl<B> DLoss<'_, B> {
    /// What this is, for an error message: `"a scalar"` or `"a per-row tensor"`.
    pub fn kind(&self) -> &'static str {
        match self {
            DLoss::Scalar(_) => "a scalar",
            DLoss::PerRow(_) => "a per-row tensor",
        }
    }
}
impl<B> Clone for Upstream<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B> Copy for Upstream<'_, B> {}
impl<B> Clone for Inputs<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B> Copy for Inputs<'_, B> {}
impl<B> Clone for Saved<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B> Copy for Saved<'_, B> {}

impl<B> Default for Upstream<'_, B> {
    fn default() -> Self {
        Self {
            d_loss: DLoss::Scalar(1.0),
            d_lse: None,
        }
    }
}

/// Output of the backward pass. Gradients are in the input dtype (or f32 with
/// `GradDType::F32`), accumulated in f32.
#[derive(Debug)]
pub struct BackwardOutput<B> {
    /// `d_e` `[N, D]` (the shape of `e`), if `compute_d_e`.
    pub d_e: Option<B>,
    /// `d_c` `[V, D]`, if `compute_d_c`.
    pub d_c: Option<B>,
    /// `d_bias` `[V]`, if a bias was given and `compute_d_c`.
    pub d_bias: Option<B>,
    /// What the call did (filter statistics live here).
    pub stats: CallStats,
}

/// Outputs of a forward+backward call.
pub type ForwardBackward<B> = (ForwardOutput<B>, BackwardOutput<B>);

/// A compute backend for cut cross-entropy.
///
/// Implementations validate with [`crate::problem::Problem::new`] and
/// [`crate::problem::PreparedTargets`], follow [`crate::plan::Plan`], honour the filter rule of
/// [`crate::filter`], and return typed errors, never panic, on bad input.
pub trait Backend {
    /// The backend's buffer type.
    type Buffer: TensorMeta;

    /// Short name (`cpu`, `cuda`, `wgpu`).
    fn name(&self) -> &'static str;

    /// Hardware facts the plan is derived from.
    fn limits(&self) -> crate::plan::DeviceLimits;

    /// Copy a host tensor to a backend buffer. Errors: `OutOfMemory`, `Backend`.
    fn upload(&self, host: &HostTensor) -> Result<Self::Buffer>;

    /// Copy a backend buffer to the host. Errors: `Backend`.
    fn download(&self, buf: &Self::Buffer) -> Result<HostTensor>;

    /// Forward: loss, lse, side outputs. Errors: every input error of
    /// [`crate::problem::Problem::new`], `TargetOutOfRange`, `AllTargetsIgnored` (mean
    /// reduction with no valid row, from [`crate::problem::PreparedTargets::new`]), `NonFinite`,
    /// `ResourceLimit`, `OutOfMemory`, `Backend`.
    fn forward(
        &self,
        inputs: &Inputs<'_, Self::Buffer>,
        opts: &Options,
    ) -> Result<ForwardOutput<Self::Buffer>>;

    /// Backward from the [`Saved`] `lse` and `rest_mass` (`[N]` f32 each) of a forward with the
    /// same inputs and options: recomputes the logits (paper section 4.3). Errors as
    /// `forward`, plus `ShapeMismatch` for saved buffers or upstream gradients of the wrong
    /// shape (per-row upstream gradients must be `[N]` f32), `NonFinite { what: "d_loss" |
    /// "d_lse", row, .. }` for a NaN or infinite upstream gradient
    /// ([`crate::problem::check_upstream_finite`]: a scalar always, per-row values under
    /// `Options::check_finite`), and on the CPU and wgpu `NonFinite { what: "lse" |
    /// "rest_mass", row, .. }` for a saved state no forward writes, under `check_finite`
    /// ([`crate::problem::check_saved_finite`]).
    fn backward(
        &self,
        inputs: &Inputs<'_, Self::Buffer>,
        opts: &Options,
        saved: Saved<'_, Self::Buffer>,
        upstream: &Upstream<'_, Self::Buffer>,
    ) -> Result<BackwardOutput<Self::Buffer>>;

    /// Forward then backward. Backends may fuse; the default runs the two.
    fn forward_backward(
        &self,
        inputs: &Inputs<'_, Self::Buffer>,
        opts: &Options,
        upstream: &Upstream<'_, Self::Buffer>,
    ) -> Result<ForwardBackward<Self::Buffer>> {
        let fwd = self.forward(inputs, opts)?;
        let bwd = self.backward(inputs, opts, fwd.saved(), upstream)?;
        Ok((fwd, bwd))
    }
}
