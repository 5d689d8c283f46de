//! The CUDA arm of the vocabulary-parallel calls: this rank's shard on torch's current stream
//! (`cce_core::vocab_parallel::BackendShard` over a `CudaBackend`, the shard primitives
//! composed from the backend's unsharded calls), the collectives through the host.
//!
//! Each call runs on a backend made for it ([`call_backend`]) on
//! `torch.cuda.current_stream(device)`, with eager checks: the driver reads the shard's results
//! back for the collectives anyway, so a bad input raises at the call (and takes part in the
//! collective as a failed rank), and no lock is held while the call waits for the other ranks
//! (ranks that are threads of one process may share a stream). Inputs are borrowed in place;
//! the forward's loss, lse and `rest_mass` and the summed `d_e` come from the host (the
//! merge and the all-reduce run there) and are copied into torch's output tensors on the
//! stream; this shard's `d_c` and `d_bias` are device buffers of the backend, copied into
//! torch's on the stream.
//!
//! An error before the driver runs (the backend's setup, a tensor it cannot borrow) still takes
//! part in the call's first collective as a failed rank (`super::failed`).
//!
//! Host traffic per call, besides the collectives: the targets (and bias) read for the shard's
//! checks, the partials of up to three unsharded forwards (`[N]` f32 each) and the forward's
//! outputs (`3N` f32) written back; in the backward the saved lse and `rest_mass` and the
//! upstream gradients read, four `[N]` arrays written, `d_e` (`N · D` f32) read and the
//! summed one written back.

use crate::cuda::{borrow, borrow_opt, capturing, context, d_loss_on, TorchStream};
use crate::RawTensor;
use cce_core::vocab_parallel::{BackendShard, Communicator, VocabShard};
use cce_core::CceError as LibError;
use cce_core::{CallStats, HostTensor, Inputs, Options, Saved, TensorMeta, Upstream};
use cce_cuda::cudarc::driver::sys::CUstream;
use cce_cuda::{Checks, CudaBackend, CudaTensor};
use cce_reference::vocab_parallel::RankDriver;
use std::cell::Cell;

use crate::args::{ForwardArgs, GradArgs, InputArgs, SavedArgs};

const WHO: &str = "cut_cross_entropy_rs (cuda vocab-parallel)";

/// `f` on a backend made for this call on `stream`, with eager checks.
///
/// Errors: `Unsupported` while the stream captures a CUDA graph (the driver reads the device
/// back between the collectives); those of `CudaBackend::on_raw_stream`.
///
/// # Safety
/// `stream.handle` is a live stream of device `stream.ordinal`'s primary context that
/// outlives the call (torch's current stream does).
unsafe fn call_backend<T>(
    stream: TorchStream,
    f: impl FnOnce(&CudaBackend) -> cce_core::Result<T>,
) -> cce_core::Result<T> {
    let ctx = context(stream.ordinal)?;
    // SAFETY: forwarded from this function's contract.
    let be = unsafe { CudaBackend::on_raw_stream(&ctx, stream.handle as CUstream) }?
        .with_checks(Checks::Eager);
    if capturing(&be)? {
        return Err(LibError::Unsupported {
            backend: WHO,
            what: "vocabulary-parallel calls while the stream captures a CUDA graph (the \
                   collectives read the device back)"
                .into(),
        });
    }
    f(&be)
}

/// Check that `dst` (a torch output) holds `src`'s dtype and element count.
fn same_layout(dst: &RawTensor, src: &dyn TensorMeta) -> cce_core::Result<()> {
    if src.dtype() != dst.dtype || src.numel() != dst.numel() {
        return Err(LibError::ShapeMismatch {
            what: dst.what,
            expected: format!("{:?} {}", src.shape(), src.dtype()),
            got: format!("{:?} {}", dst.shape, dst.dtype),
        });
    }
    Ok(())
}

/// Copy the host tensor `src` into the torch output `dst` on `be`'s stream.
///
/// # Safety
/// `dst` satisfies `crate::cuda::borrow`'s contract for an output of this call on `be`.
unsafe fn write_host(be: &CudaBackend, dst: &RawTensor, src: &HostTensor) -> cce_core::Result<()> {
    same_layout(dst, src)?;
    let bytes = src.as_bytes();
    if bytes.is_empty() {
        return Ok(());
    }
    // SAFETY: forwarded from this function's contract.
    let mut out = unsafe { borrow(be, dst)? };
    let mut view = out.slice_mut().slice_mut(..bytes.len());
    be.stream()
        .memcpy_htod(bytes, &mut view)
        .map_err(|e| LibError::backend(WHO, e))
}

/// Copy the backend's device buffer `src` into the torch output `dst` on `be`'s stream.
///
/// # Safety
/// As [`write_host`]; `src` is a buffer of `be`'s context.
unsafe fn write_device(
    be: &CudaBackend,
    dst: &RawTensor,
    src: &CudaTensor,
) -> cce_core::Result<()> {
    same_layout(dst, src)?;
    let n = src.nbytes();
    if n == 0 {
        return Ok(());
    }
    // SAFETY: forwarded from this function's contract.
    let mut out = unsafe { borrow(be, dst)? };
    let from = src.slice().slice(..n);
    let mut to = out.slice_mut().slice_mut(..n);
    be.stream()
        .memcpy_dtod(&from, &mut to)
        .map_err(|e| LibError::backend(WHO, e))
}

/// A call's inputs borrowed in place as the backend's tensors.
struct Held {
    e: CudaTensor,
    c: CudaTensor,
    targets: CudaTensor,
    bias: Option<CudaTensor>,
}

