//! Our kernels on burn's wgpu device, in burn's buffers.
//!
//! A call takes each input's storage from cubecl (`Client::get_resource`: the wgpu buffer, the
//! byte offset and size of the tensor's allocation), allocates the outputs through cubecl
//! (`CubeTensor`s that burn owns), takes their storage the same way, and runs
//! `WgpuBackend::forward_into` / `backward_into` on views of those buffers. Nothing goes
//! through the host except what our engine reads itself: the targets (validated and prepared
//! on the host, 4 or 8 bytes a row), a 16-byte status word of the forward, and the scalar
//! upstream gradient of a mean or sum (4 bytes).
//!
//! Ordering. cubecl records burn's kernels into its own command encoder and submits them
//! lazily; `get_resource` submits the pending work of the streams that own the buffer, and the
//! `flush` before our call submits the rest of this thread's stream, so burn's work on our
//! inputs precedes ours on the shared queue. Our call then submits its passes on that queue
//! and waits until the device is idle (our engine reads its status word back), so when it
//! returns the outputs are written and any later burn work reads them. The storage handles
//! (`ManagedResource`) are held for the whole call: cubecl neither frees, reuses nor relocates
//! an allocation while one is held.

use crate::backend::cube::{CubeInputs, Forward, Grads, Saved};
use crate::kernels::{engine_options, NAME};
use burn::tensor::DType as BurnDType;
use burn_cubecl::cubecl::wgpu::{AutoCompiler, WgpuServer};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cce_core::{
    Backend as _, CceError, DLoss, DType, Inputs, Options, Reduction, Result, TensorMeta, Upstream,
};
use cce_wgpu::{BackwardDest, ForwardDest, WgpuBackend, WgpuTensor};

/// cubecl's server behind burn's wgpu devices (`WgpuRuntime`'s default compiler).
type Server = WgpuServer<AutoCompiler>;

/// The storage of a tensor (cubecl's `ManagedResource<WgpuResource>`, a type cubecl does not
/// re-export), held while our kernels use it.
type Held = Box<dyn std::any::Any>;

fn ours(dtype: BurnDType) -> Result<DType> {
    match dtype {
        BurnDType::F32 => Ok(DType::F32),
        BurnDType::F16 => Ok(DType::F16),
        BurnDType::BF16 => Ok(DType::BF16),
        BurnDType::I32 => Ok(DType::I32),
        BurnDType::I64 => Ok(DType::I64),
        other => Err(CceError::Unsupported {
            backend: NAME,
            what: format!("a {other:?} tensor on the zero-copy wgpu path"),
        }),
    }
}

/// One call's tensors as views of burn's buffers, and the storage they hold.
struct Views<'a> {
    engine: &'a WgpuBackend,
    held: Vec<Held>,
}

impl Views<'_> {
    /// A view of `t` (contiguous), holding its storage until the call ends.
    fn of(&mut self, t: &CubeTensor) -> Result<WgpuTensor> {
        let res = t
            .client
            .get_resource::<Server>(t.handle.clone())
            .map_err(|e| CceError::backend(NAME, format!("cubecl get_resource: {e:?}")))?;
        let dtype = ours(t.dtype)?;
        let shape = t.meta.shape().to_vec();
        let r = res.resource();
        let bytes = (shape.iter().product::<usize>() * dtype.size_bytes()) as u64;
        if r.size < bytes {
            return Err(CceError::backend(
                NAME,
                format!("cubecl storage of {} bytes for {bytes} bytes", r.size),
            ));
        }
        let view = self.engine.view(&r.buffer, r.offset, dtype, shape)?;
        self.held.push(Box::new(res));
        Ok(view)
    }

    /// A new burn tensor of `shape` x `dtype` on `like`'s device, and its view.
    fn output(
        &mut self,
        like: &CubeTensor,
        shape: Vec<usize>,
        dtype: BurnDType,
    ) -> Result<(CubeTensor, WgpuTensor)> {
        let t = empty_device_contiguous_dtype(
            like.client.clone(),
            like.device.clone(),
            shape.into(),
            dtype,
        );
        let view = self.of(&t)?;
        Ok((t, view))
    }

    /// Submit burn's pending work on this thread's stream before ours reads its buffers.
    fn flush(&self, like: &CubeTensor) -> Result<()> {
        like.client
            .flush()
            .map_err(|e| CceError::backend(NAME, format!("cubecl flush: {e:?}")))
    }
}

fn contiguous(t: CubeTensor) -> CubeTensor {
    burn_cubecl::kernel::into_contiguous(t)
}

