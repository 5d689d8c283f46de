#![doc = include_str!("../README.md")]
//!
//! # Design
//!
//! **Op arity.** The loss is a candle custom op with one output (the loss) whose inputs are the
//! *differentiable* tensors: [`CustomOp2`] over `(e, c)`, or [`CustomOp3`] over `(e, c, bias)`
//! with [`linear_cross_entropy_with_bias`]. The targets are not differentiable, so they are not
//! an op input: the op holds them (a candle [`Tensor`], a reference count, no copy) and reads
//! their storage when it runs. That leaves `CustomOp3`'s three slots for `e`, `c` and `bias`,
//! and candle's autograd returns `d_bias` like any other gradient. The alternative, folding the
//! bias in as an extra column (`[e, 1]·[c, bias]ᵀ`), would copy `e` and `c` into `[N, D+1]` and
//! `[V, D+1]` tensors on every call (the size of the inputs again, and a `D+1` that breaks the
//! aligned, vector-width `D` the GPU kernels prefer), and `d_bias` would come back as a column
//! of a `[V, D+1]` gradient to be sliced out.
//!
//! **Recompute, not eager.** The forward runs our forward only (loss, plus the per-row lse and
//! rest mass, `8N` bytes, kept in the op until candle drops the graph); the backward recomputes
//! the logits tile by tile from them (arXiv 2411.09009, section 4.3), as
//! [`cce_core::Backend::backward`] does. An eager forward (the gradients computed in the
//! forward with a unit upstream gradient, scaled in `bwd`) costs the same work on the CPU,
//! where the backend has no fused forward-backward, adds a scaling pass over `d_e` and `d_c`,
//! holds both gradients (`(N+V)·D` values) from the forward until the backward, does the
//! backward's work for forwards that never get one (evaluation), and cannot serve
//! `Reduction::None` with a per-row upstream gradient (`d_c = Σ_i g_i·G_iᵀ·e_i` is not a
//! rescaling of the unit-upstream `d_c`). Measured at `N x D x V = 1024 x 256 x 16384`, f32:
//! 825 ms (recompute) and 870 ms (eager) for forward plus backward, the difference within the
//! noise of a shared machine (crate README, "Eager or recompute").
//!
//! **Exact gradients by default.** [`LceOptions::default`] has `filter_eps = Off`: the
//! gradients are those of candle's own materialized cross-entropy (to f32 rounding), what a
//! drop-in replacement must give. The filtered backward of the facade's `Options::default()`
//! (entries with `|p − onehot| < ε` skipped under a per-row dropped-mass bound) is one field
//! away: `filter_eps: FilterEps::Auto`.
//!
//! **Copies on the CPU.** `e`, `c` and `bias` are read in place from candle's `CpuStorage`
//! when f32 and contiguous; f16 and bf16 are widened to f32 once per call by our CPU backend
//! (as for its own host tensors); a non-contiguous input is made contiguous first
//! ([`Tensor::contiguous`], a copy candle's layout forces, since our kernels read row-major
//! rows). The targets are converted to i64 (`8N` bytes, our backend's target preparation). The
//! upstream gradient is read in place (f32, `[N]` or a scalar). The loss and the gradients are
//! moved into candle storage without a copy ([`Tensor::from_vec`]).
//!
//! **Errors.** Every error of ours is a [`CceCandleError`] (our [`CceError`] or a candle-side
//! one: an unsupported dtype or device), returned as `candle_core::Error::Wrapped`, whose
//! message is ours verbatim; never a panic.

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp2, CustomOp3, DType as CDType, Device, Layout, Shape, Storage, Tensor,
};
use cce_core::{DLoss, DType, HostData, HostTensor, Inputs, Options, Saved, TensorMeta, Upstream};
use cce_reference::{CpuBackend, HostSlice, HostView};
use std::sync::Mutex;

pub use cce_core::{CceError, FilterEps, Reduction};

