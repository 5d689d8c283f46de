//! Running on a framework's wgpu device: [`WgpuBackend::from_device`], views of the
//! framework's buffers ([`WgpuBackend::view`]), and calls that write into them
//! ([`WgpuBackend::forward_into`], [`WgpuBackend::backward_into`]).
//!
//! Offsets. A view starts at any byte offset that is a multiple of 4 (wgpu's copy alignment,
//! and the u32 words the shaders address). `e`, `c`, `bias` and the gradients are bound at the
//! offset rounded down to `min_storage_buffer_offset_alignment`, the remainder passed to the
//! shader in elements, so they are read and written in place at any such offset. The per-row
//! f32 arrays (`lse`, `rest_mass`, the losses, `d_loss` and `d_lse` of `Reduction::None`) are
//! bound per row chunk at offsets the shaders cannot shift; where a view of one of them does
//! not start at a multiple of the alignment, the call copies it on the device (4 bytes a row)
//! into an aligned scratch buffer before the passes (inputs) or from one after them (outputs).
//! An offset that is not a multiple of 4 is an `InvalidOption` error.

use super::WgpuBackend;
use crate::buffers::{padded, WgpuTensor};
use crate::context::Context;
use cce_core::{
    BackwardOutput, CceError, DType, ForwardOutput, Inputs, Options, Result, Saved, TensorMeta,
    Upstream,
};
use std::borrow::Cow;
use std::sync::Arc;

/// Caller-owned destinations for the outputs of [`WgpuBackend::forward_into`]: views
/// ([`WgpuBackend::view`]) of buffers on the backend's device, or `None` for the call to
/// allocate. Each must hold the output's element count in its dtype: `loss` 1 f32 for mean/sum
/// (shape `[]` or `[1]`) and `N` f32 for `Reduction::None`; `lse` and `rest_mass` `N` f32.
#[derive(Clone, Debug, Default)]
pub struct ForwardDest {
    /// The loss.
    pub loss: Option<WgpuTensor>,
    /// The per-row log-sum-exp.
    pub lse: Option<WgpuTensor>,
    /// The per-row non-target mass `1 − p_y`.
    pub rest_mass: Option<WgpuTensor>,
}

/// Caller-owned destinations for the gradients of [`WgpuBackend::backward_into`], each used
/// only when that gradient is computed: `d_e` `N·D`, `d_c` `V·D`, `d_bias` `V` elements, in the
/// gradient dtype (`Options::grad_dtype`: the input dtype or f32).
#[derive(Clone, Debug, Default)]
pub struct BackwardDest {
    /// `∂L/∂e`.
    pub d_e: Option<WgpuTensor>,
    /// `∂L/∂c`.
    pub d_c: Option<WgpuTensor>,
    /// `∂L/∂bias`.
    pub d_bias: Option<WgpuTensor>,
}

/// A per-row (or scalar) f32 output: `work` is where the passes write; `dest`, when set, is
/// the caller's unaligned view that `work` is copied into at the end.
pub(crate) struct RowOut {
    pub work: WgpuTensor,
    dest: Option<WgpuTensor>,
}

impl RowOut {
    /// Record the copy of `work` into the caller's view, if any.
    pub fn copy_out(&self, enc: &mut wgpu::CommandEncoder) {
        if let Some(d) = &self.dest {
            let bytes = padded(d.size_bytes());
            enc.copy_buffer_to_buffer(&self.work.buf, 0, &d.buf, d.offset, bytes);
        }
    }

    /// The output as the caller sees it: its view, or the tensor the call allocated.
    pub fn into_result(self) -> WgpuTensor {
        self.dest.unwrap_or(self.work)
    }
}

fn check_dest(
    ctx: &Context,
    t: &WgpuTensor,
    what: &'static str,
    numel: usize,
    dtype: DType,
) -> Result<()> {
    ctx.check_own(t, what)?;
    if t.numel() != numel {
        return Err(CceError::ShapeMismatch {
            what,
            expected: format!("{numel} elements"),
            got: format!("{:?}", t.shape()),
        });
    }
    if t.dtype() != dtype {
        return Err(CceError::DTypeMismatch {
            what,
            expected: dtype.to_string(),
            got: t.dtype(),
        });
    }
    Ok(())
}

