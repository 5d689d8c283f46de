//! burn's cubecl backend (`Cube`, the type behind `burn::backend::Wgpu`) and our WGSL kernels.
//!
//! On a wgpu device registered here ([`init_wgpu`], [`register_wgpu`]) our kernels run on
//! burn's own device and queue, reading burn's buffers and writing their outputs into buffers
//! burn allocated (the `zero_copy` module). burn 0.22 creates a device's wgpu handles inside
//! cubecl's runtime and keeps them private there (cubecl-wgpu's `WgpuServer` holds them; its
//! client hands out buffers, `get_resource`, but not the device or queue), so they are only
//! reachable when the runtime is brought up through `WgpuOptions::init_with_setup`, which
//! returns them: that is what registration does. On any other wgpu device (e.g.
//! `Device::wgpu(DeviceKind::DefaultDevice)` created lazily by a tensor operation) the tensors
//! go through the host to our kernels on our own device ([`wgpu_engine`]), counted by
//! [`crate::host_copies`].

use super::*;
use crate::kernels::{host_backward, host_forward, CceForward, CceGrads, NAME};
use burn::backend::{Cube, DispatchDevice};
use burn::tensor::wgpu::{WgpuOptions, WgpuSetup};
use burn::tensor::{DType as BurnDType, Device};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeDevice;
use cce_core::Result;
use cce_reference::CpuBackend;
use cce_wgpu::WgpuBackend;
use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

mod zero_copy;

static ENGINE: OnceLock<Option<WgpuBackend>> = OnceLock::new();

/// Our engines on burn's registered wgpu devices, by cubecl device.
static REGISTERED: OnceLock<Mutex<HashMap<CubeDevice, WgpuBackend>>> = OnceLock::new();

fn registered() -> std::sync::MutexGuard<'static, HashMap<CubeDevice, WgpuBackend>> {
    // A poisoned lock only means a panic elsewhere while it was held; the map stays valid.
    REGISTERED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// Our wgpu engine on its own device, created on first use (one per process): the engine of
/// `Cube` tensors on wgpu devices not registered here (through host copies); `None` when no
/// wgpu adapter is usable, in which case such tensors run on the CPU reference engine.
pub fn wgpu_engine() -> Option<&'static WgpuBackend> {
    ENGINE.get_or_init(|| WgpuBackend::new().ok()).as_ref()
}

/// Bring up burn's wgpu runtime with `options` (`Device::wgpu_options()`, with any memory or
/// task settings) and register our kernels on its device and queue: `linear_cross_entropy`
/// on tensors of the returned device (or of its `.autodiff()`) then reads and writes burn's
/// buffers in place, with no host copy.
///
/// Call it before any tensor is created on the selected device kind: burn initializes a
/// device's runtime once, lazily on first use.
///
/// Errors: `Backend` when burn cannot initialize the runtime (already initialized, no adapter:
/// burn's `WgpuInitError` message), and those of [`register_wgpu`].
///
/// ```no_run
/// use burn::tensor::{DType as BurnDType, Device};
/// let device = cce_burn::cube::init_wgpu(Device::wgpu_options())?.autodiff();
/// # Ok::<(), cce_burn::CceError>(())
/// ```
pub fn init_wgpu(options: WgpuOptions) -> Result<Device> {
    let (device, setup) = options
        .init_with_setup()
        .map_err(|e| CceError::backend(NAME, format!("initializing burn's wgpu device: {e}")))?;
    register_wgpu(&device, &setup)?;
    Ok(device)
}

/// Register our kernels on the wgpu device and queue behind burn's `device`: `setup` is what
/// `WgpuOptions::init_with_setup` returned with it (or the setup given to
/// `WgpuOptions::setup`). Registering a device again replaces its engine.
///
/// Installs no wgpu callback on the device (cubecl's device-lost and uncaptured-error
/// handlers stay; see `cce_wgpu::WgpuBackend::from_device`).
///
/// Errors: `InvalidOption` when `device` is not a wgpu device of burn's cubecl backend;
/// those of `WgpuBackend::from_device` (limits that do not fit our tiles).
pub fn register_wgpu(device: &Device, setup: &WgpuSetup) -> Result<()> {
    let cube = cube_device(device).ok_or_else(|| CceError::InvalidOption {
        name: "device",
        reason: format!("{device:?} is not a wgpu device of burn's cubecl backend"),
    })?;
    let engine = WgpuBackend::from_device(setup.device.clone(), setup.queue.clone())?;
    registered().insert(cube, engine);
    Ok(())
}

