//! # cce-candle-cuda: cut cross-entropy on candle's CUDA tensors
//!
//! [`linear_cross_entropy`] and [`linear_cross_entropy_with_bias`] as in `cce_candle` (same
//! [`LceOptions`], shapes, dtypes and errors), on candle's CUDA device through our CUDA backend;
//! tensors on candle's CPU device go to `cce_candle` itself.
//!
//! The path (Wijmans et al. 2024, arXiv 2411.09009, on the GPU):
//! 1. candle's stream: `CudaDevice::cuda_stream()`; our backend runs on it
//!    ([`CudaBackend::on_stream`]), so the call is ordered after the ops that produced its
//!    inputs and before those that consume its outputs (compiled kernels are cached per
//!    device, so a backend per call is cheap); its checks are eager ([`Checks::Eager`]: one
//!    read of the device status per call), so that a bad target is candle's `Err` at the call;
//! 2. inputs: candle's `CudaSlice`s viewed at their layout's offset and used in place
//!    ([`CudaTensor::borrowed_view`]: never copied, never freed by us); u32 targets are cast
//!    to i64 by candle first (our kernels take i32/i64);
//! 3. outputs: the loss and the gradients are allocated by candle (its device, its stream) and
//!    lent to our backend, which writes them in place ([`CudaBackend::forward_into`],
//!    [`CudaBackend::backward_into`]): no copy, no second buffer;
//! 4. the forward keeps the per-row lse and rest mass (`8N` bytes of device memory) in the op;
//!    the backward recomputes the logits from them, as on the CPU (`cce_candle`'s docs say why
//!    recompute, not eager). The upstream scalar of a mean/sum is read back (4 bytes).
//!
//! Status: `cargo check` and `cargo clippy -- -D warnings` pass against candle-core 0.11.1
//! with `cuda` (candle-kernels built by nvcc 13.0 for sm_90a); not yet run on a GPU. The
//! README gives the build.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, DevicePtrMut, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, CudaDevice};
use candle_core::op::BackpropOp;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp2, CustomOp3, DType as CDType, Device, Layout, Shape, Storage,
    Tensor,
};
use cut_cross_entropy::cce_cuda::{Checks, CudaBackend, CudaTensor, ForwardInto, GradsInto};
use cut_cross_entropy::{CceError, DLoss, DType, Inputs, Options, Reduction, Saved, Upstream};
use std::sync::{Arc, Mutex};

pub use cce_candle::{CceCandleError, LceOptions};

fn cce(e: CceError) -> candle_core::Error {
    CceCandleError::Cce(e).into()
}

/// `cce_candle::linear_cross_entropy` on CUDA tensors (our CUDA backend on candle's stream)
/// and on CPU tensors (`cce_candle`). Same shapes, dtypes, options and errors.
pub fn linear_cross_entropy(
    e: &Tensor,
    c: &Tensor,
    targets: &Tensor,
    opts: &LceOptions,
) -> candle_core::Result<Tensor> {
    if !e.device().is_cuda() {
        return cce_candle::linear_cross_entropy(e, c, targets, opts);
    }
    let op = CudaLce::new(e, targets, opts)?;
    e.contiguous()?.apply_op2(&c.contiguous()?, CudaLce2(op))
}

/// `cce_candle::linear_cross_entropy_with_bias` on CUDA and CPU tensors, as
/// [`linear_cross_entropy`].
pub fn linear_cross_entropy_with_bias(
    e: &Tensor,
    c: &Tensor,
    bias: &Tensor,
    targets: &Tensor,
    opts: &LceOptions,
) -> candle_core::Result<Tensor> {
    if !e.device().is_cuda() {
        return cce_candle::linear_cross_entropy_with_bias(e, c, bias, targets, opts);
    }
    let op = CudaLce::new(e, targets, opts)?;
    e.contiguous()?
        .apply_op3(&c.contiguous()?, &bias.contiguous()?, CudaLce3(op))
}