impl WgpuBackend {
    /// Our kernels on a device and queue someone else opened: a framework's (burn's, through
    /// cubecl-wgpu's `WgpuSetup`), so that they read and write its buffers with no copy.
    ///
    /// The adapter info, limits and features come from the device (those it was created with,
    /// which bound our chunking); the kernel configuration is the default one for its adapter
    /// type. Work is submitted on `queue` after the owner's submitted work, and every call
    /// waits until the device is idle before it returns (as with [`WgpuBackend::new`]), so the
    /// owner's later work sees our outputs; the owner must submit (flush) its pending work on
    /// our inputs before a call.
    ///
    /// Unlike [`WgpuBackend::new`], no device-lost or uncaptured-error callback is installed
    /// (wgpu keeps one of each per device, and the owner's stay in place). Our calls run inside
    /// wgpu error scopes, which are per thread, so their errors are still typed errors of the
    /// call and never reach the owner's handler; a device loss is seen as a failed poll or
    /// mapping (`Backend` error).
    ///
    /// Errors: `ResourceLimit` or `Unsupported` when the device's limits (workgroup memory,
    /// invocations, storage offset alignment) do not fit the default tiles, `Backend` when the
    /// device rejects the backend's one small buffer.
    ///
    /// ```no_run
    /// # fn main() -> cce_core::Result<()> {
    /// let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle());
    /// let adapter = pollster::block_on(instance.request_adapter(&Default::default())).unwrap();
    /// let (device, queue) = pollster::block_on(adapter.request_device(&Default::default())).unwrap();
    /// let cce = cce_wgpu::WgpuBackend::from_device(device.clone(), queue.clone())?;
    /// assert!(!cce.owns_device());
    /// # Ok(())
    /// # }
    /// ```
    pub fn from_device(device: wgpu::Device, queue: wgpu::Queue) -> Result<Self> {
        let ctx = Arc::new(Context::borrow(device, queue)?);
        let cfg = Self::default_config(&ctx);
        Self::check_cfg(&ctx, &cfg)?;
        Ok(Self { ctx, cfg })
    }

    /// Whether this backend opened its device ([`WgpuBackend::new`]) rather than borrowing one
    /// ([`WgpuBackend::from_device`]).
    pub fn owns_device(&self) -> bool {
        self.ctx.owns_device
    }

    /// A tensor of `shape` x `dtype` over the bytes of `buffer` from `offset` on, without a
    /// copy: a framework's tensor, as this backend's input or output. Row-major and
    /// contiguous, in the layout of [`WgpuTensor`]; the view keeps `buffer` alive (wgpu
    /// buffers are reference counted), not the framework's allocation inside it, so the caller
    /// keeps that allocation for as long as calls use the view.
    ///
    /// `buffer` must belong to this backend's device (another device's buffer fails the call
    /// that binds it, with a `Backend` error) and have the usages STORAGE, COPY_SRC and
    /// COPY_DST. The view covers `offset .. offset + bytes` rounded up to a multiple of 4: an
    /// output of an odd number of f16/bf16 elements writes the two bytes after its end.
    ///
    /// Errors: `InvalidOption` when `offset` is not a multiple of 4 (wgpu copies need 4-byte
    /// offsets, and a 16-bit tensor starting mid-word would share its first word with the
    /// caller's other data) or a usage is missing; `ShapeMismatch` when the buffer holds fewer
    /// bytes; `ResourceLimit` when the shape's size overflows.
    pub fn view(
        &self,
        buffer: &wgpu::Buffer,
        offset: u64,
        dtype: DType,
        shape: Vec<usize>,
    ) -> Result<WgpuTensor> {
        if !offset.is_multiple_of(4) {
            return Err(CceError::InvalidOption {
                name: "buffer view offset",
                reason: format!("{offset} is not a multiple of 4 bytes"),
            });
        }
        let need = wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_SRC
            | wgpu::BufferUsages::COPY_DST;
        if !buffer.usage().contains(need) {
            return Err(CceError::InvalidOption {
                name: "buffer view usage",
                reason: format!("{:?} lacks some of {need:?}", buffer.usage()),
            });
        }
        let bytes = padded(cce_core::checked_bytes(&shape, dtype)? as u64);
        if offset
            .checked_add(bytes)
            .is_none_or(|end| end > buffer.size())
        {
            return Err(CceError::ShapeMismatch {
                what: "buffer view",
                expected: format!("{bytes} bytes for {shape:?} x {dtype} from offset {offset}"),
                got: format!("a buffer of {} bytes", buffer.size()),
            });
        }
        Ok(WgpuTensor::from_parts(
            buffer.clone(),
            offset,
            dtype,
            shape,
            self.ctx.id,
        ))
    }

