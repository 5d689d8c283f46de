//! burn's cubecl backend (`Cube`, the one type behind `burn::backend::Wgpu` and
//! `burn::backend::Cuda`): each call is routed by the device its tensors live on.
//!
//! - A wgpu device registered here (`init_wgpu`, `register_wgpu`, feature `wgpu`): our
//!   WGSL kernels on burn's own device and queue, in burn's buffers (the `wgpu` module).
//! - A CUDA device (feature `cuda`): our CUDA kernels in burn's buffers, on a stream of ours
//!   ordered against cubecl's by two host synchronizations (the `cuda` module).
//! - Anything else, and tensors the in-place paths do not take (burn's `fusion` feature, whose
//!   tensors are not `CubeTensor`s; f64; mixed devices or dtypes; targets other than i32/i64):
//!   through the host to our engine for that kind of device (our CUDA backend on its own
//!   stream, our wgpu engine on its own device, else the CPU reference), counted by
//!   [`crate::host_copies`].

use super::*;
use crate::kernels::{host_backward, host_forward, CceForward, CceGrads, NAME};
use burn::backend::{Cube, TensorMetadata};
use burn::tensor::DType as BurnDType;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeDevice;
use cce_core::Result;
use cce_reference::CpuBackend;
use std::any::{Any, TypeId};

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "wgpu")]
mod wgpu;

#[cfg(feature = "cuda")]
pub use self::cuda::{cuda_host_syncs, cuda_ready};
#[cfg(feature = "wgpu")]
pub use self::wgpu::{init_wgpu, register_wgpu, registered_engine, wgpu_engine};

/// The forward's outputs as burn tensors on the inputs' device.
pub(crate) struct Forward {
    pub loss: CubeTensor,
    pub lse: CubeTensor,
    pub rest_mass: CubeTensor,
}

/// The forward's per-row outputs as the backward reads them.
pub(crate) struct Saved {
    pub lse: CubeTensor,
    pub rest_mass: CubeTensor,
}

impl Saved {
    /// The saved tensors and the upstream gradient of a backward as `CubeTensor`s.
    fn new(saved: CceForward<Cube>, d_loss: FloatTensor<Cube>) -> Result<(Self, CubeTensor)> {
        let saved = Self {
            lse: to_cube(saved.lse)?,
            rest_mass: to_cube(saved.rest_mass)?,
        };
        Ok((saved, to_cube(d_loss)?))
    }
}

/// The backward's gradients; `None` where not asked for.
pub(crate) struct Grads {
    pub d_e: Option<CubeTensor>,
    pub d_c: Option<CubeTensor>,
    pub d_bias: Option<CubeTensor>,
}

/// `a` as a `B`, when they are one type: `Cube`'s primitives are `CubeTensor`s unless burn's
/// `fusion` feature wraps them.
fn same<A: 'static, B: 'static>(a: A) -> Option<B> {
    let mut slot = Some(a);
    (&mut slot as &mut dyn Any)
        .downcast_mut::<Option<B>>()
        .and_then(Option::take)
}

/// Whether `Cube`'s tensors are plain `CubeTensor`s (burn without `fusion`).
fn unfused() -> bool {
    TypeId::of::<FloatTensor<Cube>>() == TypeId::of::<CubeTensor>()
        && TypeId::of::<IntTensor<Cube>>() == TypeId::of::<CubeTensor>()
}

fn lost() -> CceError {
    CceError::backend(NAME, "a Cube tensor is not a CubeTensor")
}

/// A `Cube` primitive (float or int) as the `CubeTensor` it is when [`unfused`].
fn to_cube<T: 'static>(t: T) -> Result<CubeTensor> {
    same::<T, CubeTensor>(t).ok_or_else(lost)
}

/// A `CubeTensor` as a `Cube` primitive.
fn from_cube<T: 'static>(t: CubeTensor) -> Result<T> {
    same::<CubeTensor, T>(t).ok_or_else(lost)
}

/// The cubecl device of `floats` and `targets` when an in-place path takes them: plain
/// `CubeTensor`s on one device, floats of f32, f16 or bf16 (one dtype, as our kernels need;
/// those flagged per-row, the saved lse and rest mass and the upstream gradient, f32), not
/// quantized, and i32 or i64 targets. `None` sends the call through the host, which converts.
fn in_place_device(
    floats: &[(&FloatTensor<Cube>, bool)],
    targets: &IntTensor<Cube>,
) -> Option<CubeDevice> {
    if !unfused() {
        return None;
    }
    fn cube(t: &dyn Any) -> Option<&CubeTensor> {
        t.downcast_ref()
    }
    let (first, _) = floats.first()?;
    let device = &cube(*first)?.device;
    let dtype = cube(*first)?.dtype;
    for &(t, per_row) in floats {
        let t = cube(t)?;
        let want = if per_row { BurnDType::F32 } else { dtype };
        let float = matches!(t.dtype, BurnDType::F32 | BurnDType::F16 | BurnDType::BF16);
        if &t.device != device || t.dtype != want || !float || t.qparams.is_some() {
            return None;
        }
    }
    let y = cube(targets)?;
    if &y.device != device || !matches!(y.dtype, BurnDType::I32 | BurnDType::I64) {
        return None;
    }
    Some(device.clone())
}

/// The inputs of one call as `CubeTensor`s.
pub(crate) struct CubeInputs {
    pub e: CubeTensor,
    pub c: CubeTensor,
    pub bias: Option<CubeTensor>,
    pub targets: CubeTensor,
}

