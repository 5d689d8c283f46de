//! The CUDA arm of `forward` and `backward`: torch's CUDA tensors on torch's current stream.
//!
//! Each call builds a [`CudaBackend`] on the stream the package passes
//! (`torch.cuda.current_stream(device).cuda_stream`, [`CudaBackend::on_raw_stream`]; cheap: the
//! compiled modules are cached per context for the process) in the device's primary context,
//! which PyTorch uses too. Inputs are borrowed in place ([`CudaTensor::borrowed`]) and the
//! outputs are the tensors torch allocated for them (`CudaBackend::forward_into`,
//! `backward_into`): no copy, and the backend allocates only its workspace (stream-ordered,
//! freed when the call's buffers drop).
//!
//! Each (device, stream) keeps one backend for the process ([`TorchStream::run`]), made on the
//! first call outside a graph capture: its device status outlives the call, so that a call's
//! checks need not be read at the call. A call's checks are deferred unless the package asks
//! for eager ones (`eager`: the package's `set_checks("eager")`, or `return_stats=True`, whose
//! statistics need the device's counts) and the stream is not capturing; deferred errors are
//! read by [`status`], and until then a mean or sum loss is NaN (`cce_cuda::Checks`).
//!
//! Host synchronization that remains: eager checks (one per check point); a backward that
//! recomputes with both an upstream gradient of the lse and a mean's or sum's upstream
//! gradient reads the latter as a host scalar (without a gradient of the lse the package asks
//! for the gradients of an upstream gradient of 1, `unit_d_loss`, and scales them itself);
//! the sparse backward's choice on filtered calls outside a capture (`cce_cuda` docs).

use crate::RawTensor;
use cce_core::CceError as LibError;
use cce_core::{
    Backend, CallStats, DLoss, DType, Inputs, Options, Reduction, Saved, TensorMeta, Upstream,
};
use cce_cuda::cudarc::driver::{sys::CUstream, CudaContext};
use cce_cuda::device::RelaxedCapture;
use cce_cuda::{Checks, CudaBackend, CudaTensor, DeviceReport, ForwardInto, GradsInto};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

const WHO: &str = "cut_cross_entropy_rs (cuda)";

/// The primary context of device `ordinal`, retained once for the process.
pub(crate) fn context(ordinal: usize) -> cce_core::Result<Arc<CudaContext>> {
    static CONTEXTS: OnceLock<Mutex<HashMap<usize, Arc<CudaContext>>>> = OnceLock::new();
    let map = CONTEXTS.get_or_init(|| Mutex::new(HashMap::new()));
    let mut map = map
        .lock()
        .map_err(|_| LibError::backend(WHO, "context cache poisoned"))?;
    if let Some(ctx) = map.get(&ordinal) {
        return Ok(ctx.clone());
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| LibError::NoDevice {
        backend: WHO,
        reason: format!("CUDA device {ordinal}: {e}"),
    })?;
    // SAFETY: this `Arc<CudaContext>` is the extension's own handle. Every call enqueues all
    // its work on one stream (torch's current stream), in program order, and the backend
    // orders what it shares between streams (its pooled cuBLAS handle) with its own events;
    // cudarc's per-buffer events would also make a call inside a CUDA graph capture wait on
    // work recorded outside it, which the driver refuses.
    unsafe { ctx.disable_event_tracking() };
    map.insert(ordinal, ctx.clone());
    Ok(ctx)
}

/// Where a call runs: torch's current stream of the tensors' device, and how its checks reach
/// the host.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TorchStream {
    /// Device index (`tensor.device.index`).
    pub ordinal: usize,
    /// `torch.cuda.current_stream(device).cuda_stream` (a `CUstream`; 0 is the legacy default).
    pub handle: usize,
    /// Read the call's checks at the call (`Checks::Eager`: a bad input raises there, and the
    /// statistics carry the device's counts); else deferred to [`status`].
    pub eager: bool,
    /// Exact bf16 calls whose budget holds no f32 `d_c` accumulator accumulate `d_c` in the
    /// bf16 output (`cce_cuda::CudaBackend::set_dc_in_grad_dtype`, set on the kept backend for
    /// this call).
    pub dc_in_grad_dtype: bool,
}

