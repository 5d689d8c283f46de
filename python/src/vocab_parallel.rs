//! Vocabulary-parallel calls over a Python communicator (the package's
//! `vocab_parallel.TorchDistributedComm`: torch.distributed collectives of a process group), on
//! CPU tensors (the CPU reference's shard primitives) or CUDA tensors (the `cuda` module: the
//! CUDA backend's composed shard primitives on torch's current stream).
//!
//! Each rank holds the whole batch (`e` `[N, D]`, the targets) and the classes `[start, start +
//! c.shape[0])` of a vocabulary of `vocab_size` real classes (rows past `vocab_size` are padding
//! and never read). [`vp_forward`] runs this shard's partial forward, one all-gather and the
//! merge (`cce_reference::vocab_parallel::RankDriver::forward`): every rank gets the loss, lse
//! and `1 − p_y` of the whole vocabulary. [`vp_backward`] gives this shard's `d_c` and `d_bias`
//! and the whole `d_e` (all-reduced in f32). Math and contract: `cce_core::vocab_parallel`.
//!
//! The collectives are calls back into Python while the GIL is held: `comm.rank()`,
//! `comm.size()`, `comm.all_reduce(t, op)` (`op` "sum" or "max", in place or returned) and
//! `comm.all_gather(t)` (the ranks' tensors concatenated in rank order), `t` a 1-D CPU tensor
//! of float32 or float64, for CUDA inputs too (the merge and the `d_e` all-reduce go through
//! the host). A Python exception there becomes `CceError` of kind `Backend`.

use super::args::{ForwardArgs, GradArgs, InputArgs, SavedArgs};
use super::{guarded, options, stats_dict, to_py, Device, RawTensor};
use cce_core::vocab_parallel::{Communicator, ReduceOp, VocabShard};
use cce_core::CceError as LibError;
use cce_reference::vocab_parallel::RankDriver;
use pyo3::prelude::*;
use pyo3::types::PyDict;

#[cfg(feature = "cuda")]
mod cuda;
mod failed;

/// A [`Communicator`] whose collectives are methods of a Python object (see the module docs).
struct PyComm<'py> {
    obj: Bound<'py, PyAny>,
    torch: Bound<'py, PyModule>,
    rank: usize,
    size: usize,
}

/// A Python exception raised by a collective, as the library's `Backend` error.
fn comm_error(what: &str, err: PyErr) -> LibError {
    LibError::backend(
        "torch.distributed",
        format!("{what} failed in the communicator: {err}"),
    )
}

/// An element type the collectives carry.
trait Wire: Copy {
    /// The `torch` dtype attribute.
    const TORCH: &'static str;
}
impl Wire for f32 {
    const TORCH: &'static str = "float32";
}
impl Wire for f64 {
    const TORCH: &'static str = "float64";
}

impl<'py> PyComm<'py> {
    /// Ask `obj` for its rank and size.
    fn new(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        let py = obj.py();
        let rank: usize = obj.call_method0("rank")?.extract()?;
        let size: usize = obj.call_method0("size")?.extract()?;
        if size == 0 || rank >= size {
            return Err(to_py(
                py,
                LibError::InvalidOption {
                    name: "comm",
                    reason: format!("rank {rank} of a group of {size}"),
                },
            ));
        }
        Ok(Self {
            obj: obj.clone(),
            torch: py.import("torch")?,
            rank,
            size,
        })
    }

    /// A fresh 1-D CPU tensor holding `data`.
    fn tensor<T: Wire>(&self, data: &[T]) -> PyResult<Bound<'py, PyAny>> {
        let kwargs = PyDict::new(self.obj.py());
        kwargs.set_item("dtype", self.torch.getattr(T::TORCH)?)?;
        let t = self
            .torch
            .call_method("empty", (data.len(),), Some(&kwargs))?;
        if !data.is_empty() {
            let ptr: usize = t.call_method0("data_ptr")?.extract()?;
            // SAFETY: `t` is a fresh contiguous CPU tensor of `data.len()` elements of `T`
            // (torch.empty with T's dtype; its allocation is aligned for T), alive while `t`
            // is, and no one else holds it yet.
            let dst = unsafe { std::slice::from_raw_parts_mut(ptr as *mut T, data.len()) };
            dst.copy_from_slice(data);
        }
        Ok(t)
    }

    /// Copy the 1-D CPU tensor `t` (of `T`'s dtype and `out.len()` elements) into `out`.
    fn read<T: Wire>(&self, what: &str, t: &Bound<'py, PyAny>, out: &mut [T]) -> PyResult<()> {
        let t = t.call_method0("contiguous")?;
        let dtype: String = t.getattr("dtype")?.str()?.extract()?;
        let device: String = t.getattr("device")?.getattr("type")?.extract()?;
        let numel: usize = t.call_method0("numel")?.extract()?;
        if dtype != format!("torch.{}", T::TORCH) || device != "cpu" || numel != out.len() {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "{what} returned a {dtype} tensor of {numel} elements on {device}, expected \
                 torch.{} of {} on cpu",
                T::TORCH,
                out.len()
            )));
        }
        if !out.is_empty() {
            let ptr: usize = t.call_method0("data_ptr")?.extract()?;
            // SAFETY: `t` is a contiguous CPU tensor of `out.len()` elements of `T` (checked
            // above), alive while `t` is; it is only read here.
            let src = unsafe { std::slice::from_raw_parts(ptr as *const T, out.len()) };
            out.copy_from_slice(src);
        }
        Ok(())
    }

    fn all_reduce<T: Wire>(&self, buf: &mut [T], op: ReduceOp) -> cce_core::Result<()> {
        let op = match op {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
        };
        let mut run = || -> PyResult<()> {
            let t = self.tensor(buf)?;
            let r = self.obj.call_method1("all_reduce", (&t, op))?;
            // An implementation may reduce in place and return None.
            let r = if r.is_none() { t } else { r };
            self.read("all_reduce", &r, buf)
        };
        run().map_err(|e| comm_error("all_reduce", e))
    }

    fn all_gather<T: Wire>(&self, send: &[T], recv: &mut [T]) -> cce_core::Result<()> {
        let mut run = || -> PyResult<()> {
            let t = self.tensor(send)?;
            let r = self.obj.call_method1("all_gather", (&t,))?;
            self.read("all_gather", &r, recv)
        };
        run().map_err(|e| comm_error("all_gather", e))
    }
}