impl CubeInputs {
    fn new(
        e: FloatTensor<Cube>,
        c: FloatTensor<Cube>,
        bias: Option<FloatTensor<Cube>>,
        targets: IntTensor<Cube>,
    ) -> Result<Self> {
        Ok(Self {
            e: to_cube(e)?,
            c: to_cube(c)?,
            bias: bias.map(to_cube).transpose()?,
            targets: to_cube(targets)?,
        })
    }
}

fn forward_back(f: Forward) -> Result<CceForward<Cube>> {
    Ok(CceForward {
        loss: from_cube(f.loss)?,
        lse: from_cube(f.lse)?,
        rest_mass: from_cube(f.rest_mass)?,
    })
}

fn grads_back(g: Grads) -> Result<CceGrads<Cube>> {
    let back = |t: Option<CubeTensor>| t.map(from_cube).transpose();
    Ok(CceGrads {
        d_e: back(g.d_e)?,
        d_c: back(g.d_c)?,
        d_bias: back(g.d_bias)?,
    })
}

/// Which engine takes a call through the host, by the device kind of `e`.
enum HostEngine {
    #[cfg(feature = "cuda")]
    Cuda(std::sync::Arc<std::sync::Mutex<cce_cuda::CudaBackend>>),
    #[cfg(feature = "wgpu")]
    Wgpu(&'static cce_wgpu::WgpuBackend),
    Cpu,
}

fn host_engine(device: &CubeDevice) -> HostEngine {
    match device {
        #[cfg(feature = "cuda")]
        CubeDevice::Cuda(d) => match cuda::kept(d.index) {
            Some(be) => HostEngine::Cuda(be),
            None => HostEngine::Cpu,
        },
        #[cfg(feature = "wgpu")]
        CubeDevice::Wgpu(_) => match wgpu_engine() {
            Some(w) => HostEngine::Wgpu(w),
            None => HostEngine::Cpu,
        },
        _ => HostEngine::Cpu,
    }
}

impl CceKernels for Cube {
    fn cce_forward(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        targets: IntTensor<Self>,
        opts: &Options,
    ) -> Result<CceForward<Self>> {
        let mut floats = vec![(&e, false), (&c, false)];
        floats.extend(bias.as_ref().map(|b| (b, false)));
        let device = in_place_device(&floats, &targets);
        match device {
            #[cfg(feature = "cuda")]
            Some(CubeDevice::Cuda(d)) => {
                if let Some(be) = cuda::kept(d.index) {
                    let inputs = CubeInputs::new(e, c, bias, targets)?;
                    return forward_back(cuda::forward(&be, inputs, opts)?);
                }
            }
            #[cfg(feature = "wgpu")]
            Some(ref d @ CubeDevice::Wgpu(_)) => {
                if let Some(engine) = wgpu::registered(d) {
                    let inputs = CubeInputs::new(e, c, bias, targets)?;
                    return forward_back(wgpu::zero_copy::forward(&engine, inputs, opts)?);
                }
            }
            _ => {}
        }
        match host_engine(&e.device()) {
            #[cfg(feature = "cuda")]
            HostEngine::Cuda(be) => cuda::through_host(&be, |be| {
                host_forward::<Self, _>(be, e, c, bias, targets, opts)
            }),
            #[cfg(feature = "wgpu")]
            HostEngine::Wgpu(w) => host_forward::<Self, _>(w, e, c, bias, targets, opts),
            HostEngine::Cpu => {
                host_forward::<Self, _>(&CpuBackend::new(), e, c, bias, targets, opts)
            }
        }
    }

    fn cce_backward(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        targets: IntTensor<Self>,
        saved: CceForward<Self>,
        d_loss: FloatTensor<Self>,
        opts: &Options,
    ) -> Result<CceGrads<Self>> {
        let mut floats = vec![(&e, false), (&c, false)];
        floats.extend(bias.as_ref().map(|b| (b, false)));
        floats.extend([
            (&saved.lse, true),
            (&saved.rest_mass, true),
            (&d_loss, true),
        ]);
        let device = in_place_device(&floats, &targets);
        match device {
            #[cfg(feature = "cuda")]
            Some(CubeDevice::Cuda(d)) => {
                if let Some(be) = cuda::kept(d.index) {
                    let inputs = CubeInputs::new(e, c, bias, targets)?;
                    let (saved, d_loss) = Saved::new(saved, d_loss)?;
                    return grads_back(cuda::backward(&be, inputs, saved, d_loss, opts)?);
                }
            }
            #[cfg(feature = "wgpu")]
            Some(ref d @ CubeDevice::Wgpu(_)) => {
                if let Some(engine) = wgpu::registered(d) {
                    let inputs = CubeInputs::new(e, c, bias, targets)?;
                    let (saved, d_loss) = Saved::new(saved, d_loss)?;
                    return grads_back(wgpu::zero_copy::backward(
                        &engine, inputs, saved, d_loss, opts,
                    )?);
                }
            }
            _ => {}
        }
        match host_engine(&e.device()) {
            #[cfg(feature = "cuda")]
            HostEngine::Cuda(be) => cuda::through_host(&be, |be| {
                host_backward::<Self, _>(be, e, c, bias, targets, saved, d_loss, opts)
            }),
            #[cfg(feature = "wgpu")]
            HostEngine::Wgpu(w) => {
                host_backward::<Self, _>(w, e, c, bias, targets, saved, d_loss, opts)
            }
            HostEngine::Cpu => host_backward::<Self, _>(
                &CpuBackend::new(),
                e,
                c,
                bias,
                targets,
                saved,
                d_loss,
                opts,
            ),
        }
    }
}

concrete_extension!(Cube);
