//! Our CUDA kernels in burn's CUDA buffers.
//!
//! Device pointers. cubecl-cuda keeps a tensor in a slice of a pooled device allocation.
//! `Client::get_resource::<CudaServer>(handle)` resolves the handle's binding on the stream
//! that owns it and returns a `ManagedResource<GpuResource>`: `ptr` is the `CUdeviceptr` of the
//! tensor's first byte (the allocation's address plus the slice's and the handle's offsets),
//! `size` its bytes, and while the `ManagedResource` is held cubecl neither frees, reuses nor
//! moves the allocation. The address goes to our backend as a raw `u64`
//! (`CudaTensor::borrowed`): no cudarc object crosses from cubecl to us (both are built on the
//! one cudarc 0.19.10 of the lock, but cubecl's driver handles are private to its server).
//! Outputs (loss, lse, rest mass, gradients) are allocated through cubecl, so burn owns them,
//! and lent the same way; our kernels write them in place. No tensor is copied, except on the
//! device an input that is not contiguous (`into_contiguous`; cubecl's default layout pads the
//! rows of some widths) or whose address lacks the alignment our kernels load with (16 bytes
//! for floats; never for cubecl's own allocations, which are aligned to 512 bytes).
//!
//! Streams and host synchronizations. cubecl 0.11 runs each thread's work on a non-blocking
//! stream it creates and keeps private: neither the `CUstream` nor an event on it is
//! reachable through `Client` (which offers `sync`, `flush` and reads), so our work cannot be
//! enqueued behind burn's on the device. It runs on our backend's own stream instead, ordered
//! by two host waits per call:
//! 1. before our kernels: `Client::sync` returns once the device has finished everything cubecl
//!    enqueued on this thread's stream, which includes the waits `get_resource` added for the
//!    streams the inputs came from. Our kernels then read finished inputs, and write outputs
//!    whose memory no earlier cubecl kernel still uses. (cubecl submits a launch to its server
//!    thread asynchronously; the sync is queued behind them.) A mean or sum backward reads its
//!    upstream gradient (4 bytes) through cubecl instead, which waits the same way;
//! 2. after our kernels: `CudaBackend::status` waits for our stream and reads its 256-byte
//!    status (the checks run on the device under `Checks::Deferred`, so a bad target is the
//!    call's typed error). burn's next kernels, enqueued after the call returns, then read
//!    written outputs, and the storage is given back to cubecl only then.
//!
//! What the in-place path reads back: the status (256 bytes a call), the scalar upstream
//! gradient of a mean or sum (4 bytes), and, for a filtered backward that tries the sparse
//! path, its kept-entry count (`cce_cuda` docs). [`super::cuda_host_syncs`] counts the waits.

use crate::backend::cube::{CubeInputs, Forward, Grads, Saved};
use crate::kernels::{engine_options, NAME};
use burn::tensor::DType as BurnDType;
use burn_cubecl::cubecl::future::block_on;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cce_core::{CceError, DLoss, DType, Inputs, Options, Reduction, Result, Upstream};
use cce_cuda::{required_alignment, Checks, CudaBackend, CudaTensor, ForwardInto, GradsInto};
use cubecl_cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;
use std::any::Any;

/// cubecl's server behind burn's CUDA devices.
type Server = <CudaRuntime as Runtime>::Server;

fn ours(dtype: BurnDType) -> Result<DType> {
    match dtype {
        BurnDType::F32 => Ok(DType::F32),
        BurnDType::F16 => Ok(DType::F16),
        BurnDType::BF16 => Ok(DType::BF16),
        BurnDType::I32 => Ok(DType::I32),
        BurnDType::I64 => Ok(DType::I64),
        other => Err(CceError::Unsupported {
            backend: NAME,
            what: format!("a {other:?} tensor on the in-place CUDA path"),
        }),
    }
}

fn cubecl_error(what: &str, e: impl std::fmt::Debug) -> CceError {
    CceError::backend(NAME, format!("cubecl {what}: {e:?}"))
}

/// One call's burn tensors lent to our backend, and the cubecl storage they hold.
struct Lender<'a> {
    be: &'a CudaBackend,
    /// `ManagedResource<GpuResource>`s (a cubecl type not named outside cubecl-cuda), held
    /// until our stream has finished with them.
    held: Vec<Box<dyn Any>>,
    /// Our stream was waited for after the last work enqueued on it.
    drained: bool,
}

impl Drop for Lender<'_> {
    fn drop(&mut self) {
        // A call that failed after enqueuing work: drain our stream before cubecl may reuse
        // the storage (`held` is dropped after this). The error, if any, is the call's.
        if !self.drained && !self.held.is_empty() {
            super::count_sync();
            let _ = self.be.synchronize();
        }
    }
}

impl<'a> Lender<'a> {
    fn new(be: &'a CudaBackend) -> Self {
        Self {
            be,
            held: Vec::new(),
            drained: false,
        }
    }