/// A backend kept for the calls on one stream.
type Kept = Arc<Mutex<CudaBackend>>;

/// The kept backends by (device, stream handle), for the process. Never dropped: a backend's
/// status buffer and pooled cuBLAS handle stay allocated (256 bytes and the handle's 32 MiB
/// workspace per stream that ran a call), and no work is ever enqueued on a stream after its
/// last call (a handle torch destroyed and reused is a new stream of the same device).
fn kept() -> &'static Mutex<HashMap<(usize, usize), Kept>> {
    static KEPT: OnceLock<Mutex<HashMap<(usize, usize), Kept>>> = OnceLock::new();
    KEPT.get_or_init(|| Mutex::new(HashMap::new()))
}

/// `m` locked. A panic while it was held (caught by the extension and raised as an `Internal`
/// error) leaves it poisoned; the data stays usable (a kept backend holds no half-made state
/// between calls), so the lock is taken anyway rather than failing every later call.
fn lock<T>(m: &Mutex<T>) -> cce_core::Result<std::sync::MutexGuard<'_, T>> {
    Ok(m.lock().unwrap_or_else(|p| p.into_inner()))
}

/// Whether `be`'s stream is capturing a CUDA graph.
pub(crate) fn capturing(be: &CudaBackend) -> cce_core::Result<bool> {
    use cce_cuda::cudarc::driver::sys::CUstreamCaptureStatus as Capture;
    Ok(be
        .stream()
        .capture_status()
        .map_err(|e| LibError::backend(WHO, e))?
        == Capture::CU_STREAM_CAPTURE_STATUS_ACTIVE)
}

/// The checks of a call: deferred while capturing (nothing may be read back then), else as
/// asked. Pure.
pub(crate) fn checks_for(eager: bool, capturing: bool) -> Checks {
    if eager && !capturing {
        Checks::Eager
    } else {
        Checks::Deferred
    }
}

impl TorchStream {
    /// Run `f` on this stream's kept backend, made on the first call (a call on a stream that
    /// captures a graph and has no kept backend yet runs on a backend of its own, whose status
    /// lives in the graph: its deferred errors are seen only as a NaN loss).
    ///
    /// # Safety
    /// `handle` is a live stream of device `ordinal`'s primary context that outlives the call
    /// (torch's current stream does).
    unsafe fn run<T>(
        self,
        f: impl FnOnce(&CudaBackend) -> cce_core::Result<T>,
    ) -> cce_core::Result<T> {
        let key = (self.ordinal, self.handle);
        let found = lock(kept())?.get(&key).cloned();
        if let Some(kept) = found {
            let mut be = lock(&kept)?;
            let capturing = capturing(&be)?;
            be.set_checks(checks_for(self.eager, capturing));
            be.set_dc_in_grad_dtype(self.dc_in_grad_dtype);
            return f(&be);
        }
        let ctx = context(self.ordinal)?;
        // SAFETY: forwarded from this function's contract.
        let mut be = unsafe { CudaBackend::on_raw_stream(&ctx, self.handle as CUstream) }?;
        let capturing = capturing(&be)?;
        be.set_checks(checks_for(self.eager, capturing));
        be.set_dc_in_grad_dtype(self.dc_in_grad_dtype);
        if capturing {
            return f(&be);
        }
        let kept = lock(kept())?
            .entry(key)
            .or_insert_with(|| Arc::new(Mutex::new(be)))
            .clone();
        let mut be = lock(&kept)?;
        be.set_dc_in_grad_dtype(self.dc_in_grad_dtype);
        f(&be)
    }
}

