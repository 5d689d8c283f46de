//! Our WGSL kernels on burn's wgpu devices: which devices are registered, and our engines on
//! them.
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

use crate::kernels::NAME;
use burn::backend::DispatchDevice;
use burn::tensor::wgpu::{WgpuOptions, WgpuSetup};
use burn::tensor::Device;
use burn_cubecl::CubeDevice;
use cce_core::{CceError, Result};
use cce_wgpu::WgpuBackend;
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

pub(super) mod zero_copy;

static ENGINE: OnceLock<Option<WgpuBackend>> = OnceLock::new();

/// Our engines on burn's registered wgpu devices, by cubecl device.
static REGISTERED: OnceLock<Mutex<HashMap<CubeDevice, WgpuBackend>>> = OnceLock::new();

fn engines() -> std::sync::MutexGuard<'static, HashMap<CubeDevice, WgpuBackend>> {
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
    engines().insert(cube, engine);
    Ok(())
}

/// Our engine on burn's `device` when it was registered ([`init_wgpu`], [`register_wgpu`]).
pub fn registered_engine(device: &Device) -> Option<WgpuBackend> {
    let cube = cube_device(device)?;
    engines().get(&cube).cloned()
}

/// Our engine on cubecl device `device`, when it was registered.
pub(super) fn registered(device: &CubeDevice) -> Option<WgpuBackend> {
    engines().get(device).cloned()
}

/// The cubecl wgpu device behind a burn device (autodiff or not).
fn cube_device(device: &Device) -> Option<CubeDevice> {
    match device.as_dispatch().clone().inner() {
        DispatchDevice::Cube(d @ CubeDevice::Wgpu(_)) => Some(d),
        _ => None,
    }
}