impl Communicator for PyComm<'_> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce_f32(&self, buf: &mut [f32], op: ReduceOp) -> cce_core::Result<()> {
        self.all_reduce(buf, op)
    }

    fn all_reduce_f64(&self, buf: &mut [f64], op: ReduceOp) -> cce_core::Result<()> {
        self.all_reduce(buf, op)
    }

    fn all_gather_f32(&self, send: &[f32], recv: &mut [f32]) -> cce_core::Result<()> {
        self.all_gather(send, recv)
    }

    fn all_gather_f64(&self, send: &[f64], recv: &mut [f64]) -> cce_core::Result<()> {
        self.all_gather(send, recv)
    }
}

/// This rank's shard: classes `[start, start + rows of c)` of `vocab_size`.
fn shard_of(c: &RawTensor, vocab_size: usize, start: usize) -> cce_core::Result<VocabShard> {
    let rows = c.shape.first().copied().unwrap_or(0);
    VocabShard::new(vocab_size, start, start + rows)
}

/// torch's current stream of the call's CUDA device (`stream`: its handle, from the package).
#[cfg(feature = "cuda")]
fn cuda_stream(inp: &InputArgs, stream: usize) -> super::cuda::TorchStream {
    super::cuda::TorchStream {
        ordinal: inp.e.ordinal,
        handle: stream,
        eager: true,
        dc_in_grad_dtype: false,
    }
}

/// Vocabulary-parallel forward of this rank: writes the loss (`[]` or `[N]` f32), the lse and
/// `1 − p_y` of the whole vocabulary (`[N]` f32 each, the same on every rank; saved for
/// [`vp_backward`]); returns this shard's statistics as a dict. `c`, `bias`: this shard's
/// classes `[start, start + c.shape[0])`; `e`, `targets`, `opts`: the same on every rank.
///
/// Every tensor on one device: CPU, or CUDA (the `cuda` module: torch's current stream, whose
/// handle the package passes as `stream`).
///
/// Errors (`CceError`): every error of the unsharded call; `VocabParallel` when the shards do
/// not tile `[0, vocab_size)` or a rank failed (a rank whose call fails before its shard runs
/// still takes part in the first collective as a failed rank: `failed`); `Unsupported` for tensors on different devices,
/// for CUDA tensors in a build without the `cuda` feature and during a CUDA graph capture;
/// `Backend` when a collective raised.
#[pyfunction]
#[pyo3(signature = (e, c, bias, targets, opts, comm, vocab_size, start, loss_out, lse_out, rest_mass_out, stream=0))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn vp_forward<'py>(
    py: Python<'py>,
    e: &Bound<'py, PyAny>,
    c: &Bound<'py, PyAny>,
    bias: Option<&Bound<'py, PyAny>>,
    targets: &Bound<'py, PyAny>,
    opts: &Bound<'py, PyDict>,
    comm: &Bound<'py, PyAny>,
    vocab_size: usize,
    start: usize,
    loss_out: &Bound<'py, PyAny>,
    lse_out: &Bound<'py, PyAny>,
    rest_mass_out: &Bound<'py, PyAny>,
    stream: usize,
) -> PyResult<Bound<'py, PyDict>> {
    let o = options(opts)?;
    let inp = InputArgs::read(py, e, c, bias, targets)?;
    let outs = ForwardArgs::read(py, [loss_out, lse_out, rest_mass_out], [None, None])?;
    let comm = PyComm::new(comm)?;
    let stats = guarded(py, || {
        let placed = super::device_of(&[inp.tensors(), outs.tensors()].concat())
            .and_then(|device| Ok((device, shard_of(&inp.c, vocab_size, start)?)));
        let (device, shard) = placed.map_err(|e| failed::forward(&comm, &inp, &o, e))?;
        match device {
            #[cfg(feature = "cuda")]
            Device::Cuda => {
                // SAFETY: every RawTensor was read by `raw` from a CUDA tensor of one device
                // that the caller holds for the whole call, and `stream` is torch's current
                // stream of that device (the package passes it); inputs are only read and the
                // outputs, fresh tensors of this call, only written, all on that stream.
                unsafe { cuda::forward(cuda_stream(&inp, stream), &comm, shard, &inp, &outs, &o) }
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda => {
                let _ = stream;
                Err(super::cuda_missing())
            }
            Device::Cpu => {
                // SAFETY: every RawTensor was read by `raw` from a CPU tensor the caller holds
                // for the whole call; inputs are only read and the outputs, fresh tensors the
                // package allocated for this call, are only written here (so is the write
                // below).
                let views = unsafe { inp.views()? };
                let fwd = RankDriver::from_shard(&comm, shard).forward(&views.inputs(), &o)?;
                // SAFETY: as above.
                unsafe { outs.write(&fwd.output)? };
                Ok(fwd.shard_stats)
            }
        }
    })?;
    stats_dict(py, &stats)
}