/// The device status of `ordinal`: the first error a deferred call on any of its streams
/// recorded since the last read (then cleared), else what the device knows of the last call on
/// `handle` (`None` when no call ran there). Synchronizes each stream that ran a call.
///
/// Errors: the recorded error (`cce_cuda::CudaBackend::status`).
pub(crate) fn status(ordinal: usize, handle: usize) -> cce_core::Result<Option<DeviceReport>> {
    let _relaxed = RelaxedCapture::enter()?;
    let mut mine = None;
    let mut all: Vec<((usize, usize), Kept)> = lock(kept())?
        .iter()
        .filter(|(k, _)| k.0 == ordinal)
        .map(|(k, v)| (*k, v.clone()))
        .collect();
    all.sort_by_key(|(k, _)| k.1);
    // A graph captured on one stream may be replayed on another: with no stream capturing,
    // the whole device is waited for first, so that every replay's record has landed. A
    // stream that captures is skipped (nothing may be enqueued into its graph).
    let mut live = Vec::with_capacity(all.len());
    for (key, be) in all {
        let capturing = capturing(&*lock(&be)?)?;
        if !capturing {
            live.push((key, be));
        }
    }
    if live.len() == lock(kept())?.iter().filter(|(k, _)| k.0 == ordinal).count() {
        // Best effort: a stream without a kept backend may be capturing, which forbids a
        // context-wide wait; each kept stream is then still waited for by its status read.
        let _ = context(ordinal)?.synchronize();
    }
    for (key, be) in live {
        let report = lock(&be)?.status()?;
        if key.1 == handle {
            mine = Some(report);
        }
    }
    Ok(mine)
}

/// `t` borrowed in place on `be`'s stream.
///
/// # Safety
/// `t` was read by `raw` from a live, contiguous CUDA tensor of `be`'s device that the caller
/// holds for the whole call; inputs are not written and outputs not read by anyone else
/// until the work of the call on torch's current stream has completed (stream order).
pub(crate) unsafe fn borrow(be: &CudaBackend, t: &RawTensor) -> cce_core::Result<CudaTensor> {
    // SAFETY: forwarded from this function's contract: `ptr` addresses `numel` elements of
    // `dtype` in one torch allocation on this device.
    unsafe { CudaTensor::borrowed(be.stream(), t.ptr as u64, t.dtype, t.shape.clone()) }
}

/// [`borrow`] of an optional tensor.
///
/// # Safety
/// As [`borrow`].
pub(crate) unsafe fn borrow_opt(
    be: &CudaBackend,
    t: Option<&RawTensor>,
) -> cce_core::Result<Option<CudaTensor>> {
    match t {
        // SAFETY: forwarded from this function's contract.
        Some(t) => Ok(Some(unsafe { borrow(be, t)? })),
        None => Ok(None),
    }
}

/// The CUDA forward on borrowed tensors (see `run_forward` for the CPU's).
///
/// # Safety
/// Every tensor satisfies [`borrow`]'s contract and `stream` [`TorchStream::run`]'s.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn forward(
    stream: TorchStream,
    e: &RawTensor,
    c: &RawTensor,
    bias: Option<&RawTensor>,
    targets: &RawTensor,
    opts: &Options,
    outs: [Option<&RawTensor>; 5],
) -> cce_core::Result<CallStats> {
    // Setup calls (kernel loads, the pooled cuBLAS handle's fence) are allowed while torch
    // captures a graph in its default global mode.
    let _relaxed = RelaxedCapture::enter()?;
    let call = |be: &CudaBackend| -> cce_core::Result<_> {
        // SAFETY: forwarded from this function's contract: tensors of `be`'s device held by the
        // caller for the whole call, inputs only read, outputs only written, on `be`'s stream.
        let (e, c, targets) = unsafe { (borrow(be, e)?, borrow(be, c)?, borrow(be, targets)?) };
        // SAFETY: as above.
        let bias = unsafe { borrow_opt(be, bias)? };
        let inputs = Inputs {
            e: &e,
            c: &c,
            bias: bias.as_ref(),
            targets: &targets,
        };
        let [loss, lse, rest, ent, arg] = outs;
        // SAFETY: as above (outputs torch allocated for this call, written only by it).
        let (mut loss, mut lse, mut rest) = unsafe {
            (
                borrow(be, req(loss)?)?,
                borrow(be, req(lse)?)?,
                borrow(be, req(rest)?)?,
            )
        };
        // SAFETY: as above.
        let (mut ent, mut arg) = unsafe { (borrow_opt(be, ent)?, borrow_opt(be, arg)?) };
        be.forward_into(
            &inputs,
            opts,
            ForwardInto {
                loss: &mut loss,
                lse: &mut lse,
                rest_mass: &mut rest,
                entropy: ent.as_mut(),
                argmax: arg.as_mut(),
            },
        )
    };
    // SAFETY: forwarded from this function's contract (the stream's and every tensor's).
    unsafe { stream.run(call) }
}