/// Our engine on burn's `device` when it was registered ([`init_wgpu`], [`register_wgpu`]).
pub fn registered_engine(device: &Device) -> Option<WgpuBackend> {
    let cube = cube_device(device)?;
    registered().get(&cube).cloned()
}

/// The cubecl wgpu device behind a burn device (autodiff or not).
fn cube_device(device: &Device) -> Option<CubeDevice> {
    match device.as_dispatch().clone().inner() {
        DispatchDevice::Cube(d @ CubeDevice::Wgpu(_)) => Some(d),
        _ => None,
    }
}

/// `a` as a `B`, when they are one type: `Cube`'s primitives are `CubeTensor`s unless burn's
/// `fusion` feature wraps them (then `None`, and the host path is taken).
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

/// The engine registered for the device of `floats` and `targets`, when the zero-copy path
/// takes them: plain `CubeTensor`s on one registered device, floats of f32, f16 or bf16 (one
/// dtype, as our kernels need; per-row and upstream tensors f32) and i32 or i64 targets. Any
/// other case (f64, quantized, mixed devices) takes the host path, which converts.
fn engine_for(
    floats: &[(&FloatTensor<Cube>, bool)],
    targets: &IntTensor<Cube>,
) -> Option<WgpuBackend> {
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
    registered().get(device).cloned()
}

fn lost() -> CceError {
    CceError::backend(NAME, "a Cube tensor is not a CubeTensor")
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
        if let Some(engine) = engine_for(&floats, &targets) {
            let cast = |t| same::<FloatTensor<Self>, CubeTensor>(t).ok_or_else(lost);
            let bias = bias.map(cast).transpose()?;
            let targets = same::<IntTensor<Self>, CubeTensor>(targets).ok_or_else(lost)?;
            let f = zero_copy::forward(&engine, cast(e)?, cast(c)?, bias, targets, opts)?;
            let back = |t| same::<CubeTensor, FloatTensor<Self>>(t).ok_or_else(lost);
            return Ok(CceForward {
                loss: back(f.loss)?,
                lse: back(f.lse)?,
                rest_mass: back(f.rest_mass)?,
            });
        }
        match wgpu_engine() {
            Some(w) => host_forward::<Self, _>(w, e, c, bias, targets, opts),
            None => host_forward::<Self, _>(&CpuBackend::new(), e, c, bias, targets, opts),
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
        if let Some(engine) = engine_for(&floats, &targets) {
            let cast = |t| same::<FloatTensor<Self>, CubeTensor>(t).ok_or_else(lost);
            let bias = bias.map(cast).transpose()?;
            let targets = same::<IntTensor<Self>, CubeTensor>(targets).ok_or_else(lost)?;
            let saved = zero_copy::Saved {
                lse: cast(saved.lse)?,
                rest_mass: cast(saved.rest_mass)?,
            };
            let (e, c, d_loss) = (cast(e)?, cast(c)?, cast(d_loss)?);
            let g = zero_copy::backward(&engine, e, c, bias, targets, saved, d_loss, opts)?;
            let back = |t: Option<CubeTensor>| {
                t.map(|t| same::<CubeTensor, FloatTensor<Self>>(t).ok_or_else(lost))
                    .transpose()
            };
            return Ok(CceGrads {
                d_e: back(g.d_e)?,
                d_c: back(g.d_c)?,
                d_bias: back(g.d_bias)?,
            });
        }
        match wgpu_engine() {
            Some(w) => host_backward::<Self, _>(w, e, c, bias, targets, saved, d_loss, opts),
            None => host_backward::<Self, _>(
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