    /// The device address of `t`'s first byte and the storage holding it; `Backend` when the
    /// storage is smaller than `bytes`.
    fn resource(t: &CubeTensor, bytes: usize) -> Result<(u64, Box<dyn Any>)> {
        let res = t
            .client
            .get_resource::<Server>(t.handle.clone())
            .map_err(|e| cubecl_error("get_resource", e))?;
        let r = res.resource();
        if r.size < bytes as u64 {
            return Err(CceError::backend(
                NAME,
                format!("cubecl storage of {} bytes for {bytes} bytes", r.size),
            ));
        }
        let ptr = r.ptr;
        Ok((ptr, Box::new(res)))
    }

    /// `t` (made contiguous) as one of our tensors over its cubecl storage, and the burn tensor
    /// whose storage it is (a device copy of `t` when `t`'s address is not aligned as our
    /// kernels need).
    fn lend(&mut self, t: CubeTensor) -> Result<(CubeTensor, CudaTensor)> {
        let t = burn_cubecl::kernel::into_contiguous(t);
        let dtype = ours(t.dtype)?;
        let shape = t.meta.shape().to_vec();
        let bytes = cce_core::checked_bytes(&shape, dtype)?;
        let align = required_alignment(dtype) as u64;
        let (t, (ptr, res)) = match Self::resource(&t, bytes)? {
            (ptr, res) if ptr.is_multiple_of(align) => (t, (ptr, res)),
            _ => {
                let copy = burn_cubecl::kernel::into_contiguous(t.copy());
                let found = Self::resource(&copy, bytes)?;
                (copy, found)
            }
        };
        self.held.push(res);
        // SAFETY: `ptr` addresses `bytes` bytes (checked against the storage's size) of one
        // allocation cubecl made in the device's primary context, the context of our backend's
        // stream. Lifetime: the storage is held (`held`) until our stream has finished the call
        // (`status` on success, the drain in `Drop` otherwise). Order: cubecl's writes of the
        // inputs and its last use of an output's memory are complete before our first launch
        // (`wait_for_cubecl`), and burn reads the outputs only after `status` waited for our
        // stream. Aliasing: every output is a fresh cubecl allocation, disjoint from the inputs
        // and from each other.
        let lent = unsafe { CudaTensor::borrowed(self.be.stream(), ptr, dtype, shape) }?;
        Ok((t, lent))
    }

    /// A new contiguous burn tensor of `shape` x `dtype` on `like`'s device, lent.
    fn output(
        &mut self,
        like: &CubeTensor,
        shape: Vec<usize>,
        dtype: BurnDType,
    ) -> Result<(CubeTensor, CudaTensor)> {
        let t = empty_device_contiguous_dtype(
            like.client.clone(),
            like.device.clone(),
            shape.into(),
            dtype,
        );
        self.lend(t)
    }

    /// Wait until the device has finished cubecl's work on this thread's stream.
    fn wait_for_cubecl(&self, like: &CubeTensor) -> Result<()> {
        super::count_sync();
        block_on(like.client.sync()).map_err(|e| cubecl_error("sync", e))
    }

    /// Wait for our stream and read the call's checks: the recorded error, if any.
    fn finish(&mut self) -> Result<()> {
        super::count_sync();
        self.drained = true;
        self.be.status().map(|_| ())
    }
}

/// A call's inputs: the burn tensors whose storage is lent (kept for the call), and ours.
struct Lent {
    e: (CubeTensor, CudaTensor),
    c: (CubeTensor, CudaTensor),
    bias: Option<(CubeTensor, CudaTensor)>,
    targets: (CubeTensor, CudaTensor),
}

impl Lent {
    fn new(l: &mut Lender<'_>, inputs: CubeInputs) -> Result<Self> {
        Ok(Self {
            e: l.lend(inputs.e)?,
            c: l.lend(inputs.c)?,
            bias: inputs.bias.map(|b| l.lend(b)).transpose()?,
            targets: l.lend(inputs.targets)?,
        })
    }

    fn inputs(&self) -> Inputs<'_, CudaTensor> {
        Inputs {
            e: &self.e.1,
            c: &self.c.1,
            bias: self.bias.as_ref().map(|b| &b.1),
            targets: &self.targets.1,
        }
    }

    /// Rows of `e`.
    fn rows(&self) -> usize {
        self.e.0.meta.shape().first().copied().unwrap_or(0)
    }
}