/// A required output (the package always passes it).
fn req(t: Option<&RawTensor>) -> cce_core::Result<&RawTensor> {
    t.ok_or_else(|| LibError::backend(WHO, "a required output is missing"))
}

/// The CUDA backward on borrowed tensors. For a mean or sum, `unit_d_loss` asks for the
/// gradients of an upstream gradient of 1 (`d_loss` is not read; the package scales them by
/// the real one on the device); else `d_loss` is read back as a host scalar (one
/// synchronization of torch's stream).
///
/// # Safety
/// As [`forward`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn backward(
    stream: TorchStream,
    e: &RawTensor,
    c: &RawTensor,
    bias: Option<&RawTensor>,
    targets: &RawTensor,
    opts: &Options,
    saved: [&RawTensor; 2],
    d_loss: &RawTensor,
    d_lse: Option<&RawTensor>,
    unit_d_loss: bool,
    outs: [Option<&RawTensor>; 3],
) -> cce_core::Result<CallStats> {
    // Setup calls (kernel loads, the pooled cuBLAS handle's fence) are allowed while torch
    // captures a graph in its default global mode.
    let _relaxed = RelaxedCapture::enter()?;
    let call = |be: &CudaBackend| -> cce_core::Result<_> {
        // SAFETY: forwarded from this function's contract: tensors of `be`'s device held by the
        // caller for the whole call, inputs only read, outputs only written, on `be`'s stream.
        let (e, c, targets) = unsafe { (borrow(be, e)?, borrow(be, c)?, borrow(be, targets)?) };
        // SAFETY: as above.
        let (bias, d_lse) = unsafe { (borrow_opt(be, bias)?, borrow_opt(be, d_lse)?) };
        // SAFETY: as above.
        let (lse, rest_mass) = unsafe { (borrow(be, saved[0])?, borrow(be, saved[1])?) };
        // SAFETY: as above.
        let d_loss = unsafe { borrow(be, d_loss)? };
        let d_loss = d_loss_on(be, &d_loss, opts, unit_d_loss)?;
        let inputs = Inputs {
            e: &e,
            c: &c,
            bias: bias.as_ref(),
            targets: &targets,
        };
        let upstream = Upstream {
            d_loss,
            d_lse: d_lse.as_ref(),
        };
        let saved = Saved {
            lse: &lse,
            rest_mass: &rest_mass,
        };
        let [d_e, d_c, d_bias] = outs;
        // SAFETY: as above (outputs torch allocated for this call, written only by it).
        let (mut d_e, mut d_c, mut d_bias) = unsafe {
            (
                borrow_opt(be, d_e)?,
                borrow_opt(be, d_c)?,
                borrow_opt(be, d_bias)?,
            )
        };
        be.backward_into(
            &inputs,
            opts,
            saved,
            &upstream,
            GradsInto {
                d_e: d_e.as_mut(),
                d_c: d_c.as_mut(),
                d_bias: d_bias.as_mut(),
                accumulate: false,
            },
        )
    };
    // SAFETY: forwarded from this function's contract (the stream's and every tensor's).
    unsafe { stream.run(call) }
}