struct CudaLce {
    opts: Options,
    /// i32/i64 (u32 cast to i64), contiguous. Not an op input, so candle does not check its
    /// device: `forward` requires a CUDA storage (`DeviceMismatch` otherwise).
    targets: Tensor,
    /// lse and rest mass of the forward, `[N]` f32 each, on the device.
    saved: Mutex<Option<(CudaTensor, CudaTensor)>>,
}

/// The library dtype of a candle dtype our kernels take.
fn lib_dtype(what: &'static str, dt: CDType) -> candle_core::Result<DType> {
    Ok(match dt {
        CDType::F32 => DType::F32,
        CDType::F16 => DType::F16,
        CDType::BF16 => DType::BF16,
        CDType::I32 => DType::I32,
        CDType::I64 => DType::I64,
        got => {
            return Err(CceCandleError::UnsupportedDType {
                what,
                expected: "f32, f16 or bf16 (e, c, bias); u32, i32 or i64 (targets)",
                got,
            }
            .into())
        }
    })
}

/// A candle CUDA storage used in place as one of our tensors.
fn borrow(
    stream: &Arc<CudaStream>,
    what: &'static str,
    s: &CudaStorage,
    l: &Layout,
) -> candle_core::Result<CudaTensor> {
    let Some((start, end)) = l.contiguous_offsets() else {
        return Err(cce(CceError::ShapeMismatch {
            what,
            expected: "a contiguous row-major tensor".into(),
            got: format!("strides {:?}", l.stride()),
        }));
    };
    let dims = l.dims().to_vec();
    let dtype = lib_dtype(what, s.dtype())?;
    fn view<T: CudaDType>(
        stream: &Arc<CudaStream>,
        s: &CudaStorage,
        range: std::ops::Range<usize>,
        dtype: DType,
        dims: Vec<usize>,
    ) -> candle_core::Result<CudaTensor> {
        let slice = s.as_cuda_slice::<T>()?;
        let view = slice.slice(range);
        // SAFETY: the view holds the tensor's elements (the layout's contiguous range of the
        // storage). Lifetime: candle frees a storage on its device's one stream, the stream
        // this call's work is enqueued on, so a free after the call is ordered after it.
        // Order: candle wrote the inputs on that same stream. Aliasing: the outputs are fresh
        // allocations (candle's for the loss and the gradients, the backend's for lse and rest
        // mass).
        unsafe { CudaTensor::borrowed_view(stream, &view, dtype, dims) }.map_err(cce)
    }
    match dtype {
        DType::F32 => view::<f32>(stream, s, start..end, dtype, dims),
        DType::F16 => view::<half::f16>(stream, s, start..end, dtype, dims),
        DType::BF16 => view::<half::bf16>(stream, s, start..end, dtype, dims),
        DType::I32 => view::<i32>(stream, s, start..end, dtype, dims),
        DType::I64 => view::<i64>(stream, s, start..end, dtype, dims),
    }
}

/// An output buffer allocated by candle on its device (its stream), and the same memory lent to
/// our backend, which writes every element of it (`forward_into`, `backward_into`).
struct Output {
    storage: CudaStorage,
    lent: CudaTensor,
}

