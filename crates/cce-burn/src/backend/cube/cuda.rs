//! Our CUDA kernels on burn's CUDA devices: one backend of ours per device, kept for the
//! process, and how a call borrows it (in place: the `zero_copy` module; through the host:
//! [`through_host`]).
//!
//! The backend is `cce_cuda::CudaBackend::new(ordinal)`: the device's primary context, which
//! cubecl-cuda's server uses too (it retains the primary context of the device it serves), so
//! the device addresses cubecl hands out are valid in it; and a non-blocking stream of its
//! own, since cubecl 0.11 keeps its `CUstream`s private (the `zero_copy` module says how the
//! two streams are ordered). Creating it loads libcuda, libnvrtc and libcublas and compiles (or
//! fetches from the disk cache) our kernels; where that fails (no NVRTC, compute capability
//! below 8.0) the device's calls run on the CPU reference through the host.

use crate::kernels::NAME;
use burn::backend::DispatchDevice;
use burn::tensor::Device;
use burn_cubecl::CubeDevice;
use cce_core::{CceError, Result};
use cce_cuda::{Checks, CudaBackend};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

mod zero_copy;

pub(super) use zero_copy::{backward, forward};

/// A backend of ours kept for one device; calls on it are serialized by the lock (each sets
/// its checks).
pub(super) type Kept = Arc<Mutex<CudaBackend>>;

/// Our backends by CUDA ordinal, or why none could be made (the message of the first error).
type Backends = HashMap<usize, std::result::Result<Kept, String>>;

static BACKENDS: OnceLock<Mutex<Backends>> = OnceLock::new();

/// Host synchronizations of the in-place path (see [`cuda_host_syncs`]).
static HOST_SYNCS: AtomicU64 = AtomicU64::new(0);

/// Lock `m`: a poisoned lock only means a panic elsewhere while it was held; a backend stays
/// usable (each call sets its checks and reads its status before returning).
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Our backend for CUDA device `ordinal`, made on first use; the error of a device where it
/// cannot be made (its first error's message on later calls).
fn backend(ordinal: usize) -> Result<Kept> {
    let mut all = lock(BACKENDS.get_or_init(Default::default));
    match all.get(&ordinal) {
        Some(Ok(kept)) => return Ok(kept.clone()),
        Some(Err(why)) => return Err(CceError::backend(NAME, why.clone())),
        None => {}
    }
    let made = CudaBackend::new(ordinal).map(|be| Arc::new(Mutex::new(be)));
    let entry = match &made {
        Ok(kept) => Ok(kept.clone()),
        Err(e) => Err(format!("our CUDA backend on device {ordinal}: {e}")),
    };
    all.insert(ordinal, entry);
    made
}

/// Our backend for CUDA device `ordinal`, or `None` where it cannot be made.
pub(super) fn kept(ordinal: usize) -> Option<Kept> {
    backend(ordinal).ok()
}

/// Run `f` (a call through the host: the `cce_core::Backend` trait's calls, which allocate,
/// upload and download on our stream) on `kept` with eager checks, so that a bad input is the
/// call's error.
pub(super) fn through_host<R>(kept: &Kept, f: impl FnOnce(&CudaBackend) -> Result<R>) -> Result<R> {
    let mut be = lock(kept);
    be.set_checks(Checks::Eager);
    f(&be)
}

/// Count one host synchronization of the in-place path.
fn count_sync() {
    HOST_SYNCS.fetch_add(1, Ordering::Relaxed);
}

/// Whether our CUDA kernels take the calls on burn's CUDA `device` (of `Device::cuda(i)`,
/// autodiff or not) in place: `Ok` once our backend for it is made (this makes it, on first
/// use: it loads the CUDA libraries and compiles or fetches our kernels, without touching
/// burn's runtime, so it is a safe probe before any tensor is created).
///
/// Errors: `InvalidOption` when `device` is not a CUDA device of burn's cubecl backend;
/// `NoDevice` when libcuda or libnvrtc cannot be loaded or the device is not visible;
/// `Unsupported` below compute capability 8.0 or without libcublas; `Backend` for a driver or
/// compile error (its message on later calls). On such a device calls run on the CPU reference
/// through the host ([`crate::host_copies`]).
pub fn cuda_ready(device: &Device) -> Result<()> {
    match device.as_dispatch().clone().inner() {
        DispatchDevice::Cube(CubeDevice::Cuda(d)) => backend(d.index).map(|_| ()),
        _ => Err(CceError::InvalidOption {
            name: "device",
            reason: format!("{device:?} is not a CUDA device of burn's cubecl backend"),
        }),
    }
}

/// Host synchronizations the in-place CUDA path has made in this process: two per forward and
/// two per backward (the wait for cubecl's stream before our kernels read burn's tensors, and
/// the wait for our stream, with its status read, before burn's next kernels read ours; a mean
/// or sum backward's read of its 4-byte upstream gradient is the first of the two), and one
/// more when a call fails after enqueuing work (our stream is drained before burn's buffers are
/// given back).
pub fn cuda_host_syncs() -> u64 {
    HOST_SYNCS.load(Ordering::Relaxed)
}