/// [`crate::CceKernels::cce_forward`] in burn's buffers.
pub(in crate::backend::cube) fn forward(
    engine: &WgpuBackend,
    inputs: CubeInputs,
    opts: &Options,
) -> Result<Forward> {
    let opts = engine_options(opts);
    let CubeInputs {
        e,
        c,
        bias,
        targets,
    } = inputs;
    let (e, c, targets) = (contiguous(e), contiguous(c), contiguous(targets));
    let bias = bias.map(contiguous);
    let mut v = Views {
        engine,
        held: Vec::new(),
    };
    let (ev, cv, yv) = (v.of(&e)?, v.of(&c)?, v.of(&targets)?);
    let bv = bias.as_ref().map(|b| v.of(b)).transpose()?;
    let n = e.meta.shape().first().copied().unwrap_or(0);
    let loss_shape = if opts.reduction == Reduction::None {
        vec![n]
    } else {
        vec![1]
    };
    let (loss, loss_v) = v.output(&e, loss_shape, BurnDType::F32)?;
    let (lse, lse_v) = v.output(&e, vec![n], BurnDType::F32)?;
    let (rest_mass, rest_v) = v.output(&e, vec![n], BurnDType::F32)?;
    v.flush(&e)?;
    let inputs = Inputs {
        e: &ev,
        c: &cv,
        bias: bv.as_ref(),
        targets: &yv,
    };
    let dest = ForwardDest {
        loss: Some(loss_v),
        lse: Some(lse_v),
        rest_mass: Some(rest_v),
    };
    engine.forward_into(&inputs, &opts, &dest)?;
    Ok(Forward {
        loss,
        lse,
        rest_mass,
    })
}

/// [`crate::CceKernels::cce_backward`] in burn's buffers.
pub(in crate::backend::cube) fn backward(
    engine: &WgpuBackend,
    inputs: CubeInputs,
    saved: Saved,
    d_loss: CubeTensor,
    opts: &Options,
) -> Result<Grads> {
    let opts = engine_options(opts);
    let CubeInputs {
        e,
        c,
        bias,
        targets,
    } = inputs;
    let (e, c, targets) = (contiguous(e), contiguous(c), contiguous(targets));
    let bias = bias.map(contiguous);
    let (lse, rest_mass, d_loss) = (
        contiguous(saved.lse),
        contiguous(saved.rest_mass),
        contiguous(d_loss),
    );
    let mut v = Views {
        engine,
        held: Vec::new(),
    };
    let (ev, cv, yv) = (v.of(&e)?, v.of(&c)?, v.of(&targets)?);
    let bv = bias.as_ref().map(|b| v.of(b)).transpose()?;
    let (lse_v, rest_v, dl_v) = (v.of(&lse)?, v.of(&rest_mass)?, v.of(&d_loss)?);
    let grad = |v: &mut Views, like: &CubeTensor, want: bool| -> Result<_> {
        match want {
            true => v
                .output(like, like.meta.shape().to_vec(), like.dtype)
                .map(Some),
            false => Ok(None),
        }
    };
    let d_e = grad(&mut v, &e, opts.compute_d_e)?;
    let d_c = grad(&mut v, &c, opts.compute_d_c)?;
    let d_bias = match &bias {
        Some(b) => grad(&mut v, b, opts.compute_d_c)?,
        None => None,
    };
    v.flush(&e)?;
    let d_loss = match opts.reduction {
        Reduction::None => DLoss::PerRow(&dl_v),
        Reduction::Mean | Reduction::Sum => {
            let host = engine.download(&dl_v)?.to_f32_vec();
            match host.as_slice() {
                [g] => DLoss::Scalar(*g),
                _ => {
                    return Err(CceError::ShapeMismatch {
                        what: "d_loss",
                        expected: "[1]".into(),
                        got: format!("{:?}", dl_v.shape()),
                    })
                }
            }
        }
    };
    let inputs = Inputs {
        e: &ev,
        c: &cv,
        bias: bv.as_ref(),
        targets: &yv,
    };
    let dest = BackwardDest {
        d_e: d_e.as_ref().map(|x| x.1.clone()),
        d_c: d_c.as_ref().map(|x| x.1.clone()),
        d_bias: d_bias.as_ref().map(|x| x.1.clone()),
    };
    let saved = cce_core::Saved {
        lse: &lse_v,
        rest_mass: &rest_v,
    };
    let upstream = Upstream {
        d_loss,
        d_lse: None,
    };
    engine.backward_into(&inputs, &opts, saved, &upstream, &dest)?;
    Ok(Grads {
        d_e: d_e.map(|x| x.0),
        d_c: d_c.map(|x| x.0),
        d_bias: d_bias.map(|x| x.0),
    })
}