impl Output {
    fn new(
        dev: &CudaDevice,
        stream: &Arc<CudaStream>,
        dtype: DType,
        numel: usize,
    ) -> candle_core::Result<Self> {
        fn alloc<T: CudaDType + DeviceRepr>(
            dev: &CudaDevice,
            stream: &Arc<CudaStream>,
            dtype: DType,
            numel: usize,
        ) -> candle_core::Result<Output> {
            // SAFETY: uninitialized device memory of `numel` elements; our backend overwrites
            // every element before anything reads it (`ForwardInto`, `GradsInto`: no
            // accumulation), and on an error the storage is dropped unread.
            let mut slice = unsafe { dev.alloc::<T>(numel)? };
            let (ptr, record) = slice.device_ptr_mut(stream);
            // SAFETY: `ptr` addresses `numel` elements of `T` of one allocation of `stream`'s
            // context; the allocation lives in `storage` (returned with the lent tensor, and
            // kept until the call is enqueued; candle frees it later on the same stream, after
            // the call); nothing else reads or writes it during the call; it aliases no input.
            let lent =
                unsafe { CudaTensor::borrowed(stream, ptr, dtype, vec![numel]) }.map_err(cce)?;
            drop(record);
            Ok(Output {
                storage: CudaStorage::wrap_cuda_slice(slice, dev.clone()),
                lent,
            })
        }
        match dtype {
            DType::F32 => alloc::<f32>(dev, stream, dtype, numel),
            DType::F16 => alloc::<half::f16>(dev, stream, dtype, numel),
            DType::BF16 => alloc::<half::bf16>(dev, stream, dtype, numel),
            DType::I32 => alloc::<i32>(dev, stream, dtype, numel),
            DType::I64 => alloc::<i64>(dev, stream, dtype, numel),
        }
    }
}

fn cuda_storage(s: &Storage) -> candle_core::Result<&CudaStorage> {
    match s {
        Storage::Cuda(s) => Ok(s),
        _ => Err(CceCandleError::DeviceMismatch {
            what: "an input",
            expected: "cuda".into(),
            got: "another device".into(),
        }
        .into()),
    }
}

impl CudaLce {
    fn new(e: &Tensor, targets: &Tensor, opts: &LceOptions) -> candle_core::Result<Self> {
        if !targets.device().same_device(e.device()) {
            return Err(CceCandleError::DeviceMismatch {
                what: "targets",
                expected: format!("{:?}", e.device().location()),
                got: format!("{:?}", targets.device().location()),
            }
            .into());
        }
        let targets = match targets.dtype() {
            CDType::U32 => targets.to_dtype(CDType::I64)?,
            _ => targets.clone(),
        };
        Ok(Self {
            opts: opts.to_options(),
            targets: targets.contiguous()?,
            saved: Mutex::new(None),
        })
    }