/// Options of [`linear_cross_entropy`], mapped onto the library's [`Options`] by
/// [`LceOptions::to_options`]. The default is candle's `cross_entropy` with PyTorch's
/// `ignore_index = -100`: mean reduction, no smoothing, softcap or z-loss, and exact gradients
/// (`filter_eps = Off`).
#[derive(Clone, Debug, PartialEq)]
pub struct LceOptions {
    /// Targets equal to this are ignored (loss 0, gradient 0). Default -100. With u32 targets,
    /// pick a value they can hold (e.g. `u32::MAX as i64`).
    pub ignore_index: i64,
    /// Mean over the valid rows (default; a batch with no valid row is
    /// [`CceError::AllTargetsIgnored`]), sum, or none (per-row losses shaped like e's leading
    /// dims, whatever the shape of `targets`).
    pub reduction: Reduction,
    /// Label smoothing `α` in `[0, 1)`: the loss is `(1 − α)·CE + α·mean_j(lse − z_j)`.
    pub label_smoothing: f32,
    /// Softcap `s > 0`: logits `z = s·tanh(x/s)` (Gemma 2).
    pub softcap: Option<f32>,
    /// z-loss weight `λ ≥ 0`: adds `λ·lse²` per valid row.
    pub z_loss: f32,
    /// Row `(b, t)` of `e` is paired with target `(b, t + shift)` (next-token prediction with
    /// unshifted targets); the last `shift` rows of each sequence are ignored. Default 0.
    pub shift: usize,
    /// Rows per sequence for `shift`; `None`: `T` for a `[B, T, D]` `e`, else all rows.
    pub seq_len: Option<usize>,
    /// Gradient filter: `Off` (default, exact), `Auto` or `Value(ε)`.
    pub filter_eps: FilterEps,
    /// Per-row bound on the probability mass a filtered backward may skip (default 1e-3).
    pub max_dropped_mass: f32,
    /// Reject NaN/±inf in `e`, `c`, `bias` and the upstream gradient with
    /// [`CceError::NonFinite`] (default true).
    pub check_finite: bool,
    /// Workspace our backend may use beyond inputs and outputs, bytes (default 512 MiB).
    pub workspace_budget_bytes: u64,
}

impl Default for LceOptions {
    fn default() -> Self {
        let o = Options::exact();
        Self {
            ignore_index: o.ignore_index,
            reduction: o.reduction,
            label_smoothing: o.label_smoothing,
            softcap: o.softcap,
            z_loss: o.z_loss,
            shift: o.shift,
            seq_len: o.seq_len,
            filter_eps: o.filter_eps,
            max_dropped_mass: o.max_dropped_mass,
            check_finite: o.check_finite,
            workspace_budget_bytes: o.workspace_budget_bytes,
        }
    }
}

impl LceOptions {
    /// The library's [`Options`] for these: gradients in the input dtype (candle adds a
    /// gradient to the others of its tensor, so it must have the tensor's dtype), no side
    /// outputs, both gradients enabled (the backward narrows them to the inputs that need one).
    pub fn to_options(&self) -> Options {
        Options {
            ignore_index: self.ignore_index,
            reduction: self.reduction,
            label_smoothing: self.label_smoothing,
            softcap: self.softcap,
            z_loss: self.z_loss,
            shift: self.shift,
            seq_len: self.seq_len,
            filter_eps: self.filter_eps,
            max_dropped_mass: self.max_dropped_mass,
            check_finite: self.check_finite,
            workspace_budget_bytes: self.workspace_budget_bytes,
            ..Options::exact()
        }
    }
}