/// Vocabulary-parallel backward of this rank from [`vp_forward`]'s lse and `1 − p_y`: writes
/// this shard's `d_c` (`[rows of c, D]`, padding rows 0) and `d_bias`, and the whole `d_e`
/// (summed over the ranks: the same on every rank) into the output tensors given (`None`: not
/// computed; every rank must ask for the same gradients); returns the call's statistics (tiles
/// and entries summed over the ranks, the dropped mass per row summed over the shards).
/// `d_loss`: a scalar f32 tensor (mean, sum) or `[N]` f32 (none); `d_lse`: `[N]` f32 or None.
///
/// Devices and errors: as [`vp_forward`]; `VocabParallel(PeerFailed)` when another rank's
/// backward failed.
#[pyfunction]
#[pyo3(signature = (e, c, bias, targets, opts, comm, vocab_size, start, lse, rest_mass, d_loss, d_lse=None, d_e_out=None, d_c_out=None, d_bias_out=None, stream=0))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn vp_backward<'py>(
    py: Python<'py>,
    e: &Bound<'py, PyAny>,
    c: &Bound<'py, PyAny>,
    bias: Option<&Bound<'py, PyAny>>,
    targets: &Bound<'py, PyAny>,
    opts: &Bound<'py, PyDict>,
    comm: &Bound<'py, PyAny>,
    vocab_size: usize,
    start: usize,
    lse: &Bound<'py, PyAny>,
    rest_mass: &Bound<'py, PyAny>,
    d_loss: &Bound<'py, PyAny>,
    d_lse: Option<&Bound<'py, PyAny>>,
    d_e_out: Option<&Bound<'py, PyAny>>,
    d_c_out: Option<&Bound<'py, PyAny>>,
    d_bias_out: Option<&Bound<'py, PyAny>>,
    stream: usize,
) -> PyResult<Bound<'py, PyDict>> {
    let mut o = options(opts)?;
    let inp = InputArgs::read(py, e, c, bias, targets)?;
    let sv = SavedArgs::read(py, [lse, rest_mass, d_loss], d_lse)?;
    let grads = GradArgs::read(py, [d_e_out, d_c_out, d_bias_out])?;
    grads.ask(&mut o);
    let comm = PyComm::new(comm)?;
    let stats = guarded(py, || {
        let placed = super::device_of(&[inp.tensors(), sv.tensors(), grads.tensors()].concat())
            .and_then(|device| Ok((device, shard_of(&inp.c, vocab_size, start)?)));
        let (device, shard) = placed.map_err(|e| failed::backward(&comm, &inp, &sv, &o, e))?;
        match device {
            #[cfg(feature = "cuda")]
            Device::Cuda => {
                // SAFETY: as in `vp_forward`'s CUDA arm.
                unsafe {
                    cuda::backward(
                        cuda_stream(&inp, stream),
                        &comm,
                        shard,
                        &inp,
                        &sv,
                        &grads,
                        &o,
                    )
                }
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda => {
                let _ = stream;
                Err(super::cuda_missing())
            }
            Device::Cpu => {
                // SAFETY: as in `vp_forward`'s CPU arm (so is the write below).
                let (views, saved) = unsafe { (inp.views()?, sv.views()?) };
                let out = RankDriver::from_shard(&comm, shard).backward(
                    &views.inputs(),
                    &o,
                    saved.saved(),
                    &saved.upstream(&o, false)?,
                )?;
                // SAFETY: as above.
                unsafe { grads.write([&out.d_e, &out.d_c, &out.d_bias])? };
                Ok(out.stats)
            }
        }
    })?;
    stats_dict(py, &stats)
}