    fn forward(
        &self,
        e: (&CudaStorage, &Layout),
        c: (&CudaStorage, &Layout),
        bias: Option<(&CudaStorage, &Layout)>,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = e.0.device().clone();
        let stream = dev.cuda_stream();
        let backend = CudaBackend::on_stream(stream.clone())
            .map_err(cce)?
            .with_checks(Checks::Eager);
        let (ts, tl) = self.targets.storage_and_layout();
        let t = borrow(&stream, "targets", cuda_storage(&ts)?, tl)?;
        let e_t = borrow(&stream, "e", e.0, e.1)?;
        let c_t = borrow(&stream, "c", c.0, c.1)?;
        let b_t = bias
            .map(|(s, l)| borrow(&stream, "bias", s, l))
            .transpose()?;
        let inputs = Inputs {
            e: &e_t,
            c: &c_t,
            bias: b_t.as_ref(),
            targets: &t,
        };
        let lead = &e.1.dims()[..e.1.dims().len().saturating_sub(1)];
        let n = lead.iter().product::<usize>();
        let shape = match self.opts.reduction {
            Reduction::None => Shape::from(lead),
            _ => Shape::from(()),
        };
        let mut loss = Output::new(&dev, &stream, DType::F32, shape.elem_count())?;
        let mut lse = backend.alloc_tensor(vec![n], DType::F32).map_err(cce)?;
        let mut rest = backend.alloc_tensor(vec![n], DType::F32).map_err(cce)?;
        backend
            .forward_into(
                &inputs,
                &self.opts,
                ForwardInto {
                    loss: &mut loss.lent,
                    lse: &mut lse,
                    rest_mass: &mut rest,
                    entropy: None,
                    argmax: None,
                },
            )
            .map_err(cce)?;
        *self.saved.lock().unwrap_or_else(|p| p.into_inner()) = Some((lse, rest));
        Ok((loss.storage, shape))
    }

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
        let grad = grad_res
            .to_dtype(CDType::F32)?
            .flatten_all()?
            .contiguous()?;
        let scalar = match opts.reduction {
            Reduction::None => None,
            _ => Some(grad.to_vec1::<f32>()?.first().copied().unwrap_or(0.0)),
        };
        let Device::Cuda(dev) = e.device() else {
            return Err(CceCandleError::Internal("a CUDA op's input left the device").into());
        };
        let stream = dev.cuda_stream();
        let backend = CudaBackend::on_stream(stream.clone())
            .map_err(cce)?
            .with_checks(Checks::Eager);
        let saved = self.saved.lock().unwrap_or_else(|p| p.into_inner());
        let Some((lse, rest)) = saved.as_ref() else {
            return Err(CceCandleError::Internal("backward before its forward").into());
        };
        let (es, el) = e.storage_and_layout();
        let (cs, cl) = c.storage_and_layout();
        let bias_sl = bias.map(|b| b.storage_and_layout());
        let (gs, gl) = grad.storage_and_layout();
        let (ts, tl) = self.targets.storage_and_layout();
        let e_t = borrow(&stream, "e", cuda_storage(&es)?, el)?;
        let c_t = borrow(&stream, "c", cuda_storage(&cs)?, cl)?;
        let b_t = match &bias_sl {
            Some((s, l)) => Some(borrow(&stream, "bias", cuda_storage(s)?, l)?),
            None => None,
        };
        let t_t = borrow(&stream, "targets", cuda_storage(&ts)?, tl)?;
        let g_t = borrow(&stream, "d_loss", cuda_storage(&gs)?, gl)?;
        let inputs = Inputs {
            e: &e_t,
            c: &c_t,
            bias: b_t.as_ref(),
            targets: &t_t,
        };
        let upstream = Upstream {
            d_loss: match scalar {
                Some(s) => DLoss::Scalar(s),
                None => DLoss::PerRow(&g_t),
            },
            d_lse: None,
        };
        let grad_out = |want: bool, t: &Tensor| -> candle_core::Result<Option<Output>> {
            want.then(|| {
                Output::new(
                    dev,
                    &stream,
                    lib_dtype("gradient", t.dtype())?,
                    t.elem_count(),
                )
            })
            .transpose()
        };
        let mut d_e = grad_out(want_e, e)?;
        let mut d_c = grad_out(want_c, c)?;
        let mut d_bias = match bias {
            Some(b) => grad_out(want_c, b)?,
            None => None,
        };
        backend
            .backward_into(
                &inputs,
                &opts,
                Saved {
                    lse,
                    rest_mass: rest,
                },
                &upstream,
                GradsInto {
                    d_e: d_e.as_mut().map(|o| &mut o.lent),
                    d_c: d_c.as_mut().map(|o| &mut o.lent),
                    d_bias: d_bias.as_mut().map(|o| &mut o.lent),
                    accumulate: false,
                },
            )
            .map_err(cce)?;
        let tensor = |o: Option<Output>, like: &Tensor| {
            o.map(|o| {
                Tensor::from_storage(
                    Storage::Cuda(o.storage),
                    like.shape().clone(),
                    BackpropOp::none(),
                    false,
                )
            })
        };
        let d_bias = match bias {
            Some(b) => tensor(d_bias, b),
            None => None,
        };
        Ok((tensor(d_e, e), tensor(d_c, c), d_bias))
    }
}

fn not_cpu() -> candle_core::Error {
    CceCandleError::Internal("the CUDA op ran on the CPU (cce_candle handles CPU tensors)").into()
}

struct CudaLce2(CudaLce);

impl CustomOp2 for CudaLce2 {
    fn name(&self) -> &'static str {
        "cut-cross-entropy-cuda"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(not_cpu())
    }

    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        self.0.forward((s1, l1), (s2, l2), None)
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

struct CudaLce3(CudaLce);

impl CustomOp3 for CudaLce3 {
    fn name(&self) -> &'static str {
        "cut-cross-entropy-cuda-bias"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(not_cpu())
    }

    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        self.0.forward((s1, l1), (s2, l2), Some((s3, l3)))
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