/// Errors of this crate, returned inside `candle_core::Error::Wrapped` (message verbatim).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CceCandleError {
    /// An error of the library: bad shapes, dtypes, targets, options, non-finite values, all
    /// targets ignored under a mean, resources.
    #[error(transparent)]
    Cce(#[from] CceError),
    /// A candle dtype the library has no counterpart for (f64, u8 floats, ... for `e`/`c`/
    /// `bias`; floats for `targets`).
    #[error("dtype {got:?} of {what} is not supported: expected {expected}")]
    UnsupportedDType {
        /// Which tensor.
        what: &'static str,
        /// The dtypes accepted there.
        expected: &'static str,
        /// The candle dtype passed.
        got: CDType,
    },
    /// An input on another device than `e`.
    #[error("{what} is on {got}, but e is on {expected}: every input must be on one device")]
    DeviceMismatch {
        /// Which tensor.
        what: &'static str,
        /// e's device.
        expected: String,
        /// That tensor's device.
        got: String,
    },
    /// A device this build has no backend for (CUDA without the CUDA path, Metal).
    #[error(
        "cut cross-entropy for candle does not support {device} tensors in this build: {reason}"
    )]
    UnsupportedDevice {
        /// The device.
        device: String,
        /// Why, and what to do.
        reason: &'static str,
    },
    /// The backward ran without the state of its forward (a bug, never bad input).
    #[error("internal: {0}")]
    Internal(&'static str),
}

impl From<CceCandleError> for candle_core::Error {
    fn from(e: CceCandleError) -> Self {
        candle_core::Error::wrap(e)
    }
}

fn cce(e: CceError) -> candle_core::Error {
    CceCandleError::Cce(e).into()
}

/// The fused linear cross-entropy `CE(e·cᵀ, targets)` (softcap, label smoothing, z-loss per
/// `opts`) without the `N x V` logits, differentiable through candle's autograd with respect
/// to `e` and `c` (Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language Models",
/// arXiv 2411.09009).
///
/// - `e`: `[..., D]` (any leading dims, `N` = their product), f32, f16 or bf16;
/// - `c`: `[V, D]`, e's dtype (candle's `Linear` weight `[out, in]` as it is);
/// - `targets`: e's leading dims or `[N]`, u32, i32 or i64, values in `[0, V)` or
///   `opts.ignore_index`; not differentiable.
///
/// Returns the loss as f32 whatever the input dtype (accumulated in f64, rounded once): a
/// scalar for mean and sum, e's leading dims for `Reduction::None`. The backward returns
/// `d_e` and `d_c` in the input dtype (accumulated in f32).
///
/// Runs on candle's CPU device (our blocked CPU backend). Errors: a candle error wrapping a
/// [`CceCandleError`]: the library's [`CceError`] (`ShapeMismatch`, `DTypeMismatch`,
/// `TargetOutOfRange`, `AllTargetsIgnored` for a mean with no valid row, `NonFinite` under
/// `check_finite`, `InvalidOption`, `EmptyInput`, ...), `UnsupportedDType`, `DeviceMismatch`,
/// `UnsupportedDevice` (CUDA tensors: the crate `cce-candle-cuda`, `compat/cce-candle-cuda`;
/// Metal); the backward can fail with `NonFinite` for a NaN upstream gradient.
pub fn linear_cross_entropy(
    e: &Tensor,
    c: &Tensor,
    targets: &Tensor,
    opts: &LceOptions,
) -> candle_core::Result<Tensor> {
    let op = LceOp::new(e, c, None, targets, opts)?;
    e.contiguous()?.apply_op2(&c.contiguous()?, LceOp2(op))
}

/// [`linear_cross_entropy`] with a bias: `CE(e·cᵀ + bias, targets)`, `bias` `[V]` in e's
/// dtype, differentiable (`d_bias` in its dtype). A `-inf` bias entry masks its class (the
/// loss of a row whose target is masked is [`CceError::TargetMasked`]). Same errors.
pub fn linear_cross_entropy_with_bias(
    e: &Tensor,
    c: &Tensor,
    bias: &Tensor,
    targets: &Tensor,
    opts: &LceOptions,
) -> candle_core::Result<Tensor> {
    let op = LceOp::new(e, c, Some(bias), targets, opts)?;
    e.contiguous()?
        .apply_op3(&c.contiguous()?, &bias.contiguous()?, LceOp3(op))
}