/// The loss gradient of a backward from the `d_loss` tensor on the device: per row for
/// reduction none, else the scalar (1 when `unit_d_loss`: the caller scales the gradients
/// itself; otherwise read back as a host scalar, one synchronization of the stream).
///
/// Errors: `DTypeMismatch` unless f32; `ShapeMismatch` for a non-scalar under mean or sum.
pub(crate) fn d_loss_on<'a>(
    be: &CudaBackend,
    d_loss: &'a CudaTensor,
    opts: &Options,
    unit_d_loss: bool,
) -> cce_core::Result<DLoss<'a, CudaTensor>> {
    if d_loss.dtype() != DType::F32 {
        return Err(LibError::DTypeMismatch {
            what: "d_loss",
            expected: "f32".into(),
            got: d_loss.dtype(),
        });
    }
    Ok(match opts.reduction {
        Reduction::None => DLoss::PerRow(d_loss),
        _ if unit_d_loss => DLoss::Scalar(1.0),
        _ => {
            let host = be.download(d_loss)?.to_f32_vec();
            match host.as_slice() {
                [s] => DLoss::Scalar(*s),
                _ => {
                    return Err(LibError::ShapeMismatch {
                        what: "d_loss",
                        expected: "a scalar for reduction mean or sum".into(),
                        got: format!("{} elements", host.len()),
                    })
                }
            }
        }
    })
}

/// The CUDA forward and backward in one call (the logits computed once), the gradients of the
/// loss with an upstream gradient of 1 (the package scales them by the real one in its
/// backward): the forward's outputs into `fwd`, the gradients into `grads`.
///
/// # Safety
/// As [`forward`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn forward_backward(
    stream: TorchStream,
    e: &RawTensor,
    c: &RawTensor,
    bias: Option<&RawTensor>,
    targets: &RawTensor,
    opts: &Options,
    fwd: [Option<&RawTensor>; 5],
    grads: [Option<&RawTensor>; 3],
) -> cce_core::Result<(CallStats, CallStats)> {
    // Setup calls (kernel loads, the pooled cuBLAS handle's fence) are allowed while torch
    // captures a graph in its default global mode.
    let _relaxed = RelaxedCapture::enter()?;
    let call = |be: &CudaBackend| -> cce_core::Result<_> {
        // SAFETY: forwarded from this function's contract: tensors of `be`'s device held by the
        // caller for the whole call, inputs only read, outputs only written, on `be`'s stream.
        let (e, c, targets) = unsafe { (borrow(be, e)?, borrow(be, c)?, borrow(be, targets)?) };
        // SAFETY: as above.
        let bias = unsafe { borrow_opt(be, bias)? };
        let [loss, lse, rest, ent, arg] = fwd;
        // SAFETY: as above.
        let (mut loss, mut lse, mut rest) = unsafe {
            (
                borrow(be, req(loss)?)?,
                borrow(be, req(lse)?)?,
                borrow(be, req(rest)?)?,
            )
        };
        // SAFETY: as above.
        let (mut ent, mut arg) = unsafe { (borrow_opt(be, ent)?, borrow_opt(be, arg)?) };
        let [d_e, d_c, d_bias] = grads;
        // SAFETY: as above.
        let (mut d_e, mut d_c, mut d_bias) = unsafe {
            (
                borrow_opt(be, d_e)?,
                borrow_opt(be, d_c)?,
                borrow_opt(be, d_bias)?,
            )
        };
        let inputs = Inputs {
            e: &e,
            c: &c,
            bias: bias.as_ref(),
            targets: &targets,
        };
        be.forward_backward_into(
            &inputs,
            opts,
            &Upstream {
                d_loss: DLoss::Scalar(1.0),
                d_lse: None,
            },
            ForwardInto {
                loss: &mut loss,
                lse: &mut lse,
                rest_mass: &mut rest,
                entropy: ent.as_mut(),
                argmax: arg.as_mut(),
            },
            GradsInto {
                d_e: d_e.as_mut(),
                d_c: d_c.as_mut(),
                d_bias: d_bias.as_mut(),
                accumulate: false,
            },
        )
    };
    // SAFETY: forwarded from this function's contract (the stream's and every tensor's).
    unsafe { stream.run(call) }
}