    /// [`cce_core::Backend::forward`] with the loss, lse and rest mass written into `dest`
    /// where given (see [`ForwardDest`]); the returned [`ForwardOutput`] holds those views.
    ///
    /// Errors: those of `forward`; `ForeignBuffer` for a destination from another backend,
    /// `ShapeMismatch` / `DTypeMismatch` for one of the wrong size or dtype. Destinations may
    /// have been written when an input error is found after the passes (`NonFinite`,
    /// `TargetMasked`).
    pub fn forward_into(
        &self,
        inputs: &Inputs<'_, WgpuTensor>,
        opts: &Options,
        dest: &ForwardDest,
    ) -> Result<ForwardOutput<WgpuTensor>> {
        self.ctx
            .scoped("forward", || self.forward_impl(inputs, opts, dest))
    }

    /// [`cce_core::Backend::backward`] with the gradients written into `dest` where given
    /// (see [`BackwardDest`]); the returned [`BackwardOutput`] holds those views.
    ///
    /// Errors: those of `backward`; `ForeignBuffer`, `ShapeMismatch` or `DTypeMismatch` for a
    /// destination as in [`WgpuBackend::forward_into`]. Destinations may have been written when
    /// a `NonFinite` is found after the passes (under `check_finite`: a saved state or per-row
    /// upstream gradient the CPU's rule rejects, or a non-finite gradient).
    pub fn backward_into(
        &self,
        inputs: &Inputs<'_, WgpuTensor>,
        opts: &Options,
        saved: Saved<'_, WgpuTensor>,
        upstream: &Upstream<'_, WgpuTensor>,
        dest: &BackwardDest,
    ) -> Result<BackwardOutput<WgpuTensor>> {
        self.ctx.scoped("backward", || {
            self.backward_impl(inputs, opts, saved, upstream, dest)
        })
    }

    /// Where a per-row (`shape` `[N]`) or scalar f32 output is computed: the caller's view
    /// when it may be bound where it is, else a scratch tensor copied into it at the end.
    pub(crate) fn row_out(
        &self,
        dest: Option<&WgpuTensor>,
        shape: Vec<usize>,
        what: &'static str,
    ) -> Result<RowOut> {
        let ctx = &self.ctx;
        match dest {
            Some(d) => {
                check_dest(ctx, d, what, shape.iter().product(), DType::F32)?;
                if ctx.is_bind_aligned(d.offset) {
                    Ok(RowOut {
                        work: d.clone(),
                        dest: None,
                    })
                } else {
                    Ok(RowOut {
                        work: ctx.alloc(shape, DType::F32, what)?,
                        dest: Some(d.clone()),
                    })
                }
            }
            None => Ok(RowOut {
                work: ctx.alloc(shape, DType::F32, what)?,
                dest: None,
            }),
        }
    }

    /// A per-row f32 input as the passes bind it: itself when aligned, else an aligned copy
    /// recorded into `enc` (which must run before the passes).
    pub(crate) fn row_in<'t>(
        &self,
        enc: &mut wgpu::CommandEncoder,
        t: &'t WgpuTensor,
        what: &str,
    ) -> Result<Cow<'t, WgpuTensor>> {
        if self.ctx.is_bind_aligned(t.offset) {
            return Ok(Cow::Borrowed(t));
        }
        let copy = self.ctx.alloc(t.shape().to_vec(), t.dtype(), what)?;
        enc.copy_buffer_to_buffer(&t.buf, t.offset, &copy.buf, 0, padded(t.size_bytes()));
        Ok(Cow::Owned(copy))
    }

    /// A gradient output: the caller's view (checked) or a new tensor.
    pub(crate) fn grad_out(
        &self,
        dest: Option<&WgpuTensor>,
        shape: Vec<usize>,
        dtype: DType,
        what: &'static str,
    ) -> Result<WgpuTensor> {
        match dest {
            Some(d) => {
                check_dest(&self.ctx, d, what, shape.iter().product(), dtype)?;
                Ok(d.clone())
            }
            None => self.ctx.alloc(shape, dtype, what),
        }
    }
}