/// Library dtype of a candle float tensor.
fn float_dtype(what: &'static str, dt: CDType) -> Result<DType, CceCandleError> {
    match dt {
        CDType::F32 => Ok(DType::F32),
        CDType::F16 => Ok(DType::F16),
        CDType::BF16 => Ok(DType::BF16),
        got => Err(CceCandleError::UnsupportedDType {
            what,
            expected: "f32, f16 or bf16 (the dtype of e)",
            got,
        }),
    }
}

/// State shared by the forward and the backward of one call.
struct LceOp {
    opts: Options,
    /// Contiguous targets, on e's device.
    targets: Tensor,
    /// What the forward saved for the backward: `lse` and `rest_mass`, `[N]` f32 each.
    saved: Mutex<Option<SavedState>>,
}

enum SavedState {
    Cpu { lse: HostTensor, rest: HostTensor },
}

impl LceOp {
    fn new(
        e: &Tensor,
        c: &Tensor,
        bias: Option<&Tensor>,
        targets: &Tensor,
        opts: &LceOptions,
    ) -> candle_core::Result<Self> {
        let dev = e.device();
        for (what, t) in [("c", Some(c)), ("bias", bias), ("targets", Some(targets))] {
            if let Some(t) = t {
                if !t.device().same_device(dev) {
                    return Err(CceCandleError::DeviceMismatch {
                        what,
                        expected: format!("{:?}", dev.location()),
                        got: format!("{:?}", t.device().location()),
                    }
                    .into());
                }
            }
        }
        // dtypes first, so that an f64 e is named as such rather than as a dtype mismatch.
        float_dtype("e", e.dtype())?;
        if !matches!(targets.dtype(), CDType::U32 | CDType::I32 | CDType::I64) {
            return Err(CceCandleError::UnsupportedDType {
                what: "targets",
                expected: "u32, i32 or i64",
                got: targets.dtype(),
            }
            .into());
        }
        if !dev.is_cpu() {
            return Err(CceCandleError::UnsupportedDevice {
                device: format!("{:?}", dev.location()),
                reason: "only candle's CPU device runs here; for CUDA tensors use the crate \
                         cce-candle-cuda (compat/cce-candle-cuda: our CUDA backend on candle's \
                         stream)",
            }
            .into());
        }
        Ok(Self {
            opts: opts.to_options(),
            targets: targets.contiguous()?,
            saved: Mutex::new(None),
        })
    }

    fn forward_cpu(
        &self,
        e: (&CpuStorage, &Layout),
        c: (&CpuStorage, &Layout),
        bias: Option<(&CpuStorage, &Layout)>,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (ts, tl) = self.targets.storage_and_layout();
        let t_data = target_data(&ts, tl)?;
        let targets = t_data.view(tl.dims())?;
        let e_v = float_view("e", e.0, e.1)?;
        let c_v = float_view("c", c.0, c.1)?;
        let b_v = bias.map(|(s, l)| float_view("bias", s, l)).transpose()?;
        let inputs = Inputs {
            e: &e_v,
            c: &c_v,
            bias: b_v.as_ref(),
            targets: &targets,
        };
        let out = CpuBackend::new()
            .forward_host(&inputs, &self.opts)
            .map_err(cce)?;
        let shape = match self.opts.reduction {
            Reduction::None => Shape::from(&e.1.dims()[..e.1.dims().len() - 1]),
            _ => Shape::from(()),
        };
        *self.saved.lock().unwrap_or_else(|p| p.into_inner()) = Some(SavedState::Cpu {
            lse: out.lse,
            rest: out.rest_mass,
        });
        match out.loss.into_data() {
            HostData::F32(v) => Ok((CpuStorage::F32(v), shape)),
            _ => Err(CceCandleError::Internal("the loss is not f32").into()),
        }
    }