impl Held {
    /// # Safety
    /// `inp`'s tensors satisfy `crate::cuda::borrow`'s contract for inputs of a call on `be`.
    unsafe fn borrow(be: &CudaBackend, inp: &InputArgs) -> cce_core::Result<Self> {
        // SAFETY: forwarded from this function's contract.
        unsafe {
            Ok(Self {
                e: borrow(be, &inp.e)?,
                c: borrow(be, &inp.c)?,
                targets: borrow(be, &inp.targets)?,
                bias: borrow_opt(be, inp.bias.as_ref())?,
            })
        }
    }

    fn inputs(&self) -> Inputs<'_, CudaTensor> {
        Inputs {
            e: &self.e,
            c: &self.c,
            bias: self.bias.as_ref(),
            targets: &self.targets,
        }
    }
}

/// This rank's vocabulary-parallel forward on CUDA tensors (see `super::vp_forward`): the
/// loss, lse and `rest_mass` of the whole vocabulary written into `outs`; returns this shard's
/// statistics.
///
/// # Safety
/// Every tensor was read by `raw` from a CUDA tensor of `stream`'s device that the caller holds
/// for the whole call; inputs are only read and the outputs, fresh tensors of this call, only
/// written, all on `stream`, which satisfies [`call_backend`]'s contract.
pub(crate) unsafe fn forward<C: Communicator + ?Sized>(
    stream: TorchStream,
    comm: &C,
    shard: VocabShard,
    inp: &InputArgs,
    outs: &ForwardArgs,
    opts: &Options,
) -> cce_core::Result<CallStats> {
    // Whether the driver ran (and took part in the collectives): an error before it still
    // joins them as a failed rank (`super::failed`).
    let joined = Cell::new(false);
    let call = |be: &CudaBackend| -> cce_core::Result<CallStats> {
        // SAFETY: forwarded from this function's contract (inputs only read, on `be`'s stream).
        let held = unsafe { Held::borrow(be, inp)? };
        let inputs = held.inputs();
        joined.set(true);
        let fwd = RankDriver::from_shard(comm, shard)
            .with_primitives(BackendShard::new(be))
            .forward(&inputs, opts)?;
        // SAFETY: forwarded from this function's contract (outputs of this call, written only
        // here, on `be`'s stream).
        unsafe {
            write_host(be, &outs.loss, &fwd.output.loss)?;
            write_host(be, &outs.lse, &fwd.output.lse)?;
            write_host(be, &outs.rest_mass, &fwd.output.rest_mass)?;
        }
        Ok(fwd.shard_stats)
    };
    // SAFETY: forwarded from this function's contract.
    unsafe { call_backend(stream, call) }.map_err(|e| match joined.get() {
        true => e,
        false => super::failed::forward(comm, inp, opts, e),
    })
}

/// This rank's vocabulary-parallel backward on CUDA tensors (see `super::vp_backward`): the
/// summed `d_e` and this shard's `d_c` and `d_bias` written into `grads` (those given); returns
/// the call's statistics.
///
/// # Safety
/// As [`forward`].
pub(crate) unsafe fn backward<C: Communicator + ?Sized>(
    stream: TorchStream,
    comm: &C,
    shard: VocabShard,
    inp: &InputArgs,
    sv: &SavedArgs,
    grads: &GradArgs,
    opts: &Options,
) -> cce_core::Result<CallStats> {
    // Whether the driver ran (and took part in the collectives): an error before it still
    // joins them as a failed rank (`super::failed`).
    let joined = Cell::new(false);
    let call = |be: &CudaBackend| -> cce_core::Result<CallStats> {
        // SAFETY: forwarded from this function's contract (inputs only read, on `be`'s stream).
        let held = unsafe { Held::borrow(be, inp)? };
        // SAFETY: as above.
        let d_lse = unsafe { borrow_opt(be, sv.d_lse.as_ref())? };
        // SAFETY: as above.
        let (lse, rest_mass, d_loss) = unsafe {
            (
                borrow(be, &sv.lse)?,
                borrow(be, &sv.rest_mass)?,
                borrow(be, &sv.d_loss)?,
            )
        };
        let inputs = held.inputs();
        let upstream = Upstream {
            d_loss: d_loss_on(be, &d_loss, opts, false)?,
            d_lse: d_lse.as_ref(),
        };
        joined.set(true);
        let out = RankDriver::from_shard(comm, shard)
            .with_primitives(BackendShard::new(be))
            .backward(
                &inputs,
                opts,
                Saved {
                    lse: &lse,
                    rest_mass: &rest_mass,
                },
                &upstream,
            )?;
        // SAFETY: forwarded from this function's contract (outputs of this call, written only
        // here, on `be`'s stream; `d_c` and `d_bias` are buffers `be` made).
        unsafe {
            if let (Some(dst), Some(src)) = (&grads.d_e, &out.d_e) {
                write_host(be, dst, src)?;
            }
            if let (Some(dst), Some(src)) = (&grads.d_c, &out.d_c) {
                write_device(be, dst, src)?;
            }
            if let (Some(dst), Some(src)) = (&grads.d_bias, &out.d_bias) {
                write_device(be, dst, src)?;
            }
        }
        Ok(out.stats)
    };
    // SAFETY: forwarded from this function's contract.
    unsafe { call_backend(stream, call) }.map_err(|e| match joined.get() {
        true => e,
        false => super::failed::backward(comm, inp, sv, opts, e),
    })
}