/// The f32 scalar of a `[1]` tensor, read through cubecl: the read is enqueued on this
/// thread's stream behind cubecl's work, so it returns once that work is done (the wait
/// `Lender::wait_for_cubecl` makes otherwise).
fn read_scalar(t: CubeTensor) -> Result<f32> {
    let t = burn_cubecl::kernel::into_contiguous(t);
    if t.meta.shape().iter().product::<usize>() != 1 {
        return Err(CceError::ShapeMismatch {
            what: "d_loss",
            expected: "[1]".into(),
            got: format!("{:?}", t.meta.shape()),
        });
    }
    super::count_sync();
    let bytes = t
        .client
        .read_one(t.handle.clone())
        .map_err(|e| cubecl_error("read of d_loss", e))?;
    match bytes.get(..4) {
        Some(&[a, b, c, d]) => Ok(f32::from_le_bytes([a, b, c, d])),
        _ => Err(CceError::backend(
            NAME,
            "cubecl read of d_loss: fewer than 4 bytes",
        )),
    }
}

/// [`crate::CceKernels::cce_forward`] in burn's buffers, on our backend `kept`.
pub(in crate::backend::cube) fn forward(
    kept: &super::Kept,
    inputs: CubeInputs,
    opts: &Options,
) -> Result<Forward> {
    let opts = engine_options(opts);
    let mut be = super::lock(kept);
    be.set_checks(Checks::Deferred);
    let be = &*be;
    let mut l = Lender::new(be);
    let x = Lent::new(&mut l, inputs)?;
    let n = x.rows();
    let loss_shape = if opts.reduction == Reduction::None {
        vec![n]
    } else {
        vec![1]
    };
    let like = &x.e.0;
    let (loss, mut loss_l) = l.output(like, loss_shape, BurnDType::F32)?;
    let (lse, mut lse_l) = l.output(like, vec![n], BurnDType::F32)?;
    let (rest_mass, mut rest_l) = l.output(like, vec![n], BurnDType::F32)?;
    l.wait_for_cubecl(like)?;
    let out = ForwardInto {
        loss: &mut loss_l,
        lse: &mut lse_l,
        rest_mass: &mut rest_l,
        entropy: None,
        argmax: None,
    };
    let run = be.forward_into(&x.inputs(), &opts, out);
    let checked = l.finish();
    run?;
    checked?;
    Ok(Forward {
        loss,
        lse,
        rest_mass,
    })
}

/// [`crate::CceKernels::cce_backward`] in burn's buffers, on our backend `kept`.
pub(in crate::backend::cube) fn backward(
    kept: &super::Kept,
    inputs: CubeInputs,
    saved: Saved,
    d_loss: CubeTensor,
    opts: &Options,
) -> Result<Grads> {
    let opts = engine_options(opts);
    let mut be = super::lock(kept);
    be.set_checks(Checks::Deferred);
    let be = &*be;
    let mut l = Lender::new(be);
    let x = Lent::new(&mut l, inputs)?;
    let lse = l.lend(saved.lse)?;
    let rest_mass = l.lend(saved.rest_mass)?;
    let grad = |l: &mut Lender<'_>, of: &CubeTensor, want: bool| -> Result<_> {
        match want {
            true => l.output(of, of.meta.shape().to_vec(), of.dtype).map(Some),
            false => Ok(None),
        }
    };
    let mut d_e = grad(&mut l, &x.e.0, opts.compute_d_e)?;
    let mut d_c = grad(&mut l, &x.c.0, opts.compute_d_c)?;
    let mut d_bias = match &x.bias {
        Some(b) => grad(&mut l, &b.0, opts.compute_d_c)?,
        None => None,
    };
    // Per row the upstream gradient is lent; a mean's or sum's scalar is read to the host,
    // which waits for cubecl's stream in place of `wait_for_cubecl`.
    let per_row;
    let d_loss = match opts.reduction {
        Reduction::None => {
            per_row = l.lend(d_loss)?;
            l.wait_for_cubecl(&x.e.0)?;
            DLoss::PerRow(&per_row.1)
        }
        Reduction::Mean | Reduction::Sum => DLoss::Scalar(read_scalar(d_loss)?),
    };
    let out = GradsInto {
        d_e: d_e.as_mut().map(|g| &mut g.1),
        d_c: d_c.as_mut().map(|g| &mut g.1),
        d_bias: d_bias.as_mut().map(|g| &mut g.1),
        accumulate: false,
    };
    let saved = cce_core::Saved {
        lse: &lse.1,
        rest_mass: &rest_mass.1,
    };
    let upstream = Upstream {
        d_loss,
        d_lse: None,
    };
    let run = be.backward_into(&x.inputs(), &opts, saved, &upstream, out);
    let checked = l.finish();
    run?;
    checked?;
    Ok(Grads {
        d_e: d_e.map(|g| g.0),
        d_c: d_c.map(|g| g.0),
        d_bias: d_bias.map(|g| g.0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_dtypes_and_the_rest() {
        assert_eq!(ours(BurnDType::BF16).unwrap(), DType::BF16);
        assert_eq!(ours(BurnDType::I64).unwrap(), DType::I64);
        assert!(matches!(
            ours(BurnDType::F64),
            Err(CceError::Unsupported { .. })
        ));
    }
}