    /// `(d_e, d_c, d_bias)` for upstream `grad_res` (the loss's gradient), recomputed from the
    /// saved lse and rest mass.
    fn backward(
        &self,
        e: &Tensor,
        c: &Tensor,
        bias: Option<&Tensor>,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let want_e = e.track_op();
        let want_c = c.track_op() || bias.is_some_and(|b| b.track_op());
        if !want_e && !want_c {
            return Ok((None, None, None));
        }
        let opts = Options {
            compute_d_e: want_e,
            compute_d_c: want_c,
            ..self.opts.clone()
        };
        let saved = self.saved.lock().unwrap_or_else(|p| p.into_inner());
        let Some(SavedState::Cpu { lse, rest }) = saved.as_ref() else {
            return Err(CceCandleError::Internal("backward before its forward").into());
        };
        // The upstream gradient: f32 like the loss (converted should a caller have cast it).
        let grad = grad_res
            .to_dtype(CDType::F32)?
            .flatten_all()?
            .contiguous()?;
        let scalar = match opts.reduction {
            Reduction::None => None,
            _ => Some(grad.to_vec1::<f32>()?.first().copied().unwrap_or(0.0)),
        };
        let (es, el) = e.storage_and_layout();
        let (cs, cl) = c.storage_and_layout();
        let bias_sl = bias.map(|b| b.storage_and_layout());
        let (gs, gl) = grad.storage_and_layout();
        let (ts, tl) = self.targets.storage_and_layout();
        let e_v = float_view("e", cpu(&es)?, el)?;
        let c_v = float_view("c", cpu(&cs)?, cl)?;
        let b_v = match &bias_sl {
            Some((s, l)) => Some(float_view("bias", cpu(s)?, l)?),
            None => None,
        };
        let t_data = target_data(&ts, tl)?;
        let t_v = t_data.view(tl.dims())?;
        let g_v = float_view("d_loss", cpu(&gs)?, gl)?;
        let lse_v = host_view(lse)?;
        let rest_v = host_view(rest)?;
        let inputs = Inputs {
            e: &e_v,
            c: &c_v,
            bias: b_v.as_ref(),
            targets: &t_v,
        };
        let upstream = Upstream {
            d_loss: match scalar {
                Some(s) => DLoss::Scalar(s),
                None => DLoss::PerRow(&g_v),
            },
            d_lse: None,
        };
        let saved = Saved {
            lse: &lse_v,
            rest_mass: &rest_v,
        };
        let out = CpuBackend::new()
            .backward_host(&inputs, &opts, saved, &upstream)
            .map_err(cce)?;
        let dev = Device::Cpu;
        let d_e = out.d_e.map(|t| to_tensor(t, e.shape(), &dev)).transpose()?;
        let d_c = out.d_c.map(|t| to_tensor(t, c.shape(), &dev)).transpose()?;
        let d_bias = match bias {
            Some(b) => out
                .d_bias
                .map(|t| to_tensor(t, b.shape(), &dev))
                .transpose()?,
            None => None,
        };
        Ok((d_e, d_c, d_bias))
    }
}

/// The CPU storage of a tensor on candle's CPU device.
fn cpu(s: &Storage) -> candle_core::Result<&CpuStorage> {
    match s {
        Storage::Cpu(s) => Ok(s),
        _ => Err(CceCandleError::UnsupportedDevice {
            device: "non-CPU".into(),
            reason: "the backward's inputs left the CPU",
        }
        .into()),
    }
}

/// The contiguous elements of `layout` in `v`.
fn elems<'a, T>(v: &'a [T], what: &'static str, layout: &Layout) -> candle_core::Result<&'a [T]> {
    let start = layout.start_offset();
    let n = layout.shape().elem_count();
    match (layout.is_contiguous(), v.get(start..start + n)) {
        (true, Some(s)) => Ok(s),
        _ => Err(cce(CceError::ShapeMismatch {
            what,
            expected: "a contiguous row-major tensor".into(),
            got: format!("strides {:?}, offset {start}", layout.stride()),
        })),
    }
}

/// A float tensor's elements, borrowed, with our dtype.
fn float_view<'a>(
    what: &'static str,
    s: &'a CpuStorage,
    l: &Layout,
) -> candle_core::Result<HostView<'a>> {
    let data = match s {
        CpuStorage::F32(v) => HostSlice::F32(elems(v, what, l)?),
        CpuStorage::F16(v) => HostSlice::F16(elems(v, what, l)?),
        CpuStorage::BF16(v) => HostSlice::BF16(elems(v, what, l)?),
        other => {
            // The library names the mismatch against e's dtype; e itself is checked up front.
            return Err(CceCandleError::UnsupportedDType {
                what,
                expected: "f32, f16 or bf16 (the dtype of e)",
                got: other.dtype(),
            }
            .into());
        }
    };
    HostView::new(l.dims().to_vec(), data).map_err(cce)
}

/// Targets: borrowed when i32/i64, widened to i64 when u32.
enum TargetData<'a> {
    Slice(HostSlice<'a>),
    Wide(Vec<i64>),
}

impl TargetData<'_> {
    fn view(&self, dims: &[usize]) -> candle_core::Result<HostView<'_>> {
        let data = match self {
            TargetData::Slice(s) => *s,
            TargetData::Wide(v) => HostSlice::I64(v),
        };
        HostView::new(dims.to_vec(), data).map_err(cce)
    }
}

fn target_data<'a>(s: &'a Storage, l: &Layout) -> candle_core::Result<TargetData<'a>> {
    Ok(match cpu(s)? {
        CpuStorage::I64(v) => TargetData::Slice(HostSlice::I64(elems(v, "targets", l)?)),
        CpuStorage::I32(v) => TargetData::Slice(HostSlice::I32(elems(v, "targets", l)?)),
        CpuStorage::U32(v) => {
            TargetData::Wide(elems(v, "targets", l)?.iter().map(|&x| x as i64).collect())
        }
        other => {
            return Err(CceCandleError::UnsupportedDType {
                what: "targets",
                expected: "u32, i32 or i64",
                got: other.dtype(),
            }
            .into())
        }
    })
}

/// A borrowed view of a host tensor of ours.
fn host_view(t: &HostTensor) -> candle_core::Result<HostView<'_>> {
    let data = match t.data() {
        HostData::F32(v) => HostSlice::F32(v),
        HostData::F16(v) => HostSlice::F16(v),
        HostData::BF16(v) => HostSlice::BF16(v),
        HostData::I32(v) => HostSlice::I32(v),
        HostData::I64(v) => HostSlice::I64(v),
    };
    HostView::new(t.shape().to_vec(), data).map_err(cce)
}

/// A gradient of ours as a candle tensor of `shape`, its storage moved (no copy).
fn to_tensor(t: HostTensor, shape: &Shape, dev: &Device) -> candle_core::Result<Tensor> {
    match t.into_data() {
        HostData::F32(v) => Tensor::from_vec(v, shape, dev),
        HostData::F16(v) => Tensor::from_vec(v, shape, dev),
        HostData::BF16(v) => Tensor::from_vec(v, shape, dev),
        _ => Err(CceCandleError::Internal("an integer gradient").into()),
    }
}

/// The op without a bias: inputs `(e, c)`.
struct LceOp2(LceOp);

impl CustomOp2 for LceOp2 {
    fn name(&self) -> &'static str {
        "cut-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.0.forward_cpu((s1, l1), (s2, l2), None)
    }

    fn bwd(
        &self,
        e: &Tensor,
        c: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let (d_e, d_c, _) = self.0.backward(e, c, None, grad_res)?;
        Ok((d_e, d_c))
    }
}

/// The op with a bias: inputs `(e, c, bias)`.
struct LceOp3(LceOp);

impl CustomOp3 for LceOp3 {
    fn name(&self) -> &'static str {
        "cut-cross-entropy-bias"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.0.forward_cpu((s1, l1), (s2, l2), Some((s3, l3)))
    }

    fn bwd(
        &self,
        e: &Tensor,
        c: &Tensor,
        bias: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.0.backward(e, c, Some(bias), grad_res)
    }
}
